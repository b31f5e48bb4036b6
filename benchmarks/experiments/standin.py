"""The experiments' stand-in policy: a small Llama with SmolLM2's real 49,152-token vocabulary and
chat template, warm-started by a short supervised run on the arithmetic task's training split to a
low but non-zero accuracy (RL needs some reward signal; the long vocabulary tail is what the DRPO
paper's argument is about, so the vocabulary stays real). Built once per spec, cached in a folder.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class StandinSpec:
    hidden: int = 128
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 384
    sft_steps: int = 300
    sft_batch: int = 32
    sft_lr: float = 2e-3
    seed: int = 0


def _tokenize(tok, problems):
    """(prompt ids, answer ids + end-of-turn) per problem."""
    rows = []
    for p in problems:
        prompt = tok.apply_chat_template([{"role": "user", "content": p.prompt}], add_generation_prompt=True, tokenize=True)
        prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
        answer = tok(p.ground_truth, add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids("<|im_end|>")]
        rows.append((prompt, answer))
    return rows


def build_standin(folder: Path, smollm2_folder: Path, spec: StandinSpec = StandinSpec(), log=print) -> Path:
    """Create (or reuse) the stand-in model folder; returns it. SFT: cross-entropy on the answer
    tokens only, AdamW, on the training split (the held-out split is never seen)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from rollout.tasks import arithmetic_split

    folder = Path(folder)
    if (folder / "standin.json").is_file() and json.loads((folder / "standin.json").read_text())["spec"] == asdict(spec):
        return folder
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(Path(smollm2_folder) / name, tmp / name)
    tok = AutoTokenizer.from_pretrained(tmp)
    torch.manual_seed(spec.seed)
    cfg = LlamaConfig(
        vocab_size=49152, hidden_size=spec.hidden, intermediate_size=spec.intermediate, num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2, pad_token_id=2, max_position_embeddings=512,
    )
    model = LlamaForCausalLM(cfg)
    rows = _tokenize(tok, arithmetic_split("train", 2048))
    opt = torch.optim.AdamW(model.parameters(), lr=spec.sft_lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(spec.seed)
    model.train()
    for step in range(spec.sft_steps):
        idx = torch.randint(0, len(rows), (spec.sft_batch,), generator=gen).tolist()
        seqs = [rows[i][0] + rows[i][1] for i in idx]
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), 2)
        labels = torch.full((len(seqs), width), -100)
        attn = torch.zeros((len(seqs), width), dtype=torch.long)
        for j, i in enumerate(idx):
            p, a = rows[i]
            ids[j, : len(p) + len(a)] = torch.tensor(p + a)
            labels[j, len(p) : len(p) + len(a)] = torch.tensor(a)
            attn[j, : len(p) + len(a)] = 1
        loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step == spec.sft_steps - 1:
            log(f"stand-in SFT step {step}: answer loss {loss.item():.3f}")
    model.eval()
    model.save_pretrained(tmp)
    (tmp / "standin.json").write_text(json.dumps({"spec": asdict(spec)}))
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return folder
