"""Learner benchmarks, side by side in one run (from the repo root):

    .venv/bin/python -m benchmarks.learner.run [--rounds 2] [--only step|publish]

1. Train step on SmolLM2-135M, 8 sequences x 256 tokens (the last 192 of each scored), fp32, DRPO:
   drpo's megatron-core Learner (chunked log-probs, micro-batches of 4) next to the same step done
   with a plain transformers LlamaForCausalLM and torch autograd (full logits, log_softmax, the same
   DRPO loss, AdamW). Tokens/s and peak RSS, each variant in fresh processes, interleaved.
2. Weight publication of SmolLM2-135M (HF names, 512 MB buckets) to 2 consumers: over a
   WeightBroadcastGroup (gloo here, NCCL on GPU) and through Ray's object store.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from benchmarks.harness import interleaved_medians, peak_mib_since, reset_peak, run_worker

SEQS, TOKENS, PROMPT = 8, 256, 64


def _batch(vocab: int):
    import torch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (SEQS, TOKENS), generator=g)
    mask = torch.zeros(SEQS, TOKENS, dtype=torch.bool)
    mask[:, PROMPT:] = True
    adv = torch.tensor([1.0, -1.0] * (SEQS // 2))[:, None].expand(SEQS, TOKENS).contiguous()
    return ids, mask, adv


def _step_job(spec: dict) -> dict:
    import torch

    torch.set_num_threads(2)
    from rollout.offline_model import materialize_smollm2

    folder = materialize_smollm2()
    if spec["impl"] == "drpo":
        step = _drpo_step(folder)
    else:
        step = _transformers_step(folder)
    step()  # warm-up
    before = reset_peak()
    times = []
    for _ in range(spec["steps"]):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    seconds = statistics.median(times)
    return {"seconds": seconds, "tokens_per_s": SEQS * TOKENS / seconds, "peak_mib": peak_mib_since(before)}


def _drpo_step(folder):
    from learner import distributed
    from learner.config import LearnerConfig, OptimizerConfig
    from learner.batch import TrainBatch
    from learner.learner import Learner

    cfg = LearnerConfig(optimizer=OptimizerConfig(lr=1e-6), micro_batch_size=4, compute_entropy=False)
    distributed.init(cfg.parallel, 0, 1, master_port=distributed.free_port())
    learner = Learner.from_hf_folder(cfg, folder)
    ids, mask, adv = _batch(learner.arch.vocab_size)
    rollout = learner.compute_logprobs(ids).logp
    batch = TrainBatch(ids, mask, rollout, adv)
    return lambda: learner.train_step(batch)


def _transformers_step(folder):
    import torch
    from transformers import AutoModelForCausalLM

    import objectives

    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32, attn_implementation="eager")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    ids, mask, adv = _batch(model.config.vocab_size)

    def logp(micro_ids):
        logits = model(micro_ids).logits[:, :-1].float()
        out = torch.log_softmax(logits, -1).gather(-1, micro_ids[:, 1:, None]).squeeze(-1)
        return torch.cat([torch.zeros_like(out[:, :1]), out], dim=1)

    with torch.no_grad():
        rollout = logp(ids)

    def step():
        optimizer.zero_grad()
        for s in range(0, SEQS, 4):
            sl = slice(s, s + 4)
            loss = objectives.token_loss("drpo", logp(ids[sl]), rollout[sl], adv[sl], mask=mask[sl])
            objectives.aggregate(loss, mask[sl], "token-mean", normalizer=mask.sum()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

    return step


def _publish_job(spec: dict) -> dict:
    import torch.multiprocessing as mp

    from learner.distributed import free_port

    out = {}
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_broadcast_rank, args=(r, 3, port, queue)) for r in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    out["broadcast"] = queue.get()
    out["object_store"] = _object_store_publication()
    return out


def _smollm2_named():
    from learner.bridge import load_hf_state_dict
    from rollout.offline_model import materialize_smollm2

    return load_hf_state_dict(materialize_smollm2())


def _broadcast_rank(rank: int, world: int, port: int, queue) -> None:
    from learner import publish
    from learner.broadcast import WeightBroadcastGroup

    group = WeightBroadcastGroup("127.0.0.1", port, rank, world)
    if rank == 0:
        named = _smollm2_named()
        t0 = time.perf_counter()
        nbytes = 0
        for bucket in publish.buckets(named.items(), version=1):
            group.send(bucket)
            nbytes += bucket.nbytes
        queue.put({"bytes": nbytes, "seconds": time.perf_counter() - t0})
    else:
        publish.assemble(group.receive_publication())


def _object_store_publication() -> dict:
    import os

    import ray

    from learner import publish

    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)

    @ray.remote(num_cpus=0)
    class Consumer:
        def load(self, refs):
            version, weights = publish.assemble(ray.get(list(refs)))
            return sum(t.numel() * t.element_size() for t in weights.values())

    consumers = [Consumer.remote() for _ in range(2)]
    named = _smollm2_named()
    t0 = time.perf_counter()
    refs = [ray.put(b) for b in publish.buckets(named.items(), version=1)]
    loaded = ray.get([c.load.remote(refs) for c in consumers])
    seconds = time.perf_counter() - t0
    ray.shutdown()
    return {"bytes": loaded[0], "seconds": seconds}


JOBS = {"step": _step_job, "publish": _publish_job}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--only", choices=["step", "publish"])
    args = parser.parse_args()
    if args.worker:
        kind, spec = args.worker
        print(json.dumps(JOBS[kind](json.loads(spec))))
        return 0
    if args.only in (None, "step"):
        specs = {impl: {"impl": impl, "steps": args.steps} for impl in ("transformers", "drpo")}
        res = interleaved_medians("benchmarks.learner.run", "step", specs, args.rounds, ("seconds", "peak_mib"))
        print(f"Train step, SmolLM2-135M, {SEQS} x {TOKENS} tokens, fp32, DRPO; median of {args.rounds} interleaved rounds")
        med = {}
        for impl, r in res.items():
            if "error" in r:
                print(f"  {impl:14s} {r['error']}")
                continue
            med[impl] = dict(r, tokens_per_s=SEQS * TOKENS / r["seconds"])
        for impl, m in med.items():
            ratio = ""
            if "transformers" in med and impl != "transformers":
                base = med["transformers"]
                ratio = f"   tokens/s x{m['tokens_per_s'] / base['tokens_per_s']:.2f}   peak RSS x{m['peak_mib'] / base['peak_mib']:.2f}"
            print(f"  {impl:14s} {m['seconds']:7.2f} s/step {m['tokens_per_s']:8.1f} tok/s {m['peak_mib']:8.0f} MiB{ratio}")
    if args.only in (None, "publish"):
        res = run_worker("benchmarks.learner.run", "publish", {})
        print("Weight publication, SmolLM2-135M (fp32, HF names), to 2 consumers")
        if "error" in res:
            print(f"  {res['error']}")
        else:
            for path, r in res.items():
                print(f"  {path:14s} {r['bytes'] / 1e9:.3f} GB in {r['seconds']:.2f} s = {r['bytes'] / 1e9 / r['seconds']:.2f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
