"""Stall diagnosis: a run that stops making progress says what it is waiting for, then fails by name.

Progress is a finished training step (or the run's start). When none comes for
``train.stall_report_seconds``, the Controller writes a ``stall`` record (metrics.jsonl, every
logger, the Prometheus gauge ``drpo_stalled_seconds``) and prints it: each worker's served version,
queue and last heartbeat, the groups admitted and not returned (oldest first, with their worker,
the version they started under and their age), what is buffered, and the learner's state. Past
``train.stall_fail_seconds`` it raises Stalled with the same account, instead of hanging.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_LISTED = 8
"""Groups named one by one in a stall report (the rest are counted)."""


class Stalled(RuntimeError):
    """No training step finished within ``train.stall_fail_seconds``."""


@dataclass
class Watchdog:
    report_after: float
    """Seconds without progress before a stall is reported (0: never)."""
    fail_after: float
    """Seconds without progress before the run fails (0: never)."""
    last_progress: float
    reported: bool = False
    reports: list[dict] = field(default_factory=list)

    def progress(self, now: float) -> None:
        self.last_progress, self.reported = now, False

    def check(self, now: float, account) -> dict | None:
        """``account()`` builds the stall record when one is due; returns it once per stall (reported)
        and raises Stalled past the fail limit."""
        idle = now - self.last_progress
        failing = self.fail_after > 0 and idle >= self.fail_after
        if not failing and (self.reported or not self.report_after or idle < self.report_after):
            return None
        record = {"stalled_seconds": idle, **account()}
        if failing:
            raise Stalled(f"no training step finished for {idle:.0f} s (train.stall_fail_seconds={self.fail_after:g}): {describe(record)}")
        self.reported = True
        self.reports.append(record)
        return record


def describe(record: dict) -> str:
    """One paragraph for a person: what the run waits for."""
    parts = [f"step {record['step']} (version {record['version']}) waiting for {record['waiting_for']}"]
    parts.append(f"learner: {record['learner']}")
    for w in record["workers"]:
        parts.append(
            f"worker {w['worker']}: " + ", ".join(f"{k} {v}" for k, v in w.items() if k != "worker")
        )
    flights = record["in_flight"]
    if flights:
        listed = "; ".join(
            f"{f['ticket']} on worker {f['worker']} (started under {f['started']}, {f['age_seconds']:.0f} s)" for f in flights
        )
        more = record["in_flight_count"] - len(flights)
        parts.append(f"admitted and not returned: {listed}" + (f" and {more} more" if more > 0 else ""))
    parts.append(f"buffered {record['buffered']} of {record['batch_size']} groups")
    return " | ".join(parts)


def stall_account(ctl) -> dict:
    """What the Controller ``ctl`` waits for: the step, the learner, every worker and the groups
    admitted and not returned, oldest first."""
    now = ctl.backend.now()
    expiring = ctl.version - ctl.cfg.train.max_staleness
    if ctl.training is not None:
        waiting = f"the learner to finish step {ctl.step + 1}"
    elif ctl.evals and not ctl.cfg.eval.concurrent:
        ev = next(iter(ctl.evals.values()))
        waiting = f"evaluation results ({len(ev.results)} of {ev.expected} held-out prompts returned)"
    elif len(ctl.buffer) >= ctl.batch_size:
        waiting = f"groups started at or before version {expiring} to finish (train.over_bound=wait) before step {ctl.step + 1}"
    else:
        waiting = f"{ctl.batch_size - len(ctl.buffer)} more accepted groups for step {ctl.step + 1}"
    flights = sorted(ctl.in_flight.items(), key=lambda kv: kv[1].admitted)
    return {
        "step": ctl.step, "version": ctl.version, "waiting_for": waiting,
        "learner": f"training step {ctl.step + 1} for {now - ctl.training.began:.0f} s" if ctl.training else f"idle at version {ctl.version}",
        "workers": ctl.backend.diagnose(),
        "in_flight": [
            {"ticket": str(t), "worker": f.worker, "started": "queued" if f.started is None else f"version {f.started}",
             "age_seconds": now - f.admitted} for t, f in flights[:MAX_LISTED]
        ],
        "in_flight_count": len(flights), "eval_pending": len(ctl.eval_pending),
        "buffered": len(ctl.buffer), "batch_size": ctl.batch_size,
    }
