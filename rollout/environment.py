"""Environments: multi-turn episodes in which the model's turns alternate with an environment's.

An episode starts from a dataset problem: ``reset(problem)`` gives the opening messages (None: the
problem's own chat messages), then after every model turn ``step(response)`` answers with
observation messages (a tool's result, a user's reply, a checker's verdict), an optional reward
and whether the episode is over. One instance serves one episode, inside the rollout worker; a
user's class is loaded by import path (``rollout.environment: {path: "package.module:Class",
kwargs: {...}}``). ``step`` may be a coroutine function (it is run to completion in its own loop).

Token-in, token-out (rollout/episodes.py): the episode's ids are exactly the engine's sampled ids
plus the ids of the environment's messages, rendered alone by the chat template and appended; the
conversation is never re-tokenized. The model's tokens carry mu and their policy version and are
trained; the environment's are context only (loss mask 0).

Rewards: the configured reward (``rollout.reward``) scores the episode's last model turn (its
``response``; the whole transcript is the reward input's ``messages``); the rewards ``step``
returns are summed and added to it for training (``RewardResult.shaping``, logged as the
``environment`` component), so the group's advantage is computed on outcome + environment reward
and every model token of the episode carries its episode's advantage.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
from dataclasses import dataclass, field
from typing import Any

from rollout.tasks import Problem
from rollout.user_code import load


@dataclass
class StepResult:
    """What the environment answers to one model turn."""

    messages: list[dict] = field(default_factory=list)
    """Messages appended to the conversation ({role, content}; role ``tool`` or ``user`` as the chat
    template knows them); empty when the episode ends."""
    reward: float | None = None
    """A reward for this turn (None: none); summed over the episode and added to the outcome reward."""
    done: bool = False
    """The episode is over (the model's last turn stands as its answer)."""
    tool_calls: int = 0
    """Tool calls this turn made (counted in ``episode/tool_calls``)."""
    tool_errors: int = 0
    """Of those, how many failed (the error went back to the model as the tool's message)."""


class Environment:
    """One episode's environment. Subclass it and override ``step`` (and ``reset`` to open with
    messages other than the problem's own); keyword arguments come from ``rollout.environment.kwargs``."""

    template_tools: bool = False
    """Whether this run's chat template describes tools itself (its ``tools=``, as Qwen's does); the
    episode runner sets it before ``reset``, so an environment can leave the tools out of its own
    messages and return them from ``tools`` instead."""

    def __init__(self, **kwargs: Any):
        self.kwargs = kwargs

    def reset(self, problem: Problem) -> list[dict] | None:
        """The opening messages of an episode on ``problem`` (None: the problem's chat messages)."""
        return None

    def tools(self) -> list[dict] | None:
        """JSON schemas of the tools the chat template should describe in the opening prompt (asked
        after ``reset``, and only when ``template_tools``); None: none."""
        return None

    def step(self, response: str) -> StepResult:
        """The environment's answer to the model's turn ``response`` (its text, special tokens skipped)."""
        raise NotImplementedError

    def close(self) -> None:
        """Release what the episode held."""


class EnvironmentFailed(RuntimeError):
    """An environment raised, returned something that is not a StepResult, or ran past its time."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason
        """error | timeout | invalid (rollout.rewards.FAILURES)."""


def load_environment(path: str) -> type:
    """The class at ``package.module:Class`` on this process's path; a clear error naming what is missing."""
    return load(path, "rollout.environment.path", lambda c: inspect.isclass(c) and callable(getattr(c, "step", None)), "class with a step method")


class Episodes:
    """Builds one environment per episode and runs its calls under a time bound."""

    def __init__(self, path: str, kwargs: dict, timeout_s: float):
        self.path, self.kwargs, self.timeout_s = path, dict(kwargs), timeout_s
        self.cls = load_environment(path)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="drpo-env")

    def new(self) -> Any:
        return self.cls(**self.kwargs)

    def call(self, fn, *args) -> Any:
        """``fn(*args)`` (a coroutine function is run in its own event loop) within ``timeout_s``;
        raises EnvironmentFailed naming the environment on an exception or a timeout. A timed-out
        call's thread is left to finish on its own (Python cannot stop it)."""
        def run():
            out = fn(*args)
            return asyncio.run(out) if inspect.iscoroutine(out) else out

        future = self._pool.submit(run)
        try:
            return future.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            raise EnvironmentFailed("timeout", f"environment {self.path}: {fn.__name__} took longer than {self.timeout_s:g} s") from None
        except Exception as err:  # noqa: BLE001 - a user's bug fails its episode, not the run
            raise EnvironmentFailed("error", f"environment {self.path}: {fn.__name__} raised {type(err).__name__}: {err}") from err

    def step(self, env: Any, response: str) -> StepResult:
        out = self.call(env.step, response)
        if not isinstance(out, StepResult):
            raise EnvironmentFailed("invalid", f"environment {self.path}: step returned {type(out).__name__}, not a StepResult")
        bad = [m for m in out.messages if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str))]
        if bad:
            raise EnvironmentFailed("invalid", f"environment {self.path}: step returned a message that is not {{role, content}} text: {bad[0]!r}")
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
