"""Group records -> TrainBatch (controller/batch_builder.py): token alignment, advantages, version lag, top-K, filtering."""

from __future__ import annotations

import pytest
import torch

from controller.batch_builder import BatchBuilder
from objectives.config import AdvantageConfig
from rollout.engine import Completion
from rollout.records import Group, Sample, TrainTicket
from rollout.rewards import RewardResult


def completion(prompt, response, logp, versions):
    return Completion(torch.tensor(prompt), torch.tensor(response), torch.tensor(logp), torch.tensor(versions), "stop", min(versions, default=0))


def group(pid, completions, scores):
    samples = tuple(Sample(c, "t", RewardResult(s, None, "correct" if s else "wrong")) for c, s in zip(completions, scores))
    return Group(TrainTicket(0, pid), 0, samples, 0, 0.1)


def test_rows_align_tokens_mu_advantages_and_lag():
    g1 = group("a", [completion([5, 6, 7], [8, 9], [-0.1, -0.2], [3, 4]), completion([5, 6, 7], [10], [-0.3], [4])], [1.0, 0.0])
    g2 = group("b", [completion([5], [11, 12, 13], [-1.0, -2.0, -3.0], [2, 2, 3]), completion([5], [], [], [])], [0.0, 1.0])
    built = BatchBuilder.build(AdvantageConfig(estimator="dr_grpo"), pad_id=0).batch([g1, g2], version=4)
    batch = built.train
    assert batch.version == 4 and built.lags == (1, 2)  # a group's lag is its oldest token's
    assert [built.metrics[f"staleness/token_lag_hist/bin_{i}"] for i in range(3)] == [2, 2, 2]
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
    # the prompt's version (here the first token's) for every token: 4 - 3 where an update landed mid-request
    assert batch.context_lag[0, 3:].tolist() == [1, 1] and batch.context_lag[1, 3:4].tolist() == [0] and batch.context_lag[2, 1:4].tolist() == [2, 2, 2]


def test_groups_of_different_sizes_are_rejected():
    g1 = group("a", [completion([1], [2], [-0.1], [0])], [1.0])
    g2 = group("b", [completion([1], [2], [-0.1], [0])] * 2, [1.0, 0.0])
    with pytest.raises(ValueError, match="same non-zero number of samples"):
        BatchBuilder.build(AdvantageConfig()).batch([g1, g2], 0)


def test_engine_top_k_travels_into_the_batch_aligned_with_its_tokens():
    c = Completion(torch.tensor([5, 6]), torch.tensor([7, 8]), torch.tensor([-0.1, -0.2]), torch.tensor([0, 0]), "stop", 0,
                   topk_ids=torch.tensor([[7, 1], [8, 2]]), topk_logp=torch.tensor([[-0.1, -3.0], [-0.2, -4.0]]))
    batch = BatchBuilder.build(AdvantageConfig(), topk=2).batch([group("a", [c, c], [1.0, 0.0])], version=0).train
    assert batch.topk == 2 and batch.rollout_topk_ids.shape == (2, 4, 2)
    assert batch.rollout_topk_ids[0, 2:].tolist() == [[7, 1], [8, 2]] and batch.rollout_topk_ids[0, :2].abs().sum() == 0
    assert batch.rollout_topk_logp[1, 3].tolist() == pytest.approx([-0.2, -4.0])
    no_topk = group("b", [completion([5], [7], [-0.1], [0])] * 2, [1.0, 0.0])
    with pytest.raises(ValueError, match="no engine top-2 log-probs"):
        BatchBuilder.build(AdvantageConfig(), topk=2).batch([no_topk], version=0)


def test_zero_variance_groups_are_rejected_with_a_reason_only_when_filtering():
    same = group("a", [completion([1], [2], [-0.1], [0])] * 2, [1.0, 1.0])
    mixed = group("b", [completion([1], [2], [-0.1], [0])] * 2, [1.0, 0.0])
    assert BatchBuilder.build(AdvantageConfig(filter_zero_variance=True)).rejects(same) == "all rewards 1"
    assert BatchBuilder.build(AdvantageConfig(filter_zero_variance=True)).rejects(mixed) is None
    assert BatchBuilder.build(AdvantageConfig(filter_zero_variance=False)).rejects(same) is None


def test_a_group_without_samples_needs_a_reason():
    with pytest.raises(ValueError, match="neither samples nor an error"):
        Group(TrainTicket(0, "a"), 0, (), 0, 0.0)
