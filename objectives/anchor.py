"""The decoupled anchor (AReaL, arXiv 2505.24298): the objective's ratio and trust region are
anchored at the learner's own proximal log-prob pi_prox (recomputed at the start of the step), and
the behaviour policy mu of the engine enters only as the truncated importance weight
min(pi_prox / mu, C) on the advantage.

With one update per batch (pi_prox = pi at the update) and ``ppo_clip``, this is token-level
truncated importance sampling on GRPO (TIS; Yao et al., "Your efficient RL framework secretly brings
you off-policy RL training", 2025; verl's ``tis_imp_ratio_cap``): the gradient of every token is
-min(pi/mu, C) A grad log pi. With several updates per batch, ppo_clip clips pi/pi_prox as well.
The weight is exact for every registered objective, each being positively homogeneous in A.
"""

from __future__ import annotations

import math

import torch

from objectives.base import Metric, ObjectiveInputs, fraction, masked_mean


def decoupled_inputs(
    policy_logp: torch.Tensor, rollout_logp: torch.Tensor, proximal_logp: torch.Tensor, advantages: torch.Tensor,
    mask: torch.Tensor, cap: float, proximal_topk_logp: torch.Tensor | None = None, policy_topk_logp: torch.Tensor | None = None,
) -> tuple[ObjectiveInputs, dict[str, Metric]]:
    """What an objective sees under the decoupled anchor, and the behaviour weight's metrics.
    ``cap``: C, the truncation of the behaviour weight pi_prox / mu (TIS uses 2)."""
    log_w = (proximal_logp - rollout_logp).clamp(max=math.log(cap))
    weight = torch.where(mask, log_w.exp(), 0.0)
    inputs = ObjectiveInputs(
        policy_logp, proximal_logp, advantages * weight, mask, rollout_topk_logp=proximal_topk_logp, policy_topk_logp=policy_topk_logp
    )
    capped = log_w >= math.log(cap)
    return inputs, {"behaviour_weight_mean": masked_mean(weight, mask), "behaviour_weight_capped_frac": fraction(capped, mask)}
