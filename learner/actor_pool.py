"""Placing a role's actors, and keeping their processes for the next run of the same driver.

A run's rollout workers and learner ranks each live in a Ray actor process of their own, in a
placement group of their own. Starting such a process costs more than many short runs do
(importing torch, transformers, megatron-core or vLLM: ~6–16 CPU-seconds each on a 2-core CPU).
A driver that trains run after run (the cells of a grid, a test session) can keep them: inside
``reuse()``, a run's actors and their placement group go back to a pool when the run ends cleanly,
and the next run asking for the same placement (same class, bundles, strategy and actor options)
gets them, with a new object of the run's class built in each process. Outside ``reuse()`` (a
single ``drpo train``) every run starts fresh processes and kills them at its end.

Each actor is a ``Host`` of the role's class: its constructor builds the role's object from
arguments it reads from the cluster's key-value store under the actor's own slot. A Ray restart
runs the constructor again, so a restarted process builds the object with the arguments of the run
it serves now, not with those of the run that first started it. A host is killed at the end of
its run instead of being kept when it was restarted (its restart budget, ``max_restarts``, is
spent in part), when its run did not shut down cleanly, or when a call of the run still runs in it;
a kept host that died or was restarted while kept is stopped when the next run asks for it, and
that run gets fresh ones. Process-wide state a run leaves behind that its objects do not own
(environment variables an engine sets, CUDA's cached memory) is put back when the host is released.

A run's object may also leave a part of itself to the next object built in its process
(``stash``/``unstash``: a rollout worker's vLLM engine, whose own process takes seconds to start
and ~5 s to stop); what the next object does not take is closed once it is built, and everything
left is closed before the host is stopped.
"""

from __future__ import annotations

import gc
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import ray
from ray.experimental import internal_kv
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from learner.placement import wait_placed

NAMESPACE = "drpo-actor-pool"
RELEASE_SECONDS = 10.0
"""How long a release waits for every host to drop its object before killing them all."""


_stash: dict[object, tuple[object, Callable[[], None]]] = {}
"""What a run's objects left in this host process for the next run's (``stash``)."""
_hosting = False
"""Whether this process is a host (only a host can keep anything for a next run)."""


def stash(key, part, close: Callable[[], None]) -> bool:
    """In a host process, keep ``part`` for the next object built in it (``unstash(key)``);
    ``close`` ends it if that object does not take it, or when the host is stopped. Returns False
    outside a host: nothing is kept, and the caller closes ``part`` itself."""
    if not _hosting:
        return False
    if key in _stash:
        _close_stash([key])
    _stash[key] = (part, close)
    return True


def unstash(key):
    """The part an earlier run of this process stashed under ``key``, now the caller's; else None."""
    kept = _stash.pop(key, None)
    return None if kept is None else kept[0]


def _close_stash(keys=None) -> None:
    for key in list(_stash) if keys is None else keys:
        part, close = _stash.pop(key)
        try:
            close()
        except Exception as err:  # closing leftovers: say so, and close the rest
            print(f"closing a kept {type(part).__name__} failed: {type(err).__name__}: {err}", flush=True)


class Host:
    """One actor process serving one object of ``target`` (set by ``hosted``); every public method
    of ``target`` is forwarded to it."""

    target: type = object

    def __init__(self, slot: str):
        global _hosting
        _hosting = True
        self._slot = slot
        self._environ = dict(os.environ)
        self._ready = threading.Event()
        self._obj = None
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._active = 0
        """Forwarded calls running now."""
        if ray.get_runtime_context().was_current_actor_reconstructed and self._arguments() is None:
            return  # restarted while kept between runs: it builds nothing, and is not handed out again
        self._build()  # a first start, or a restart during a run: the slot holds the arguments of the run served now

    def _arguments(self):
        spec = internal_kv._internal_kv_get(self._slot, namespace=NAMESPACE)
        return None if spec is None else ray.cloudpickle.loads(spec)

    def _build(self) -> None:
        call = self._arguments()
        if call is None:
            raise RuntimeError(f"{self.target.__name__}: no arguments under slot {self._slot} (its run ended)")
        args, kwargs = call
        try:
            self._obj = self.target(*args, **kwargs)
        finally:
            _close_stash()  # what the new object did not take
        self._ready.set()

    def reopen(self) -> None:
        """Build the object of the run that took this host from the pool (the slot's new arguments);
        calls forwarded meanwhile wait for it, and get its error if building failed."""
        try:
            self._build()
        except BaseException as err:
            self._error = err
            self._ready.set()
            raise

    def fit(self) -> bool:
        """Whether this host can serve another run: never restarted, and holding no object."""
        return self._obj is None and not ray.get_runtime_context().was_current_actor_reconstructed

    def release(self, wait_s: float = RELEASE_SECONDS / 2) -> bool:
        """Drop the run's object (after its own shutdown) and put the environment back, once the
        calls forwarded to it have returned (up to ``wait_s``); True if it can serve another run: no
        call still running and the process never restarted."""
        deadline = time.monotonic() + wait_s
        while self._active and time.monotonic() < deadline:
            time.sleep(0.05)
        with self._lock:
            if self._active:
                return False  # a call of the ended run still runs (hung): this process is not kept (stop closes its stash)
            self._ready.clear()
            self._obj, self._error = None, None
        os.environ.clear()
        os.environ.update(self._environ)
        gc.collect()
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available():
            torch.cuda.empty_cache()  # the next run's engine or learner may share this GPU
        return self.fit()

    def stop(self) -> None:
        """Close what this process keeps for a next run (before Ray kills it)."""
        _close_stash()

    def pid(self) -> int:
        return os.getpid()


def _forward(name: str):
    def call(self, *args, **kwargs):
        self._ready.wait()
        if self._error is not None:
            raise self._error
        with self._lock:
            self._active += 1
            obj = self._obj
        try:
            return getattr(obj, name)(*args, **kwargs)
        finally:
            with self._lock:
                self._active -= 1

    call.__name__ = call.__qualname__ = name
    return call


_HOSTED: dict[type, type] = {}


def hosted(target: type) -> type:
    """The Host class of ``target`` (named like it: its processes show as ``ray::<target>.<method>``)."""
    if target not in _HOSTED:
        methods = {n: _forward(n) for n in dir(target) if not n.startswith("_") and callable(getattr(target, n)) and not hasattr(Host, n)}
        _HOSTED[target] = type(target.__name__, (Host,), {"target": target, "__module__": __name__, **methods})
    return _HOSTED[target]


@dataclass
class Placement:
    """A role's placement group and its actors (one per bundle, in bundle order)."""

    pg: object
    actors: list
    slots: list[str]
    key: tuple
    job: str
    """The cluster session and the driver's job (``_job``): actors die with the job that made them."""
    keep: bool = True
    """Whether it may be kept for the next run."""
    reused: bool = False
    """Placed inside ``reuse()``: its runs may have stashed parts (``stash``), closed before a stop."""
    released: bool = False


_reusing = 0
_idle: list[Placement] = []


@contextmanager
def reuse():
    """Within this block, placements that end cleanly are kept for the next run asking for the same
    one; at its end every kept one is stopped (nothing of it stays on the cluster)."""
    global _reusing
    _reusing += 1
    try:
        yield
    finally:
        _reusing -= 1
        if not _reusing:
            drain()


def reusing() -> bool:
    """Whether runs now keep what they can for the next run (inside ``reuse()``)."""
    return _reusing > 0


def kept() -> list[Placement]:
    """The placements kept now for this driver's next runs."""
    job = _job()
    return [p for p in _idle if p.job == job]


def drain() -> None:
    """Stop every kept placement (its processes and its placement group); those of an earlier
    connection to Ray went with its job."""
    job = _job()
    while _idle:
        kept = _idle.pop()
        if kept.job == job:
            _stop(kept)


def place(
    target: type, bundles: list[dict], strategy: str, what: str, options: dict, arguments: list[tuple[tuple, dict]], keep: bool = True,
) -> Placement:
    """One actor of ``target`` per bundle of a placement group (``strategy``), built with
    ``arguments[i]`` (args, kwargs) and Ray actor ``options``: kept ones when ``reuse()`` holds a
    matching placement, else fresh ones (PlacementError, naming ``what``, if Ray cannot place them).
    ``keep=False``: never kept (an object that must be built on the process's main thread)."""
    key = (target, tuple(tuple(sorted(b.items())) for b in bundles), strategy, tuple(sorted(options.items())))
    job = _job()
    while (kept := next((p for p in _idle if p.key == key and p.job == job), None)) is not None:
        _idle.remove(kept)
        try:
            fit = all(ray.get([a.fit.remote() for a in kept.actors], timeout=RELEASE_SECONDS))
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
            fit = False
        if not fit:  # died or restarted while kept
            _stop(kept)
            continue
        for slot, call in zip(kept.slots, arguments):
            _put(slot, call)
        for actor in kept.actors:
            actor.reopen.remote()
        kept.released = False
        return kept
    drain()  # what is kept holds the cluster's resources: free them for this placement
    pg = placement_group(bundles, strategy=strategy)
    wait_placed(pg, what, bundles)
    slots = [f"{target.__name__}-{uuid.uuid4().hex}" for _ in bundles]
    for slot, call in zip(slots, arguments):
        _put(slot, call)
    actor = ray.remote(hosted(target))
    actors = [
        actor.options(**options, scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)).remote(slot)
        for i, slot in enumerate(slots)
    ]
    return Placement(pg, actors, slots, key, job, keep, reused=reusing())


def release(placement: Placement, clean: bool) -> None:
    """End a run's use of ``placement`` (once: a second call does nothing): kept for the next run if
    ``reuse()`` holds, the run ended ``clean`` (every object shut down in time), no call of the run
    still runs and no host was restarted; else stopped."""
    if placement.released:
        return
    placement.released = True
    if _reusing and clean and placement.keep:
        try:
            fit = all(ray.get([a.release.remote() for a in placement.actors], timeout=RELEASE_SECONDS))
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
            fit = False
        if fit:
            _forget(placement)  # a host Ray restarts while kept finds no arguments: it builds nothing
            _idle.append(placement)
            return
    _stop(placement)


def _stop(placement: Placement) -> None:
    if placement.reused:  # close what its hosts keep for a next run (a vLLM engine's process) before they are killed
        ray.wait([a.stop.remote() for a in placement.actors], num_returns=len(placement.actors), timeout=RELEASE_SECONDS)
    for actor in placement.actors:
        ray.kill(actor)
    remove_placement_group(placement.pg)
    _forget(placement)


def _forget(placement: Placement) -> None:
    """Delete the run arguments stored under the placement's slots."""
    for slot in placement.slots:
        internal_kv._internal_kv_del(slot, namespace=NAMESPACE)


def _job() -> str | None:
    """This driver's connection to Ray: the cluster's session and the job (a fresh cluster numbers
    its first job 01000000 again); None when not connected."""
    if not ray.is_initialized():
        return None
    context = ray.get_runtime_context()
    return f"{context.get_session_name()}/{context.get_job_id()}"


def _put(slot: str, call: tuple[tuple, dict]) -> None:
    internal_kv._internal_kv_put(slot, ray.cloudpickle.dumps(call), overwrite=True, namespace=NAMESPACE)
