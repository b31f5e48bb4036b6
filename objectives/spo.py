"""SPO: Simple Policy Optimization (arXiv 2401.16025)."""

from __future__ import annotations

from objectives.base import ObjectiveInputs, ObjectiveOutput, fraction, log_ratio, masked_loss, masked_mean, register_objective
from objectives.config import SPOConfig


@register_objective("spo", SPOConfig)
def spo(inputs: ObjectiveInputs, cfg: SPOConfig) -> ObjectiveOutput:
    """loss = -(r A - |A| (r-1)^2 / (2 eps)).

    The gradient with respect to log pi is -A r (1 - sign(A)(r-1)/eps): its weight grows with r
    without bound, so a token whose mu is tiny (r huge) gets an arbitrarily large push. DRPO's
    mu-weighted penalty (drpo.py) is the bounded counterpart.
    """
    valid, adv = inputs.valid, inputs.advantages.detach()
    ratio = log_ratio(inputs).exp()
    penalty = adv.abs() * (ratio - 1.0) ** 2 / (2.0 * cfg.eps)
    loss = -(ratio * adv - penalty)
    metrics = {
        "penalty_mean": masked_mean(penalty, valid),
        "beyond_eps_frac": fraction((ratio - 1.0).abs() > cfg.eps, valid),
    }
    return ObjectiveOutput(masked_loss(loss, valid), metrics)
