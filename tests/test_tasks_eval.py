"""Generated tasks hold out what they claim to, their answers are right (recomputed from the text
by a reader written here), dataset formats load, and pass@k is the unbiased estimator."""

from __future__ import annotations

import itertools
import json
import random
import re
from fractions import Fraction

import pytest

from controller.eval_metrics import pass_at_k, summarize
from rollout.tasks import arithmetic_split, held_out_facts, load_dataset
from rollout.word_problems import LEVELS, word_problem_split, word_problems

def write_rows(path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


# ---- arithmetic -------------------------------------------------------------------------------------


def fact_of(prompt: str) -> tuple[int, str, int]:
    """The (a, op, b) an arithmetic prompt states (training wordings and the "wording" set's),
    read back from its text."""
    a, b = map(int, re.findall(r"\d+", prompt)[:2])
    op = "*" if re.search(r"boxes|bags holds", prompt) else "-" if re.search(r"gives away|takes", prompt) else "+"
    return a, op, b


def test_no_heldout_text_or_fact_occurs_in_training_at_the_default_sizes():
    train, test = arithmetic_split("train", 2048), arithmetic_split("test", 128)
    assert not {p.prompt for p in train} & {p.prompt for p in test}
    train_facts, test_facts = {fact_of(p.prompt) for p in train}, {fact_of(p.prompt) for p in test}
    assert not train_facts & test_facts  # README: the facts are disjoint, only names, items and templates are shared
    assert test_facts <= held_out_facts() and len(held_out_facts()) == 41  # a quarter of the 164 single-digit facts
    swapped = {(b, op, a) for a, op, b in train_facts if op in "+*"}
    assert not swapped & test_facts  # a held-out sum or product is not trained on in the other order either
    ranged = arithmetic_split("range", 64)
    assert all(min(fact_of(p.prompt)[::2]) >= 10 for p in ranged)  # operands never seen in training
    wording = arithmetic_split("wording", 64)
    train_sentences = {s for p in train for s in re.sub(r"\d+", "N", p.prompt).split(". ")}
    assert all(not set(re.sub(r"\d+", "N", p.prompt).split(". ")[:-1]) & train_sentences for p in wording)  # other wordings


def test_every_arithmetic_answer_is_right():
    for split in ("train", "heldout", "wording", "range"):
        for p in arithmetic_split(split, 200):
            a, op, b = fact_of(p.prompt)
            assert int(p.ground_truth) == {"+": a + b, "-": a - b, "*": a * b}[op], p


# ---- word problems ----------------------------------------------------------------------------------

_READER = [  # (phrase, operation): this test's own reading of the generator's sentences
    ("times as many", "*"), ("equal groups", "/"), ("equal piles", "/"), ("more", "+"),
    ("gives away", "-"), ("loses", "-"), ("sells", "-"), ("to a friend", "-"),
]


def read_word_problem(text: str) -> tuple[Fraction, list[str]]:
    """The answer and the operations, read from the text alone: the first sentence states the start,
    each sentence up to the question one step."""
    sentences = [s for s in re.split(r"(?<=[.?])\s+", text) if s]
    value, ops = Fraction(int(re.search(r"\d+", sentences[0]).group())), []
    for sentence in sentences[1:-1]:
        n = int(re.search(r"\d+", sentence).group())
        op = next(op for phrase, op in _READER if phrase in sentence)
        value, ops = {"+": value + n, "-": value - n, "*": value * n, "/": value / n}[op], ops + [op]
    return value, ops


@pytest.mark.parametrize("level", sorted(LEVELS))
def test_every_word_problem_answer_is_right_and_whole_and_levels_set_the_steps(level):
    for split in ("train", "test"):
        problems = word_problems(split, 300, level, test_size=50)
        for wp in problems:
            value, ops = read_word_problem(wp.text)
            assert value.denominator == 1 and value == wp.answer >= 0, wp.text  # exact splits, never below zero
            assert len(ops) == LEVELS[level].steps and set(ops) <= set(LEVELS[level].ops), wp.text
        assert len({wp.text.split(". ")[1].split(" ")[1] for wp in problems}) > 3  # varied wording


def test_word_problem_training_excludes_every_heldout_text_and_chain():
    test = word_problems("test", 128, 2)
    train = word_problems("train", 2048, 2, test_size=128)
    assert not {wp.text for wp in train} & {wp.text for wp in test}
    assert not {(wp.start, wp.steps) for wp in train} & {(wp.start, wp.steps) for wp in test}
    other_level = word_problems("test", 128, 1)  # evaluated too (task.eval_levels): held out as well
    train = word_problems("train", 2048, 2, test_size=128, also_held_out=(1,))
    assert not {(wp.start, wp.steps) for wp in train} & {(wp.start, wp.steps) for wp in other_level}
    assert {(wp.start, wp.steps) for wp in word_problems("train", 2048, 2, test_size=128)} & {(wp.start, wp.steps) for wp in other_level}
    problems = word_problem_split("test", 4, 2)
    assert all(p.prompt.endswith('write "The answer is" followed by the number.') for p in problems)


# ---- dataset formats --------------------------------------------------------------------------------


def test_gsm8k_math_and_aime_rows_load_with_their_answers_and_instructions(tmp_path):
    gsm8k = tmp_path / "gsm8k.jsonl"
    write_rows(gsm8k, [
        {"question": "Ann has 3 pens and buys 4. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
        {"question": "A big sum?", "answer": "So it is\n#### 1,234"},
        {"question": "No final line", "answer": "7"},
    ])
    report = load_dataset(gsm8k, fmt="gsm8k")
    assert [p.ground_truth for p in report.problems] == ["7", "1234"]
    assert report.problems[0].prompt.endswith('output the final answer after "####".')
    assert report.skipped == [(3, "no '#### N' line in the GSM8K answer")]
    auto = load_dataset(gsm8k)  # auto: the rows with a '####' line read as GSM8K, the last as a generic prompt + answer
    assert [p.ground_truth for p in auto.problems] == ["7", "1234", "7"] and auto.problems[2].prompt == "No final line"

    math = tmp_path / "math.jsonl"
    write_rows(math, [
        {"problem": "Compute 1/2 + 1/4.", "solution": "We get $\\frac{1}{2}+\\frac{1}{4} = \\boxed{\\frac{3}{4}}$."},
        {"problem": "No box", "solution": "It is 3.", "answer": "3"},
    ])
    report = load_dataset(math, fmt="math")
    assert [p.ground_truth for p in report.problems] == ["\\frac{3}{4}", "3"]
    assert "\\boxed{}" in report.problems[0].prompt

    aime = tmp_path / "aime.jsonl"
    write_rows(aime, [{"problem": "Find N.", "answer": 204}, {"problem": "Bad", "answer": "1/2"}])
    report = load_dataset(aime, fmt="aime", instruction="")
    assert [(p.prompt, p.ground_truth) for p in report.problems] == [("Find N.", "204")]
    assert report.skipped == [(2, "AIME answers are integers, got '1/2'")]


# ---- pass@k -----------------------------------------------------------------------------------------


def brute_pass_at_k(n: int, c: int, k: int) -> Fraction:
    """The share of k-subsets of n samples (c correct) that hold a correct one, by enumeration."""
    samples = [1] * c + [0] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return Fraction(sum(any(samples[i] for i in s) for s in subsets), len(subsets))


def test_pass_at_k_is_the_unbiased_estimator():
    for n in range(1, 8):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(float(brute_pass_at_k(n, c, k)), abs=1e-12), (n, c, k)
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(3, 1, 4)


def test_an_eval_set_summary_reports_mean_and_pass_at_k_lengths_and_truncation():
    rng = random.Random(0)
    sampled = [[rng.random() < 0.3 for _ in range(4)] for _ in range(10)]
    out = summarize([[float(x) for x in p] for p in sampled], [1, 4], [10, 20, 30, 40] * 10, [False, True, False, False] * 10, [True] * 40)
    flat = [x for p in sampled for x in p]
    assert out["mean_at_k"] == pytest.approx(sum(flat) / 40) == pytest.approx(out["pass_at_1"])  # pass@1 is mean@k
    assert out["pass_at_4"] == pytest.approx(sum(any(p) for p in sampled) / 10)  # k = n: any correct
    assert (out["response_tokens_mean"], out["response_tokens_median"], out["response_tokens_max"]) == (25.0, 25.0, 40)
    assert out["truncated_frac"] == 0.25 and out["answer_marker_frac"] == 1.0 and out["prompts"] == 10


def test_auto_rows_with_a_worked_solution_take_its_final_answer_or_are_skipped(tmp_path):
    rows = tmp_path / "mixed.jsonl"
    write_rows(rows, [
        {"problem": "What is 3+4?", "solution": "We add them, so the answer is 7."},
        {"problem": "What is 5+5?", "solution": "We add them and get ten"},
        {"problem": "What is 2+2?", "solution": "4"},
        {"problem": "Box it", "solution": "So \\fbox{9}"},
    ])
    report = load_dataset(rows)
    assert [p.ground_truth for p in report.problems] == ["7", "4", "9"]
    assert report.skipped == [(2, "no final answer in the solution (expected \\boxed{}, '####' or 'The answer is'), and no answer field")]
    # an answer field that is a worked solution (a GSM8K row missing its "#### N" line): its marked answer, or skipped
    write_rows(rows, [
        {"question": "48 clips?", "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nShe sold 48+24 = <<48+24=72>>72 clips."},
        {"question": "2 + 5?", "answer": "Add the two numbers. The answer is 7."},
        {"question": "root?", "answer": "3 \\sqrt{2}"},
        {"question": "solve", "answer": "x = 1 or x = 2"},
        {"question": "which?", "answer": "The set of all real numbers greater than 2"},
    ])
    report = load_dataset(rows)
    assert [p.ground_truth for p in report.problems] == ["7", "3 \\sqrt{2}", "x = 1 or x = 2", "The set of all real numbers greater than 2"]
    assert report.skipped == [(1, "the answer field reads as a worked solution with no final answer after a marker "
                                  "(expected \\boxed{}, '####' or 'The answer is'); give the final answer alone")]
    assert len(load_dataset(rows, fmt="dapo").problems) == 5  # a format named explicitly takes the answer field as it is


def test_one_file_loaded_twice_reports_its_skipped_rows_per_load(tmp_path):
    from controller.app import problems
    from controller.config import load_config

    data = tmp_path / "mixed.jsonl"
    write_rows(data, [
        {"question": "1 + 1?", "answer": "So #### 2"},
        {"question": "2 + 2?", "answer": "4"},  # a plain answer: fine as a dapo row, no "####" for gsm8k
    ])
    cfg = load_config(overrides=[f"model.path={tmp_path}", f'task={json.dumps({"type": "dataset", "train_path": str(data)})}',
                                 f'eval.sets={json.dumps([{"name": "strict", "path": str(data), "format": "gsm8k"}])}'])
    train, evals, skipped = problems(cfg)
    assert [p.ground_truth for p in train] == ["2", "4"] and [p.ground_truth for p in evals["strict"]] == ["2"]
    assert skipped == {"eval.sets[0] (strict)": (str(data), [(2, "no '#### N' line in the GSM8K answer")])}  # training skipped nothing
