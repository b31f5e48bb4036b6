"""Hugging Face weights as files and as transformers holds them in memory: loading a folder's
safetensors, and the per-expert names publications use for MoE models. Torch and safetensors
only: the engines load through this without importing the learner's model code."""

from __future__ import annotations

from pathlib import Path

import torch


def load_hf_state_dict(folder: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face folder's safetensors files, on CPU."""
    from safetensors.torch import load_file

    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {folder}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def unfuse_experts(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers >= 5 keeps MoE experts fused in memory (experts.gate_up_proj [E, 2F, H],
    experts.down_proj [E, H, F]); checkpoints on disk and vLLM use one tensor per expert. Returns
    the per-expert form (a no-op on checkpoint-format dicts)."""
    out = {}
    for name, t in hf.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix = name[: -len("gate_up_proj")]
            for e, fused in enumerate(t):
                gate, up = torch.chunk(fused, 2, dim=0)
                out[f"{prefix}{e}.gate_proj.weight"], out[f"{prefix}{e}.up_proj.weight"] = gate, up
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name[: -len("down_proj")]
            out.update({f"{prefix}{e}.down_proj.weight": w for e, w in enumerate(t)})
        else:
            out[name] = t
    return out
