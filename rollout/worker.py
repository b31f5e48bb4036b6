"""RolloutWorker: a Ray actor that turns admitted prompts into scored groups, asynchronously.

Thin around its parts, each testable without Ray: ``submit`` queues (ticket, problem, n) prompts in the
inbox (rollout/scheduler.py) and returns at once; a background thread takes the next engine call's
prompts from it, has the generator (rollout/generator.py) run them through the engine, has the
grader (rollout/grader.py) check and score every completion on a second thread, and appends the
finished ``Group`` records (rollout/records.py) to an outbox that ``poll`` drains. While one call's
groups are scored (a reward function, a reward service, a judge), the next call generates, and at
most one more call's wait for the scorer. Fault injection for tests goes
through rollout/chaos.py alone. ``update_weights`` stages a publication while generation runs; the
engine swaps it in between two decoding steps, so no request is dropped and a response spanning the
update records both versions. ``heartbeat`` reports liveness and progress. A bad prompt, a
generation or reward failure, or malformed engine output fails its own group (``error``), never the
worker.
"""

from __future__ import annotations

import itertools
import os
import queue
import threading
import time
from dataclasses import dataclass, field, replace

from cpu.allocator import keep_freed_memory
from rollout.chaos import Chaos
from rollout.config import RolloutConfig
from rollout.engine import Engine, EngineDied
from rollout.generator import Generated, Generator
from rollout.grader import Grader
from rollout.records import Group, Started, Ticket
from rollout.scheduler import Inbox
from rollout.tasks import Problem


@dataclass
class _Stats:
    groups: int = 0
    tokens: int = 0
    failures: int = 0
    last_step: float = field(default_factory=time.time)


class RolloutWorker:
    """Create with ``ray.remote(RolloutWorker)`` and ``build``'s arguments (the actor's constructor
    is ``build``: Ray constructs it in its own process); every method returns quickly."""

    def __init__(
        self, config: RolloutConfig, *, model_folder: str, worker_id: int = 0, topk_logprobs: int = 0, seed: int | None = None,
        eval_temperature: float | None = None, record_routing: bool = False,
    ):
        """Use ``build`` (or, as an actor, these arguments)."""
        RolloutConfig.expect(config, "RolloutWorker")
        self.worker_id = worker_id
        self.max_batch_prompts = config.max_batch_prompts
        self.max_eval_rows = config.max_eval_rows
        self.chaos = Chaos.build(config.chaos, worker_id=worker_id)
        if not config.gpus_per_worker:
            keep_freed_memory()  # an engine on the CPU reuses its freed buffers' pages (cpu/allocator.py)
        self.engine = Engine.build(config, model_folder=model_folder, topk_logprobs=topk_logprobs, record_routing=record_routing)
        self.generator = Generator.build(
            config, engine=self.engine, chaos=self.chaos, topk_logprobs=topk_logprobs, seed=seed, eval_temperature=eval_temperature,
        )
        self.grader = Grader.build(config, worker_id=worker_id, chaos=self.chaos)
        self._inbox = Inbox()
        self._calls = itertools.count()  # the inbox batches taken, for Group.call
        self._outbox: list[Group] = []
        self._started: list[Started] = []
        self._lock = threading.Lock()
        self._stats = _Stats()
        self._in_flight = 0
        self._receives = 0
        self._weight_loads = 0
        self.life = os.urandom(8).hex()
        """This process's own id: a heartbeat from a process the backend killed is not taken for its restart."""
        self._to_score: queue.Queue = queue.Queue(maxsize=1)
        """One engine call's generated groups waiting for the scoring thread (None: no more)."""
        self._scorer = threading.Thread(target=self._score_loop, name="rollout-scoring", daemon=True)
        self._scorer.start()
        self._thread = threading.Thread(target=self._loop, name="rollout", daemon=True)
        self._thread.start()

    @classmethod
    def build(
        cls, config: RolloutConfig, *, model_folder: str, worker_id: int = 0, topk_logprobs: int = 0, seed: int | None = None,
        eval_temperature: float | None = None, record_routing: bool = False,
    ) -> "RolloutWorker":
        """A worker in this process serving the HF model in ``model_folder`` with ``config``'s engine,
        sampling and scoring. From the rest of the run: ``worker_id`` (the index its records
        carry), ``topk_logprobs`` (what the objective needs of training groups), ``seed`` (the
        run's), ``eval_temperature`` (None: the training one), ``record_routing`` (MoE routing replay)."""
        return cls(config, model_folder=model_folder, worker_id=worker_id, topk_logprobs=topk_logprobs, seed=seed,
                   eval_temperature=eval_temperature, record_routing=record_routing)

    def submit(self, items: list[tuple[Ticket, Problem, int | None]]) -> int:
        """Queue (ticket, problem, n) prompts, each for n samples (None: the sampling's), together,
        so one engine call can take them all; returns the queue depth. Training prompts are
        generated before queued evaluation prompts, so an evaluation runs on rollout capacity the
        next training step does not need."""
        self._inbox.put([(ticket, problem, n or self.generator.sampling.n) for ticket, problem, n in items])
        return self._inbox.qsize()

    def reset(self) -> None:
        """Forget queued work and finished groups not yet collected (after the controller re-queued
        them elsewhere); a batch being generated still finishes and is reported."""
        self.cancel_queued()
        with self._lock:
            self._outbox, self._started = [], []

    def cancel_queued(self) -> list[Ticket]:
        """Take back every queued submission not yet started; returns their tickets."""
        return [ticket for ticket, _, _ in self._inbox.drain()]

    def poll(self, timeout_s: float = 0.0) -> tuple[list[Group], list[Started]]:
        """Finished groups and started submissions, waiting up to ``timeout_s`` for either. Raises
        EngineDied once the engine died (the backend then restarts this worker, with that text)."""
        deadline = time.time() + timeout_s
        while True:
            if self.generator.dead is not None:
                raise EngineDied(self.generator.dead)
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
        self._weight_loads += 1
        self.chaos.hang("hang_weight_load", self._weight_loads)
        self.engine.update_weights(buckets)
        return buckets[-1].version

    def join_weight_group(self, host: str, port: int, rank: int, world_size: int, timeout_s: float) -> None:
        """Join the learner's weight broadcast group as ``rank`` (called for every member at once)."""
        self.engine.join_weight_group(host, port, rank, world_size, timeout_s)

    def receive_weights(self) -> dict:
        """Receive one broadcast publication into the engine: {"version", "seconds"} or {"error"}
        (the worker then waits outside the group until it is formed again)."""
        started = time.perf_counter()
        self._receives += 1
        self.chaos.on_receive(self._receives)
        try:
            version = self.engine.receive_weights()
            self.chaos.after_receive(self._receives)
        except Exception as err:
            return {"error": f"{type(err).__name__}: {err}", "seconds": time.perf_counter() - started}
        return {"version": version, "seconds": time.perf_counter() - started}

    def weight_checksums(self) -> dict[str, str]:
        """Per HF tensor name, a checksum of the weights the engine serves (Engine.weight_checksums)."""
        return self.engine.weight_checksums()

    def heartbeat(self) -> dict:
        import ray

        node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
        with self._lock:
            return {
                "node_id": node,
                "alive": self._thread.is_alive() and self._scorer.is_alive(),  # a dead scorer would hold every call
                "version": self.engine.version, "queue_depth": self._inbox.qsize(),
                "in_flight": self._in_flight, "groups": self._stats.groups, "tokens": self._stats.tokens,
                "failures": self._stats.failures, "last_step_time": self._stats.last_step, "life": self.life,
                "engine_call_seconds": self.generator.call_seconds(),
            }

    def shutdown(self, timeout_s: float = 10.0, keep_engine: bool = False) -> bool:
        """Stop taking work, let the engine call in flight end (up to ``timeout_s``), then close the
        engine (its processes and staging folders) and the reward's verifier. Returns whether the
        generation and scoring threads ended (a hung engine call keeps them). ``keep_engine``: in a
        worker host process (learner/actor_pool.py) an engine that can serve another run
        (``Engine.renewable``) is left to the next worker built in this process instead, when the
        threads ended and the engine did not die."""
        self._inbox.close()
        deadline = time.time() + timeout_s
        self._thread.join(timeout=timeout_s)
        self._scorer.join(timeout=max(0.0, deadline - time.time()))
        ended = not self._thread.is_alive() and not self._scorer.is_alive()
        kept = False
        if keep_engine and ended and self.engine.renewable and not self.engine.ended_processes():
            from learner.actor_pool import stash  # False outside a worker host process

            kept = stash(self.engine.build_key, self.engine, self.engine.close)
        for part in [self.grader] if kept else [self.engine, self.grader]:
            close = getattr(part, "close", None)
            if close is not None:
                try:
                    close()
                except Exception as err:  # shutting down: say so, and close the rest
                    print(f"rollout worker {self.worker_id}: closing {type(part).__name__} failed: {type(err).__name__}: {err}", flush=True)
        return ended

    def _loop(self) -> None:
        rows = self.max_batch_prompts * self.generator.sampling.n  # a training call's rows
        while True:
            batch = self._inbox.take(rows, self.max_eval_rows)
            if batch is None:
                self._to_score.put(None)
                return
            version = self.engine.version
            with self._lock:
                self._in_flight += len(batch)
                self._started += [Started(ticket, self.worker_id, version) for ticket, _, _ in batch]
            generated = self.generator.generate(batch)
            if self.generator.dead is not None:
                self._to_score.put(None)
                return  # nothing more runs here: poll reports the death, the backend restarts the worker
            call = (self.worker_id, os.getpid(), next(self._calls))
            self._to_score.put((generated, version, len(batch), call))  # waits while the previous call is still being scored

    def _score_loop(self) -> None:
        while True:
            item = self._to_score.get()
            if item is None:
                return
            generated, version, prompts, call = item
            groups = self.chaos.lose([replace(self._graded(g, version), call=call) for g in generated])
            with self._lock:
                self._in_flight -= prompts
                self._outbox.extend(groups)
                self._stats.groups += len(groups)
                self._stats.failures += sum(g.error is not None for g in groups)
                self._stats.tokens += sum(g.tokens for g in groups)
                self._stats.last_step = time.time()

    def _graded(self, g: Generated, version: int) -> Group:
        if g.error is not None:
            return Group(g.ticket, self.worker_id, (), version, g.seconds, error=g.error)
        return self.grader.grade(g.ticket, g.problem, g.completions, g.texts, version, g.seconds, g.topk)
