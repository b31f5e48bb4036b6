"""Typed configs of the registered policy objectives.

One frozen pydantic model per objective, discriminated by ``type`` (the registry name). This module
imports neither torch nor Ray so the run config (controller/) can embed ``ObjectiveConfig`` and a bad
value fails at load time with the field's name. The loss functions that read these configs live in
the family modules beside this one (ppo.py, spo.py, dppo.py, drpo.py).
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Section(BaseModel):
    """The base of every config section of drpo (objectives, rollout, learner, controller): frozen,
    unknown keys refused. ``expect`` is how a component's ``build`` refuses a section of another
    component's type before it places or loads anything."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @classmethod
    def expect(cls, config: object, component: str):
        """``config`` if it is a ``cls``; else a TypeError naming what ``component`` takes and what it got."""
        if not isinstance(config, cls):
            raise TypeError(f"{component}.build takes a {cls.__name__}, not a {type(config).__name__}")
        return config


class PPOClipConfig(Section):
    """PPO / GRPO ratio clipping (arXiv 1707.06347, 2402.03300), clip-higher (DAPO, 2503.14476), dual-clip."""

    type: Literal["ppo_clip"] = "ppo_clip"
    eps_low: float = Field(0.2, gt=0.0, le=1.0, description="Lower clip: ratios below 1 - eps_low are clipped.")
    eps_high: float = Field(0.2, gt=0.0, description="Upper clip: ratios above 1 + eps_high are clipped; > eps_low is DAPO's clip-higher.")
    dual_clip_c: float | None = Field(
        3.0, gt=1.0, description="Dual-clip bound: for A < 0 the loss is at most -A*c. None disables it."
    )


class CISPOConfig(Section):
    """CISPO (MiniMax-M1, arXiv 2506.13585): REINFORCE weighted by a clipped, stop-gradient ratio."""

    type: Literal["cispo"] = "cispo"
    eps_low: float = Field(1.0, ge=0.0, le=1.0, description="Ratio floor is 1 - eps_low; 1.0 means no floor, as in the paper.")
    eps_high: float = Field(0.28, gt=0.0, description="Ratio ceiling is 1 + eps_high.")


class GSPOConfig(Section):
    """GSPO (arXiv 2507.18071): PPO clipping of the length-normalized sequence ratio."""

    type: Literal["gspo"] = "gspo"
    eps_low: float = Field(3e-4, gt=0.0, le=1.0, description="Lower clip of the sequence ratio (paper: 3e-4).")
    eps_high: float = Field(4e-4, gt=0.0, description="Upper clip of the sequence ratio (paper: 4e-4).")


class SPOConfig(Section):
    """SPO (arXiv 2401.16025): ratio objective minus |A|(r-1)^2/(2 eps)."""

    type: Literal["spo"] = "spo"
    eps: float = Field(0.2, gt=0.0, description="Penalty scale; the penalty is |A|(r-1)^2/(2 eps).")


class _DPPOConfig(Section):
    is_cap: float = Field(
        10.0, gt=0.0, description="C: the stop-gradient importance weight is min(r, C); 10000 effectively disables truncation."
    )


class DPPOBinaryTVConfig(_DPPOConfig):
    """DPPO Binary-TV (arXiv 2602.04879): mask tokens whose |pi - mu| crossed delta in the harmful direction."""

    type: Literal["dppo_binary_tv"] = "dppo_binary_tv"
    delta: float = Field(0.15, gt=0.0, le=1.0, description="Trust region on the sampled token's probability shift pi - mu.")


class DPPOBinaryKLConfig(_DPPOConfig):
    """DPPO Binary-KL (arXiv 2602.04879): mask when KL(Bern(mu) || Bern(pi)) > delta in the harmful direction."""

    type: Literal["dppo_binary_kl"] = "dppo_binary_kl"
    delta: float = Field(0.05, gt=0.0, description="Trust region on the Bernoulli KL of the sampled token.")


class _DPPOTopKConfig(_DPPOConfig):
    k: int = Field(
        20, ge=1, le=100,
        description="K: the engine reports its K most likely tokens at every position (vLLM's default max_logprobs is 20).",
    )


class DPPOTopKTVConfig(_DPPOTopKConfig):
    """DPPO Top-K TV: TV between the engine's top-K (+ rest bucket) and the learner's probabilities on those ids."""

    type: Literal["dppo_topk_tv"] = "dppo_topk_tv"
    delta: float = Field(0.15, gt=0.0, le=1.0, description="Trust region on the top-K TV distance.")


class DPPOTopKKLConfig(_DPPOTopKConfig):
    """DPPO Top-K KL: KL(mu_topK || pi_topK), both with one rest bucket."""

    type: Literal["dppo_topk_kl"] = "dppo_topk_kl"
    delta: float = Field(0.05, gt=0.0, description="Trust region on the top-K KL divergence.")


class DRPOConfig(Section):
    """DRPO (arXiv 2606.09821): -(r A - |A|/(2 delta) * mu * (r-1)^2)."""

    type: Literal["drpo"] = "drpo"
    delta: float = Field(
        12.5,
        gt=0.0,
        description="Divergence scale. The released recipe uses 12.5 (|w-1| <= 0.08); delta < 1 gives a DPPO-like trust region.",
    )


class MaskDRPOConfig(Section):
    """Mask-DRPO ablation: the quadratic term applies only to tokens with |pi - mu| > delta."""

    type: Literal["mask_drpo"] = "mask_drpo"
    delta: float = Field(
        0.15,
        gt=0.0,
        le=1.0,
        description="Trust region and divergence scale; defaults to DPPO's delta_TV since with delta >= 1 no token is ever outside.",
    )


class DRPONoAbsAdvConfig(Section):
    """Ablation: DRPO with |A| removed from the regularizer (weight 1 on every token, A = 0 included)."""

    type: Literal["drpo_no_abs_adv"] = "drpo_no_abs_adv"
    delta: float = Field(12.5, gt=0.0, description="Divergence scale, as in drpo.")


class TVPenaltyConfig(Section):
    """Ablation: |A|/delta * |pi - mu| (Bernoulli TV of the sampled token) in place of the quadratic."""

    type: Literal["tv_penalty"] = "tv_penalty"
    delta: float = Field(12.5, gt=0.0, description="Penalty scale: the penalty is |A| |pi - mu| / delta.")


class KLPenaltyConfig(Section):
    """Ablation: |A|/delta * KL(Bern(mu) || Bern(pi)) in place of the quadratic."""

    type: Literal["kl_penalty"] = "kl_penalty"
    delta: float = Field(12.5, gt=0.0, description="Penalty scale: the penalty is |A| KL(Bern(mu)||Bern(pi)) / delta.")


ObjectiveConfig = Annotated[
    Union[
        PPOClipConfig,
        CISPOConfig,
        GSPOConfig,
        SPOConfig,
        DPPOBinaryTVConfig,
        DPPOBinaryKLConfig,
        DPPOTopKTVConfig,
        DPPOTopKKLConfig,
        DRPOConfig,
        MaskDRPOConfig,
        DRPONoAbsAdvConfig,
        TVPenaltyConfig,
        KLPenaltyConfig,
    ],
    Field(discriminator="type"),
]


AdvantageEstimatorName = Literal["grpo", "dr_grpo", "rloo", "reinforce_pp"]
AggregationMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


class AdvantageConfig(Section):
    """How sequence rewards become per-token advantages."""

    estimator: AdvantageEstimatorName = Field(
        "grpo",
        description="grpo (group mean, std-normalized), dr_grpo (group mean, no std), rloo (leave-one-out mean), "
        "reinforce_pp (group mean, then normalized over the whole batch).",
    )
    std_eps: float = Field(1e-6, gt=0.0, description="Added to a standard deviation before dividing by it.")
    filter_zero_variance: bool = Field(True, description="DAPO dynamic sampling: drop groups whose rewards are all equal.")


class AggregationConfig(Section):
    """How per-token losses become one scalar."""

    mode: AggregationMode = Field("token-mean", description="Loss aggregation mode.")
    horizon: int | None = Field(
        None, ge=1, description="Fixed horizon dividing token sums; required by seq-mean-token-sum-norm, unused otherwise."
    )

    @model_validator(mode="after")
    def _horizon_for_norm(self) -> "AggregationConfig":
        if self.mode == "seq-mean-token-sum-norm" and self.horizon is None:
            raise ValueError("aggregation.horizon is required when mode is seq-mean-token-sum-norm")
        if self.mode != "seq-mean-token-sum-norm" and self.horizon is not None:
            raise ValueError(f"aggregation.horizon is only used by seq-mean-token-sum-norm, not {self.mode}")
        return self


def required_topk(config: BaseModel) -> int:
    """K of the engine top-K log-probs an objective needs (0: it needs none). The rollout engine is
    asked for them, the batch carries them, and the learner computes pi on exactly those ids."""
    return config.k if isinstance(config, _DPPOTopKConfig) else 0
