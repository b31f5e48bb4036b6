"""The Controller: one training run's schedule, over a real or a simulated backend.

    prompts ──admit──▶ rollout workers ──groups──▶ score/filter ──▶ buffer ──train──▶ learner
       ▲      (staleness gate: started ≤ (η+v+1)·B)                    (oldest first)       │
       └──────────── ledger ◀── outcomes                        workers ◀──publish v+1──────┘

sync mode is η = 0 with a blocking publication (generate, then train, on-policy); async lets
rollouts run up to η versions ahead. Over-bound samples are waited for (a step is held until every
rollout that would expire after it has finished) or dropped at consumption; either way
``StalenessManager.check`` raises if one ever reaches the learner.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import objectives
from controller import checkpoints
from controller.backend import Backend, Events, TrainResult
from controller.batch_builder import Batch, BatchBuilder
from controller.config import RunConfig, dump
from controller.eval_metrics import engine_calls, set_summary
from controller.ledger import Ledger, PromptSampler
from controller.staleness import StalenessManager
from controller.stop import StopRequest
from controller.telemetry import StepReport, Telemetry
from controller.watchdog import Watchdog, stall_account
from rollout.records import EvalTicket, Group, TrainTicket
from rollout.scheduler import Submission
from rollout.tasks import Problem


class RolloutsFailing(RuntimeError):
    """Every rollout failed for ``train.max_failures_in_a_row`` groups or ``train.max_failing_seconds``;
    the message names the first failure's cause (the root cause; later ones often follow from it)."""


@dataclass
class _Flight:
    worker: int
    started: int | None = None
    """The version the worker served when it began this group (None while queued)."""
    admitted: float = 0.0
    """When it was submitted (the backend's clock)."""


@dataclass
class _Eval:
    version: int
    expected: int
    began: float
    """When the round was submitted (the backend's clock): its record's ``seconds`` count from here."""
    results: list[Group] = field(default_factory=list)
    cancelled: int = 0
    """Prompts taken back unstarted because the run was stopped: the round is then incomplete."""


@dataclass
class _Step:
    """The training step in progress: the groups it consumes and the batch built from them."""

    groups: list[Group]
    batch: Batch
    began: float = 0.0


class Controller:
    def __init__(
        self, cfg: RunConfig, backend: Backend, train: list[Problem], evals: dict[str, list[Problem]], telemetry: Telemetry,
        stop: StopRequest | None = None,
    ):
        """Use ``build``."""
        self.cfg, self.backend, self.telemetry = cfg, backend, telemetry
        self.stop = stop or StopRequest()
        self.problems = {p.id: p for p in train}
        self.eval_sets = {name: list(ps) for name, ps in evals.items() if ps}
        self.eval_problems = {(name, p.id): p for name, ps in self.eval_sets.items() for p in ps}
        for name, ps in self.eval_sets.items():
            ids = [p.id for p in ps]
            if len(set(ids)) != len(ids):
                dup = sorted({i for i in ids if ids.count(i) > 1})
                raise ValueError(f"eval set {name!r} has repeated problem ids ({', '.join(dup[:5])}); evaluation results are matched by id")
        self.evaluates = bool(self.eval_sets)  # False: no eval set, nothing to evaluate
        """Whether there is anything to evaluate."""
        self.step = self.version = 0
        self.batch_size = cfg.train.prompts_per_step
        self.staleness = StalenessManager(
            cfg.train.max_staleness, self.batch_size, lambda: self.version,
            serving_version=lambda: min(
                (backend.worker_version(w) for w in range(backend.workers) if backend.available(w)), default=self.version
            ),
            surplus=math.ceil(round((cfg.train.oversample - 1) * self.batch_size, 9)),
        )
        self.builder = BatchBuilder.build(cfg.advantages, topk=objectives.required_topk(cfg.learner.objective))
        self.sampler = PromptSampler([p.id for p in train], cfg.seed)
        self.ledger = Ledger()
        self.in_flight: dict[TrainTicket, _Flight] = {}
        self.drawn: dict[TrainTicket, int] = {}
        """Each admitted training prompt's place in the draw: over-sampling keeps the batch's first-drawn
        groups, not the first finished (short responses finish first)."""
        self.draws = 0
        self.buffer: list[Group] = []
        self.training: _Step | None = None
        self.load = [0] * backend.workers
        self.evals: dict[int, _Eval] = {}
        self.eval_rounds = 0
        self.eval_history: list[dict] = []
        self.failures_in_a_row = self.filtered_in_a_row = 0
        self.failing_since, self.first_in_streak = 0.0, ""
        self.first_failures: dict[int, str] = {}
        """Each worker's first failed group's error (reported once)."""
        self.eval_waiting: list[EvalTicket] = []
        """Evaluation prompts of a lost worker that wait for a live one (every worker was restarting)."""
        self.eval_pending: dict[EvalTicket, int] = {}
        """Evaluation submissions without a result yet, and the worker each went to."""
        self.checkpointed = 0
        """The step of the newest checkpoint (0: none, nothing trained yet)."""
        self.abandoned = False
        """Whether a stop abandoned a step in flight (the run then resumes from ``checkpointed``)."""
        self.watchdog = Watchdog(cfg.train.stall_report_seconds, cfg.train.stall_fail_seconds, backend.now())

    # ---- the loop -----------------------------------------------------------------------------------

    @classmethod
    def build(
        cls, config: RunConfig, *, backend: Backend, train: list[Problem], evals: dict[str, list[Problem]], telemetry: Telemetry,
        stop: StopRequest | None = None,
    ) -> "Controller":
        """The loop of the run ``config`` describes, over ``backend`` (Ray or simulated), sampling
        prompts from ``train``; ``evals``: the eval sets by name, the one ``accuracy`` reports first;
        ``stop``: polled between events; once requested, ``run`` winds down (see ``wind_down``)."""
        RunConfig.expect(config, "Controller")
        return cls(config, backend, train, evals, telemetry, stop)

    def run(self) -> None:
        """admit → generate → score → train → publish → evaluate → checkpoint, until the last step
        (or a stop is requested: then ``wind_down``)."""
        self.stop.graceful = True
        self.watchdog.progress(self.backend.now())
        if self.cfg.eval.at_start and self.step == 0 and self.evaluates:
            began = self.backend.now()
            self.evaluate(blocking=True)
            self.telemetry.startup_phase(first_eval_seconds=self.backend.now() - began)
        self.telemetry.startup_done()
        while self.step < self.cfg.train.steps and not self.stop.requested:
            self.admit()
            self.handle(self.backend.wait())
            self.maybe_train()
        self.requeue_unstarted()
        if self.stop.requested:
            self.wind_down()
            return
        if self.evaluates:
            self.evaluate(blocking=True)
        self.checkpoint()

    # ---- admission and scoring ----------------------------------------------------------------------

    def admit(self) -> None:
        live = [w for w in range(len(self.load)) if self.backend.available(w)]
        quota = self._round_quota()
        admitted: dict[int, list[Submission]] = {}
        while live and quota != 0 and self.staleness.try_admit() is not None:
            quota -= 1
            ticket = self.sampler.next()
            worker = min(live, key=self.load.__getitem__)
            self.load[worker] += 1
            self.in_flight[ticket] = _Flight(worker, admitted=self.backend.now())
            self.drawn[ticket] = self.draws
            self.draws += 1
            admitted.setdefault(worker, []).append((ticket, self.problems[ticket.id], self.cfg.rollout.samples_per_prompt))
        self._submit(admitted)

    def _submit(self, per_worker: dict[int, list[Submission]]) -> None:
        """One submission per worker of everything admitted at once: its engine sees them all
        queued together and generates them in one call, not the first alone."""
        for worker, items in per_worker.items():
            self.backend.submit(worker, items)

    def _round_quota(self) -> int:
        """Prompts this admission may start; -1: as many as the staleness bound allows. Sync
        over-sampling (train.oversample > 1) runs in rounds: nothing while a round or a step is in
        flight, then ceil(oversample x the groups the batch lacks) at once."""
        if self.cfg.train.oversample == 1:
            return -1
        if self.in_flight or self.training is not None:
            return 0
        return math.ceil(round(self.cfg.train.oversample * max(0, self.batch_size - len(self.buffer)), 9))

    def handle(self, events: Events) -> None:
        for worker in events.lost:
            self.worker_lost(worker)
            self.telemetry.worker_event("lost", worker, None, events.why.get(worker))
        for worker in events.revived:
            self.telemetry.worker_event("back", worker, self.backend.worker_version(worker))
        if events.revived and self.eval_waiting:  # evaluation prompts that waited for a live worker
            waiting, self.eval_waiting = self.eval_waiting, []
            self._submit_evals(waiting)
        for s in events.started:
            flight = self.in_flight.get(s.ticket) if isinstance(s.ticket, TrainTicket) else None
            if flight is not None:
                flight.started = s.version
        self.score(events.groups)
        if events.trained is not None:
            self.finish_step(events.trained)
        stall = self.watchdog.check(self.backend.now(), lambda: stall_account(self))
        if stall is not None:
            self.telemetry.stall(stall)

    def worker_lost(self, worker: int) -> None:
        """Re-queue what a dead worker held: its training prompts go back to the sampler (drawn
        first), its evaluation prompts to the other workers. Nothing it held has an outcome yet."""
        tickets = [t for t, f in self.in_flight.items() if f.worker == worker]
        for ticket in tickets:
            del self.in_flight[ticket]
            self.staleness.on_cancelled()
        self.sampler.requeue(tickets)
        self.load[worker] = 0
        self._submit_evals([t for t, w in self.eval_pending.items() if w == worker])

    def _start_bound(self, flight: _Flight) -> int:
        """A lower bound on the version of a running group's oldest token: the version it started
        under, or for one still queued, the version its worker serves now (it can only go up)."""
        return flight.started if flight.started is not None else self.backend.worker_version(flight.worker)

    def score(self, groups: list[Group]) -> None:
        for g in groups:
            if isinstance(g.ticket, EvalTicket):
                self._eval_result(g)
                continue
            flight = self.in_flight.get(g.ticket)
            if flight is None or flight.worker != g.worker:
                continue  # from a worker declared lost whose work was re-queued: the re-run counts, not this
            del self.in_flight[g.ticket]
            self.load[flight.worker] -= 1
            self.telemetry.group(g)
            if g.error is not None:
                self.staleness.on_rejected()
                self.ledger.record(g.ticket, "failed", self.step, reason=g.error)
                self._count_failure(g.worker, g.error)
                continue
            self.failures_in_a_row = 0
            reason = self.builder.rejects(g)
            if reason is None:
                self.filtered_in_a_row = 0
                self.staleness.on_accepted()
                self.buffer.append(g)
                continue
            self.staleness.on_rejected()
            self.ledger.record(g.ticket, "filtered", self.step, reason=reason)
            self.filtered_in_a_row += 1
            if self.filtered_in_a_row >= self.cfg.train.max_filtered_in_a_row:
                raise RuntimeError(
                    f"{self.filtered_in_a_row} groups in a row were filtered (last: {reason}); the task gives "
                    "no learning signal at this accuracy (raise train.max_filtered_in_a_row or change the task)"
                )

    def _count_failure(self, worker: int, error: str) -> None:
        """A failed group: its worker's first failure is reported (console and metrics.jsonl); a run
        whose every group fails stops, with the first failure's text."""
        if worker not in self.first_failures:
            self.first_failures[worker] = error
            self.telemetry.worker_error(worker, error)
        if self.failures_in_a_row == 0:
            self.failing_since, self.first_in_streak = self.backend.now(), error
        self.failures_in_a_row += 1
        failing = self.backend.now() - self.failing_since
        limits = self.cfg.train
        if self.failures_in_a_row >= limits.max_failures_in_a_row or (self.failures_in_a_row > 1 and failing >= limits.max_failing_seconds):
            raise RolloutsFailing(
                f"every rollout failed: {self.failures_in_a_row} groups in a row over {failing:.0f} s (train.max_failures_in_a_row="
                f"{limits.max_failures_in_a_row}, train.max_failing_seconds={limits.max_failing_seconds:g}). The first failed with: "
                f"{self.first_in_streak}"
            )

    # ---- training -----------------------------------------------------------------------------------

    def maybe_train(self) -> None:
        """Start a step on the B oldest buffered groups, once nothing older is still running."""
        if self.training is not None or self.step >= self.cfg.train.steps:
            return
        expiring = self.version - self.cfg.train.max_staleness
        if self.cfg.train.over_bound == "wait" and any(self._start_bound(f) <= expiring for f in self.in_flight.values()):
            return
        for g in [g for g in self.buffer if not self.staleness.is_fresh(g.oldest_version)]:
            self.buffer.remove(g)
            self.staleness.on_dropped()
            self.ledger.record(g.ticket, "stale", self.step, reason=f"sampled at version {g.oldest_version}, learner at {self.version}")
        if len(self.buffer) < self.batch_size:
            return
        oversampled = self.cfg.train.oversample > 1
        self.buffer.sort(key=lambda g: (g.oldest_version, self.drawn.get(g.ticket, 0) if oversampled else 0))
        chosen, self.buffer = self.buffer[: self.batch_size], self.buffer[self.batch_size :]
        self.drawn = {t: i for t, i in self.drawn.items() if t in self.in_flight}  # the buffer is dropped below when oversampled
        if oversampled:  # sync over-sampling: what the batch does not take would be stale next version
            for g in self.buffer:
                self.staleness.on_dropped()
                self.ledger.record(g.ticket, "surplus", self.step, reason=f"over-sampled: the batch took {self.batch_size} groups")
            self.buffer = []
        batch = self.builder.batch(chosen, self.version)
        for lag in batch.lags:
            self.staleness.check(lag)
        self.training = _Step(chosen, batch, self.backend.now())
        self.backend.train(batch.train)

    def finish_step(self, result: TrainResult) -> None:
        done, self.training = self.training, None
        if result.version != self.version + 1:
            raise RuntimeError(f"the learner reports version {result.version} after a step from version {self.version}")
        self.step += 1
        self.watchdog.progress(self.backend.now())
        for g, lag in zip(done.groups, done.batch.lags):
            self.ledger.record(g.ticket, "trained", self.step, lag=lag)
        self.version = result.version
        published = self.backend.publish(self.version, wait=self.cfg.train.mode == "sync")
        stats = self.staleness.stats()
        self.telemetry.rollouts(self.step, done.groups)
        self.telemetry.step(StepReport(
            step=self.step, version=self.version, result=result, rewards=[r for g in done.groups for r in g.rewards],
            scores=[s for g in done.groups for s in g.scores], reasons=[s.reward.reason for g in done.groups for s in g.samples],
            response_tokens=[len(s.completion.response_ids) for g in done.groups for s in g.samples],
            truncated=[s.completion.finish_reason == "length" for g in done.groups for s in g.samples],
            lags=done.batch.lags, batch_metrics=done.batch.metrics, published=published, staleness=stats,
            max_staleness=self.cfg.train.max_staleness, queue_depth=sum(self.load), buffered=len(self.buffer),
            ledger=self.ledger.counts(),
        ))
        if self.stop.requested:
            return  # wind_down checkpoints; no evaluation on the way out
        if self.cfg.eval.every and self.step % self.cfg.eval.every == 0 and self.step < self.cfg.train.steps and self.evaluates:
            self.evaluate(blocking=not self.cfg.eval.concurrent)
        if self.cfg.checkpoint.every and self.step % self.cfg.checkpoint.every == 0 and self.step < self.cfg.train.steps:
            self.checkpoint()

    # ---- evaluation ---------------------------------------------------------------------------------

    def evaluate(self, blocking: bool) -> None:
        """Evaluate the served weights on every eval set: ``eval.samples_per_prompt`` sampled
        responses per prompt, and one greedy response more with ``eval.greedy``."""
        rnd = self.eval_rounds
        self.eval_rounds += 1
        modes = (False, True) if self.cfg.eval.greedy else (False,)
        # every set's sampled prompts, then every set's greedy ones: a worker's engine call takes a
        # run of queued prompts with one decoding, so the sets share calls
        tickets = [EvalTicket(rnd, p.id, name, greedy) for greedy in modes for name, ps in self.eval_sets.items() for p in ps]
        self.evals[rnd] = _Eval(self.version, len(tickets), self.backend.now())
        self._submit_evals(tickets)
        while blocking and rnd in self.evals and not self.stop.requested:
            self.handle(self.backend.wait())

    def _submit_evals(self, tickets: list[EvalTicket]) -> None:
        """Spread evaluation prompts over the live workers, each to the one with the fewest pending."""
        live = [w for w in range(self.backend.workers) if self.backend.available(w)]
        if not live:  # every worker is restarting: a submission now would be dropped by its restart's reset
            self.eval_waiting += tickets
            return
        queued = [0] * self.backend.workers
        for w in self.eval_pending.values():
            queued[w] += 1
        per_worker: dict[int, list[Submission]] = {}
        for ticket in tickets:
            worker = min(live, key=queued.__getitem__)
            queued[worker] += 1
            self.eval_pending[ticket] = worker
            n = 1 if ticket.greedy else self.cfg.eval.samples_per_prompt
            per_worker.setdefault(worker, []).append((ticket, self.eval_problems[(ticket.set, ticket.id)], n))
        self._submit(per_worker)

    def _eval_result(self, g: Group | None, rnd: int | None = None) -> None:
        """Record an evaluation group (the first to arrive for its ticket), or with ``g`` None only
        close round ``rnd`` if nothing else is outstanding."""
        if g is not None:
            if self.eval_pending.pop(g.ticket, None) is None:
                return  # a late duplicate of a re-submitted evaluation prompt
            rnd = g.ticket.round
            self.evals[rnd].results.append(g)
        ev = self.evals[rnd]
        if len(ev.results) < ev.expected:
            return
        del self.evals[rnd]
        if ev.cancelled:  # cut short by a stop: not a result (the summary and the next resume never see it)
            self.telemetry.evaluation_cancelled({"round": rnd, "step": self.step, "version": ev.version, "answered": len(ev.results),
                                                 "cancelled": ev.cancelled})
            return
        versions = [res.oldest_version for res in ev.results if res.oldest_version is not None]
        sets = {name: set_summary([g for g in ev.results if g.ticket.set == name], self.cfg.eval.pass_k) for name in self.eval_sets}
        first = sets[next(iter(sets))]
        record = {
            "round": rnd, "step": self.step, "version": ev.version, "accuracy": first["mean_at_k"], "samples": first["samples"],
            "prompts": first["prompts"], "failed": first["failed"], "min_version": min(versions, default=None),
            "seconds": self.backend.now() - ev.began, "engine_calls": engine_calls(ev.results), "sets": sets,
        }
        self.eval_history.append(record)
        self.telemetry.evaluation(record)
        self.watchdog.progress(self.backend.now())

    # ---- checkpoints --------------------------------------------------------------------------------

    def requeue_unstarted(self) -> None:
        """Take back queued submissions so the run can stop without waiting for them."""
        for ticket in self.backend.cancel_queued():
            if isinstance(ticket, TrainTicket):
                flight = self.in_flight.pop(ticket)
                self.load[flight.worker] -= 1
                self.staleness.on_cancelled()
                self.sampler.requeue([ticket])
            elif self.eval_pending.pop(ticket, None) is not None:
                self.evals[ticket.round].expected -= 1
                self.evals[ticket.round].cancelled += 1
                self._eval_result(None, ticket.round)

    def wind_down(self) -> None:
        """After a stop request: let the step in flight finish (up to ``train.stop_grace_seconds``;
        rollouts still running are not waited for, their prompts are re-queued by the checkpoint),
        then checkpoint unless the newest checkpoint is of this step. A step that does not finish in
        time is abandoned: nothing is saved and the run resumes from its newest checkpoint."""
        deadline = self.backend.now() + self.cfg.train.stop_grace_seconds
        while self.training is not None and self.backend.now() < deadline:
            self.handle(self.backend.wait())
        self.abandoned = self.training is not None
        if not self.abandoned and self.step != self.checkpointed:
            self.checkpoint()
        self.telemetry.stopped(self.stop.name, self.step, self.checkpointed, self.abandoned)

    def checkpoint(self) -> Path:
        """Write ``checkpoints/step-N`` (controller/checkpoints.py): the learner's state and the controller's.

        Buffered and in-flight groups are not saved: their prompts are re-queued (drawn first on
        resume), since none was trained on. Admission counters are saved as trained-only, so a
        resumed run admits exactly what a run at this step boundary would (no burst)."""
        from controller.run_folder import check_held, discard_aside

        check_held(self.cfg.run_dir)  # never write over another driver's run
        pending = sorted(self.in_flight, key=lambda t: self._start_bound(self.in_flight[t])) + [g.ticket for g in self.buffer]
        state = {
            "step": self.step, "version": self.version, "sampler": self.sampler.state_dict(pending),
            "ledger": self.ledger.state_dict(), "eval_history": self.eval_history, "eval_rounds": self.eval_rounds,
            "staleness": self.staleness.state_dict(requeued=len(self.buffer)),
        }
        final = checkpoints.write(self.cfg.run_dir, self.step, lambda folder: self.backend.save(str(folder)), state, dump(self.cfg),
                                  keep=self.cfg.checkpoint.keep)
        self.checkpointed = self.step
        discard_aside(self.cfg.run_dir)  # an --overwrite's old run goes once this run has a checkpoint
        self.telemetry.checkpoint(final)
        return final

    def restore(self, folder: Path) -> None:
        """Continue from a checkpoint written by ``checkpoint`` (before anything is admitted)."""
        state = checkpoints.read_state(folder)
        self.step, self.version = int(state["step"]), int(state["version"])
        self.sampler.load_state_dict(state["sampler"])
        self.ledger.load_state_dict(state["ledger"])
        self.staleness.load_state_dict(state["staleness"])
        self.eval_history, self.eval_rounds = list(state["eval_history"]), int(state["eval_rounds"])
        self.checkpointed = self.step
        self.backend.load(str(folder), self.version)
