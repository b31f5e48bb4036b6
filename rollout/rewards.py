"""Rewards: the reward-function interface and the two built-in comparisons.

A reward function maps a ``RewardInput`` (one sample: its prompt as text and chat messages, the
response as text and token ids, the finish reason, the ground truth and the dataset row's other
columns) to a ``RewardResult`` (or, for one's own functions, a float or a dict that
rollout/reward_functions.py turns into one). The two built-ins compare the response's answer
with the ground truth; they never raise on model output (garbage scores 0 with a reason) and
never take longer than their time bound. The
answer is extracted by rollout/answers.py: a final-answer marker first ("####", "The answer is",
``\\boxed{}``), then the last number (``require_marker`` turns that fallback off).

``literal`` (``LiteralNumberReward``): the answer must be a literal (an integer, decimal or
fraction) and equal the ground truth exactly. ``math_verify`` (``MathVerifyReward``): math-verify
decides equivalence, so closed forms count (``\\frac{1}{2}`` for 0.5, ``2\\sqrt{2}``, ``\\pi``), but an
answer that is a *computation* (two numbers joined by an operator) is refused first: math-verify
evaluates expressions, so ``\\boxed{7 * 27}`` would otherwise score as 189 although the model
computed nothing — and within 10 GRPO steps a policy learned to exploit exactly that.

``MathVerifyReward`` runs math-verify in a separate worker process: math-verify's own timeouts use
signals and only work in the main thread, and a sympy computation cannot be interrupted from
another thread, so the bound is enforced by killing and restarting the process.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import re
import threading
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from rollout.answers import extract, is_computation, is_literal, is_too_large


@dataclass(frozen=True)
class RewardInput:
    """One sample as a reward function sees it."""

    problem_id: str
    prompt: str
    """The prompt's text: the last user message (chat rows) or the prompt string, instruction included."""
    messages: tuple[dict[str, Any], ...]
    """The chat messages the prompt was rendered from (a per-row system message first, when there is one)."""
    response: str
    """The response decoded (special tokens skipped)."""
    response_ids: tuple[int, ...]
    finish_reason: str
    """stop (the model ended it) or length (cut at rollout.max_new_tokens)."""
    ground_truth: str | None
    """The row's answer (None for rows without one, which a reward of one's own may not need)."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """Every other column of the dataset row, unchanged (test cases, a rubric, a difficulty...)."""


@dataclass(frozen=True)
class RewardResult:
    score: float
    """The reward: for the built-ins 1.0 for a correct answer, else 0.0. Accuracy and pass@k count a
    sample correct when its score is >= 1."""
    extracted: str | None = None
    """The answer taken from the completion, or None."""
    reason: str = "scored"
    """correct | wrong | no_answer | too_long | not_literal | computation | too_large | verify_timeout |
    verify_error (the built-ins' verdicts on an answer); scored (a reward of one's own gave a score); the failures (FAILURES): error | timeout |
    invalid | unreachable."""
    marker: str | None = None
    """Where the answer came from (rollout.answers.Marker: "####", "answer is", "boxed", "last number")."""
    shaping: float = 0.0
    """Added to ``score`` for training (over-long shaping: <= 0; an episode's environment rewards); correctness stays ``score``."""
    detail: str | None = None
    """What more there is to say about ``reason``: for a failure, the error."""
    components: dict[str, float] = field(default_factory=dict)
    """Named parts of the score a reward reports (e.g. format, correct), logged as reward/component/<name>."""

    @property
    def failed(self) -> bool:
        """The reward could not score this sample (it scores 0 or fails its group: rollout.reward.on_error)."""
        return self.reason in FAILURES

    @property
    def value(self) -> float:
        """The reward trained on: correctness plus shaping."""
        return self.score + self.shaping


FAILURES = ("error", "timeout", "invalid", "unreachable")
"""Reasons a sample could not be scored: the reward raised (error), took longer than its bound
(timeout), answered something that is not a usable score (invalid), or its service could not be
reached (unreachable)."""


def literal_value(answer: str) -> Fraction:
    """Exact value of a literal answer (see ``is_literal``)."""
    s = answer.strip().replace(",", "")
    m = re.match(r"^(-?)\\[dt]?frac\{(-?\d+)\}\{(\d+)\}$", s)
    if m:
        return (-1 if m.group(1) else 1) * Fraction(int(m.group(2)), int(m.group(3)))
    if "/" in s:
        num, den = s.split("/")
        return Fraction(int(num), int(den))
    return Fraction(s)


MAX_ANSWER_CHARS = 512
"""An extracted answer longer than this is degenerate output (a run of digits, a repeated
expression), refused in both modes before any comparison: math-verify would spend its whole time
bound parsing it, and the record would carry it (cut to this length)."""


def _answer_or_rejection(completion: str, require_marker: bool, literal_only: bool) -> tuple[str, str | None, RewardResult | None]:
    """The extracted answer and its marker, or the zero-score result that rejects the completion."""
    found = extract(completion, require_marker)
    if found is None:
        return "", None, RewardResult(0.0, None, "no_answer")
    if len(found.answer) > MAX_ANSWER_CHARS:
        cut = found.answer[:MAX_ANSWER_CHARS]
        return cut, found.marker, RewardResult(0.0, cut, "too_long", found.marker)
    if literal_only and not is_literal(found.answer):
        return found.answer, found.marker, RewardResult(0.0, found.answer, "not_literal", found.marker)
    if is_computation(found.answer):
        return found.answer, found.marker, RewardResult(0.0, found.answer, "computation", found.marker)
    if is_too_large(found.answer):  # checked here, not left to math-verify's time bound (a whole timeout per sample)
        return found.answer, found.marker, RewardResult(0.0, found.answer, "too_large", found.marker)
    return found.answer, found.marker, None


class LiteralNumberReward:
    """Exact comparison of the extracted literal with a numeric ground truth."""

    def __init__(self, require_marker: bool = False):
        self.require_marker = require_marker

    def __call__(self, sample: RewardInput) -> RewardResult:
        return self.compare(sample.response, sample.ground_truth)

    def compare(self, completion: str, ground_truth: str | None) -> RewardResult:
        if ground_truth is None:
            raise ValueError("the literal reward needs a ground truth, and this row has none")
        answer, marker, rejected = _answer_or_rejection(completion, self.require_marker, literal_only=True)
        if rejected is not None:
            return rejected
        try:
            correct = literal_value(answer) == literal_value(ground_truth)
        except (ValueError, ZeroDivisionError):
            return RewardResult(0.0, answer, "verify_error", marker)
        return RewardResult(1.0 if correct else 0.0, answer, "correct" if correct else "wrong", marker)


VERIFY_MEMORY_BYTES = 4 * 2**30
"""The math-verify process's address space (RLIMIT_AS): a comparison that would exceed it fails
(MemoryError: reason "verify_error") instead of taking the node's memory."""


def _bound_this_process(memory_bytes: int) -> None:
    """Linux: die with the parent (PR_SET_PDEATHSIG: a SIGKILLed rollout worker leaves no verifier
    behind) and cap the address space. Elsewhere only what the platform offers."""
    import resource
    import signal

    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() == 1:  # the parent died before the line above
            os._exit(0)
    except OSError:
        pass
    try:
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    except (ValueError, OSError):
        pass


def _verify_loop(conn, memory_bytes: int = VERIFY_MEMORY_BYTES) -> None:
    """Worker process: math-verify (gold, answer) pairs until the pipe closes."""
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):  # one thread: no per-core buffers under the cap
        os.environ[var] = "1"
    _bound_this_process(memory_bytes)
    from math_verify import parse, verify

    while True:
        try:
            gold, answer = conn.recv()
        except EOFError:
            return
        try:
            ok = verify(parse(gold, parsing_timeout=None), parse(answer, parsing_timeout=None), timeout_seconds=None)
            conn.send(("ok", bool(ok)))
        except (Exception, MemoryError) as err:  # math-verify/sympy failures are the answer's problem, not the worker's
            conn.send(("error", repr(err)[:200]))


def _delimited(s: str) -> str:
    """LaTeX in math delimiters: math-verify's parser reads ``\\frac{3}{4}`` only inside ``$...$``."""
    s = s.strip()
    return f"${s}$" if "\\" in s and not s.startswith("$") else s


class MathVerifyReward:
    """math-verify equivalence of the extracted answer with the ground truth, time-bounded; a
    computation is refused before math-verify sees it.

    Thread-safe (one call at a time through a lock); a call that exceeds ``timeout_s`` kills the
    verifier process, scores 0 with reason "verify_timeout", and the next call starts a fresh one.
    """

    def __init__(self, timeout_s: float = 5.0, require_marker: bool = False):
        self.timeout_s, self.require_marker = timeout_s, require_marker
        self._lock = threading.Lock()
        self._proc = None
        self._conn = None

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_verify_loop, args=(child,), daemon=True)
        proc.start()  # spawn: the calling script needs an `if __name__ == "__main__":` guard
        self._proc, self._conn = proc, parent

    def _kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.join(timeout=5)
        self._proc = self._conn = None

    def close(self) -> None:
        with self._lock:
            self._kill()

    def __call__(self, sample: RewardInput) -> RewardResult:
        return self.compare(sample.response, sample.ground_truth)

    def compare(self, completion: str, ground_truth: str | None) -> RewardResult:
        if ground_truth is None:
            raise ValueError("the math_verify reward needs a ground truth, and this row has none")
        answer, marker, rejected = _answer_or_rejection(completion, self.require_marker, literal_only=False)
        if rejected is not None:
            return rejected
        with self._lock:
            if self._proc is None or not self._proc.is_alive():
                self._start()
            self._conn.send((_delimited(str(ground_truth)), _delimited(answer)))
            if not self._conn.poll(self.timeout_s):
                self._kill()
                return RewardResult(0.0, answer, "verify_timeout", marker)
            status, value = self._conn.recv()
        if status != "ok":
            return RewardResult(0.0, answer, "verify_error", marker)
        return RewardResult(1.0 if value else 0.0, answer, "correct" if value else "wrong", marker)


def overlong_shaping(length: int, max_new_tokens: int, truncated: bool, penalty: float, buffer: int) -> float:
    """Over-long shaping of one response (DAPO, arXiv 2503.14476, "soft overlong punishment"): 0
    up to ``max_new_tokens - buffer`` tokens, then falling linearly to ``-penalty`` at the length
    limit; with ``buffer`` 0, ``-penalty`` for a truncated response (cut at the limit, so it never
    reached an answer's end) and 0 otherwise."""
    if penalty == 0.0:
        return 0.0
    if buffer == 0:
        return -penalty if truncated else 0.0
    return -penalty * min(1.0, max(0, length - (max_new_tokens - buffer)) / buffer)
