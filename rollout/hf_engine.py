"""The ``hf`` engine: plain transformers with a KV cache and batched sampling. The light default.

Log-probs are *processed*: log softmax(logits / T) of the full vocabulary, exactly the distribution
each token is sampled from (no top-p/top-k truncation). Prompts are left-padded and prefilled once
each; the KV cache is then repeated for the n samples, decoded as one batch of len(prompts) * n
rows; finished rows keep decoding padding until every row stops, and their extra tokens are dropped.

Weight updates are staged bucket by bucket and swapped in between two decoding steps, under a lock,
when the publication's last bucket arrives; the KV cache of tokens already decoded is kept (as
vLLM's in-flight updates do), so a response spanning an update records the old version for its
earlier tokens and the new one after.
"""

from __future__ import annotations

import inspect
import threading
from typing import Callable, Iterable

import torch

from learner.weights.hf_io import unfuse_experts
from learner.weights.wire import WeightBucket
from rollout.engine import Completion, Engine, Precision, SamplingParams, fake_quantize_fp8, tensor_checksum
from rollout.routing import RoutingRecorder, per_row


def sample_categorical(logp: torch.Tensor, generators: list[torch.Generator] | None = None) -> torch.Tensor:
    """One token per row of log-probs [rows, V], by inverting the float64 CDF at a uniform draw.

    Exact for the categorical softmax(logits / T) (a token of probability 0 is never drawn: the CDF
    does not rise at it), and ~15x faster than torch.multinomial on CPU, whose exponential draws
    over the whole vocabulary cost more than the model's decoding step (measured: 67 ms per call at
    64 x 49,152). ``generators``: one per row (seeded sampling), else torch's global stream."""
    cdf = logp.double().exp_().cumsum_(dim=-1)
    if generators is None:
        u = torch.rand((logp.shape[0], 1), dtype=torch.float64, device=logp.device)
    else:  # the generators are CPU streams (seeded the same on every device); the draws move to logp's
        u = torch.cat([torch.rand((1, 1), dtype=torch.float64, generator=g) for g in generators]).to(logp.device)
    u = u * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).squeeze(1).clamp_(max=logp.shape[-1] - 1)


class HFEngine(Engine):
    def __init__(
        self, model_folder: str, precision: Precision = "fp32", version: int = 0, num_threads: int | None = None, device: str | None = None,
    ):
        """``device``: where the model runs; None = the first CUDA device this process sees (a Ray
        worker given a GPU sees its own), else the CPU. Completions always come back on the CPU."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if num_threads:
            torch.set_num_threads(num_threads)
        self.precision = precision
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        self.model = AutoModelForCausalLM.from_pretrained(model_folder, torch_dtype=dtype, attn_implementation="eager").eval().to(self.device)
        self.tokenizer = AutoTokenizer.from_pretrained(model_folder)
        self.eos_ids = self._eos_ids()
        self._eos = torch.tensor(self.eos_ids, device=self.device)
        forward = inspect.signature(self.model.forward).parameters
        # transformers renamed past_key_values to cache (the old name goes in 5.40); support both
        self._cache_arg = "cache" if "cache" in forward else "past_key_values"
        # the prefill needs the last position's logits only: the vocabulary projection of every prompt
        # position would cost a quarter of an evaluation call's prefill (64 prompts x 38 tokens x 49,152)
        self._last_logits = {"logits_to_keep": 1} if "logits_to_keep" in forward else {}
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_ids[0]
        if precision == "fp8":
            self._load({k: v for k, v in self.model.state_dict().items()})
        self.version = version
        self._lock = threading.Lock()
        self._staged: dict[str, torch.Tensor] = {}
        self._pending: tuple[int, dict[str, torch.Tensor]] | None = None
        self._running = threading.Event()
        self._running.set()
        self._routing = RoutingRecorder(self.model)  # MoE models: the experts each position was routed to
        self.share_prefix = True
        """Prefill the tokens every prompt of a call starts with (a chat template's system turn) once,
        not once per prompt (evaluation calls hold many prompts: the prefill is most of their time)."""

    def _eos_ids(self) -> list[int]:
        eos = self.model.generation_config.eos_token_id
        eos = eos if isinstance(eos, list) else [eos if eos is not None else self.tokenizer.eos_token_id]
        return [int(e) for e in eos if e is not None]

    # ---- weights ------------------------------------------------------------------------------------

    def update_weights(self, buckets: Iterable[WeightBucket]) -> None:
        for bucket in buckets:
            self._staged.update(bucket.tensors)
            if bucket.last:
                with self._lock:
                    self._pending = (bucket.version, self._staged)
                self._staged = {}

    def _apply_pending(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is not None:
            version, tensors = pending
            self._load(tensors)
            self.version = version

    def _own(self) -> dict[str, torch.Tensor]:
        """The model's tensors under the names publications use: MoE experts one tensor per expert
        (views into transformers' fused in-memory layout, so writing one writes the model)."""
        return unfuse_experts(self.model.state_dict())

    def _load(self, tensors: dict[str, torch.Tensor]) -> None:
        own = self._own()
        unknown = sorted(set(tensors) - set(own))
        if unknown:
            raise KeyError(f"weight update names tensors the model does not have: {unknown[:5]}")
        with torch.no_grad():
            for name, t in tensors.items():
                own[name].copy_(self._as_loaded(t, own[name]))
            if self.model.config.tie_word_embeddings:
                self.model.tie_weights()

    def weight_checksums(self) -> dict[str, str]:
        """Of the weights the next decoding step uses: the model's, with a staged publication's on top."""
        with self._lock:
            pending = self._pending[1] if self._pending is not None else {}
        own = self._own()
        return {name: tensor_checksum(self._as_loaded(pending[name], own[name]) if name in pending else t) for name, t in own.items()}

    def _as_loaded(self, t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """``t`` as ``_load`` writes it into a parameter like ``like``."""
        t = fake_quantize_fp8(t.float()) if self.precision == "fp8" and t.dim() >= 2 else t
        return t.to(like.dtype)

    def pause(self) -> None:
        self._running.clear()

    def resume(self) -> None:
        self._running.set()

    # ---- generation ---------------------------------------------------------------------------------

    @torch.no_grad()
    def generate(
        self, prompts: list[list[int]], params: SamplingParams, on_step: Callable[[int], None] | None = None
    ) -> list[list[Completion]]:
        """See Engine.generate. ``on_step(step)`` runs before each decoding step (tests, heartbeats)."""
        self.check_prompts(prompts)
        self._apply_pending()
        rows = [list(p) for p in prompts for _ in range(params.n)]
        # the prompts are prefilled once each; their KV cache and first logits are then repeated
        # for the n samples (each prompt's n rows are identical until the first sampled token)
        shared = self._shared_prefix(prompts)
        # after a shared prefix, each prompt's rest is left-padded: the padding sits between the two
        # (masked out, and the positions count only real tokens)
        tails = [p[shared:] for p in prompts]
        rest = max(len(t) for t in tails)
        width = shared + rest  # the longest prompt
        ids = torch.tensor([[self.pad_id] * (rest - len(t)) + list(t) for t in tails], device=self.device)
        mask = torch.tensor([[1] * shared + [0] * (rest - len(t)) + [1] * len(t) for t in tails], device=self.device)
        seeds = params.row_seeds(len(prompts))
        gen = [torch.Generator().manual_seed(s) for s in seeds] if seeds is not None else None
        tokens, logps, versions, tops = [], [], [], []
        self._routing.take()
        done = torch.zeros(len(rows), dtype=torch.bool, device=self.device)
        past, step_input = None, ids
        for step in range(params.max_new_tokens):
            if on_step is not None:
                on_step(step)
            self._running.wait()
            self._apply_pending()
            positions = (mask.cumsum(-1) - 1).clamp_min(0)[:, -step_input.shape[1]:]
            if step == 0:
                prompt_version = self.version  # the prompts' KV, kept for the whole call
                past = self._prefill_shared(prompts[0][:shared], len(prompts))
            out = self.model(input_ids=step_input, attention_mask=mask, position_ids=positions, use_cache=True, **{self._cache_arg: past}, **self._last_logits)
            past = getattr(out, self._cache_arg)
            logits = out.logits[:, -1]
            if step == 0 and params.n > 1:
                past.batch_repeat_interleave(params.n)
                logits, mask = logits.repeat_interleave(params.n, dim=0), mask.repeat_interleave(params.n, dim=0)
            logp = torch.log_softmax(logits.float() / params.temperature, dim=-1)
            token = logp.argmax(-1) if params.greedy else sample_categorical(logp, gen)
            token = torch.where(done, torch.full_like(token, self.pad_id), token)
            tokens.append(token)
            logps.append(logp.gather(1, token[:, None]).squeeze(1))
            versions.append(torch.full_like(token, self.version))
            if params.topk_logprobs:
                tops.append(torch.topk(logp, params.topk_logprobs, dim=-1))
            done |= torch.isin(token, self._eos)
            if done.all():
                break
            step_input = token[:, None]
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        return self._package(prompts, params, rows, tokens, logps, versions, tops, width, prompt_version)

    def _shared_prefix(self, prompts: list[list[int]]) -> int:
        """How many leading tokens every prompt of the call has in common, leaving each at least one
        of its own (0: prefill each prompt whole; also for MoE routing replay, whose record is laid
        out per prompt)."""
        if not self.share_prefix or len(prompts) < 2 or self._routing.active:
            return 0
        first, shortest = prompts[0], min(len(p) for p in prompts)
        shared = 0
        while shared < shortest - 1 and all(p[shared] == first[shared] for p in prompts):
            shared += 1
        return shared

    def _prefill_shared(self, prefix: list[int], copies: int):
        """The KV cache of ``prefix``, computed once and repeated for ``copies`` prompts (None when empty)."""
        if not prefix:
            return None
        ids = torch.tensor([prefix], device=self.device)
        out = self.model(input_ids=ids, attention_mask=torch.ones_like(ids), position_ids=torch.arange(len(prefix), device=self.device)[None],
                         use_cache=True, **{self._cache_arg: None}, **self._last_logits)
        past = getattr(out, self._cache_arg)
        past.batch_repeat_interleave(copies)
        return past

    def _package(self, prompts, params, rows, tokens, logps, versions, tops, width: int, prompt_version: int) -> list[list[Completion]]:
        tokens, logps, versions = (torch.stack(x, 1).cpu() for x in (tokens, logps, versions))
        tops = [torch.return_types.topk((t.values.cpu(), t.indices.cpu())) for t in tops]
        eos = self._eos.cpu()
        out: list[list[Completion]] = [[] for _ in prompts]
        lengths, stopped = [], []
        for i in range(len(rows)):
            hits = torch.isin(tokens[i], eos).nonzero()
            lengths.append(int(hits[0]) + 1 if len(hits) else tokens.shape[1])
            stopped.append(len(hits) > 0)
        calls = self._routing.take()
        routed = per_row(calls, prompts, params.n, width, lengths) if self._routing.active else [None] * len(rows)
        for i, row in enumerate(rows):
            length = lengths[i]
            out[i // params.n].append(
                Completion(
                    prompt_ids=torch.tensor(row),
                    response_ids=tokens[i, :length].clone(),
                    rollout_logp=logps[i, :length].clone(),
                    versions=versions[i, :length].clone(),
                    finish_reason="stop" if stopped[i] else "length", prompt_version=prompt_version,
                    topk_ids=torch.stack([t.indices[i] for t in tops[:length]]) if tops else None,
                    topk_logp=torch.stack([t.values[i] for t in tops[:length]]) if tops else None,
                    routed_experts=routed[i],
                )
            )
        return out
