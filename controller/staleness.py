"""Bounded staleness: admission control for asynchronous rollouts (AReaL's rule, arXiv 2505.24298).

With max staleness eta, batch size B (groups consumed per optimizer step) and the learner's current
policy version v, a new rollout may start only while

    started = accepted + running < (eta + v + 1) * B

so no admitted rollout can be consumed more than eta versions after the version it started with.
Admission alone bounds how many rollouts start, not when each is consumed: rollouts finish out of
order, and a slow one admitted early can outlive the bound (tests show the case). So the rule is
enforced twice: at admission (``try_admit``), and at consumption, where ``is_fresh`` lets a drop
policy discard an over-bound sample and ``check`` raises if one reaches the learner anyway — the
invariant, not a best effort.
Samples rejected by the reward filter or failing give their slot back (``on_rejected``).

The class is a small lock-protected counter handed a version provider (the learner's version), so
the same object schedules a real run and a simulated one.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable


LAG_BINS = 8
"""Version-lag histograms (staleness/lag_hist, staleness/token_lag_hist) have bins 0..LAG_BINS-2
and one overflow bin."""


class StalenessViolation(RuntimeError):
    """A sample older than the staleness bound reached the learner."""


@dataclass(frozen=True)
class StalenessStats:
    version: int
    accepted: int
    running: int
    rejected: int
    capacity: int
    admitted: int


class StalenessManager:
    def __init__(
        self, max_staleness: int, batch_size: int, version: Callable[[], int], max_concurrent: int | None = None,
        serving_version: Callable[[], int] | None = None, surplus: int = 0,
    ):
        """``version``: the learner's policy version. ``serving_version``: the oldest version a new
        rollout may start under (the slowest worker's, while a publication travels); admission counts
        with it, so a lagging publication slows admission instead of producing samples to drop.
        ``surplus``: rollouts admitted beyond the bound's (eta + v + 1) * B (sync over-sampling: the
        caller drops what the batch does not take, giving the slots back with ``on_dropped``)."""
        if max_staleness < 0 or batch_size < 1:
            raise ValueError(f"max_staleness must be >= 0 and batch_size >= 1, got {max_staleness}, {batch_size}")
        self.max_staleness, self.batch_size = max_staleness, batch_size
        self.max_concurrent, self.surplus = max_concurrent, surplus
        self._version = version
        self._serving = serving_version or version
        self._lock = threading.Lock()
        self._accepted = self._running = self._rejected = self._admitted = 0

    def _capacity(self) -> int:
        limit = (self.max_staleness + min(self._version(), self._serving()) + 1) * self.batch_size + self.surplus - (self._accepted + self._running)
        if self.max_concurrent is not None:
            limit = min(limit, self.max_concurrent - self._running)
        return limit

    def try_admit(self) -> int | None:
        """Admit one rollout if the bound allows; returns the version it starts under, or None."""
        with self._lock:
            if self._capacity() <= 0:
                return None
            self._running += 1
            self._admitted += 1
            return self._version()

    def on_accepted(self) -> None:
        """A running rollout finished and was kept for training."""
        with self._lock:
            self._require_running()
            self._running -= 1
            self._accepted += 1

    def on_rejected(self) -> None:
        """A running rollout finished and was dropped (filtered, failed): its slot is free again."""
        with self._lock:
            self._require_running()
            self._running -= 1
            self._rejected += 1

    def on_dropped(self) -> None:
        """An accepted sample was dropped before training (over the bound): its slot is free again."""
        with self._lock:
            if self._accepted <= 0:
                raise RuntimeError("a sample was dropped that was never accepted")
            self._accepted -= 1
            self._rejected += 1

    def on_cancelled(self) -> None:
        """A running rollout was taken back before it started (it will be admitted again later)."""
        with self._lock:
            self._require_running()
            self._running -= 1

    def is_fresh(self, oldest_token_version: int) -> bool:
        """Whether a sample may be trained on now (the drop policy discards it otherwise)."""
        return self._version() - oldest_token_version <= self.max_staleness

    def check(self, lag: int) -> None:
        """Raise StalenessViolation if a sample ``lag`` versions old (the batch builder's count for
        its oldest token) is about to be trained on."""
        if lag > self.max_staleness:
            raise StalenessViolation(f"a sample {lag} versions old reached the learner; the bound is {self.max_staleness}")

    def stats(self) -> StalenessStats:
        with self._lock:
            return StalenessStats(self._version(), self._accepted, self._running, self._rejected, max(0, self._capacity()), self._admitted)

    def state_dict(self, requeued: int = 0) -> dict:
        """Counters to checkpoint. In-flight rollouts are re-queued on resume, so running is not
        saved; ``requeued`` accepted samples (buffered, not trained) will be admitted again, so they
        leave the accepted count: a resumed run admits what a run at this boundary would."""
        with self._lock:
            return {"accepted": self._accepted - requeued, "rejected": self._rejected, "admitted": self._admitted}

    def load_state_dict(self, state: dict) -> None:
        with self._lock:
            self._accepted, self._rejected, self._running = int(state["accepted"]), int(state["rejected"]), 0
            self._admitted = int(state.get("admitted", 0))

    def _require_running(self) -> None:
        if self._running <= 0:
            raise RuntimeError("a rollout finished that was never admitted")
