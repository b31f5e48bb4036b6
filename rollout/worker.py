"""RolloutWorker: a Ray actor that turns admitted prompts into scored groups, asynchronously.

Thin around its parts: ``submit`` queues (ticket, problem) pairs in the inbox (rollout/scheduler.py)
and returns at once; a background thread takes the next engine call's prompts from it, generates
their groups of n samples with the engine, has the grader (rollout/grader.py) check and score every
completion, and appends the finished ``Group`` records (rollout/records.py) to an outbox that
``poll`` drains. Fault injection for tests goes through rollout/chaos.py alone.
``update_weights`` stages a publication while generation runs; the engine swaps it in between two
decoding steps, so no request is dropped and a response spanning the update records both versions.
``heartbeat`` reports liveness and progress. A bad prompt, a generation or reward failure, or
malformed engine output fails its own group (``error``), never the worker.
"""

from __future__ import annotations

import dataclasses
import os
import re
import threading
import time
from dataclasses import dataclass, field

from rollout.chaos import Chaos
from rollout.engine import EngineDied, EndedProcess, SamplingParams, make_engine, mix_seed
from rollout.grader import Grader
from rollout.records import EvalTicket, Group, Started, Ticket
from rollout.scheduler import Inbox, Submission
from rollout.tasks import Problem


@dataclass
class _Stats:
    groups: int = 0
    tokens: int = 0
    failures: int = 0
    last_step: float = field(default_factory=time.time)


_ERROR_LINE_RE = re.compile(r"(?:^|\] )([A-Za-z_][\w.]*(?:Error|Exception)): (.+)$")
POINTERS = ("stack trace (above)", "stack trace above", "EngineDeadError")
"""Error lines that only point elsewhere (vLLM's "See stack trace (above) for the root cause")."""


def _root_cause_in_own_log(max_bytes: int = 262_144, max_lines: int = 400) -> str | None:
    """The first error line (``SomeError: text``) among the recent lines of this process's own
    stdout and stderr files, which an engine's child processes share (Ray writes them to the
    worker's log files): where vLLM's EngineCore writes the exception that killed it, while the
    EngineDeadError raised here only says "see the stack trace above"."""
    for fd in (1, 2):
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
            size = os.path.getsize(path)
            with open(path, "rb") as f:
                f.seek(max(0, size - max_bytes))
                lines = f.read().decode("utf-8", "replace").splitlines()[-max_lines:]
        except OSError:
            continue
        for line in lines:
            m = _ERROR_LINE_RE.search(line.strip())
            if m and not any(p in line for p in POINTERS):
                return f"{m.group(1).rsplit('.', 1)[-1]}: {m.group(2)}"
    return None


def _cause(err: BaseException, ended: list[EndedProcess] = ()) -> str:
    """An engine error for a person: its type and message and, when it only points at a stack trace
    nobody sees, what the engine's processes say: one killed by a signal (``ended``), else the
    root cause its engine process wrote to the worker's log, else which ended and how; then the
    last frames of its traceback."""
    import traceback

    frames = [f for f in traceback.format_exception(type(err), err, err.__traceback__)[:-1] if not f.startswith("Traceback")]
    tail = " | ".join(" ".join(f.split()) for f in frames[-3:])
    text = f"{type(err).__name__}: {err}"
    if any(p in text for p in POINTERS):
        killed = [e.text for e in ended if e.killed]
        root = None if killed else _root_cause_in_own_log()  # a kill from outside wrote no error: older log lines are not its cause
        if killed:
            text = (f"{' and '.join(killed)} (from outside the engine: a signal, or the kernel's out-of-memory killer, which "
                    f"`dmesg` on that node names); the engine raised {text}")
        elif root:
            text = f"{root} (the engine process's error; it raised {text})"
        elif ended:
            text = f"{' and '.join(e.text for e in ended)} without writing an error to the worker's log; the engine raised {text}"
    return text + (f" (at: {tail})" if tail else "")


class RolloutWorker:
    """Create with ``ray.remote(RolloutWorker)``; every method returns quickly."""

    def __init__(
        self, model_folder: str, sampling: dict, reward: str = "literal", precision: str = "fp32", engine: str = "hf",
        max_batch_prompts: int = 1, max_prompt_tokens: int | None = None, chaos: dict | None = None, worker_id: int = 0,
        eval_sampling: dict | None = None, scoring: dict | None = None, **engine_kwargs,
    ):
        """``sampling``: SamplingParams fields (``topk_logprobs`` applies to training groups only);
        ``max_batch_prompts``: queued training prompts generated together in one engine
        call (more rows per decoding step); evaluation prompts fill as many rows (max_batch_prompts
        x n of them at one sample each); ``max_prompt_tokens``: longer prompts fail their group;
        ``chaos``: fault-injection rates (rollout.config.ChaosConfig), for tests; ``worker_id``:
        the index its records carry; ``eval_sampling``: SamplingParams fields that differ for
        evaluation groups (temperature); ``scoring``: rollout.config.ScoringConfig fields."""
        self.engine = make_engine(engine, model_folder, precision, **engine_kwargs)
        self.sampling = SamplingParams(**sampling)
        self.eval_sampling = dataclasses.replace(self.sampling, topk_logprobs=0, **(eval_sampling or {}))
        self.worker_id = worker_id
        self.max_batch_prompts, self.max_prompt_tokens = max_batch_prompts, max_prompt_tokens
        self.chaos = Chaos(chaos, worker_id)
        self.grader = Grader(reward, scoring or {}, self.sampling.max_new_tokens, worker_id, self.chaos)
        self._inbox = Inbox()
        self._outbox: list[Group] = []
        self._started: list[Started] = []
        self._lock = threading.Lock()
        self._stats = _Stats()
        self._in_flight = 0
        self._receives = 0
        self._engine_calls = self._weight_loads = 0
        self._engine_call_began: float | None = None
        """When the engine call running now began (time.monotonic), or None between calls."""
        self._dead: str | None = None
        """Why the engine died (its error and the end of its traceback), once it has."""
        self.life = os.urandom(8).hex()
        """This process's own id: a heartbeat from a process the backend killed is not taken for its restart."""
        self._thread = threading.Thread(target=self._loop, name="rollout", daemon=True)
        self._thread.start()

    def submit(self, ticket: Ticket, problem: Problem, n: int | None = None) -> int:
        """Queue one problem for ``n`` samples (default the sampling's) under ``ticket``; returns the
        queue depth. Training prompts are generated before queued evaluation prompts, so an
        evaluation runs on rollout capacity the next training step does not need."""
        self._inbox.put((ticket, problem, n or self.sampling.n))
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
            if self._dead is not None:
                raise EngineDied(self._dead)
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
                "alive": self._thread.is_alive(), "version": self.engine.version, "queue_depth": self._inbox.qsize(),
                "in_flight": self._in_flight, "groups": self._stats.groups, "tokens": self._stats.tokens,
                "failures": self._stats.failures, "last_step_time": self._stats.last_step, "life": self.life,
                "engine_call_seconds": None if self._engine_call_began is None else time.monotonic() - self._engine_call_began,
            }

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop taking work, let the engine call in flight end (up to ``timeout_s``), then close the
        engine (its processes and staging folders) and the reward's verifier."""
        self._inbox.close()
        self._thread.join(timeout=timeout_s)
        for part in (self.engine, self.grader):
            close = getattr(part, "close", None)
            if close is not None:
                try:
                    close()
                except Exception as err:  # shutting down: say so, and close the rest
                    print(f"rollout worker {self.worker_id}: closing {type(part).__name__} failed: {type(err).__name__}: {err}", flush=True)

    def _loop(self) -> None:
        rows = self.max_batch_prompts * self.sampling.n  # an engine call's rows: evaluation (n = 1) batches more prompts
        while True:
            batch = self._inbox.take(lambda n: max(1, rows // n))
            if batch is None:
                return
            version = self.engine.version
            with self._lock:
                self._in_flight += len(batch)
                self._started += [Started(ticket, self.worker_id, version) for ticket, _, _ in batch]
            groups = self.chaos.lose(self._generate(batch, version))
            if self._dead is not None:
                return  # nothing more runs here: poll reports the death, the backend restarts the worker
            with self._lock:
                self._in_flight -= len(batch)
                self._outbox.extend(groups)
                self._stats.groups += len(groups)
                self._stats.failures += sum(g.error is not None for g in groups)
                self._stats.tokens += sum(g.tokens for g in groups)
                self._stats.last_step = time.time()

    def _prompt_ids(self, problem: Problem) -> list[int]:
        if not problem.prompt.strip():
            raise ValueError("empty prompt")
        ids = self.engine.chat_prompt(problem.prompt)
        if self.max_prompt_tokens is not None and len(ids) > self.max_prompt_tokens:
            raise ValueError(f"prompt has {len(ids)} tokens, more than max_prompt_tokens={self.max_prompt_tokens}")
        return ids

    def _params(self, tickets: list[Ticket], n: int) -> SamplingParams:
        """The sampling of one engine call, with its n: evaluation has its own (no top-K log-probs).
        With a seed (the run's), each prompt's seed is derived from it and the prompt's ticket (epoch
        and problem id): runs with the same seed make the same random draws for the same draw of a
        prompt, however the prompts were batched (the logits themselves can differ slightly with
        padding and batch size)."""
        base = self.eval_sampling if isinstance(tickets[0], EvalTicket) else self.sampling
        if getattr(tickets[0], "greedy", False):
            base = dataclasses.replace(base, greedy=True)
        seeds = None if base.seed is None else tuple(mix_seed(base.seed, repr(t)) for t in tickets)
        return dataclasses.replace(base, n=n, prompt_seeds=seeds)

    def _generate(self, batch: list[Submission], version: int) -> list[Group]:
        """Groups in submission order; a bad prompt fails its own group only."""
        started = time.perf_counter()
        out: dict[int, Group] = {}
        prompts = {}
        for i, (ticket, problem, _) in enumerate(batch):
            try:
                prompts[i] = self._prompt_ids(problem)
            except Exception as err:
                reason = str(err) if str(err) == "empty prompt" else f"{type(err).__name__}: {err}"
                out[i] = Group(ticket, self.worker_id, (), version, 0.0, error=reason)
        if prompts:
            _, _, n = batch[next(iter(prompts))]
            params = self._params([batch[i][0] for i in prompts], n)
            self._engine_calls += 1
            self._engine_call_began = time.monotonic()
            try:
                self.chaos.before_generate(self.engine, self._engine_calls)
                results = self.engine.generate(list(prompts.values()), params)
            except Exception as err:  # the worker outlives a bad request; the controller sees why
                self._engine_call_began = None
                if self.engine.is_dead(err):  # not this request's fault: the worker must restart
                    try:
                        ended = self.engine.ended_processes()
                    except Exception:  # noqa: BLE001 - describing the death must not stop the restart
                        ended = []
                    self._dead = _cause(err, ended)
                    return []  # its groups are re-queued with the worker's work
                seconds = time.perf_counter() - started
                for i in prompts:
                    out[i] = Group(batch[i][0], self.worker_id, (), version, seconds, error=f"{type(err).__name__}: {err}")
            else:
                self._engine_call_began = None  # scoring is not the engine's time
                seconds = (time.perf_counter() - started) / len(prompts)
                for i, completions in zip(prompts, results):
                    out[i] = self.grader.grade(batch[i][0], batch[i][1], completions, version, seconds, params.topk_logprobs, self._decode)
        return [out[i] for i in range(len(batch))]

    def _decode(self, ids) -> str:
        return self.engine.tokenizer.decode(ids, skip_special_tokens=True)
