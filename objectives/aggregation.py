"""Loss aggregation: per-token losses [B, T] -> one scalar, with an explicit normalizer.

With gradient accumulation over micro-batches (and data-parallel ranks) each micro-batch must divide
by the *global* count, or micro-batches with fewer tokens weigh more. The caller therefore passes
``normalizer``: the global number of valid tokens (token-mean) or of non-empty sequences (seq-*
modes). Omitted, it is the local count, which is right only for a single micro-batch.
"""

from __future__ import annotations

import torch

from objectives.config import AggregationMode

MODES: tuple[str, ...] = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def aggregate(
    loss: torch.Tensor,
    mask: torch.Tensor,
    mode: AggregationMode,
    normalizer: torch.Tensor | float | None = None,
    horizon: int | None = None,
) -> torch.Tensor:
    """Aggregate ``loss`` [B, T] over the bool ``mask`` [B, T]::

        token-mean:               sum over tokens / normalizer (tokens)
        seq-mean-token-sum:       sum_seq (sum over its tokens) / normalizer (sequences)
        seq-mean-token-mean:      sum_seq (mean over its tokens) / normalizer (sequences)
        seq-mean-token-sum-norm:  sum_seq (sum over its tokens / horizon) / normalizer (sequences);
                                  Dr. GRPO's length-unbiased form, horizon a fixed constant.

    Sequences without valid tokens count in no mode.
    """
    if mode not in MODES:
        raise ValueError(f"unknown aggregation mode {mode!r}; expected one of {', '.join(MODES)}")
    if loss.shape != mask.shape or loss.dim() != 2:
        raise ValueError(f"loss {tuple(loss.shape)} and mask {tuple(mask.shape)} must both be [B, T]")
    valid = mask.bool()
    token_loss = torch.where(valid, loss, torch.zeros_like(loss))
    if mode == "token-mean":
        denom = valid.sum() if normalizer is None else normalizer
        return token_loss.sum() / _positive(denom)
    seq_tokens = valid.sum(dim=-1)
    seq_loss = token_loss.sum(dim=-1)
    if mode == "seq-mean-token-mean":
        seq_loss = seq_loss / seq_tokens.clamp_min(1)
    elif mode == "seq-mean-token-sum-norm":
        if horizon is None or horizon < 1:
            raise ValueError("seq-mean-token-sum-norm needs a fixed horizon >= 1")
        seq_loss = seq_loss / horizon
    denom = (seq_tokens > 0).sum() if normalizer is None else normalizer
    return seq_loss.sum() / _positive(denom)


def _positive(denom: torch.Tensor | float) -> torch.Tensor | float:
    # An all-masked micro-batch has a zero local count; its loss sum is 0, so dividing by 1 keeps it 0.
    if isinstance(denom, torch.Tensor):
        return denom.clamp_min(1)
    if denom <= 0:
        raise ValueError(f"aggregation normalizer must be positive, got {denom}")
    return denom
