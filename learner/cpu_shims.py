"""Every change megatron-core needs to train on CPU with gloo, in one place. No-ops on GPU.

megatron-core (0.16.1 here; 0.17+ needs Python >= 3.12) is written for CUDA; GPTModel
trains on CPU given the settings below. ``apply()`` is idempotent and
returns immediately when CUDA is available, so the learner calls it unconditionally.

Config-level settings (``cpu_config_overrides``), each needed on CPU:
- use_cpu_initialization: parameters are otherwise created on the current CUDA device.
- gradient_accumulation_fusion: a fused CUDA kernel (wgrad accumulation into main_grad).
- bias_dropout_fusion, apply_rope_fusion, persist_layer_norm: fused CUDA or Apex kernels with no
  CPU implementation (masked_softmax_fusion is off everywhere: learner/model.py says why).

Process-level patches (``apply``):
- torch.cuda.current_device -> "cpu": megatron calls it to place buffers and RNG state; returning
  a device string makes those calls allocate on the CPU.
- the tensor-parallel RNG tracker is initialized in its inference form, which does not fork CUDA RNG
  states (it would call torch.cuda.get_rng_state); dropout is 0 anyway.
- moe_utils.te_general_gemm = None: a Transformer Engine GEMM that the MoE path probes for and uses
  when it is not None; with None it falls back to torch matmuls.
"""

from __future__ import annotations

import torch

_APPLIED = False


def on_gpu() -> bool:
    return torch.cuda.is_available()


def cpu_config_overrides() -> dict:
    """TransformerConfig fields that must take these values on CPU (empty on GPU)."""
    if on_gpu():
        return {}
    return {
        "use_cpu_initialization": True,
        "gradient_accumulation_fusion": False,
        "bias_dropout_fusion": False,
        "apply_rope_fusion": False,
        "persist_layer_norm": False,
    }


def apply() -> None:
    """Patch megatron-core for CPU execution; does nothing when CUDA is available."""
    global _APPLIED
    if _APPLIED or on_gpu():
        return
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    try:
        from megatron.core.transformer.moe import moe_utils

        moe_utils.te_general_gemm = None
    except ImportError:  # older layouts without the probe need nothing
        pass
    _APPLIED = True


def init_rng_tracker() -> None:
    """Initialize megatron's tensor-parallel RNG tracker in a CPU-safe way (after parallel_state)."""
    from megatron.core import tensor_parallel

    if on_gpu():
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
    else:
        tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True)
