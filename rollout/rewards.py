"""Verifiable rewards: the reward-function interface, answer extraction and math verification.

A reward function maps (completion text, ground truth) to a ``RewardResult``; it never raises on
model output (garbage scores 0 with a reason) and never takes longer than its time bound.

Answer extraction (``extract_answer``): the content of the last ``\\boxed{...}`` if there is one,
else the last number in the text. The extracted answer must be a *literal* (an integer, decimal or
simple fraction, optionally signed or with thousands separators) before anything compares it:
math-verify evaluates expressions, so ``\\boxed{7 * 27}`` would otherwise score as 189 although the
model computed nothing — and within 10 GRPO steps a policy learned to exploit exactly that
(DESIGN.md).

``MathVerifyReward`` compares with math-verify in a separate worker process: math-verify's own
timeouts use signals and only work in the main thread, and a sympy computation cannot be
interrupted from another thread, so the bound is enforced by killing and restarting the process.
"""

from __future__ import annotations

import multiprocessing as mp
import re
import threading
from dataclasses import dataclass
from fractions import Fraction
from typing import Protocol

NUMBER = r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?"
_NUMBER_RE = re.compile(rf"-?\d+\s*/\s*\d+(?![\d.,])|{NUMBER}")  # a plain fraction counts as one number
_LITERAL_RE = re.compile(rf"^\s*(?:{NUMBER})\s*$|^\s*-?\d+\s*/\s*\d+\s*$|^\s*-?\\d?frac\{{-?\d+\}}\{{\d+\}}\s*$")
_BOXED = "\\boxed{"


@dataclass(frozen=True)
class RewardResult:
    score: float
    """1.0 for a correct answer, else 0.0."""
    extracted: str | None
    """The answer taken from the completion, or None."""
    reason: str
    """correct | wrong | no_answer | not_literal | timeout | error"""


class RewardFn(Protocol):
    def __call__(self, completion: str, ground_truth: str) -> RewardResult: ...


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...}, braces balanced; None if absent or unclosed."""
    start = text.rfind(_BOXED)
    if start < 0:
        return None
    depth, i = 1, start + len(_BOXED)
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def extract_answer(text: str) -> str | None:
    """The last boxed answer, else the last number in the text."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    numbers = _NUMBER_RE.findall(text)
    return numbers[-1].replace(" ", "") if numbers else None


def is_literal(answer: str) -> bool:
    return bool(_LITERAL_RE.match(answer))


def literal_value(answer: str) -> Fraction:
    """Exact value of a literal answer (see ``is_literal``)."""
    s = answer.strip().replace(",", "")
    m = re.match(r"^(-?)\\d?frac\{(-?\d+)\}\{(\d+)\}$", s)
    if m:
        return (-1 if m.group(1) else 1) * Fraction(int(m.group(2)), int(m.group(3)))
    if "/" in s:
        num, den = s.split("/")
        return Fraction(int(num), int(den))
    return Fraction(s)


def _literal_or_rejection(completion: str) -> tuple[str, RewardResult | None]:
    """The extracted literal answer, or the zero-score result that rejects the completion."""
    answer = extract_answer(completion)
    if answer is None:
        return "", RewardResult(0.0, None, "no_answer")
    if not is_literal(answer):
        return answer, RewardResult(0.0, answer, "not_literal")
    return answer, None


class LiteralNumberReward:
    """Exact comparison of the extracted literal with a numeric ground truth (the arithmetic task)."""

    def __call__(self, completion: str, ground_truth: str) -> RewardResult:
        answer, rejected = _literal_or_rejection(completion)
        if rejected is not None:
            return rejected
        try:
            correct = literal_value(answer) == literal_value(ground_truth)
        except (ValueError, ZeroDivisionError):
            return RewardResult(0.0, answer, "error")
        return RewardResult(1.0 if correct else 0.0, answer, "correct" if correct else "wrong")


def _verify_loop(conn) -> None:
    """Worker process: math-verify (gold, answer) pairs until the pipe closes."""
    from math_verify import parse, verify

    while True:
        try:
            gold, answer = conn.recv()
        except EOFError:
            return
        try:
            ok = verify(parse(gold, parsing_timeout=None), parse(answer, parsing_timeout=None), timeout_seconds=None)
            conn.send(("ok", bool(ok)))
        except Exception as err:  # math-verify/sympy failures are the answer's problem, not the worker's
            conn.send(("error", repr(err)[:200]))


class MathVerifyReward:
    """math-verify equivalence of the extracted literal with the ground truth, time-bounded.

    Thread-safe (one call at a time through a lock); a call that exceeds ``timeout_s`` kills the
    verifier process, scores 0 with reason "timeout", and the next call starts a fresh one.
    """

    def __init__(self, timeout_s: float = 5.0):
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._proc = None
        self._conn = None

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        self._proc = ctx.Process(target=_verify_loop, args=(child,), daemon=True)
        self._proc.start()
        self._conn = parent

    def _kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.join(timeout=5)
        self._proc = self._conn = None

    def close(self) -> None:
        with self._lock:
            self._kill()

    def __call__(self, completion: str, ground_truth: str) -> RewardResult:
        answer, rejected = _literal_or_rejection(completion)
        if rejected is not None:
            return rejected
        with self._lock:
            if self._proc is None or not self._proc.is_alive():
                self._start()
            self._conn.send((str(ground_truth), answer))
            if not self._conn.poll(self.timeout_s):
                self._kill()
                return RewardResult(0.0, answer, "timeout")
            status, value = self._conn.recv()
        if status != "ok":
            return RewardResult(0.0, answer, "error")
        return RewardResult(1.0 if value else 0.0, answer, "correct" if value else "wrong")
