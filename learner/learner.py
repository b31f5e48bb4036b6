"""The Learner: one rank's megatron-core model, optimizer and DRPO (or any registered) step.

A plain class, built in tests without Ray; ``learner/worker.py`` wraps it in a Ray actor. The
process group and megatron's parallel_state must be initialized first (learner/distributed.py).

One call of ``train`` is one rollout batch: in decoupled mode the proximal log-probs of every
mini-batch are computed first, then one optimizer update per mini-batch, then the version advances
once. Metrics are accumulated by kind over every micro-batch of every update and reduced across
data-parallel ranks once (learner/metrics.py). The data convention is ``TrainBatch``'s (learner/batch.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Iterator

import torch
import torch.distributed as dist

import objectives
from learner import bridge, checkpoint, optim, packing
from learner.weights.hf_io import load_hf_state_dict
from learner import model as modeling
from learner.batch import TrainBatch
from learner.config import LearnerConfig
from learner import distributed
from learner.distributed import tp_rank_size
from learner.metrics import MetricAccumulator
from learner.routing import Routing
from objectives.anchor import decoupled_inputs
from objectives.base import Metric, masked_mean
from objectives.diagnostics import abs_shift_mean, gap_metrics, gap_metrics_by_lag
from objectives.logprobs import TokenLogProbs, logprobs_from_hidden


@dataclass(frozen=True)
class StepMetrics:
    """What one optimizer step reports (floats, namespaced keys in ``values``)."""

    updates: int
    """Optimizer updates so far (a controller step, one rollout batch, takes train.mini_batches of them)."""
    version: int
    """The policy version after the batch (one per rollout batch, however many updates)."""
    loss: float
    """Mean over the batch's updates."""
    grad_norm: float
    """Mean over the batch's updates (learner/grad_norm_max has the largest)."""
    lr: float
    tokens: int
    seconds: float
    values: dict[str, float] = field(default_factory=dict)
    """objective/* (every objective diagnostic), gap/*, learner/*; each reduced by its kind over all
    micro-batches, updates and data-parallel ranks; histograms as '/bin_i'."""


class Learner:
    """One rank of a learner group."""

    def __init__(self, cfg: LearnerConfig, arch: modeling.ModelArch, weights: dict[str, torch.Tensor] | None = None):
        """Build the model (megatron names, full tensors in ``weights``, sharded here), DDP and AdamW."""
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        if cfg.precision == "auto":  # resolved where the run config is loaded (controller/hardware.py)
            raise ValueError("learner.precision 'auto' reached the learner unresolved; resolve it with controller.hardware.resolve_precision")
        self.cfg, self.arch = cfg, arch
        torch.manual_seed(cfg.seed)
        self.tp_rank, self.tp_size = tp_rank_size()
        module = modeling.build_gpt(arch, expert_parallel=cfg.parallel.expert, tensor_parallel=cfg.parallel.tensor, precision=cfg.precision)
        loaded = self._load_full(module, weights) if weights is not None else {}
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=torch.cuda.is_available()
        )
        self.model = DistributedDataParallel(module.config, ddp_config, module)
        # bf16: the optimizer's fp32 main parameters start from the weights as given, not from their
        # bf16 rounding (which would put every main parameter on the bf16 grid, where updates much
        # smaller than half a bf16 step leave the bf16 weights unchanged for many steps)
        main = {id(p): loaded[name] for name, p in module.named_parameters() if name in loaded}
        self.optimizer = optim.build(self.model, cfg.optimizer, self.tp_size, bf16=cfg.precision == "bf16", initial=main)
        self.device = next(self.module.parameters()).device
        self.routing = Routing(module) if arch.num_experts else None
        self.step_count = 0
        self.version = 0

    @classmethod
    def build(cls, config: LearnerConfig, *, model_folder) -> "Learner":
        """This rank's learner, with the weights of the HF model in ``model_folder`` (the process
        group must be initialized: learner.distributed.init)."""
        LearnerConfig.expect(config, "Learner")
        arch = modeling.ModelArch.from_hf_folder(model_folder)
        return cls(config, arch, bridge.hf_to_megatron(load_hf_state_dict(model_folder), arch))

    # ---- forward ----------------------------------------------------------------------------------

    @property
    def module(self):
        return self.model.module

    def _load_full(self, module, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Load full weights (sharded here); returns this rank's shards at their given precision."""
        from megatron.core import parallel_state

        own = module.state_dict()
        ep_rank, ep_size = parallel_state.get_expert_model_parallel_rank(), parallel_state.get_expert_model_parallel_world_size()
        shards = {}
        for name, full in weights.items():
            local = bridge.expert_local_name(name, ep_rank, ep_size, self.arch.num_experts or 1)
            if local is not None:
                shards[local] = bridge.shard(local, full, self.tp_rank, self.tp_size)
        unknown = sorted(set(shards) - set(own))
        if unknown:
            raise KeyError(f"weights for parameters the model does not have: {unknown[:5]}")
        result = module.load_state_dict(shards, strict=False)
        missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
        if missing:
            raise KeyError(f"weights missing for {missing[:5]}")
        return shards

    def _output_weight(self) -> torch.Tensor:
        weight = modeling.output_weight(self.module)
        if self.tp_size == 1:
            return weight
        from megatron.core import parallel_state

        return distributed.GatherVocabShards.apply(weight, parallel_state.get_tensor_model_parallel_group(), self.tp_rank, self.tp_size)

    def token_logprobs(self, input_ids: torch.Tensor, ids: torch.Tensor | None = None) -> TokenLogProbs:
        """Per-token statistics aligned with input_ids (position 0 is 0); differentiable when grad is on.
        ``ids`` [N, S, K] (aligned the same way): also the log-probs of those ids (``ids_logp``)."""
        scored = torch.ones(input_ids.shape, dtype=torch.bool)
        scored[:, 0] = False
        return self._packed_logprobs(packing.unpacked(input_ids), input_ids, scored, ids)

    def _packed_logprobs(
        self, packed: packing.Packed, input_ids: torch.Tensor, scored: torch.Tensor, ids: torch.Tensor | None, routed: torch.Tensor | None = None,
    ) -> TokenLogProbs:
        """Statistics of the tokens ``scored`` [n, S] of rows ``input_ids`` [n, S], computed by one
        forward of their packed layout; zero elsewhere. The output projection and softmax run on
        the scored tokens only (always in fp32, from hidden states of the learner's precision).
        ``routed`` [n, S, layers, k]: the engine's expert ids (MoE), replayed with ``routing_replay``
        and compared with the learner's own routing (``routing_metrics``)."""
        device = self.device
        if self.routing is not None:
            # packed rows do not keep the engine's positions: its routing is neither replayed there
            # (the config refuses routing_replay with packing) nor compared
            unpacked = self.cfg.packing == "none" or packed.input_ids is input_ids  # token_logprobs' own plain layout
            self.routing.prepare(routed if unpacked else None, self.cfg.routing_replay)
        hidden = modeling.forward_hidden(
            self.module, packed.input_ids.to(device), packed.position_ids.to(device), packed.attention_mask.to(device)
        )
        scored = scored.to(device) & (packed.source.to(device) >= 0)
        source = packed.source.to(device)[scored]
        out = logprobs_from_hidden(
            hidden.reshape(-1, hidden.shape[-1])[source], self._output_weight(), input_ids.to(device)[scored], self.cfg.temperature,
            entropy=self.cfg.compute_entropy, max_chunk_elements=self.cfg.max_chunk_elements,
            ids=None if ids is None else ids.to(device)[scored],
        )

        def place(t):  # [M, ...] values of the scored tokens, row-major, back into [n, S, ...]
            if t is None:
                return None
            full = torch.zeros((*scored.shape, *t.shape[1:]), dtype=t.dtype, device=device)
            where = scored.view(*scored.shape, *([1] * (t.dim() - 1))).expand_as(full)
            return full.masked_scatter(where, t)

        return TokenLogProbs(place(out.logp), place(out.entropy), place(out.topk_logp), place(out.topk_ids), place(out.ids_logp))

    @torch.no_grad()
    def compute_logprobs(self, input_ids: torch.Tensor, ids: torch.Tensor | None = None) -> TokenLogProbs:
        """Log-probs without gradient (proximal_logp recomputation, evaluation)."""
        self.model.eval()
        return self.token_logprobs(input_ids, ids)

    def _micro_batches(self, batch: TrainBatch) -> list[tuple[list[int], TrainBatch, packing.Packed]]:
        """The batch's micro-batches: (the batch rows each holds, its TrainBatch, its forward
        layout). packing=none slices micro_batch_size right-padded rows; the packed modes fill
        micro_batch_tokens token slots."""
        if self.cfg.packing == "none":
            n, size = batch.input_ids.shape[0], self.cfg.micro_batch_size
            return [
                (list(range(s, min(n, s + size))), mb, packing.unpacked(mb.input_ids, mb.response_mask))
                for s, mb in zip(range(0, n, size), batch.micro_batches(size))
            ]
        plan = packing.micro_batches(batch.input_ids.cpu(), batch.response_mask.cpu(), self.cfg.packing, self.cfg.micro_batch_tokens)
        return [(rows, batch.select(rows), packed) for rows, packed in plan]

    @torch.no_grad()
    def batch_logprobs(self, batch: TrainBatch) -> TokenLogProbs:
        """pi now at the batch's response tokens [N, S] (0 elsewhere), laid out and micro-batched
        as a training step would; with engine top-K ids, also pi on them (``ids_logp``)."""
        self.model.eval()
        logp = torch.zeros(batch.input_ids.shape)
        topk = torch.zeros(batch.rollout_topk_ids.shape) if batch.rollout_topk_ids is not None else None
        for rows, mb, packed in self._micro_batches(batch):
            stats = self._packed_logprobs(packed, mb.input_ids, mb.response_mask, mb.rollout_topk_ids, mb.routed_experts)
            logp[rows] = stats.logp.cpu()
            if topk is not None:
                topk[rows] = stats.ids_logp.cpu()
        return TokenLogProbs(logp, ids_logp=topk)

    # ---- step -------------------------------------------------------------------------------------

    def train(self, mini_batches: list[TrainBatch] | TrainBatch, epochs: int = 1) -> StepMetrics:
        """One rollout batch: ``epochs`` passes, each an optimizer update per mini-batch (one
        TrainBatch, one epoch: one update), then the version advances once (the policy version
        counts rollout batches, what the staleness bound is stated in).

        The log-probs at consumption (``proximal_logp``, the weights before any of this batch's
        updates) come first for every mini-batch when the decoupled anchor needs them (AReaL, arXiv
        2505.24298) or when there is more than one update: gap/* must be pi at consumption
        against mu, not include the drift of this batch's own earlier updates (which is reported
        apart, as gap/proximal/*, and per update as gap/update_<i>/abs_shift_mean: pi at update i
        against mu). The first mini-batch needs no extra pass, nor does one update: the first
        update's forward runs at the consumption weights, so its pi is the proximal log-prob.
        With the bypass anchor, ``consumption_pass`` false skips the pass: gap/* then comes
        from the first mini-batch alone and gap/proximal/* is not reported."""
        started = time.perf_counter()
        if isinstance(mini_batches, TrainBatch):
            mini_batches = [mini_batches]
        for mb in mini_batches:
            if mb.version is not None and mb.version != self.version:
                raise RuntimeError(f"a batch consumed at version {mb.version} reached the learner at version {self.version}")
        decoupled = self.cfg.anchor == "decoupled"
        proximal = decoupled or (len(mini_batches) * epochs > 1 and self.cfg.consumption_pass)
        if proximal:  # a later epoch revisits the first mini-batch after updates: it needs the pass too
            mini_batches = [mb if i == 0 and epochs == 1 else self._with_proximal(mb) for i, mb in enumerate(mini_batches)]
        acc = MetricAccumulator(self.device)
        losses, norms, tokens = [], [], 0
        for index, mb in enumerate(mini_batches * epochs):
            # without the pass (several bypass updates, consumption_pass false) only the first
            # update's forward runs at the consumption weights: gap/* is measured there alone
            loss, grad_norm, count = self._update(
                mb, acc, index, own_proximal=proximal and mb.proximal_logp is None, consumption=index == 0 or mb.proximal_logp is not None,
            )
            losses.append(loss)
            norms.append(grad_norm)
            tokens += count if index < len(mini_batches) else 0  # the batch's tokens, once however many passes
        self.version += 1
        loss = torch.stack(losses)
        if self._dp_size() > 1:  # each rank's loss is normalized by global counts: ranks' parts add up
            dist.all_reduce(loss, group=self._dp_group())
        values = acc.reduce(self._dp_group())
        values["learner/entropy_mean"] = values.pop("gap/entropy_mean", float("nan"))
        values.update({"learner/grad_norm_max": max(norms), "learner/updates": len(losses)})
        return StepMetrics(
            updates=self.step_count, version=self.version, loss=float(loss.mean()), grad_norm=sum(norms) / len(norms),
            lr=self.optimizer.lr, tokens=tokens, seconds=time.perf_counter() - started, values=values,
        )

    def _with_proximal(self, batch: TrainBatch) -> TrainBatch:
        """The batch with the learner's log-probs now (before updating on it) as proximal_logp,
        and on the engine's top-K ids as proximal_topk_logp; micro-batch by micro-batch, so the
        pass needs no more memory than a training forward."""
        stats = self.batch_logprobs(batch)
        return replace(batch, proximal_logp=stats.logp, proximal_topk_logp=stats.ids_logp)

    def _objective_inputs(self, mb: TrainBatch, stats: TokenLogProbs) -> tuple[objectives.ObjectiveInputs, dict[str, Metric]]:
        """What the objective sees. bypass: mu anchors it. decoupled: proximal_logp anchors it and mu
        enters only as the behaviour weight min(proximal/mu, cap) on the advantage (objectives/anchor.py;
        with ppo_clip and one update per batch, token-level TIS)."""
        mask = mb.response_mask
        if objectives.required_topk(self.cfg.objective) and mb.rollout_topk_ids is None:
            raise ValueError(
                f"{self.cfg.objective.type} needs the engine's top-K log-probs: TrainBatch.rollout_topk_ids and rollout_topk_logp [N, S, K]"
            )
        if self.cfg.anchor == "bypass":
            inputs = objectives.ObjectiveInputs(
                stats.logp, mb.rollout_logp, mb.advantages, mask, rollout_topk_logp=mb.rollout_topk_logp, policy_topk_logp=stats.ids_logp
            )
            return inputs, {}
        return decoupled_inputs(
            stats.logp, mb.rollout_logp, mb.proximal_logp, mb.advantages, mask, self.cfg.behaviour_weight_cap, mb.proximal_topk_logp, stats.ids_logp
        )

    def _update(
        self, batch: TrainBatch, acc: MetricAccumulator, index: int = 0, own_proximal: bool = False, consumption: bool = True,
    ) -> tuple[torch.Tensor, float, int]:
        """Forward/backward over micro-batches, gradient all-reduce, clipped optimizer step, LR
        schedule; ``index`` is the update's place in its rollout batch; ``own_proximal``: this
        forward's pi (detached) is the proximal log-prob (the weights have not moved since the
        batch was consumed); ``consumption``: pi at consumption is known for this batch (its own
        forward's or a pass's), so gap/* is measured on it. Returns this rank's loss (a tensor: no
        host sync), the grad norm and the global number of response tokens."""
        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        normalizer, tokens = self._global_normalizer(batch)
        dp = self._dp_size()
        delta = getattr(self.cfg.objective, "delta", None)  # the trust region, for gap/beyond_delta_frac
        total_loss = torch.zeros((), device=self.device)
        slots = real = 0
        for _, mb, packed in self._micro_batches(batch.to(self.device)):
            slots, real = slots + packed.tokens, real + packed.real_tokens
            stats = self._packed_logprobs(packed, mb.input_ids, mb.response_mask, mb.rollout_topk_ids, mb.routed_experts)
            if own_proximal:
                ids_logp = None if stats.ids_logp is None else stats.ids_logp.detach()
                mb = replace(mb, proximal_logp=stats.logp.detach(), proximal_topk_logp=ids_logp)
            if self.routing is not None:
                acc.add("gap/", self.routing.metrics())
            inputs, anchor_metrics = self._objective_inputs(mb, stats)
            out = objectives.compute(self.cfg.objective, inputs)
            loss = objectives.aggregate(out.loss, mb.response_mask, self.cfg.aggregation.mode, normalizer, self.cfg.aggregation.horizon)
            # the loss is already normalized by global counts, so ranks' gradients must add, not average
            (loss * dp).backward()
            total_loss += loss.detach()
            acc.add("objective/", out.metrics)
            acc.add("learner/", anchor_metrics)
            if consumption:
                self._gap_metrics(acc, stats, mb, delta)
            if stats.entropy is not None:  # the training forward's own, for every update whatever gap/* covers
                acc.add("gap/", {"entropy_mean": masked_mean(stats.entropy, mb.response_mask.bool())})
            acc.add(f"gap/update_{index}/", {"abs_shift_mean": abs_shift_mean(stats.logp.detach(), mb.rollout_logp, mb.response_mask)})
        acc.add("learner/", {
            "forward_tokens": Metric(torch.tensor(float(slots)), "sum"),
            "padding_frac": Metric(torch.tensor(1.0 - real / max(1, slots)), "mean", count=torch.tensor(float(slots))),
        })
        self.model.finish_grad_sync()
        grad_norm = self.optimizer.step()
        self.step_count += 1
        return total_loss, grad_norm, tokens

    @staticmethod
    def _gap_metrics(acc: MetricAccumulator, stats: TokenLogProbs, mb: TrainBatch, delta: float | None) -> None:
        """gap/* is always pi at consumption against mu from the engine (split by lag when the batch
        has lags): proximal_logp where the step computed it, else the update's own pi (one
        mini-batch: the same weights). gap/proximal/* adds pi now against pi at consumption."""
        logp, mask = stats.logp.detach(), mb.response_mask
        consumed = logp if mb.proximal_logp is None else mb.proximal_logp
        acc.add("gap/", gap_metrics(consumed, mb.rollout_logp, mask, delta))
        if mb.version_lag is not None:
            by_lag = gap_metrics_by_lag(consumed, mb.rollout_logp, mb.version_lag, mask, delta, mb.context_lag)
            acc.add("gap/", {k: v for k, v in by_lag.items() if not k.startswith("all/")})
        if mb.proximal_logp is not None:
            acc.add("gap/proximal/", gap_metrics(logp, mb.proximal_logp, mask, delta))

    def _global_normalizer(self, batch: TrainBatch) -> tuple[torch.Tensor, int]:
        mask = batch.response_mask
        counts = torch.tensor([mask.sum(), (mask.sum(dim=1) > 0).sum()], dtype=torch.float64, device=self.device)
        if self._dp_size() > 1:
            dist.all_reduce(counts, group=self._dp_group())
        tokens = int(counts[0])
        return (counts[0] if self.cfg.aggregation.mode == "token-mean" else counts[1]).float(), tokens

    def _dp_group(self):
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_group()

    def _dp_size(self) -> int:
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_world_size()

    # ---- weights out, checkpoints ------------------------------------------------------------------

    def full_megatron_state(self) -> dict[str, torch.Tensor]:
        """Unsharded megatron-named weights: tensor-parallel shards and expert-parallel experts
        are all-gathered, experts renamed to their global index. Every rank must call it."""
        from megatron.core import parallel_state

        state = self._own_tensors()
        if self.tp_size > 1:
            group = parallel_state.get_tensor_model_parallel_group()
            state = {name: bridge.unshard(name, distributed.all_gather_parts(t, self.tp_size, group)) for name, t in state.items()}
        ep_size = parallel_state.get_expert_model_parallel_world_size()
        if ep_size == 1:
            return state
        group = parallel_state.get_expert_model_parallel_group()
        full = {}
        for name, t in state.items():
            if ".mlp.experts.local_experts." not in name:
                full[name] = t
                continue
            for ep_rank, part in enumerate(distributed.all_gather_parts(t, ep_size, group)):
                full[bridge.expert_global_name(name, ep_rank, ep_size, self.arch.num_experts)] = part
        return full

    def _own_tensors(self) -> dict[str, torch.Tensor]:
        """This rank's model tensors, without megatron's _extra_state entries."""
        return {k: v.detach() for k, v in self.module.state_dict().items() if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")}

    def hf_named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The current weights under Hugging Face names, for rollout engines."""
        return bridge.megatron_to_hf(self.full_megatron_state(), self.arch)

    def save_checkpoint(self, path) -> None:
        checkpoint.save(path, self._checkpoint_state())

    def load_checkpoint(self, path) -> None:
        state = checkpoint.load(path)
        checkpoint.check_compatible(state, self._checkpoint_meta())
        expected, saved = set(self._own_tensors()), set(state["model"])
        if expected != saved:  # strict=False below only skips megatron's _extra_state entries
            missing, extra = sorted(expected - saved), sorted(saved - expected)
            raise checkpoint.CheckpointError(
                f"checkpoint {path} does not hold this model's weights: {len(missing)} missing ({', '.join(missing[:4])}), "
                f"{len(extra)} unexpected ({', '.join(extra[:4])})"
            )
        self.module.load_state_dict(state["model"], strict=False)
        self.optimizer.load_state_dict(state["optimizer"])
        self.step_count, self.version = int(state["step"]), int(state["version"])
        torch.set_rng_state(state["rng"]["torch"])

    def _checkpoint_meta(self) -> dict:
        return {"arch": self.arch.__dict__, "tp_rank": self.tp_rank, "tp_size": self.tp_size}

    def _layout(self) -> dict:
        """Where this rank's tensors sit in the full model: what ``learner.export`` merges by."""
        from megatron.core import parallel_state

        return {
            "tp_rank": self.tp_rank, "tp_size": self.tp_size,
            "ep_rank": parallel_state.get_expert_model_parallel_rank(), "ep_size": parallel_state.get_expert_model_parallel_world_size(),
        }

    def _checkpoint_state(self) -> dict:
        return {
            "meta": self._checkpoint_meta(),
            "layout": self._layout(),
            "model": self._own_tensors(),
            "optimizer": self.optimizer.state_dict(),
            "step": self.step_count,
            "version": self.version,
            "rng": {"torch": torch.get_rng_state()},
        }
