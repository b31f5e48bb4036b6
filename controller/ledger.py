"""Prompt order with epoch accounting, and the ledger of what became of every prompt drawn.

``PromptSampler`` hands out prompt ids in a seeded permutation per epoch; ids given back with
``requeue`` (in-flight or buffered work at a checkpoint, a dead worker's queue) come out first.
``Ledger`` records one outcome per drawn (epoch, id): trained (with the step and the sample's
version lag) or dropped with a reason (filtered, stale, failed, or surplus: over-sampled in sync
mode beyond the batch). Together they make resume exact:
a checkpoint holds the sampler's position, the ledger and the re-queued ids, so nothing is
consumed twice or skipped (tests/test_controller_sim.py checks it).
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from typing import Literal

from rollout.records import TrainTicket as Ticket

Outcome = Literal["trained", "filtered", "stale", "failed", "surplus"]


class PromptSampler:
    def __init__(self, ids: list[str], seed: int):
        if not ids:
            raise ValueError("the training set is empty")
        if len(set(ids)) != len(ids):
            raise ValueError("training prompt ids are not unique; the ledger keys on them")
        self.ids, self.seed = list(ids), seed
        self.epoch, self.position = 0, 0
        self._order = self._permutation(0)
        self._requeued: list[Ticket] = []

    def _permutation(self, epoch: int) -> list[str]:
        order = list(self.ids)
        random.Random(f"{self.seed}-{epoch}").shuffle(order)
        return order

    def next(self) -> Ticket:
        if self._requeued:
            return self._requeued.pop(0)
        if self.position == len(self._order):
            self.epoch, self.position = self.epoch + 1, 0
            self._order = self._permutation(self.epoch)
        self.position += 1
        return Ticket(self.epoch, self._order[self.position - 1])

    def requeue(self, tickets: list[Ticket]) -> None:
        """Give tickets back; they are drawn again before any new prompt, in the order given."""
        self._requeued = list(tickets) + self._requeued

    def issued(self, epoch: int) -> list[str]:
        """Ids drawn fresh from ``epoch``'s permutation so far (requeues are not new draws)."""
        if epoch < self.epoch:
            return self._permutation(epoch)
        return self._order[: self.position] if epoch == self.epoch else []

    def state_dict(self, pending: list[Ticket]) -> dict:
        """Position plus everything to draw again first: the requeue list and ``pending`` work."""
        return {"epoch": self.epoch, "position": self.position, "requeued": [asdict(t) for t in pending + self._requeued]}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._permutation(self.epoch)
        self._requeued = [Ticket(**t) for t in state["requeued"]]


@dataclass(frozen=True)
class Entry:
    epoch: int
    id: str
    outcome: Outcome
    step: int
    """The step it was trained in, or the step during which it was dropped."""
    lag: int | None = None
    """trained: learner version minus the sample's oldest token version."""
    reason: str | None = None


class Ledger:
    def __init__(self) -> None:
        self.entries: list[Entry] = []
        self._seen: set[tuple[int, str]] = set()

    def record(self, ticket: Ticket, outcome: Outcome, step: int, lag: int | None = None, reason: str | None = None) -> None:
        key = (ticket.epoch, ticket.id)
        if key in self._seen:
            raise RuntimeError(f"prompt {ticket.id} of epoch {ticket.epoch} already has an outcome; it was consumed twice")
        self._seen.add(key)
        self.entries.append(Entry(ticket.epoch, ticket.id, outcome, step, lag, reason))

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for e in self.entries:
            out[e.outcome] = out.get(e.outcome, 0) + 1
        return out

    def state_dict(self) -> list[dict]:
        return [asdict(e) for e in self.entries]

    def load_state_dict(self, entries: list[dict]) -> None:
        self.entries, self._seen = [], set()
        for e in entries:
            entry = Entry(**e)
            self._seen.add((entry.epoch, entry.id))
            self.entries.append(entry)


def audit(state: dict, ids: list[str], seed: int) -> dict[str, int]:
    """Account for every prompt drawn, from a checkpoint's controller state (controller.json) and
    the training ids in file order: ``double_counted`` (an (epoch, id) with two outcomes, or with
    one and also waiting to be drawn again), ``lost`` (drawn, with no outcome and not waiting),
    ``phantom`` (an outcome or a wait for a prompt never drawn), ``unexplained`` (dropped without a
    reason), and the ``trained`` count. An exact run has zeros everywhere but ``trained``."""
    keys = [(e["epoch"], e["id"]) for e in state["ledger"]]
    pending = [(t["epoch"], t["id"]) for t in state["sampler"]["requeued"]]
    sampler = PromptSampler(ids, seed)
    sampler.load_state_dict(state["sampler"])
    drawn = {(epoch, i) for epoch in range(sampler.epoch + 1) for i in sampler.issued(epoch)}
    accounted = set(keys) | set(pending)
    return {
        "double_counted": len(keys) + len(pending) - len(accounted),
        "lost": len(drawn - accounted),
        "phantom": len(accounted - drawn),
        "unexplained": sum(1 for e in state["ledger"] if e["outcome"] != "trained" and not e["reason"]),
        "trained": sum(1 for e in state["ledger"] if e["outcome"] == "trained"),
    }
