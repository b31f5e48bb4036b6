"""Rewards of one's own that tests run through `drpo train` by import path (``tests.reward_fixtures:NAME``:
the rollout workers find the tests package from the run's working directory, the repository root)."""

from __future__ import annotations

from rollout.rewards import LiteralNumberReward

_LITERAL = LiteralNumberReward()


def correct_and_length(sample, length_weight: float = 0.0):
    """The literal comparison as component ``correct``, plus ``length_weight`` times the response's
    token count as component ``length`` (so a test sees its kwargs arrive)."""
    correct = _LITERAL(sample).score
    return {"score": correct, "components": {"correct": correct, "length": length_weight * len(sample.response_ids)}}


def always_raises(sample):
    raise KeyError(f"no rubric for {sample.problem_id}")
