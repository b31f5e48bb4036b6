"""Generating a rollout: one engine call for a batch of queued submissions, and its bookkeeping.

The ``Generator`` turns submissions (rollout/scheduler.py) into completions with one engine call:
it tokenizes and checks each prompt (a bad prompt fails only its own submission), chooses the call's
sampling (training or evaluation, each prompt's seed derived from the run's), and keeps what the
worker reports about its engine: how many calls ran, how long the running one has taken, and, once
the engine died, why. Testable without Ray: it needs an ``Engine``.
"""

from __future__ import annotations

import dataclasses
import os
import re
import time
from dataclasses import dataclass

from rollout.chaos import Chaos
from rollout.config import EnvironmentConfig, RolloutConfig
from rollout.engine import Completion, EndedProcess, Engine, SamplingParams, mix_seed
from rollout.episodes import EpisodeRunner
from rollout.records import EvalTicket, Ticket
from rollout.scheduler import Submission
from rollout.tasks import Problem

_ERROR_LINE_RE = re.compile(r"(?:^|\] )([A-Za-z_][\w.]*(?:Error|Exception)): (.+)$")
POINTERS = ("stack trace (above)", "stack trace above", "EngineDeadError")
"""Error lines that only point elsewhere (vLLM's "See stack trace (above) for the root cause")."""


def _root_cause_in_own_log(max_bytes: int = 262_144, max_lines: int = 400) -> str | None:
    """The first error line (``SomeError: text``) among the recent lines of this process's own
    stdout and stderr files, which an engine's child processes share (Ray writes them to the
    worker's log files): where vLLM's EngineCore writes the exception that killed it, while the
    EngineDeadError raised here only says "see the stack trace above"."""
    for fd in (1, 2):
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
            size = os.path.getsize(path)
            with open(path, "rb") as f:
                f.seek(max(0, size - max_bytes))
                lines = f.read().decode("utf-8", "replace").splitlines()[-max_lines:]
        except OSError:
            continue
        for line in lines:
            m = _ERROR_LINE_RE.search(line.strip())
            if m and not any(p in line for p in POINTERS):
                return f"{m.group(1).rsplit('.', 1)[-1]}: {m.group(2)}"
    return None


def death_cause(err: BaseException, ended: list[EndedProcess] = ()) -> str:
    """An engine error for a person: its type and message and, when it only points at a stack trace
    nobody sees, what the engine's processes say: one killed by a signal (``ended``), else the
    root cause its engine process wrote to the worker's log, else which ended and how; then the
    last frames of its traceback."""
    import traceback

    frames = [f for f in traceback.format_exception(type(err), err, err.__traceback__)[:-1] if not f.startswith("Traceback")]
    tail = " | ".join(" ".join(f.split()) for f in frames[-3:])
    text = f"{type(err).__name__}: {err}"
    if any(p in text for p in POINTERS):
        killed = [e.text for e in ended if e.killed]
        root = None if killed else _root_cause_in_own_log()  # a kill from outside wrote no error: older log lines are not its cause
        if killed:
            text = (f"{' and '.join(killed)} (from outside the engine: a signal, or the kernel's out-of-memory killer, which "
                    f"`dmesg` on that node names); the engine raised {text}")
        elif root:
            text = f"{root} (the engine process's error; it raised {text})"
        elif ended:
            text = f"{' and '.join(e.text for e in ended)} without writing an error to the worker's log; the engine raised {text}"
    return text + (f" (at: {tail})" if tail else "")


@dataclass(frozen=True)
class Generated:
    """One submission after its engine call: its completions, or why it has none (``error``)."""

    ticket: Ticket
    problem: Problem
    completions: list[Completion] | None
    error: str | None
    seconds: float
    """Engine seconds charged to it: the call's time shared among its prompts (0 for a bad prompt)."""
    topk: int
    """The top-K log-probs its call asked for (0 for evaluation)."""
    texts: list[str] | None = None
    """Each completion's response decoded (special tokens skipped), in the generating thread: the
    tokenizer is never used from two threads at once."""


class Generator:
    def __init__(self, engine: Engine, sampling: SamplingParams, eval_sampling: SamplingParams, max_prompt_tokens: int | None, chaos: Chaos,
                 environment: EnvironmentConfig | None = None):
        """Use ``build``."""
        self.engine, self.sampling, self.eval_sampling = engine, sampling, eval_sampling
        self.episodes = None if environment is None else EpisodeRunner(engine, environment, sampling.max_new_tokens, self.decode)
        """Multi-turn episodes (rollout/episodes.py) when the rollout config has an environment."""
        self.max_prompt_tokens, self.chaos = max_prompt_tokens, chaos
        self.calls = 0
        self._call_began: float | None = None
        """When the engine call running now began (time.monotonic), or None between calls."""
        self.dead: str | None = None
        """Why the engine died (its error and the end of its traceback), once it has."""

    @classmethod
    def build(
        cls, config: RolloutConfig, *, engine: Engine, chaos: Chaos | None = None, worker_id: int = 0, topk_logprobs: int = 0,
        seed: int | None = None, eval_temperature: float | None = None,
    ) -> "Generator":
        """Generation on ``engine`` with ``config``'s sampling (n, max_new_tokens, temperature) and
        prompt limit; training calls ask for ``topk_logprobs``; evaluation calls ask for none and
        sample at ``eval_temperature`` (None: the training temperature); ``seed``: the run's, from
        which each prompt's seed derives (None: unseeded)."""
        RolloutConfig.expect(config, "Generator")
        sampling = SamplingParams(
            n=config.samples_per_prompt, max_new_tokens=config.max_new_tokens, temperature=config.temperature,
            topk_logprobs=topk_logprobs, seed=seed,
        )
        eval_sampling = dataclasses.replace(sampling, topk_logprobs=0, temperature=eval_temperature or config.temperature)
        return cls(engine, sampling, eval_sampling, config.max_prompt_tokens, chaos or Chaos.build(None, worker_id=worker_id), config.environment)

    def call_seconds(self) -> float | None:
        """How long the engine call running now has taken (None between calls)."""
        began = self._call_began
        return None if began is None else time.monotonic() - began

    def generate(self, batch: list[Submission]) -> list[Generated]:
        """One engine call for ``batch`` (whose submissions share one n), in submission order. A
        bad prompt or a failed call fails its submissions; an engine that died fails none and
        returns nothing: ``dead`` says why (the worker must be restarted, its work re-queued)."""
        started = time.perf_counter()
        out: dict[int, Generated] = {}
        prompts = {}
        n = batch[0][2] if batch else 1
        params = self._params([t for t, _, _ in batch], n) if batch else None
        for i, (ticket, problem, _) in enumerate(batch):
            try:
                prompts[i] = self._prompt_ids(problem) if self.episodes is None else self._episodes(problem, params, i)
            except Exception as err:
                reason = str(err) if str(err) == "empty prompt" else f"{type(err).__name__}: {err}"
                out[i] = Generated(ticket, problem, None, reason, 0.0, 0)
        if prompts:
            if len(prompts) < len(batch):  # each kept prompt keeps its own seed
                params = self._params([batch[i][0] for i in prompts], n)
            self.calls += 1
            self._call_began = time.monotonic()
            try:
                self.chaos.before_generate(self.engine, self.calls)
                if self.episodes is None:
                    results = self.engine.generate(list(prompts.values()), params)
                else:
                    results = self.episodes.run(list(prompts.values()), params)
            except Exception as err:  # the worker outlives a bad request; the controller sees why
                self._call_began = None
                if self.engine.is_dead(err):  # not this request's fault: the worker must restart
                    try:
                        ended = self.engine.ended_processes()
                    except Exception:  # noqa: BLE001 - describing the death must not stop the restart
                        ended = []
                    self.dead = death_cause(err, ended)
                    return []
                seconds = time.perf_counter() - started
                for i in prompts:
                    out[i] = Generated(batch[i][0], batch[i][1], None, f"{type(err).__name__}: {err}", seconds, params.topk_logprobs)
            else:
                self._call_began = None  # scoring is not the engine's time
                seconds = (time.perf_counter() - started) / len(prompts)
                for i, completions in zip(prompts, results):
                    out[i] = Generated(
                        batch[i][0], batch[i][1], completions, None, seconds, params.topk_logprobs,
                        [self._text(c) for c in completions],
                    )
        return [out[i] for i in range(len(batch))]

    def decode(self, ids) -> str:
        return self.engine.tokenizer.decode(ids, skip_special_tokens=True)

    def _text(self, c: Completion) -> str:
        """What the reward reads: the response, or an episode's last model turn."""
        if c.episode is not None and c.episode.messages and c.episode.messages[-1]["role"] == "assistant":
            return c.episode.messages[-1]["content"]
        return self.decode(c.response_ids)

    def _episodes(self, problem: Problem, params: SamplingParams, row: int) -> list:
        """The n episodes of one submission, opened (their environments reset, their prompts checked)."""
        if not problem.prompt.strip():
            raise ValueError("empty prompt")
        seeds = None if params.prompt_seeds is None else params.prompt_seeds[row]
        runs = [self.episodes.open(problem, None if seeds is None else mix_seed(seeds, j)) for j in range(params.n)]
        for r in runs:
            if self.max_prompt_tokens is not None and len(r.prompt_ids) > self.max_prompt_tokens:
                raise ValueError(f"prompt has {len(r.prompt_ids)} tokens, more than max_prompt_tokens={self.max_prompt_tokens}")
        return runs

    def _prompt_ids(self, problem: Problem) -> list[int]:
        if not problem.prompt.strip():
            raise ValueError("empty prompt")
        ids = self.engine.chat_prompt(problem.chat_messages())
        if self.max_prompt_tokens is not None and len(ids) > self.max_prompt_tokens:
            raise ValueError(f"prompt has {len(ids)} tokens, more than max_prompt_tokens={self.max_prompt_tokens}")
        return ids

    def _params(self, tickets: list[Ticket], n: int) -> SamplingParams:
        """The sampling of one engine call, with its n: evaluation has its own (no top-K log-probs).
        With a seed (the run's), each prompt's seed is derived from it and the prompt's ticket (epoch
        and problem id): runs with the same seed make the same random draws for the same draw of a
        prompt, however the prompts were batched (the logits themselves can differ slightly with
        padding and batch size)."""
        base = self.eval_sampling if isinstance(tickets[0], EvalTicket) else self.sampling
        if getattr(tickets[0], "greedy", False):
            base = dataclasses.replace(base, greedy=True)
        seeds = None if base.seed is None else tuple(mix_seed(base.seed, repr(t)) for t in tickets)
        return dataclasses.replace(base, n=n, prompt_seeds=seeds)
