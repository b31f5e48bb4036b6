"""Pure policy objectives, advantages, aggregation, diagnostics and memory-bounded log-probs.

Importable without Ray, Megatron or an inference engine, and ``import objectives.config`` (what the
run config embeds) imports no torch: the names below come from objectives/api.py on first use. The two convenience entry points other
code and users call::

    objectives.available() -> list[str]
    objectives.token_loss(name, policy_logp, rollout_logp, advantages, **params) -> torch.Tensor

``params`` are the objective's config fields (``delta`` for drpo, mask_drpo and dppo_*;
``eps_low``/``eps_high`` for ppo_clip; ``eps`` for spo; ...) plus the optional tensors ``mask``,
``rollout_topk_logp`` and ``policy_topk_logp``. The learner uses ``compute`` with a typed config and
gets metrics too.
"""

from __future__ import annotations

__all__ = [
    "LOG_RATIO_CLAMP",
    "Metric",
    "ObjectiveConfig",
    "ObjectiveInputs",
    "ObjectiveOutput",
    "aggregate",
    "available",
    "compute",
    "make_config",
    "register_objective",
    "required_topk",
    "token_loss",
]


def __getattr__(name: str):
    if name in __all__:
        from objectives import api

        return getattr(api, name)
    raise AttributeError(f"module 'objectives' has no attribute {name!r}")
