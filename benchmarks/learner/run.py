"""Learner benchmarks, side by side in one run (from the repo root):

    .venv/bin/python -m benchmarks.learner.run [--rounds 2] [--only preset|heap|gap|step|publish]

1. The default preset's learner step (``--only preset``): SmolLM2-135M, 8 groups x 8 samples, each
   the chat-templated arithmetic prompt (~60 tokens) and a response of 4 to 16 tokens, DRPO; fp32
   vs bf16 and packing none (right-padded rows, micro-batches of 16) vs shared_prompt (a group's
   prompt once, micro-batches of 4096 token slots). Seconds per step and peak RSS, each variant in
   fresh processes, interleaved; ratios against today's fp32 / none.
2. glibc's allocator (``--only heap``): the default preset's learner step (its first and later
   steps) and one hf engine call of 8 prompts x 8 samples, at the precision ``auto`` picks,
   with the allocator as it comes and told to keep freed memory (cpu/allocator.py), fresh
   processes, interleaved.
3. The lag-0 numerics gap (``--only gap``): mean and max |pi - mu| for {fp32, bf16 learner} x
   {fp32, bf16, fp8 hf engine} on completions of the default task.
4. Train step on SmolLM2-135M, 8 sequences x 256 tokens (the last 192 of each scored), fp32, DRPO:
   drpo's megatron-core Learner (chunked log-probs, micro-batches of 4) next to the same step done
   with a plain transformers LlamaForCausalLM and torch autograd (full logits, log_softmax, the same
   DRPO loss, AdamW). Tokens/s and peak RSS, each variant in fresh processes, interleaved.
5. Weight publication of SmolLM2-135M (HF names, 512 MB buckets) to 2 consumers: over a
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
    learner = Learner.build(cfg, model_folder=folder)
    ids, mask, adv = _batch(learner.arch.vocab_size)
    rollout = learner.compute_logprobs(ids).logp
    batch = TrainBatch(ids, mask, rollout, adv)
    return lambda: learner.train(batch)


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
    from learner.weights.hf_io import load_hf_state_dict
    from rollout.offline_model import materialize_smollm2

    return load_hf_state_dict(materialize_smollm2())


def _broadcast_rank(rank: int, world: int, port: int, queue) -> None:
    from learner.weights import wire
    from learner.weights.broadcast import WeightBroadcastGroup

    group = WeightBroadcastGroup("127.0.0.1", port, rank, world)
    if rank == 0:
        named = _smollm2_named()
        t0 = time.perf_counter()
        nbytes = 0
        for bucket in wire.buckets(named.items(), version=1):
            group.send(bucket)
            nbytes += bucket.nbytes
        queue.put({"bytes": nbytes, "seconds": time.perf_counter() - t0})
    else:
        wire.assemble(group.receive_publication())


def _object_store_publication() -> dict:
    from controller.network import init_ray

    init_ray(num_cpus=2)
    import ray

    from learner.weights import wire

    @ray.remote(num_cpus=0)
    class Consumer:
        def load(self, refs):
            version, weights = wire.assemble(ray.get(list(refs)))
            return sum(t.numel() * t.element_size() for t in weights.values())

    consumers = [Consumer.remote() for _ in range(2)]
    named = _smollm2_named()
    t0 = time.perf_counter()
    refs = [ray.put(b) for b in wire.buckets(named.items(), version=1)]
    loaded = ray.get([c.load.remote(refs) for c in consumers])
    seconds = time.perf_counter() - t0
    ray.shutdown()
    return {"bytes": loaded[0], "seconds": seconds}


def _preset_batch(folder, vocab: int):
    """The default preset's batch shape: 8 arithmetic prompts (chat template) x 8 responses of
    4..16 random tokens (the preset's max_new_tokens is 16), right-padded."""
    import random

    import torch
    from transformers import AutoTokenizer

    from learner.batch import TrainBatch
    from rollout.tasks import arithmetic_split

    tok = AutoTokenizer.from_pretrained(folder)
    rng, g = random.Random(0), torch.Generator().manual_seed(0)
    rows = []
    for problem in arithmetic_split("train", 8):
        ids = tok.apply_chat_template([{"role": "user", "content": problem.prompt}], add_generation_prompt=True, tokenize=True)
        prompt = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        for _ in range(8):
            rows.append((prompt, torch.randint(0, vocab, (rng.randint(4, 16),), generator=g).tolist()))
    width = max(len(p) + len(r) for p, r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, (p, r) in enumerate(rows):
        ids[i, : len(p) + len(r)] = torch.tensor(p + r)
        mask[i, len(p) : len(p) + len(r)] = True
    adv = torch.tensor([1.0, -1.0] * (len(rows) // 2))[:, None] * mask
    return TrainBatch(ids, mask, torch.full(ids.shape, -3.0) * mask, adv)


def _preset_job(spec: dict) -> dict:
    import torch

    torch.set_num_threads(2)
    from learner import distributed
    from learner.config import LearnerConfig, OptimizerConfig
    from learner.learner import Learner
    from objectives.config import DRPOConfig
    from rollout.offline_model import materialize_smollm2

    folder = materialize_smollm2()
    cfg = LearnerConfig(
        objective=DRPOConfig(delta=0.2), optimizer=OptimizerConfig(lr=1e-6), precision=spec["precision"], packing=spec["packing"],
        micro_batch_size=16, micro_batch_tokens=4096,
    )
    distributed.init(cfg.parallel, 0, 1, master_port=distributed.free_port())
    learner = Learner.build(cfg, model_folder=folder)
    batch = _preset_batch(folder, learner.arch.vocab_size)
    learner.train(batch)  # warm-up
    before = reset_peak()
    times, metrics = [], None
    for _ in range(spec["steps"]):
        t0 = time.perf_counter()
        metrics = learner.train(batch)
        times.append(time.perf_counter() - t0)
    return {
        "seconds": statistics.median(times), "peak_mib": peak_mib_since(before),
        "forward_tokens": metrics.values["learner/forward_tokens"], "padding_frac": metrics.values["learner/padding_frac"],
    }


PRESET_VARIANTS = {
    "fp32 none": {"precision": "fp32", "packing": "none"},
    "bf16 none": {"precision": "bf16", "packing": "none"},
    "fp32 shared_prompt": {"precision": "fp32", "packing": "shared_prompt"},
    "bf16 shared_prompt": {"precision": "bf16", "packing": "shared_prompt"},
}


def _print_preset(rounds: int, steps: int) -> None:
    specs = {label: dict(v, steps=steps) for label, v in PRESET_VARIANTS.items()}
    res = interleaved_medians("benchmarks.learner.run", "preset", specs, rounds, ("seconds", "peak_mib", "forward_tokens", "padding_frac"))
    print(f"Default preset learner step, SmolLM2-135M, 8 groups x 8 samples, DRPO; median of {rounds} interleaved rounds")
    base = res.get("fp32 none", {})
    for label, r in res.items():
        if "error" in r:
            print(f"  {label:20s} {r['error']}")
            continue
        ratio = ""
        if "seconds" in base and label != "fp32 none":
            ratio = f"   speed x{base['seconds'] / r['seconds']:.2f}   peak RSS x{r['peak_mib'] / base['peak_mib']:.2f}"
        print(
            f"  {label:20s} {r['seconds']:7.2f} s/step {r['peak_mib']:8.0f} MiB  forward tokens {r['forward_tokens']:6.0f}"
            f"  padding {r['padding_frac']:.3f}{ratio}"
        )


def _heap_job(spec: dict) -> dict:
    """The default preset's learner step and one rollout engine call (8 prompts x n = 8, <= 16
    tokens), at the precision ``auto`` picks here, with glibc's allocator as it comes or told to
    keep freed memory (cpu/allocator.py; what drpo's CPU actors do)."""
    import torch

    torch.set_num_threads(2)
    from controller.hardware import auto_precision
    from learner import distributed
    from learner.config import LearnerConfig, OptimizerConfig
    from cpu.allocator import keep_freed_memory
    from learner.learner import Learner
    from objectives.config import DRPOConfig
    from rollout.engine import SamplingParams
    from rollout.hf_engine import HFEngine
    from rollout.offline_model import materialize_smollm2
    from rollout.tasks import arithmetic_split

    if spec["keep"] and not keep_freed_memory():
        raise RuntimeError("this C library takes no mallopt settings")
    precision = auto_precision(0)
    folder = materialize_smollm2()
    cfg = LearnerConfig(objective=DRPOConfig(delta=0.2), optimizer=OptimizerConfig(lr=1e-6), precision=precision, packing="shared_prompt")
    distributed.init(cfg.parallel, 0, 1, master_port=distributed.free_port())
    learner = Learner.build(cfg, model_folder=folder)
    batch = _preset_batch(folder, learner.arch.vocab_size)
    first = time.perf_counter()
    learner.train(batch)
    first = time.perf_counter() - first
    times = []
    for _ in range(spec["steps"]):
        t0 = time.perf_counter()
        learner.train(batch)
        times.append(time.perf_counter() - t0)
    del learner
    engine = HFEngine(str(folder), precision=precision, num_threads=2)
    prompts = [engine.chat_prompt(p.prompt) for p in arithmetic_split("train", 8)]
    engine.generate(prompts[:2], SamplingParams(n=1, max_new_tokens=2))
    calls = []
    for c in range(spec["steps"]):
        t0 = time.perf_counter()
        engine.generate(prompts, SamplingParams(n=8, max_new_tokens=16, seed=c))
        calls.append(time.perf_counter() - t0)
    return {"first": first, "seconds": statistics.median(times), "generate": statistics.median(calls), "precision": precision}


def _print_heap(rounds: int, steps: int) -> None:
    specs = {"glibc as it comes": {"keep": False, "steps": steps}, "freed memory kept": {"keep": True, "steps": steps}}
    res = interleaved_medians("benchmarks.learner.run", "heap", specs, rounds, ("first", "seconds", "generate"))
    print(f"glibc's allocator in the CPU actors: the default preset's learner step and one engine call (8 prompts x 8 samples, "
          f"<= 16 tokens); medians of {rounds} interleaved rounds of fresh processes, {steps} steps and calls each")
    base = res["glibc as it comes"]
    for label, r in res.items():
        if "error" in r:
            print(f"  {label:18s} {r['error']}")
            continue
        print(f"  {label:18s} first step {r['first']:6.2f} s, later steps {r['seconds']:6.2f} s (x{base['seconds'] / r['seconds']:.2f}), "
              f"engine call {r['generate']:5.2f} s (x{base['generate'] / r['generate']:.2f})")


def _gap_job(spec: dict) -> dict:
    """Lag-0 numerics gap |pi - mu| on the default task: completions sampled by the hf engine at
    each precision (8 prompts x 8 samples x <= 16 tokens, T = 1), pi from an fp32 and a bf16
    learner on the same weights (version 0)."""
    import torch

    torch.set_num_threads(2)
    from controller.batch_builder import BatchBuilder
    from learner import distributed
    from learner.config import LearnerConfig
    from learner.learner import Learner
    from objectives.config import AdvantageConfig
    from rollout.engine import SamplingParams
    from rollout.hf_engine import HFEngine
    from rollout.offline_model import materialize_smollm2
    from rollout.records import Group, Sample, TrainTicket
    from rollout.rewards import RewardResult
    from rollout.tasks import arithmetic_split

    folder = str(materialize_smollm2())
    problems = arithmetic_split("train", 8)
    batches = {}
    for precision in ("fp32", "bf16", "fp8"):
        engine = HFEngine(folder, precision=precision, num_threads=2)
        out = engine.generate([engine.chat_prompt(p.prompt) for p in problems], SamplingParams(n=8, max_new_tokens=16, seed=0))
        groups = [Group(TrainTicket(0, p.id), 0, tuple(Sample(c, "", RewardResult(float(i % 2), None, "")) for i, c in enumerate(cs)), 0, 0.0)
                  for p, cs in zip(problems, out)]
        batches[precision] = BatchBuilder.build(AdvantageConfig(filter_zero_variance=False)).batch(groups, 0).train
        del engine
    distributed.init(LearnerConfig().parallel, 0, 1, master_port=distributed.free_port())
    out = {}
    for learner_precision in ("fp32", "bf16"):
        learner = Learner.build(LearnerConfig(precision=learner_precision, packing="shared_prompt"), model_folder=folder)
        for engine_precision, batch in batches.items():
            logp = learner.batch_logprobs(batch).logp
            shift = (logp.exp() - batch.rollout_logp.exp()).abs()[batch.response_mask]
            out[f"{learner_precision} learner / {engine_precision} engine"] = {"mean": float(shift.mean()), "max": float(shift.max())}
    return out


def _print_gap() -> None:
    res = run_worker("benchmarks.learner.run", "gap", {})
    print("Lag-0 numerics gap |pi - mu| at sampled tokens, SmolLM2-135M, default task (8 x 8 samples, hf engine)")
    if "error" in res:
        print(f"  {res['error']}")
        return
    for pair, r in res.items():
        print(f"  {pair:28s} mean {r['mean']:.5f}   max {r['max']:.4f}")


JOBS = {"step": _step_job, "publish": _publish_job, "preset": _preset_job, "gap": _gap_job, "heap": _heap_job}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--only", choices=["preset", "gap", "step", "publish", "heap"])
    args = parser.parse_args()
    if args.worker:
        kind, spec = args.worker
        print(json.dumps(JOBS[kind](json.loads(spec))))
        return 0
    if args.only in (None, "preset"):
        _print_preset(args.rounds, args.steps)
    if args.only in (None, "heap"):
        _print_heap(args.rounds, args.steps)
    if args.only in (None, "gap"):
        _print_gap()
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
