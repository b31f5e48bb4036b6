"""TrainBatch: what the controller's batch builder hands the learner (torch only, no Megatron).

Data convention: every per-token tensor is aligned with ``input_ids`` [N, S] (prompt and response,
right-padded): position t holds the statistics of token input_ids[t], which the model predicts from
positions < t; position 0 is never scored. Top-K tensors add a last dimension K.

Three log-probs, each in its own field, never one standing in for another:
``rollout_logp`` is mu from the engine that sampled the token; ``proximal_logp`` is the learner's
own recomputation at the start of the step (decoupled anchor only, filled in by the learner); the
learner's current ``policy_logp`` is computed in the step and never stored here.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Iterator

import torch

_PER_TOKEN = ("response_mask", "rollout_logp", "advantages", "version_lag", "context_lag", "proximal_logp")
_TOP_K = ("rollout_topk_ids", "rollout_topk_logp", "proximal_topk_logp")


@dataclass(frozen=True)
class TrainBatch:
    """A batch of sequences to train on."""

    input_ids: torch.Tensor
    """[N, S] int64 prompt + response token ids, right-padded (any id at padding)."""
    response_mask: torch.Tensor
    """[N, S] bool, True at response tokens that count in the loss."""
    rollout_logp: torch.Tensor
    """[N, S] behaviour log-prob mu of each response token, from the engine that sampled it."""
    advantages: torch.Tensor
    """[N, S] advantage of each response token."""
    version_lag: torch.Tensor | None = None
    """[N, S] int64 learner version minus the version that sampled each token (optional): splits
    the gap metrics into numerics (lag 0) and staleness (lag >= 1)."""
    context_lag: torch.Tensor | None = None
    """[N, S] int64 learner version minus the version its prompt was submitted at (optional, with
    ``version_lag``; >= it). Larger than ``version_lag`` where an update landed mid-request: the
    token was sampled by newer weights attending to KV computed with older ones, so a lag-0 token's
    gap is not the engine's numerics alone (reported apart, as ``inflight``)."""
    rollout_topk_ids: torch.Tensor | None = None
    """[N, S, K] int64 ids of the engine's K most likely tokens at each position (Top-K objectives)."""
    rollout_topk_logp: torch.Tensor | None = None
    """[N, S, K] the engine's log-probs of those ids."""
    proximal_logp: torch.Tensor | None = None
    """[N, S] the learner's log-prob of each token before this step's updates (decoupled anchor)."""
    proximal_topk_logp: torch.Tensor | None = None
    """[N, S, K] the learner's log-probs, before this step's updates, of the engine's top-K ids."""
    routed_experts: torch.Tensor | None = None
    """[N, S, layers, k] int16 ids of the experts the engine routed each position to, per MoE layer
    (-1 where it routed nothing: the last token, padding); replayed with ``learner.routing_replay``."""
    version: int | None = None
    """The learner version the controller consumes the batch at (the lags count from it); the
    learner refuses a batch whose version is not its own. None: not checked (direct learner use)."""

    def __post_init__(self) -> None:
        shape = tuple(self.input_ids.shape)
        for name in _PER_TOKEN:
            t = getattr(self, name)
            if t is not None and tuple(t.shape) != shape:
                raise ValueError(f"TrainBatch.{name} has shape {tuple(t.shape)}, input_ids has {shape}")
        top = [getattr(self, name) for name in _TOP_K if getattr(self, name) is not None]
        if top and (len({tuple(t.shape) for t in top}) != 1 or tuple(top[0].shape[:-1]) != shape):
            raise ValueError(f"TrainBatch top-K tensors must all be {shape} + (K,), got {[tuple(t.shape) for t in top]}")
        if self.routed_experts is not None and (self.routed_experts.dim() != 4 or tuple(self.routed_experts.shape[:2]) != shape):
            raise ValueError(f"TrainBatch.routed_experts must be {shape} + (layers, k), got {tuple(self.routed_experts.shape)}")
        if (self.rollout_topk_ids is None) != (self.rollout_topk_logp is None):
            raise ValueError("TrainBatch.rollout_topk_ids and rollout_topk_logp come together")
        if self.response_mask.dtype != torch.bool:
            raise ValueError(f"TrainBatch.response_mask must be a bool tensor, got {self.response_mask.dtype}")
        if self.response_mask[:, 0].any():
            raise ValueError("TrainBatch.response_mask marks position 0, which has no context to predict it from")
        if not torch.isfinite(torch.where(self.response_mask, self.rollout_logp, 0.0)).all():
            raise ValueError("TrainBatch.rollout_logp has NaN or inf at response tokens (bad engine output)")

    @property
    def topk(self) -> int:
        """K of the engine's top-K tensors (0 when the batch has none)."""
        return 0 if self.rollout_topk_ids is None else self.rollout_topk_ids.shape[-1]

    def map(self, fn) -> "TrainBatch":
        """A TrainBatch of ``fn`` applied to every tensor field (slicing, device moves)."""
        return replace(self, **{f.name: fn(getattr(self, f.name)) for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)})

    def to(self, device: torch.device) -> "TrainBatch":
        return self.map(lambda t: t.to(device, non_blocking=True))

    def rows(self, start: int, stop: int) -> "TrainBatch":
        return self.map(lambda t: t[start:stop])

    def select(self, rows: list[int]) -> "TrainBatch":
        """The sequences at ``rows`` (a packed micro-batch's), in that order."""
        index = torch.as_tensor(rows, dtype=torch.long)
        return self.map(lambda t: t.index_select(0, index.to(t.device)))

    def micro_batches(self, size: int) -> Iterator["TrainBatch"]:
        for s in range(0, self.input_ids.shape[0], size):
            yield self.rows(s, s + size)

    def split(self, parts: int) -> list["TrainBatch"]:
        """``parts`` consecutive equal slices of the sequences (mini-batches, data-parallel shards)."""
        n = self.input_ids.shape[0]
        if n % parts:
            raise ValueError(f"batch of {n} sequences does not split into {parts} equal parts")
        size = n // parts
        return [self.rows(r * size, (r + 1) * size) for r in range(parts)]
