"""megatron-core GPTModel for Llama-, Qwen2-, Qwen3-family dense models and a MoE variant.

``ModelArch`` is the architecture read off a Hugging Face ``config.json`` (or written by hand for
tests). ``build_gpt`` turns it into a megatron-core GPTModel with the local (non Transformer
Engine) layer spec, which is what runs on CPU; on GPU the same spec works, only slower than TE.
``forward_hidden`` runs the model up to the final norm and returns hidden states, so log-probs
are computed by the memory-bounded kernels in objectives/logprobs.py instead of full logits.

Family differences handled here: Qwen2 has biases on q/k/v (``qkv_bias``); Qwen3 has RMSNorm on
each head's q and k (``qk_norm``) and an explicit head_dim; MoE replaces every MLP with
``num_experts`` experts, ``router_topk`` of them active per token.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from learner import cpu_shims

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "qwen3_moe")


@dataclass(frozen=True)
class ModelArch:
    """The shape of a decoder-only transformer, in Hugging Face terms."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    max_position_embeddings: int = 4096
    num_experts: int | None = None
    router_topk: int = 2
    moe_intermediate_size: int | None = None
    norm_topk_prob: bool = True
    """Renormalize the top-k routing probabilities (softmax over the chosen experts' logits);
    False takes them from a softmax over all experts, as Qwen3-MoE does unless configured."""

    @classmethod
    def from_hf_config(cls, config: dict) -> "ModelArch":
        """Read a Hugging Face config.json dict; unsupported families raise with their name."""
        model_type = config.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config.get('hidden_act')!r} is not supported (SwiGLU models only)")
        rope = config.get("rope_parameters") or {}
        if rope.get("rope_type", "default") != "default" or config.get("rope_scaling"):
            raise ValueError("rope scaling is not supported yet; the model's rope_type must be 'default'")
        heads = config["num_attention_heads"]
        moe = {}
        if model_type == "qwen3_moe":
            if config.get("decoder_sparse_step", 1) != 1 or config.get("mlp_only_layers"):
                raise ValueError("qwen3_moe models mixing dense and MoE layers (decoder_sparse_step, mlp_only_layers) are not supported")
            moe = dict(
                num_experts=config.get("num_experts") or config["num_local_experts"], router_topk=config["num_experts_per_tok"],
                moe_intermediate_size=config["moe_intermediate_size"], norm_topk_prob=bool(config.get("norm_topk_prob", False)),
            )
        return cls(
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", config.get("rope_theta", 10000.0)),
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or bool(config.get("attention_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            max_position_embeddings=config.get("max_position_embeddings", 4096),
            **moe,
        )

    @classmethod
    def from_hf_folder(cls, folder: str | Path) -> "ModelArch":
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist: not a Hugging Face model folder")
        return cls.from_hf_config(json.loads(path.read_text()))


def layout_problems(arch: ModelArch, tensor: int, expert: int) -> list[str]:
    """Why a learner layout cannot split this model (empty: it can), each naming its field."""
    problems = []
    for what, n in (("attention heads", arch.num_heads), ("key/value heads", arch.num_kv_heads),
                    ("MLP width (intermediate_size)", arch.intermediate_size), ("vocabulary", arch.vocab_size)):
        if n % tensor:
            problems.append(f"learner.parallel.tensor={tensor} must divide the model's {what} ({n})")
    if arch.num_experts is None:
        if expert > 1:
            problems.append(f"learner.parallel.expert={expert} needs an MoE model; this one has no experts")
    else:
        if arch.num_experts % expert:
            problems.append(f"learner.parallel.expert={expert} must divide the model's experts ({arch.num_experts})")
        if tensor > 1:  # megatron-core's MoE layer needs sequence parallel under tensor parallel, which the learner does not use
            problems.append(f"learner.parallel.tensor={tensor} on an MoE model is not supported yet (use expert and data parallel)")
        if (arch.moe_intermediate_size or arch.intermediate_size) % tensor:
            problems.append(f"learner.parallel.tensor={tensor} must divide the experts' width (moe_intermediate_size, {arch.moe_intermediate_size})")
    return problems


def transformer_config(arch: ModelArch, *, expert_parallel: int = 1, tensor_parallel: int = 1, precision: str = "fp32"):
    """The megatron-core TransformerConfig for ``arch`` (no dropout, CPU overrides applied).

    ``precision="bf16"``: bf16 parameters and compute (megatron's mixed precision: the optimizer
    keeps fp32 main parameters, DDP accumulates gradients in fp32; learner/optim.py), attention
    softmax in fp32."""
    from megatron.core.transformer import TransformerConfig

    moe = {}
    if arch.num_experts:
        moe = dict(
            num_moe_experts=arch.num_experts,
            moe_router_topk=arch.router_topk,
            moe_ffn_hidden_size=arch.moe_intermediate_size or arch.intermediate_size,
            moe_token_dispatcher_type="allgather",
            moe_router_pre_softmax=not arch.norm_topk_prob,
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_grouped_gemm=False,
            expert_model_parallel_size=expert_parallel,
        )
    return TransformerConfig(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.intermediate_size,
        num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm,
        # Megatron's defaults are 0.1; RL log-probs must be deterministic functions of the weights.
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.bfloat16 if precision == "bf16" else torch.float32,
        bf16=precision == "bf16",
        attention_softmax_in_fp32=True,
        # the fused causal softmax kernel ignores an explicit mask: packed layouts (block masks,
        # learner/packing.py) need the unfused softmax, which applies the mask it is given
        masked_softmax_fusion=False,
        tensor_model_parallel_size=tensor_parallel,
        **moe,
        **cpu_shims.cpu_config_overrides(),
    )


def build_gpt(arch: ModelArch, *, expert_parallel: int = 1, tensor_parallel: int = 1, precision: str = "fp32"):
    """A megatron-core GPTModel for ``arch``; parallel_state must already be initialized."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    config = transformer_config(arch, expert_parallel=expert_parallel, tensor_parallel=tensor_parallel, precision=precision)
    spec = get_gpt_layer_local_spec(num_experts=arch.num_experts, qk_layernorm=arch.qk_norm, normalization="RMSNorm")
    return GPTModel(
        config,
        spec,
        vocab_size=arch.vocab_size,
        max_sequence_length=arch.max_position_embeddings,
        position_embedding_type="rope",
        rotary_base=int(arch.rope_theta),
        share_embeddings_and_output_weights=arch.tie_embeddings,
        parallel_output=True,
    )


def causal_mask(seq_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[1, 1, s, s] bool, True above the diagonal (megatron masks where True).

    Passed explicitly: megatron's default causal mask is created on device="cuda". Sequences are
    right-padded, so causality alone keeps every real token from seeing padding.
    """
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), diagonal=1)[None, None]


def forward_hidden(model, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Hidden states after the final norm, [batch, seq, hidden], for input_ids [batch, seq].

    Runs GPTModel's own preprocess (embedding) and decoder and stops before the output layer, so
    no [tokens, vocab] logits are formed. ``position_ids`` [batch, seq] (default 0..seq-1) and
    ``attention_mask`` [batch or 1, 1, seq, seq] (True = masked; default causal) carry packed
    layouts (learner/packing.py): the rotary table is indexed by each token's own position.
    """
    batch, seq = input_ids.shape
    if attention_mask is None:
        attention_mask = causal_mask(seq, input_ids.device)
    decoder_input = model.embedding(input_ids=input_ids, position_ids=None)
    if position_ids is None:
        rotary_pos_emb = model.rotary_pos_emb(seq)  # [seq, 1, 1, dim]
    else:
        table = model.rotary_pos_emb(int(position_ids.max()) + 1)  # [max_pos, 1, 1, dim]
        rotary_pos_emb = table[position_ids.t()].squeeze(2)  # [seq, batch, 1, dim]
    hidden = model.decoder(hidden_states=decoder_input, attention_mask=attention_mask.to(input_ids.device), rotary_pos_emb=rotary_pos_emb)
    return hidden.transpose(0, 1)


def output_weight(model) -> torch.Tensor:
    """The (vocab-parallel) output embedding [V / tp, hidden]: tied to the input embedding or not."""
    if model.share_embeddings_and_output_weights:
        return model.shared_embedding_or_output_weight()
    return model.output_layer.weight
