"""The ``sglang`` engine: ``sglang.Engine`` (offline engine API). GPU only — SGLang has no CPU build.

Written against SGLang's public offline API (``Engine.generate`` with ``input_ids``,
``return_logprob`` and ``top_logprobs_num``; ``update_weights_from_tensor``) and exercised by
tests marked ``gpu``; no GPU was available when it was written, so treat it as unverified until
those tests have run.

Log-probs: SGLang reports the log-probs of the distribution it sampled from (after temperature)
unless RETURN_ORIGINAL_LOGPROB is set; this engine sets it to false explicitly so mu has the same
definition as the hf and vllm engines. n samples per prompt are requested as n copies of the
prompt. Weight updates go through ``update_weights_from_tensor`` bucket by bucket (the KV cache is
flushed with the last bucket); SGLang's NCCL path (``init_weights_update_group`` +
``update_weights_from_distributed``) expects one broadcast per tensor and is not wired to
learner/broadcast.py's bucketed protocol yet.
"""

from __future__ import annotations

import os
from typing import Iterable

import torch

from learner.publish import WeightBucket
from rollout.engine import Completion, Engine, Precision, SamplingParams


class SGLangEngine(Engine):
    def __init__(self, model_folder: str, precision: Precision = "bf16", version: int = 0, seed: int = 0, mem_fraction_static: float = 0.6, **engine_kwargs):
        os.environ["RETURN_ORIGINAL_LOGPROB"] = "false"
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        import sglang

        if not torch.cuda.is_available():
            raise RuntimeError("the sglang engine needs a CUDA GPU (SGLang has no CPU build); use the hf or vllm engine")
        kwargs = dict(
            model_path=str(model_folder), dtype="float32" if precision == "fp32" else "bfloat16", random_seed=seed,
            mem_fraction_static=mem_fraction_static,
        )
        if precision == "fp8":
            kwargs["quantization"] = "fp8"
        self.engine = sglang.Engine(**{**kwargs, **engine_kwargs})
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_folder)
        self.version = version


    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        self.check_prompts(prompts)
        rows = [list(p) for p in prompts for _ in range(params.n)]
        sampling = {"temperature": 0.0 if params.greedy else params.temperature, "top_p": 1.0, "top_k": -1, "max_new_tokens": params.max_new_tokens}
        seeds = params.row_seeds(len(prompts))
        if seeds is not None:  # one sampling dict per row, each with its own seed
            sampling = [{**sampling, "sampling_seed": seed} for seed in seeds]
        outs = self.engine.generate(
            input_ids=rows, sampling_params=sampling, return_logprob=True, top_logprobs_num=params.topk_logprobs or None
        )
        completions = [self._completion(row, out, params.topk_logprobs) for row, out in zip(rows, outs)]
        return [completions[i * params.n : (i + 1) * params.n] for i in range(len(prompts))]

    def _completion(self, prompt: list[int], out: dict, k: int) -> Completion:
        meta = out["meta_info"]
        token_logprobs = meta["output_token_logprobs"]  # [(logprob, token_id, text), ...]
        ids = torch.tensor([t for _, t, _ in token_logprobs], dtype=torch.long)
        logp = torch.tensor([lp for lp, _, _ in token_logprobs], dtype=torch.float32)
        if not torch.isfinite(logp).all():
            raise RuntimeError("SGLang returned a non-finite log-prob for a sampled token")
        top_ids = top_logp = None
        if k:
            tops = meta["output_top_logprobs"]
            top_ids = torch.tensor([[t for _, t, _ in step[:k]] for step in tops], dtype=torch.long)
            top_logp = torch.tensor([[lp for lp, _, _ in step[:k]] for step in tops], dtype=torch.float32)
        finish = meta.get("finish_reason") or {}
        return Completion(
            prompt_ids=torch.tensor(prompt), response_ids=ids, rollout_logp=logp,
            versions=torch.full((len(ids),), self.version, dtype=torch.long),
            finish_reason="length" if finish.get("type") == "length" else "stop", topk_ids=top_ids, topk_logp=top_logp,
        )

    def update_weights(self, buckets: Iterable[WeightBucket]) -> None:
        for bucket in buckets:
            result = self.engine.update_weights_from_tensor(named_tensors=list(bucket.tensors.items()), flush_cache=bucket.last)
            ok = result[0] if isinstance(result, tuple) else getattr(result, "success", True)
            if not ok:
                raise RuntimeError(f"SGLang rejected weight bucket {bucket.index} of version {bucket.version}: {result}")
            if bucket.last:
                self.version = bucket.version

    def close(self) -> None:
        self.engine.shutdown()
