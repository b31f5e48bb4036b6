"""The engine factory: builds the engine a config names. Apart from the interface (rollout/engine.py),
which every engine module imports, so no engine and the interface import each other."""

from __future__ import annotations

from rollout.engine import Engine, Precision

ENGINES = ("hf", "vllm", "sglang")


def make_engine(kind: str, model_folder: str, precision: Precision = "fp32", **kwargs) -> Engine:
    """Build the named engine; heavy imports happen only for the one chosen."""
    if precision == "auto":  # resolved where the run config is loaded (controller/hardware.py), never here
        raise ValueError("engine precision 'auto' reached the engine unresolved; resolve it with controller.hardware.resolve_precision")
    if kind == "hf":
        from rollout.hf_engine import HFEngine

        return HFEngine(model_folder, precision=precision, **kwargs)
    if kind == "vllm":
        from rollout.vllm_engine import VLLMEngine

        return VLLMEngine(model_folder, precision=precision, **kwargs)
    if kind == "sglang":
        from rollout.sglang_engine import SGLangEngine

        return SGLangEngine(model_folder, precision=precision, **kwargs)
    raise ValueError(f"unknown engine {kind!r}; expected one of {', '.join(ENGINES)}")
