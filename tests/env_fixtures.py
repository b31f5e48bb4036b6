"""Environments of one's own that tests load by import path (``tests.env_fixtures:NAME``), as a user's
module outside the drpo package would be."""

from __future__ import annotations

import time

from rollout.environment import Environment, StepResult


class Scripted(Environment):
    """Answers every model turn with the same observation (a word that tokenizes differently alone and
    inside longer text) until ``turns`` model turns have run, with a reward of 0.25 per step."""

    def __init__(self, turns: int = 2, observation: str = "hello there 42", reward: float = 0.25):
        super().__init__()
        self.turns, self.observation, self.reward, self.seen = turns, observation, reward, 0

    def step(self, response: str) -> StepResult:
        self.seen += 1
        if self.seen >= self.turns:
            return StepResult(done=True, reward=self.reward)
        return StepResult(messages=[{"role": "user", "content": self.observation}], reward=self.reward)


class AsyncScripted(Scripted):
    """The same as a coroutine: step is ``async def``."""

    async def step(self, response: str) -> StepResult:  # type: ignore[override]
        return Scripted.step(self, response)


class Raises(Environment):
    """Fails every episode at its first step."""

    def step(self, response: str) -> StepResult:
        raise KeyError("no such state")


class Slow(Environment):
    """Takes ``seconds`` per step (past a short step_timeout_s)."""

    def __init__(self, seconds: float = 5.0):
        super().__init__()
        self.seconds = seconds

    def step(self, response: str) -> StepResult:
        time.sleep(self.seconds)
        return StepResult(done=True)
