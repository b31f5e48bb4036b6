"""Grading a rollout: checking an engine's completions and scoring them into a ``Group``.

A completion the engine got wrong (lengths that disagree, a non-finite mu, missing top-K) fails its
group with the reason; otherwise each response is decoded, scored by the reward (a reward that
raises scores 0 with reason ``error``), and given the over-long shaping of ``rollout.scoring``.
Testable without Ray or an engine: it needs the tokenizer's ``decode`` only.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from rollout.chaos import Chaos
from rollout.config import RolloutConfig, ScoringConfig
from rollout.engine import Completion
from rollout.records import Group, Sample, Ticket
from rollout.rewards import LiteralNumberReward, MathVerifyReward, RewardResult, overlong_shaping
from rollout.tasks import Problem


def make_reward(name: str, scoring: ScoringConfig):
    """The reward function ``rollout.reward`` names, as ``rollout.scoring`` configures it."""
    if name == "literal":
        return LiteralNumberReward(scoring.require_marker)
    if name == "math_verify":
        return MathVerifyReward(scoring.verify_timeout_s, scoring.require_marker)
    raise ValueError(f"unknown reward {name!r}; expected 'literal' or 'math_verify'")


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

    def __init__(self, reward: Callable[[str, str], RewardResult], scoring: ScoringConfig, max_new_tokens: int, worker_id: int, chaos: Chaos):
        """Use ``build``; ``reward(text, ground_truth)`` is the reward function."""
        self.reward, self.scoring = reward, scoring
        self.max_new_tokens, self.worker_id = max_new_tokens, worker_id
        self.chaos = chaos

    @classmethod
    def build(cls, config: RolloutConfig, *, worker_id: int = 0, chaos: Chaos | None = None) -> "Grader":
        """Worker ``worker_id``'s grader: ``config.reward`` scored as ``config.scoring`` says, over-long
        shaping against ``config.max_new_tokens``; ``chaos``: the worker's fault injection (none by default)."""
        RolloutConfig.expect(config, "Grader")
        return cls(make_reward(config.reward, config.scoring), config.scoring, config.max_new_tokens, worker_id,
                   chaos or Chaos.build(None, worker_id=worker_id))

    def grade(
        self, ticket: Ticket, problem: Problem, completions: list[Completion], version: int, seconds: float, topk: int,
        decode: Callable[[torch.Tensor], str],
    ) -> Group:
        completions = self.chaos.corrupt(completions)
        for c in completions:
            wrong = completion_problem(c, topk)
            if wrong is not None:
                return Group(ticket, self.worker_id, (), version, seconds, error=wrong)
        if not any(len(c.response_ids) for c in completions):
            return Group(ticket, self.worker_id, (), version, seconds, error="every response is empty")
        texts = [decode(c.response_ids) for c in completions]
        samples = tuple(Sample(c, t, self._shaped(c, self._score(t, problem.ground_truth))) for c, t in zip(completions, texts))
        return Group(ticket, self.worker_id, samples, version, seconds)

    def _shaped(self, c: Completion, result: RewardResult) -> RewardResult:
        """The over-long shaping added to a verdict (training groups and evaluation alike; evaluation reads correctness only)."""
        shaping = overlong_shaping(
            len(c.response_ids), self.max_new_tokens, c.finish_reason == "length",
            self.scoring.overlong_penalty, self.scoring.overlong_buffer,
        )
        return dataclasses.replace(result, shaping=shaping) if shaping else result

    def _score(self, text: str, truth: str) -> RewardResult:
        try:
            if self.chaos.reward_fails():
                raise RuntimeError("chaos: injected reward failure")
            return self.reward(text, truth)
        except Exception as err:
            return RewardResult(0.0, None, "error", detail=type(err).__name__)

    def close(self) -> None:
        close = getattr(self.reward, "close", None)
        if close is not None:
            close()
