"""Register drpo's objectives in verl's policy-loss registry, so a verl user selects them by name.

    import objectives.verl_adapter
    objectives.verl_adapter.register()      # then actor.policy_loss.loss_mode=drpo

Optional: importing this module does not import verl; ``register()`` does, and raises ImportError
with the reason when verl is missing. Checked against verl 0.9's ``PolicyLossFn`` signature
``(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights)
-> (loss, metrics)``.

Conventions, following verl's own DPPO losses:
- the anchor is ``old_log_prob``: in verl's bypass mode that is the rollout engine's log-prob mu,
  which is what DRPO regularizes against; in decoupled mode it is the recomputed proximal policy;
- delta is ``config.clip_ratio`` (verl's dppo_tv reads its TV threshold there too), so set
  ``actor.clip_ratio=12.5`` for the released DRPO recipe; spo reads its eps there;
- ``rollout_is_weights`` (verl's rollout correction), when given, multiplies the per-token loss.

Not registered: the Top-K DPPO variants. verl's PolicyLossFn receives only per-token log-probs of
the sampled token; the engine's and learner's top-K distributions have no way in without changing
verl's actor, so registering them could only fail at run time.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

import objectives

REGISTERED = ("drpo", "mask_drpo", "drpo_no_abs_adv", "spo")
_PARAM = {"drpo": "delta", "mask_drpo": "delta", "drpo_no_abs_adv": "delta", "spo": "eps"}


def _config_value(config: Any, key: str) -> Any:
    if config is None:
        return None
    getter = getattr(config, "get", None)
    return getter(key, None) if callable(getter) else getattr(config, key, None)


def make_policy_loss(name: str, agg_loss: Callable[..., torch.Tensor]) -> Callable[..., tuple[torch.Tensor, dict[str, float]]]:
    """A verl PolicyLossFn running drpo objective ``name``; ``agg_loss`` is verl's core_algos.agg_loss.

    Aggregation goes through verl's own agg_loss with ``config.global_batch_info``, exactly as
    verl's built-in losses do, so data-parallel and micro-batch normalization stay verl's.
    """

    def policy_loss(
        old_log_prob: torch.Tensor,
        log_prob: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        loss_agg_mode: str = "token-mean",
        config: Any = None,
        rollout_is_weights: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        clip_ratio = _config_value(config, "clip_ratio")
        params = {} if clip_ratio is None else {_PARAM[name]: float(clip_ratio)}
        cfg = objectives.make_config(name, **params)
        mask = response_mask.bool()
        out = objectives.compute(cfg, objectives.ObjectiveInputs(log_prob, old_log_prob, advantages, mask))
        per_token = out.loss if rollout_is_weights is None else out.loss * rollout_is_weights
        batch_info = _config_value(config, "global_batch_info") or {}
        loss = agg_loss(loss_mat=per_token, loss_mask=response_mask, loss_agg_mode=loss_agg_mode, **batch_info)
        # verl logs python floats; this adapter is glue outside the hot objectives path.
        metrics = {f"actor/{name}/{k}": m.value.item() for k, m in out.metrics.items() if m.value.dim() == 0}
        return loss, metrics

    policy_loss.__name__ = f"compute_policy_loss_{name}"
    return policy_loss


def register(names: tuple[str, ...] = REGISTERED, *, overwrite: bool = False) -> list[str]:
    """Add ``names`` to verl's POLICY_LOSS_REGISTRY; returns the names added.

    An existing verl entry of the same name is kept unless ``overwrite``.
    """
    try:
        from verl.trainer.ppo import core_algos
    except ImportError as err:
        raise ImportError(f"verl is not importable ({err}); pip install 'drpo[verl]'") from err
    added = []
    for name in names:
        if name not in _PARAM:
            raise ValueError(f"{name!r} cannot be registered in verl; choose from {', '.join(REGISTERED)}")
        if name in core_algos.POLICY_LOSS_REGISTRY and not overwrite:
            continue
        core_algos.register_policy_loss(name)(make_policy_loss(name, core_algos.agg_loss))
        added.append(name)
    return added
