"""The DRPO paper's comparison at small scale (from the repo root):

    .venv/bin/python -m benchmarks.experiments.run                      # the grid in grid.yaml
    .venv/bin/python -m benchmarks.experiments.run --only drpo,grpo     # a subset of objectives
    .venv/bin/python -m benchmarks.experiments.run --docs docs/results.md

Runs every cell (objective x mismatch setting x seed, plus the drpo delta sweep) as a real drpo
training run on one local Ray cluster, one after the other, into OUT/cells/NAME (a finished cell is
not run again, so an interrupted grid resumes). Writes OUT/results.json, OUT/results.md (the table)
and OUT/accuracy.png (held-out accuracy per setting); ``--docs`` also writes the markdown report.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from benchmarks.experiments.reporting import COLLAPSE_DROP, copy_assets, largest, markdown, mean, overrides, replace_block, sd, se

HERE = Path(__file__).parent


@dataclass(frozen=True)
class GridCell:
    name: str
    objective: str
    setting: str
    seed: int
    overrides: tuple[str, ...]

    def row(self) -> dict:
        return {"cell": self.name, "objective": self.objective, "setting": self.setting, "seed": self.seed}


def grid_cells(grid: dict, only: set[str] | None = None) -> list[GridCell]:
    out = []
    for obj in grid["objectives"]:
        if only and obj["name"] not in only:
            continue
        for setting, sets in grid["settings"].items():
            for seed in grid["seeds"]:
                over = [f"learner.objective={json.dumps(obj['objective'])}", f"seed={seed}", *overrides(sets)]
                out.append(GridCell(f"{obj['name']}-{setting}-s{seed}", obj["name"], setting, seed, tuple(over)))
    sweep = grid.get("delta_sweep")
    if sweep and (not only or "drpo" in only):
        for delta in sweep["deltas"]:
            for seed in sweep["seeds"]:
                over = [f"learner.objective={{type: drpo, delta: {delta}}}", f"seed={seed}",
                        *overrides(grid["settings"][sweep["setting"]])]
                out.append(GridCell(f"drpo-d{delta}-{sweep['setting']}-s{seed}", f"drpo δ={delta}", sweep["setting"], seed, tuple(over)))
    return out


def summarize(run_dir: Path, target: float) -> dict:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in records if r["kind"] == "step"]
    evals = [r for r in records if r["kind"] == "eval"]

    def step_mean(key, rows=steps):
        return mean(s.get(key) for s in rows)

    def step_max(key):
        return largest(s.get(key) for s in steps)

    collapses, best = 0, 0.0
    for e in evals:
        if best > 0 and e["accuracy"] < COLLAPSE_DROP * best:
            collapses += 1
        best = max(best, e["accuracy"])
    nonfinite = sum(not math.isfinite(s.get("learner/loss", 0.0)) or not math.isfinite(s.get("learner/grad_norm", 0.0)) for s in steps)
    collapses += nonfinite
    reached = [e["step"] for e in evals if e["accuracy"] >= target]
    return {
        "start_accuracy": evals[0]["accuracy"] if evals else None, "final_accuracy": evals[-1]["accuracy"] if evals else None,
        "best_accuracy": best if evals else None, "eval_samples": evals[-1]["samples"] if evals else 0,
        "steps_to_target": reached[0] if reached else None, "collapses": collapses, "nonfinite_steps": nonfinite,
        "gap_lag0": step_mean("gap/numerics/abs_shift_mean"), "gap_lag1plus": step_mean("gap/staleness/abs_shift_mean"),
        "corrective_frac": step_mean("objective/corrective_frac"), "regularizer_mean": step_mean("objective/regularizer_mean"),
        "gap_max": step_max("gap/abs_shift_max"), "grad_norm_max": step_max("learner/grad_norm"),
        "train_reward_last5": step_mean("reward/mean", steps[-5:]), "train_reward_first5": step_mean("reward/mean", steps[:5]),
        **{f"gap_{part}_{stat}": (step_max if stat == "max" else step_mean)(f"gap/{part}/abs_shift_{stat}")
           for part in ("numerics", "inflight", "staleness") for stat in ("mean", "p99", "max")},
        "gap_proximal_max": step_max("gap/proximal/abs_shift_max"),
        "response_tokens_mean": step_mean("rollout/response_tokens_mean"), "truncated_frac": step_mean("rollout/truncated_frac"),
        "kl_k3_numerics": step_mean("gap/numerics/kl_k3"),
        "clipped_frac": step_mean("objective/clip_frac_low") + step_mean("objective/clip_frac_high") if step_mean("objective/clip_frac_low") is not None else None,
        "masked_frac": step_mean("objective/masked_frac"), "behaviour_capped_frac": step_mean("learner/behaviour_weight_capped_frac"),
        "regularizer_share": step_mean("objective/regularizer_share"),
        "reward_curve": [[s["step"], s.get("reward/mean")] for s in steps],
        "entropy_curve": [[s["step"], s.get("learner/entropy_mean")] for s in steps],
        "filtered_frac_last5": _filtered_frac(steps[-6:]),
        "seconds": (steps[-1]["time"] - steps[0]["time"]) if len(steps) > 1 else None,
        "curve": [[e["step"], e["accuracy"]] for e in evals],
    }


def _filtered_frac(steps: list[dict]) -> float | None:
    """The share of groups filtered (all rewards equal: no learning signal) over ``steps``, from the
    ledger's cumulative counts (the first step is the baseline)."""
    if len(steps) < 2 or any(s.get("ledger/filtered") is None or s.get("ledger/trained") is None for s in (steps[0], steps[-1])):
        return None
    filtered = steps[-1]["ledger/filtered"] - steps[0]["ledger/filtered"]
    trained = steps[-1]["ledger/trained"] - steps[0]["ledger/trained"]
    return filtered / (filtered + trained) if filtered + trained else None


def run_grid(grid: dict, out: Path, model_path: str, only: set[str] | None = None, log=print) -> list[dict]:
    rows = run_cells(grid_cells(grid, only), out, lambda cell: [f"model.path={model_path}", *overrides(grid["base"])], grid["target_accuracy"], log)
    (out / "results.json").write_text(json.dumps(rows, indent=1))
    return rows


def _summarized(run_dir: Path, target: float, error: str | None) -> dict:
    """summarize(run_dir); a failed cell keeps what its steps measured before it failed (counted as
    one collapse more), or only its collapse when it has no readable metrics."""
    if error is None:
        return summarize(run_dir, target)
    try:
        got = summarize(run_dir, target)
    except (OSError, ValueError, KeyError, IndexError):
        return {"collapses": 1}
    return {**got, "collapses": got["collapses"] + 1}


def run_cells(todo, out: Path, base_of, target: float, log=print, on_row=None) -> list[dict]:
    """Run every cell of ``todo`` (one drpo training run each, on the Ray cluster already up) into
    OUT/cells/NAME, skipping finished ones; ``base_of(cell)``: the overrides before the cell's own;
    ``on_row(row)`` is called as each cell's row is ready. Returns one row per cell: its fields and its summary."""
    from controller.app import train
    from controller.config import load_config
    from learner import actor_pool

    rows = []
    with actor_pool.reuse():  # a cell's worker processes serve the next cell (its start-up is not in a cell's seconds)
        for cell in todo:
            run_dir = out / "cells" / cell.name
            done = run_dir / "summary.json"
            if done.is_file():
                summary = json.loads(done.read_text())
                summary.update(_summarized(run_dir, target, summary.get("error")))  # re-read: new summary fields reach old cells
            else:
                if run_dir.exists():
                    shutil.rmtree(run_dir)  # an interrupted cell starts over
                # no Hugging Face export: a cell keeps its summary and metrics.jsonl only (below)
                cfg = load_config(overrides=[*base_of(cell), *cell.overrides, f"run_dir={run_dir}", "checkpoint.hf=false"])
                started = time.time()
                log(f"[{len(rows) + 1}/{len(todo)}] {cell.name}")
                try:
                    train(cfg)
                    summary = {**summarize(run_dir, target), "error": None}
                    for folder in ("checkpoints", "hf"):  # ~110 MB a stand-in cell; the summary and metrics.jsonl are the result (hf: cells of older runs)
                        shutil.rmtree(run_dir / folder, ignore_errors=True)
                except Exception as err:  # a diverging run is a result, not a reason to stop the grid
                    error = f"{type(err).__name__}: {err}"
                    summary = {**_summarized(run_dir, target, error), "error": error}
                    for folder in ("checkpoints", "hf"):
                        shutil.rmtree(run_dir / folder, ignore_errors=True)
                summary["wall_seconds"] = time.time() - started
                done.write_text(json.dumps(summary))
            rows.append({**cell.row(), **summary})
            if on_row is not None:
                on_row(rows[-1])
    return rows


GAP = ["mean \\|π−μ\\| lag 0", "lag ≥ 1", "max \\|π−μ\\|", "corrective", "regularizer"]


def _gaps(rs: list[dict]) -> list:
    return [mean(r.get(k) for r in rs) for k in ("gap_lag0", "gap_lag1plus")] + [
        largest(r.get("gap_max") for r in rs),
        mean(r.get("corrective_frac") for r in rs), mean(r.get("regularizer_mean") for r in rs)]


def table(rows: list[dict]) -> str:
    """Every cell."""
    head = ["objective", "setting", "seed", "start acc", "final acc", "best acc", "n", "steps to target", "collapses",
            "train reward (last 5 steps)", "max grad norm", *GAP]
    return markdown(head, [
        [r["objective"], r["setting"], r["seed"], r.get("start_accuracy"), r.get("final_accuracy"), r.get("best_accuracy"),
         r.get("eval_samples", 0), r.get("steps_to_target"),
         f"{r.get('collapses', 0)}" + (f" ({r['error'][:40]})" if r.get("error") else ""),
         r.get("train_reward_last5"), r.get("grad_norm_max"), *_gaps([r])]
        for r in rows])


def _groups(rows: list[dict], key) -> dict:
    out: dict = {}
    for r in rows:
        out.setdefault(key(r), []).append(r)
    return out


def _gains(rs: list[dict]) -> list[float]:
    """Final minus start held-out accuracy of every evaluated cell."""
    return [r["final_accuracy"] - r["start_accuracy"] for r in rs if r.get("final_accuracy") is not None]


def _accuracy_columns(rs: list[dict]) -> list:
    finals = [r["final_accuracy"] for r in rs if r.get("final_accuracy") is not None]
    gains = _gains(rs)
    return [len(rs), mean(r.get("start_accuracy") for r in rs), mean(finals), mean(gains), se(gains), min(finals, default=None),
            mean(r.get("best_accuracy") for r in rs), f"{sum(r.get('steps_to_target') is not None for r in rs)}/{len(rs)}",
            sum(r.get("collapses", 0) for r in rs), mean(r.get("train_reward_last5") for r in rs),
            largest(r.get("grad_norm_max") for r in rs)]


ACCURACY = ["cells", "mean start acc", "mean final acc", "mean gain", "± se", "min final acc", "mean best acc", "reached target",
            "collapses", "train reward (last 5)", "max grad norm"]


def grid_summary_table(rows: list[dict]) -> str:
    """One line per (objective, setting): means over seeds, collapses summed, maxima over cells."""
    return markdown(["objective", "setting", *ACCURACY, *GAP], [
        [objective, setting, *_accuracy_columns(rs), *_gaps(rs)]
        for (objective, setting), rs in _groups(rows, lambda r: (r["objective"], r["setting"])).items()])


def objective_table(rows: list[dict]) -> str:
    """One line per objective, pooled over settings and seeds (more cells, so smaller noise)."""
    return markdown(["objective", *ACCURACY], [
        [objective, *_accuracy_columns(rs)] for objective, rs in _groups(rows, lambda r: r["objective"]).items()])


def noise_floor(rows: list[dict]) -> str:
    """Every cell's step-0 evaluation is of the same starting model: their spread is the evaluation noise."""
    starts = [r["start_accuracy"] for r in rows if r.get("start_accuracy") is not None]
    if len(starts) < 2:
        return "Evaluation noise: fewer than two cells evaluated."
    m, spread = mean(starts), sd(starts)
    n = max(r.get("eval_samples", 0) for r in rows) or 1
    return (f"Evaluation noise: the starting model's held-out accuracy over the {len(starts)} cells' step-0 evaluations "
            f"is {m:.3f} ± {spread:.3f} (sd; range {min(starts):.3f}–{max(starts):.3f}); the binomial standard error at "
            f"n = {n} is {math.sqrt(m * (1 - m) / n):.3f}. A difference between two single cells below about "
            f"{2 * math.sqrt(2) * spread:.2f} is within noise.")


BEGIN, END = "<!-- results:begin (written by benchmarks/experiments/run.py --docs) -->", "<!-- results:end -->"


def write_grid_docs(path: Path, rows: list[dict], out: Path, grid_path: str, grid: dict) -> None:
    """The generated part of the report page: command, machine, tables, plot. Text outside the
    markers (the written reading of the results) is kept when the page already exists."""
    import os

    path = Path(path)
    assets = copy_assets(path, out, PLOTS)
    seconds = sum(r.get("wall_seconds") or 0.0 for r in rows)
    generated = (
        f"\n\nCommand: `.venv/bin/python -m benchmarks.experiments.run --grid {os.path.relpath(grid_path)} --docs {path}` "
        f"(model: {grid['model']}); machine: {platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}; {len(rows)} cells, {seconds / 3600:.2f} h of training wall time.\n\n"
        f"{noise_floor(rows)}\n\n### By objective (pooled over settings and seeds)\n\n{objective_table(rows)}\n"
        f"### By objective and setting (means over seeds)\n\n{grid_summary_table(rows)}\n### Every cell\n\n{table(rows)}\n"
        f"![final minus start accuracy]({assets.name}/gain.png)\n\n![held-out accuracy per setting]({assets.name}/accuracy.png)\n\n"
    )
    replace_block(path, BEGIN, END, generated)


PLOTS = ("accuracy.png", "gain.png")


def plot_grid(rows: list[dict], folder: Path) -> list[Path]:
    """accuracy.png: held-out accuracy curves (mean over seeds), one panel per setting; gain.png: final minus start
    accuracy per objective and setting (bar = mean over seeds, dots = the seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = list(dict.fromkeys(r["setting"] for r in rows))
    objectives = list(dict.fromkeys(r["objective"] for r in rows))
    colors = {name: f"C{i % 10}" for i, name in enumerate(objectives)}
    cells_of = _groups(rows, lambda r: (r["objective"], r["setting"]))
    fig, axes = plt.subplots(1, len(settings), figsize=(5 * len(settings), 3.6), squeeze=False)
    for ax, setting in zip(axes[0], settings):
        for objective in objectives:  # mean over seeds at each evaluated step
            by_step: dict[int, list[float]] = {}
            for r in cells_of.get((objective, setting), []):
                for step, acc in r.get("curve") or []:
                    by_step.setdefault(step, []).append(acc)
            if by_step:
                xs = sorted(by_step)
                ax.plot(xs, [sum(by_step[x]) / len(by_step[x]) for x in xs], marker="o", markersize=3,
                        color=colors[objective], label=objective)
        ax.set_title(f"{setting} (mean over seeds)")
        ax.set_xlabel("step")
        ax.set_ylabel("held-out accuracy")
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(Path(folder) / PLOTS[0], dpi=80)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(max(6.0, 2.5 * len(settings)), 3.6))
    width = 0.8 / len(objectives)
    for i, objective in enumerate(objectives):
        for j, setting in enumerate(settings):
            gains = _gains(cells_of.get((objective, setting), []))
            if gains:
                x = j + (i - (len(objectives) - 1) / 2) * width
                ax.bar(x, sum(gains) / len(gains), width, color=colors[objective], label=objective)
                ax.plot([x] * len(gains), gains, "k.", markersize=3)
    ax.axhline(0.0, color="grey", linewidth=0.5)
    ax.set_xticks(range(len(settings)), settings)
    ax.set_ylabel("final − start held-out accuracy")
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    ax.legend(unique.values(), unique.keys(), fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(Path(folder) / PLOTS[1], dpi=80)
    plt.close(fig)
    return [Path(folder) / name for name in PLOTS]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--grid", default=str(HERE / "grid.yaml"))
    parser.add_argument("--out", default=str(HERE / "results"))
    parser.add_argument("--only", help="comma-separated objective names")
    parser.add_argument("--docs", help="also write the markdown report here (docs/results.md)")
    args = parser.parse_args()
    grid = yaml.safe_load(Path(args.grid).read_text())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    from benchmarks.experiments.standin import StandinSpec, build_standin
    from controller.cli import _init_ray
    from controller.config import load_config
    from rollout.offline_model import materialize_smollm2

    smollm2 = materialize_smollm2()
    model = smollm2 if grid["model"] == "smollm2" else build_standin(out / "standin", smollm2, StandinSpec(**grid.get("standin", {})))
    _init_ray(load_config())
    rows = run_grid(grid, out, str(model), set(args.only.split(",")) if args.only else None)
    (out / "results.md").write_text(table(rows))
    plot_grid(rows, out)
    print(noise_floor(rows), objective_table(rows), grid_summary_table(rows), sep="\n\n")
    if args.docs:
        write_grid_docs(Path(args.docs), rows, out, args.grid, grid)


if __name__ == "__main__":
    main()
