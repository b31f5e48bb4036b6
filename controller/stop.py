"""Stopping a run on SIGINT (Ctrl-C) or SIGTERM (``ray job stop``, a Kubernetes eviction, a preemption).

Before the loop starts (Ray, the models loading) nothing is worth saving: a signal stops at once.
Once the loop runs, the first signal asks the Controller to stop: it admits nothing more, lets the
step in flight finish for up to ``train.stop_grace_seconds`` (or abandons it), writes a checkpoint
unless the last one is current, and returns; the driver then prints the resume command and exits
with 128 + the signal's number (130 for SIGINT, 143 for SIGTERM). A second signal stops at once.
"""

from __future__ import annotations

import signal
import sys
import threading
from contextlib import contextmanager

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(BaseException):
    """Stop at once (a second signal, or one during start-up). A BaseException, like
    KeyboardInterrupt, so no ``except Exception`` on the way swallows it."""

    def __init__(self, signum: int):
        super().__init__(f"stopped at once by {signal.Signals(signum).name}")
        self.signum = signum


class StopRequest:
    """Whether, and by which signal, the run was asked to stop. The Controller polls ``requested``."""

    def __init__(self):
        self.signum: int | None = None
        self.graceful = False
        """False until the loop starts: a signal before then raises Interrupted."""
        self._previous: dict[int, object] = {}
        self.closing = False
        """True while the driver shuts down after the run: a signal then only says so."""

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str | None:
        return signal.Signals(self.signum).name if self.signum is not None else None

    def request(self, signum: int) -> None:
        """What the signal handler does (tests call it directly)."""
        if self.closing:
            print(f"drpo train: {signal.Signals(signum).name} received while shutting down; almost done", file=sys.stderr, flush=True)
            return
        if self.signum is not None or not self.graceful:
            raise Interrupted(signum)
        self.signum = signum
        print(
            f"\ndrpo train: {self.name} received: stopping (no new rollouts; the step in flight finishes, then a checkpoint). "
            f"Send it again to stop at once.", file=sys.stderr, flush=True,
        )

    def install(self) -> None:
        """Route SIGINT and SIGTERM to ``request`` (main thread only; elsewhere a no-op). Call it again
        after ``ray.init``, which replaces SIGTERM's handler (its own Python one and its C++ core's
        crash handler, which prints a stack dump and exits)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for s in SIGNALS:
            self._previous.setdefault(s, signal.signal(s, self._handle))

    def _handle(self, signum, frame) -> None:
        self.request(signum)

    @contextmanager
    def handling_signals(self):
        """``install`` while inside; the previous handlers come back on the way out."""
        self.install()
        try:
            yield self
        finally:
            for s, handler in self._previous.items():
                signal.signal(s, handler)
            self._previous.clear()
