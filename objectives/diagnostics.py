"""Off-policy gap diagnostics between the learner pi and the behaviour policy mu.

Every metric is computed on the sampled tokens (the only place mu is known) and returned as a
``Metric`` with its reduction. With ``version_lag`` the gap is split, and the parts must always be
reported apart: lag 0 (``numerics``: engine vs learner arithmetic, same weights) and lag >= 1
(``staleness``: the sample came from older weights). With ``context_lag`` as well, lag-0 tokens
whose request began under older weights (an in-flight update kept its older KV) are taken out of
``numerics`` into ``inflight``. Nothing here syncs with the host.
"""

from __future__ import annotations

import torch

from objectives.base import LOG_RATIO_CLAMP, Metric, fraction, masked_mean

QUANTILES = (0.5, 0.9, 0.99)
RATIO_QUANTILES = (0.01, 0.5, 0.99)


def masked_quantile(x: torch.Tensor, valid: torch.Tensor, q: float) -> Metric:
    """Nearest-rank (lower) quantile of x over valid entries; NaN when there are none.

    Masked entries are moved to +inf and the flat tensor sorted, so the rank index is computed as a
    tensor and no boolean indexing (a host sync) is needed.
    """
    flat = torch.where(valid, x.detach().float(), torch.full((), float("inf"), device=x.device)).flatten()
    ordered, _ = torch.sort(flat)
    count = valid.sum()
    rank = torch.clamp(((count - 1).clamp_min(0).float() * q).floor().long(), 0, flat.numel() - 1)
    value = ordered.gather(0, rank.reshape(1)).squeeze(0)
    return Metric(torch.where(count > 0, value, torch.full_like(value, float("nan"))), "quantile", count)


def masked_max(x: torch.Tensor, valid: torch.Tensor) -> Metric:
    filled = torch.where(valid, x.detach().float(), torch.full((), float("-inf"), device=x.device))
    return Metric(filled.max() if filled.numel() else torch.tensor(float("-inf")), "max", valid.sum())


def _abs_shift(policy_logp: torch.Tensor, rollout_logp: torch.Tensor) -> torch.Tensor:
    """|pi - mu| per token, in fp32, outside autograd."""
    return (policy_logp.detach().float().exp() - rollout_logp.detach().float().exp()).abs()


def abs_shift_mean(policy_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> Metric:
    """Mean |pi - mu| over ``mask``: gap_metrics' first figure alone, for one update of several."""
    return masked_mean(_abs_shift(policy_logp, rollout_logp), mask.bool())


def gap_metrics(
    policy_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor | None = None,
    delta: float | None = None,
    entropy: torch.Tensor | None = None,
) -> dict[str, Metric]:
    """|pi - mu| mean/max/quantiles, k1 and k3 estimates of KL(mu || pi), chi^2, ratio quantiles.

    With tokens sampled from mu and r = pi/mu: k1 = -log r, k3 = r - 1 - log r (unbiased, >= 0),
    chi^2 = (r - 1)^2 estimates chi^2(pi || mu). ``delta`` adds the fraction with |pi - mu| > delta;
    ``entropy`` [B, T] (the learner's, from logprobs.py) adds its mean.
    """
    valid = torch.ones_like(policy_logp, dtype=torch.bool) if mask is None else mask.bool()
    policy_logp, rollout_logp = policy_logp.detach().float(), rollout_logp.detach().float()
    log_r = torch.clamp(policy_logp - rollout_logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = log_r.exp()
    shift = _abs_shift(policy_logp, rollout_logp)
    out = {
        "abs_shift_mean": masked_mean(shift, valid),
        "abs_shift_max": masked_max(shift, valid),
        "kl_k1": masked_mean(-log_r, valid),
        "kl_k3": masked_mean(ratio - 1.0 - log_r, valid),
        "chi2": masked_mean((ratio - 1.0) ** 2, valid),
        "ratio_max": masked_max(ratio, valid),
    }
    for q in QUANTILES:
        out[f"abs_shift_p{round(q * 100)}"] = masked_quantile(shift, valid, q)
    for q in RATIO_QUANTILES:
        out[f"ratio_p{round(q * 100):02d}"] = masked_quantile(ratio, valid, q)
    if delta is not None:
        out["beyond_delta_frac"] = fraction(shift > delta, valid)
    if entropy is not None:
        out["entropy_mean"] = masked_mean(entropy, valid)
    return out


def gap_metrics_by_lag(
    policy_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    version_lag: torch.Tensor,
    mask: torch.Tensor | None = None,
    delta: float | None = None,
    context_lag: torch.Tensor | None = None,
) -> dict[str, Metric]:
    """gap_metrics split into ``numerics/`` (lag 0), ``staleness/`` (lag >= 1) and, with
    ``context_lag``, ``inflight/`` (lag 0, prompt from an older version), plus ``all/``.

    ``version_lag`` [B, T] is learner version minus the policy version that produced each token;
    ``context_lag`` [B, T] learner version minus the version its request's prompt was submitted at.
    """
    valid = torch.ones_like(policy_logp, dtype=torch.bool) if mask is None else mask.bool()
    lag0 = valid & (version_lag == 0)
    parts = [("all", valid), ("staleness", valid & (version_lag >= 1))]
    if context_lag is None:
        parts.append(("numerics", lag0))
    else:
        parts += [("numerics", lag0 & (context_lag == 0)), ("inflight", lag0 & (context_lag > 0))]
    out: dict[str, Metric] = {}
    for prefix, part in parts:
        for key, metric in gap_metrics(policy_logp, rollout_logp, part, delta).items():
            out[f"{prefix}/{key}"] = metric
    return out
