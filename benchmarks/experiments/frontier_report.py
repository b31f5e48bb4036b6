"""The stability frontier's analysis: collapse and entropy events, paired noise, per-rung stats,
the verdicts (highest rung still learning, first degraded rung), tables, plots and the docs block.
Pure functions of finished cells' rows (benchmarks/experiments/frontier.py runs them)."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from benchmarks.experiments.frontier_grid import BASE, calibration_cells, cells, labels_of
from benchmarks.experiments.reporting import COLLAPSE_DROP, copy_assets, fmt, largest, markdown, mean, replace_block, se

RESULTS_BEGIN, RESULTS_END = "<!-- frontier:begin (written by benchmarks/experiments/frontier.py --docs) -->", "<!-- frontier:end -->"


def _gain(r: dict) -> float | None:
    if r.get("final_accuracy") is None or r.get("start_accuracy") is None:
        return None
    return r["final_accuracy"] - r["start_accuracy"]


def _reward_gain(r: dict) -> float | None:
    if r.get("train_reward_last5") is None or r.get("train_reward_first5") is None:
        return None
    return r["train_reward_last5"] - r["train_reward_first5"]


REWARD_WINDOW = 5


def collapses(r: dict, learning: str) -> int:
    """Collapse events of a cell: non-finite loss or gradient steps, plus falls of the learning
    signal below COLLAPSE_DROP of its best so far — held-out accuracy at each evaluation, or the
    training reward's REWARD_WINDOW-step moving average (once that best is above 0.05: a signal at
    the noise floor cannot collapse). A failed cell is counted apart (``errors``)."""
    if r.get("error") is not None:
        return 0
    if learning == "heldout":
        return r.get("collapses", 0)
    rewards = [v for _, v in r.get("reward_curve") or [] if v is not None and math.isfinite(v)]
    windows = [sum(rewards[i - REWARD_WINDOW:i]) / REWARD_WINDOW for i in range(REWARD_WINDOW, len(rewards) + 1)]
    events, best, down = 0, 0.0, False
    for w in windows:
        fell = best > 0.05 and w < COLLAPSE_DROP * best
        events += fell and not down
        down, best = fell, max(best, w)
    return events + r.get("nonfinite_steps", 0)


ENTROPY_FLOOR, ENTROPY_CEILING = 0.1, 3.0


def entropy_collapsed(r: dict) -> bool:
    """The policy went (near) deterministic or blew up toward uniform: the REWARD_WINDOW-step moving
    average of the learner's mean token entropy fell below ENTROPY_FLOOR of its first window's, or
    rose above ENTROPY_CEILING times it. The training reward cannot show the first: groups whose
    rewards are all equal are filtered before ``reward/mean``."""
    values = [v for _, v in r.get("entropy_curve") or [] if v is not None and math.isfinite(v)]
    if len(values) < REWARD_WINDOW + 1:  # a cell stopped early by the filtered-groups guard has few steps
        return False
    windows = [sum(values[i - REWARD_WINDOW:i]) / REWARD_WINDOW for i in range(REWARD_WINDOW, len(values) + 1)]
    return windows[0] > 0 and (min(windows) < ENTROPY_FLOOR * windows[0] or max(windows) > ENTROPY_CEILING * windows[0])


def _by(rows: list[dict], *keys) -> dict:
    out: dict = {}
    for r in rows:
        out.setdefault(tuple(r[k] for k in keys), []).append(r)
    return out


def paired_noise(rows: list[dict], metric=_gain) -> dict:
    """What common random numbers buy: for every pair of objectives (a, b) at every rung, the
    variance of their difference a_s - b_s paired by seed (same draws until the policies differ)
    against that of an unpaired difference, var(a) + var(b) (what independent runs would give);
    each with n - 1 degrees of freedom, pooled over pairs and rungs weighted by them. Returns both
    sds and the degrees of freedom pooled."""
    paired = unpaired = 0.0
    dof = 0
    for (_, _), rs in _by(rows, "dimension", "rung").items():
        per = {o: {r["seed"]: metric(r) for r in g if metric(r) is not None} for (o,), g in _by(rs, "objective").items()}
        names = sorted(per)
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                seeds = sorted(set(per[a]) & set(per[b]))
                if len(seeds) < 2:
                    continue
                n = len(seeds)
                paired += (n - 1) * statistics.variance([per[a][s] - per[b][s] for s in seeds])
                unpaired += (n - 1) * (statistics.variance([per[a][s] for s in seeds]) + statistics.variance([per[b][s] for s in seeds]))
                dof += n - 1
    if not dof:
        return {"paired_sd": None, "unpaired_sd": None, "dof": 0}
    return {"paired_sd": math.sqrt(paired / dof), "unpaired_sd": math.sqrt(unpaired / dof), "dof": dof}


METRICS = {"heldout": _gain, "reward": _reward_gain}
"""What "learning" is measured by (the grid's ``learning``): the held-out accuracy gain (final minus
start) or the training reward gain (mean of the last 5 steps minus the first 5: on-policy reward on
the training prompts, where an unstable optimization shows first)."""


def cell_stats(rs: list[dict], base: list[dict] | None, metric=_gain, learning: str = "heldout") -> dict:
    """One (objective, rung): means over seeds, and the paired change of ``metric`` against the
    same objective's base cells (same seeds)."""
    gains = [g for g in map(metric, rs) if g is not None]
    heldout = [g for g in map(_gain, rs) if g is not None]
    rewards = [g for g in map(_reward_gain, rs) if g is not None]
    out = {
        "seeds": len(rs), "gain": mean(gains), "gain_se": se(gains), "heldout_gain": mean(heldout), "heldout_gain_se": se(heldout),
        "reward_gain": mean(rewards), "reward_gain_se": se(rewards), "final": mean(r.get("final_accuracy") for r in rs),
        "collapses": sum(collapses(r, learning) for r in rs), "errors": sum(r.get("error") is not None for r in rs),
        "entropy_collapses": sum(entropy_collapsed(r) for r in rs),
        "entropy_last": mean(next((v for _, v in reversed(r.get("entropy_curve") or []) if v is not None), None) for r in rs),
        "filtered_frac_last5": mean(r.get("filtered_frac_last5") for r in rs),
        "grad_norm_max": largest(r.get("grad_norm_max") for r in rs),
        **{k: mean(r.get(k) for r in rs) for k in ("gap_numerics_mean", "gap_numerics_p99", "gap_inflight_mean", "gap_staleness_mean",
                                                      "gap_staleness_p99", "clipped_frac", "masked_frac", "corrective_frac",
                                                      "behaviour_capped_frac", "regularizer_share")},
        **{k: largest(r.get(k) for r in rs) for k in ("gap_numerics_max", "gap_staleness_max", "gap_max", "gap_proximal_max")},
    }
    if base is not None:
        own = {r["seed"]: metric(r) for r in base if metric(r) is not None}
        d = [metric(r) - own[r["seed"]] for r in rs if metric(r) is not None and r["seed"] in own]
        out["vs_base"] = mean(d)
        out["vs_base_se"] = se(d)
    return out


def learns(s: dict) -> bool:
    """Still learning: no collapse (of the learning signal or of the entropy) or error, and a gain above twice its standard error."""
    return (not s["collapses"] and not s["errors"] and not s.get("entropy_collapses") and s["gain"] is not None
            and s["gain_se"] is not None and s["gain"] > 2 * s["gain_se"])


def degraded(s: dict) -> bool:
    """Worse than its own base: a collapse (of the learning signal or of the entropy) or error, or a
    paired drop beyond twice its standard error."""
    if s["collapses"] or s["errors"] or s.get("entropy_collapses"):
        return True
    return s.get("vs_base") is not None and s.get("vs_base_se") is not None and s["vs_base"] < -2 * s["vs_base_se"]


def frontier(rows: list[dict], learning: str = "heldout") -> dict:
    """For every objective and dimension: per-rung stats, the highest rung (of those run) where it
    still learns with no lower rung degraded, and the first degraded rung; ``learning``: a METRICS key."""
    metric = METRICS[learning]
    rows = [r for r in rows if not r.get("calibration")]
    base = {o: rs for (o, _), rs in _by([r for r in rows if r["rung"] == 0], "objective", "rung").items()}
    out: dict = {}
    for (objective, dimension), rs in _by([r for r in rows if r["rung"] > 0], "objective", "dimension").items():
        ladder = {0: cell_stats(base[objective], None, metric, learning)} if objective in base else {}
        for (rung,), g in sorted(_by(rs, "rung").items()):
            ladder[rung] = cell_stats(g, base.get(objective), metric, learning)
        survived, first_bad = None, None
        for rung in sorted(ladder):
            s = ladder[rung]
            if rung and degraded(s) and first_bad is None:
                first_bad = rung
            if first_bad is None and learns(s):
                survived = rung
        out[(objective, dimension)] = {"rungs": ladder, "highest_learning": survived, "first_degraded": first_bad}
    for objective, rs in base.items():  # the base alone (no rung of any dimension run yet)
        if not any(o == objective for o, _ in out):
            stats = cell_stats(rs, None, metric, learning)
            out[(objective, BASE)] = {"rungs": {0: stats}, "highest_learning": 0 if learns(stats) else None, "first_degraded": None}
    return out


STAT_HEAD = ["objective", "rung", "seeds", "held-out gain ± se", "train reward gain ± se", "paired vs base ± se", "collapses",
             "entropy collapses", "last entropy", "filtered groups (last 5 steps)",
             "max grad norm", "\\|π−μ\\| lag 0 mean / p99 / max", "inflight", "lag ≥ 1 mean / p99 / max", "max drift in step",
             "clipped", "masked", "corrective", "TIS capped", "regularizer share"]


def _pm(v, se) -> str:
    return "–" if v is None else f"{v:+.3f}" + ("" if se is None else f" ± {se:.3f}")


def _triple(s, part) -> str:
    return " / ".join(fmt(s.get(f"gap_{part}_{k}"), 2) for k in ("mean", "p99", "max"))


def _order(result: dict, grid: dict) -> tuple[list[str], list[str]]:
    """Objectives and dimensions present in ``result``, in the grid's order."""
    objectives = [o["name"] for o in grid["objectives"] if any(oo == o["name"] for oo, _ in result)]
    dims = [d for d in grid["ladder"] if any(dd == d for _, dd in result)]
    return objectives, dims


def rung_table(result: dict, labels: dict, grid: dict) -> str:
    """One line per objective and rung: the base once per objective, then each dimension's rungs."""
    objectives, dims = _order(result, grid)
    lines = []
    for objective in objectives:
        entries = [(BASE, 0, f["rungs"][0]) for (o, d), f in result.items() if o == objective and 0 in f["rungs"]][:1]
        entries += [(d, rung, st) for d in dims for rung, st in sorted(result.get((objective, d), {"rungs": {}})["rungs"].items()) if rung]
        for dimension, rung, st in entries:
            lines.append([objective, labels.get((dimension, rung), "base"), st["seeds"], _pm(st["heldout_gain"], st["heldout_gain_se"]),
                          _pm(st["reward_gain"], st["reward_gain_se"]), _pm(st.get("vs_base"), st.get("vs_base_se")) if rung else "–",
                          str(st["collapses"] + st["errors"]), str(st["entropy_collapses"]), st["entropy_last"], st["filtered_frac_last5"],
                          st["grad_norm_max"], _triple(st, "numerics"), st["gap_inflight_mean"], _triple(st, "staleness"), st["gap_proximal_max"],
                          st["clipped_frac"], st["masked_frac"], st["corrective_frac"], st["behaviour_capped_frac"], st["regularizer_share"]])
    return markdown(STAT_HEAD, lines)


COLUMNS = (
    "Columns: gains are means over seeds ± their standard error; *paired vs base* is the mean over seeds of (this rung's gain − the "
    "same objective's base gain, same seed); *collapses* counts collapse events and failed cells; *entropy collapses* counts seeds whose "
    "policy went near deterministic or blew up toward uniform, *last entropy* is the learner's mean token entropy at the last step, *filtered groups* the share "
    "of groups dropped for all-equal rewards (no learning signal: all right or all wrong) over the last 5 steps; |π−μ| is per sampled token, at lag 0 "
    "(engine numerics), *inflight* (lag 0 but the request began before a weight update) and lag ≥ 1 (staleness); *max drift in step* is "
    "the largest |π − π at the step's start| over a step's later updates (measured with several updates per batch or the decoupled "
    "anchor); *clipped* (grpo: ratio clipped), *masked* (DPPO), *corrective* (DRPO: weight w < 0) and *TIS capped* (behaviour weight at "
    "its cap) are token fractions; *regularizer share* is DRPO's quadratic term's share of the objective's magnitude. – : not "
    "measured for this objective or rung."
)
VERDICTS = (
    "Verdicts: an objective *learns* at a rung when no seed collapsed or failed and its gain is above twice its standard error; "
    "a rung is *degraded* when a seed collapsed or failed, or the gain paired against the objective's own base dropped by more than "
    "twice its standard error. A *collapse* is a non-finite loss or gradient step, or the learning signal falling below half its best "
    "so far (held-out accuracy at an evaluation, or the 5-step moving average of the training reward once that best is above 0.05); "
    "an *entropy collapse* is the 5-step moving average of the learner's mean token entropy falling below a tenth of its first "
    "5 steps' or rising above three times it (the training reward cannot show it: groups whose rewards are all equal are filtered before it is measured). "
    "*Learns to R* is the highest rung run with no degraded rung below it."
)


def summary_table(result: dict, labels: dict, grid: dict) -> str:
    """Objective x dimension: the highest rung still learning and the first degraded one (the
    base's verdict in its own column)."""
    objectives, dims = _order(result, grid)

    def base_word(o):
        f = next((f for (oo, _), f in result.items() if oo == o and 0 in f["rungs"]), None)
        return "not run" if f is None else ("learns" if learns(f["rungs"][0]) else "does not learn")

    def word(o, d):
        f = result.get((o, d))
        if f is None:
            return "not run"
        ran = max(f["rungs"])
        hi = "none" if f["highest_learning"] is None else labels.get((d, f["highest_learning"]), "base")
        bad = "none up to " + labels.get((d, ran), "base") if f["first_degraded"] is None else labels[(d, f["first_degraded"])]
        return f"learns to {hi}; first degraded: {bad}"

    return markdown(["objective", "base", *dims], [[o, base_word(o), *[word(o, d) for d in dims]] for o in objectives])


def calibration_table(rows: list[dict]) -> str:
    """SmolLM2's measured gap next to the stand-in's at the same rung and objective (seed-mean)."""
    small = [r for r in rows if r.get("calibration")]
    lines = []
    for r in small:
        peers = [p for p in rows if not p.get("calibration") and p["objective"] == r["objective"]
                 and p["dimension"] == r["dimension"] and p["rung"] == r["rung"]]
        for who, rs in (("SmolLM2-135M", [r]), ("stand-in", peers)):
            if rs:
                lines.append([r["label"], who, len(rs), mean(x.get("gap_numerics_mean") for x in rs), mean(x.get("gap_numerics_p99") for x in rs),
                              largest(x.get("gap_numerics_max") for x in rs), largest(x.get("gap_proximal_max") for x in rs)])
    return markdown(["rung", "model", "cells", "\\|π−μ\\| lag 0 mean", "lag 0 p99", "lag 0 max", "max drift in a step"], lines)


def short_cells_table(rows: list[dict]) -> str:
    """A SmolLM2 grid's short calibration cells, one line each: what the rung does to the responses
    and to the measured gap, and which share of tokens each objective acted on (no learning verdict:
    they run a few steps, and their end-of-run evaluation is the smallest one a run allows)."""
    def per_response(r):  # KL(mu || pi) of a whole response: the per-token estimate times the mean length
        k3, n = r.get("kl_k3_numerics"), r.get("response_tokens_mean")
        return None if k3 is None or n is None else k3 * n

    lines = [[r["objective"], r["label"], len(r.get("reward_curve") or []), r.get("response_tokens_mean"), r.get("truncated_frac"),
              mean(v for _, v in r.get("entropy_curve") or []),
              " / ".join(fmt(r.get(f"gap_numerics_{k}"), 2) for k in ("mean", "p99", "max")), r.get("kl_k3_numerics"), per_response(r),
              r.get("clipped_frac"), r.get("masked_frac"), r.get("corrective_frac"), r.get("regularizer_share"), r.get("grad_norm_max"),
              r.get("wall_seconds")]
             for r in rows if r.get("calibration")]
    return markdown(["objective", "rung", "steps", "response tokens (mean)", "truncated", "learner entropy", "\\|π−μ\\| lag 0 mean / p99 / max",
                      "KL(μ‖π) per token (k3)", "per response (k3 × tokens)", "clipped", "masked", "corrective", "regularizer share",
                      "max grad norm", "wall s"], lines)


def plot(rows: list[dict], grid: dict, folder: Path) -> list[Path]:
    """frontier.png: per dimension, held-out gain (mean ± se over seeds) of every objective by rung;
    frontier_gap.png: the measured gap by rung (mean |π−μ| at lag 0 and lag ≥ 1, max drift within a step)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    result, labels = frontier(rows, grid.get("learning", "heldout")), labels_of(grid)
    dims = [d for d in grid["ladder"] if any(dd == d for _, dd in result)] or [BASE]
    objectives = [o["name"] for o in grid["objectives"]]
    paths = []
    gain_name = "held-out gain (final − start)" if grid.get("learning", "heldout") == "heldout" else "train reward gain (last 5 − first 5 steps)"
    for name, panels in (("frontier.png", [("gain", gain_name)]),
                         ("frontier_gap.png", [("gap_numerics_mean", "mean |π−μ|, lag 0"), ("gap_staleness_mean", "mean |π−μ|, lag ≥ 1"),
                                               ("gap_proximal_max", "max |π−π_step start|")])):
        # a panel per (dimension, measure) that at least two objectives measured (a measure some rungs
        # do not record, e.g. lag >= 1 without staleness, gets no empty panel), 4 to a row, one legend
        cells = [(d, key, title) for key, title in panels for d in dims
                 if sum(any(v.get(key) is not None for v in (result.get((o, d)) or {"rungs": {}})["rungs"].values()) for o in objectives) >= 2]
        ncols = max(1, min(4, len(cells)))
        fig, axes = plt.subplots(-(-len(cells) // ncols) or 1, ncols, figsize=(4.2 * ncols, 3.2 * (-(-len(cells) // ncols) or 1) + 0.5), squeeze=False)
        for ax, (d, key, title) in zip(axes.flat, cells):
            for i, o in enumerate(objectives):
                f = result.get((o, d))
                if not f:
                    continue
                xs = sorted(f["rungs"])
                ys = [f["rungs"][x].get(key) for x in xs]
                es = [f["rungs"][x].get("gain_se") or 0.0 for x in xs] if key == "gain" else None
                pts = [(x, y, e) for x, y, e in zip(xs, ys, es or [0.0] * len(xs)) if y is not None]
                if pts:
                    ax.errorbar([p[0] + (i - len(objectives) / 2) * 0.04 for p in pts], [p[1] for p in pts],
                                yerr=[p[2] for p in pts] if es else None, marker="o", markersize=3, capsize=2, label=o, color=f"C{i}")
            ticks = sorted({r for (dd, r) in labels if dd == d} | {0})
            ax.set_xticks(ticks, [labels.get((d, r), "base") for r in ticks], rotation=20, fontsize=7)
            ax.set_title(f"{d}: {title}", fontsize=9)
            if key == "gain":
                ax.axhline(0.0, color="grey", linewidth=0.5)
        for ax in axes.flat[len(cells):]:
            ax.axis("off")
        _shared_legend(fig, axes)
        fig.savefig(Path(folder) / name, dpi=90)
        plt.close(fig)
        paths.append(Path(folder) / name)
    paths.append(plot_curves(rows, grid, folder))
    return paths


def _seed_mean_curve(rs: list[dict], key: str, window: int = 1) -> tuple[list[int], list[float]]:
    """The mean over seeds of a per-step curve (``key``: [[step, value], ...]), each seed's curve
    smoothed by a trailing moving average of ``window`` points first; steps where no seed has a value are dropped."""
    by_step: dict[int, list[float]] = {}
    for r in rs:
        points = [(x, v) for x, v in r.get(key) or [] if v is not None and math.isfinite(v)]
        for i, (x, _) in enumerate(points):
            part = [v for _, v in points[max(0, i - window + 1):i + 1]]
            by_step.setdefault(x, []).append(sum(part) / len(part))
    steps = sorted(by_step)
    return steps, [sum(by_step[x]) / len(by_step[x]) for x in steps]


def _shared_legend(fig, axes) -> None:
    """One legend for the whole figure, above its panels (each objective keeps its colour in every panel)."""
    legend = {label: handle for ax in axes.flat for handle, label in zip(*ax.get_legend_handles_labels())}
    fig.legend(list(legend.values()), list(legend.keys()), loc="upper center", ncol=max(1, len(legend)), fontsize=9, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.45 / fig.get_figheight()))


def plot_curves(rows: list[dict], grid: dict, folder: Path) -> Path:
    """frontier_curves.png: for the base and each dimension's highest rung run, every objective's
    training reward (5-step moving average), learner entropy and held-out accuracy by step, means over
    seeds (a panel names an objective averaged over fewer seeds than the others)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if not r.get("calibration")]
    labels = labels_of(grid)
    settings = [(BASE, 0)] if any(r["rung"] == 0 for r in rows) else []
    settings += [(d, max(r["rung"] for r in rows if r["dimension"] == d)) for d in grid["ladder"] if any(r["dimension"] == d for r in rows)]
    settings = settings or [(BASE, 0)]
    panels = (("reward_curve", "train reward (5-step mean)", REWARD_WINDOW), ("entropy_curve", "learner entropy", 1), ("curve", "held-out accuracy", 1))
    seeds = max((sum(1 for r in rows if (r["objective"], r["dimension"], r["rung"]) == key) for key in {(r["objective"], r["dimension"], r["rung"]) for r in rows}), default=0)
    fig, axes = plt.subplots(len(panels), len(settings), figsize=(4.2 * len(settings), 2.8 * len(panels) + 0.5), squeeze=False)
    for col, (d, rung) in enumerate(settings):
        for row_i, (key, title, window) in enumerate(panels):
            ax = axes[row_i][col]
            fewer = []
            for i, o in enumerate(o["name"] for o in grid["objectives"]):
                rs = [r for r in rows if r["objective"] == o and r["dimension"] == d and r["rung"] == rung]
                xs, ys = _seed_mean_curve(rs, key, window)
                if xs:
                    ax.plot(xs, ys, marker="o" if key == "curve" else None, markersize=3, label=o, color=f"C{i}")
                    if len(rs) < seeds:
                        fewer.append(f"{o}: {len(rs)} seeds")
            ax.set_title(f"{labels.get((d, rung), 'base')}: {title}", fontsize=9)
            ax.set_xlabel("step", fontsize=7)
            if fewer:  # means over fewer seeds than the others
                ax.text(0.02, 0.02, ", ".join(fewer), transform=ax.transAxes, fontsize=7, va="bottom")
            if not ax.get_legend_handles_labels()[0]:
                ax.text(0.5, 0.5, "not measured", ha="center", va="center", transform=ax.transAxes, fontsize=7)
    _shared_legend(fig, axes)
    path = Path(folder) / "frontier_curves.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def report(rows: list[dict], grid: dict) -> str:
    seconds = sum(r.get("wall_seconds") or 0.0 for r in rows)
    total = len(cells(grid)) + len(calibration_cells(grid))
    calib = ""
    if any(r.get("calibration") for r in rows):
        calib = (f"### Short SmolLM2 cells at the rungs (a few steps, no learning verdict: the gap, not learning)\n\n{short_cells_table(rows)}\n"
                 if grid.get("model") == "smollm2"  # the grid's own model: no stand-in to put them next to
                 else f"### Gap calibration: SmolLM2 next to the stand-in\n\n{calibration_table(rows)}\n")
    if not any(not r.get("calibration") for r in rows):
        return f"{len(rows)} of the grid's {total} cells finished (no frontier cell), {seconds / 3600:.2f} h of training wall time.\n\n{calib}"
    learning = grid.get("learning", "heldout")
    result, labels = frontier(rows, learning), labels_of(grid)
    crn = []
    early = lambda r: r.get("train_reward_first5")  # noqa: E731  (before the policies have drifted far apart)
    for name, metric in (("held-out accuracy gain", _gain), ("train reward gain", _reward_gain), ("train reward of the first 5 steps", early)):
        noise = paired_noise([r for r in rows if not r.get("calibration")], metric)
        ratio = (noise["unpaired_sd"] / noise["paired_sd"]) if noise["paired_sd"] and noise["unpaired_sd"] else None
        crn.append(f"- {name}: sd of two objectives' difference {fmt(noise['paired_sd'])} paired by seed, against {fmt(noise['unpaired_sd'])} "
                   f"for unpaired runs (sqrt(var a + var b)); {noise['dof']} degrees of freedom pooled over objective pairs and rungs"
                   + (f"; unpaired/paired sd ratio {ratio:.2f}." if ratio else "."))
    crn = "Common random numbers (cells of one seed draw the same completions until their policies differ):\n" + "\n".join(crn)
    crn += f"\n\nVerdicts below measure learning by the {'held-out accuracy' if learning == 'heldout' else 'train reward'} gain (grid `learning: {learning}`)."
    return (f"{len(rows)} of the grid's {total} cells finished, {seconds / 3600:.2f} h of training wall time.\n\n{crn}\n\n"
            f"### Highest rung still learning, first degraded rung\n\n{VERDICTS}\n\n"
            f"{summary_table(result, labels, grid)}\n### Every rung (means over seeds)\n\n{COLUMNS}\n\n{rung_table(result, labels, grid)}\n"
            + calib)


def docs_markers(grid: dict) -> tuple[str, str]:
    """The page block a grid's report goes into: the default one, or the one its ``docs_block``
    names (so that grid's report never replaces the default grid's)."""
    name = grid.get("docs_block")
    if not name:
        return RESULTS_BEGIN, RESULTS_END
    return f"<!-- {name}:begin (written by benchmarks/experiments/frontier.py --docs) -->", f"<!-- {name}:end -->"


def write_docs(path: Path, rows: list[dict], grid: dict, out: Path, grid_path: str) -> None:
    """A grid's generated block of the report page (prose outside the markers is kept); a grid with
    its own ``docs_block`` prefixes its plots with that name."""
    import os

    path = Path(path)
    begin, end = docs_markers(grid)
    block = (f"\n\nCommand: `.venv/bin/python -m benchmarks.experiments.frontier --grid {os.path.relpath(grid_path)} --report "
             f"--docs {path}`.\n\n{report(rows, grid)}\n")
    if any(not r.get("calibration") for r in rows):  # plots of frontier cells (short calibration cells have none)
        prefix = f"{grid['docs_block']}_" if grid.get("docs_block") else ""
        assets = copy_assets(path, out, ("frontier.png", "frontier_gap.png", "frontier_curves.png"), prefix)
        block += (f"![learning gain by rung]({assets.name}/{prefix}frontier.png)\n\n"
                  f"![measured gap by rung]({assets.name}/{prefix}frontier_gap.png)\n\n"
                  f"![training reward, entropy and held-out accuracy by step: the base and each dimension's highest rung run]({assets.name}/{prefix}frontier_curves.png)\n\n")
    replace_block(path, begin, end, block)
