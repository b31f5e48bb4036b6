"""The grader and the chaos seam on their own, without Ray or an engine: completions in, a Group out."""

from __future__ import annotations

import torch

from rollout.chaos import Chaos
from rollout.config import ChaosConfig, RolloutConfig, ScoringConfig
from rollout.engine import Completion
from rollout.grader import Grader
from rollout.records import TrainTicket
from rollout.tasks import Problem

TEXTS = {1: "The answer is 42", 2: "41", 3: "42 and more"}


def completion(token: int, length: int = 3, finish: str = "stop", logp: float = -0.5) -> Completion:
    return Completion(torch.tensor([7, 8]), torch.full((length,), token), torch.full((length,), logp), torch.zeros(length, dtype=torch.long),
                      finish, 0)


def decode(ids: torch.Tensor) -> str:
    return TEXTS[int(ids[0])] if len(ids) else ""


def decoded(completions: list[Completion], decode=decode) -> tuple[list[Completion], list[str]]:
    """Completions with their responses decoded, as the generator hands them to the grader."""
    return completions, [decode(c.response_ids) for c in completions]


def test_a_group_is_scored_shaped_and_failed_only_for_bad_engine_output():
    grader = Grader.build(RolloutConfig(max_new_tokens=3, scoring=ScoringConfig(overlong_penalty=0.5)), worker_id=2)
    ticket, problem = TrainTicket(0, "p"), Problem("p", "What is 6*7?", "42")
    group = grader.grade(ticket, problem, *decoded([completion(1), completion(2), completion(3, finish="length")]), 0, 0.1, 0)
    assert group.error is None and group.worker == 2
    assert [s.reward.reason for s in group.samples] == ["correct", "wrong", "correct"]
    assert [s.reward.value for s in group.samples] == [1.0, 0.0, 0.5]  # cut at max_new_tokens: shaped, still correct
    bad = grader.grade(ticket, problem, *decoded([completion(1), completion(2, logp=float("nan"))]), 0, 0.1, 0)
    assert bad.error == "engine returned NaN or inf behaviour log-probs" and bad.samples == ()
    missing = grader.grade(ticket, problem, *decoded([completion(1)]), 0, 0.1, 2)
    assert missing.error == "engine returned no top-2 log-probs although they were asked for"


def test_chaos_is_one_seam_that_does_nothing_unless_configured():
    ticket, problem = TrainTicket(0, "p"), Problem("p", "q", "42")
    quiet = Chaos.build(None, worker_id=0)
    assert quiet.corrupt([completion(1)])[0].response_ids.tolist() == [1, 1, 1] and not quiet.reward_fails()
    failing = Grader.build(RolloutConfig(max_new_tokens=3), chaos=Chaos.build(ChaosConfig(reward_error_rate=1.0), worker_id=0))
    group = failing.grade(ticket, problem, *decoded([completion(1), completion(2)]), 0, 0.1, 0)
    # every sample's reward failed: the group fails naming the reward and its first error (never trained on zeros)
    assert group.samples == () and group.error == "reward literal failed on every sample (error): RuntimeError: chaos: injected reward failure"
    assert [(r.reason, r.score) for r in group.reward_errors] == [("error", 0.0)] * 2
    emptied = Grader.build(RolloutConfig(max_new_tokens=3), chaos=Chaos.build(ChaosConfig(empty_response_rate=1.0), worker_id=0))
    assert emptied.grade(ticket, problem, *decoded([completion(1)]), 0, 0.1, 0).error == "every response is empty"
