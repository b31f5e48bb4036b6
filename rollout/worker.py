"""RolloutWorker: a Ray actor that turns admitted prompts into scored groups, asynchronously.

Thin around an Engine: ``submit`` queues problems and returns at once; a background thread takes
them in order, generates a group of n samples, scores every completion, and appends the finished
``ScoredGroup`` to an outbox that ``collect`` drains. ``update_weights`` stages a publication while
generation runs; the engine swaps it in between two decoding steps, so no request is dropped and a
response spanning the update records both versions. ``heartbeat`` reports liveness and progress.
A generation or reward failure is recorded on its group (``error``), never kills the worker.
"""

from __future__ import annotations

import dataclasses
import queue
import random
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
    tag: str = "train"
    """What the controller asked for it as ("train", "eval"); echoed back unchanged."""

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

    def __init__(
        self, model_folder: str, sampling: dict, reward: str = "literal", precision: str = "fp32", engine: str = "hf",
        max_batch_prompts: int = 1, max_prompt_tokens: int | None = None, chaos: dict | None = None, **engine_kwargs,
    ):
        """``max_batch_prompts``: queued prompts of the same kind generated together in one engine
        call (more rows per decoding step); ``max_prompt_tokens``: longer prompts fail their group;
        ``chaos``: fault-injection rates (controller.config.ChaosConfig), for tests."""
        self.engine = make_engine(engine, model_folder, precision, **engine_kwargs)
        self.sampling = SamplingParams(**sampling)
        self.reward = make_reward(reward)
        self.max_batch_prompts, self.max_prompt_tokens = max_batch_prompts, max_prompt_tokens
        self.chaos = dict(chaos or {})
        self._chaos_rng = random.Random(self.chaos.pop("seed", 0))
        self._inbox: queue.Queue[tuple[Problem, str, int] | None] = queue.Queue()
        self._outbox: list[ScoredGroup] = []
        self._started: list[tuple[str, str, int]] = []
        self._lock = threading.Lock()
        self._stats = _Stats()
        self._in_flight = 0
        self._thread = threading.Thread(target=self._loop, name="rollout", daemon=True)
        self._thread.start()

    def submit(self, problems: list[Problem], tag: str = "train", n: int | None = None) -> int:
        """Queue problems for generation (``n`` samples each, default the sampling's); returns the queue depth."""
        for p in problems:
            self._inbox.put((p, tag, n or self.sampling.n))
        return self._inbox.qsize()

    def reset(self) -> None:
        """Forget queued work and finished groups not yet collected (after the controller re-queued
        them elsewhere); a batch being generated still finishes and is reported."""
        self.cancel_queued()
        with self._lock:
            self._outbox, self._started = [], []

    def cancel_queued(self) -> list[tuple[str, str]]:
        """Take back every queued problem not yet started; returns their (problem id, tag)."""
        taken, keep = [], []
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            (keep if item is None else taken).append(item)
        for item in keep:
            self._inbox.put(item)
        return [(p.id, tag) for p, tag, _ in taken]

    def collect(self, min_groups: int = 1, timeout_s: float = 0.0) -> list[ScoredGroup]:
        """Finished groups (all of them), waiting up to ``timeout_s`` for at least ``min_groups``."""
        deadline = time.time() + timeout_s
        while True:
            with self._lock:
                if len(self._outbox) >= min_groups or time.time() >= deadline:
                    out, self._outbox = self._outbox, []
                    return out
            time.sleep(0.05)

    def poll(self, timeout_s: float = 0.0) -> tuple[list[ScoredGroup], list[tuple[str, str, int]]]:
        """Finished groups and started submissions ((problem id, tag, version served at start)),
        waiting up to ``timeout_s`` for either."""
        deadline = time.time() + timeout_s
        while True:
            with self._lock:
                if self._outbox or self._started or time.time() >= deadline:
                    out, started = self._outbox, self._started
                    self._outbox, self._started = [], []
                    return out, started
            time.sleep(0.05)

    def update_weights(self, bucket_refs: list) -> int:
        """Stage a publication (object-store refs of WeightBuckets); returns its version."""
        import ray

        buckets = ray.get(list(bucket_refs))
        self.engine.update_weights(buckets)
        return buckets[-1].version

    def heartbeat(self) -> dict:
        import ray

        node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
        with self._lock:
            return {
                "node_id": node,
                "alive": self._thread.is_alive(), "version": self.engine.version, "queue_depth": self._inbox.qsize(),
                "in_flight": self._in_flight, "groups": self._stats.groups, "tokens": self._stats.tokens,
                "failures": self._stats.failures, "last_step_time": self._stats.last_step,
            }

    def shutdown(self) -> None:
        self._inbox.put(None)

    def _loop(self) -> None:
        while True:
            item = self._inbox.get()
            if item is None:
                return
            batch = [item]
            while len(batch) < self.max_batch_prompts:  # more of the same kind, if already queued
                try:
                    nxt = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if nxt is None or nxt[1:] != item[1:]:
                    self._inbox.put(nxt)  # order across kinds is not promised; shutdown still arrives
                    break
                batch.append(nxt)
            with self._lock:
                self._in_flight += len(batch)
                self._started += [(p.id, tag, self.engine.version) for p, tag, _ in batch]
            groups = self._generate([p for p, _, _ in batch], item[1], item[2])
            with self._lock:
                self._in_flight -= len(batch)
                self._outbox.extend(groups)
                self._stats.groups += len(groups)
                self._stats.failures += sum(g.error is not None for g in groups)
                self._stats.tokens += sum(len(c.response_ids) for g in groups for c in g.completions)
                self._stats.last_step = time.time()

    def _prompt_ids(self, problem: Problem) -> list[int]:
        if not problem.prompt.strip():
            raise ValueError("empty prompt")
        ids = self.engine.chat_prompt(problem.prompt)
        if self.max_prompt_tokens is not None and len(ids) > self.max_prompt_tokens:
            raise ValueError(f"prompt has {len(ids)} tokens, more than max_prompt_tokens={self.max_prompt_tokens}")
        return ids

    def _generate(self, problems: list[Problem], tag: str, n: int) -> list[ScoredGroup]:
        """Groups in ``problems`` order; a bad prompt fails its own group only."""
        started = time.perf_counter()
        out: dict[int, ScoredGroup] = {}
        prompts = {}
        for i, p in enumerate(problems):
            try:
                prompts[i] = self._prompt_ids(p)
            except Exception as err:
                out[i] = ScoredGroup(p, [], [], [], 0.0, error=str(err) if str(err) == "empty prompt" else f"{type(err).__name__}: {err}", tag=tag)
        if prompts:
            try:
                params = dataclasses.replace(self.sampling, n=n)
                results = self.engine.generate(list(prompts.values()), params)
                seconds = (time.perf_counter() - started) / len(prompts)
                for i, completions in zip(prompts, results):
                    out[i] = self._score_group(problems[i], completions, seconds, tag)
            except Exception as err:  # the worker outlives a bad request; the controller sees why
                for i in prompts:
                    out[i] = ScoredGroup(problems[i], [], [], [], time.perf_counter() - started, error=f"{type(err).__name__}: {err}", tag=tag)
        return [out[i] for i in range(len(problems))]

    def _inject(self, completions: list[Completion]) -> list[Completion]:
        """Chaos: corrupt engine output on purpose (rates from ``chaos``)."""
        rng = self._chaos_rng
        if rng.random() < self.chaos.get("nan_logp_rate", 0.0):
            completions = [dataclasses.replace(c, rollout_logp=torch.full_like(c.rollout_logp, float("nan"))) for c in completions]
        return [
            dataclasses.replace(c, response_ids=c.response_ids[:0], rollout_logp=c.rollout_logp[:0], versions=c.versions[:0])
            if rng.random() < self.chaos.get("empty_response_rate", 0.0) else c
            for c in completions
        ]

    def _score_group(self, problem: Problem, completions: list[Completion], seconds: float, tag: str) -> ScoredGroup:
        if self.chaos:
            completions = self._inject(completions)
        if any(not torch.isfinite(c.rollout_logp).all() for c in completions):
            return ScoredGroup(problem, [], [], [], seconds, error="engine returned NaN or inf behaviour log-probs", tag=tag)
        texts = [self.engine.tokenizer.decode(c.response_ids, skip_special_tokens=True) for c in completions]
        rewards = [self._score(t, problem.ground_truth) for t in texts]
        return ScoredGroup(problem, completions, texts, rewards, seconds, tag=tag)

    def _score(self, text: str, truth: str) -> RewardResult:
        try:
            if self.chaos and self._chaos_rng.random() < self.chaos.get("reward_error_rate", 0.0):
                raise RuntimeError("chaos: injected reward failure")
            return self.reward(text, truth)
        except Exception as err:
            return RewardResult(0.0, None, f"error: {type(err).__name__}")
