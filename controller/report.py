"""``drpo report RUN_DIR``: a self-contained HTML report (PNGs embedded) and a PNG overview of a run,
for people without Grafana. Reads only the run folder: metrics.jsonl and config.yaml.

Plots: reward and accuracy (train and held-out), the off-policy gap split by version lag, the
regularizer (magnitude, share, corrective fraction), the DRPO weight histogram over steps, staleness
(token age and group lag against the bound) and throughput. A plot whose metrics the run does not
have says so instead of failing (a simulated run has no gap, a PPO run no regularizer).
"""

from __future__ import annotations

from controller.eval_metrics import describe_set

import base64
import html
import io
import json
import math
from dataclasses import dataclass
from pathlib import Path

import yaml

PLOTS = ("reward", "gap", "regularizer", "weight_hist", "staleness", "throughput")


class ReportError(ValueError):
    """The run folder cannot be reported on; the message says why."""


@dataclass
class RunRecords:
    steps: list[dict]
    evals: list[dict]
    config: dict
    skipped: list[str]
    """'line N: reason' for every metrics.jsonl line that could not be read."""


def read_run(run_dir: Path) -> RunRecords:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise ReportError(f"{run_dir} has no metrics.jsonl: is it a drpo run folder?")
    steps, evals, skipped = [], [], []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            kind = record["kind"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:  # a line cut by a crash, or foreign
            skipped.append(f"line {number}: {type(err).__name__}")
            continue
        (steps if kind == "step" else evals if kind == "eval" else []).append(record)
    if not steps:
        raise ReportError(f"{path} has no step records" + (f" ({len(skipped)} unreadable lines)" if skipped else ""))
    config_path = run_dir / "config.yaml"
    config = yaml.safe_load(config_path.read_text()) if config_path.is_file() else {}
    return RunRecords(steps, evals, config or {}, skipped)


def _series(steps: list[dict], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for r in steps:
        v = r.get(key)
        if isinstance(v, (int, float)) and not (isinstance(v, float) and math.isnan(v)):
            xs.append(r["step"])
            ys.append(v)
    return xs, ys


def _lines(ax, steps, keys_labels, ylabel) -> bool:
    drawn = False
    for key, label, style in keys_labels:
        xs, ys = _series(steps, key)
        if xs:
            ax.plot(xs, ys, style, label=label, markersize=3)
            drawn = True
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    if drawn:
        ax.legend(fontsize=7)
    return drawn


def _bins(steps: list[dict], prefix: str) -> tuple[list[int], list[list[float]]]:
    count = 0
    while any(f"{prefix}/bin_{count}" in r for r in steps):
        count += 1
    rows = [(r["step"], [float(r.get(f"{prefix}/bin_{i}", 0.0)) for i in range(count)]) for r in steps if f"{prefix}/bin_0" in r]
    return [s for s, _ in rows], [b for _, b in rows]


def _plot(name: str, ax, run: RunRecords) -> bool:
    steps = run.steps
    if name == "reward":
        drawn = _lines(ax, steps, [("reward/mean", "train reward", "-o"), ("reward/accuracy", "train accuracy", "--")], "reward / accuracy")
        if run.evals:
            ax.plot([e["step"] for e in run.evals], [e["accuracy"] for e in run.evals], "s-", label="eval accuracy (first set, mean@k)")
            ax.legend(fontsize=7)
            drawn = True
        ax.set_title("reward and accuracy")
        return drawn
    if name == "gap":
        ax.set_title("|π−μ| by version lag")
        return _lines(ax, steps, [
            ("gap/numerics/abs_shift_mean", "mean, lag 0 (numerics)", "-o"), ("gap/staleness/abs_shift_mean", "mean, lag ≥ 1 (staleness)", "-s"),
            ("gap/numerics/abs_shift_p99", "p99, lag 0", ":"), ("gap/staleness/abs_shift_p99", "p99, lag ≥ 1", "--"),
            ("gap/inflight/abs_shift_mean", "mean, lag 0 after an update mid-request", "-^"),
            *[(f"gap/update_{i}/abs_shift_mean", f"mean at update {i} of the batch (π moved by its earlier updates)", "-.")
              for i in range(1, int(max((s.get("learner/updates", 1) for s in steps), default=1)))],
        ], "|π − μ|")
    if name == "regularizer":
        ax.set_title("regularizer")
        return _lines(ax, steps, [
            ("objective/regularizer_mean", "mean quadratic term", "-o"), ("objective/regularizer_share", "share of the loss", "-s"),
            ("objective/corrective_frac", "corrective fraction (w < 0)", "--"), ("objective/weight_above_one_frac", "w > 1 fraction", ":"),
            ("objective/weight_abs_dev_mean", "mean |w − 1|", "-^"),
        ], "value")
    if name == "weight_hist":
        xs, rows = _bins(steps, "objective/weight_hist")
        ax.set_title("DRPO gradient weight w (tokens per bin)")
        if not xs:
            return False
        import numpy as np

        grid = np.array(rows).T
        delta = (run.config.get("learner", {}).get("objective", {}) or {}).get("delta")
        extent = [xs[0] - 0.5, xs[-1] + 0.5, 1 - 1 / delta, 1 + 1 / delta] if delta else None
        ax.imshow(np.log1p(grid), aspect="auto", origin="lower", extent=extent, cmap="viridis")
        ax.set_xlabel("step")
        ax.set_ylabel("w" if delta else "bin")
        return True
    if name == "staleness":
        xs, rows = _bins(steps, "staleness/token_lag_hist")
        ax.set_title("token age (version lag) per step")
        if xs:
            import numpy as np

            data = np.array(rows)
            bottom = np.zeros(len(xs))
            for lag in range(data.shape[1]):
                if data[:, lag].any():
                    ax.bar(xs, data[:, lag], bottom=bottom, label=f"lag {lag}")
                    bottom += data[:, lag]
            ax.set_xlabel("step")
            ax.set_ylabel("tokens")
            ax.legend(fontsize=7)
            return True
        return _lines(ax, steps, [("staleness/lag_mean", "mean group lag", "-o"), ("staleness/lag_max", "max group lag", "--"), ("staleness/max", "bound η", ":")], "versions")
    if name == "throughput":
        ax.set_title("throughput")
        return _lines(ax, steps, [
            ("step_seconds", "seconds per step", "-o"), ("learner/seconds", "learner seconds", "--"), ("rollout/publish_seconds", "weight update seconds", ":"),
        ], "seconds")
    raise ValueError(name)


def render(run: RunRecords) -> dict[str, bytes]:
    """PNG bytes of every plot, plus "overview" (all in one grid)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = {}
    for name in PLOTS:
        fig, ax = plt.subplots(figsize=(6, 3.6))
        if not _plot(name, ax, run):
            ax.text(0.5, 0.5, "no data in this run", ha="center", va="center", transform=ax.transAxes)
        fig.tight_layout()
        out[name] = _png(fig)
        plt.close(fig)
    fig, axes = plt.subplots(2, 3, figsize=(18, 7.2))
    for name, ax in zip(PLOTS, axes.flat):
        if not _plot(name, ax, run):
            ax.text(0.5, 0.5, "no data in this run", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    out["overview"] = _png(fig)
    plt.close(fig)
    return out


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return buf.getvalue()


def _summary_rows(run: RunRecords) -> list[tuple[str, str]]:
    last = run.steps[-1]
    rows = [("steps", str(last["step"])), ("policy version", str(last["version"]))]
    if run.evals:
        first, final = run.evals[0], run.evals[-1]
        rows += [
            ("eval accuracy, first", f"{first['accuracy']:.3f} (step {first['step']}, n={first['samples']})"),
            ("eval accuracy, last", f"{final['accuracy']:.3f} (step {final['step']}, n={final['samples']})"),
        ]
        for name, summary in final.get("sets", {}).items():
            start = first.get("sets", {}).get(name, {})
            rows.append((f"eval set {name}, step {first['step']} → {final['step']}", describe_set(start, summary)))
    rows += [(k, f"{v:g}") for k, v in sorted(last.items()) if k.startswith("ledger/")]
    objective = (run.config.get("learner", {}) or {}).get("objective")
    if objective:
        rows.append(("objective", ", ".join(f"{k}={v}" for k, v in objective.items())))
    train = run.config.get("train")
    if train:
        rows.append(("train", ", ".join(f"{k}={v}" for k, v in train.items())))
    if run.skipped:
        rows.append(("unreadable metrics lines", "; ".join(run.skipped[:5]) + (" …" if len(run.skipped) > 5 else "")))
    return rows


def write_report(run_dir: str | Path, out_dir: str | Path | None = None) -> Path:
    """Write report.html, report.png and one PNG per plot into ``out_dir`` (default RUN_DIR/report)."""
    run_dir = Path(run_dir)
    run = read_run(run_dir)
    out = Path(out_dir) if out_dir is not None else run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    images = render(run)
    for name, data in images.items():
        (out / ("report.png" if name == "overview" else f"{name}.png")).write_bytes(data)
    rows = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in _summary_rows(run))
    figures = "".join(
        f'<figure><img alt="{name}" src="data:image/png;base64,{base64.b64encode(images[name]).decode()}">'
        f"<figcaption>{name}</figcaption></figure>"
        for name in PLOTS
    )
    page = (
        "<!doctype html><html><head><meta charset='utf-8'><title>drpo run report</title><style>"
        "body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}th,td{padding:2px 8px;text-align:left;"
        "border-bottom:1px solid #ddd}figure{display:inline-block;margin:8px}img{max-width:600px}</style></head><body>"
        f"<h1>drpo run report</h1><p>{html.escape(str(run_dir))}</p><table>{rows}</table>{figures}</body></html>"
    )
    path = out / "report.html"
    path.write_text(page)
    return path
