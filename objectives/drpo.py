"""DRPO: Divergence Regularized Policy Optimization (arXiv 2606.09821), and the paper's ablations.

    loss = -( r A - |A| / (2 delta) * mu * (r - 1)^2 ),   r = pi/mu differentiable, mu and A detached.

mu (r-1)^2 = (pi - mu)^2 / mu is the sampled token's term of the chi-square divergence between the
two distributions. Its gradient with respect to log pi is -A r w, with

    w = 1 - sign(A (r - 1)) |pi - mu| / delta.

w falls to 0 exactly at DPPO's trust-region boundary |pi - mu| = delta when the update diverges
(pushes pi further from mu the way A wants), turns negative past it (pulls the token back:
"corrective"), and exceeds 1 when the update converges towards mu. Unlike SPO's (r-1)^2 / eps
penalty, w stays in [1 - 1/delta, 1 + 1/delta] however small mu is. No token is truncated.

Ablations: Mask-DRPO (the quadratic only outside |pi - mu| > delta), DRPO without |A| in the
regularizer, and TV / KL penalties in place of the quadratic. The paper's text does not fix the exact
form of the TV and KL penalties; here they are the sampled token's Bernoulli divergences
|pi - mu| and KL(Bern(mu) || Bern(pi)) with the same |A| / delta scale (our choice, documented).
"""

from __future__ import annotations

import torch

from objectives.base import (
    Metric,
    ObjectiveInputs,
    ObjectiveOutput,
    bernoulli_kl,
    fraction,
    log_ratio,
    masked_loss,
    masked_mean,
    register_objective,
)
from objectives.config import DRPOConfig, DRPONoAbsAdvConfig, KLPenaltyConfig, MaskDRPOConfig, TVPenaltyConfig

WEIGHT_HISTOGRAM_BINS = 10


def gradient_weight(advantages: torch.Tensor, rollout_logp: torch.Tensor, ratio: torch.Tensor, delta: float) -> torch.Tensor:
    """DRPO's w = 1 - sign(A) mu (r-1) / delta (= 1 - sign(A(r-1)) |pi-mu| / delta), detached."""
    shift = rollout_logp.exp() * (ratio.detach() - 1.0)
    return 1.0 - torch.sign(advantages) * shift / delta


def weight_histogram(w: torch.Tensor, among: torch.Tensor, delta: float) -> Metric:
    """Histogram of w over its attainable range [1 - 1/delta, 1 + 1/delta] (outer bins open-ended)."""
    edges = torch.linspace(1.0 - 1.0 / delta, 1.0 + 1.0 / delta, WEIGHT_HISTOGRAM_BINS + 1, device=w.device)
    index = torch.bucketize(w.detach().float().flatten(), edges[1:-1])
    counts = torch.zeros(WEIGHT_HISTOGRAM_BINS, device=w.device).scatter_add_(0, index, among.flatten().float())
    return Metric(counts, "histogram", among.sum(), edges)


def _penalized(inputs: ObjectiveInputs, ratio: torch.Tensor, penalty: torch.Tensor) -> tuple[torch.Tensor, dict[str, Metric]]:
    """loss = -(r A - penalty) and the regularizer-magnitude metrics shared by the family.

    ``regularizer_share`` = sum(penalty) / (sum(|r A|) + sum(penalty)) over valid tokens: the part of
    the objective's magnitude that the regularizer accounts for, in [0, 1].
    """
    valid, adv = inputs.valid, inputs.advantages.detach()
    surrogate = ratio * adv
    loss = masked_loss(-(surrogate - penalty), valid)
    zero = torch.zeros((), dtype=penalty.dtype, device=penalty.device)
    pen_sum = torch.where(valid, penalty.detach(), zero).sum()
    surr_sum = torch.where(valid, surrogate.detach().abs(), zero).sum()
    metrics = {
        "regularizer_mean": masked_mean(penalty, valid),
        "regularizer_share": Metric(pen_sum / (pen_sum + surr_sum).clamp_min(1e-30), "mean", valid.sum()),
    }
    return loss, metrics


def _weight_metrics(inputs: ObjectiveInputs, w: torch.Tensor, delta: float) -> dict[str, Metric]:
    """w diagnostics over tokens that carry gradient (valid and A != 0)."""
    active = inputs.valid & (inputs.advantages != 0)
    return {
        "weight_mean": masked_mean(w, active),
        "weight_hist": weight_histogram(w, active, delta),
        "corrective_frac": fraction(w < 0, active),
        "weight_above_one_frac": fraction(w > 1, active),
    }


@register_objective("drpo", DRPOConfig)
def drpo(inputs: ObjectiveInputs, cfg: DRPOConfig) -> ObjectiveOutput:
    """DRPO: -(r A - |A|/(2 delta) mu (r-1)^2). See the module docstring."""
    adv = inputs.advantages.detach()
    ratio = log_ratio(inputs).exp()
    penalty = adv.abs() / (2.0 * cfg.delta) * inputs.rollout_logp.detach().exp() * (ratio - 1.0) ** 2
    loss, metrics = _penalized(inputs, ratio, penalty)
    w = gradient_weight(adv, inputs.rollout_logp, ratio, cfg.delta)
    metrics |= _weight_metrics(inputs, w, cfg.delta)
    shift = inputs.rollout_logp.exp() * (ratio.detach() - 1.0)
    metrics["beyond_delta_frac"] = fraction(shift.abs() > cfg.delta, inputs.valid)
    return ObjectiveOutput(loss, metrics)


@register_objective("mask_drpo", MaskDRPOConfig)
def mask_drpo(inputs: ObjectiveInputs, cfg: MaskDRPOConfig) -> ObjectiveOutput:
    """Mask-DRPO: DRPO's quadratic applied only where |pi - mu| > delta (plain r A inside)."""
    adv = inputs.advantages.detach()
    ratio = log_ratio(inputs).exp()
    mu = inputs.rollout_logp.detach().exp()
    outside = (mu * (ratio.detach() - 1.0)).abs() > cfg.delta
    quadratic = adv.abs() / (2.0 * cfg.delta) * mu * (ratio - 1.0) ** 2
    penalty = torch.where(outside, quadratic, torch.zeros_like(quadratic))
    loss, metrics = _penalized(inputs, ratio, penalty)
    w_full = gradient_weight(adv, inputs.rollout_logp, ratio, cfg.delta)
    w = torch.where(outside, w_full, torch.ones_like(w_full))
    metrics |= _weight_metrics(inputs, w, cfg.delta)
    metrics["beyond_delta_frac"] = fraction(outside, inputs.valid)
    return ObjectiveOutput(loss, metrics)


@register_objective("drpo_no_abs_adv", DRPONoAbsAdvConfig)
def drpo_no_abs_adv(inputs: ObjectiveInputs, cfg: DRPONoAbsAdvConfig) -> ObjectiveOutput:
    """Ablation: -(r A - mu (r-1)^2 / (2 delta)); tokens with A = 0 are regularized too."""
    ratio = log_ratio(inputs).exp()
    penalty = inputs.rollout_logp.detach().exp() * (ratio - 1.0) ** 2 / (2.0 * cfg.delta)
    loss, metrics = _penalized(inputs, ratio, penalty)
    return ObjectiveOutput(loss, metrics)


@register_objective("tv_penalty", TVPenaltyConfig)
def tv_penalty(inputs: ObjectiveInputs, cfg: TVPenaltyConfig) -> ObjectiveOutput:
    """Ablation: -(r A - |A| |pi - mu| / delta)."""
    adv = inputs.advantages.detach()
    ratio = log_ratio(inputs).exp()
    penalty = adv.abs() / cfg.delta * (inputs.rollout_logp.detach().exp() * (ratio - 1.0)).abs()
    loss, metrics = _penalized(inputs, ratio, penalty)
    return ObjectiveOutput(loss, metrics)


@register_objective("kl_penalty", KLPenaltyConfig)
def kl_penalty(inputs: ObjectiveInputs, cfg: KLPenaltyConfig) -> ObjectiveOutput:
    """Ablation: -(r A - |A| KL(Bern(mu) || Bern(pi)) / delta)."""
    adv = inputs.advantages.detach()
    ratio = log_ratio(inputs).exp()
    penalty = adv.abs() / cfg.delta * bernoulli_kl(inputs.rollout_logp.detach(), inputs.policy_logp)
    loss, metrics = _penalized(inputs, ratio, penalty)
    return ObjectiveOutput(loss, metrics)
