"""What the machine the run starts on can compute fast, for ``precision: auto`` (read from
/proc/cpuinfo, without importing torch), and how many CUDA GPUs it has (``cuda_gpus``, which does
import torch, when it is called).

Without bf16 arithmetic units torch emulates bf16 on the CPU, far slower than fp32; with them
(AMX, AVX-512 BF16) bf16 is faster (docs/design/learner.md, "Precision", has the measured figures). So the
embedded presets say ``auto``, and it is resolved once, when the config is loaded, into what
config.yaml then records.
"""

from __future__ import annotations

from pathlib import Path

BF16_CPU_FLAGS = frozenset({"amx_bf16", "avx512_bf16", "bf16"})
"""/proc/cpuinfo flags of CPUs with bf16 arithmetic: x86's AMX and AVX-512 BF16 ("flags"), Arm's
BF16 extension ("Features")."""


def cpu_has_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU (or the one ``cpuinfo``, a /proc/cpuinfo text, describes) has bf16
    arithmetic; False where /proc/cpuinfo cannot be read."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features") and BF16_CPU_FLAGS & set(value.split()):
            return True
    return False


def auto_precision(gpus: float, cpu_bf16: bool | None = None) -> str:
    """``auto`` for one role: bf16 where it is given GPUs or the CPU has bf16 arithmetic, else fp32."""
    return "bf16" if gpus > 0 or (cpu_has_bf16() if cpu_bf16 is None else cpu_bf16) else "fp32"


def cuda_gpus() -> int:
    """The CUDA GPUs this process sees (CUDA_VISIBLE_DEVICES applies; 0 with a CPU-only torch)."""
    import torch

    return torch.cuda.device_count()


def resolve_precision(cfg, cpu_bf16: bool | None = None):
    """``cfg`` (a RunConfig) with ``rollout.precision`` and ``learner.precision`` set from ``auto``
    to what this machine computes fast; unchanged where neither is ``auto``."""
    update = {}
    if cfg.rollout.precision == "auto":
        update["rollout"] = cfg.rollout.model_copy(update={"precision": auto_precision(cfg.rollout.gpus_per_worker, cpu_bf16)})
    if cfg.learner.precision == "auto":
        update["learner"] = cfg.learner.model_copy(update={"precision": auto_precision(cfg.learner_resources.gpus_per_worker, cpu_bf16)})
    return cfg.model_copy(update=update) if update else cfg
