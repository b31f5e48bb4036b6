"""Grading a rollout: checking an engine's completions and scoring them into a ``Group``.

A completion the engine got wrong (lengths that disagree, a non-finite mu, missing top-K) fails its
group with the reason; otherwise the group's samples (each with its decoded response) are scored by
the reward (rollout/reward_functions.py: every kind behind one ``score``), then given the over-long
shaping of ``rollout.scoring``. A sample the reward could not score (it raised, timed out, answered
no usable score, its service was unreachable) scores 0 (``on_error: zero``) or fails its group
(``drop_group``); a group whose every sample failed fails either way, with the reward's name and
first error, so a broken reward stops the run (train.max_failures_in_a_row) instead of training on
zeros. Testable without Ray or an engine: it takes the responses already decoded.
"""

from __future__ import annotations

import dataclasses
import time
import torch

from rollout.chaos import Chaos
from rollout.config import RolloutConfig, ScoringConfig
from rollout.engine import Completion
from rollout.records import Group, Sample, Ticket
from rollout.reward_functions import Reward, build_reward, failure
from rollout.rewards import RewardInput, RewardResult, overlong_shaping
from rollout.tasks import Problem


def completion_problem(c: Completion, topk: int) -> str | None:
    """What is wrong with an engine's completion, or None: per-token tensors must match the response
    length, mu must be finite, and top-K must be there (with K columns) when it was asked for."""
    length = len(c.response_ids)
    if len(c.rollout_logp) != length or len(c.versions) != length:
        return f"engine returned {len(c.rollout_logp)} log-probs and {len(c.versions)} versions for {length} tokens"
    if not torch.isfinite(c.rollout_logp).all():
        return "engine returned NaN or inf behaviour log-probs"
    if length and int(c.versions.min()) < c.prompt_version:
        return f"engine stamped a token with version {int(c.versions.min())}, older than its prompt's {c.prompt_version}"
    if topk and length:  # an empty response has nothing to report (engines may give None)
        if c.topk_ids is None or c.topk_logp is None:
            return f"engine returned no top-{topk} log-probs although they were asked for"
        if tuple(c.topk_ids.shape) != (length, topk) or tuple(c.topk_logp.shape) != (length, topk):
            return f"engine returned top-K of shape {tuple(c.topk_ids.shape)}, expected ({length}, {topk})"
    return None


class Grader:
    """Scores completions into groups with one reward and one ``rollout.scoring``."""

    def __init__(self, reward: Reward, scoring: ScoringConfig, max_new_tokens: int, worker_id: int, chaos: Chaos):
        """Use ``build``."""
        self.reward, self.scoring = reward, scoring
        self.max_new_tokens, self.worker_id = max_new_tokens, worker_id
        self.chaos = chaos

    @classmethod
    def build(cls, config: RolloutConfig, *, worker_id: int = 0, chaos: Chaos | None = None) -> "Grader":
        """Worker ``worker_id``'s grader: ``config.reward`` scored as ``config.scoring`` says, over-long
        shaping against ``config.max_new_tokens``; ``chaos``: the worker's fault injection (none by default)."""
        RolloutConfig.expect(config, "Grader")
        return cls(build_reward(config.reward, config.scoring), config.scoring, config.max_new_tokens, worker_id,
                   chaos or Chaos.build(None, worker_id=worker_id))

    def grade(
        self, ticket: Ticket, problem: Problem, completions: list[Completion], texts: list[str], version: int, seconds: float,
        topk: int,
    ) -> Group:
        """``completions`` of ``problem`` and their responses decoded (``texts``) into a group."""
        completions = self.chaos.corrupt(completions)
        for c in completions:
            wrong = completion_problem(c, topk)
            if wrong is not None:
                return Group(ticket, self.worker_id, (), version, seconds, error=wrong)
        if not any(len(c.response_ids) for c in completions):
            return Group(ticket, self.worker_id, (), version, seconds, error="every response is empty")
        texts = [t if len(c.response_ids) else "" for c, t in zip(completions, texts)]  # chaos may have emptied one
        started = time.perf_counter()
        broken = [c.episode.error if c.episode is not None else None for c in completions]  # an environment failed the episode
        scored = iter(self._score([reward_input(problem, c, t) for c, t, b in zip(completions, texts, broken) if b is None]))
        results = [failure(*b) if b is not None else _with_environment(next(scored), c) for c, b in zip(completions, broken)]
        scoring = time.perf_counter() - started
        failed = [r for r in results if r.failed]
        if failed and (len(failed) == len(results) or self.reward.config.on_error == "drop_group"):
            every = "every sample" if len(failed) == len(results) else f"{len(failed)} of {len(results)} samples"
            who = "its environment" if all(b is not None for b in broken) else f"reward {self.reward.name}"
            error = f"{who} failed on {every} ({failed[0].reason}): {failed[0].detail}"
            return Group(ticket, self.worker_id, (), version, seconds + scoring, error=error, scoring_seconds=scoring, reward_failures=tuple(failed))
        samples = tuple(Sample(c, t, self._shaped(c, r)) for c, t, r in zip(completions, texts, results))
        return Group(ticket, self.worker_id, samples, version, seconds + scoring, scoring_seconds=scoring)

    def _score(self, inputs: list[RewardInput]) -> list[RewardResult]:
        """The reward's results, with chaos's injected failures in place of the samples it picks."""
        injected = [self.chaos.reward_fails() for _ in inputs]
        kept = [x for x, bad in zip(inputs, injected) if not bad]
        scored = iter(self.reward.score(kept) if kept else [])
        return [failure("error", "RuntimeError: chaos: injected reward failure") if bad else next(scored) for bad in injected]

    def _shaped(self, c: Completion, result: RewardResult) -> RewardResult:
        """The over-long shaping added to a verdict (training groups and evaluation alike; evaluation
        reads correctness only). Not for an episode, whose budget is rollout.environment's."""
        if c.episode is not None:
            return result
        shaping = overlong_shaping(
            len(c.response_ids), self.max_new_tokens, c.finish_reason == "length",
            self.scoring.overlong_penalty, self.scoring.overlong_buffer,
        )
        return dataclasses.replace(result, shaping=result.shaping + shaping) if shaping else result

    def close(self) -> None:
        self.reward.close()


def _with_environment(result: RewardResult, c: Completion) -> RewardResult:
    """An episode's reward: the outcome reward plus what its environment's steps gave (as shaping,
    logged as the ``environment`` component); correctness stays the outcome's."""
    if c.episode is None or result.failed or not c.episode.environment_reward:
        return result
    extra = c.episode.environment_reward
    return dataclasses.replace(result, shaping=result.shaping + extra, components={**result.components, "environment": extra})


def reward_input(problem: Problem, completion: Completion, text: str) -> RewardInput:
    """One sample as the reward sees it (an episode: its last model turn as ``response``, the whole
    conversation as ``messages``)."""
    messages = completion.episode.messages if completion.episode is not None else problem.chat_messages()
    return RewardInput(
        problem_id=problem.id, prompt=problem.prompt, messages=tuple(messages), response=text,
        response_ids=tuple(completion.response_ids.tolist()), finish_reason=completion.finish_reason,
        ground_truth=problem.ground_truth, metadata=dict(problem.metadata),
    )
