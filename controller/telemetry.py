"""What a run reports: metrics.jsonl, a Prometheus endpoint, a live progress bar, a summary table.

Every step appends one JSON line of namespaced floats (``learner/``, ``objective/``, ``gap/``,
``staleness/``, ``rollout/``, ``reward/``, ``ledger/``); evaluations and checkpoints append their own
lines with a ``kind`` field. The same values are served in Prometheus format
(families and names: controller/prometheus.py) on ``metrics.host:port`` (127.0.0.1 by default), and
copied to TensorBoard / W&B / MLflow when ``metrics.loggers`` asks (controller/loggers.py).
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from controller.backend import PublishReport, TrainResult
from controller.config import MetricsConfig
from controller.eval_metrics import describe_set
from controller.loggers import MetricLogger, numeric
from controller.prometheus import PrometheusExporter
from controller.staleness import LAG_BINS, StalenessStats
from rollout.records import Group
from rollout.rewards import FAILURES


REASONS = (
    "correct", "wrong", "no_answer", "too_long", "not_literal", "computation", "too_large", "verify_timeout", "verify_error", "scored",
    *FAILURES,
)
"""Reward verdicts (rollout.rewards.RewardResult.reason); each step reports every one's share of
its trained samples (a gauge that is not rewritten would keep its last value), and the failures'
counts over every group that arrived (reward/errors/<reason>)."""


def turn_versions(c) -> list[list[int]]:
    """An episode's model turns, each as the [oldest, newest] policy version of its tokens."""
    mask = c.loss_mask.tolist()
    turns, current = [], []
    for model, v in zip(mask, c.versions.tolist()):
        if model:
            current.append(v)
        elif current:
            turns.append([min(current), max(current)])
            current = []
    return turns + ([[min(current), max(current)]] if current else [])


def shown(value: float, digits: int) -> str:
    """A figure for the console: ``n/a`` where nothing was there to measure (NaN: no token with a
    nonzero advantage for a fraction over those tokens, no lag >= 1 token in a sync run)."""
    return "n/a" if math.isnan(value) else f"{value:.{digits}f}"


@dataclass(frozen=True)
class StepReport:
    """What the Controller tells telemetry about a finished step: a snapshot, not the Controller."""

    step: int
    version: int
    result: TrainResult
    rewards: list[float]
    """Every sample's reward in the step's groups (what was trained on: correctness plus shaping)."""
    scores: list[float]
    """Every sample's correctness (1.0 or 0.0)."""
    reasons: list[str]
    """Every sample's verdict (rollout.rewards.RewardResult.reason: correct, wrong, no_answer, ...)."""
    response_tokens: list[int]
    """Every sample's response length."""
    truncated: list[bool]
    """Every sample: cut at max_new_tokens."""
    lags: tuple[int, ...]
    """Per trained group: its version lag (the batch builder's)."""
    batch_metrics: dict[str, float]
    """What the batch builder measured (staleness/token_lag_hist)."""
    published: PublishReport
    staleness: StalenessStats
    max_staleness: int
    queue_depth: int
    buffered: int
    ledger: dict[str, int]


class Telemetry:
    def __init__(
        self, run_dir: str | Path, cfg: MetricsConfig, total_steps: int, clock, loggers: list[MetricLogger] = (), reward: str = "reward",
    ):
        """``loggers``: TensorBoard / W&B / MLflow copies (controller/loggers.py); metrics.jsonl is always written.
        ``reward``: the reward's name in messages (rollout.reward's ``label``)."""
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._file = (self.run_dir / "metrics.jsonl").open("a")
        self._rollouts = (self.run_dir / "rollouts.jsonl").open("a") if cfg.rollouts else None
        self.cfg, self.total_steps, self.clock = cfg, total_steps, clock
        self.exporter = PrometheusExporter(cfg.host, cfg.port) if cfg.port is not None else None
        self.steps: list[dict] = []
        self.evals: list[dict] = []
        self._tty = sys.stderr.isatty()
        self._since = self._began = clock()  # _since: the last step's end (rates); _began: the engines were up
        self._group_tokens = self._groups = 0
        self.worker_events: dict[str, int] = {}
        self.loggers = list(loggers)
        self._startup: dict[str, float] = {}
        self._startup_written = False
        self.reward = reward
        self._reward_errors = dict.fromkeys(FAILURES, 0)
        self._components: dict[str, list[float]] = {}
        self._scoring_seconds = 0.0
        self._reward_error_shown = False

    def _write(self, record: dict) -> None:
        self._file.write(json.dumps(record, allow_nan=True) + "\n")
        self._file.flush()

    def rollouts(self, step: int, groups: list[Group]) -> None:
        """With ``metrics.rollouts``: one rollouts.jsonl line per trained sample of ``step``."""
        if self._rollouts is None:
            return
        for g in groups:
            for j, s in enumerate(g.samples):
                c = s.completion
                self._rollouts.write(json.dumps({
                    "step": step, "prompt_id": g.ticket.id, "epoch": g.ticket.epoch, "sample": j,
                    "prompt_ids": c.prompt_ids.tolist(), "response": s.text, "response_ids": c.response_ids.tolist(), "reward": s.reward.value, "score": s.reward.score,
                    "reason": s.reward.reason, **({"reason_detail": s.reward.detail} if s.reward.detail else {}), "finish": c.finish_reason, "prompt_version": c.prompt_version,
                    "versions": [int(c.versions.min()), int(c.versions.max())] if len(c.versions) else None,
                    **({"episode": {"turns": c.episode.turns, "tool_calls": c.episode.tool_calls, "tool_errors": c.episode.tool_errors,
                                    "truncated": c.episode.truncated, "model_tokens": c.model_tokens, "messages": list(c.episode.messages),
                                    "turn_versions": turn_versions(c)}} if c.episode is not None else {}),
                }, allow_nan=True) + "\n")
        self._rollouts.flush()

    def group(self, g: Group) -> None:
        """A training group arrived (trained later, filtered or failed): tokens, the reward's time,
        components and failures; the first failed sample of the run is printed and written once."""
        self._group_tokens += g.tokens
        self._groups += 1
        self._scoring_seconds += g.scoring_seconds
        for s in g.samples:
            for name, value in s.reward.components.items():
                self._components.setdefault(name, []).append(value)
        for r in g.reward_errors:
            self._reward_errors[r.reason] = self._reward_errors.get(r.reason, 0) + 1
        if g.reward_errors and not self._reward_error_shown:
            self._reward_error_shown = True
            first = g.reward_errors[0]
            who = "an environment" if (first.detail or "").startswith("environment ") else f"reward {self.reward}"  # rollout/episodes.py's failures
            print(f"drpo train: {who}: first sample it could not score ({first.reason}): {first.detail}", file=sys.stderr, flush=True)
            self._write({"kind": "reward_error", "time": self.clock(), "reward": self.reward, "reason": first.reason, "error": first.detail})

    def step(self, r: StepReport) -> None:
        now = self.clock()
        elapsed = max(now - self._since, 1e-9)
        rewards, lags, stats, result = r.rewards, r.lags, r.staleness, r.result
        record = {
            "kind": "step", "step": r.step, "version": r.version, "time": now, "step_seconds": elapsed,
            "reward/mean": sum(rewards) / max(1, len(rewards)),
            "reward/accuracy": sum(x >= 1.0 for x in r.scores) / max(1, len(r.scores)),
            **{f"reward/reason/{why}": r.reasons.count(why) / max(1, len(r.reasons)) for why in REASONS},
            **{f"reward/errors/{why}": n for why, n in self._reward_errors.items()},
            **{f"reward/component/{name}": sum(v) / len(v) for name, v in self._components.items() if v},
            "reward/scoring_seconds": self._scoring_seconds,
            **({"rollout/response_tokens_mean": sum(r.response_tokens) / len(r.response_tokens), "rollout/response_tokens_max":
                max(r.response_tokens), "rollout/truncated_frac": sum(r.truncated) / len(r.truncated)} if r.response_tokens else {}),
            "learner/tokens": result.tokens, "learner/seconds": result.seconds,
            "learner/tokens_per_second": result.tokens / max(result.seconds, 1e-9),
            "rollout/tokens_per_second": self._group_tokens / elapsed, "rollout/groups": self._groups,
            "rollout/publish_seconds": r.published.seconds, "rollout/publish_bytes": r.published.nbytes,
            **({"rollout/receive_seconds_max": max(r.published.receive_seconds), "rollout/receive_seconds_mean":
                sum(r.published.receive_seconds) / len(r.published.receive_seconds),
                "rollout/receive_workers": len(r.published.receive_seconds)} if r.published.receive_seconds else {}),
            **({"rollout/publish_retries": r.published.retries} if r.published.transport == "broadcast" else {}),
            "staleness/lag_mean": sum(lags) / max(1, len(lags)), "staleness/lag_max": max(lags, default=0),
            "staleness/accepted": stats.accepted, "staleness/running": stats.running, "staleness/rejected": stats.rejected,
            "staleness/capacity": stats.capacity, "staleness/admitted": stats.admitted,
            "rollout/queue_depth": r.queue_depth, "staleness/buffered": r.buffered, "staleness/max": r.max_staleness,
            **{f"staleness/lag_hist/bin_{i}": sum(min(lag, LAG_BINS - 1) == i for lag in lags) for i in range(LAG_BINS)},
            **{f"ledger/{k}": v for k, v in r.ledger.items()},
            "rollout/worker_losses": self.worker_events.get("lost", 0),
            **r.batch_metrics,
            **result.metrics,
        }
        self._since, self._group_tokens, self._groups = now, 0, 0
        self._reward_errors, self._scoring_seconds = dict.fromkeys(self._reward_errors, 0), 0.0
        self._components = {name: [] for name in self._components}
        self.steps.append(record)
        self._publish(record)
        for logger in self.loggers:
            logger.log(numeric(record), r.step)
        self._progress(record)

    def evaluation(self, record: dict) -> None:
        record = {"kind": "eval", "time": self.clock(), **record}
        self.evals.append(record)
        values = {"eval/accuracy": record["accuracy"], "eval/samples": record["samples"], "eval/version": record["version"],
                  "eval/seconds": record["seconds"]}
        for name, summary in record.get("sets", {}).items():
            values.update({f"eval/{name}/{key}": v for key, v in summary.items() if isinstance(v, (int, float))})
        self._publish(values, record)
        for logger in self.loggers:
            logger.log(values, record["step"])

    def evaluation_cancelled(self, record: dict) -> None:
        """An evaluation round a stop cut short: one ``eval_cancelled`` line (how many prompts were
        answered and how many taken back); no accuracy is reported from it."""
        self._write({"kind": "eval_cancelled", "time": self.clock(), **record})

    def startup_phase(self, **seconds: float) -> None:
        """Seconds spent in start-up phases (Ray, engines and learner, the first evaluation);
        written as one ``startup`` record when ``startup_done`` is called."""
        self._startup.update(seconds)

    def startup_done(self) -> None:
        """Everything before the first training step is over: record where its time went."""
        if self._startup and not self._startup_written:
            self._startup_written = True
            self._write({"kind": "startup", "time": self.clock(), **self._startup, "total_seconds": sum(self._startup.values())})
        self._since = self.clock()  # the first step's seconds start here: the first evaluation is start-up's

    def placement(self, nodes: dict[str, list[str]]) -> None:
        """Which Ray node each learner rank and rollout worker runs on."""
        self._write({"kind": "placement", "time": self.clock(), **nodes})

    def dataset_rows_skipped(self, path: str, rows: list[tuple[int, str]], field: str | None = None) -> None:
        """Bad rows of one dataset load; ``field``: the config field that named the file (task.train_path, eval.sets[i] (name))."""
        self._write({"kind": "dataset", "time": self.clock(), "path": path, "field": field,
                     "skipped": [{"row": r, "reason": why} for r, why in rows]})

    def worker_event(self, event: str, worker: int, version: int | None, reason: str | None = None) -> None:
        """A rollout worker died ("lost", with the ``reason`` where known, also printed) or came back
        serving ``version`` ("back")."""
        record = {"kind": "worker", "time": self.clock(), "event": event, "worker": worker, "version": version}
        if reason:
            record["reason"] = reason
            print(f"drpo train: rollout worker {worker} lost: {reason}; restarting it", file=sys.stderr, flush=True)
        self._write(record)
        self.worker_events[event] = self.worker_events.get(event, 0) + 1

    def _reward_rows(self) -> list[tuple[str, str]]:
        """A reward's components (first and last step) and the samples it could not score, when it has either."""
        rows = []
        first, last = self.steps[0], self.steps[-1]
        names = sorted(k.removeprefix("reward/component/") for k in last if k.startswith("reward/component/"))
        if names:
            parts = [f"{n} {first.get('reward/component/' + n, float('nan')):.3f} -> {last['reward/component/' + n]:.3f}" for n in names]
            rows.append(("reward components, first -> last step", ", ".join(parts)))
        failed = {why: sum(s.get(f"reward/errors/{why}", 0) for s in self.steps) for why in FAILURES}
        if any(failed.values()):
            rows.append((f"samples reward {self.reward} could not score", ", ".join(f"{why} {n}" for why, n in failed.items() if n)))
        return rows

    def worker_error(self, worker: int, error: str) -> None:
        """A rollout worker's first failed group: its error, printed and written once per worker
        (the ledger has every failure; this is where to look first)."""
        print(f"drpo train: rollout worker {worker}: first failed group: {error}", file=sys.stderr, flush=True)
        self._write({"kind": "worker_error", "time": self.clock(), "worker": worker, "error": error})

    def checkpoint(self, path: Path) -> None:
        self._write({"kind": "checkpoint", "time": self.clock(), "path": str(path)})

    def stall(self, record: dict) -> None:
        """No progress for a while (controller/watchdog.py): the account, written, exported and printed."""
        from controller.watchdog import describe

        self._write({"kind": "stall", "time": self.clock(), **record})
        if self.exporter is not None:
            self.exporter.set({"stalled_seconds": record["stalled_seconds"]})
        print(f"\ndrpo train: no progress for {record['stalled_seconds']:.0f} s: {describe(record)}", file=sys.stderr, flush=True)

    def stopped(self, signal: str | None, step: int, checkpointed: int, abandoned: bool) -> None:
        """The run stopped early on ``signal`` at ``step``; it resumes from the checkpoint of ``checkpointed``."""
        self._write({"kind": "stop", "time": self.clock(), "signal": signal, "step": step, "resume_step": checkpointed, "abandoned": abandoned})

    def _publish(self, values: dict, record: dict | None = None) -> None:
        self._write(record if record is not None else values)
        values = {**values, "last_step_timestamp_seconds": time.time(), "stalled_seconds": 0.0} if record is None else values
        if self.exporter is not None:
            self.exporter.set(values)

    # ---- the console --------------------------------------------------------------------------------

    def _progress(self, r: dict) -> None:
        if not self.cfg.progress:
            return
        width = 20
        done = int(width * r["step"] / self.total_steps)
        ev = self.evals[-1] if self.evals else None
        last = int(r.get("learner/updates", 1)) - 1  # several updates per batch: how far the last one's pi had moved
        drift = f"(update {last}: {r[f'gap/update_{last}/abs_shift_mean']:.4f}) " if last and f"gap/update_{last}/abs_shift_mean" in r else ""
        line = (
            f"step {r['step']}/{self.total_steps} [{'#' * done}{'.' * (width - done)}] "
            f"reward {r['reward/mean']:.3f} acc {r['reward/accuracy']:.3f} "
            f"|pi-mu| {shown(r.get('gap/abs_shift_mean', math.nan), 4)} {drift}{self._objective_headline(r)} "
            f"staleness {r['staleness/lag_mean']:.2f}"
        )
        line += (f" eval {ev['accuracy']:.3f}" if ev else "") + f" {r['step_seconds']:.1f}s/step"
        print(("\r" + line) if self._tty else line, end="" if self._tty else "\n", file=sys.stderr, flush=True)

    @staticmethod
    def _objective_headline(r: dict) -> str:
        """The objective's own telling number: DRPO's corrective fraction, DPPO's masked fraction,
        a ratio method's clipped fraction."""
        headlines = (
            ("objective/corrective_frac", "corrective"), ("objective/masked_frac", "masked"), ("objective/clip_frac", "clipped"),
            ("objective/clip_frac_high", "clipped-high"), ("objective/beyond_eps_frac", "beyond-eps"),
        )
        for key, name in headlines:
            if key in r:
                return f"{name} {shown(r[key], 4)}"
        return ""

    def _update_rows(self, mean) -> list[tuple[str, str]]:
        """Several updates per rollout batch: pi moves away from mu within the batch. |pi - mu| per
        update index and, for DRPO, what its trust region did (weights counted beyond
        objectives.drpo.WEIGHT_TOLERANCE)."""
        updates = max((s.get("learner/updates", 1) for s in self.steps), default=1)
        if updates <= 1:
            return []
        rows = [("updates per rollout batch", f"{updates:.0f}"),
                ("|pi-mu| mean by update", ", ".join(f"{i}: {mean(f'gap/update_{i}/abs_shift_mean'):.5f}" for i in range(int(updates))))]
        if any("objective/weight_abs_dev_mean" in s for s in self.steps):
            rows += [
                ("DRPO weights above 1 / below 0", f"{shown(mean('objective/weight_above_one_frac'), 4)} / {shown(mean('objective/corrective_frac'), 4)} "
                                                  "of tokens (beyond 0.001)"),
                ("DRPO mean |w-1|, regularizer share", f"{mean('objective/weight_abs_dev_mean'):.5f}, {mean('objective/regularizer_share'):.5f} of the loss"),
            ]
        return rows

    def summary(self, eval_history: list[dict], ledger: dict[str, int], model_dir: Path | None = None) -> str:
        """A plain-text table of the run: eval accuracy first and last (and per eval set), throughput, gap, ledger."""
        rows = []
        if eval_history:
            first, last = eval_history[0], eval_history[-1]
            if len(eval_history) > 1:
                label = "eval accuracy, start" if first["version"] == 0 else "eval accuracy, first evaluation"
                rows.append((label, f"{first['accuracy']:.3f} (version {first['version']}, n={first['samples']})"))
            rows.append(("eval accuracy, end", f"{last['accuracy']:.3f} (version {last['version']}, n={last['samples']})"))
            before = first.get("sets", {}) if len(eval_history) > 1 else {}  # one evaluation: no "start -> end" to show
            rows += [(f"eval set {name}", describe_set(before.get(name, {}), s)) for name, s in last.get("sets", {}).items()]
        if self.steps:
            def mean(key: str) -> float:  # over the steps that have it (a lag bucket can be empty)
                got = [s[key] for s in self.steps if key in s and not math.isnan(s[key])]
                return sum(got) / len(got) if got else math.nan

            if self._startup:
                rows.append(("start-up seconds", ", ".join(f"{k.removesuffix('_seconds')} {v:.1f}" for k, v in self._startup.items())))
            rows += [
                ("steps this session", f"{len(self.steps)} (to step {self.steps[-1]['step']})"),
                ("seconds per step", f"{mean('step_seconds'):.1f}"),
                ("learner response tokens/s", f"{mean('learner/tokens_per_second'):.1f}"),
                ("rollout response tokens/s", f"{mean('rollout/tokens_per_second'):.1f}"),
                ("train reward, first -> last step", f"{self.steps[0]['reward/mean']:.3f} -> {self.steps[-1]['reward/mean']:.3f}"),
                ("|pi-mu| mean, lag 0 (numerics)", shown(mean('gap/numerics/abs_shift_mean'), 5)),
                ("|pi-mu| mean, lag 0 after an update mid-request", shown(mean('gap/inflight/abs_shift_mean'), 5)),
                ("|pi-mu| mean, lag >= 1 (staleness)", shown(mean('gap/staleness/abs_shift_mean'), 5)),
                ("corrective fraction", shown(mean('objective/corrective_frac'), 5)),
                ("mean version lag", f"{mean('staleness/lag_mean'):.2f}"),
            ]
            rows += self._update_rows(mean)
            rows += self._reward_rows()
        if self.evals:  # this session's rounds: each record came through evaluation(), with its seconds
            seconds, wall = [e["seconds"] for e in self.evals], self.clock() - self._began
            calls = sum(e["engine_calls"] for e in self.evals) / len(self.evals)
            rows.append(("evaluation seconds per round", f"{sum(seconds) / len(seconds):.1f} ({len(seconds)} rounds of {calls:.0f} engine calls, "
                                                         f"{sum(seconds) / max(wall, 1e-9):.0%} of the {wall:.0f} s since the engines were up)"))
        rows.append(("ledger", ", ".join(f"{k} {v}" for k, v in sorted(ledger.items())) or "empty"))
        rows.append(("run folder", str(self.run_dir)))
        if model_dir is not None:
            rows.append(("trained model", f"{model_dir} (transformers: AutoModelForCausalLM.from_pretrained(\"{model_dir}\"))"))
            rows.append(("evaluate it", f"drpo eval {self.run_dir} (the run's own task and eval settings)"))
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)

    def close(self) -> None:
        if self._tty and self.cfg.progress:
            print(file=sys.stderr)
        self._file.close()
        if self._rollouts is not None:
            self._rollouts.close()
        for logger in self.loggers:
            logger.close()
        if self.exporter is not None:
            time.sleep(self.cfg.linger_seconds)
            self.exporter.close()
