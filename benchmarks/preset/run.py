"""The embedded default against its variants, side by side in one run: wall time to 0.80 held-out.

Each variant is `drpo train` on the embedded default with some `--set` overrides, run once per seed,
one at a time (they share this machine's cores). Per run: wall from launch to the first evaluation
at or above --target (start-up included; evaluations at steps 0, 5, 10, 15 — the preset itself
evaluates only at the start and the end —, so this is the time of the evaluation that first saw it), the held-out accuracy at the end, evaluation seconds per
round and their share of the run, seconds per step, learner response tokens/s and its MFU (6 x
parameters x tokens/s over this CPU's matmul peak in the learner's precision, measured here with
the learner's thread count), and what DRPO did: |pi - mu| by update, mean |w - 1|, the regularizer's
share of the loss. Ratios are against the first variant.

  python -m benchmarks.preset.run                               # the built-in variants, seeds 0 and 1
  python -m benchmarks.preset.run --seeds 0 --variant 'epochs 3=train.epochs=3'
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
RESULTS = Path(__file__).parent / "results"

VARIANTS = {
    "the default (2 mini-batches, lr 1.5e-5)": [],
    "on-policy (1 update, lr 2e-5)": ["train.mini_batches=1", "learner.optimizer.lr=2.0e-5"],
    "2 mini-batches, lr 2e-5": ["learner.optimizer.lr=2.0e-5"],
}


def matmul_peak(dtype: torch.dtype, threads: int, n: int = 1024, repeats: int = 20) -> float:
    """FLOP/s of this CPU's n x n matmul in ``dtype`` on ``threads`` threads (best of ``repeats``)."""
    torch.set_num_threads(threads)
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    best = math.inf
    for _ in range(repeats):
        began = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - began)
    return 2 * n**3 / best


def run_once(name: str, sets: list[str], seed: int, out: Path, target: float) -> dict:
    run_dir = out / f"{name.replace(' ', '_').replace(',', '')}-seed{seed}"
    command = [sys.executable, "-m", "controller.cli", "train", "--overwrite", "--set", f"run_dir={run_dir}", "--set", f"seed={seed}",
               "--set", "metrics.progress=false", "--set", "eval.every=5"]  # the preset evaluates only at the start and the end
    for s in sets:
        command += ["--set", s]
    launched = time.monotonic()  # CLOCK_MONOTONIC: the run's metrics.jsonl times are on the same clock
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
    wall = time.monotonic() - launched
    if done.returncode != 0:
        raise RuntimeError(f"{name} seed {seed} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for folder in ("checkpoints", "hf"):  # ~4 GB a run (fp32 main parameters and Adam moments); metrics.jsonl is the result
        shutil.rmtree(run_dir / folder, ignore_errors=True)
    steps = [r for r in records if r["kind"] == "step"]
    evals = [r for r in records if r["kind"] == "eval"]
    reached = next((r for r in evals if r["accuracy"] >= target), None)

    def mean(key: str) -> float:
        got = [s[key] for s in steps if key in s and not math.isnan(s[key])]
        return sum(got) / len(got) if got else math.nan

    updates = int(max(s.get("learner/updates", 1) for s in steps))
    return {
        "variant": name, "seed": seed, "wall_s": wall, "to_target_s": reached["time"] - launched if reached else None,
        "to_target_step": reached["step"] if reached else None, "heldout_end": evals[-1]["accuracy"],
        "eval_seconds": [e.get("seconds") for e in evals], "step_s": mean("step_seconds"),
        "learner_tokens_per_s": mean("learner/tokens_per_second"), "learner_s": mean("learner/seconds"),
        "shift_by_update": [mean(f"gap/update_{i}/abs_shift_mean") for i in range(updates)],
        "weight_abs_dev": mean("objective/weight_abs_dev_mean"), "regularizer_share": mean("objective/regularizer_share"),
        "corrective": mean("objective/corrective_frac"), "above_one": mean("objective/weight_above_one_frac"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--variant", action="append", default=[], help="'name=field=value[,field=value...]' (repeatable; replaces the built-ins)")
    parser.add_argument("--target", type=float, default=0.80)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    variants = {v.split("=", 1)[0]: v.split("=", 1)[1].split(",") for v in args.variant} or VARIANTS
    sys.path.insert(0, str(ROOT))
    from controller.config import load_config
    from controller.hardware import cpu_has_bf16

    cfg = load_config(None)
    threads = cfg.learner_resources.threads
    dtype = torch.bfloat16 if cfg.learner.precision == "bf16" else torch.float32
    peak = matmul_peak(dtype, threads)
    params = 134.5e6  # SmolLM2-135M
    print(f"machine: bf16 arithmetic {'yes' if cpu_has_bf16() else 'no'}; learner precision {cfg.learner.precision}; "
          f"{dtype} matmul peak on {threads} threads {peak / 1e9:.0f} GFLOP/s", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for seed in args.seeds:  # seeds outermost: a drift of the machine's speed hits every variant alike
        for name, sets in variants.items():
            row = run_once(name, sets, seed, args.out, args.target)
            row["mfu"] = 6 * params * row["learner_tokens_per_s"] / peak
            rows.append(row)
            print(json.dumps(row), flush=True)
    (args.out / "preset.json").write_text(json.dumps({"peak_flops": peak, "rows": rows}, indent=1))
    base = [r for r in rows if r["variant"] == next(iter(variants))]

    def med(rs, key):
        got = [r[key] for r in rs if r[key] is not None]
        return statistics.median(got) if got else math.nan

    print(f"\n{'variant':28} {'to 0.80 (s)':>18} {'vs first':>8} {'held-out end':>14} {'eval s/round':>12} {'s/step':>7} "
          f"{'learner tok/s':>13} {'MFU':>6} {'|pi-mu| by update':>24} {'mean|w-1|':>9} {'reg share':>9}")
    for name in variants:
        rs = [r for r in rows if r["variant"] == name]
        reached = [f"{r['to_target_s']:.0f}" if r["to_target_s"] else "never" for r in rs]
        evals = [s for r in rs for s in r["eval_seconds"] if s is not None]
        shifts = ", ".join(f"{statistics.mean(r['shift_by_update'][i] for r in rs):.4f}" for i in range(len(rs[0]["shift_by_update"])))
        ratio = med(rs, "to_target_s") / med(base, "to_target_s")
        ends = " / ".join(f"{r['heldout_end']:.3f}" for r in rs)
        print(f"{name:28} {' / '.join(reached):>18} {ratio:>8.2f} {ends:>14} "
              f"{statistics.mean(evals) if evals else math.nan:>12.1f} {med(rs, 'step_s'):>7.1f} {med(rs, 'learner_tokens_per_s'):>13.0f} "
              f"{med(rs, 'mfu'):>6.2%} {shifts:>24} {med(rs, 'weight_abs_dev'):>9.5f} {med(rs, 'regularizer_share'):>9.5f}")


if __name__ == "__main__":
    main()
