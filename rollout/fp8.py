"""Block-wise fp8 rollout weights: the format fp8 checkpoints such as DeepSeek-V3's and Qwen3's
"-FP8" releases ship, which SGLang loads natively (``quantization_config.quant_method: fp8`` with
``weight_block_size``).

Every decoder projection's weight (q/k/v/o, gate/up/down, each expert's) becomes float8_e4m3fn
with one float32 scale per ``block x block`` tile, stored beside it as ``<name>_scale_inv`` (the
multiplier that dequantizes: w ~= q * scale_inv); embeddings, norms, the output head and MoE
routers stay in their dtype. The sglang engine serves fp8 rollout this way (rollout/sglang_engine.py):
it starts from a folder written by ``write_fp8_folder`` and every publication is quantized by
``quantize_named`` before it is handed over, so the engine never has to re-quantize online fp8
weights (SGLang's ``update_weights_from_tensor`` does not). Pure torch: tested on CPU.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path
from typing import Iterable, Iterator

import torch

from rollout.engine import expert_count

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max
"""448: the largest e4m3 magnitude; each tile's largest |w| is scaled onto it."""

SCALE_SUFFIX = "_scale_inv"

_PROJECTION = re.compile(r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.weight$")


def quantized(name: str, tensor: torch.Tensor) -> bool:
    """Whether ``name`` (an HF name) is one of the projections an fp8 checkpoint stores in fp8."""
    return tensor.dim() == 2 and bool(_PROJECTION.search(name))


def quantization_config(block: int) -> dict:
    """The ``quantization_config`` of config.json that makes SGLang (and vLLM) load the folder as
    block-wise fp8 with dynamic activation scales."""
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [block, block]}


def quantize_block(weight: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight of the same shape, float32 scale_inv of shape [ceil(rows/block), ceil(cols/block)]).
    A tile's scale maps its largest |w| onto FP8_MAX; an all-zero tile gets scale 1."""
    rows, cols = weight.shape
    tiles = (math.ceil(rows / block), math.ceil(cols / block))
    padded = torch.zeros(tiles[0] * block, tiles[1] * block, dtype=torch.float32, device=weight.device)
    padded[:rows, :cols] = weight.float()
    view = padded.view(tiles[0], block, tiles[1], block)
    amax = view.abs().amax(dim=(1, 3))
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (view / scale_inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(padded.shape)[:rows, :cols].contiguous(), scale_inv


def dequantize_block(q: torch.Tensor, scale_inv: torch.Tensor, block: int) -> torch.Tensor:
    """The float32 weight an fp8 tile grid stands for (what the engine computes with)."""
    scale = scale_inv.repeat_interleave(block, 0).repeat_interleave(block, 1)[: q.shape[0], : q.shape[1]]
    return q.float() * scale


def quantize_named(named: Iterable[tuple[str, torch.Tensor]], block: int) -> Iterator[tuple[str, torch.Tensor]]:
    """The named tensors of a publication (or a checkpoint) in the fp8 checkpoint's layout: each
    projection weight as (name, fp8) and (name + "_scale_inv", scales); everything else as given."""
    for name, tensor in named:
        if quantized(name, tensor):
            q, scale_inv = quantize_block(tensor, block)
            yield name, q
            yield name + SCALE_SUFFIX, scale_inv
        else:
            yield name, tensor


def block_mismatches(model_config: dict, block: int, tp: int = 1) -> list[str]:
    """What of an HF ``config.json``'s projections does not divide into whole ``block`` tiles per
    tensor-parallel rank, as SGLang checks at start (Fp8LinearMethod): every part of a fused output
    (q, k, v; gate, up; each expert's) always, and with ``tp`` > 1 the row-parallel input widths (o
    and down) too. Key/value heads that tensor parallel replicates count one per rank. Each entry
    names the width and its per-rank value."""
    text = model_config.get("text_config", model_config)
    heads, hidden = text.get("num_attention_heads"), text.get("hidden_size")
    if not heads or not hidden:
        return []
    head_dim = text.get("head_dim") or hidden // heads
    kv_heads = text.get("num_key_value_heads") or heads
    moe = expert_count(text) > 0
    dense_mlp = not moe or bool(text.get("mlp_only_layers")) or bool(text.get("first_k_dense_replace"))
    outputs = {"num_attention_heads x head_dim": heads * head_dim // tp, "num_key_value_heads x head_dim": max(1, kv_heads // tp) * head_dim}
    widths = {"intermediate_size": text.get("intermediate_size") if dense_mlp else None, "moe_intermediate_size": text.get("moe_intermediate_size") if moe else None}
    outputs.update({name: w // tp for name, w in widths.items() if w})
    inputs = {}
    if tp > 1:  # o_proj's and down_proj's inputs are split across the ranks
        inputs = {"num_attention_heads x head_dim (o_proj input)": heads * head_dim // tp}
        inputs.update({f"{name} (down_proj input)": w // tp for name, w in widths.items() if w})
    per_rank = "" if tp == 1 else f" per rank of tensor parallel {tp}"
    return [f"{name} = {value}{per_rank}" for name, value in {**outputs, **inputs}.items() if value % block]


def write_fp8_folder(source: str | Path, target: str | Path, block: int) -> Path:
    """A copy of the HF folder ``source`` with its projections in block-wise fp8 and config.json
    carrying the quantization_config; tokenizer and other files copied as they are."""
    from safetensors.torch import save_file

    from learner.weights.hf_io import load_hf_state_dict

    source, target = Path(source), Path(target)
    config = json.loads((source / "config.json").read_text())
    wrong = block_mismatches(config, block)  # at tensor parallel 1; the run config checks its own (controller/app.py)
    if wrong:
        raise ValueError(f"{source} cannot be served as {block}x{block} block fp8: {', '.join(wrong)} not a multiple of {block}")
    target.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        if path.is_file() and path.suffix != ".safetensors" and path.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy2(path, target / path.name)
    state = dict(quantize_named(load_hf_state_dict(source).items(), block))
    save_file({k: v.contiguous() for k, v in state.items()}, str(target / "model.safetensors"))
    (target / "config.json").write_text(json.dumps({**config, "quantization_config": quantization_config(block)}, indent=2))
    return target
