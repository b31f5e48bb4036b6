"""In-flight weight updates for asynchronous engines (vLLM's AsyncLLM, SGLang's Engine): the
bookkeeping both share, factored out of them so it runs and is tested without either engine.

An async engine is driven from one event loop in a thread of its own (``EngineLoop``): the rollout
thread's ``generate`` and the actor thread's weight updates both hand it coroutines, so the engine
is only ever touched from that loop (SGLang's Engine is bound to the loop it was built on and is not
safe across threads; vLLM's AsyncLLM likewise runs its output handler on one loop).

``ServedWeights`` holds the version being served and orders weight loads: a load runs between two
decoding steps (the engine's pause, the load, the engine's ``settle``, the version bump, its
resume) under one lock, so two loads never interleave and a cache reset never runs during a load.
The version changes only after the load has returned and the engine has delivered what it decoded
before the pause (``settle``: vLLM delivers on the loop already; SGLang's tokens come through its
detokenizer process, so it waits for them to stop arriving). A publication older than the one
served is skipped, and a load that fails part way leaves the engine refusing to generate until a
whole publication loads (its weights are a mix no version describes).

``TokenStream`` collects one request's streamed tokens and stamps each with the version served when
it arrived, so a response that spans an update carries both versions, token by token.
"""

from __future__ import annotations

import asyncio
import math
import threading
from typing import Awaitable, Callable

import torch

from rollout.engine import Completion


class EngineLoop:
    """An asyncio event loop running in a daemon thread: the only thread that touches the engine."""

    def __init__(self, name: str, setup: Callable[[], object] | None = None):
        """``setup`` runs in the loop's thread with the loop set as its current loop, before the loop
        starts (an engine that binds to ``asyncio.get_event_loop()`` at construction is built there);
        its result is ``self.built`` and an exception it raises is raised here."""
        self.loop = asyncio.new_event_loop()
        self.built = None
        started, failure = threading.Event(), []

        def main() -> None:
            asyncio.set_event_loop(self.loop)
            try:
                self.built = setup() if setup is not None else None
            except BaseException as err:  # reported to the constructing thread
                failure.append(err)
                started.set()
                return
            started.set()
            self.loop.run_forever()

        self._thread = threading.Thread(target=main, name=name, daemon=True)
        self._thread.start()
        started.wait()
        if failure:
            self.loop.close()
            raise failure[0]

    def run(self, coro: Awaitable):
        """Run ``coro`` on the loop and wait for its result (from any thread but the loop's own)."""
        if threading.current_thread() is self._thread:
            if asyncio.iscoroutine(coro):
                coro.close()
            raise RuntimeError("EngineLoop.run called from the engine loop itself (it would wait for itself)")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def close(self) -> None:
        """Cancel what is still pending on the loop (engine output handlers) and stop it."""
        if not self.loop.is_running():
            return
        self.run(_cancel_pending())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)


async def _cancel_pending() -> None:
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


class ServedWeights:
    """The policy version an engine serves, and the lock that orders its weight loads. Used only on
    the engine's loop (the lock binds to it on first use)."""

    def __init__(self, version: int = 0):
        self.version = version
        self.cache_stale = False
        """Whether the engine's prefix cache may hold KV computed with older weights."""
        self.cache_floor = version
        """The oldest version whose KV the prefix cache may hold (the version at its last reset)."""
        self.loads = 0
        """Loads finished (tests and progress)."""
        self.broken: str | None = None
        """Why the served weights are not a publication (a load failed part way), or None."""
        self._lock: asyncio.Lock | None = None

    @property
    def lock(self) -> asyncio.Lock:
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock

    async def swap(
        self, pause: Callable[[], Awaitable], load: Callable[[], Awaitable[int | None]], resume: Callable[[], Awaitable],
        version: int | None = None, settle: Callable[[], Awaitable] | None = None,
    ) -> int:
        """Pause the engine between two decoding steps, ``load`` (returns the version it loaded, or
        None to keep the served one), ``settle``, bump the version, resume; returns the served
        version. ``version``, when known before loading: a publication older than the served one
        is skipped. Loads are serialized; resume runs whatever the load did; a load that raises
        marks the engine ``broken`` until one succeeds. Without ``settle``, one turn of the loop
        passes before the bump (output already queued on this loop is stamped first)."""
        async with self.lock:
            if version is not None and version < self.version:
                return self.version  # a newer publication is already served
            await pause()
            try:
                try:
                    loaded = await load()
                    await (settle() if settle is not None else asyncio.sleep(0))
                except BaseException as err:
                    self.broken = f"a weight load failed part way ({type(err).__name__}: {err})"
                    raise
                if loaded is not None:
                    self.version = loaded
                self.cache_stale, self.broken = True, None
                self.loads += 1
            finally:
                await resume()
        return self.version

    def check(self) -> None:
        """Raise if the served weights are not a whole publication (generation must not use them)."""
        if self.broken is not None:
            raise RuntimeError(f"this engine serves no whole publication: {self.broken}; it needs a full weight load (or a restart)")

    async def fresh_cache(self, reset: Callable[[], Awaitable[bool]]) -> None:
        """Before a new generate call: drop prefix-cache entries computed with older weights
        (``reset`` returns whether the engine accepted; a refused reset is tried again next call).
        Waits for a load in progress, so the call's requests start after it with a clean cache."""
        async with self.lock:
            if self.cache_stale:
                self.cache_stale = not await reset()
                if not self.cache_stale:
                    self.cache_floor = self.version


class TokenStream:
    """One request's response as it streams back, each token stamped with the version served when
    it arrived. Engines that stream deltas call ``add``; engines that stream running totals call
    ``extend_to`` with the totals."""

    def __init__(self, served: ServedWeights, topk: int = 0):
        self.served, self.topk = served, topk
        self.prompt_version = min(served.version, served.cache_floor)
        """The oldest version the request's prompt KV may come from: the one served when it was
        submitted, or older where the prefix cache was not reset since (a refused reset). A request
        still queued when an update lands is counted from the version before too, although its
        prompt may be prefilled afresh after it."""
        self.ids: list[int] = []
        self.logp: list[float] = []
        self.top_ids: list[list[int]] = []
        self.top_logp: list[list[float]] = []
        self.versions: list[int] = []

    def add(self, ids: list[int], logp: list[float], top_ids: list[list[int]] | None = None, top_logp: list[list[float]] | None = None) -> int:
        """Append newly sampled tokens (and their top-K when ``topk``); returns how many."""
        if len(logp) != len(ids):
            raise RuntimeError(f"the engine returned {len(logp)} log-probs for {len(ids)} new tokens")
        if not all(math.isfinite(x) for x in logp):
            raise RuntimeError("the engine returned a non-finite log-prob for a sampled token")
        if self.topk and (top_ids is None or top_logp is None or len(top_ids) != len(ids) or len(top_logp) != len(ids)):
            raise RuntimeError(f"the engine returned top-{self.topk} entries for {0 if top_ids is None else len(top_ids)} of {len(ids)} new tokens")
        self.ids += ids
        self.logp += logp
        if self.topk:
            self.top_ids += top_ids
            self.top_logp += top_logp
        self.versions += [self.served.version] * len(ids)
        return len(ids)

    def extend_to(self, ids: list[int], logp: list[float], top_ids: list[list[int]] | None = None, top_logp: list[list[float]] | None = None) -> int:
        """Running totals (everything sampled so far): stamp the entries beyond those seen before."""
        seen = len(self.ids)
        if len(ids) < seen or ids[:seen] != self.ids:
            raise RuntimeError(f"the engine's running output ({len(ids)} tokens) does not extend the {seen} tokens it streamed before")
        cut = lambda rows: None if rows is None else rows[seen:]  # noqa: E731
        return self.add(ids[seen:], logp[seen:], cut(top_ids), cut(top_logp))

    def completion(self, prompt: list[int], finish: str, routed: torch.Tensor | None = None) -> Completion:
        has_top = bool(self.topk and self.ids)
        return Completion(
            prompt_ids=torch.tensor(prompt), response_ids=torch.tensor(self.ids, dtype=torch.long),
            rollout_logp=torch.tensor(self.logp, dtype=torch.float32), versions=torch.tensor(self.versions, dtype=torch.long),
            finish_reason=finish, prompt_version=self.prompt_version,  # type: ignore[arg-type]
            topk_ids=torch.tensor(self.top_ids, dtype=torch.long) if has_top else None,
            topk_logp=torch.tensor(self.top_logp, dtype=torch.float32) if has_top else None, routed_experts=routed,
        )
