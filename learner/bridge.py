"""Hugging Face <-> megatron-core weights for Llama-, Qwen2- and Qwen3-family models.

Choice: a hand-written converter, not mbridge or megatron-bridge. On these machines mbridge 0.15.1
produced the same layout but needed four patches of its internals to run on CPU (it hard-codes
Transformer Engine and .cuda()), and megatron-bridge needs Python 3.12 and GPU-only packages.
The layout rules are few and stable, and a converter we own runs identically on CPU and GPU,
shards for tensor parallelism itself, and is tested for exact round trips.

Layout (local layer spec, RMSNorm), per layer i:
    model.layers.i.input_layernorm            <-> decoder.layers.i.input_layernorm
    q_proj, k_proj, v_proj (weights, biases)  <-> self_attention.linear_qkv: per query group g,
                                                  [g's q heads; g's k head; g's v head], by rows
    self_attn.q_norm / k_norm (Qwen3)         <-> self_attention.q_layernorm / k_layernorm
    o_proj                                    <-> self_attention.linear_proj
    post_attention_layernorm                  <-> pre_mlp_layernorm
    mlp.gate_proj, mlp.up_proj                <-> mlp.linear_fc1 = [gate; up] by rows
    mlp.down_proj                             <-> mlp.linear_fc2
and model.embed_tokens <-> embedding.word_embeddings, model.norm <-> decoder.final_layernorm,
lm_head <-> output_layer (absent when embeddings are tied).

MoE layers (Qwen3-MoE): mlp.gate <-> mlp.router, and per expert e mlp.experts.e.{gate,up,down}_proj
<-> mlp.experts.local_experts.e.linear_fc1 ([gate; up]) / linear_fc2; expert parallelism assigns
whole experts to ranks (expert_local_name).

Tensor parallelism (rank r of t): column-parallel weights (linear_qkv, linear_fc1, embeddings,
output layer) split by rows, with linear_qkv split by whole query groups and linear_fc1 as
[gate_r; up_r]; row-parallel weights (linear_proj, linear_fc2) split by columns; norms replicated.
"""

from __future__ import annotations

from typing import Iterator

import torch

from learner.model import ModelArch
from learner.weights.hf_io import unfuse_experts

HF_LAYER = "model.layers.{i}."
MG_LAYER = "decoder.layers.{i}."


def _qkv_to_megatron(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, arch: ModelArch) -> torch.Tensor:
    """Interleave q [H*d, ...], k, v [G*d, ...] per query group; works for weights and biases."""
    groups, d = arch.num_kv_heads, arch.head_dim
    per_group = arch.num_heads // groups
    q = q.reshape(groups, per_group * d, *q.shape[1:])
    k = k.reshape(groups, d, *k.shape[1:])
    v = v.reshape(groups, d, *v.shape[1:])
    return torch.cat([q, k, v], dim=1).reshape(-1, *q.shape[2:])


def _qkv_from_megatron(qkv: torch.Tensor, arch: ModelArch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    groups, d = arch.num_kv_heads, arch.head_dim
    per_group = arch.num_heads // groups
    grouped = qkv.reshape(groups, (per_group + 2) * d, *qkv.shape[1:])
    q, k, v = torch.split(grouped, [per_group * d, d, d], dim=1)
    return (q.reshape(-1, *qkv.shape[1:]), k.reshape(-1, *qkv.shape[1:]), v.reshape(-1, *qkv.shape[1:]))


def _layer_pairs(arch: ModelArch, i: int) -> list[tuple[str, str]]:
    """One-to-one (hf, megatron) names of layer i."""
    hf, mg = HF_LAYER.format(i=i), MG_LAYER.format(i=i)
    pairs = [
        (hf + "input_layernorm.weight", mg + "input_layernorm.weight"),
        (hf + "self_attn.o_proj.weight", mg + "self_attention.linear_proj.weight"),
        (hf + "post_attention_layernorm.weight", mg + "pre_mlp_layernorm.weight"),
    ]
    if arch.num_experts:
        pairs.append((hf + "mlp.gate.weight", mg + "mlp.router.weight"))
        pairs += [(hf + f"mlp.experts.{e}.down_proj.weight", mg + f"mlp.experts.local_experts.{e}.linear_fc2.weight") for e in range(arch.num_experts)]
    else:
        pairs.append((hf + "mlp.down_proj.weight", mg + "mlp.linear_fc2.weight"))
    if arch.qk_norm:
        pairs += [
            (hf + "self_attn.q_norm.weight", mg + "self_attention.q_layernorm.weight"),
            (hf + "self_attn.k_norm.weight", mg + "self_attention.k_layernorm.weight"),
        ]
    return pairs


def _global_pairs(arch: ModelArch) -> list[tuple[str, str]]:
    pairs = [("model.embed_tokens.weight", "embedding.word_embeddings.weight"), ("model.norm.weight", "decoder.final_layernorm.weight")]
    if not arch.tie_embeddings:
        pairs.append(("lm_head.weight", "output_layer.weight"))
    return pairs


def _fc1_pairs(arch: ModelArch, i: int) -> list[tuple[str, str, str]]:
    """(hf gate, hf up, megatron linear_fc1) names of layer i: one per expert on MoE layers."""
    hf, mg = HF_LAYER.format(i=i) + "mlp.", MG_LAYER.format(i=i) + "mlp."
    if not arch.num_experts:
        return [(hf + "gate_proj.weight", hf + "up_proj.weight", mg + "linear_fc1.weight")]
    return [
        (hf + f"experts.{e}.gate_proj.weight", hf + f"experts.{e}.up_proj.weight", mg + f"experts.local_experts.{e}.linear_fc1.weight")
        for e in range(arch.num_experts)
    ]


def hf_to_megatron(hf: dict[str, torch.Tensor], arch: ModelArch) -> dict[str, torch.Tensor]:
    """Full (unsharded) megatron state dict from a Hugging Face state dict."""
    hf = unfuse_experts(hf)
    out: dict[str, torch.Tensor] = {}
    for hf_name, mg_name in _global_pairs(arch):
        out[mg_name] = _take(hf, hf_name)
    for i in range(arch.num_layers):
        hfp, mgp = HF_LAYER.format(i=i), MG_LAYER.format(i=i)
        for hf_name, mg_name in _layer_pairs(arch, i):
            out[mg_name] = _take(hf, hf_name)
        attn = hfp + "self_attn."
        out[mgp + "self_attention.linear_qkv.weight"] = _qkv_to_megatron(
            _take(hf, attn + "q_proj.weight"), _take(hf, attn + "k_proj.weight"), _take(hf, attn + "v_proj.weight"), arch
        )
        if arch.qkv_bias:
            out[mgp + "self_attention.linear_qkv.bias"] = _qkv_to_megatron(
                _take(hf, attn + "q_proj.bias"), _take(hf, attn + "k_proj.bias"), _take(hf, attn + "v_proj.bias"), arch
            )
        for gate, up, fc1 in _fc1_pairs(arch, i):
            out[fc1] = torch.cat([_take(hf, gate), _take(hf, up)])
    return out


def megatron_to_hf(mg: dict[str, torch.Tensor], arch: ModelArch) -> Iterator[tuple[str, torch.Tensor]]:
    """(hf_name, tensor) pairs from a full megatron state dict, layer by layer (a generator, so
    weight publication can bucket without holding a second copy of the model)."""
    for hf_name, mg_name in _global_pairs(arch):
        yield hf_name, mg[mg_name]
    for i in range(arch.num_layers):
        hfp, mgp = HF_LAYER.format(i=i), MG_LAYER.format(i=i)
        for hf_name, mg_name in _layer_pairs(arch, i):
            yield hf_name, mg[mg_name]
        q, k, v = _qkv_from_megatron(mg[mgp + "self_attention.linear_qkv.weight"], arch)
        yield from ((hfp + f"self_attn.{n}_proj.weight", t) for n, t in zip("qkv", (q, k, v)))
        if arch.qkv_bias:
            q, k, v = _qkv_from_megatron(mg[mgp + "self_attention.linear_qkv.bias"], arch)
            yield from ((hfp + f"self_attn.{n}_proj.bias", t) for n, t in zip("qkv", (q, k, v)))
        for gate_name, up_name, fc1 in _fc1_pairs(arch, i):
            gate, up = torch.chunk(mg[fc1], 2, dim=0)
            yield gate_name, gate
            yield up_name, up


# ---- tensor-parallel sharding -----------------------------------------------------------------------

_COLUMN = ("linear_qkv.weight", "linear_qkv.bias", "linear_fc1.weight", "word_embeddings.weight", "output_layer.weight")
_ROW = ("linear_proj.weight", "linear_fc2.weight")


def shard(name: str, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s slice of a full megatron tensor under tensor parallelism of ``size``."""
    if size == 1:
        return full
    if name.endswith("linear_fc1.weight"):
        gate, up = torch.chunk(full, 2, dim=0)
        return torch.cat([torch.chunk(gate, size)[rank], torch.chunk(up, size)[rank]])
    if name.endswith(_COLUMN):
        # linear_qkv rows are grouped per query group, so equal row chunks are whole groups
        return torch.chunk(full, size, dim=0)[rank].clone()
    if name.endswith(_ROW):
        return torch.chunk(full, size, dim=1)[rank].clone()
    return full


_LOCAL_EXPERT = ".mlp.experts.local_experts."


def expert_local_name(name: str, ep_rank: int, ep_size: int, num_experts: int) -> str | None:
    """Expert parallelism: the local name of a full-model expert tensor on ``ep_rank``, or None
    when another rank owns that expert. Rank r owns global experts [r*n/ep, (r+1)*n/ep)."""
    if _LOCAL_EXPERT not in name or ep_size == 1:
        return name
    head, tail = name.split(_LOCAL_EXPERT)
    index, rest = tail.split(".", 1)
    per_rank = num_experts // ep_size
    owner, local = divmod(int(index), per_rank)
    return f"{head}{_LOCAL_EXPERT}{local}.{rest}" if owner == ep_rank else None


def expert_global_name(local_name: str, ep_rank: int, ep_size: int, num_experts: int) -> str:
    """Inverse of ``expert_local_name``: the full-model name of ``ep_rank``'s local expert tensor."""
    head, tail = local_name.split(_LOCAL_EXPERT)
    index, rest = tail.split(".", 1)
    return f"{head}{_LOCAL_EXPERT}{ep_rank * (num_experts // ep_size) + int(index)}.{rest}"


def unshard(name: str, parts: list[torch.Tensor]) -> torch.Tensor:
    """Inverse of ``shard`` given every rank's slice in rank order."""
    if len(parts) == 1:
        return parts[0]
    if name.endswith("linear_fc1.weight"):
        halves = [torch.chunk(p, 2, dim=0) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    if name.endswith(_COLUMN):
        return torch.cat(parts, dim=0)
    if name.endswith(_ROW):
        return torch.cat(parts, dim=1)
    return parts[0]


def _take(hf: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in hf:
        raise KeyError(f"Hugging Face checkpoint has no tensor {name!r}")
    return hf[name]
