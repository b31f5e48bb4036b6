"""Tasks: prompts with verifiable answers. A seeded synthetic arithmetic task, and a loader for
DAPO-Math-style datasets (jsonl or parquet rows with a prompt and a ground truth).

``Problem`` is one prompt: a stable id (the controller's ledger keys on it), the user message, and
the ground truth. Rendering to tokens (chat template) is the engine side's job.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

# Chosen by measurement (README): SmolLM2-135M-Instruct answers single-digit word problems with this
# instruction correctly ~10-20% of the time at temperature 1, and 2-digit ones ~3%: RL needs signal.
ARITHMETIC_INSTRUCTION = "Reply with only the number."


@dataclass(frozen=True)
class Problem:
    id: str
    prompt: str
    ground_truth: str


_TEMPLATES = {
    "+": ("{name} has {a} {item}. {pronoun} gets {b} more. How many {item} does {name} have now?", lambda a, b: a + b),
    "-": ("{name} has {a} {item}. {pronoun} gives away {b}. How many {item} does {name} have left?", lambda a, b: a - b),
    "*": ("{name} buys {a} boxes with {b} {item} in each box. How many {item} does {name} buy?", lambda a, b: a * b),
}
_NAMES = [("Tom", "He"), ("Anna", "She"), ("Ben", "He"), ("Mia", "She"), ("Sam", "He"), ("Lucy", "She")]
_ITEMS = ["apples", "pencils", "stickers", "marbles", "books", "cookies"]


def arithmetic_problem(rng: random.Random, index: int, split: str, max_operand: int = 9) -> Problem:
    op = rng.choice("+-*")
    a, b = rng.randint(2, max_operand), rng.randint(2, max_operand)
    if op == "-" and b > a:
        a, b = b, a
    (name, pronoun), item = rng.choice(_NAMES), rng.choice(_ITEMS)
    template, fn = _TEMPLATES[op]
    question = template.format(name=name, pronoun=pronoun, a=a, b=b, item=item)
    return Problem(f"arith-{split}-{index}", f"{question} {ARITHMETIC_INSTRUCTION}", str(fn(a, b)))


def arithmetic_split(split: str, size: int, seed: int = 0, max_operand: int = 9) -> list[Problem]:
    """``size`` problems of ``split`` ("train" or "test"); the splits use disjoint seeds, so the
    held-out set never overlaps the training stream's generator (identical texts can recur by
    chance, as in any small synthetic task)."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    rng = random.Random(f"{seed}-{split}")
    return [arithmetic_problem(rng, i, split, max_operand) for i in range(size)]


@dataclass(frozen=True)
class LoadReport:
    problems: list[Problem]
    skipped: list[tuple[int, str]] = field(default_factory=list)
    """(1-based row number, reason) of every row that was skipped."""


def _row_prompt(row: dict) -> str:
    prompt = row.get("prompt", row.get("problem", row.get("question")))
    if isinstance(prompt, list):  # chat form: [{"role": "user", "content": ...}, ...]
        users = [m.get("content") for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
        prompt = users[-1] if users else None
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError("no prompt (expected a non-empty 'prompt', 'problem' or 'question')")
    return prompt


def _row_answer(row: dict) -> str:
    reward_model = row.get("reward_model")
    answer = reward_model.get("ground_truth") if isinstance(reward_model, dict) else None
    answer = answer if answer is not None else row.get("answer", row.get("solution", row.get("ground_truth")))
    if answer is None or (isinstance(answer, str) and not answer.strip()):
        raise ValueError("no ground truth (expected reward_model.ground_truth, 'answer', 'solution' or 'ground_truth')")
    return str(answer).strip()


def _rows(path: Path):
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ImportError(f"reading {path} needs pyarrow (pip install pyarrow)") from None
        yield from enumerate(pq.read_table(path).to_pylist(), start=1)
        return
    with path.open() as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield number, json.loads(line)
            except json.JSONDecodeError as err:
                yield number, err


def load_dataset(path: str | Path, max_prompt_chars: int = 8192) -> LoadReport:
    """Load a jsonl or parquet math dataset. Bad rows (unparseable, no prompt, no ground truth,
    over-long prompt) are skipped and reported by 1-based row number; nothing raises for them. An
    empty result raises, naming the file and the first reasons."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"dataset {path} does not exist")
    problems, skipped = [], []
    for number, row in _rows(path):
        try:
            if isinstance(row, Exception):
                raise ValueError(f"not JSON: {row}")
            if not isinstance(row, dict):
                raise ValueError("not an object")
            prompt = _row_prompt(row)
            if len(prompt) > max_prompt_chars:
                raise ValueError(f"prompt has {len(prompt)} characters, more than {max_prompt_chars}")
            problems.append(Problem(str(row.get("id", f"{path.stem}-{number}")), prompt, _row_answer(row)))
        except ValueError as err:
            skipped.append((number, str(err)))
    if not problems:
        raise ValueError(f"dataset {path} has no usable rows; first problems: {skipped[:3]}")
    return LoadReport(problems, skipped)
