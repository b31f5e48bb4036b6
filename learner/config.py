"""Typed learner config. Imports neither torch, Ray nor Megatron."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from objectives.config import AggregationConfig, DRPOConfig, ObjectiveConfig, Section

Packing = Literal["none", "sequences", "shared_prompt"]
"""How the learner lays sequences out for its forward (learner/packing.py)."""


class ParallelConfig(Section):
    """How the learner's world is split. world size = tensor * data (no pipeline parallelism: the
    step is not built on megatron's pipeline schedule)."""

    tensor: int = Field(1, ge=1, description="Tensor-parallel size (attention heads, MLP and vocabulary split).")
    expert: int = Field(
        1, ge=1, description="Expert-parallel size for MoE models: must divide tensor * data (the experts are split over "
        "groups of that many ranks; e.g. expert 2 needs data 2 at tensor 1).",
    )
    data: int = Field(1, ge=1, description="Data-parallel size.")

    @property
    def world_size(self) -> int:
        return self.tensor * self.data

    @model_validator(mode="after")
    def _expert_divides_data(self) -> "ParallelConfig":
        if (self.tensor * self.data) % self.expert:
            raise ValueError(
                f"parallel.expert={self.expert} must divide tensor*data={self.tensor * self.data}: raise learner.parallel.data "
                f"(e.g. --set learner.parallel.data={self.expert})"
            )
        return self


class OptimizerConfig(Section):
    """AdamW with a warm-up then constant, linear or cosine schedule."""

    lr: float = Field(1e-6, gt=0.0, description="Peak learning rate.")
    weight_decay: float = Field(0.0, ge=0.0, description="Decoupled weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="Adam betas.")
    eps: float = Field(1e-8, gt=0.0, description="Adam epsilon.")
    grad_clip: float | None = Field(1.0, gt=0.0, description="Clip the global gradient norm to this; None disables.")
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up from 0 to lr over this many steps.")
    schedule: Literal["constant", "linear", "cosine"] = Field("constant", description="Decay after warm-up.")
    total_steps: int | None = Field(None, ge=1, description="Steps the decay spans; required by linear and cosine.")
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0, description="Floor of the decay as a fraction of lr.")

    @model_validator(mode="after")
    def _total_for_decay(self) -> "OptimizerConfig":
        if self.schedule != "constant" and self.total_steps is None:
            raise ValueError(f"optimizer.total_steps is required by the {self.schedule} schedule")
        return self


class LearnerConfig(Section):
    """Everything a Learner needs besides its process group and model weights."""

    objective: ObjectiveConfig = Field(default_factory=DRPOConfig, description="The policy objective and its parameters.")
    aggregation: AggregationConfig = Field(default_factory=AggregationConfig, description="Loss aggregation mode.")
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig, description="Optimizer and LR schedule.")
    parallel: ParallelConfig = Field(default_factory=ParallelConfig, description="Parallel layout.")
    anchor: Literal["bypass", "decoupled"] = Field(
        "bypass",
        description="bypass: mu from the engine anchors ratio and trust region; decoupled (AReaL): the learner's proximal_logp, "
        "recomputed at the start of each step, does, and mu only reweights the advantage by min(proximal/mu, cap).",
    )
    consumption_pass: bool = Field(
        True,
        description="Several updates per rollout batch with the bypass anchor: a log-prob pass over the mini-batches after "
        "the first, at the weights they were consumed with, so gap/* (pi at consumption against mu) covers every token and "
        "gap/proximal/* measures the drift within the step. false: no pass (a forward over all but the first mini-batch saved, "
        "over every one when train.epochs > 1); "
        "gap/* is measured on the first mini-batch, whose own update runs at those weights, and gap/proximal/* is not "
        "reported. The decoupled anchor needs the pass and always runs it.",
    )
    behaviour_weight_cap: float = Field(
        5.0, gt=0.0, description="decoupled: C, the cap on the behaviour weight proximal/mu (token-level TIS on ppo_clip uses 2; objectives/anchor.py).",
    )
    precision: Literal["auto", "fp32", "bf16"] = Field(
        "fp32",
        description="fp32, or bf16 mixed precision: bf16 parameters and compute, fp32 main parameters, gradients and optimizer; "
        "log-probs, entropy and the objective are always fp32. auto: bf16 with GPUs or on a CPU with bf16 arithmetic, else fp32 "
        "(controller/hardware.py; resolved when the run config loads).",
    )
    packing: Packing = Field(
        "none",
        description="none: right-padded rows, micro_batch_size sequences per micro-batch; sequences: sequences packed into rows "
        "without attending across their boundaries, micro-batches of micro_batch_tokens; shared_prompt: as sequences, and the "
        "samples of a group share one copy of their prompt (exact: each response sees the prompt and itself only).",
    )
    micro_batch_size: int = Field(4, ge=1, description="packing=none: sequences per forward/backward; gradients accumulate across micro-batches.")
    micro_batch_tokens: int = Field(
        4096, ge=1, description="packing=sequences|shared_prompt: token slots (padding included) per forward/backward."
    )
    weight_sync: Literal["object_store", "broadcast"] = Field(
        "object_store", description="How publications reach the rollout engines: object_store (rank 0 puts buckets in Ray's "
        "object store, every worker fetches them) or broadcast (a process group of rank 0 and every engine: NCCL on GPU, gloo "
        "on CPU; buckets arrive straight in the engine).",
    )
    routing_replay: bool = Field(
        False, description="MoE: the learner's routers use the experts the engine routed each token to (rollout routing "
        "replay, R3), gate weights from the learner's own scores so the router still trains; needs packing=none and an "
        "engine that records routing (hf; vllm on GPU only).",
    )
    weight_bucket_mib: int = Field(
        512, ge=1, description="A publication travels in buckets of at most this many MiB (a larger tensor alone); "
        "each worker holds one bucket beside its weights while loading.",
    )
    weight_sync_timeout_s: float = Field(
        60.0, gt=0.0, description="broadcast: a collective that takes longer fails (a dead engine cannot hang the learner); "
        "the group is then formed again without it and the publication re-sent.",
    )
    temperature: float = Field(1.0, gt=0.0, description="Sampling temperature the rollout used; log-probs are taken at it.")
    compute_entropy: bool = Field(True, description="Report the learner's per-token entropy.")
    max_chunk_elements: int = Field(2**25, ge=1024, description="Logits per chunk in the memory-bounded log-prob kernel.")
    seed: int = Field(1234, description="Seed for weight init of layers the checkpoint does not cover, and RNG state.")

    @model_validator(mode="after")
    def _expert_parallel_needs_unpacked_rows(self) -> "LearnerConfig":
        if self.parallel.expert > 1 and self.packing != "none":
            raise ValueError(
                f"learner.parallel.expert={self.parallel.expert} needs learner.packing=none (got {self.packing!r}): expert-parallel "
                "ranks exchange tokens in every MoE layer, so their micro-batches must match in count and shape, which packed "
                "micro-batches (each rank's own rows and widths) do not"
            )
        return self

    @model_validator(mode="after")
    def _replay_needs_unpacked_rows(self) -> "LearnerConfig":
        if self.routing_replay and self.packing != "none":
            raise ValueError(
                f"learner.routing_replay needs learner.packing=none (got {self.packing!r}): packed rows do not keep the "
                "engine's token positions, which the replayed routing is laid out by"
            )
        return self


class LearnerResources(Section):
    """Where and on what each learner rank runs (the run config's ``learner_resources``)."""

    cpus_per_worker: float = Field(1.0, ge=0.0, description="Ray CPUs per learner rank.")
    gpus_per_worker: float = Field(0.0, ge=0.0, description="Ray GPUs per learner rank.")
    threads: int = Field(1, ge=1, description="torch threads per learner rank.")
    node_resource: str | None = Field(
        None, min_length=1, description="Ray custom resource a node must declare to host learner ranks (each rank's bundle "
        "requests ROLE_RESOURCE_SHARE of it), e.g. learner_node as deploy/kuberay/rayjob.yaml declares; None = any node.",
    )
