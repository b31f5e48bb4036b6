"""Scored groups -> TrainBatch: token alignment, advantages, version lag, the decoupled anchor."""

from __future__ import annotations

import math

import pytest
import torch

from controller.batch import build_train_batch, decoupled_anchor
from objectives.config import AdvantageConfig
from rollout.engine import Completion
from rollout.rewards import RewardResult
from rollout.tasks import Problem
from rollout.worker import ScoredGroup


def completion(prompt, response, logp, versions):
    return Completion(torch.tensor(prompt), torch.tensor(response), torch.tensor(logp), torch.tensor(versions), "stop")


def group(pid, completions, scores):
    rewards = [RewardResult(s, None, "correct" if s else "wrong") for s in scores]
    return ScoredGroup(Problem(pid, "q", "1"), completions, ["t"] * len(completions), rewards, 0.1)


def test_rows_align_tokens_mu_advantages_and_lag():
    g1 = group("a", [completion([5, 6, 7], [8, 9], [-0.1, -0.2], [3, 4]), completion([5, 6, 7], [10], [-0.3], [4])], [1.0, 0.0])
    g2 = group("b", [completion([5], [11, 12, 13], [-1.0, -2.0, -3.0], [2, 2, 3]), completion([5], [], [], [])], [0.0, 1.0])
    batch = build_train_batch([g1, g2], version=4, advantages=AdvantageConfig(estimator="dr_grpo"), pad_id=0)
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 9], [5, 6, 7, 10, 0], [5, 11, 12, 13, 0], [5, 0, 0, 0, 0]]
    assert batch.response_mask.tolist() == [
        [False, False, False, True, True], [False, False, False, True, False],
        [False, True, True, True, False], [False, False, False, False, False],
    ]
    assert batch.rollout_logp[0, 3:].tolist() == pytest.approx([-0.1, -0.2]) and batch.rollout_logp[2, 1:4].tolist() == pytest.approx([-1, -2, -3])
    # dr_grpo: reward minus the group mean, on every response token, 0 elsewhere
    assert batch.advantages[0].tolist() == [0, 0, 0, 0.5, 0.5] and batch.advantages[1].tolist() == [0, 0, 0, -0.5, 0]
    assert batch.advantages[2].tolist() == [0, -0.5, -0.5, -0.5, 0] and batch.advantages[3].abs().sum() == 0
    assert batch.version_lag[0, 3:].tolist() == [1, 0] and batch.version_lag[2, 1:4].tolist() == [2, 2, 1]


def test_groups_of_different_sizes_are_rejected():
    g1 = group("a", [completion([1], [2], [-0.1], [0])], [1.0])
    g2 = group("b", [completion([1], [2], [-0.1], [0])] * 2, [1.0, 0.0])
    with pytest.raises(ValueError, match="same non-zero number of completions"):
        build_train_batch([g1, g2], 0, AdvantageConfig())


def test_decoupled_anchor_moves_mu_into_a_capped_behaviour_weight():
    g = group("a", [completion([1], [2, 3], [-1.0, -2.0], [0, 0]), completion([1], [4, 5], [-0.5, -2.0], [0, 0])], [1.0, 0.0])
    batch = build_train_batch([g], 0, AdvantageConfig(estimator="dr_grpo"))
    proximal = torch.tensor([[0.0, -0.5, -2.0], [0.0, -0.5, 0.0]])  # pi_prox; position 0 is never scored
    anchored, mean_w = decoupled_anchor(batch, proximal, cap=2.0)
    assert torch.equal(anchored.rollout_logp, proximal)
    w = torch.tensor([[0.0, math.exp(0.5), 1.0], [0.0, 1.0, 2.0]])  # exp(prox - mu), the last one (e^2) capped at 2
    assert torch.allclose(anchored.advantages, batch.advantages * w)
    assert mean_w == pytest.approx(float(w[:, 1:].mean()))
