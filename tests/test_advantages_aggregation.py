"""Advantage estimators, zero-variance filtering and loss aggregation, checked by hand."""

from __future__ import annotations

import pytest
import torch

from objectives import aggregate
from objectives.advantages import compute_advantages, dr_grpo, grpo, nonzero_variance_groups, reinforce_pp, rloo, to_tokens
from objectives.config import AdvantageConfig, AggregationConfig

REWARDS = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])


def test_grpo_normalizes_by_group_std_and_dr_grpo_does_not():
    a = grpo(REWARDS, std_eps=0.0)
    # group 0: mean .5, unbiased std sqrt(1/3)
    s = (1 / 3) ** 0.5
    torch.testing.assert_close(a[0], torch.tensor([0.5, -0.5, -0.5, 0.5]) / s)
    torch.testing.assert_close(dr_grpo(REWARDS)[1], torch.tensor([0.25, 0.25, 0.25, -0.75]))
    assert torch.equal(dr_grpo(REWARDS)[2], torch.zeros(4))
    assert torch.equal(grpo(REWARDS)[2], torch.zeros(4))  # eps keeps an all-equal group finite


def test_rloo_is_leave_one_out_baseline():
    a = rloo(REWARDS)
    for g in range(3):
        for i in range(4):
            others = torch.cat([REWARDS[g, :i], REWARDS[g, i + 1 :]])
            assert a[g, i].item() == pytest.approx((REWARDS[g, i] - others.mean()).item())


def test_reinforce_pp_normalizes_over_the_batch():
    a = reinforce_pp(REWARDS, std_eps=0.0)
    assert a.mean().item() == pytest.approx(0.0, abs=1e-6)
    assert a.std().item() == pytest.approx(1.0)
    centered = REWARDS - REWARDS.mean(-1, keepdim=True)
    torch.testing.assert_close(a, (centered - centered.mean()) / centered.std())


def test_compute_advantages_dispatches_and_rejects_bad_rewards():
    assert torch.equal(compute_advantages(REWARDS, AdvantageConfig(estimator="rloo")), rloo(REWARDS))
    assert torch.equal(compute_advantages(REWARDS, AdvantageConfig(estimator="dr_grpo")), dr_grpo(REWARDS))
    with pytest.raises(ValueError, match="NaN or inf"):
        compute_advantages(torch.tensor([[1.0, float("nan")]]), AdvantageConfig())
    with pytest.raises(ValueError, match="groups, samples"):
        compute_advantages(torch.ones(4), AdvantageConfig())


def test_zero_variance_groups_are_filtered():
    assert nonzero_variance_groups(REWARDS).tolist() == [True, True, False]


def test_to_tokens_broadcasts_over_response_mask():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    assert to_tokens(torch.tensor([2.0, -1.0]), mask).tolist() == [[2.0, 2.0, 0.0], [-1.0, 0.0, 0.0]]


LOSS = torch.tensor([[1.0, 2.0, 3.0, 100.0], [4.0, 5.0, 200.0, 300.0], [7.0, 7.0, 7.0, 7.0]])
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)


@pytest.mark.parametrize(
    "mode,horizon,expected",
    [
        ("token-mean", None, (1 + 2 + 3 + 4 + 5) / 5),
        ("seq-mean-token-sum", None, (6 + 9) / 2),
        ("seq-mean-token-mean", None, (2 + 4.5) / 2),
        ("seq-mean-token-sum-norm", 10, (0.6 + 0.9) / 2),
    ],
)
def test_aggregation_modes_by_hand(mode, horizon, expected):
    assert aggregate(LOSS, MASK, mode, horizon=horizon).item() == pytest.approx(expected)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_micro_batches_with_global_normalizer_equal_the_full_batch(mode):
    full = aggregate(LOSS, MASK, mode)
    normalizer = MASK.sum() if mode == "token-mean" else (MASK.sum(-1) > 0).sum()
    parts = sum(aggregate(LOSS[i : i + 1], MASK[i : i + 1], mode, normalizer=normalizer) for i in range(3))
    assert parts.item() == pytest.approx(full.item())


def test_aggregation_rejects_bad_arguments():
    with pytest.raises(ValueError, match="unknown aggregation mode"):
        aggregate(LOSS, MASK, "token-sum")
    with pytest.raises(ValueError, match="horizon"):
        aggregate(LOSS, MASK, "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        aggregate(LOSS[0], MASK[0], "token-mean")
    with pytest.raises(ValueError, match="horizon is required"):
        AggregationConfig(mode="seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="only used by"):
        AggregationConfig(mode="token-mean", horizon=10)
