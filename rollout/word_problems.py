"""A generated multi-step word-problem task: one person's count of something changes over 2-4
steps (buys more, gives some away, ends up with k times as many, splits them into k equal groups
and keeps one), stated in varied wording; the model is asked to reason and then give the final
answer after a fixed marker ("The answer is N").

Levels set the difficulty (``LEVELS``): the number of steps, the operations used and the size of
the numbers. Every intermediate count stays a whole number between 0 and MAX_COUNT: subtractions
never go below zero and a split is always exact. Train and test come from disjoint seeded streams,
and training skips every problem whose text or whose chain (start and steps) is in the test split.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from rollout.tasks import Problem

WORD_INSTRUCTION = 'Solve the problem step by step. At the end, write "The answer is" followed by the number.'

MAX_COUNT = 999
"""The largest count a problem passes through (keeps every number small enough to reason about)."""


@dataclass(frozen=True)
class Level:
    steps: int
    ops: str
    """Operations drawn from: + (more), - (fewer), * (k times as many), / (k equal groups, keep one)."""
    max_number: int
    """The largest start and the largest number added or taken away."""
    max_factor: int = 3
    """The largest k of a * or / step."""


LEVELS = {
    1: Level(steps=2, ops="+", max_number=5),
    2: Level(steps=2, ops="+-", max_number=10),
    3: Level(steps=3, ops="+-", max_number=20),
    4: Level(steps=3, ops="+-*/", max_number=20),
    5: Level(steps=4, ops="+-*/", max_number=50, max_factor=4),
}

_NAMES = [("Tom", "he", "his"), ("Anna", "she", "her"), ("Ben", "he", "his"), ("Mia", "she", "her"), ("Sam", "he", "his"),
          ("Lucy", "she", "her"), ("Omar", "he", "his"), ("Nina", "she", "her"), ("Leo", "he", "his"), ("Zoe", "she", "her")]
_ITEMS = ["apples", "pencils", "stickers", "marbles", "books", "cookies", "shells", "cards", "coins", "balloons"]
_START = [
    "{Name} has {n} {item}.",
    "{Name} starts the day with {n} {item}.",
    "There are {n} {item} in {name}'s bag.",
    "{Name} collects {n} {item}.",
]
_STEPS = {
    "+": ["Then {p} buys {n} more.", "Later {p} finds {n} more {item}.", "A friend gives {name} {n} more {item}.",
          "After that, {p} gets {n} more {item}."],
    "-": ["Then {p} gives away {n} of them.", "Later {p} loses {n} {item}.", "After that, {p} sells {n} {item}.",
          "{Name} gives {n} {item} to a friend."],
    "*": ["Then {p} ends up with {n} times as many {item} as before.", "Now {name} has {n} times as many {item} as before."],
    "/": ["Then {p} splits the {item} into {n} equal groups and keeps one group.",
          "{Name} puts the {item} into {n} equal piles and keeps only one pile."],
}
_QUESTIONS = [
    "How many {item} does {name} have now?",
    "How many {item} does {name} have at the end?",
    "What is the number of {item} {name} has in the end?",
]


@dataclass(frozen=True)
class WordProblem:
    start: int
    steps: tuple[tuple[str, int], ...]
    """(operation, number) in order: +n, -n, *k, /k."""
    text: str
    level: int

    @property
    def answer(self) -> int:
        value = self.start
        for op, n in self.steps:
            value = apply(op, value, n)
        return value


def apply(op: str, value: int, n: int) -> int:
    if op == "+":
        return value + n
    if op == "-":
        return value - n
    if op == "*":
        return value * n
    if op == "/":
        return value // n
    raise ValueError(f"unknown operation {op!r}")


def _step(rng: random.Random, level: Level, value: int) -> tuple[str, int] | None:
    """One step that keeps the count a whole number in [0, MAX_COUNT], or None if the drawn
    operation cannot apply to ``value`` (the caller draws again)."""
    op = rng.choice(level.ops)
    if op == "+":
        n = rng.randint(1, level.max_number)
        return (op, n) if value + n <= MAX_COUNT else None
    if op == "-":
        return (op, rng.randint(1, min(value, level.max_number))) if value >= 1 else None
    k = rng.randint(2, level.max_factor)
    if op == "*":
        return (op, k) if 0 < value * k <= MAX_COUNT else None
    return (op, k) if value >= k and value % k == 0 else None


def word_problem(rng: random.Random, level: int) -> WordProblem:
    spec = LEVELS[level]
    start = rng.randint(2, spec.max_number)
    steps, value = [], start
    while len(steps) < spec.steps:
        step = _step(rng, spec, value)
        if step is not None:
            steps.append(step)
            value = apply(step[0], value, step[1])
    name, pronoun, _ = rng.choice(_NAMES)
    item = rng.choice(_ITEMS)
    fields = {"Name": name, "name": name, "p": pronoun, "item": item}
    sentences = [rng.choice(_START).format(n=start, **fields)]
    for op, n in steps:
        template = rng.choice(_STEPS[op])
        sentences.append(template.format(n=n, **fields))
    sentences.append(rng.choice(_QUESTIONS).format(**fields))
    return WordProblem(start, tuple(steps), " ".join(sentences), level)


def word_problem_split(split: str, size: int, level: int, seed: int = 0, test_size: int = 128, also_held_out: tuple[int, ...] = ()) -> list[Problem]:
    """``size`` problems of ``split`` ("train" or "test") at ``level``. The test split (``test_size``
    problems) is drawn first; training skips every problem whose text or chain is in it, or in the
    test split of a level of ``also_held_out`` (those evaluated too)."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    if level not in LEVELS:
        raise ValueError(f"level must be one of {sorted(LEVELS)}, got {level}")
    problems = word_problems(split, size, level, seed, test_size, also_held_out)
    return [Problem(f"word-L{level}-{split}-{i}", f"{wp.text} {WORD_INSTRUCTION}", str(wp.answer)) for i, wp in enumerate(problems)]


def word_problems(split: str, size: int, level: int, seed: int = 0, test_size: int = 128, also_held_out: tuple[int, ...] = ()) -> list[WordProblem]:
    """The structured problems behind ``word_problem_split`` (tests recompute their answers)."""
    def stream(name: str, count: int, exclude=None, at: int = level) -> list[WordProblem]:
        rng, out = random.Random(f"word-{seed}-{at}-{name}"), []
        texts, chains = exclude or (set(), set())
        for _ in range(count * 100):
            if len(out) == count:
                break
            wp = word_problem(rng, at)
            if wp.text in texts or (wp.start, wp.steps) in chains:
                continue
            out.append(wp)
        if len(out) < count:
            raise ValueError(f"level {level} cannot give {count} {name} problems distinct from the test split")
        return out

    held_out = stream("test", size if split == "test" else test_size)
    if split == "test":
        return held_out
    for other in also_held_out:
        held_out += stream("test", test_size, at=other)
    return stream("train", size, ({wp.text for wp in held_out}, {(wp.start, wp.steps) for wp in held_out}))
