"""The objectives' public entry points (``objectives.available``, ``token_loss``, ``compute`` ...),
re-exported by the package on first use (objectives/__init__.py)."""


from __future__ import annotations

from typing import Any

import torch
from pydantic import BaseModel, ValidationError

from objectives import dppo, drpo, ppo, spo  # noqa: F401  (registers the objectives)
from objectives.aggregation import aggregate
from objectives.base import (
    LOG_RATIO_CLAMP,
    Metric,
    ObjectiveInputs,
    ObjectiveOutput,
    register_objective,
    registry,
)
from objectives.config import ObjectiveConfig, required_topk

_TENSOR_PARAMS = ("mask", "rollout_topk_logp", "policy_topk_logp")


def available() -> list[str]:
    """Names of every registered objective, sorted."""
    return sorted(registry())


def make_config(name: str, **fields: Any) -> BaseModel:
    """The validated config of objective ``name``; unknown names and bad fields raise ValueError."""
    entries = registry()
    if name not in entries:
        raise ValueError(f"unknown objective {name!r}; available: {', '.join(available())}")
    try:
        return entries[name].config_cls(**fields)
    except ValidationError as err:
        raise ValueError(f"invalid parameters for objective {name!r}: {err}") from None


def compute(config: BaseModel, inputs: ObjectiveInputs) -> ObjectiveOutput:
    """Run the objective that ``config`` (one of ObjectiveConfig) selects."""
    entries = registry()
    name = getattr(config, "type", None)
    if name not in entries or not isinstance(config, entries[name].config_cls):
        raise ValueError(f"{type(config).__name__} is not the config of a registered objective")
    return entries[name].fn(inputs, config)


def token_loss(
    name: str,
    policy_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    advantages: torch.Tensor,
    **params: Any,
) -> torch.Tensor:
    """Per-token loss to minimize, same shape as policy_logp and differentiable with respect to it."""
    tensors = {k: params.pop(k) for k in _TENSOR_PARAMS if k in params}
    config = make_config(name, **params)
    inputs = ObjectiveInputs(policy_logp, rollout_logp, advantages, **tensors)
    return compute(config, inputs).loss
