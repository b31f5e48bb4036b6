"""Turn scored groups into the learner's TrainBatch: advantages, padding, per-token version lag."""

from __future__ import annotations

import torch

from learner.learner import TrainBatch
from objectives.advantages import compute_advantages
from objectives.config import AdvantageConfig
from rollout.worker import ScoredGroup


def build_train_batch(groups: list[ScoredGroup], version: int, advantages: AdvantageConfig, pad_id: int = 0) -> TrainBatch:
    """Rows are prompt + response (right-padded), in group order; every group must have the same n.

    Advantages come from each group's rewards; the lag is ``version`` (the learner's, at
    consumption) minus the version that sampled each token."""
    sizes = {len(g.completions) for g in groups}
    if len(sizes) != 1 or 0 in sizes:
        raise ValueError(f"groups must all hold the same non-zero number of completions, got sizes {sorted(sizes)}")
    rewards = torch.tensor([g.scores for g in groups], dtype=torch.float32)
    seq_adv = compute_advantages(rewards, advantages).flatten()
    completions = [c for g in groups for c in g.completions]
    width = max(len(c.prompt_ids) + len(c.response_ids) for c in completions)
    n = len(completions)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.bool)
    rollout_logp = torch.zeros((n, width))
    lag = torch.zeros((n, width), dtype=torch.long)
    for i, c in enumerate(completions):
        p, r = len(c.prompt_ids), len(c.response_ids)
        input_ids[i, :p] = c.prompt_ids
        input_ids[i, p : p + r] = c.response_ids
        mask[i, p : p + r] = True
        rollout_logp[i, p : p + r] = c.rollout_logp.float()
        lag[i, p : p + r] = version - c.versions
    return TrainBatch(input_ids, mask, rollout_logp, seq_adv[:, None] * mask, lag)


def decoupled_anchor(batch: TrainBatch, proximal_logp: torch.Tensor, cap: float) -> tuple[TrainBatch, float]:
    """Decoupled objective (AReaL, arXiv 2505.24298): the learner's proximal_logp anchors the ratio and
    trust region, and mu enters only through the behaviour weight min(proximal/mu, cap) on the
    advantage. Exact for every registered objective, which are positively homogeneous in A.
    Returns the batch and the mean behaviour weight."""
    log_w = (proximal_logp - batch.rollout_logp).clamp(max=torch.log(torch.tensor(cap)).item())
    weight = torch.where(batch.response_mask, log_w.exp(), torch.zeros(()))
    anchored = TrainBatch(batch.input_ids, batch.response_mask, proximal_logp.float(), batch.advantages * weight, batch.version_lag)
    count = batch.response_mask.sum().clamp_min(1)
    return anchored, float(weight.sum() / count)
