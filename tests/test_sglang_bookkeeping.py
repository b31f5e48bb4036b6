"""The sglang engine's request/response bookkeeping without a GPU: SGLang's response format parsed
by the engine's pure functions, and the engine's own generate/update code driven against a
scheduling stand-in of the subset of SGLang's offline API it calls (``async_generate(stream=True)``
streaming running totals by reference as SGLang does, the tokenizer manager's in-place
pause/continue, ``update_weights_from_tensor``, ``flush_cache``). The real engine runs only in the
gpu-marked tests (tests/test_sglang_engine.py)."""

from __future__ import annotations

import asyncio
import pickle
import sys
import threading
import time
import types
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler

import pytest
import torch

from learner.weights.wire import WeightBucket
from rollout.engine import SamplingParams, tensor_checksum
from rollout.sglang_engine import SGLangEngine, check_update, finish_reason, running_totals, sglang_sampling


# ---- the format ------------------------------------------------------------------------------------


def test_running_totals_read_ids_logprobs_and_topk_from_a_chunk():
    meta = {
        "output_token_logprobs": [(-0.5, 11, None), (-1.5, 12, "x")],
        "output_top_logprobs": [[(-0.5, 11, None), (-0.9, 3, None)], [(-0.2, 4, None), (-1.5, 12, None)]],
    }
    assert running_totals(meta, 0) == ([11, 12], [-0.5, -1.5], None, None)
    assert running_totals(meta, 2) == ([11, 12], [-0.5, -1.5], [[11, 3], [4, 12]], [[-0.5, -0.9], [-0.2, -1.5]])
    with pytest.raises(RuntimeError, match="fewer than 3 top"):
        running_totals(meta, 3)
    with pytest.raises(RuntimeError, match="top-2 log-probs for 1 of 2"):
        running_totals({**meta, "output_top_logprobs": meta["output_top_logprobs"][:1]}, 2)
    with pytest.raises(RuntimeError, match="no output_token_logprobs"):
        running_totals({}, 0)
    ids, logp, _, _ = running_totals({"output_token_logprobs": [(None, 5, None)]}, 0)
    assert ids == [5] and logp[0] != logp[0]  # a missing log-prob becomes NaN (TokenStream refuses it)


def test_finish_reasons_and_update_answers():
    assert finish_reason({"finish_reason": {"type": "length", "length": 8}}) == "length"
    assert finish_reason({"finish_reason": {"type": "stop", "matched": 2}}) == "stop"
    with pytest.raises(RuntimeError, match="SGLang aborted a request: out of memory"):
        finish_reason({"finish_reason": {"type": "abort", "message": "out of memory"}})
    with pytest.raises(RuntimeError, match="unknown finish reason"):
        finish_reason({"finish_reason": None})
    bucket = WeightBucket(3, 1, True, {})
    check_update((True, "ok"), bucket)
    check_update(types.SimpleNamespace(success=True), bucket)
    with pytest.raises(RuntimeError, match="rejected weight bucket 1 of version 3: shape mismatch"):
        check_update((False, "shape mismatch"), bucket)


def test_sampling_is_plain_temperature_with_the_rows_seed():
    params = SamplingParams(n=2, max_new_tokens=7, temperature=0.8)
    assert sglang_sampling(params, None) == {"temperature": 0.8, "top_p": 1.0, "top_k": -1, "max_new_tokens": 7}
    assert sglang_sampling(params, 42)["sampling_seed"] == 42
    assert sglang_sampling(SamplingParams(greedy=True), None)["temperature"] == 0.0


# ---- the engine's code against a stand-in of SGLang's API ------------------------------------------


@dataclass
class PauseGenerationReqInput:
    mode: str = "abort"


@dataclass
class ContinueGenerationReqInput:
    pass


@dataclass
class UpdateWeightsFromTensorReqInput:
    serialized_named_tensors: list
    load_format: str | None = None
    flush_cache: bool = True


class StandInManager:
    """SGLang's tokenizer manager, as far as the engine uses it: pausing is a message to the
    scheduler (it returns at once; a step in progress still finishes), a paused scheduler takes
    updates at once and answers quicker than tokens travel through the detokenizer, a flush fails
    while requests run."""

    def __init__(self, owner: "StandInSGLang"):
        self.owner, self.calls = owner, []

    async def pause_generation(self, obj):
        self.calls.append(("pause", obj.mode))
        self.owner.running.clear()

    async def continue_generation(self, obj):
        self.calls.append(("continue",))
        self.owner.running.set()

    async def update_weights_from_tensor(self, obj, request):
        assert len(obj.serialized_named_tensors) == self.owner.server_args.tp_size  # one payload per TP rank
        named = pickle.loads(obj.serialized_named_tensors[0])
        self.calls.append(("update", [n for n, _ in named], obj.flush_cache))
        self.owner.received.update(named)
        if self.owner.refuse is not None and self.owner.refuse(named):
            return False, "dtype mismatch"
        await asyncio.sleep(UPDATE_S)
        marker = dict(named).get("version_marker")
        if marker is not None:
            self.owner.weights = int(marker.item())
        return True, "Succeeded to update model weights."

    async def flush_cache(self):
        self.calls.append(("flush", self.owner.requests))
        return types.SimpleNamespace(success=self.owner.requests == 0)


UPDATE_S = 0.001
"""The stand-in's update answers this fast..."""
DETOKENIZER_S = 0.01
"""...while a decoded token reaches the tokenizer manager this much later (through the detokenizer)."""


class StandInSGLang:
    """Streams every request's running totals by reference (SGLang hands out its growing state lists);
    each token's log-prob encodes the weights its decoding step used (-1 - weights)."""

    def __init__(self):
        self.server_args = types.SimpleNamespace(tp_size=2)
        self.tokenizer_manager = StandInManager(self)
        self.weights, self.requests, self.refuse = 0, 0, None
        self.received: dict[str, torch.Tensor] = {}  # every tensor handed over, by name
        self.running = asyncio.Event()
        self.running.set()
        self.threads: set[str] = set()

    async def async_generate(self, input_ids, sampling_params, return_logprob, top_logprobs_num, stream, rid):
        assert stream and return_logprob
        self.threads.add(threading.current_thread().name)
        tokens, loop = sampling_params["max_new_tokens"], asyncio.get_running_loop()

        async def chunks():
            self.requests += 1
            state, arrived = [], asyncio.Queue()  # SGLang's per-request list, extended in place, handed out by reference

            async def scheduler():
                for i in range(tokens):
                    await self.running.wait()
                    weights = self.weights  # the step runs with the weights loaded when it starts
                    await asyncio.sleep(0.001)
                    loop.call_later(DETOKENIZER_S, arrived.put_nowait, (-1.0 - weights, 100 + i, None))

            decoding = asyncio.ensure_future(scheduler())
            for i in range(tokens):
                state.append(await arrived.get())
                done = i == tokens - 1
                yield {"meta_info": {"output_token_logprobs": state, "finish_reason": {"type": "length"} if done else None}}
            await decoding
            self.requests -= 1

        return chunks()


@pytest.fixture
def standin(monkeypatch):
    io_struct = types.SimpleNamespace(
        PauseGenerationReqInput=PauseGenerationReqInput, ContinueGenerationReqInput=ContinueGenerationReqInput,
        UpdateWeightsFromTensorReqInput=UpdateWeightsFromTensorReqInput,
    )
    # SGLang's MultiprocessingSerializer pickles with multiprocessing's ForkingPickler (plain pickle
    # cannot rebuild an fp8 tensor's storage in torch 2.13)
    utils = types.SimpleNamespace(MultiprocessingSerializer=types.SimpleNamespace(serialize=lambda obj: bytes(ForkingPickler.dumps(obj))))
    for name, module in {"sglang": types.ModuleType("sglang"), "sglang.srt": types.ModuleType("sglang.srt"),
                         "sglang.srt.managers": types.ModuleType("sglang.srt.managers"), "sglang.srt.managers.io_struct": io_struct,
                         "sglang.srt.utils": utils}.items():
        monkeypatch.setitem(sys.modules, name, module)
    engine = SGLangEngine.__new__(SGLangEngine)
    engine._attach(StandInSGLang(), tokenizer=None, version=0)
    yield engine
    engine._loop.close()


def publication(version: int, buckets: int = 2) -> list[WeightBucket]:
    return [WeightBucket(version, i, i == buckets - 1, {f"w{i}": torch.full((2,), float(version)), "version_marker": torch.tensor(version)}) for i in range(buckets)]


def wait_for(condition, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def test_an_update_mid_response_pauses_in_place_and_every_token_carries_the_version_that_sampled_it(standin):
    sglang = standin.engine
    result = []
    rollout = threading.Thread(target=lambda: result.extend(standin.generate([[1, 2], [3]], SamplingParams(n=2, max_new_tokens=40))))
    rollout.start()
    wait_for(lambda: standin.tokens_received >= 20)
    standin.update_weights(publication(1))  # from this (the actor's) thread while the rollout thread's requests decode
    wait_for(lambda: standin.tokens_received >= 80)
    standin.update_weights(publication(2))
    rollout.join()
    completions = [c for group in result for c in group]
    assert len(completions) == 4
    for c in completions:
        produced_by = (-1.0 - c.rollout_logp).round().long()
        assert torch.equal(c.versions, produced_by), (c.versions, produced_by)  # exact, although tokens arrive after the update's reply
        assert c.response_ids.tolist() == list(range(100, 140)) and c.finish_reason == "length"
    assert {int(v) for c in completions for v in c.versions} == {0, 1, 2}  # the responses spanned both updates
    calls = [c for c in sglang.tokenizer_manager.calls if c[0] != "flush"]
    assert calls == [("pause", "in_place"), ("update", ["w0", "version_marker"], False), ("update", ["w1", "version_marker"], False), ("continue",)] * 2
    assert standin.version == 2 and sglang.threads == {"sglang-engine-loop"}  # one loop, one thread


def test_the_cache_is_flushed_before_the_next_generate_and_checksums_track_what_was_handed_over(standin):
    standin.weight_checksums()  # turns the tracking on
    standin.update_weights(publication(1, buckets=1))
    assert standin.served.cache_stale
    standin.generate([[1]], SamplingParams(n=1, max_new_tokens=3))
    manager = standin.engine.tokenizer_manager
    assert ("flush", 0) in manager.calls and not standin.served.cache_stale  # flushed with no request running
    assert standin.weight_checksums()["w0"] == tensor_checksum(torch.full((2,), 1.0))


def test_an_older_publication_is_skipped(standin):
    standin.update_weights(publication(3, buckets=1))
    calls = len(standin.engine.tokenizer_manager.calls)
    standin.update_weights(publication(2, buckets=1))
    assert standin.version == 3 and len(standin.engine.tokenizer_manager.calls) == calls


def test_a_bucket_rejected_part_way_names_itself_and_generation_waits_for_a_whole_publication(standin):
    sglang = standin.engine
    sglang.refuse = lambda named: "w1" in dict(named)  # bucket 0 loads, bucket 1 is refused
    with pytest.raises(RuntimeError, match="rejected weight bucket 1 of version 1: dtype mismatch"):
        standin.update_weights(publication(1))
    assert standin.version == 0 and sglang.tokenizer_manager.calls[-1] == ("continue",)  # generation was resumed
    with pytest.raises(RuntimeError, match="serves no whole publication"):  # half of version 1 is loaded: no version describes it
        standin.generate([[1]], SamplingParams(n=1, max_new_tokens=2))
    sglang.refuse = None
    standin.update_weights(publication(1))
    assert standin.generate([[1]], SamplingParams(n=1, max_new_tokens=2))[0][0].versions.tolist() == [1, 1]


def test_fp8_publications_are_handed_over_as_block_fp8_with_their_scales(standin):
    from rollout.fp8 import FP8_DTYPE, dequantize_block

    standin.fp8_block = 16  # as SGLangEngine sets it for precision fp8 (rollout.fp8_block)
    standin.weight_checksums()
    g = torch.Generator().manual_seed(0)
    q_proj, norm = torch.randn(32, 48, generator=g), torch.rand(48, generator=g)
    names = {"model.layers.0.self_attn.q_proj.weight": q_proj, "model.norm.weight": norm, "version_marker": torch.tensor(1)}
    standin.update_weights([WeightBucket(1, 0, True, names)])
    got = standin.engine.received
    assert set(got) == {*names, "model.layers.0.self_attn.q_proj.weight_scale_inv"}
    assert got["model.layers.0.self_attn.q_proj.weight"].dtype == FP8_DTYPE and got["model.layers.0.self_attn.q_proj.weight_scale_inv"].shape == (2, 3)
    served = dequantize_block(got["model.layers.0.self_attn.q_proj.weight"], got["model.layers.0.self_attn.q_proj.weight_scale_inv"], 16)
    assert (served - q_proj).abs().max() <= q_proj.abs().max() / 16 and torch.equal(got["model.norm.weight"], norm)
    assert standin.version == 1 and standin.weight_checksums()["model.layers.0.self_attn.q_proj.weight"] == tensor_checksum(q_proj)  # as received


class StandInMembership:
    """learner.weights.broadcast.Membership as receive_weights uses it: ``run(fn)`` calls fn on the group,
    whose ``receive()`` returns the broadcast's next bucket."""

    def __init__(self, buckets: list[WeightBucket]):
        self.buckets, self.received = list(buckets), 0

    def run(self, fn):
        group = types.SimpleNamespace(receive=self._next)
        return fn(group)

    def _next(self) -> WeightBucket:
        self.received += 1
        return self.buckets.pop(0)


def test_a_broadcast_publication_is_received_bucket_by_bucket_under_one_pause_mid_response(standin):
    with pytest.raises(RuntimeError, match="never joined a weight broadcast group"):
        standin.receive_weights()
    sglang = standin.engine
    standin._weights_membership = StandInMembership(publication(1, buckets=3))
    result = []
    rollout = threading.Thread(target=lambda: result.extend(standin.generate([[1]], SamplingParams(n=2, max_new_tokens=40))))
    rollout.start()
    wait_for(lambda: standin.tokens_received >= 20)
    assert standin.receive_weights() == 1  # the actor's thread, while the rollout thread's requests decode
    rollout.join()
    assert standin._weights_membership.received == 3 and standin.version == 1
    calls = [c for c in sglang.tokenizer_manager.calls if c[0] != "flush"]
    assert calls == [("pause", "in_place"), *[("update", [f"w{i}", "version_marker"], False) for i in range(3)], ("continue",)]
    for c in (c for group in result for c in group):
        assert torch.equal(c.versions, (-1.0 - c.rollout_logp).round().long())  # each token: the weights that decoded it
        assert set(c.versions.tolist()) == {0, 1}
