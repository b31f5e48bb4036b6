"""Routing replay, side by side: the lag-0 gap of an MoE model with and without R3.

    .venv/bin/python -m benchmarks.routing.run [--prompts 16] [--scales 1,0.1,0.02]

The tiny chat Qwen3-MoE (rollout/tiny_models.py, 2 MoE layers, 4 experts, top-2) with its router
rows pulled together around a shared direction — each expert's row is the shared one plus ``scale``
times its own deviation (smaller: the experts' logits closer relative to their size, more near-ties,
like trained routers whose experts score alike) — sampled by a bf16 hf engine, scored by an fp32 megatron-core
learner with and without replaying the engine's routing: mean and max |pi - mu| over the response
tokens at lag 0, and the fraction of (position, layer) decisions where the learner's own routers
chose other experts than the engine.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch


def scaled_model(folder: Path, scale: float) -> Path:
    from transformers import AutoModelForCausalLM

    from rollout.offline_model import materialize_smollm2
    from rollout.tiny_models import build_tiny_chat

    build_tiny_chat(folder, materialize_smollm2(), "qwen3_moe", hidden=128, heads=2, kv_heads=2, intermediate=64, eos=0.8)
    model = AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        for layer in model.model.layers:
            w = layer.mlp.gate.weight
            common = w.mean(dim=0, keepdim=True) + 0.05 * torch.randn(1, w.shape[1])  # a direction every expert shares
            w.copy_(common + scale * (w - w.mean(dim=0, keepdim=True)))
    model.save_pretrained(folder)
    return folder


def measure(folder: Path, prompts: int) -> dict[str, float]:
    from controller.batch_builder import completion_batch
    from learner.config import LearnerConfig
    from learner.learner import Learner
    from rollout.engine import SamplingParams
    from rollout.hf_engine import HFEngine
    from rollout.tasks import arithmetic_split

    engine = HFEngine(str(folder), precision="bf16")
    ids = [engine.chat_prompt(p.prompt) for p in arithmetic_split("train", prompts)]
    completions = [c for g in engine.generate(ids, SamplingParams(n=4, max_new_tokens=24, seed=0)) for c in g]
    batch = completion_batch(completions)
    mask, mu = batch.response_mask, batch.rollout_logp
    out = {"tokens": float(mask.sum())}
    for replay in (False, True):
        learner = Learner.build(LearnerConfig(routing_replay=replay, packing="none", micro_batch_size=16), model_folder=folder)
        pi = learner.batch_logprobs(batch).logp
        gap = (pi.exp() - mu.exp()).abs()[mask]
        tag = "replay" if replay else "no_replay"
        out[f"{tag}_mean"], out[f"{tag}_max"] = gap.mean().item(), gap.max().item()
        out["disagreement"] = learner.routing.metrics()["routing_disagreement_frac"].value.item()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--scales", default="1,0.1,0.01,0.001")
    args = parser.parse_args()

    from learner import distributed
    from learner.config import ParallelConfig

    distributed.init(ParallelConfig(), rank=0, world_size=1, master_port=distributed.free_port())
    print(f"tiny Qwen3-MoE, bf16 hf engine vs fp32 learner, lag 0, {args.prompts} prompts x 4 samples x <= 24 tokens")
    print(f"{'router scale':>12} {'disagree':>9} {'mean |pi-mu| off':>17} {'on':>9} {'max off':>8} {'on':>7} {'mean on/off':>12}")
    with tempfile.TemporaryDirectory() as tmp:
        for scale in map(float, args.scales.split(",")):
            r = measure(scaled_model(Path(tmp) / f"scale-{scale}", scale), args.prompts)
            print(
                f"{scale:>12g} {r['disagreement']:>9.4f} {r['no_replay_mean']:>17.5f} {r['replay_mean']:>9.5f} "
                f"{r['no_replay_max']:>8.4f} {r['replay_max']:>7.4f} {r['replay_mean'] / max(r['no_replay_mean'], 1e-12):>12.2f}"
            )


if __name__ == "__main__":
    main()
