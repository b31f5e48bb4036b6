"""What the controller asks of the machinery under it, and what comes back.

The Controller (loop.py) schedules against this interface only; ``RayBackend`` runs real rollout
workers and a learner group, ``SimulatedBackend`` replaces both with sampled durations and synthetic
records. Both return the same records (rollout/records.py) and take the same TrainBatch, so the
scheduling and the batch building are the same code in both modes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from learner.batch import TrainBatch
from rollout.records import Group, Started, Ticket
from rollout.scheduler import Submission


@dataclass(frozen=True)
class TrainResult:
    version: int
    """The learner's policy version after the step."""
    tokens: int
    seconds: float
    metrics: dict[str, float]
    """The learner's step metrics, already reduced across updates and ranks by kind."""


@dataclass(frozen=True)
class Events:
    """What ``Backend.wait`` returns: anything may be empty."""

    groups: list[Group] = field(default_factory=list)
    trained: TrainResult | None = None
    started: list[Started] = field(default_factory=list)
    lost: list[int] = field(default_factory=list)
    """Workers that died: everything queued or generating on them is gone (the controller
    re-queues it). A worker comes back only after it serves the current weights."""
    revived: list[int] = field(default_factory=list)
    """Workers back from the dead, already serving the newest publication."""
    why: dict[int, str] = field(default_factory=dict)
    """Of the ``lost`` workers, why each was lost where the backend knows (a call past its deadline,
    an engine that failed); a worker whose process just died has none."""


@dataclass(frozen=True)
class PublishReport:
    """What one publication cost."""

    seconds: float
    """From the call until the publication was handed off (``wait``: until every worker serves it)."""
    nbytes: int = 0
    transport: str = "object_store"
    receive_seconds: tuple[float, ...] = ()
    """broadcast: per receiving worker, seconds from its receive call until its engine held the weights."""
    retries: int = 0
    """broadcast: times the group was formed again and the publication re-sent (an engine died mid-way)."""


class LearnerLost(RuntimeError):
    """A learner rank died: the run cannot go on; resume it from its last checkpoint."""


class WorkersGone(RuntimeError):
    """Every rollout worker died and is out of restarts; the message names the last reason known."""


class DeadlineExceeded(RuntimeError):
    """A call the run cannot go on without (start-up, a learner call) ran past its deadline
    (``deadlines``); the message names the call and the actors."""


class Backend(ABC):
    """Transport only: moves submissions to workers, records back, batches to the learner and
    weights to the workers. It decides nothing about what trains (the Controller does)."""

    workers: int

    @abstractmethod
    def now(self) -> float:
        """Seconds on the backend's clock (wall clock, or simulated)."""

    @abstractmethod
    def submit(self, worker: int, items: list[Submission]) -> None:
        """Queue (ticket, problem, n) prompts, each for ``n`` samples, on ``worker``, together (the
        worker sees them all queued at once); returns at once."""

    @abstractmethod
    def cancel_queued(self) -> list[Ticket]:
        """Take back every submission not yet started; returns their tickets."""

    @abstractmethod
    def train(self, batch: TrainBatch) -> None:
        """Start one training step (every update of the batch) on the learner; returns at once."""

    @abstractmethod
    def wait(self) -> Events:
        """Block until something happens: groups finish or start, the training step ends, or a
        publication reaches a worker."""

    @abstractmethod
    def publish(self, version: int, wait: bool) -> PublishReport:
        """Send the learner's weights to every worker; ``wait`` until all serve them."""

    def available(self, worker: int) -> bool:
        """Whether ``worker`` takes submissions now (False while it is dead or restarting)."""
        return True

    @abstractmethod
    def worker_version(self, worker: int) -> int:
        """The newest version ``worker`` is known to serve (a lower bound while a publication travels)."""

    def diagnose(self) -> list[dict]:
        """Per worker, what a stall report shows: the version it serves, whether it takes work, and
        what its own heartbeat says where there is one."""
        return [{"worker": w, "serves": self.worker_version(w), "available": self.available(w)} for w in range(self.workers)]

    def probe_storage(self, run_dir: str, nonce: str) -> list[dict]:
        """Every learner rank's view of the driver's storage marker (learner.checkpoint.storage_probe);
        empty where the learner shares the driver's process."""
        return []

    def save(self, folder: str) -> None:
        """Write the learner's state into ``folder``."""

    def load(self, folder: str, version: int) -> None:
        """Restore the learner from ``folder`` and serve its weights (``version``) on every worker."""

    def shutdown(self) -> None:
        pass
