"""Final-answer extraction: what a response answered, and which marker it answered after.

A final-answer marker comes first — whichever of GSM8K's ``#### N``, ``The answer is N`` (also
"final answer is", "Answer:") and ``\\boxed{N}`` stands last in the response — and, with none, the
last number in the text (unless the caller requires a marker). After a marker the answer is the
rest of its line, up to the end of the sentence, unwrapped from ``$...$`` / ``\\(...\\)`` and with a
trailing unit word dropped ("12 apples." answers 12).

Only the response's last TAIL_CHARS characters are read: a final answer stands at the end, and the
work per response stays bounded whatever its length.

Whether an answer may be compared, and how, is the reward's business (rollout/rewards.py): a
*literal* is a number, a plain fraction or ``\\frac{a}{b}``; a *computation* is two numbers joined by
an operator (``7 * 27``), which math-verify would evaluate and so score a restated question as
correct.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

TAIL_CHARS = 16384
"""Characters read from the end of a response (a final answer stands at the end; bounds the work)."""

MAX_LITERAL_CHARS = 64
"""Longer "numbers" are degenerate output (a run of digits), not answers; Python also refuses to
convert integers of more than 4,300 digits."""

NUMBER = r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?"
_NUMBER_RE = re.compile(rf"-?\d+\s*/\s*\d+(?![\d.,])|{NUMBER}")  # a plain fraction counts as one number
_LITERAL_RE = re.compile(rf"^\s*(?:{NUMBER})\s*$|^\s*-?\d+\s*/\s*\d+\s*$|^\s*-?\\[dt]?frac\{{-?\d+\}}\{{\d+\}}\s*$")
_OPERATOR = r"(?:[-+*/×÷^·]|\\times|\\cdot|\\div)"
_COMPUTATION_RE = re.compile(rf"(?<![\w^_.])\d+(?:\.\d+)?\s*{_OPERATOR}\s*-?\d")
_HASH_RE = re.compile(r"####[ \t]*(?=[-+$\\\d.])")  # before an answer only, not a markdown header ("#### Step 2")
_ANSWER_IS_RE = re.compile(r"(?i)\b(?:the\s+)?(?:final\s+)?answer(?:\s+is|\s*:|\s*=)[ \t:]*")
_LIKE_ANSWER_RE = re.compile(r"^\s*(?:\*\*)?\s*[-+$\\\d(.]")  # what follows a marker that states an answer (not prose)
_SENTENCE_END_RE = re.compile(r"(?<=[^\d\\])\.(?:\s|$)|\.\s")  # a period that is not a decimal point
_CLAUSE_END_RE = re.compile(r",\s|;|\s(?:because|since)\s")
_LEADING_ANSWER_RE = re.compile(rf"^((?:-?\d+\s*/\s*\d+)|(?:{NUMBER}))(?:\s*%|\s+[A-Za-z][\w\s.'-]*)?$")
_BOXES = ("\\boxed{", "\\fbox{")
TRAILING = ".,;:!?"
"""Punctuation that ends a sentence, not an answer."""

Marker = Literal["####", "answer is", "boxed", "last number"]


@dataclass(frozen=True)
class Extracted:
    answer: str
    marker: Marker
    """Where the answer came from: a final-answer marker, or the last number of the text."""


def extract(text: str, require_marker: bool = False) -> Extracted | None:
    """The response's final answer (see the module docstring); None when it gave none, or when its
    last marker has nothing after it (the response was cut inside its answer). A marker followed by
    prose ("the answer is not clear") states no answer and is passed over."""
    tail = text[-TAIL_CHARS:]
    found = _after_hash(tail) + _after_answer_is(tail) + _boxed(tail)
    if found:  # the last marker decides
        return max(found, key=lambda f: f[0])[1]
    if require_marker:
        return None
    numbers = _NUMBER_RE.findall(tail)
    return Extracted(numbers[-1].replace(" ", ""), "last number") if numbers else None


def is_literal(answer: str) -> bool:
    """An integer, decimal (thousands separators allowed), plain fraction or ``\\frac{a}{b}``, of at
    most MAX_LITERAL_CHARS characters."""
    return len(answer) <= MAX_LITERAL_CHARS and bool(_LITERAL_RE.match(answer))


def is_computation(answer: str) -> bool:
    """Two numbers joined by an arithmetic operator (``7 * 27``, ``3+4``, ``2^10``): something to
    evaluate, not an answer. ``3+\\sqrt{2}``, ``x^2+1`` and ``\\frac{1}{2}`` are not."""
    return not is_literal(answer) and bool(_COMPUTATION_RE.search(answer))


MAX_EXPONENT = 10_000
"""A power with a larger integer exponent (or a tower, an exponent that is itself a power) is too
large to compare: sympy would build the number digit by digit (``10^{10^{10}}`` has ten billion)."""


def _exponents(answer: str) -> list[str]:
    """The exponent of every ``^`` in ``answer``: a brace group's contents, or the token after it."""
    out = []
    for i, ch in enumerate(answer):
        if ch != "^":
            continue
        rest = answer[i + 1 :].lstrip()
        if rest.startswith("{"):
            depth = 0
            for j, c in enumerate(rest):
                depth += (c == "{") - (c == "}")
                if depth == 0:
                    out.append(rest[1:j])
                    break
            else:
                out.append(rest[1:])
        else:
            m = re.match(r"-?[\w.]+", rest)
            token = m.group(0) if m else ""
            tower = rest[len(token) :].lstrip().startswith("^")  # a^b^c is a^(b^c)
            out.append(token + "^" if tower else token)
    return out


_NUMERIC_TOWER_RE = re.compile(r"[\d\s{}^+\-.,()]*\^[\d\s{}^+\-.,()]*")


def is_too_large(answer: str) -> bool:
    """A numeric power tower or a power with an exponent above MAX_EXPONENT (``10^{10^{10}}``,
    ``2^{100000}``); symbolic exponents (``e^{-x^2}``) are left to math-verify."""
    for exponent in _exponents(answer):
        if "^" in exponent and _NUMERIC_TOWER_RE.fullmatch(exponent.strip()):
            return True
        digits = exponent.strip().lstrip("-").replace(",", "")
        if digits.isdigit() and int(digits) > MAX_EXPONENT:
            return True
    return False


def _line_after(tail: str, end: int) -> str:
    stop = tail.find("\n", end)
    return tail[end : stop if stop >= 0 else len(tail)]


def _after_hash(tail: str) -> list:
    return [(m.start(), _answer(_line_after(tail, m.end()), "####")) for m in _HASH_RE.finditer(tail)]


def _after_answer_is(tail: str) -> list:
    found = []
    for m in _ANSWER_IS_RE.finditer(tail):
        rest = _line_after(tail, m.end())
        if not rest.strip():
            found.append((m.start(), None))  # cut right after the marker
        elif _LIKE_ANSWER_RE.match(rest):
            found.append((m.start(), _answer_in_sentence(_SENTENCE_END_RE.split(rest, maxsplit=1)[0])))
    return found


def _answer_in_sentence(sentence: str) -> Extracted | None:
    """The sentence's answer; a literal ending a clause first ("12, because 5+7" answers 12)."""
    whole = _answer(sentence, "answer is")
    if whole is not None and not is_literal(whole.answer):
        clause = _answer(_CLAUSE_END_RE.split(sentence, maxsplit=1)[0], "answer is")
        if clause is not None and is_literal(clause.answer):
            return clause
    return whole


def _boxed(tail: str) -> list:
    start = max(tail.rfind(box) for box in _BOXES)
    if start < 0:
        return []
    opening = tail.index("{", start) + 1
    depth = 1
    for j in range(opening, len(tail)):
        depth += {"{": 1, "}": -1}.get(tail[j], 0)
        if depth == 0:
            return [(start, _answer(tail[opening:j], "boxed"))]
    return [(start, None)]  # unclosed: the response was cut inside its answer


def _answer(raw: str, marker: Marker) -> Extracted | None:
    s = _clean(raw)
    if not s:
        return None
    leading = _LEADING_ANSWER_RE.match(s)
    if leading and not is_literal(s):
        s = leading.group(1).strip()
    return Extracted(s, marker)


def _clean(s: str) -> str:
    s = s.strip().replace("**", "").strip()
    for left, right in (("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if s.startswith(left) and s.endswith(right) and len(s) > len(left) + len(right) - 1:
            s = s[len(left) : len(s) - len(right)].strip()
    s = s.rstrip(TRAILING).strip()
    s = re.sub(r"^(?:\\\$|\$)\s*", "", s)  # a currency sign
    s = re.sub(r"^\+(?=\d)", "", s)  # an explicit plus sign
    s = re.sub(r"\\(?:text|mathrm)\{\s*[A-Za-z][^{}]*\}\s*$", "", s).strip()  # a trailing unit
    return s.rstrip(TRAILING).strip()
