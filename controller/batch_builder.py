"""The batch builder the Controller owns: which groups may train, and the TrainBatch they become.

Runs on the records any backend returns (rollout/records.py), so a simulated run builds its
batches with exactly this code. The version lag is computed here once, per token (learner version
at consumption minus the version that sampled the token); a group's lag is the largest of its
tokens', which the staleness bound is checked against.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from controller.staleness import LAG_BINS
from learner.batch import TrainBatch
from rollout.routing import NOT_ROUTED
from objectives.advantages import compute_advantages
from objectives.config import AdvantageConfig
from rollout.records import Group


@dataclass(frozen=True)
class Batch:
    """A built batch: the learner's tensors and what the controller records about it."""

    train: TrainBatch
    lags: tuple[int, ...]
    """Per group, in order: the largest version lag of its tokens."""
    metrics: dict[str, float]
    """staleness/token_lag_hist/bin_i: response tokens per version lag (last bin: that lag or more);
    staleness/spanning_responses: responses whose tokens came from more than one policy version
    (a weight update landed while they were generated)."""


class BatchBuilder:
    def __init__(self, advantages: AdvantageConfig, topk: int = 0, pad_id: int = 0):
        """Use ``build``."""
        self.advantages, self.topk, self.pad_id = advantages, topk, pad_id

    @classmethod
    def build(cls, config: AdvantageConfig, *, topk: int = 0, pad_id: int = 0) -> "BatchBuilder":
        """Batches with advantages as ``config`` estimates them; ``topk``: K of the engine top-K
        log-probs the objective needs (0: none are batched); ``pad_id``: the padding token."""
        AdvantageConfig.expect(config, "BatchBuilder")
        return cls(config, topk, pad_id)

    def rejects(self, group: Group) -> str | None:
        """Why a finished (not failed) group is not trained on, or None: with zero-variance
        filtering, a group whose rewards are all equal has zero advantage everywhere."""
        rewards = group.rewards
        if self.advantages.filter_zero_variance and max(rewards) == min(rewards):
            return f"all rewards {rewards[0]:g}"
        return None

    def batch(self, groups: list[Group], version: int) -> Batch:
        """Rows are prompt + response (right-padded), in group order; every group must hold the same n."""
        sizes = {len(g.samples) for g in groups}
        if len(sizes) != 1 or 0 in sizes:
            raise ValueError(f"groups must all hold the same non-zero number of samples, got sizes {sorted(sizes)}")
        rewards = torch.tensor([g.rewards for g in groups], dtype=torch.float32)
        seq_adv = compute_advantages(rewards, self.advantages).flatten()
        completions = [s.completion for g in groups for s in g.samples]
        rows = completion_batch(completions, self.pad_id)
        mask = rows.response_mask
        n, width = mask.shape
        lag = torch.zeros((n, width), dtype=torch.long)
        context_lag = torch.zeros((n, width), dtype=torch.long)
        top_ids = torch.zeros((n, width, self.topk), dtype=torch.long) if self.topk else None
        top_logp = torch.zeros((n, width, self.topk)) if self.topk else None
        for i, c in enumerate(completions):
            p, r = len(c.prompt_ids), len(c.response_ids)
            lag[i, p : p + r] = version - c.versions
            context_lag[i, p : p + r] = version - c.prompt_version
            if self.topk and r:
                if c.topk_ids is None or c.topk_ids.shape != (r, self.topk):
                    raise ValueError(f"a sample has no engine top-{self.topk} log-probs (got {None if c.topk_ids is None else tuple(c.topk_ids.shape)})")
                top_ids[i, p : p + r], top_logp[i, p : p + r] = c.topk_ids, c.topk_logp.float()
        per_group = torch.where(mask, lag, -1).amax(dim=1).view(len(groups), -1).amax(dim=1)
        counts = lag[mask].clamp(max=LAG_BINS - 1).bincount(minlength=LAG_BINS).tolist()
        train = replace(
            rows, advantages=seq_adv[:, None] * mask, version_lag=lag, context_lag=context_lag, rollout_topk_ids=top_ids, rollout_topk_logp=top_logp, version=version,
        )
        spanning = sum(len(c.versions) > 0 and bool(c.versions.min() != c.versions.max()) for c in completions)
        metrics = {f"staleness/token_lag_hist/bin_{i}": float(c) for i, c in enumerate(counts)}
        metrics |= episode_metrics(completions)
        return Batch(train, tuple(int(v) for v in per_group), {**metrics, "staleness/spanning_responses": float(spanning)})


TRUNCATIONS = ("max_turns", "tokens")
"""Why a budget cut an episode (rollout.environment: max_turns, max_episode_tokens)."""


def episode_metrics(completions) -> dict[str, float]:
    """Multi-turn episodes among ``completions`` (none: no metrics): means per episode of model turns,
    tool calls, tool errors, environment seconds and environment reward; the share of response
    tokens the environment inserted (context only); the share of episodes each budget cut."""
    episodes = [c.episode for c in completions if c.episode is not None]
    if not episodes:
        return {}
    n = len(episodes)
    tokens = sum(len(c.response_ids) for c in completions if c.episode is not None)
    inserted = tokens - sum(c.model_tokens for c in completions if c.episode is not None)
    return {
        "episode/turns_mean": sum(e.turns for e in episodes) / n, "episode/turns_max": float(max(e.turns for e in episodes)),
        "episode/tool_calls_mean": sum(e.tool_calls for e in episodes) / n, "episode/tool_errors_mean": sum(e.tool_errors for e in episodes) / n,
        "episode/environment_seconds_mean": sum(e.environment_seconds for e in episodes) / n,
        "episode/environment_reward_mean": sum(e.environment_reward for e in episodes) / n,
        "episode/environment_token_frac": inserted / max(1, tokens),
        **{f"episode/truncated/{why}": sum(e.truncated == why for e in episodes) / n for why in TRUNCATIONS},
    }


def completion_batch(completions, pad_id: int = 0) -> TrainBatch:
    """Completions as TrainBatch rows (prompt + response, right-padded with ``pad_id``): response
    mask, mu, the engine's routing where every sample has it; zero advantages (BatchBuilder.build
    adds advantages, lags and top-K)."""
    n, width = len(completions), max(len(c.prompt_ids) + len(c.response_ids) for c in completions)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.bool)
    rollout_logp = torch.zeros((n, width))
    for i, c in enumerate(completions):
        p, r = len(c.prompt_ids), len(c.response_ids)
        input_ids[i, :p] = c.prompt_ids
        input_ids[i, p : p + r] = c.response_ids
        mask[i, p : p + r] = True if c.loss_mask is None else c.loss_mask  # an environment's tokens: context only
        rollout_logp[i, p : p + r] = c.rollout_logp.float()
    return TrainBatch(input_ids, mask, rollout_logp, torch.zeros((n, width)), routed_experts=_routing(completions, width))


def _routing(completions, width: int) -> torch.Tensor | None:
    """[n, width, layers, k] the engine's expert ids per position (-1: not routed, padding), when
    every sample carries them (an MoE engine that records routing); else None."""
    routed = [c.routed_experts for c in completions]
    if not routed or any(r is None for r in routed):
        return None
    out = torch.full((len(routed), width, *routed[0].shape[1:]), NOT_ROUTED, dtype=torch.int16)  # small: it travels to every rank
    for i, (c, r) in enumerate(zip(completions, routed)):
        if r.shape[0] != len(c.prompt_ids) + len(c.response_ids) or r.shape[1:] != routed[0].shape[1:]:
            raise ValueError(f"a sample's routed experts have shape {tuple(r.shape)} for {len(c.prompt_ids)} + {len(c.response_ids)} tokens")
        out[i, : r.shape[0]] = r
    return out
