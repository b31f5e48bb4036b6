"""The inference-engine interface every rollout backend implements (hf, vllm, sglang), built by ``Engine.build``.

An engine samples n completions per prompt and reports, for every sampled token, the behaviour
log-prob mu of that token under the distribution it was *actually sampled from* (temperature
applied, no top-p/top-k truncation, so it is log softmax(logits / T)), optional top-K log-probs of
that same distribution, and the policy version of the weights that produced it. Weights arrive as
HF-named ``WeightBucket``s with a new version and may be swapped while requests are in flight: a
response that spans an update carries both versions, token by token.
"""

from __future__ import annotations

import hashlib
import os
import signal
import sys
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Literal, NamedTuple

import torch

from learner.weights.wire import WeightBucket
from rollout.config import RolloutConfig

Precision = Literal["fp32", "bf16", "fp8"]


class EndedProcess(NamedTuple):
    """One of an engine's own processes that is gone (``Engine.ended_processes``)."""

    text: str
    """Which process and how it ended, for a person."""
    killed: bool
    """Ended by a signal (from outside the engine), so it wrote no error of its own."""


def _gone(process) -> bool:
    """Whether a psutil process has ended (a zombie, or no longer there)."""
    try:
        return not process.is_running() or process.status() == "zombie"
    except Exception:  # noqa: BLE001 - psutil.NoSuchProcess and the like: it ended meanwhile
        return True


def _signal_name(number: int) -> str:
    """SIGKILL for 9; "signal N" for a number this platform has no name for (real-time signals)."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    """Samples per prompt (a group)."""
    max_new_tokens: int = 128
    temperature: float = 1.0
    topk_logprobs: int = 0
    """Also return the K most likely tokens' log-probs at every step (0 = off)."""
    seed: int | None = None
    """Seed of the whole call (sample r of the call draws from ``mix_seed(seed, r)``)."""
    prompt_seeds: tuple[int, ...] | None = None
    """One seed per prompt of the call, over ``seed``: sample j of prompt i draws from
    ``mix_seed(prompt_seeds[i], j)`` whatever else the call holds, so two runs that give a prompt the
    same seed draw the same samples from the same weights (common random numbers)."""
    greedy: bool = False
    """Take the most likely token at every step (evaluation); mu is still reported at ``temperature``."""

    def __post_init__(self) -> None:
        if self.n < 1 or self.max_new_tokens < 1:
            raise ValueError(f"n and max_new_tokens must be >= 1, got n={self.n}, max_new_tokens={self.max_new_tokens}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 (greedy decoding has no behaviour distribution), got {self.temperature}")
        if self.topk_logprobs < 0:
            raise ValueError(f"topk_logprobs must be >= 0, got {self.topk_logprobs}")

    def row_seeds(self, prompts: int) -> list[int] | None:
        """The sampling seed of every row of a call of ``prompts`` prompts (n rows each), or None
        when unseeded."""
        if self.prompt_seeds is not None:
            if len(self.prompt_seeds) != prompts:
                raise ValueError(f"{len(self.prompt_seeds)} prompt seeds for {prompts} prompts")
            return [mix_seed(s, j) for s in self.prompt_seeds for j in range(self.n)]
        if self.seed is not None:
            return [mix_seed(self.seed, r) for r in range(prompts * self.n)]
        return None


def mix_seed(*parts) -> int:
    """A 31-bit seed from ``parts`` (hashed: nearby inputs give unrelated seeds)."""
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


@dataclass(frozen=True)
class Episode:
    """What a multi-turn episode (rollout/episodes.py) adds to its Completion."""

    turns: int
    """Model turns."""
    tool_calls: int = 0
    tool_errors: int = 0
    environment_reward: float = 0.0
    """The sum of the rewards the environment's steps gave (added to the outcome reward)."""
    environment_seconds: float = 0.0
    truncated: str | None = None
    """Why a budget cut the episode: max_turns or tokens (None: it ended)."""
    error: tuple[str, str] | None = None
    """(reason, detail) when the environment failed the episode (error, timeout, invalid)."""
    messages: tuple[dict, ...] = ()
    """The conversation: the opening messages, then each model turn and the environment's messages."""


@dataclass(frozen=True)
class Completion:
    """One sampled response. Per-token tensors are [L] (or [L, K]) for the L response tokens."""

    prompt_ids: torch.Tensor
    response_ids: torch.Tensor
    rollout_logp: torch.Tensor
    """fp32 log mu(y_t | prefix) of each sampled token (temperature applied)."""
    versions: torch.Tensor
    """int64 policy version of the weights that sampled each token."""
    finish_reason: Literal["stop", "length"]
    prompt_version: int
    """Policy version served when the prompt was submitted. Engines keep the KV cache already
    computed across an in-flight update, so a token sampled by newer weights (``versions`` above
    this) attended to context computed with older ones: its mu is neither version's exactly."""
    topk_ids: torch.Tensor | None = None
    topk_logp: torch.Tensor | None = None
    routed_experts: torch.Tensor | None = None
    """MoE models: [P + L, layers, k] int16 ids of the experts the engine routed each position of
    prompt + response to, per MoE layer (rollout routing replay); the last position was never an
    input, its row is -1. None: a dense model, or an engine that does not report routing."""
    loss_mask: torch.Tensor | None = None
    """bool [L]: which response tokens the model sampled (trained, with mu and a version); False for
    tokens an environment inserted (context only: their mu is 0 and their version the preceding
    model token's). None: every token is the model's."""
    episode: Episode | None = None
    """A multi-turn episode's record (None: one response to a prompt)."""

    @property
    def model_tokens(self) -> int:
        """Response tokens the model sampled."""
        return len(self.response_ids) if self.loss_mask is None else int(self.loss_mask.sum())


class EngineDied(RuntimeError):
    """The engine cannot serve any more in this process (its engine process died, it crashed)."""


def private_folder(prefix: str, parent: str | None = None) -> str:
    """A new folder ``{prefix}{pid}-<random suffix>`` (under ``parent``, default the temporary folder),
    removed by ``remove_private_folder`` when its engine closes. A process killed before it closed its
    engine (a restart after a hung call, a SIGKILL) cannot remove its own: each new folder and each
    removal sweeps the folders of ``prefix`` whose process is gone, so /dev/shm and the disk do not
    fill up over restarts."""
    import tempfile

    sweep_private_folders(prefix, parent)
    return tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=parent)


def remove_private_folder(folder: str, prefix: str) -> None:
    """Remove ``folder`` (made by ``private_folder`` with ``prefix``), and beside it the folders of
    ``prefix`` whose process is gone: a killed worker's replacement may start while the dead
    process is still being torn down, so the sweep at its start can miss the folder."""
    import shutil

    shutil.rmtree(folder, ignore_errors=True)
    sweep_private_folders(prefix, str(Path(folder).parent))


def sweep_private_folders(prefix: str, parent: str | None = None) -> None:
    """Remove the folders ``{prefix}{pid}-*`` under ``parent`` whose process has exited (a zombie
    not yet reaped counts as exited)."""
    import shutil
    import tempfile

    import psutil

    def gone(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True
        except psutil.AccessDenied:  # another user's process (/proc mounted hidepid): alive, not ours to judge
            return False

    for old in Path(parent or tempfile.gettempdir()).glob(f"{prefix}*-*"):
        pid = old.name[len(prefix):].split("-", 1)[0]
        if pid.isdigit() and gone(int(pid)):
            shutil.rmtree(old, ignore_errors=True)


class Engine(ABC):
    """A rollout backend. ``version`` is the policy version of the weights currently served."""

    version: int
    tokenizer: object
    """A Hugging Face tokenizer of the served model."""

    @classmethod
    def build(cls, config: RolloutConfig, *, model_folder: str, topk_logprobs: int = 0, record_routing: bool = False) -> "Engine":
        """The engine ``config.engine`` names, serving the HF model in ``model_folder`` at
        ``config.precision`` (``topk_logprobs``: the widest top-K a request will ask for;
        ``record_routing``: MoE routing replay), built with ``engine_options``. Each engine module
        (which imports this one) is imported only when chosen."""
        RolloutConfig.expect(config, "Engine")
        if config.precision == "auto":  # resolved where the run config is loaded (controller/hardware.py), never here
            raise ValueError("rollout.precision 'auto' reached the engine unresolved; resolve it with controller.hardware.resolve_precision")
        options = engine_options(config, topk_logprobs, record_routing)
        if config.engine == "hf":
            from rollout.hf_engine import HFEngine as engine
        elif config.engine == "vllm":
            from rollout.vllm_engine import VLLMEngine as engine
        elif config.engine == "sglang":
            from rollout.sglang_engine import SGLangEngine as engine
        else:
            raise ValueError(f"rollout.engine {config.engine!r}: Engine.build has no engine of that name")
        key = ("engine", config.engine, str(model_folder), config.precision, repr(sorted(options.items())))
        pool = sys.modules.get("learner.actor_pool")  # imported in every worker host process; elsewhere nothing is kept
        kept = pool.unstash(key) if pool is not None else None  # an engine an earlier run of this process left (RolloutWorker.shutdown)
        if kept is not None:
            try:
                kept.renew()
                return kept
            except Exception as err:
                print(f"a kept {config.engine} engine could not serve {model_folder} again ({type(err).__name__}: {err}); starting a new one", flush=True)
                try:
                    kept.close()
                except Exception as closing:
                    print(f"closing it failed too: {type(closing).__name__}: {closing}", flush=True)
        built = engine(model_folder, precision=config.precision, **options)
        built.build_key = key
        return built

    renewable = False
    """Whether ``renew`` can make this engine serve its model folder's weights again, for another run."""
    build_key: tuple | None = None
    """How ``build`` built it: an engine kept for another run is handed only to a build asking the same."""

    def renew(self) -> None:
        """Serve the model folder's own weights again, at version 0, with nothing cached from before
        (engines whose start costs more than a load: ``renewable``)."""
        raise NotImplementedError(f"{type(self).__name__} is not kept for another run")

    def close(self) -> None:
        """Release what the engine holds outside this process's memory (engine processes, staging
        folders); the worker calls it on shutdown. This default holds nothing."""

    def is_dead(self, error: BaseException) -> bool:
        """Whether ``error`` (raised by ``generate`` or a weight load) means the engine cannot serve
        again in this process, so the worker must be restarted, rather than one request failing:
        EngineDied, or one of the engine's own processes (``_engine_processes``, recorded at start by
        engines that run in other processes) is gone."""
        if isinstance(error, EngineDied):
            return True
        return any(_gone(p) for p in getattr(self, "_engine_processes", ()))

    def ended_processes(self) -> list[EndedProcess]:
        """The engine's own processes that are gone, for a person: name, pid and, where the engine
        kept it, how each ended (``_exit_codes``: "was killed by SIGKILL", "exited with code 1").
        Empty for an engine inside the worker's process."""
        codes = self._exit_codes()
        ended = []
        for p in filter(_gone, getattr(self, "_engine_processes", ())):
            code = codes.get(p.pid)
            how = "ended" if code is None else f"was killed by {_signal_name(-code)}" if code < 0 else f"exited with code {code}"
            ended.append(EndedProcess(f"its {self._engine_marker} process (pid {p.pid}) {how}", code is not None and code < 0))
        return ended

    def _exit_codes(self) -> dict[int, int]:
        """pid -> exit code (negative: the signal) of the engine's own processes that ended, where
        the engine library keeps them; engines that spawn processes override it."""
        return {}

    def _record_engine_processes(self, marker: str) -> None:
        """Remember this process's children whose command line holds ``marker`` (the engine's own
        processes), for ``is_dead`` and ``kill_for_chaos``."""
        import psutil

        found = []
        for child in psutil.Process().children(recursive=True):
            try:
                if marker in " ".join(child.cmdline()) or marker in child.name():
                    found.append(child)
            except psutil.Error:
                continue
        self._engine_processes, self._engine_marker = found, marker

    def kill_for_chaos(self) -> None:
        """chaos ``kill_engine``: make the engine die the way it really dies: its own processes are
        killed; an engine inside the worker's process (no such processes) has its next call raise
        EngineDied."""
        processes = getattr(self, "_engine_processes", ())
        for p in processes:
            p.kill()
        if not processes:
            self._chaos_dead = True

    def chat_prompt(self, prompt: str | list[dict], tools: list[dict] | None = None) -> list[int]:
        """Token ids of a chat prompt (one user message, or a list of chat messages) with the
        generation prompt appended; ``tools``: JSON schemas the chat template describes (its ``tools=``)."""
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        extra = {"tools": tools} if tools else {}
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **extra)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    @staticmethod
    def check_prompts(prompts: list[list[int]]) -> None:
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")

    @abstractmethod
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        """``params.n`` completions for each prompt (token ids), in prompt order."""

    @abstractmethod
    def update_weights(self, buckets: Iterable[WeightBucket]) -> None:
        """Load a publication (HF names); the new weights serve from the next decoding step on."""

    def join_weight_group(self, host: str, port: int, rank: int, world_size: int, timeout_s: float) -> None:
        """Join the learner's weight broadcast group (learner/weights/broadcast.py) as ``rank``, replacing any
        group joined before. This default joins in the engine's own process (the hf engine);
        engines whose weights live in other processes join from there (vLLM's workers)."""
        from learner.weights.broadcast import Membership

        if not hasattr(self, "_weights_membership"):
            self._weights_membership = Membership()
        self._weights_membership.join(host, port, rank, world_size, timeout_s)

    def receive_weights(self) -> int:
        """Receive the next publication from the group straight into the engine (as
        ``update_weights`` would load it); returns its version. A failed or timed-out collective
        leaves the group (join again) and raises."""
        membership = getattr(self, "_weights_membership", None)
        if membership is None:
            raise RuntimeError("this engine never joined a weight broadcast group")
        buckets = membership.receive_publication()
        self.update_weights(buckets)
        return buckets[-1].version

    @abstractmethod
    def weight_checksums(self) -> dict[str, str]:
        """Per HF tensor name, ``tensor_checksum`` of the weights served (tests compare them with the
        learner's). Engines that repack weights on load report what they loaded."""

    def pause(self) -> None:  # backends without a scheduler need nothing
        """Stop scheduling new decoding steps until ``resume`` (requests stay in flight)."""

    def resume(self) -> None:
        """Resume after ``pause``."""


def expert_count(config) -> int:
    """Routed experts per MoE layer of an HF text config (a ``config.json`` dict or a config object),
    under whichever name its architecture uses; 0 for a dense model."""
    get = config.get if isinstance(config, dict) else lambda key: getattr(config, key, None)
    return next((int(n) for key in ("num_experts", "num_local_experts", "n_routed_experts") if (n := get(key))), 0)


def fake_quantize_fp8(t: torch.Tensor) -> torch.Tensor:
    """Weights through float8_e4m3fn and back with a per-tensor scale: the CPU stand-in for an fp8
    engine, to create real training-inference mismatch. Scale maps the max |w| to e4m3's max 448."""
    scale = t.abs().max().clamp_min(1e-12) / 448.0
    return (t / scale).to(torch.float8_e4m3fn).to(t.dtype) * scale


def tensor_checksum(t: torch.Tensor) -> str:
    """SHA-1 of a tensor's bytes, dtype and shape included: equal only for bit-identical tensors."""
    flat = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
    return hashlib.sha1(f"{t.dtype}{tuple(t.shape)}".encode() + flat.numpy().tobytes()).hexdigest()


VLLM_DEFAULT_MAX_LOGPROBS = 20
"""vLLM refuses requests for more log-probs than its engine's max_logprobs (20 unless raised)."""


def engine_problems(config: RolloutConfig, model_config: dict) -> list[str]:
    """What ``config.engine`` cannot serve of this model (``model_config``: its HF config.json) in
    this rollout config, by field, before anything starts: sglang needs GPUs (it has no CPU build),
    and its block-fp8 rollout must tile every projection width."""
    problems = []
    if config.engine == "sglang" and config.gpus_per_worker == 0:
        problems.append("rollout.engine=sglang needs GPUs (set rollout.gpus_per_worker > 0): SGLang has no CPU build; use hf or vllm here")
    if config.engine == "sglang" and config.precision == "fp8":
        from rollout.fp8 import block_mismatches

        wrong = block_mismatches(model_config, config.fp8_block, int(config.engine_kwargs.get("tp_size", 1)))
        if wrong:
            problems.append(
                f"rollout.fp8_block={config.fp8_block}: sglang's block-fp8 rollout needs every projection width to be a "
                f"multiple of it, and {', '.join(wrong)} are not (a smaller power of two that divides them all tiles the model)"
            )
    return problems


def engine_options(config: RolloutConfig, topk_logprobs: int = 0, record_routing: bool = False) -> dict:
    """The keyword arguments ``config.engine``'s class is built with: ``config.engine_kwargs``, then
    what the rollout config and the run imply for that engine unless engine_kwargs set it
    (threads for hf; fp8 block size for sglang; threads, routing recording, KV cache size and
    log-prob width for vllm)."""
    options = dict(config.engine_kwargs)
    implied = {
        "hf": {"num_threads": config.threads},
        "sglang": {"fp8_block": config.fp8_block} if config.precision == "fp8" else {},
        "vllm": {
            "num_threads": config.threads,
            **({"record_routing": True} if record_routing else {}),
            **({"kv_cache_gib": config.kv_cache_gib} if config.kv_cache_gib is not None else {}),
            **({"max_logprobs": topk_logprobs} if topk_logprobs > VLLM_DEFAULT_MAX_LOGPROBS else {}),
        },
    }.get(config.engine, {})
    return {**implied, **options}
