"""Advantage estimators for groups of n samples per prompt, and DAPO's zero-variance filter.

``rewards`` is [G, n]: G prompts (groups), n samples each. Every estimator returns [G, n]
sequence-level advantages; ``to_tokens`` broadcasts them over response tokens.
"""

from __future__ import annotations

import torch

from objectives.config import AdvantageConfig


def grpo(rewards: torch.Tensor, norm_std: bool = True, std_eps: float = 1e-6) -> torch.Tensor:
    """GRPO (arXiv 2402.03300): (r - group mean) / (group std + eps); unbiased std, as in verl/TRL."""
    centered = rewards - rewards.mean(dim=-1, keepdim=True)
    if not norm_std:
        return centered
    return centered / (rewards.std(dim=-1, keepdim=True) + std_eps)


def dr_grpo(rewards: torch.Tensor) -> torch.Tensor:
    """Dr. GRPO (arXiv 2503.20783): r - group mean, no std (the std division biases by difficulty)."""
    return grpo(rewards, norm_std=False)


def rloo(rewards: torch.Tensor) -> torch.Tensor:
    """RLOO (arXiv 2402.14740): r_i - mean of the other n-1 samples = n/(n-1) (r_i - mean)."""
    n = rewards.shape[-1]
    if n < 2:
        raise ValueError("rloo needs at least 2 samples per prompt")
    return (rewards - rewards.mean(dim=-1, keepdim=True)) * (n / (n - 1))


def reinforce_pp(rewards: torch.Tensor, std_eps: float = 1e-6) -> torch.Tensor:
    """REINFORCE++-baseline (arXiv 2501.03262): subtract the group mean, then normalize over the batch."""
    centered = rewards - rewards.mean(dim=-1, keepdim=True)
    return (centered - centered.mean()) / (centered.std() + std_eps)


def compute_advantages(rewards: torch.Tensor, cfg: AdvantageConfig) -> torch.Tensor:
    """Sequence advantages [G, n] for ``rewards`` [G, n] under ``cfg.estimator``."""
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [groups, samples], got shape {tuple(rewards.shape)}")
    if not torch.isfinite(rewards).all():
        raise ValueError("rewards contain NaN or inf")
    rewards = rewards.float()
    if cfg.estimator == "grpo":
        return grpo(rewards, True, cfg.std_eps)
    if cfg.estimator == "dr_grpo":
        return dr_grpo(rewards)
    if cfg.estimator == "rloo":
        return rloo(rewards)
    return reinforce_pp(rewards, cfg.std_eps)


def nonzero_variance_groups(rewards: torch.Tensor) -> torch.Tensor:
    """[G] bool: True for groups whose rewards are not all equal (DAPO dynamic sampling keeps these).

    A group where every sample got the same reward has zero advantage under every group-relative
    estimator and only dilutes the batch.
    """
    return rewards.amax(dim=-1) != rewards.amin(dim=-1)


def to_tokens(seq_advantages: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Broadcast [N] sequence advantages over [N, T] response tokens (0 where masked)."""
    return seq_advantages[:, None] * response_mask.to(seq_advantages.dtype)
