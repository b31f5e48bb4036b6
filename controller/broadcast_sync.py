"""Weight publication over a broadcast group (``learner.weight_sync: broadcast``).

    learner rank 0 ──bucket, bucket, …──▶ group ranks 1..N: one per live rollout worker's engine
                     (NCCL on GPU, gloo on CPU; learner/weights/broadcast.py)

The group is formed with every live worker at the start, and formed again whenever its members
change: a worker that died is left out; a worker back from a restart joins at the next publication
(sent at once if the learner is idle) and takes work once that publication reached it. Every collective is bounded by
``learner.weight_sync_timeout_s``: an engine that dies mid-broadcast makes the broadcast fail on the
learner and the other engines instead of hanging them; the group is then formed again without it and
the same publication re-sent, up to BROADCAST_ATTEMPTS times.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import ray
from ray.exceptions import RayActorError

from learner.group import LearnerGroup

BROADCAST_ATTEMPTS = 3
"""Tries of one publication (each after forming the group again without the workers that died)."""
JOIN_SLACK_SECONDS = 30.0
"""Beyond the collective timeout, how long a worker may take after the learner's rank 0 is done."""


@dataclass
class Outcome:
    nbytes: int = 0
    received: dict[int, dict] = field(default_factory=dict)
    """Worker -> its receive_weights result ({"version", "seconds"} or {"error"})."""
    dead: set[int] = field(default_factory=set)
    """Workers whose actor died during the attempt."""
    error: str | None = None
    """Why the attempt failed (None: every member received the publication)."""
    sent: bool = False
    """The learner's rank 0 sent the whole publication (so a worker that reports an error failed on its own)."""

    @property
    def failed_alone(self) -> list[int]:
        """Live workers that failed while the transfer itself succeeded for everyone (their engine
        could not take it): restarting them is the way back, not another try."""
        if not self.sent or self.dead or not any("version" in r for r in self.received.values()):
            return []  # when no member took it, the publication (not an engine) is what failed
        return sorted(w for w, r in self.received.items() if "error" in r)


class BroadcastSync:
    """Forms the group and runs one broadcast attempt at a time; the backend decides what to retry."""

    def __init__(self, learner: LearnerGroup, actors: list, timeout_s: float):
        self.learner, self.actors, self.timeout_s = learner, actors, timeout_s
        self.members: tuple[int, ...] = ()

    def invalidate(self) -> None:
        """A member is gone (its group rank with it): the next publication forms a new group."""
        self.members = ()

    def form(self, live: list[int]) -> tuple[set[int], list[int]]:
        """A new group of the learner's rank 0 and ``live`` workers (ranks 1.. in that order);
        returns the workers that died while joining and those whose join failed (either way the
        group is not formed, and the next attempt forms it again)."""
        host, port = ray.get(self.learner.workers[0].address.remote())
        world = 1 + len(live)
        refs = self.learner.join_broadcast(host, port, world, self.timeout_s)
        joins = {self.actors[w].join_weight_group.remote(host, port, 1 + i, world, self.timeout_s): w for i, w in enumerate(live)}
        results, dead = self._settle(refs, joins)
        failed = sorted(w for w in live if "error" in results.get(w, {}))
        self.members = () if dead or failed else tuple(live)
        return dead, failed

    def attempt(self, live: list[int], max_bytes: int, dtype: str | None) -> Outcome:
        """One broadcast of the current weights to ``live`` (the group is formed first if its members
        differ); every receive is waited for."""
        if tuple(live) != self.members:
            dead, failed = self.form(live)
            if dead or failed:
                return Outcome(dead=dead, error=f"forming the group failed (died: {sorted(dead)}, join failed: {failed})")
        sends = self.learner.broadcast(max_bytes, dtype)
        receives = {self.actors[w].receive_weights.remote(): w for w in self.members}
        results, dead = self._settle(sends, receives)
        publication = results.pop(None)
        sent = publication is not None and publication.error is None
        out = Outcome(publication.nbytes if publication else 0, results, dead, sent=sent)
        failed = sorted(w for w, r in results.items() if "error" in r)
        if publication is None or publication.error or failed or dead:
            out.error = (publication.error if publication and publication.error else None) or (
                f"workers {sorted(dead)} died" if dead else f"workers {failed} failed to receive: {results[failed[0]]['error']}" if failed else "no publication"
            )
            self.invalidate()  # the group is broken: formed again before the next attempt
        return out

    def _settle(self, learner_refs: list, worker_refs: dict) -> tuple[dict, set[int]]:
        """Wait for the learner's refs (each of its collectives is bounded by the group's timeout),
        then for the workers' (bounded from then on); returns ({worker: result, None: rank 0's
        result or None if it failed}, the workers whose actor died). A dead learner rank raises (the
        backend turns it into LearnerLost); an unavailable worker counts as dead (the backend reports it
        lost, and it comes back through the restart path)."""
        results: dict = {None: None}
        for i, ref in enumerate(learner_refs):
            try:
                value = ray.get(ref)
            except ray.exceptions.RayTaskError:
                value = None
            if i == 0 and not isinstance(value, dict):
                results[None] = value
        deadline = time.monotonic() + self.timeout_s + JOIN_SLACK_SECONDS
        dead: set[int] = set()
        for ref, worker in worker_refs.items():
            try:
                value = ray.get(ref, timeout=max(1.0, deadline - time.monotonic()))
            except RayActorError:  # dead, or unavailable (restarting): out of this group either way
                dead.add(worker)
                continue
            except (ray.exceptions.GetTimeoutError, ray.exceptions.RayTaskError) as err:
                value = {"error": f"{type(err).__name__}: {str(err)[:200]}"}
            results[worker] = value or {}
        return results, dead
