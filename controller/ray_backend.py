"""The real backend: RolloutWorker actors and a LearnerGroup on a Ray cluster.

Rollout workers sit in a placement group of their own (one bundle each, SPREAD across nodes); the
learner group places itself (PACK). Finished groups come back through one long-poll ``poll`` per
worker, waited on together with the running training step, so one ``ray.wait`` serves hundreds of
workers. Publications go through the object store; every worker swaps them in between two decoding
steps, and the backend learns which version a worker serves when its ``update_weights`` returns.
"""

from __future__ import annotations

import sys
import time

import ray
from ray.exceptions import ActorDiedError, RayActorError

import objectives
from controller.backend import Backend, DeadlineExceeded, Events, LearnerLost, PublishReport, TrainResult, WorkersGone
from controller.broadcast_sync import BROADCAST_ATTEMPTS, BroadcastSync
from controller.config import RunConfig
from learner import actor_pool
from learner.batch import TrainBatch
from learner.group import LearnerGroup, LearnerTimeout, late_refs
from learner.host import check_host
from learner.placement import PlacementError, role_bundle
from rollout.records import Ticket
from rollout.scheduler import Submission
from rollout.worker import RolloutWorker

HEARTBEAT_SECONDS = 5.0
"""How long a stall report waits for one worker's heartbeat."""
PROBE_SECONDS = 5.0
"""How often wait() wakes to probe dead workers when nothing else happens."""
PUBLISH_DTYPE = {"fp32": "float32", "bf16": "bfloat16", "fp8": "float32"}
"""The dtype weights are published in, by engine precision: what the engine holds (bf16 halves the
bytes moved); fp8 engines quantize from full precision."""
ENGINE_CLOSE_SECONDS = 30.0
"""How long shutdown waits for the rollout workers to close their engines before killing them."""
COLLECT_POLL_SECONDS = 2.0
"""How long one poll call may wait for news: bounds the latency of noticing a dead worker."""


def _cause_text(err: "ray.exceptions.RayTaskError") -> str:
    """The remote error's own text (not Ray's wrapping traceback)."""
    cause = getattr(err, "cause", None)
    return f"{type(cause).__name__}: {cause}" if cause is not None and type(cause).__name__ != "EngineDied" else str(cause or err)[:2000]


def check_roles(cfg: RunConfig, learner: bool = True) -> None:
    """Every role resource the config names is declared by some node of the cluster, or the run
    stops before placing anything, naming the field and the resource."""
    declared = {k for k in ray.cluster_resources() if k not in ("CPU", "GPU", "memory", "object_store_memory") and not k.startswith("node:")}
    roles = [("rollout.node_resource", "rollout", cfg.rollout.node_resource)]
    if learner:
        roles.append(("learner_resources.node_resource", "learner", cfg.learner_resources.node_resource))
    for field, role, name in roles:
        if name and name not in declared:
            raise PlacementError(
                f"{field}: no node of this Ray cluster declares the resource {name!r} (declared: {sorted(declared) or 'none'}); "
                f"start the {role} nodes with `ray start --resources='{{\"{name}\": 1}}'` (deploy/kuberay/rayjob.yaml does)"
            )


class RayBackend(Backend):
    def __init__(self, cfg: RunConfig, model_folder: str | None = None, learner: bool = True):
        """Use ``build``."""
        from rollout.offline_model import materialize_smollm2

        self.cfg = cfg
        self.deadlines = cfg.deadlines
        folder = model_folder or cfg.model.path or str(materialize_smollm2())
        ro = cfg.rollout
        check_roles(cfg, learner)
        # the learner's placement group is reserved first (PACK: its ranks together), then the
        # engines start and load while the learner ranks start and build their model: start-up is
        # their maximum, not their sum
        self.learner = LearnerGroup.build(cfg.learner, model_folder=folder, resources=cfg.learner_resources, wait=False) if learner else None
        self.workers = ro.workers
        bundle = role_bundle(ro.cpus_per_worker, ro.gpus_per_worker, ro.node_resource)
        topk = objectives.required_topk(cfg.learner.objective)
        try:
            self._placed = actor_pool.place(
                RolloutWorker, [bundle] * ro.workers, "SPREAD", f"the rollout workers (rollout.workers {ro.workers}, each {bundle})",
                {"num_cpus": ro.cpus_per_worker, "num_gpus": ro.gpus_per_worker, "max_concurrency": 4,
                 "max_restarts": ro.max_restarts, "max_task_retries": 0},
                [((ro,), {"model_folder": folder, "worker_id": i, "topk_logprobs": topk, "seed": cfg.seed,
                          "eval_temperature": cfg.eval.temperature, "record_routing": cfg.learner.routing_replay})
                 for i in range(ro.workers)],
                keep=ro.engine != "sglang",  # sglang's engine must be built on the process's main thread: a fresh one each run
            )
        except PlacementError:
            if self.learner is not None:
                self.learner.shutdown()  # do not keep the learner's placement group on a shared cluster
            raise
        self.pg, self.actors = self._placed.pg, self._placed.actors
        began = time.monotonic()
        try:
            if self.learner is not None:
                self._learner_call(self.learner.ready, self.deadlines.startup_seconds)
            beats = self._started_up([a.heartbeat.remote() for a in self.actors], began)  # every engine is up
        except Exception:  # late, or a worker or rank failed to start
            self.shutdown()  # nothing of this run stays placed on the cluster
            raise
        self._life = {w: b["life"] for w, b in enumerate(beats)}
        """Each worker's process id as its heartbeat reports it (rollout.worker.RolloutWorker.life)."""
        self._dead_life: dict[int, str | None] = {}
        """Workers the backend killed: the life of the killed process, whose answers are not a restart's."""
        self._sync = None
        if self.learner is not None and cfg.learner.weight_sync == "broadcast":
            self._sync = BroadcastSync(self.learner, self.actors, cfg.learner.weight_sync_timeout_s)
            self._learner_call(self._sync.form, list(range(self.workers)))  # every worker joins at start
        self.placement = {
            "learner": ray.get([w.node_id.remote() for w in self.learner.workers]) if self.learner else [],
            "rollout": [b["node_id"] for b in beats],
        }
        self._serving = [0] * self.workers
        self._version = 0
        """The newest version published."""
        self._acks: dict = {}
        self._collects = {a.poll.remote(COLLECT_POLL_SECONDS): i for i, a in enumerate(self.actors)}
        self._train: list | None = None
        self._down: set[int] = set()
        self._gone: set[int] = set()
        self._probes: dict = {}
        self._rejoining: set[int] = set()
        """broadcast: restarted workers waiting for the next publication (they join its group)."""
        self._revived: list[int] = []
        """Workers back in service since the last wait (reported by it)."""
        self._lost: list[int] = []
        """Workers declared lost since the last wait (reported by it)."""
        self._next_probe: dict[int, float] = {}
        self._publication = None
        self._calls: dict[int, dict] = {w: {} for w in range(self.workers)}
        """Per worker, the submissions it started and has not returned, and when the backend heard they started."""
        self._ack_sent: dict = {}
        """When each pending ``update_weights`` was sent."""
        self._why: dict[int, str] = {}
        """Why a worker was lost, for the next ``wait``'s report."""
        self._last_reason: dict[int, str] = {}
        """Why each worker was last restarted (named if it runs out of restarts)."""

    @classmethod
    def build(cls, config: RunConfig, *, model_folder: str | None = None, learner: bool = True) -> "RayBackend":
        """The run's learner group and rollout workers on the Ray cluster this process is connected
        to, serving the HF model in ``model_folder`` (default: ``model.path``, else the packaged
        SmolLM2). ``learner=False``: rollout workers only (``drpo eval``): nothing can train or
        publish. ``config``'s precisions must be resolved (load_config and train do)."""
        RunConfig.expect(config, "RayBackend")
        if "auto" in (config.rollout.precision, config.learner.precision):
            raise ValueError("precision 'auto' reached RayBackend unresolved; resolve it with controller.hardware.resolve_precision")
        return cls(config, model_folder, learner)

    def _started_up(self, refs: list, began: float) -> list[dict]:
        """Every worker's first heartbeat, within the start-up deadline (DeadlineExceeded names the late ones)."""
        left = max(1.0, self.deadlines.startup_seconds - (time.monotonic() - began))
        try:
            return ray.get(refs, timeout=left)
        except ray.exceptions.GetTimeoutError:
            raise DeadlineExceeded(
                f"rollout workers {late_refs(refs)} did not load their engine within "
                f"deadlines.startup_seconds={self.deadlines.startup_seconds:g} s"
            ) from None

    def restart(self, worker: int, reason: str) -> None:
        """Kill ``worker``'s process and let Ray start it again (the restart path: it is reported lost
        with ``reason``, its work re-queued, and it serves again once it loaded the newest weights)."""
        if worker in self._down:
            return
        ray.kill(self.actors[worker], no_restart=False)
        self._dead_life[worker] = self._life.get(worker)
        self._why[worker] = self._last_reason[worker] = reason
        self._lose(worker)
        if self._sync is not None:
            self._sync.invalidate()

    def _enforce_deadlines(self) -> None:
        """Restart every live worker with an engine call or a weight load past its deadline. A
        submission started longer ago than the engine-call deadline is only a suspicion (the worker
        may be scoring, or its groups wait unread): the worker's heartbeat says how long its engine
        call has run, and only that is held to the deadline."""
        now = time.monotonic()
        limit = self.deadlines.engine_call_seconds
        for worker, calls in self._calls.items():
            if not calls or worker in self._down or now - min(calls.values()) <= limit:
                continue
            try:
                beat = ray.get(self.actors[worker].heartbeat.remote(), timeout=self.deadlines.control_seconds)
            except RayActorError:
                continue  # dead: its poll reports it
            except ray.exceptions.GetTimeoutError:
                self.restart(worker, f"its heartbeat did not answer within deadlines.control_seconds={self.deadlines.control_seconds:g} s "
                             f"while its engine call had run {now - min(calls.values()):.0f} s: the worker is hung")
                continue
            running = beat.get("engine_call_seconds")
            if running is not None and running > limit:
                self.restart(worker, f"its engine call (running {running:.0f} s, {len(calls)} prompts) ran past "
                             f"deadlines.engine_call_seconds={limit:g} s: the engine is hung")
            else:  # not in a long engine call now: measure from now on
                self._calls[worker] = {t: now - (running or 0.0) for t in calls}
        for ref, sent in list(self._ack_sent.items()):
            if ref in self._acks and now - sent > self.deadlines.weight_load_seconds:
                self._restart_late_ack(ref, "update_weights (loading a publication)")

    def _restart_late_ack(self, ref, call: str) -> None:
        """A worker that did not acknowledge a publication within its deadline: restarted, it loads it."""
        worker = self._acks.pop(ref)
        self._ack_sent.pop(ref, None)
        self.restart(worker, f"{call} ran past deadlines.weight_load_seconds={self.deadlines.weight_load_seconds:g} s: the engine is hung")

    def now(self) -> float:
        return time.monotonic()

    def submit(self, worker: int, items: list[Submission]) -> None:
        self.actors[worker].submit.remote(items)

    def cancel_queued(self) -> list[Ticket]:
        taken = []
        for i, a in enumerate(self.actors):
            if i in self._down:
                continue
            try:
                taken += ray.get(a.cancel_queued.remote(), timeout=self.deadlines.control_seconds)
            except RayActorError:
                pass  # died just now: the controller hears of it from its poll
            except ray.exceptions.GetTimeoutError:
                self.restart(i, f"cancel_queued ran past deadlines.control_seconds={self.deadlines.control_seconds:g} s")
        return taken

    def train(self, batch: TrainBatch) -> None:
        self._train = self.learner.submit_train(batch, self.cfg.train.mini_batches, self.cfg.train.epochs)

    def wait(self) -> Events:
        self._probe_down_workers()
        revived, self._revived = self._revived, []
        lost, self._lost = self._lost, []
        pending = list(self._collects) + (self._train or []) + list(self._acks) + list(self._probes)  # an ack can open admission
        ray.wait(pending, num_returns=1, timeout=PROBE_SECONDS if not self._down else 1.0)
        ready = set(ray.wait(pending, num_returns=len(pending), timeout=0)[0])
        self._collect_acks(ready)
        events = Events(lost=lost, revived=revived, why={w: self._why.pop(w) for w in lost if w in self._why})
        for ref in [r for r in self._collects if r in ready]:
            worker = self._collects.pop(ref)
            try:
                finished, began = ray.get(ref)
            except RayActorError:
                self._down.add(worker)
                self._calls[worker] = {}
                events.lost.append(worker)
                if self._sync is not None:
                    self._sync.invalidate()
                continue
            except ray.exceptions.RayTaskError as err:  # the worker's engine died (rollout.engine.EngineDied): restart it
                self.restart(worker, f"its engine died: {_cause_text(err)}")
                continue
            now = time.monotonic()
            self._calls[worker].update({s.ticket: now for s in began})
            for g in finished:
                self._calls[worker].pop(g.ticket, None)
            events.groups.extend(finished)
            events.started.extend(began)
            self._collects[self.actors[worker].poll.remote(COLLECT_POLL_SECONDS)] = worker
        for ref in [r for r in self._probes if r in ready]:
            self._revive(self._probes.pop(ref), ref, events)
        self._enforce_deadlines()  # after what is ready was read: finished work is never taken for a hang
        if not (self._train and all(r in ready for r in self._train)):
            return events
        per_rank, self._train = check_host(self._learner_call(ray.get, self._train), "train"), None
        m = per_rank[0]  # every rank's metrics are already reduced across data-parallel ranks
        values = {**m.values, "learner/loss": m.loss, "learner/grad_norm": m.grad_norm, "learner/lr": m.lr}
        trained = TrainResult(m.version, m.tokens, m.seconds, values)
        return Events(events.groups, trained, events.started, events.lost, events.revived)

    def _probe_down_workers(self) -> None:
        """A heartbeat to every dead worker without one in flight: Ray holds it until the actor has
        restarted (or fails it if the actor is gone for good)."""
        probing = set(self._probes.values())
        now = time.monotonic()
        for worker in self._down - probing - self._gone - self._rejoining:
            if now >= self._next_probe.get(worker, 0.0):
                self._next_probe[worker] = now + 1.0  # a failed probe comes back at once: do not spin
                self._probes[self.actors[worker].heartbeat.remote()] = worker

    def _revive(self, worker: int, probe, events: Events) -> None:
        """A restarted worker loads the newest publication before it is given work again."""
        try:
            beat = ray.get(probe)
            if beat.get("life") is not None and beat.get("life") == self._dead_life.get(worker):
                return  # answered by the process the backend killed, not yet gone: probed again
            # a worker that only looked dead still holds re-queued work; a restarted one may still be loading its engine
            ray.get(self.actors[worker].reset.remote(), timeout=self.deadlines.startup_seconds)
            if self._sync is not None and self._version > 0:
                # it joins the group when the next publication forms it again, and takes work once
                # that publication reached it (the learner may already be past the current version)
                self._rejoining.add(worker)
                if self._train is None:  # the learner is idle at the published version: send it again now
                    self._learner_call(self._broadcast, self._version, time.monotonic())
                return
            if self._publication is not None:
                self._serving[worker] = ray.get(
                    self.actors[worker].update_weights.remote(self._publication.refs), timeout=self.deadlines.weight_load_seconds,
                )
            else:
                self._serving[worker] = 0
        except ActorDiedError:
            self._gone.add(worker)  # out of restarts: never comes back
            if len(self._gone) == self.workers:
                last = self._last_reason.get(worker)
                raise WorkersGone(
                    "every rollout worker died and is out of restarts (rollout.max_restarts)"
                    + (f"; worker {worker} was last lost because {last}" if last else "")
                ) from None
            return
        except RayActorError:
            return  # still restarting; probed again on the next wait
        except ray.exceptions.GetTimeoutError:
            # still down (already reported lost): killed again, it comes back through another restart
            ray.kill(self.actors[worker], no_restart=False)
            self._dead_life[worker] = beat.get("life")
            print(f"drpo train: rollout worker {worker} did not take the newest publication after its restart within "
                  f"deadlines.startup_seconds / weight_load_seconds; restarting it again", file=sys.stderr, flush=True)
            return
        self._life[worker] = beat.get("life")
        self._dead_life.pop(worker, None)
        self._back(worker)
        events.revived.append(worker)

    def _lose(self, worker: int) -> None:
        """Declare a worker lost outside ``wait`` (a broadcast found it dead or unavailable, or a call
        ran past its deadline): its poll is dropped, so it is reported lost once, by the next ``wait``."""
        self._down.add(worker)
        self._calls[worker] = {}
        for ref in [r for r, w in self._collects.items() if w == worker]:
            del self._collects[ref]
        self._lost.append(worker)

    def _back(self, worker: int) -> None:
        self._down.discard(worker)
        self._collects[self.actors[worker].poll.remote(COLLECT_POLL_SECONDS)] = worker

    def available(self, worker: int) -> bool:
        return worker not in self._down

    def publish(self, version: int, wait: bool) -> PublishReport:
        started = time.monotonic()
        self._version = version
        if self._sync is not None:
            return self._learner_call(self._broadcast, version, started)
        publication = self._object_store_publication(version)
        for i, a in enumerate(self.actors):
            if i not in self._down:
                ref = a.update_weights.remote(publication.refs)
                self._acks[ref], self._ack_sent[ref] = i, time.monotonic()
        if wait and self._acks:
            ready, late = ray.wait(list(self._acks), num_returns=len(self._acks), timeout=self.deadlines.weight_load_seconds)
            self._collect_acks(set(ready))
            for ref in late:  # a hung engine must not hang a synchronous run
                self._restart_late_ack(ref, f"update_weights of version {version}")
        return PublishReport(time.monotonic() - started, publication.nbytes)

    def _object_store_publication(self, version: int):
        publication = self._learner_call(
            self.learner.publish, self.cfg.learner.weight_bucket_mib * 2**20, PUBLISH_DTYPE[self.cfg.rollout.precision], self.deadlines.publish_seconds,
        )
        if publication.version != version:
            raise RuntimeError(f"learner published version {publication.version}, the controller expected {version}")
        self._publication = publication
        return publication

    def _broadcast(self, version: int, started: float) -> PublishReport:
        """Broadcast to every live worker, forming the group again without the ones that die, until
        every member received it (always waited for: the learner's rank 0 sends until all have it)."""
        outcome = None
        for retries in range(BROADCAST_ATTEMPTS):
            live = [w for w in range(self.workers) if w not in self._down or w in self._rejoining]
            if not live:  # every worker is down: the restarted ones join the next publication
                return PublishReport(time.monotonic() - started, 0, "broadcast", (), retries)
            outcome = self._sync.attempt(live, self.cfg.learner.weight_bucket_mib * 2**20, PUBLISH_DTYPE[self.cfg.rollout.precision])
            for w in outcome.failed_alone:  # alive but its engine cannot take weights: restarted, it rejoins like a dead one
                ray.kill(self.actors[w], no_restart=False)
            lost = outcome.dead | set(outcome.failed_alone)
            for w in sorted(lost - self._down):  # lost now (their work is re-queued); a restart brings them back
                self._lose(w)
            self._rejoining -= lost
            for w, got in outcome.received.items():
                if "version" in got:
                    self._serving[w] = max(self._serving[w], got["version"])
            if outcome.error is None or outcome.failed_alone:  # every other member has it: no re-send
                for w in sorted(self._rejoining):  # back in the group, serving this version: work again
                    self._back(w)
                    self._revived.append(w)
                self._rejoining.clear()
                seconds = tuple(got["seconds"] for got in outcome.received.values() if "version" in got)
                return PublishReport(time.monotonic() - started, outcome.nbytes, "broadcast", seconds, retries)
        raise RuntimeError(
            f"weight broadcast of version {version} failed {BROADCAST_ATTEMPTS} times (last: {outcome.error}); "
            f"learner.weight_sync=object_store avoids the group"
        )

    def diagnose(self) -> list[dict]:
        """Backend.diagnose with each live worker's heartbeat (bounded: a hung actor says so)."""
        out = super().diagnose()
        refs = {w: self.actors[w].heartbeat.remote() for w in range(self.workers) if w not in self._down}
        for w, ref in refs.items():
            try:
                beat = ray.get(ref, timeout=HEARTBEAT_SECONDS)
            except (ray.exceptions.GetTimeoutError, RayActorError) as err:
                out[w]["heartbeat"] = f"no answer within {HEARTBEAT_SECONDS:g} s ({type(err).__name__})"
                continue
            last = beat.get("last_step_time")
            out[w].update({
                "queue": beat["queue_depth"], "running": beat["in_flight"], "loop_alive": beat["alive"], "groups": beat["groups"],
                "failures": beat["failures"], "last_engine_call": f"{time.time() - last:.0f} s ago" if last else "never",
            })
        return out

    def _collect_acks(self, ready: set) -> None:
        """Record the version of every worker whose ``update_weights`` returned (among ``ready``)."""
        for ref in [r for r in self._acks if r in ready]:
            w = self._acks.pop(ref)
            self._ack_sent.pop(ref, None)
            try:
                self._serving[w] = max(self._serving[w], ray.get(ref))
            except RayActorError:
                pass  # the worker died; its poll reports it
            except ray.exceptions.RayTaskError as err:  # its engine could not load the publication: restarted, it loads it
                self.restart(w, f"loading a publication failed: {_cause_text(err)}")

    def worker_version(self, worker: int) -> int:
        """The newest version ``worker`` acknowledged, as of the last ``wait`` (acks are waited on there)."""
        return self._serving[worker]

    def _learner_call(self, fn, *args):
        try:
            return fn(*args)
        except RayActorError as err:
            raise LearnerLost(
                f"a learner rank died ({type(err).__name__}); the run stops. Continue it from its last checkpoint with: "
                f"drpo train --resume {self.cfg.run_dir}"
            ) from None
        except LearnerTimeout as err:
            raise DeadlineExceeded(
                f"{err} (deadlines in the config); the run stops. Continue it from its last checkpoint with: "
                f"drpo train --resume {self.cfg.run_dir}"
            ) from None

    def probe_storage(self, run_dir: str, nonce: str) -> list[dict]:
        return self._learner_call(self.learner.check_storage, run_dir, nonce) if self.learner is not None else []

    def save(self, folder: str) -> None:
        self._learner_call(self.learner.save_checkpoint, folder, self.deadlines.checkpoint_seconds)

    def load(self, folder: str, version: int) -> None:
        self._learner_call(self.learner.load_checkpoint, folder, self.deadlines.checkpoint_seconds)
        self.publish(version, wait=True)
        self._serving = [version] * self.workers

    def shutdown(self) -> None:
        # each worker closes its engine (engine processes, /dev/shm staging) before its process is
        # killed, or kept for the driver's next run (learner/actor_pool.py), where an engine that can
        # serve another run is left to the next worker built in that process
        keep = actor_pool.reusing() and self._placed.keep
        closing = [a.shutdown.remote(keep_engine=keep) for i, a in enumerate(self.actors) if i not in getattr(self, "_down", ())]
        ended = []
        try:
            closed, _ = ray.wait(closing, num_returns=len(closing), timeout=ENGINE_CLOSE_SECONDS)
            ended = ray.get(closed)  # whether each worker's threads ended
        except ray.exceptions.RayError:
            ended = []
        try:
            if self.learner is not None:
                self.learner.shutdown()
        except RayActorError:
            pass  # a dead learner has nothing left to shut down
        finally:
            clean = len(ended) == len(self.actors) == len(closing) and all(ended) and not getattr(self, "_dead_life", None)
            actor_pool.release(self._placed, clean)
