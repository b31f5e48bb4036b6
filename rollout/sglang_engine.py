"""The ``sglang`` engine: ``sglang.Engine`` (the offline engine). GPU only — SGLang has no CPU build.

Written against SGLang 0.5.9–0.5.20's public API (read from the released wheels; the ``sglang``
extra pins that range) and exercised by tests marked ``gpu``; no GPU was available when it was
written, so treat it as unverified until those tests have run. 0.5.21 made weight updates require a
``begin_weight_update``/``end_weight_update`` session, which this engine does not open yet.

One loop, one thread. SGLang's Engine drives an asyncio loop with ``run_until_complete`` from
every synchronous method, so calls from two threads (the rollout thread's generate, the actor
thread's weight update) would race on it. The engine is built in the constructing thread (its
start-up installs signal handlers, which Python allows only there) and afterwards only its
tokenizer manager's coroutines are used, all on one ``EngineLoop`` (rollout/inflight.py); the
tokenizer manager binds its response loop to the first running loop that calls it, that one.

Per-token versions. Every sample is one streamed request (``async_generate(stream=True)``); SGLang
0.5.9-0.5.20 streams running totals (``output_token_logprobs`` holds every token so far), and each
new token is stamped with the version served when it arrived (``TokenStream.extend_to``). A weight
update pauses the scheduler in place (``pause_generation(mode="in_place")``: requests keep their KV
cache and continue on it), loads the tensors (``update_weights_from_tensor``, which runs at once
while paused), waits until tokens decoded before the pause have arrived (they travel through
SGLang's detokenizer process, the update's reply does not: ``SETTLE_QUIET_S``), bumps the version
and continues (``continue_generation``). The prefix-cache rule is the vLLM engine's (an in-place
pause cannot flush with requests running, so the cache is flushed before the next generate call).

fp8: SGLang quantizes *online* fp8 weights at load, but ``update_weights_from_tensor`` only calls
the model's ``load_weights`` and never re-runs that quantization. So fp8 rollout here is block-wise
fp8 done on drpo's side, as verl and slime do it (rollout/fp8.py): the engine starts from a copy of
the model written as a block-fp8 checkpoint (``quantization_config`` with ``weight_block_size``,
which SGLang loads natively), and every publication's projections are quantized the same way
(fp8 weight + ``weight_scale_inv``) on this GPU before they are handed over. Every fused q/k/v and
gate/up part must be a multiple of the block (``rollout.fp8_block``; SGLang refuses the model
otherwise, and drpo refuses it at load naming the widths). With a block other than 128 the engine
turns SGLang's DeepGEMM path off (``SGLANG_ENABLE_JIT_DEEPGEMM=0``: DeepGEMM assumes 128x128
tiles) so its triton block-fp8 kernel runs. The fp8 copy is written per engine, on the host, into
a temporary folder removed at ``close``. Written against SGLang's fp8 checkpoint format; not yet
run on a GPU.

Seeds: SGLang honours a request's ``sampling_seed`` only with ``enable_deterministic_inference``
(pass it through ``rollout.engine_kwargs``); without it seeded runs draw differently.

Log-probs: SGLang reports the log-probs of the distribution it sampled from (after temperature)
unless RETURN_ORIGINAL_LOGPROB is set; this engine sets it to false so mu has the hf and vllm
engines' definition.

Weights. An object-store publication is moved to this GPU and handed to SGLang's scheduler as CUDA
IPC handles (``MultiprocessingSerializer``, as SGLang's own ``update_weights_from_tensor`` does):
no file, no host round trip in the scheduler. With ``learner.weight_sync: broadcast`` this actor joins
the learner's group (learner/weights/broadcast.py: NCCL, on the GPU it shares with SGLang's scheduler),
receives each bucket into GPU memory and hands it over the same way, bucket by bucket under one pause.
SGLang's own ``init_weights_update_group``/``update_weights_from_distributed`` is not used: it wants
one broadcast per tensor, announced by an API call before it is sent, on a group built with its own
rendezvous; receiving drpo's bucketed broadcast here keeps one protocol for every engine.
"""

from __future__ import annotations

import itertools
import os
from typing import Iterable

import torch

from learner.weights.wire import WeightBucket
from rollout.engine import Completion, Engine, Precision, SamplingParams, private_folder, remove_private_folder, tensor_checksum
from rollout.fp8 import quantize_named, write_fp8_folder
from rollout.inflight import EngineLoop, ServedWeights, TokenStream

FP8_SCRATCH_PREFIX = "drpo-sglang-fp8-"
"""The folder of an fp8 copy of the model, on a host where SGLang quantizes it from ours."""
SETTLE_QUIET_S = 0.02
"""After a load, the version is bumped once no token has arrived for this long (the scheduler is
paused, so only tokens decoded before the pause are still on their way through the detokenizer)."""
SETTLE_MAX_S = 2.0
"""Give up waiting for quiet after this long (a stream that keeps delivering is a bug upstream)."""


class SGLangEngine(Engine):
    def __init__(
        self, model_folder: str, precision: Precision = "bf16", version: int = 0, seed: int = 0, mem_fraction_static: float = 0.6,
        fp8_block: int = 128, **engine_kwargs,
    ):
        os.environ["RETURN_ORIGINAL_LOGPROB"] = "false"
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        if not torch.cuda.is_available():
            raise RuntimeError("the sglang engine needs a CUDA GPU (SGLang has no CPU build); use the hf or vllm engine")
        import sglang
        from transformers import AutoTokenizer

        served_folder, self._scratch = str(model_folder), None
        if precision == "fp8":  # SGLang loads the block-fp8 copy as an fp8 checkpoint
            if fp8_block != 128:  # DeepGEMM, SGLang's default fp8 GEMM on Hopper, assumes 128x128 tiles: its triton kernel takes others
                os.environ.setdefault("SGLANG_ENABLE_JIT_DEEPGEMM", "0")
            self._scratch = private_folder(FP8_SCRATCH_PREFIX)
            served_folder = str(write_fp8_folder(model_folder, self._scratch, fp8_block))
        kwargs = dict(
            model_path=served_folder, dtype="float32" if precision == "fp32" else "bfloat16", random_seed=seed,
            mem_fraction_static=mem_fraction_static,
        )
        engine = sglang.Engine(**{**kwargs, **engine_kwargs})
        self._attach(engine, AutoTokenizer.from_pretrained(model_folder), version, fp8_block if precision == "fp8" else None)

    def _attach(self, engine, tokenizer, version: int, fp8_block: int | None = None) -> None:
        """Serve ``engine`` (an sglang.Engine, or a stand-in in tests) from a new engine loop;
        ``fp8_block``: publications are quantized to block fp8 of that block before loading."""
        self.fp8_block = fp8_block
        self.served = ServedWeights(version)
        self._ids = itertools.count()
        self._sums: dict[str, str] | None = None
        self.tokens_received = 0
        """Response tokens streamed back so far, over all requests (progress; tests use it)."""
        self.tokenizer = tokenizer
        self.engine = engine
        self._loop = EngineLoop("sglang-engine-loop")
        self._record_engine_processes("sglang")  # its scheduler and detokenizer processes: one gone is a crashed engine

    @property
    def version(self) -> int:
        return self.served.version

    # ---- generation ---------------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        """See Engine.generate: every sample is its own streamed request (with its row's seed)."""
        self.check_prompts(prompts)
        rows = [list(p) for p in prompts for _ in range(params.n)]
        completions = self._loop.run(self._generate(rows, params, params.row_seeds(len(prompts))))
        return [completions[i * params.n : (i + 1) * params.n] for i in range(len(prompts))]

    async def _generate(self, rows: list[list[int]], params: SamplingParams, seeds: list[int] | None) -> list[Completion]:
        import asyncio

        self.served.check()
        await self.served.fresh_cache(self._flush_cache)
        tasks = [asyncio.ensure_future(self._sample(row, sglang_sampling(params, seeds and seeds[i]), params.topk_logprobs)) for i, row in enumerate(rows)]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for task in tasks:  # a failed request must not leave its siblings running
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    async def _sample(self, row: list[int], sampling: dict, k: int) -> Completion:
        stream, meta = TokenStream(self.served, k), {}
        chunks = await self.engine.async_generate(
            input_ids=row, sampling_params=sampling, return_logprob=True, top_logprobs_num=k or None, stream=True, rid=f"drpo-{next(self._ids)}",
        )
        async for chunk in chunks:
            meta = chunk["meta_info"]
            self.tokens_received += stream.extend_to(*running_totals(meta, k))
        return stream.completion(row, finish_reason(meta))

    async def _flush_cache(self) -> bool:
        return bool(getattr(await self.engine.tokenizer_manager.flush_cache(), "success", False))

    # ---- weights ------------------------------------------------------------------------------------

    def update_weights(self, buckets: Iterable[WeightBucket]) -> None:
        """Load an object-store publication: every bucket under one in-place pause (the version
        changes once, after the last)."""
        buckets = list(buckets)
        self._loop.run(self._swap(lambda: self._load_all(buckets), buckets[-1].version if buckets else None))

    def receive_weights(self) -> int:
        """Receive a broadcast publication bucket by bucket into this GPU and load each as it
        arrives, under one in-place pause; returns its version."""
        membership = getattr(self, "_weights_membership", None)
        if membership is None:
            raise RuntimeError("this engine never joined a weight broadcast group")

        async def load():
            while True:
                bucket = membership.run(lambda group: group.receive())  # blocks this loop: the scheduler is paused anyway
                await self._load_bucket(bucket)
                if bucket.last:
                    return bucket.version

        return self._loop.run(self._swap(load))

    async def _swap(self, load, version: int | None = None) -> int:
        from sglang.srt.managers.io_struct import ContinueGenerationReqInput, PauseGenerationReqInput

        manager = self.engine.tokenizer_manager

        async def pause():
            await manager.pause_generation(PauseGenerationReqInput(mode="in_place"))

        async def resume():
            await manager.continue_generation(ContinueGenerationReqInput())

        return await self.served.swap(pause, load, resume, version, settle=self._settle)

    async def _settle(self) -> None:
        """Wait until tokens stop arriving (SETTLE_QUIET_S without one, at most SETTLE_MAX_S)."""
        import asyncio

        waited = 0.0
        while waited < SETTLE_MAX_S:
            seen = self.tokens_received
            await asyncio.sleep(SETTLE_QUIET_S)
            waited += SETTLE_QUIET_S
            if self.tokens_received == seen:
                return

    async def _load_all(self, buckets: list[WeightBucket]) -> int | None:
        for bucket in buckets:
            await self._load_bucket(bucket)
        return buckets[-1].version if buckets and buckets[-1].last else None

    async def _load_bucket(self, bucket: WeightBucket) -> None:
        from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput
        from sglang.srt.utils import MultiprocessingSerializer

        if torch.cuda.is_available():  # the scheduler reads the tensors through CUDA IPC handles
            _patch_torch_reductions()
            device = torch.device("cuda", torch.cuda.current_device())
            named = [(name, t.to(device, non_blocking=True)) for name, t in bucket.tensors.items()]
        else:
            named = list(bucket.tensors.items())
        if self.fp8_block is not None:  # quantized where the tensors are (this GPU)
            named = list(quantize_named(named, self.fp8_block))
        if torch.cuda.is_available():
            torch.cuda.current_stream().synchronize()
        payload = MultiprocessingSerializer.serialize(named)
        request = UpdateWeightsFromTensorReqInput(
            serialized_named_tensors=[payload] * self.engine.server_args.tp_size, load_format=None, flush_cache=False,
        )
        result = await self.engine.tokenizer_manager.update_weights_from_tensor(request, None)
        check_update(result, bucket)
        if self._sums is not None:
            self._sums.update({name: tensor_checksum(t) for name, t in bucket.tensors.items()})

    def weight_checksums(self) -> dict[str, str]:
        """Checksums (HF names) of the publications' tensors this engine loaded since the first call
        (which turns the tracking on), as received (before any fp8 quantization); SGLang offers no
        full read-back of its weights."""
        if self._sums is None:
            self._sums = {}
        return dict(self._sums)

    def close(self) -> None:
        try:
            self.engine.shutdown()
        finally:
            self._loop.close()
            if getattr(self, "_scratch", None):
                remove_private_folder(self._scratch, FP8_SCRATCH_PREFIX)


# ---- SGLang's request/response format (pure; tests/test_sglang_bookkeeping.py) ------------------------------


def sglang_sampling(params: SamplingParams, seed: int | None) -> dict:
    """SGLang sampling parameters of one sample: temperature only (no top-p/top-k truncation, so mu
    is the distribution sampled from), greedy as temperature 0, the row's seed when seeded."""
    sampling = {"temperature": 0.0 if params.greedy else params.temperature, "top_p": 1.0, "top_k": -1, "max_new_tokens": params.max_new_tokens}
    if seed is not None:
        sampling["sampling_seed"] = seed
    return sampling


def running_totals(meta: dict, k: int) -> tuple[list[int], list[float], list[list[int]] | None, list[list[float]] | None]:
    """Token ids, log-probs and top-K ids/log-probs of everything sampled so far, from one streamed
    chunk's ``meta_info`` (``output_token_logprobs``: [(logprob, token id, text)], and per step
    ``output_top_logprobs``: [(logprob, token id, text)] best first)."""
    steps = meta.get("output_token_logprobs")
    if steps is None:
        raise RuntimeError("SGLang returned no output_token_logprobs (was return_logprob dropped?)")
    ids = [int(t) for _, t, *_ in steps]
    logp = [float(lp) if lp is not None else float("nan") for lp, *_ in steps]
    if not k:
        return ids, logp, None, None
    tops = meta.get("output_top_logprobs") or []
    if len(tops) != len(steps):
        raise RuntimeError(f"SGLang returned top-{k} log-probs for {len(tops)} of {len(steps)} tokens")
    top_ids = [[int(t) for _, t, *_ in step[:k]] for step in tops]
    top_logp = [[float(lp) for lp, *_ in step[:k]] for step in tops]
    if any(len(row) != k for row in top_ids):
        raise RuntimeError(f"SGLang returned fewer than {k} top log-probs at some step")
    return ids, logp, top_ids, top_logp


def finish_reason(meta: dict) -> str:
    """"length" when SGLang stopped at max_new_tokens, "stop" for a stop token or string; an aborted
    request (SGLang's own abort, an out-of-memory retraction that failed) is an error, not a sample."""
    finish = meta.get("finish_reason") or {}
    kind = finish.get("type") if isinstance(finish, dict) else str(finish)
    if kind == "abort":
        raise RuntimeError(f"SGLang aborted a request: {finish.get('message', finish)}")
    if kind not in ("length", "stop"):
        raise RuntimeError(f"SGLang ended a request with an unknown finish reason {finish!r}")
    return kind


def check_update(result, bucket: WeightBucket) -> None:
    """``update_weights_from_tensor`` answers (success, message) (older releases an object with
    ``success``); a refusal names the bucket."""
    ok, message = (result[0], result[1] if len(result) > 1 else "") if isinstance(result, tuple) else (getattr(result, "success", False), getattr(result, "message", ""))
    if not ok:
        raise RuntimeError(f"SGLang rejected weight bucket {bucket.index} of version {bucket.version}: {message}")


def _patch_torch_reductions() -> None:
    """SGLang's fix of CUDA IPC handles across processes that see different device indices
    (applied by SGLang's own callers of update_weights_from_tensor)."""
    try:
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
    except ImportError:  # older releases
        from sglang.srt.patch_torch import monkey_patch_torch_reductions
    monkey_patch_torch_reductions()
