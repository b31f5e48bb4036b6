"""The in-flight update bookkeeping the vLLM and SGLang engines share (rollout/inflight.py), on a
scheduling stand-in for an async engine: it decodes one token per step on its loop, delivers
tokens through a queue (as an engine's output handler does, a turn of the loop later), and can be
paused between steps. Every token records the weights that produced it; the stamps must agree."""

from __future__ import annotations

import asyncio
import math
import threading

import pytest

from rollout.inflight import EngineLoop, ServedWeights, TokenStream


class SteppingEngine:
    """Pure scheduling stand-in: ``weights`` is the version its decoding steps use."""

    def __init__(self):
        self.weights = 0
        self.running = asyncio.Event()
        self.running.set()
        self.stepping = asyncio.Lock()  # held during one decoding step
        self.events: list[str] = []

    async def pause(self):
        self.running.clear()
        async with self.stepping:  # the step in progress finishes first
            self.events.append("pause")

    async def resume(self):
        self.events.append("resume")
        self.running.set()

    async def load(self, version: int, seconds: float = 0.01):
        self.events.append(f"load {version} start")
        await asyncio.sleep(seconds)
        self.weights = version
        self.events.append(f"load {version} end")
        return version

    async def stream(self, tokens: int):
        """Yields (token id, weights that produced it), delivered through a queue."""
        queue: asyncio.Queue = asyncio.Queue()

        async def decode():
            for i in range(tokens):
                await self.running.wait()
                async with self.stepping:
                    await asyncio.sleep(0.001)
                    queue.put_nowait((i, self.weights))
            queue.put_nowait(None)

        task = asyncio.ensure_future(decode())
        while (item := await queue.get()) is not None:
            yield item
        await task


async def sample(engine: SteppingEngine, served: ServedWeights, tokens: int):
    stream, produced_by = TokenStream(served), []
    async for token, weights in engine.stream(tokens):
        stream.add([token], [-1.0])
        produced_by.append(weights)
    return stream, produced_by


def test_a_response_spanning_an_update_is_stamped_token_by_token_with_the_weights_that_produced_it():
    async def main():
        engine, served = SteppingEngine(), ServedWeights(0)
        request = asyncio.ensure_future(sample(engine, served, 60))
        await asyncio.sleep(0.02)
        await served.swap(engine.pause, lambda: engine.load(1), engine.resume)
        await asyncio.sleep(0.02)
        await served.swap(engine.pause, lambda: engine.load(2), engine.resume)
        return await request

    stream, produced_by = asyncio.run(main())
    assert stream.versions == produced_by  # every stamp is the version that sampled the token
    assert set(stream.versions) == {0, 1, 2} and stream.versions == sorted(stream.versions)
    assert stream.ids == list(range(60))  # nothing dropped or repeated across the pauses


def test_loads_never_interleave_a_failed_load_leaves_the_engine_unusable_and_old_publications_are_skipped():
    async def main():
        engine, served = SteppingEngine(), ServedWeights(3)
        await asyncio.gather(*(served.swap(engine.pause, lambda v=v: engine.load(v), engine.resume) for v in (4, 5)))
        assert served.version == 5 and served.loads == 2
        assert engine.events == ["pause", "load 4 start", "load 4 end", "resume", "pause", "load 5 start", "load 5 end", "resume"]

        async def broken():
            raise RuntimeError("the engine rejected the weights")

        with pytest.raises(RuntimeError, match="rejected"):
            await served.swap(engine.pause, broken, engine.resume)
        assert served.version == 5 and engine.events[-1] == "resume" and engine.running.is_set()
        with pytest.raises(RuntimeError, match="serves no whole publication.*rejected"):  # what it serves now is unknown
            served.check()
        # a load that reports no version keeps the served one, and a whole load makes it usable again
        assert await served.swap(engine.pause, lambda: asyncio.sleep(0), engine.resume) == 5
        served.check()
        # a publication older than the one served is skipped without pausing
        events = len(engine.events)
        assert await served.swap(engine.pause, lambda: engine.load(4), engine.resume, version=4) == 5
        assert len(engine.events) == events

    asyncio.run(main())


def test_the_prefix_cache_is_reset_after_a_load_never_during_one_and_a_refusal_is_retried():
    async def main():
        engine, served = SteppingEngine(), ServedWeights()
        answers = [False, True]
        resets = []

        async def reset():
            resets.append(served.lock.locked())
            return answers.pop(0)

        await served.fresh_cache(reset)
        assert resets == []  # nothing loaded yet: nothing to reset
        await served.swap(engine.pause, lambda: engine.load(1), engine.resume)
        await served.fresh_cache(reset)  # refused (requests still hold blocks): stays stale
        assert served.cache_stale
        assert TokenStream(served).prompt_version == 0  # its prompt may reuse version-0 KV: not numerics at lag 0
        slow_load = asyncio.ensure_future(served.swap(engine.pause, lambda: engine.load(2, 0.05), engine.resume))
        await asyncio.sleep(0.01)
        await served.fresh_cache(reset)  # waits for the load in progress, then resets after it
        assert engine.events[-2:] == ["load 2 end", "resume"] and not served.cache_stale
        assert TokenStream(served).prompt_version == 2
        await slow_load
        assert resets == [True, True] and answers == []  # each reset ran holding the lock, none during a load
        return served

    served = asyncio.run(main())
    assert served.version == 2


def test_running_totals_are_stamped_only_beyond_what_was_seen():
    served = ServedWeights(0)
    stream = TokenStream(served, topk=1)
    assert stream.extend_to([5, 6], [-0.1, -0.2], [[5], [6]], [[-0.1], [-0.2]]) == 2
    served.version = 1
    assert stream.extend_to([5, 6, 7], [-0.1, -0.2, -0.3], [[5], [6], [7]], [[-0.1], [-0.2], [-0.3]]) == 1
    assert stream.versions == [0, 0, 1]
    done = stream.completion([1, 2], "length")
    assert done.response_ids.tolist() == [5, 6, 7] and done.versions.tolist() == [0, 0, 1] and done.topk_ids.shape == (3, 1)
    assert done.prompt_version == 0  # submitted before the update: its KV came from version 0
    assert TokenStream(served).prompt_version == 0  # no cache reset since version 0: its KV may still be reused
    with pytest.raises(RuntimeError, match="does not extend"):
        stream.extend_to([5, 9, 7, 8], [-0.1] * 4, [[0]] * 4, [[0.0]] * 4)
    with pytest.raises(RuntimeError, match="3 log-probs for 2 new tokens"):
        TokenStream(served).add([1, 2], [-1.0, -1.0, -1.0])
    with pytest.raises(RuntimeError, match="top-2 entries for 1 of 2"):
        TokenStream(served, topk=2).add([1, 2], [-1.0, -1.0], [[1, 2]], [[-1.0, -2.0]])
    with pytest.raises(RuntimeError, match="non-finite"):
        TokenStream(served).add([1], [math.nan])


def test_the_engine_loop_builds_the_engine_on_its_own_thread_and_refuses_to_wait_on_itself():
    seen = {}

    def build():
        seen["thread"] = threading.current_thread().name
        seen["loop"] = asyncio.get_event_loop()
        return "engine"

    loop = EngineLoop("test-engine-loop", build)
    try:
        assert loop.built == "engine" and seen["thread"] == "test-engine-loop" and seen["loop"] is loop.loop

        async def inside():
            loop.run(asyncio.sleep(0))

        with pytest.raises(RuntimeError, match="from the engine loop itself"):
            loop.run(inside())
        assert loop.run(asyncio.sleep(0, result=7)) == 7
    finally:
        loop.close()

    def broken():
        raise ValueError("no GPU")

    with pytest.raises(ValueError, match="no GPU"):
        EngineLoop("test-broken-loop", broken)
