"""Block-wise fp8 rollout weights (rollout/fp8.py), the format the sglang engine serves fp8 in:
tiles quantized with their own scales, the projections chosen by name, a checkpoint folder SGLang
loads as fp8, and models whose widths do not tile refused by field before anything starts."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from controller.app import check_layout
from controller.config import ConfigError, RunConfig, load_config
from rollout.fp8 import FP8_DTYPE, FP8_MAX, block_mismatches, dequantize_block, quantize_block, quantize_named, write_fp8_folder


def reference_tile_quantization(weight: torch.Tensor, block: int) -> torch.Tensor:
    """Tile by tile with a loop (independent of the vectorized code): what each tile dequantizes to."""
    out = torch.empty_like(weight, dtype=torch.float32)
    for r in range(0, weight.shape[0], block):
        for c in range(0, weight.shape[1], block):
            tile = weight[r : r + block, c : c + block].float()
            scale = tile.abs().max() / FP8_MAX if tile.abs().max() > 0 else torch.tensor(1.0)
            out[r : r + block, c : c + block] = (tile / scale).to(FP8_DTYPE).float() * scale
    return out


def test_each_tile_has_its_own_scale_and_partial_tiles_are_kept():
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(200, 72, generator=g) * torch.logspace(-3, 1, 200)[:, None]  # rows of very different sizes
    weight[:64, :64] = 0.0  # an all-zero tile
    q, scale_inv = quantize_block(weight, 64)
    assert q.dtype == FP8_DTYPE and q.shape == weight.shape and scale_inv.shape == (4, 2) and scale_inv.dtype == torch.float32
    assert scale_inv[0, 0] == 1.0 and torch.all(q[:64, :64].float() == 0)
    back = dequantize_block(q, scale_inv, 64)
    assert torch.equal(back, reference_tile_quantization(weight, 64))
    for r in range(4):  # e4m3 keeps 3 mantissa bits: within 1/16 of the tile's largest value, however small the tile
        tile = weight[r * 64 : (r + 1) * 64]
        assert (back[r * 64 : (r + 1) * 64] - tile).abs().max() <= tile.abs().max() / 16
    per_tensor = weight.abs().max() / FP8_MAX  # one scale for all would flush the small rows to zero
    assert ((weight[:10] / per_tensor).to(FP8_DTYPE).float() == 0).float().mean() > 0.5 and (back[64:74] != 0).float().mean() > 0.9


def test_projections_are_quantized_with_their_scales_and_the_rest_passes_as_it_is(tiny_moe_model):
    state = {k: v for k, v in load_file(str(next(tiny_moe_model.glob("*.safetensors")))).items() if ".layers.0." in k or "layers" not in k}
    out = dict(quantize_named(state.items(), 32))
    fp8 = {k for k, v in out.items() if v.dtype == FP8_DTYPE}
    assert fp8 and all(k.endswith("_proj.weight") for k in fp8)
    assert {k + "_scale_inv" for k in fp8} <= set(out) and len(out) == len(state) + len(fp8)
    assert any(".experts.0.gate_proj.weight" in k for k in fp8) and any("self_attn.q_proj.weight" in k for k in fp8)
    kept = set(state) - fp8
    assert any(k.endswith("mlp.gate.weight") for k in kept) and any("embed_tokens" in k for k in kept) and any("norm" in k for k in kept)
    assert all(torch.equal(out[k], state[k]) for k in kept)  # routers, embeddings and norms untouched


def test_smollm2_tiles_at_64_not_at_128_and_tensor_parallel_checks_each_ranks_part(smollm2_folder):
    config = json.loads((smollm2_folder / "config.json").read_text())
    assert block_mismatches(config, 128) == ["num_attention_heads x head_dim = 576", "num_key_value_heads x head_dim = 192"]
    assert block_mismatches(config, 64) == []
    assert block_mismatches(config, 64, tp=2) == [  # 9 heads of 64 split in two; the 3 kv heads give each rank one
        "num_attention_heads x head_dim = 288 per rank of tensor parallel 2",
        "num_attention_heads x head_dim (o_proj input) = 288 per rank of tensor parallel 2",
    ]
    qwen3_moe = {"num_attention_heads": 32, "hidden_size": 2048, "head_dim": 128, "num_key_value_heads": 4, "num_experts": 128,
                 "moe_intermediate_size": 768, "intermediate_size": 6144}  # Qwen3-30B-A3B's shape: its dense width is unused
    assert block_mismatches(qwen3_moe, 128) == [] and block_mismatches(qwen3_moe, 128, tp=2) == []
    assert block_mismatches(qwen3_moe, 128, tp=4) == [  # 768 / 4 = 192 experts' columns per rank; kv heads replicate past 4
        "moe_intermediate_size = 192 per rank of tensor parallel 4", "moe_intermediate_size (down_proj input) = 192 per rank of tensor parallel 4",
    ]


def test_the_fp8_folder_is_an_fp8_checkpoint_of_the_same_model(tiny_vllm_model, tmp_path):
    target = write_fp8_folder(tiny_vllm_model, tmp_path / "fp8", 64)
    config = json.loads((target / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [64, 64]}
    assert (target / "tokenizer.json").is_file() or (target / "tokenizer_config.json").is_file()
    original = {k: v for f in tiny_vllm_model.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    written = load_file(str(target / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.weight"
    assert written[name].dtype == FP8_DTYPE and written[name + "_scale_inv"].shape == (2, 2)
    assert torch.equal(dequantize_block(written[name], written[name + "_scale_inv"], 64), reference_tile_quantization(original[name], 64))
    assert torch.equal(written["model.norm.weight"], original["model.norm.weight"])
    with pytest.raises(ValueError, match="cannot be served as 128x128 block fp8: num_key_value_heads x head_dim = 64 not a multiple"):
        write_fp8_folder(tiny_vllm_model, tmp_path / "no", 128)
    assert not (tmp_path / "no").exists()  # refused before anything is written


def test_sglang_fp8_on_a_model_that_does_not_tile_is_refused_by_field_before_ray_starts(smollm2_folder, tmp_path):
    cfg = RunConfig.model_validate({"run_dir": str(tmp_path / "run"), "rollout": {"engine": "sglang", "precision": "fp8", "gpus_per_worker": 1}})
    with pytest.raises(ConfigError, match=r"rollout.fp8_block=128: .* num_attention_heads x head_dim = 576"):
        check_layout(cfg)
    check_layout(cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"fp8_block": 64})}))
    with pytest.raises(ConfigError, match="fp8_block=64: .* 288 per rank of tensor parallel 2"):
        check_layout(cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"fp8_block": 64, "engine_kwargs": {"tp_size": 2}})}))
    with pytest.raises(ConfigError, match=r"rollout.fp8_block: Value error, must be a power of two .*\(got 96\)"):
        load_config(overrides=["rollout.fp8_block=96"])
    with pytest.raises(ConfigError, match=r"rollout.engine=sglang needs GPUs \(set rollout.gpus_per_worker > 0\)"):
        check_layout(cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"fp8_block": 64, "gpus_per_worker": 0.0})}))
