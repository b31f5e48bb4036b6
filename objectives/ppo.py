"""Ratio-clipping objectives: PPO/GRPO clip (with clip-higher and dual-clip), CISPO and GSPO.

All three anchor the ratio r = pi/mu at the behaviour policy mu (``rollout_logp``).
"""

from __future__ import annotations

import torch

from objectives.base import (
    LOG_RATIO_CLAMP,
    ObjectiveInputs,
    ObjectiveOutput,
    fraction,
    log_ratio,
    masked_loss,
    register_objective,
)
from objectives.config import CISPOConfig, GSPOConfig, PPOClipConfig


@register_objective("ppo_clip", PPOClipConfig)
def ppo_clip(inputs: ObjectiveInputs, cfg: PPOClipConfig) -> ObjectiveOutput:
    """PPO clipped surrogate (arXiv 1707.06347) as used by GRPO (arXiv 2402.03300).

    loss = max(-r A, -clip(r, 1-eps_low, 1+eps_high) A); eps_high > eps_low is DAPO's clip-higher
    (arXiv 2503.14476). Dual-clip (arXiv 1912.09729) caps the loss of A < 0 tokens at -A c, so a huge
    ratio on a bad token cannot dominate the batch. The gradient is -r A where unclipped, else 0.
    """
    valid, adv = inputs.valid, inputs.advantages.detach()
    ratio = log_ratio(inputs).exp()
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - cfg.eps_low, 1.0 + cfg.eps_high)
    loss = torch.maximum(unclipped, clipped)
    metrics = {
        "clip_frac_low": fraction((ratio < 1.0 - cfg.eps_low) & (adv < 0), valid),
        "clip_frac_high": fraction((ratio > 1.0 + cfg.eps_high) & (adv > 0), valid),
    }
    if cfg.dual_clip_c is not None:
        cap = -adv * cfg.dual_clip_c
        dual = (adv < 0) & (loss > cap)
        loss = torch.where(dual, cap, loss)
        metrics["dual_clip_frac"] = fraction(dual, valid)
    return ObjectiveOutput(masked_loss(loss, valid), metrics)


@register_objective("cispo", CISPOConfig)
def cispo(inputs: ObjectiveInputs, cfg: CISPOConfig) -> ObjectiveOutput:
    """CISPO (MiniMax-M1, arXiv 2506.13585): loss = -sg(clip(r, 1-eps_low, 1+eps_high)) A log pi.

    Unlike PPO no token loses its gradient: clipping bounds the importance weight only.
    """
    valid, adv = inputs.valid, inputs.advantages.detach()
    ratio = log_ratio(inputs).detach().exp()
    weight = torch.clamp(ratio, 1.0 - cfg.eps_low, 1.0 + cfg.eps_high)
    loss = -weight * adv * inputs.policy_logp
    metrics = {"clip_frac": fraction(weight != ratio, valid)}
    return ObjectiveOutput(masked_loss(loss, valid), metrics)


@register_objective("gspo", GSPOConfig)
def gspo(inputs: ObjectiveInputs, cfg: GSPOConfig) -> ObjectiveOutput:
    """GSPO (arXiv 2507.18071), token form: every row of [B, T] is one sequence.

    s_i = exp(mean_t log(pi/mu)) over the row's valid tokens; token t uses
    s_{i,t} = sg(s_i) * pi_t / sg(pi_t), whose value is s_i and whose gradient, summed over the row
    and divided by its length (seq-mean-token-mean), is the sequence-level GSPO gradient.
    loss = max(-s A, -clip(s, 1-eps_low, 1+eps_high) A).
    """
    valid, adv = inputs.valid, inputs.advantages.detach()
    token_log_ratio = inputs.policy_logp - inputs.rollout_logp.detach()
    zeros = torch.zeros_like(token_log_ratio)
    seq_len = valid.sum(dim=-1, keepdim=True).clamp_min(1)
    seq_log_ratio = torch.where(valid, token_log_ratio, zeros).sum(dim=-1, keepdim=True) / seq_len
    seq_log_ratio = torch.clamp(seq_log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).detach()
    log_s = seq_log_ratio + inputs.policy_logp - inputs.policy_logp.detach()
    s = log_s.exp()
    loss = torch.maximum(-adv * s, -adv * torch.clamp(s, 1.0 - cfg.eps_low, 1.0 + cfg.eps_high))
    metrics = {"clip_frac": fraction((s < 1.0 - cfg.eps_low) | (s > 1.0 + cfg.eps_high), valid)}
    return ObjectiveOutput(masked_loss(loss, valid), metrics)
