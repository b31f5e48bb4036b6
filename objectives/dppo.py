"""DPPO: Divergence Proximal Policy Optimization (arXiv 2602.04879).

DPPO replaces ratio clipping by a trust region on a divergence between mu and pi, and masks a token
(M = 0) only when it has left the region in the *harmful* direction: pushed further the way its
advantage pulls it. The gradient is A * min(r, C) * M * grad log pi, written as the loss
-A * sg(min(r, C)) * M * log pi. A = 0 follows the negative rule, as in the reference code.

Binary variants look at the sampled token only (Bernoulli(p) of "this token"); Top-K variants at the
engine's top-K distribution plus one "rest" bucket against the learner's probabilities on the same K
ids plus rest. For Top-K the direction is read off the sampled token's pi - mu.
"""

from __future__ import annotations

import torch

from objectives.base import (
    PROB_FLOOR,
    ObjectiveInputs,
    ObjectiveOutput,
    bernoulli_kl,
    fraction,
    log_ratio,
    masked_loss,
    masked_mean,
    register_objective,
)
from objectives.config import DPPOBinaryKLConfig, DPPOBinaryTVConfig, DPPOTopKKLConfig, DPPOTopKTVConfig


def _with_rest(topk_logp: torch.Tensor) -> torch.Tensor:
    """[..., K] log-probs -> [..., K+1] probabilities, the last being the rest 1 - sum (floored at 0)."""
    probs = topk_logp.exp()
    rest = (1.0 - probs.sum(dim=-1, keepdim=True)).clamp_min(0.0)
    return torch.cat([probs, rest], dim=-1)


def topk_tv(rollout_topk_logp: torch.Tensor, policy_topk_logp: torch.Tensor) -> torch.Tensor:
    """TV distance between the top-K(+rest) distributions of mu and pi; [..., K] -> [...]."""
    return 0.5 * (_with_rest(rollout_topk_logp) - _with_rest(policy_topk_logp)).abs().sum(dim=-1)


def topk_kl(rollout_topk_logp: torch.Tensor, policy_topk_logp: torch.Tensor) -> torch.Tensor:
    """KL(mu_topK || pi_topK), both with a rest bucket; [..., K] -> [...]."""
    mu, pi = _with_rest(rollout_topk_logp), _with_rest(policy_topk_logp)
    log_mu, log_pi = mu.clamp_min(PROB_FLOOR).log(), pi.clamp_min(PROB_FLOOR).log()
    return torch.where(mu > 0, mu * (log_mu - log_pi), torch.zeros_like(mu)).sum(dim=-1)


def _harmful_direction(inputs: ObjectiveInputs) -> torch.Tensor:
    """True where pi moved the way the advantage pushes it: up for A > 0, down for A <= 0."""
    shift = inputs.policy_logp.detach() - inputs.rollout_logp
    return torch.where(inputs.advantages > 0, shift > 0, shift < 0)


def _dppo(inputs: ObjectiveInputs, is_cap: float, masked: torch.Tensor, divergence: torch.Tensor) -> ObjectiveOutput:
    valid, adv = inputs.valid, inputs.advantages.detach()
    ratio = log_ratio(inputs).detach().exp()
    keep = (~masked).to(inputs.policy_logp.dtype)
    loss = -adv * torch.clamp(ratio, max=is_cap) * keep * inputs.policy_logp
    metrics = {
        "masked_frac": fraction(masked, valid),
        "masked_frac_pos_adv": fraction(masked, valid & (adv > 0)),
        "masked_frac_nonpos_adv": fraction(masked, valid & (adv <= 0)),
        "is_truncated_frac": fraction(ratio > is_cap, valid),
        "divergence_mean": masked_mean(divergence, valid),
    }
    return ObjectiveOutput(masked_loss(loss, valid), metrics)


@register_objective("dppo_binary_tv", DPPOBinaryTVConfig)
def dppo_binary_tv(inputs: ObjectiveInputs, cfg: DPPOBinaryTVConfig) -> ObjectiveOutput:
    """Mask A > 0 tokens with pi - mu > delta and A <= 0 tokens with pi - mu < -delta."""
    shift = inputs.policy_logp.detach().exp() - inputs.rollout_logp.exp()
    masked = torch.where(inputs.advantages > 0, shift > cfg.delta, shift < -cfg.delta)
    return _dppo(inputs, cfg.is_cap, masked, shift.abs())


@register_objective("dppo_binary_kl", DPPOBinaryKLConfig)
def dppo_binary_kl(inputs: ObjectiveInputs, cfg: DPPOBinaryKLConfig) -> ObjectiveOutput:
    """Mask tokens with KL(Bern(mu)||Bern(pi)) > delta that moved in the harmful direction."""
    kl = bernoulli_kl(inputs.rollout_logp, inputs.policy_logp.detach())
    masked = (kl > cfg.delta) & _harmful_direction(inputs)
    return _dppo(inputs, cfg.is_cap, masked, kl)


def _topk_inputs(inputs: ObjectiveInputs, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    if inputs.rollout_topk_logp is None or inputs.policy_topk_logp is None:
        raise ValueError(f"{name} needs rollout_topk_logp and policy_topk_logp tensors of shape [B, T, K]")
    if inputs.rollout_topk_logp.shape != inputs.policy_topk_logp.shape:
        raise ValueError(
            f"{name}: rollout_topk_logp {tuple(inputs.rollout_topk_logp.shape)} and policy_topk_logp "
            f"{tuple(inputs.policy_topk_logp.shape)} must have the same shape"
        )
    return inputs.rollout_topk_logp, inputs.policy_topk_logp.detach()


@register_objective("dppo_topk_tv", DPPOTopKTVConfig)
def dppo_topk_tv(inputs: ObjectiveInputs, cfg: DPPOTopKTVConfig) -> ObjectiveOutput:
    """Mask tokens whose top-K TV exceeds delta and whose sampled token moved the harmful way."""
    tv = topk_tv(*_topk_inputs(inputs, "dppo_topk_tv"))
    return _dppo(inputs, cfg.is_cap, (tv > cfg.delta) & _harmful_direction(inputs), tv)


@register_objective("dppo_topk_kl", DPPOTopKKLConfig)
def dppo_topk_kl(inputs: ObjectiveInputs, cfg: DPPOTopKKLConfig) -> ObjectiveOutput:
    """Mask tokens whose top-K KL exceeds delta and whose sampled token moved the harmful way."""
    kl = topk_kl(*_topk_inputs(inputs, "dppo_topk_kl"))
    return _dppo(inputs, cfg.is_cap, (kl > cfg.delta) & _harmful_direction(inputs), kl)
