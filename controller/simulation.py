"""A discrete-event backend: generation and training replaced by sampled durations, no models.

Workers take their queue in order, one group at a time, each taking a lognormal duration; every
token of a group carries the version the worker served when it started. A publication reaches every
worker ``publish_seconds`` later. Groups are real records (rollout/records.py) with synthetic
tokens, so the Controller builds real TrainBatches from them with the same batch builder as a real
run; training only counts the batch's tokens. Time is simulated, so hundreds of workers and
thousands of steps run in seconds; the Controller driving it is the one that drives real runs.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections import deque

import torch

from controller.backend import Backend, Events, PublishReport, TrainResult
from controller.config import SimulationConfig
from learner.batch import TrainBatch
from rollout.engine import Completion
from rollout.records import Group, Sample, Started, Ticket
from rollout.scheduler import Submission
from rollout.rewards import RewardResult

PROMPT_TOKENS = 4
"""Prompt length of a synthetic sample."""
SIMULATED_LOGP = -1.0
"""mu of every synthetic token (the simulated learner computes nothing from it)."""
_REWARDS = {1.0: RewardResult(1.0, "1", "correct"), 0.0: RewardResult(0.0, "0", "wrong")}


def lognormal(rng: random.Random, mean: float, cv: float) -> float:
    """A positive duration with the given mean and coefficient of variation."""
    if cv == 0:
        return mean
    sigma2 = math.log(1 + cv * cv)
    return rng.lognormvariate(math.log(mean) - sigma2 / 2, math.sqrt(sigma2))


class SimulatedBackend(Backend):
    def __init__(self, cfg: SimulationConfig, workers: int, topk: int = 0):
        """``topk``: K of the engine top-K log-probs each synthetic token carries (the objective's need)."""
        self.cfg, self.workers, self.topk = cfg, workers, topk
        self._completions: dict[int, Completion] = {}
        self.rng = random.Random(cfg.seed)
        self.clock = 0.0
        self._events: list = []
        self._order = itertools.count()
        self._queues = [deque() for _ in range(workers)]
        self._busy = [False] * workers
        self._serving = [0] * workers
        self._started: list[Started] = []
        self._down = [False] * workers
        self._incarnation = [0] * workers
        self._published = 0
        self.crashes = 0

    @classmethod
    def build(cls, config: SimulationConfig, *, workers: int, topk: int = 0) -> "SimulatedBackend":
        """A simulated cluster of ``workers`` rollout workers and one learner, timed as ``config`` says;
        ``topk``: K of the engine top-K log-probs each synthetic token carries (the objective's need)."""
        SimulationConfig.expect(config, "SimulatedBackend")
        return cls(config, workers, topk)

    def now(self) -> float:
        return self.clock

    def _at(self, seconds: float, event: tuple) -> None:
        heapq.heappush(self._events, (self.clock + seconds, next(self._order), event))

    def available(self, worker: int) -> bool:
        return not self._down[worker]

    def submit(self, worker: int, items: list[Submission]) -> None:
        if self._down[worker]:
            raise RuntimeError(f"submit to worker {worker}, which is down")
        self._queues[worker].extend((ticket, n) for ticket, _, n in items)
        self._start_next(worker)

    def _completion(self, version: int) -> Completion:
        """One synthetic response sampled at ``version`` (records are immutable, so one per version is shared)."""
        if version not in self._completions:
            length, k = self.cfg.tokens_per_sample, self.topk
            self._completions[version] = Completion(
                torch.arange(PROMPT_TOKENS), torch.arange(length) % 7 + PROMPT_TOKENS, torch.full((length,), SIMULATED_LOGP),
                torch.full((length,), version), "stop", version,
                topk_ids=torch.arange(k).repeat(length, 1) if k else None, topk_logp=torch.full((length, k), SIMULATED_LOGP - 1) if k else None,
            )
        return self._completions[version]

    def _start_next(self, worker: int) -> None:
        if self._busy[worker] or not self._queues[worker]:
            return
        ticket, n = self._queues[worker].popleft()
        self._busy[worker] = True
        version = self._serving[worker]
        seconds = lognormal(self.rng, self.cfg.gen_seconds, self.cfg.gen_cv)
        if self.rng.random() < self.cfg.crash_rate:
            self._at(seconds * self.rng.random(), ("crash", (worker, self._incarnation[worker])))
        rewards = [float(self.rng.random() < self.cfg.accuracy) for _ in range(n)]
        if self.rng.random() < self.cfg.failure_rate:
            group = Group(ticket, worker, (), version, seconds, error="simulated engine failure")
        else:
            samples = tuple(Sample(self._completion(version), _REWARDS[r].extracted, _REWARDS[r]) for r in rewards)
            group = Group(ticket, worker, samples, version, seconds)
        self._started.append(Started(ticket, worker, version))
        self._at(seconds, ("group", (group, self._incarnation[worker])))

    def cancel_queued(self) -> list[Ticket]:
        out = [ticket for q in self._queues for ticket, _ in q]
        for q in self._queues:
            q.clear()
        return out

    def train(self, batch: TrainBatch) -> None:
        """A step that takes a sampled duration and counts the batch's response tokens."""
        seconds = lognormal(self.rng, self.cfg.train_seconds, self.cfg.train_cv)
        tokens = int(batch.response_mask.sum())
        self._at(seconds, ("train", TrainResult(batch.version + 1, tokens, seconds, {"learner/loss": 0.0})))

    def wait(self) -> Events:
        """Advance to the next event time and return what finished then (a publication arriving
        returns empty-handed: it can open admission)."""
        if self._started:  # starts happen at submit time: report them before time moves
            started, self._started = self._started, []
            return Events(started=started)
        if not self._events:
            raise RuntimeError("simulation deadlock: the controller waits but nothing is running")
        groups: list[Group] = []
        lost: list[int] = []
        revived: list[int] = []
        trained = None
        time_ = self._events[0][0]
        while self._events and self._events[0][0] == time_:
            _, _, (kind, payload) = heapq.heappop(self._events)
            self.clock = max(self.clock, time_)
            if kind in ("group", "crash") and payload[1] != self._incarnation[payload[0].worker if kind == "group" else payload[0]]:
                continue  # an event of a worker life that ended in a crash
            if kind == "group":
                group = payload[0]
                groups.append(group)
                self._busy[group.worker] = False
                self._start_next(group.worker)
            elif kind == "crash":
                worker = payload[0]
                self.crashes += 1
                self._incarnation[worker] += 1
                self._queues[worker].clear()
                self._busy[worker], self._down[worker] = False, True
                lost.append(worker)
                self._at(self.cfg.restart_seconds, ("revive", worker))
            elif kind == "revive":  # back, serving the newest publication before taking work
                self._down[payload] = False
                self._serving[payload] = self._published
                revived.append(payload)
            elif kind == "train":
                trained = payload
            else:  # "weights": a publication arrives at a worker
                worker, version = payload
                self._serving[worker] = max(self._serving[worker], version)
        started, self._started = self._started, []
        return Events(groups, trained, started, lost, revived)

    def publish(self, version: int, wait: bool) -> PublishReport:
        self._published = version
        delay = self.cfg.publish_seconds
        if wait:
            self.clock += delay
            self._serving = [max(v, version) for v in self._serving]
        else:
            for w in range(self.workers):
                self._at(delay, ("weights", (w, version)))
        return PublishReport(delay)

    def worker_version(self, worker: int) -> int:
        return self._serving[worker]

    def load(self, folder: str, version: int) -> None:
        self._serving = [version] * self.workers
