"""RolloutWorker: a Ray actor that turns admitted prompts into scored groups, asynchronously.

Thin around an Engine: ``submit`` queues problems and returns at once; a background thread takes
them in order, generates a group of n samples, scores every completion, and appends the finished
``ScoredGroup`` to an outbox that ``collect`` drains. ``update_weights`` stages a publication while
generation runs; the engine swaps it in between two decoding steps, so no request is dropped and a
response spanning the update records both versions. ``heartbeat`` reports liveness and progress.
A generation or reward failure is recorded on its group (``error``), never kills the worker.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

import torch

from rollout.engine import Completion, SamplingParams, make_engine
from rollout.rewards import LiteralNumberReward, MathVerifyReward, RewardResult
from rollout.tasks import Problem


@dataclass(frozen=True)
class ScoredGroup:
    problem: Problem
    completions: list[Completion]
    texts: list[str]
    rewards: list[RewardResult]
    seconds: float
    error: str | None = None

    @property
    def scores(self) -> list[float]:
        return [r.score for r in self.rewards]


@dataclass
class _Stats:
    groups: int = 0
    tokens: int = 0
    failures: int = 0
    last_step: float = field(default_factory=time.time)


def make_reward(name: str):
    if name == "literal":
        return LiteralNumberReward()
    if name == "math_verify":
        return MathVerifyReward()
    raise ValueError(f"unknown reward {name!r}; expected 'literal' or 'math_verify'")


class RolloutWorker:
    """Create with ``ray.remote(RolloutWorker)``; every method returns quickly."""

    def __init__(self, model_folder: str, sampling: dict, reward: str = "literal", precision: str = "fp32", engine: str = "hf", **engine_kwargs):
        self.engine = make_engine(engine, model_folder, precision, **engine_kwargs)
        self.sampling = SamplingParams(**sampling)
        self.reward = make_reward(reward)
        self._inbox: queue.Queue[Problem | None] = queue.Queue()
        self._outbox: list[ScoredGroup] = []
        self._lock = threading.Lock()
        self._stats = _Stats()
        self._in_flight = 0
        self._thread = threading.Thread(target=self._loop, name="rollout", daemon=True)
        self._thread.start()

    def submit(self, problems: list[Problem]) -> int:
        """Queue problems for generation; returns the queue depth."""
        for p in problems:
            self._inbox.put(p)
        return self._inbox.qsize()

    def collect(self, min_groups: int = 1, timeout_s: float = 0.0) -> list[ScoredGroup]:
        """Finished groups (all of them), waiting up to ``timeout_s`` for at least ``min_groups``."""
        deadline = time.time() + timeout_s
        while True:
            with self._lock:
                if len(self._outbox) >= min_groups or time.time() >= deadline:
                    out, self._outbox = self._outbox, []
                    return out
            time.sleep(0.05)

    def update_weights(self, bucket_refs: list) -> int:
        """Stage a publication (object-store refs of WeightBuckets); returns its version."""
        import ray

        buckets = ray.get(list(bucket_refs))
        self.engine.update_weights(buckets)
        return buckets[-1].version

    def heartbeat(self) -> dict:
        with self._lock:
            return {
                "alive": self._thread.is_alive(), "version": self.engine.version, "queue_depth": self._inbox.qsize(),
                "in_flight": self._in_flight, "groups": self._stats.groups, "tokens": self._stats.tokens,
                "failures": self._stats.failures, "last_step_time": self._stats.last_step,
            }

    def shutdown(self) -> None:
        self._inbox.put(None)

    def _loop(self) -> None:
        while True:
            problem = self._inbox.get()
            if problem is None:
                return
            with self._lock:
                self._in_flight += 1
            group = self._generate(problem)
            with self._lock:
                self._in_flight -= 1
                self._outbox.append(group)
                self._stats.groups += 1
                self._stats.failures += group.error is not None
                self._stats.tokens += sum(len(c.response_ids) for c in group.completions)
                self._stats.last_step = time.time()

    def _generate(self, problem: Problem) -> ScoredGroup:
        started = time.perf_counter()
        if not problem.prompt.strip():
            return ScoredGroup(problem, [], [], [], 0.0, error="empty prompt")
        try:
            prompt = self.engine.chat_prompt(problem.prompt)
            completions = self.engine.generate([prompt], self.sampling)[0]
            if any(not torch.isfinite(c.rollout_logp).all() for c in completions):
                raise ValueError("engine returned NaN or inf behaviour log-probs")
            texts = [self.engine.tokenizer.decode(c.response_ids, skip_special_tokens=True) for c in completions]
            rewards = [self._score(t, problem.ground_truth) for t in texts]
            return ScoredGroup(problem, completions, texts, rewards, time.perf_counter() - started)
        except Exception as err:  # the worker outlives a bad request; the controller sees why
            return ScoredGroup(problem, [], [], [], time.perf_counter() - started, error=f"{type(err).__name__}: {err}")

    def _score(self, text: str, truth: str) -> RewardResult:
        try:
            return self.reward(text, truth)
        except Exception as err:
            return RewardResult(0.0, None, f"error: {type(err).__name__}")
