"""Controller benchmarks (from the repo root):

    .venv/bin/python -m benchmarks.controller.run            # simulation only (seconds)
    .venv/bin/python -m benchmarks.controller.run --real 4   # + the embedded default, sync vs async
    .venv/bin/python -m benchmarks.controller.run --before-after 5   # the earlier default preset (async, fp32 learner, no packing) vs today's
    .venv/bin/python -m benchmarks.controller.run --engines 5        # the default preset, hf vs vllm rollout workers

Simulation: the Controller over SimulatedBackend with balanced stages (W workers at 1 group/s each,
a training step of B = 4W groups taking 4 s, so both stages run at W groups/s). Reports async
throughput / ideal bound (the slower stage's rate), sync likewise, and async / sync. Zero-variance
filtering is off so every generated group counts toward the bound.

Real: the embedded default (SmolLM2-135M, arithmetic, DRPO) for a few steps in sync mode (2 torch
threads per actor: the stages alternate), async mode with 1 thread each (they overlap) and async
with the learner on 2 threads (oversubscribed while both run), one after the other in one process
on one local Ray cluster; seconds per step and tokens/s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile

from controller.app import train
from controller.config import load_config

WORKERS = (1, 8, 64, 256)
VARIANTS = (  # name, mode, rollout threads, learner threads (2 cores)
    ("sync (2+2 threads)", "sync", 2, 2),
    ("async (1+1 threads)", "async", 1, 1),
    ("async (rollout 1, learner 2)", "async", 1, 2),
)


def step_records(run_dir: str) -> list[dict]:
    with open(f"{run_dir}/metrics.jsonl") as f:
        return [r for r in map(json.loads, f) if r["kind"] == "step"]


def simulate(workers: int, mode: str, steps: int, eta: int, gen_cv: float) -> float:
    """Trained groups per simulated second."""
    batch = 4 * workers
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(overrides=[
            f"run_dir={tmp}", f"rollout.workers={workers}", "rollout.samples_per_prompt=4", f"train.mode={mode}",
            f"train.max_staleness={0 if mode == 'sync' else eta}", f"train.steps={steps}", f"train.prompts_per_step={batch}",
            "advantages.filter_zero_variance=false", "eval.at_start=false", "eval.every=0", "checkpoint.every=0",
            "metrics.port=null", "metrics.progress=false", "task.test_size=1", f"task.train_size={batch * 4}",
            f"simulation={{gen_seconds: 1.0, gen_cv: {gen_cv}, train_seconds: 4.0, train_cv: 0.1}}",
        ])
        result = train(cfg)
        # measured up to the last step: the final held-out evaluation (1 prompt) is excluded
        return result.steps * batch / step_records(tmp)[-1]["time"]


def simulation_table(steps: int, eta: int, gen_cv: float) -> None:
    print(f"simulation: balanced stages (ideal W groups/s), eta = {eta}, generation cv = {gen_cv}, {steps} steps")
    print(f"{'workers':>8} {'async/ideal':>12} {'sync/ideal':>11} {'async/sync':>11}")
    for w in WORKERS:
        a, s = simulate(w, "async", steps, eta, gen_cv), simulate(w, "sync", steps, eta, gen_cv)
        print(f"{w:>8} {a / w:>12.3f} {s / w:>11.3f} {a / s:>11.2f}")


def real(steps: int) -> None:
    import ray

    from controller.cli import _init_ray

    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        base = load_config()
        _init_ray(base)
        for name, mode, rollout_threads, learner_threads in VARIANTS:
            eta = 0 if mode == "sync" else 1
            cfg = load_config(overrides=[
                f"run_dir={tmp}/{name}", f"train.mode={mode}", f"train.max_staleness={eta}", f"train.steps={steps}",
                f"rollout.threads={rollout_threads}", f"learner_resources.threads={learner_threads}", "eval.at_start=false",
                "eval.every=0", "checkpoint.every=0", "metrics.progress=false", "task.test_size=8",
            ])
            train(cfg)
            recs = step_records(f"{tmp}/{name}")[1:]  # the first step includes engine warm-up
            rows[name] = (
                statistics.median(r["step_seconds"] for r in recs),
                statistics.median(r["learner/tokens"] / r["step_seconds"] for r in recs),
            )
        ray.shutdown()
    print(f"\nreal: embedded default, {steps} steps per mode (first excluded), medians")
    print(f"{'variant':>30} {'s/step':>8} {'trained tokens/s':>17} {'x sync':>7}")
    for name, (sec, tps) in rows.items():
        print(f"{name:>30} {sec:>8.1f} {tps:>17.1f} {rows[VARIANTS[0][0]][0] / sec:>7.2f}")


BEFORE = (  # the earlier embedded default (async, fp32 learner, unpacked), as overrides of today's preset
    "train.mode=async", "train.max_staleness=1", "rollout.threads=1", "learner_resources.threads=2", "learner.precision=fp32",
    "learner.packing=none", "learner.micro_batch_size=16", "eval.concurrent=true",
)


def interleaved_train(variants: dict[str, tuple[str, ...]], steps: int, rounds: int) -> dict[str, list[dict]]:
    """Each variant (overrides of the embedded default) trained for ``steps`` steps per round, the
    variants in turn, on one local Ray cluster; no evaluations or checkpoints. Returns each
    variant's step records with every run's first step (warm-up) dropped."""
    import ray

    from controller.cli import _init_ray

    records: dict[str, list[dict]] = {name: [] for name in variants}
    with tempfile.TemporaryDirectory() as tmp:
        _init_ray(load_config())
        for r in range(rounds):
            for name, extra in variants.items():
                run_dir = f"{tmp}/{name}-{r}"
                train(load_config(overrides=[
                    f"run_dir={run_dir}", f"train.steps={steps}", "eval.at_start=false", "eval.every=0", "checkpoint.every=0",
                    "checkpoint.hf=false", "metrics.progress=false", "task.test_size=8", *extra,
                ]))
                records[name] += step_records(run_dir)[1:]
        ray.shutdown()
    return records


def before_after(steps: int, rounds: int) -> None:
    """A whole drpo train step on the embedded default, the earlier preset (async, fp32 learner, unpacked) and today's,
    interleaved (before, after, before, ...). Engine changes of the same issue (prompt prefilled
    once per group, CDF sampling) are in both: what differs is the configuration."""
    records = interleaved_train({"before": BEFORE, "after": ()}, steps, rounds)
    b, a = (statistics.median(r["step_seconds"] for r in records[k]) for k in ("before", "after"))
    print(f"\nwhole step, embedded default, {rounds} interleaved rounds x {steps} steps (first excluded), median s/step")
    print(f"  before (async, fp32 learner, no packing)   {b:6.1f}")
    print(f"  after  (today's preset)                    {a:6.1f}   x{b / a:.2f} faster")


def generation_tokens_per_second(rec: dict) -> float:
    """Sync mode: the step's generated tokens over its time outside training and publication."""
    return rec["rollout/tokens_per_second"] * rec["step_seconds"] / max(
        rec["step_seconds"] - rec["learner/seconds"] - rec["rollout/publish_seconds"], 1e-9
    )


def engines(steps: int, rounds: int) -> None:
    """The embedded default with hf and with vllm rollout workers, interleaved: s/step and the
    engine's generated tokens/s (the default is sync mode, so generation has the step's cores)."""
    variants = {"hf": ("rollout.engine=hf",), "vllm": ("rollout.engine=vllm", "rollout.kv_cache_gib=1")}
    records = interleaved_train(variants, steps, rounds)
    print(f"\nembedded default (sync, bf16 engine), {rounds} interleaved rounds x {steps} steps (first excluded), medians")
    print(f"{'engine':>8} {'s/step':>8} {'generation s':>13} {'generated tokens/s':>19} {'x hf':>6}")
    rows = {}
    for name, recs in records.items():
        sec = statistics.median(r["step_seconds"] for r in recs)
        gen = statistics.median(r["step_seconds"] - r["learner/seconds"] - r["rollout/publish_seconds"] for r in recs)
        rows[name] = (sec, gen, statistics.median(map(generation_tokens_per_second, recs)))
    for name, (sec, gen, tps) in rows.items():
        print(f"{name:>8} {sec:>8.1f} {gen:>13.1f} {tps:>19.1f} {tps / rows['hf'][2]:>6.2f}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100, help="simulated steps per point")
    parser.add_argument("--eta", type=int, default=2)
    parser.add_argument("--gen-cv", type=float, default=0.5)
    parser.add_argument("--real", type=int, default=0, metavar="STEPS", help="also run the embedded default for STEPS steps per mode")
    parser.add_argument("--before-after", type=int, default=0, metavar="STEPS", help="only: the earlier default preset (async, fp32 learner, unpacked) vs today's")
    parser.add_argument("--engines", type=int, default=0, metavar="STEPS", help="only: the default preset with hf vs vllm workers")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds of --before-after / --engines")
    args = parser.parse_args()
    if args.engines:
        engines(args.engines, args.rounds)
        return
    if args.before_after:
        before_after(args.before_after, args.rounds)
        return
    simulation_table(args.steps, args.eta, args.gen_cv)
    if args.real:
        real(args.real)


if __name__ == "__main__":
    main()
