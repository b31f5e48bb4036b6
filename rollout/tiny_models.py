"""Tiny chat models the project builds itself (no download): SmolLM2's tokenizer and chat template on
a 2-layer Llama or Qwen3-MoE with random weights, edited so replies are short digit strings.

They train in seconds on CPU, so every shape of `drpo train` (several learner ranks, MoE with expert
parallelism, vLLM workers) can be run end to end in tests and on a laptop:

    python -m rollout.tiny_models qwen3_moe DIR   # a 4-expert top-2 Qwen3-MoE (SmolLM2's tokenizer)
    drpo train --set model.path=DIR --set learner.parallel.expert=2 ...
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def build_tiny_chat(
    folder, tokenizer_folder, family: str = "llama", hidden: int = 32, heads: int = 4, kv_heads: int = 2, intermediate: int = 64,
    eos: float = 1.5, experts: int = 4, topk: int = 2, seed: int = 0,
) -> Path:
    """A 2-layer ``family`` ("llama" or "qwen3_moe": every MLP ``experts`` experts, ``topk`` active,
    each ``intermediate`` wide) with the 49,152-token vocabulary and chat template of the model in
    ``tokenizer_folder``, random weights with two edits so replies are short digit strings (some
    right, most wrong: groups with reward variance to learn from). The small random layers leave
    the residual stream close to the input token's embedding, so: every embedding carries +10 in
    hidden dimension 0 and digits also in dimension 1; the output head's digit rows read dimension 0
    and its end-of-turn row mostly dimension 1 (weight ``eos``). A reply starts with a digit and
    most often ends right after it (less often with a smaller ``eos``: longer replies)."""
    from transformers import AutoTokenizer

    folder, tokenizer_folder = Path(folder), Path(tokenizer_folder)
    folder.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_folder / name, folder / name)
    tok = AutoTokenizer.from_pretrained(folder)
    torch.manual_seed(seed)
    model = _random_model(family, hidden, heads, kv_heads, intermediate, experts, topk)
    digits = tok.convert_tokens_to_ids(list("0123456789"))
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 10.0
        model.model.embed_tokens.weight[digits, 1] = 10.0
        head = torch.zeros_like(model.lm_head.weight)
        head[digits] = torch.randn(len(digits), hidden) * 0.5
        head[digits, 0], head[digits, 1] = 2.5, 0.0
        head[2, 0], head[2, 1] = 2.0, eos
        model.lm_head.weight.copy_(head)
    model.save_pretrained(folder)  # MoE experts one tensor each (the checkpoint format), as vLLM and the learner read them
    return folder


def _random_model(family: str, hidden: int, heads: int, kv_heads: int, intermediate: int, experts: int, topk: int):
    common = dict(
        vocab_size=49152, hidden_size=hidden, num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=kv_heads,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )
    if family == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(LlamaConfig(intermediate_size=intermediate, **common))
    if family == "qwen3_moe":
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        return Qwen3MoeForCausalLM(Qwen3MoeConfig(
            intermediate_size=intermediate, moe_intermediate_size=intermediate, num_experts=experts, num_experts_per_tok=topk,
            norm_topk_prob=True, head_dim=hidden // heads, router_aux_loss_coef=0.0, **common,
        ))
    raise ValueError(f"family {family!r}: choose llama or qwen3_moe")


def main() -> None:
    from rollout.offline_model import materialize_smollm2

    parser = argparse.ArgumentParser(description="Build a tiny chat model with SmolLM2's tokenizer (offline).")
    parser.add_argument("family", choices=("llama", "qwen3_moe"))
    parser.add_argument("folder")
    args = parser.parse_args()
    # head_dim 64 (hidden 128, 2 heads): what vLLM's CPU attention supports; widths divisible by 32 for its MoE kernel
    out = build_tiny_chat(args.folder, materialize_smollm2(), args.family, hidden=128, heads=2, kv_heads=2, intermediate=64, eos=0.8)
    print(out)


if __name__ == "__main__":
    main()
