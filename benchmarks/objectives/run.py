"""Side-by-side benchmarks of the objectives library. Prints ratios measured in one run.

    .venv/bin/python -m benchmarks.objectives.run            # both benchmarks (from the repo root)
    .venv/bin/python -m benchmarks.objectives.run --only objectives --rounds 5

1. Objective forward+backward (metrics included, as the learner runs it) on 64 x 4096 tokens:
   each objective against ppo_clip. Goal for drpo: <= 1.05x time and peak memory.
2. Chunked vs naive log-prob + entropy from hidden states, vocabulary 151,936, hidden 896
   (Qwen2.5-0.5B's shapes). Goal: <= 0.25x peak memory, <= 1.0x time.

Every measurement runs in a fresh subprocess, variants interleaved round by round (this machine is
shared and noisy; only ratios measured side by side mean anything). Time and memory are measured in
separate processes. Time: median over repetitions after a warm-up, default allocator. Peak memory:
the rise of the process's resident-set high-water mark (VmHWM, reset through /proc/self/clear_refs)
over its RSS before the measured call, with glibc forced to mmap every allocation >= 64 KiB
(MALLOC_MMAP_THRESHOLD_) so freed tensors leave the RSS at once; that setting slows small
allocations several-fold, which is why time is not measured under it.
"""

from __future__ import annotations

import argparse
import json
import re
import resource
import statistics
import sys
import time

from benchmarks.harness import peak_mib_since, reset_peak, run_worker

# ---- worker side ---------------------------------------------------------------------------------


def _measure(fn, spec: dict) -> dict:
    """After spec["warmup"] calls (default 1): median seconds over spec["reps"] calls, or peak MiB of one.

    ``single`` (for runs of minutes): no warm-up, and one call gives both peak MiB and seconds.
    """
    if spec.get("single"):
        before = reset_peak()
        t0 = time.perf_counter()
        fn()
        return {"seconds": time.perf_counter() - t0, "peak_mib": peak_mib_since(before)}
    for _ in range(spec.get("warmup", 1)):
        fn()
    if spec["measure"] == "time":
        times = []
        for _ in range(spec["reps"]):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return {"seconds": statistics.median(times)}
    before = reset_peak()
    fn()
    return {"peak_mib": peak_mib_since(before)}


def _objective_job(spec: dict) -> dict:
    import torch

    import objectives

    torch.manual_seed(0)
    shape = (spec["batch"], spec["tokens"])
    rollout_logp = torch.rand(shape).mul(-8.0)
    policy_logp = (rollout_logp + 0.05 * torch.randn(shape)).clamp(max=0.0).requires_grad_()
    advantages = torch.randn(shape)
    mask = torch.rand(shape) > 0.02
    config = objectives.make_config(spec["name"])

    def step():
        out = objectives.compute(config, objectives.ObjectiveInputs(policy_logp, rollout_logp, advantages, mask))
        objectives.aggregate(out.loss, mask, "token-mean").backward()
        policy_logp.grad = None

    return _measure(step, spec)


def _logprob_job(spec: dict) -> dict:
    import torch

    from objectives.logprobs import logprobs_from_hidden, naive_logprobs

    if spec.get("limit_gib"):
        limit = int(spec["limit_gib"] * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    torch.manual_seed(0)
    n, vocab, hidden_size = spec["tokens"], spec["vocab"], spec["hidden"]
    backward = spec["backward"]
    hidden = torch.randn(n, hidden_size).requires_grad_(backward)
    weight = (0.05 * torch.randn(vocab, hidden_size)).requires_grad_(backward)
    targets = torch.randint(0, vocab, (n,))

    def step():
        with torch.set_grad_enabled(backward):
            if spec["impl"] == "naive":
                out = naive_logprobs(hidden @ weight.t(), targets, 0.9, entropy=True)
            else:
                out = logprobs_from_hidden(hidden, weight, targets, 0.9, entropy=True)
            if backward:
                (out.logp.sum() + 0.01 * out.entropy.sum()).backward()
                hidden.grad = weight.grad = None

    try:
        return _measure(step, spec)
    except (RuntimeError, MemoryError) as err:
        message = str(err).splitlines()[0]
        wanted = re.search(r"tried to allocate (\d+) bytes", message)
        if wanted:
            gib = int(wanted.group(1)) / 2**30
            return {"error": f"out of memory under the {spec['limit_gib']} GiB cap (one more tensor of {gib:.1f} GiB)"}
        return {"error": f"{type(err).__name__}: {message[:160]}"}


JOBS = {"objective": _objective_job, "logprobs": _logprob_job}


# ---- driver side ---------------------------------------------------------------------------------


def run_job(kind: str, spec: dict) -> dict:
    return run_worker(__name__ if __name__ != "__main__" else "benchmarks.objectives.run", kind, spec, mmap_threshold=spec["measure"] == "memory")


def interleaved(kind: str, specs: dict[str, dict], rounds: int) -> dict[str, dict]:
    """Run every variant once per round, in turn; median of each field over the rounds."""
    results: dict[str, list[dict]] = {k: [] for k in specs}
    for _ in range(rounds):
        for label, spec in specs.items():
            for measure in ("memory",) if spec.get("single") else ("time", "memory"):
                results[label].append(run_job(kind, dict(spec, measure=measure)))
    summary = {}
    for label, runs in results.items():
        errors = [r["error"] for r in runs if "error" in r]
        if errors:
            summary[label] = {"error": errors[0]}
            continue
        summary[label] = {k: statistics.median(r[k] for r in runs if k in r) for k in ("seconds", "peak_mib")}
    return summary


def _row(label: str, res: dict, base: dict) -> str:
    if "error" in res:
        return f"  {label:28s} {res['error']}"
    if "error" in base:
        return f"  {label:28s} {res['seconds'] * 1e3:10.1f} ms {res['peak_mib']:10.1f} MiB"
    return (
        f"  {label:28s} {res['seconds'] * 1e3:10.1f} ms {res['peak_mib']:10.1f} MiB"
        f"   time x{res['seconds'] / base['seconds']:.3f}   memory x{res['peak_mib'] / max(base['peak_mib'], 1e-9):.3f}"
    )


def bench_objectives(rounds: int, names: list[str]) -> None:
    print(f"Objective forward+backward, 64 x 4096 tokens, fp32, metrics included; median of {rounds} interleaved rounds")
    specs = {n: {"name": n, "batch": 64, "tokens": 4096, "reps": 100, "warmup": 10} for n in ["ppo_clip", *names]}
    res = interleaved("objective", specs, rounds)
    for label in specs:
        print(_row(label, res[label], res["ppo_clip"]))


def bench_logprobs(rounds: int, full: bool, small: bool = True) -> None:
    vocab, hidden = 151_936, 896
    # The size, 8 x 2048 tokens, takes minutes per call here and the naive path needs
    # ~30 GiB (three fp32 [16384, 151936] tensors): it runs once, without warm-up, and the naive
    # process is capped at 20 GiB of address space so it fails cleanly instead of meeting the
    # OOM killer. 8 x 256 tokens, where both fit, gives the interleaved ratios.
    configs = ([(8 * 256, rounds, False)] if small else []) + ([(8 * 2048, 1, True)] if full else [])
    for tokens, n_rounds, single in configs:
        for backward in (False, True):
            what = "forward+backward" if backward else "forward (no grad)"
            print(f"log-prob + entropy from hidden, {tokens} tokens, vocab {vocab}, hidden {hidden}, {what}; {n_rounds} round(s)")
            base = {"tokens": tokens, "vocab": vocab, "hidden": hidden, "backward": backward, "reps": 1, "limit_gib": 20}
            base["single"] = single
            specs = {"naive": dict(base, impl="naive"), "chunked": dict(base, impl="chunked")}
            res = interleaved("logprobs", specs, n_rounds)
            print(_row("naive (full fp32 logits)", res["naive"], res["naive"]))
            print(_row("chunked", res["chunked"], res["naive"]))
            sys.stdout.flush()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", nargs=2, metavar=("KIND", "SPEC"), help=argparse.SUPPRESS)
    parser.add_argument("--only", choices=["objectives", "logprobs"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--objectives", default="drpo,dppo_binary_tv,spo,cispo,mask_drpo")
    parser.add_argument("--no-full", action="store_true", help="skip the 8 x 2048-token log-prob size (minutes)")
    parser.add_argument("--full-only", action="store_true", help="log-probs: only the 8 x 2048-token size")
    args = parser.parse_args()
    if args.worker:
        kind, spec = args.worker
        print(json.dumps(JOBS[kind](json.loads(spec))))
        return 0
    if args.only in (None, "objectives"):
        bench_objectives(args.rounds, [n for n in args.objectives.split(",") if n])
    if args.only in (None, "logprobs"):
        bench_logprobs(args.rounds, not args.no_full, small=not args.full_only)
    return 0


if __name__ == "__main__":
    sys.exit(main())
