"""A rollout worker's queue of submissions and the order it serves them in: which prompts go
into the next engine call. Pure scheduling (a lock and a condition), testable without Ray or an engine."""

from __future__ import annotations

import threading

from rollout.records import EvalTicket, Ticket
from rollout.tasks import Problem

Submission = tuple[Ticket, Problem, int]
"""(ticket, problem, n): one prompt to sample n responses for."""


TRAINING_AHEAD_OF_EVALUATION = 2
"""Engine calls of training prompts that may go ahead of a waiting evaluation prompt: training
first, so evaluation never delays the learner's next batch, but an evaluation is never starved
when the rollout is the slower stage (there is always training work queued then)."""


def call_key(item: Submission) -> tuple[int, bool]:
    """Submissions generated in one engine call share n and decoding (greedy or sampled)."""
    return item[2], bool(getattr(item[0], "greedy", False))


class Inbox:
    """Queued (ticket, problem, n) submissions, each kind in order: training first, evaluation
    after at most TRAINING_AHEAD_OF_EVALUATION training calls. ``close`` drops what is queued (the
    controller takes queued work back with ``cancel_queued`` before it stops a worker)."""

    def __init__(self) -> None:
        self._queues: tuple[list, list] = ([], [])  # training, evaluation
        self._cond = threading.Condition()
        self._closed = False
        self._ahead = 0  # training calls served while evaluation waited

    def put(self, items: list[Submission]) -> None:
        """Queue submissions together: the next ``take`` sees all of them."""
        with self._cond:
            for item in items:
                self._queues[isinstance(item[0], EvalTicket)].append(item)
            self._cond.notify()

    def qsize(self) -> int:
        with self._cond:
            return sum(len(q) for q in self._queues)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()

    def drain(self) -> list[Submission]:
        with self._cond:
            items = self._queues[0] + self._queues[1]
            self._queues[0].clear()
            self._queues[1].clear()
            return items

    def take(self, rows: int, eval_rows: int | None = None) -> list[Submission] | None:
        """Block for the next submissions to generate together: the head of the first non-empty
        queue and what follows it with the same n and decoding, as many prompts as fill ``rows``
        engine rows (``eval_rows`` for evaluation; None: ``rows``) and at least one; None once closed."""
        with self._cond:
            while not self._closed and not any(self._queues):
                self._cond.wait()
            if self._closed:
                return None
            train, evaluation = self._queues
            if train and (not evaluation or self._ahead < TRAINING_AHEAD_OF_EVALUATION):
                q, self._ahead = train, self._ahead + bool(evaluation)
            else:
                q, self._ahead = evaluation, 0
            n, key = q[0][2], call_key(q[0])
            limit = max(1, ((eval_rows or rows) if q is evaluation else rows) // n)
            count = 1
            while count < min(len(q), limit) and call_key(q[count]) == key:
                count += 1
            batch = q[:count]
            del q[:count]
            return batch
