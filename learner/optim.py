"""The learner's optimizer: torch AdamW over megatron's main_grad on CPU, megatron's distributed
optimizer on GPU, behind one small interface (step -> grad norm, LR schedule, state dicts).

megatron-core's get_megatron_optimizer needs CUDA; on CPU, AdamW over each parameter's
``main_grad`` (the fp32 buffer megatron's DDP reduces into) after ``finish_grad_sync()`` is exact.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from learner.config import OptimizerConfig


def lr_factor(opt: OptimizerConfig, step: int) -> float:
    """Multiplier of the peak LR at ``step`` (0-based): linear warm-up, then constant/linear/cosine."""
    if step < opt.warmup_steps:
        return (step + 1) / (opt.warmup_steps + 1)
    if opt.schedule == "constant":
        return 1.0
    progress = min(1.0, (step - opt.warmup_steps) / max(1, opt.total_steps - opt.warmup_steps))
    decay = 1.0 - progress if opt.schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return opt.min_lr_ratio + (1.0 - opt.min_lr_ratio) * decay


def global_grad_norm(params, tp_size: int) -> float:
    """L2 norm over every rank's shards, counting tensor-parallel replicas once.

    Dense parameters sum over the tensor-parallel group (data-parallel ranks hold identical reduced
    grads); expert parameters (``allreduce`` False under expert parallelism) over the expert group.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    device = params[0].grad.device if params else torch.device("cpu")
    dense = torch.zeros((), dtype=torch.float64, device=device)
    expert = torch.zeros((), dtype=torch.float64, device=device)
    for p in params:
        # per tensor in its own dtype (torch's norm accumulates blockwise), summed across tensors
        # in float64: as accurate as a float64 copy of every gradient, without making one
        sq = torch.linalg.vector_norm(p.grad).double().pow(2)
        if not getattr(p, "allreduce", True):
            expert += sq
        elif param_is_not_tensor_parallel_duplicate(p):
            dense += sq
    if tp_size > 1:
        dist.all_reduce(dense, group=parallel_state.get_tensor_model_parallel_group())
    if parallel_state.get_expert_model_parallel_world_size() > 1:
        dist.all_reduce(expert, group=parallel_state.get_expert_model_parallel_group())
    return float((dense + expert).sqrt())


class TorchAdamW:
    """CPU path: AdamW over main_grad, global-norm clipping, LambdaLR schedule. Skips non-finite steps.

    Mixed precision (bf16 parameters): AdamW steps fp32 main parameters with the fp32 gradients
    DDP accumulated in ``main_grad``, then copies them into the bf16 parameters the model
    computes with (megatron-core's standard scheme). The main parameters are part of the state
    dict, so a resumed run continues from the same fp32 values, not from their bf16 rounding."""

    def __init__(self, model, cfg: OptimizerConfig, tp_size: int, initial: dict[int, torch.Tensor] | None = None):
        """``initial``: fp32 starting values of main parameters by ``id(param)`` (the weights as
        loaded, before their bf16 rounding); a parameter without one starts from its own value."""
        self.cfg, self.tp_size = cfg, tp_size
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.mixed = any(p.dtype != torch.float32 for p in self.params)
        initial = initial or {}
        self.main = [self._main_copy(p, initial.get(id(p))) for p in self.params] if self.mixed else self.params
        # fused: one pass over each tensor's parameter, gradient and moments (torch's CPU and CUDA
        # kernel); the default multi-tensor path makes several, 0.28-0.48 s against 0.07-0.08 s per
        # step for SmolLM2-135M on 2 CPU cores (AVX2 EPYC)
        self.optimizer = torch.optim.AdamW(self.main, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay, fused=True)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: lr_factor(cfg, step))

    @staticmethod
    def _main_copy(p: torch.Tensor, start: torch.Tensor | None) -> torch.Tensor:
        if start is not None and start.shape != p.shape:
            raise ValueError(f"initial main parameter of shape {tuple(start.shape)} for a parameter of shape {tuple(p.shape)}")
        main = (p.detach() if start is None else start).float().clone()
        for attr in ("allreduce", "tensor_model_parallel", "partition_dim", "partition_stride"):  # read by global_grad_norm
            if hasattr(p, attr):
                setattr(main, attr, getattr(p, attr))
        return main

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def step(self) -> float:
        for p, main in zip(self.params, self.main):
            main.grad = p.main_grad.to(main.dtype)
        norm = global_grad_norm(self.main, self.tp_size)
        clip = self.cfg.grad_clip
        if clip is not None and math.isfinite(norm) and norm > clip:
            for main in self.main:
                main.grad.mul_(clip / (norm + 1e-6))
        if math.isfinite(norm):  # a NaN/inf gradient skips the update instead of poisoning the weights
            self.optimizer.step()
            if self.mixed:
                with torch.no_grad():
                    for p, main in zip(self.params, self.main):
                        p.copy_(main)
        self.scheduler.step()
        return norm

    @property
    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    def state_dict(self) -> dict:
        state = {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}
        if self.mixed:
            state["main_params"] = [m.detach().clone() for m in self.main]
        return state

    def load_state_dict(self, state: dict) -> None:
        if self.mixed != ("main_params" in state):
            raise ValueError("checkpoint optimizer state is for another learner.precision (fp32 vs bf16 main parameters)")
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if self.mixed:
            saved = state["main_params"]
            if [tuple(t.shape) for t in saved] != [tuple(m.shape) for m in self.main]:
                raise ValueError(f"checkpoint holds {len(saved)} main parameters that do not match this model's {len(self.main)}")
            with torch.no_grad():
                for main, value in zip(self.main, saved):
                    main.copy_(value)


class MegatronDistributedAdam:
    """GPU path: megatron-core's distributed optimizer (optimizer states sharded over data parallel).
    With bf16 parameters its fp32 main parameters are copied from the bf16 weights (megatron's own
    construction), so they start on the bf16 grid (see TorchAdamW); a bf16 checkpoint does anyway.

    Written against megatron-core's public get_megatron_optimizer; exercised only on GPU (tests
    marked gpu, not run yet). It cannot be built on CPU: megatron's mixed-precision optimizer
    allocates its scalars with device="cuda", the distributed optimizer refuses parameters that are
    not torch.cuda tensors (_build_model_and_main_param_groups) and its buffers live on
    torch.cuda.current_device().

    Checkpoints use megatron's "dp_zero" parameter-state format (what Megatron-LM's torch checkpoint
    format saves): every rank keeps the optimizer's own state_dict (param groups, steps), and the
    sharded fp32 main parameters and Adam moments are gathered over each optimizer's data-parallel
    group with gloo (get_parameter_state_dp_zero) into data-parallel rank 0's file, then scattered
    back on load (load_parameter_state_from_dp_zero). Saving and loading are collective: every rank
    calls them together (LearnerGroup does); the run folder's temp-folder-and-rename keeps it atomic.
    dist_checkpointing's sharded format (resharding across layouts) is not used: its torch_dist
    save synchronizes CUDA streams and needs NCCL-side tensors, and a resumed run keeps its layout.
    """

    def __init__(self, model, cfg: OptimizerConfig, tp_size: int, bf16: bool = False):
        from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
        from megatron.core.optimizer import get_megatron_optimizer

        self.cfg, self._step = cfg, 0
        self.optimizer = get_megatron_optimizer(
            MegatronOptimizerConfig(
                optimizer="adam", lr=cfg.lr, weight_decay=cfg.weight_decay, adam_beta1=cfg.betas[0], adam_beta2=cfg.betas[1],
                adam_eps=cfg.eps, clip_grad=cfg.grad_clip or 0.0, use_distributed_optimizer=True, params_dtype=torch.float32, bf16=bf16,
            ),
            [model],
        )

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def step(self) -> float:
        for group in self.optimizer.param_groups:
            group["lr"] = self.cfg.lr * lr_factor(self.cfg, self._step)
        _, grad_norm, _ = self.optimizer.step()
        self._step += 1
        return float(grad_norm) if grad_norm is not None else math.nan

    @property
    def lr(self) -> float:
        return self.cfg.lr * lr_factor(self.cfg, max(0, self._step - 1))

    def _parts(self) -> list:
        """The optimizers megatron chained (dense and expert parameters have their own), or this one."""
        return list(getattr(self.optimizer, "chained_optimizers", [self.optimizer]))

    def state_dict(self) -> dict:
        """Collective (every rank at once): this rank's optimizer state, and on each part's
        data-parallel rank 0 the part's gathered parameter state (None elsewhere)."""
        param_state = [part.get_parameter_state_dp_zero(use_gloo_comm=True) for part in self._parts()]
        return {"optimizer": self.optimizer.state_dict(), "param_state": param_state, "step": self._step}

    def load_state_dict(self, state: dict) -> None:
        """Collective: restores the optimizer state, then scatters each part's parameter state from
        its data-parallel rank 0 (whose checkpoint file holds it) to every rank of the part."""
        parts = self._parts()
        if len(state.get("param_state", ())) != len(parts):
            raise ValueError(f"the checkpoint holds {len(state.get('param_state', ()))} optimizer parts, this learner has {len(parts)}")
        self.optimizer.load_state_dict(state["optimizer"])
        for part, param_state in zip(parts, state["param_state"]):
            # megatron's dp_zero loader copies into every entry of a parameter's optimizer state, and
            # without Apex or Transformer Engine that state (torch's Adam) holds a "step" the gathered
            # parameter state does not carry (KeyError on CUDA): set "step" aside while it copies, and
            # copy without autograd (the main parameters require grad)
            steps = {p: s.pop("step") for p, s in part.optimizer.state.items() if "step" in s}
            try:
                with torch.no_grad():
                    part.load_parameter_state_from_dp_zero(param_state if part.data_parallel_group.rank() == 0 else None)
            finally:
                for p, step in steps.items():
                    part.optimizer.state[p]["step"] = step
            unshare_steps(part.optimizer)
        self._step = int(state["step"])


def unshare_steps(optimizer: torch.optim.Optimizer) -> None:
    """Give each parameter's Adam "step" a tensor of its own. megatron's DistributedOptimizer loads
    one step tensor into every parameter's state, and torch's Adam adds 1 to each parameter's step
    in place, so a shared tensor advanced once per parameter on every update after a resume: Adam's
    bias correction vanished and the first resumed update was several times too large (seen on an
    H200, where the resumed step differed from the uninterrupted one)."""
    seen: set[int] = set()
    for state in optimizer.state.values():
        step = state.get("step")
        if isinstance(step, torch.Tensor):
            if id(step) in seen:
                state["step"] = step.clone()
            seen.add(id(step))


def build(model, cfg: OptimizerConfig, tp_size: int, bf16: bool = False, initial: dict[int, torch.Tensor] | None = None):
    """bf16: the model's parameters are bf16 and the optimizer keeps fp32 main parameters, starting
    from ``initial`` (CPU path; megatron's optimizer copies its main parameters from the model)."""
    if torch.cuda.is_available():
        return MegatronDistributedAdam(model, cfg, tp_size, bf16)
    return TorchAdamW(model, cfg, tp_size, initial)
