"""Tasks: prompts with verifiable answers. A seeded synthetic arithmetic task with held-out facts
and extra eval sets (rollout/word_problems.py has the multi-step task), and a loader for math
datasets in the DAPO-Math, GSM8K, MATH and AIME row formats (jsonl or parquet).

``Problem`` is one prompt: a stable id (the controller's ledger keys on it), the user message, and
the ground truth. Rendering to tokens (chat template) is the engine side's job.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from rollout.answers import extract

# Chosen by measurement (README): SmolLM2-135M-Instruct answers single-digit word problems with this
# instruction correctly ~10-20% of the time at temperature 1, and 2-digit ones ~3%: RL needs signal.
ARITHMETIC_INSTRUCTION = "Reply with only the number."


@dataclass(frozen=True)
class Problem:
    id: str
    prompt: str
    """The prompt's text: the user message (the last one, for chat rows), instruction included."""
    ground_truth: str | None
    """The answer a built-in reward compares with (None: a row without one, for a reward of one's own)."""
    messages: tuple[dict, ...] = field(default=(), hash=False)
    """Chat rows: the messages the prompt is rendered from (a system message first when the row or
    the task gives one); empty: one user message holding ``prompt``."""
    metadata: dict = field(default_factory=dict, hash=False, compare=False)
    """The dataset row's other columns, passed to the reward unchanged."""

    def chat_messages(self) -> list[dict]:
        """What the chat template renders."""
        return [dict(m) for m in self.messages] if self.messages else [{"role": "user", "content": self.prompt}]

    def prompt_chars(self) -> int:
        """Characters of every message's text (system and earlier turns included)."""
        return sum(len(str(m.get("content") or "")) for m in self.chat_messages())


_TEMPLATES = {
    "+": ("{name} has {a} {item}. {pronoun} gets {b} more. How many {item} does {name} have now?", lambda a, b: a + b),
    "-": ("{name} has {a} {item}. {pronoun} gives away {b}. How many {item} does {name} have left?", lambda a, b: a - b),
    "*": ("{name} buys {a} boxes with {b} {item} in each box. How many {item} does {name} buy?", lambda a, b: a * b),
}
_OTHER_WORDINGS = {  # the "wording" eval set: phrasings never used in training
    "+": "There are {a} {item} on a table and {name} puts {b} more there. How many {item} are on the table?",
    "-": "A jar holds {a} {item}. {name} takes {b} of them out. How many {item} remain in the jar?",
    "*": "Each of {a} bags holds {b} {item}. How many {item} are there in all the bags together?",
}
_NAMES = [("Tom", "He"), ("Anna", "She"), ("Ben", "He"), ("Mia", "She"), ("Sam", "He"), ("Lucy", "She")]
_ITEMS = ["apples", "pencils", "stickers", "marbles", "books", "cookies"]

HELD_OUT_FACT_SHARE = 0.25
"""The share of (a, op, b) facts kept out of training for the held-out arithmetic sets."""

ARITHMETIC_SETS = ("heldout", "wording", "range")
"""The arithmetic task's eval sets: held-out facts in the training wordings; the same facts in
wordings never trained on; operands above the training range (max_operand+1 .. 2*max_operand+1)."""


def arithmetic_facts(low: int, high: int) -> list[tuple[int, str, int]]:
    """Every (a, op, b) with operands in [low, high]; subtraction only with a >= b."""
    return [(a, op, b) for op in "+-*" for a in range(low, high + 1) for b in range(low, high + 1) if op != "-" or a >= b]


def held_out_facts(seed: int = 0, max_operand: int = 9) -> set[tuple[int, str, int]]:
    """About HELD_OUT_FACT_SHARE of the training range's facts, which training never sees: seeded
    whole classes of facts that are the same fact (a + b and b + a, a * b and b * a), so no held-out
    sum or product is trained on in the other order."""
    classes: dict[tuple, list] = {}
    for a, op, b in arithmetic_facts(2, max_operand):
        classes.setdefault((op, *sorted((a, b))) if op in "+*" else (op, a, b), []).append((a, op, b))
    keys = sorted(classes)
    random.Random(f"{seed}-held-out-facts").shuffle(keys)
    held, target = set(), HELD_OUT_FACT_SHARE * sum(len(v) for v in classes.values())
    for key in keys:
        if len(held) >= target:
            break
        held.update(classes[key])
    return held


def arithmetic_problem(rng: random.Random, index: int, split: str, facts: list[tuple[int, str, int]], wordings=None) -> Problem:
    a, op, b = rng.choice(facts)
    (name, pronoun), item = rng.choice(_NAMES), rng.choice(_ITEMS)
    template, fn = _TEMPLATES[op]
    if wordings is not None:
        template = wordings[op]
    question = template.format(name=name, pronoun=pronoun, a=a, b=b, item=item)
    return Problem(f"arith-{split}-{index}", f"{question} {ARITHMETIC_INSTRUCTION}", str(fn(a, b)))


def arithmetic_split(split: str, size: int, seed: int = 0, max_operand: int = 9) -> list[Problem]:
    """``size`` problems of ``split``: "train", or one of ARITHMETIC_SETS ("test" is "heldout").
    Training draws only facts outside ``held_out_facts``, so no held-out question text and no
    held-out (a, op, b) fact occurs in training; the sets share only names, items and (heldout,
    range) the sentence templates. Splits use disjoint seeded streams."""
    split = "heldout" if split == "test" else split
    if split not in ("train", *ARITHMETIC_SETS):
        raise ValueError(f"split must be 'train' or one of {ARITHMETIC_SETS}, got {split!r}")
    held_out = held_out_facts(seed, max_operand)
    if split == "range":
        facts = arithmetic_facts(max_operand + 1, 2 * max_operand + 1)
    else:
        facts = sorted(held_out) if split != "train" else [f for f in arithmetic_facts(2, max_operand) if f not in held_out]
    rng = random.Random(f"{seed}-{split}")
    wordings = _OTHER_WORDINGS if split == "wording" else None
    return [arithmetic_problem(rng, i, split if split != "heldout" else "test", facts, wordings) for i in range(size)]


@dataclass(frozen=True)
class LoadReport:
    problems: list[Problem]
    skipped: list[tuple[int, str]] = field(default_factory=list)
    """(1-based row number, reason) of every row that was skipped."""


DatasetFormat = Literal["auto", "dapo", "gsm8k", "math", "aime"]

INSTRUCTIONS = {
    "dapo": "",  # DAPO-Math prompts carry their own instruction
    "gsm8k": 'Let\'s think step by step and output the final answer after "####".',  # verl's GSM8K preprocessing
    "math": "Please reason step by step, and put your final answer within \\boxed{}.",
    "aime": "Please reason step by step, and put your final answer within \\boxed{}.",
}
"""What a dataset format's prompts get appended by default (DatasetTask.instruction overrides it)."""


def row_format(row: dict) -> str:
    """The format of one row: gsm8k (question + answer with a "#### N" line), math (problem +
    solution with \\boxed{}), aime (problem + integer answer, no solution), else dapo
    (reward_model.ground_truth or a chat prompt, or any prompt + answer/solution/ground_truth)."""
    if isinstance(row.get("reward_model"), dict) or isinstance(row.get("prompt"), list):
        return "dapo"
    if "question" in row and isinstance(row.get("answer"), str) and "####" in row["answer"]:
        return "gsm8k"
    if "problem" in row and any(box in str(row.get("solution", "")) for box in ("\\boxed", "\\fbox")):
        return "math"
    if "problem" in row and re.fullmatch(r"\s*-?\d+\s*", str(row.get("answer", ""))) and "solution" not in row:
        return "aime"
    return "dapo"  # prompt + answer / ground_truth / solution: the generic form the dapo reader takes


PROMPT_FIELDS = ("prompt", "problem", "question")
"""Where a row's prompt is looked for when no prompt field is named, in this order."""

CHAT_ROLES = ("system", "user", "assistant")


def _row_prompt(row: dict, field: str | None = None) -> tuple[str, str, tuple[dict, ...]]:
    """(the column it came from, the prompt's text, its chat messages or () for a plain string).
    A chat prompt is a list of {role, content} messages (system/user/assistant) ending with a user turn."""
    key = field if field is not None else next((k for k in PROMPT_FIELDS if k in row), PROMPT_FIELDS[0])
    prompt = row.get(key)
    if isinstance(prompt, list):  # chat form: [{"role": "user", "content": ...}, ...]
        for i, m in enumerate(prompt):
            if not (isinstance(m, dict) and m.get("role") in CHAT_ROLES and isinstance(m.get("content"), str)):
                raise ValueError(f"{key!r} message {i} is not a {{role: system|user|assistant, content: text}} message: {str(m)[:80]}")
        if not prompt or prompt[-1]["role"] != "user" or not prompt[-1]["content"].strip():
            raise ValueError(f"{key!r} messages must end with a non-empty user message")
        return key, prompt[-1]["content"], tuple({"role": m["role"], "content": m["content"]} for m in prompt)
    if not isinstance(prompt, str) or not prompt.strip():
        names = repr(field) if field is not None else "'prompt', 'problem' or 'question'"
        raise ValueError(f"no prompt (expected a non-empty {names}: text or a list of chat messages)")
    return key, prompt, ()


def _row_answer(row: dict, fmt: str, auto: bool = False) -> str:
    """The ground truth of one row in ``fmt``; ``auto``: the format was guessed from the row (then an
    answer field that reads as a worked solution gives its marked final answer, or the row is skipped)."""
    if fmt == "gsm8k":
        answer = row.get("answer")
        if not isinstance(answer, str) or "####" not in answer:
            raise ValueError("no '#### N' line in the GSM8K answer")
        final = answer.rsplit("####", 1)[1].strip().replace(",", "")
        if not final:
            raise ValueError("nothing after '####' in the GSM8K answer")
        return final
    if fmt == "math":
        if row.get("answer") not in (None, ""):
            return str(row["answer"]).strip()
        boxed = extract(str(row.get("solution", "")), require_marker=True)
        if boxed is None or boxed.marker != "boxed":
            raise ValueError("no \\boxed{} answer in the MATH solution")
        return boxed.answer
    if fmt == "aime":
        answer = str(row.get("answer", "")).strip()
        if not re.fullmatch(r"-?\d+", answer):
            raise ValueError(f"AIME answers are integers, got {answer[:40]!r}")
        return str(int(answer))
    reward_model = row.get("reward_model")
    answer = reward_model.get("ground_truth") if isinstance(reward_model, dict) else None
    answer = answer if answer is not None else row.get("answer", row.get("ground_truth"))
    solution = str(row.get("solution", "")).strip()
    if answer is None and " " in solution:  # a worked solution: its final answer, after a marker
        found = extract(solution, require_marker=True)
        if found is None:
            raise ValueError("no final answer in the solution (expected \\boxed{}, '####' or 'The answer is'), and no answer field")
        return found.answer
    if auto and isinstance(answer, str) and _worked(answer):  # e.g. a GSM8K answer without its "#### N" line
        found = extract(answer, require_marker=True)
        if found is None:
            raise ValueError("the answer field reads as a worked solution with no final answer after a marker "
                             "(expected \\boxed{}, '####' or 'The answer is'); give the final answer alone")
        return found.answer
    answer = answer if answer is not None else (solution or None)  # a solution that is just the answer
    if answer is None or (isinstance(answer, str) and not answer.strip()):
        raise ValueError("no ground truth (expected reward_model.ground_truth, 'answer', 'solution' or 'ground_truth')")
    return str(answer).strip()


def _row_problem(
    row: dict, default_id: str, fmt: str, instruction: str | None, prompt_field: str | None, answer_field: str | None,
    system_prompt: str | None, require_answer: bool,
) -> Problem:
    kind = row_format(row) if fmt == "auto" else fmt
    key, prompt, messages = _row_prompt(row, prompt_field)
    suffix = INSTRUCTIONS[kind] if instruction is None else instruction
    prompt = f"{prompt.rstrip()} {suffix}" if suffix else prompt
    system = row.get("system") if isinstance(row.get("system"), str) and row["system"].strip() else system_prompt
    if messages or system:
        messages = messages or ({"role": "user", "content": prompt},)
        messages = (*messages[:-1], {"role": "user", "content": prompt})  # the last user turn, instruction included
        if system and messages[0]["role"] != "system":
            messages = ({"role": "system", "content": system}, *messages)
    if answer_field is not None:
        answer = row.get(answer_field)
        truth = None if answer is None or (isinstance(answer, str) and not answer.strip()) else str(answer).strip()
        if truth is None and require_answer:
            raise ValueError(f"no ground truth in {answer_field!r}")
    else:
        try:
            truth = _row_answer(row, kind, auto=fmt == "auto")
        except ValueError:
            if require_answer:
                raise
            truth = None
    metadata = {k: v for k, v in row.items() if k not in (key, "system", answer_field)}
    return Problem(str(row.get("id", default_id)), prompt, truth, tuple(messages), metadata)


def _worked(answer: str) -> bool:
    """An answer field that is a worked solution, not a ground truth: several lines, GSM8K's
    ``<<a+b=c>>`` calculator notes, or several sentences (a closed form such as "3 \\sqrt{2}", "x = 1 or
    x = 2" or a one-sentence description of a set is not)."""
    return "\n" in answer.strip() or "<<" in answer or re.search(r"[.!?]\s+[A-Z]", answer) is not None


def _rows(path: Path):
    if path.is_dir():
        yield from enumerate(_saved_dataset_rows(path), start=1)
        return
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ImportError(f"reading {path} needs pyarrow (pip install pyarrow)") from None
        yield from enumerate(pq.read_table(path).to_pylist(), start=1)
        return
    with path.open("rb") as f:  # bytes: a row that is not UTF-8 is skipped by itself, not the whole file
        for number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                yield number, ValueError(f"not UTF-8 ({err.reason} at byte {err.start})")
                continue
            if not line.strip():
                continue
            try:
                yield number, json.loads(line)
            except json.JSONDecodeError as err:
                yield number, err


def _saved_dataset_rows(folder: Path) -> list:
    """The rows of a Hugging Face ``datasets`` folder written by ``Dataset.save_to_disk`` (its Arrow
    files, read with pyarrow: the ``datasets`` package is not needed)."""
    if (folder / "dataset_dict.json").is_file():
        splits = json.loads((folder / "dataset_dict.json").read_text()).get("splits", [])
        raise FileNotFoundError(f"dataset {folder} holds several splits ({', '.join(splits)}); give one split's folder, e.g. {folder / (splits or ['train'])[0]}")
    if not (folder / "state.json").is_file():
        raise FileNotFoundError(f"dataset {folder} is a folder but not one saved by datasets' save_to_disk (no state.json); give a .jsonl or .parquet file")
    import pyarrow as pa

    state = json.loads((folder / "state.json").read_text())
    rows = []
    for entry in state.get("_data_files", []):
        with pa.memory_map(str(folder / entry["filename"])) as source:
            rows.extend(pa.ipc.open_stream(source).read_all().to_pylist())
    return rows


def load_dataset(
    path: str | Path, max_prompt_chars: int = 8192, fmt: DatasetFormat = "auto", instruction: str | None = None, *,
    prompt_field: str | None = None, answer_field: str | None = None, system_prompt: str | None = None, require_answer: bool = True,
) -> LoadReport:
    """Load a jsonl or parquet dataset, or a folder saved by ``datasets``' ``save_to_disk``, in ``fmt``
    (auto: each row's own, ``row_format``), with ``instruction`` appended to every prompt (None: the
    format's INSTRUCTIONS entry; "": none).

    The prompt is ``prompt_field`` (None: the first of PROMPT_FIELDS) as text or a list of chat
    messages; a row's ``system`` column, else ``system_prompt``, becomes a system message unless the
    messages hold one. The ground truth is ``answer_field`` when named (else the format's); a row
    without one is skipped when ``require_answer`` (the built-in rewards compare with it), else
    gets None. Every other column (all but the prompt's, ``system`` and a named ``answer_field``)
    is the problem's ``metadata``, passed to the reward unchanged. Bad rows (unparseable, no
    prompt, no ground truth, over-long prompt) are skipped and reported by 1-based row number;
    nothing raises for them. An empty result raises, naming the file and the first reasons."""
    path = Path(path)
    if not path.exists():
        where = "" if path.is_absolute() else f" (a relative path is read from the folder drpo runs in: looked for {path.resolve()})"
        raise FileNotFoundError(f"dataset {path} does not exist{where}")
    problems, skipped = [], []
    for number, row in _rows(path):
        try:
            if isinstance(row, Exception):
                raise ValueError(f"not JSON: {row}" if isinstance(row, json.JSONDecodeError) else str(row))
            if not isinstance(row, dict):
                raise ValueError("not an object")
            problem = _row_problem(row, f"{path.stem}-{number}", fmt, instruction, prompt_field, answer_field, system_prompt, require_answer)
            if (chars := problem.prompt_chars()) > max_prompt_chars:
                raise ValueError(f"prompt has {chars} characters (all its messages), more than {max_prompt_chars}")
            problems.append(problem)
        except ValueError as err:
            skipped.append((number, str(err)))
    if not problems:
        raise ValueError(f"dataset {path} has no rows" if not skipped else f"dataset {path} has no usable rows; first problems: {skipped[:3]}")
    return LoadReport(problems, skipped)
