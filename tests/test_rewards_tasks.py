"""Rewards and tasks: extraction, literal-only comparison, time bounds, dataset rows."""

from __future__ import annotations

import json
import time

import pytest

from rollout.answers import extract
from rollout.rewards import LiteralNumberReward, MathVerifyReward, is_literal
from rollout.tasks import arithmetic_split, load_dataset


@pytest.mark.parametrize(
    "text,expected",
    [
        ("so the total is \\boxed{42}.", "42"),
        ("first 3 then \\boxed{\\frac{1}{2}} and 9 more", "\\frac{1}{2}"),
        ("Tom has 4 + 3 = 7 apples", "7"),
        ("The answer is -1,234.5", "-1,234.5"),
        ("no digits here", None),
        ("unclosed \\boxed{12", None),  # cut inside its answer: no answer, not a guess
    ],
)
def test_extract_answer(text, expected):
    found = extract(text)
    assert (None if found is None else found.answer) == expected


def test_literal_number_reward_scores_each_kind_of_answer():
    reward = LiteralNumberReward()
    assert reward.compare("I think it is \\boxed{189}", "189").reason == "correct"
    assert reward.compare("4 + 3 = 7", "7").score == 1.0  # plain final number
    assert reward.compare("half: \\boxed{\\frac{1}{2}}", "0.5").score == 1.0  # fraction vs decimal, exactly
    assert reward.compare("it is 3/4", "0.75").score == 1.0
    assert reward.compare("\\boxed{188}", "189").reason == "wrong"
    assert reward.compare("\\boxed{7 * 27}", "189").reason == "not_literal"  # an expression computes nothing
    assert reward.compare("\u2603\x00garbage", "5").reason == "no_answer"
    assert reward.compare("1,000 apples", "1000").score == 1.0


def test_math_verify_reward_refuses_computations_and_is_time_bounded():
    reward = MathVerifyReward(timeout_s=60.0)
    try:
        assert reward.compare("so \\boxed{\\frac{1}{2}}", "0.5").reason == "correct"
        assert reward.compare("\\boxed{7 * 27}", "189").reason == "computation"
        assert reward.compare("\\boxed{190}", "189").reason == "wrong"
        started = time.perf_counter()
        assert reward.compare("x" * 1_000_000 + " 12", "12").score == 1.0  # a megabyte of garbage stays linear
        assert time.perf_counter() - started < 10
        reward.timeout_s = 0.0  # no time at all: the verifier is killed and the call still returns
        started = time.perf_counter()
        assert any(reward.compare("\\boxed{3}", "3").reason == "verify_timeout" for _ in range(5))  # a warm verifier can beat poll(0) now and then
        assert time.perf_counter() - started < 6
        reward.timeout_s = 60.0  # and the next call gets a fresh verifier
        assert reward.compare("\\boxed{3}", "3").reason == "correct"
    finally:
        reward.close()


def test_literals():
    assert is_literal("12") and is_literal("-3.5") and is_literal("1,234") and is_literal("\\frac{3}{4}") and is_literal("3/4")
    assert not is_literal("7*27") and not is_literal("x+1") and not is_literal("\\sqrt{2}")


def test_arithmetic_task_is_seeded_with_a_disjoint_held_out_split():
    train, again, test = arithmetic_split("train", 50), arithmetic_split("train", 50), arithmetic_split("test", 50)
    assert train == again
    assert {p.id for p in train}.isdisjoint({p.id for p in test})
    assert [p.prompt for p in train] != [p.prompt for p in test]
    reward = LiteralNumberReward()
    assert all(reward.compare(f"\\boxed{{{p.ground_truth}}}", p.ground_truth).score == 1.0 for p in train)
    with pytest.raises(ValueError, match="split"):
        arithmetic_split("validation", 3)


def test_dataset_loader_skips_bad_rows_and_reports_them_by_number(tmp_path):
    rows = [
        {"prompt": [{"role": "user", "content": "What is 1+1?"}], "reward_model": {"ground_truth": "2"}},
        "not json at all",
        {"prompt": "What is 2+2?"},
        {"problem": "", "answer": "3"},
        {"question": "x" * 100, "answer": "5"},
        {"problem": "What is 3+3?", "solution": "6", "id": "p6"},
        {"prompt": [{"role": "system", "content": "s" * 45}, {"role": "user", "content": "What is 4+4?"}], "answer": "8"},  # system counts
    ]
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    report = load_dataset(path, max_prompt_chars=50)
    assert [(p.prompt, p.ground_truth) for p in report.problems] == [("What is 1+1?", "2"), ("What is 3+3?", "6")]
    assert report.problems[1].id == "p6"
    assert [n for n, _ in report.skipped] == [2, 3, 4, 5, 7]
    assert "not JSON" in report.skipped[0][1] and "ground truth" in report.skipped[1][1] and "50" in report.skipped[3][1]
    assert report.skipped[4][1] == "prompt has 57 characters (all its messages), more than 50"
    (tmp_path / "bad.jsonl").write_text("{}\n")
    with pytest.raises(ValueError, match="no usable rows"):
        load_dataset(tmp_path / "bad.jsonl")
    with pytest.raises(FileNotFoundError, match="relative path is read from the folder drpo runs in: looked for /"):
        load_dataset("no-such-folder/data.jsonl")  # a relative path names where it was looked for


def test_a_row_that_is_not_utf8_is_skipped_by_itself(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_bytes(b'{"problem": "What is 1+1?", "answer": "2"}\n{"problem": "bad \xff byte", "answer": "3"}\n'
                     b'{"problem": "What is 3+3?", "answer": "6"}\n')
    report = load_dataset(path)
    assert [p.ground_truth for p in report.problems] == ["2", "6"]
    assert report.skipped == [(2, "not UTF-8 (invalid start byte at byte 17)")]


def test_a_power_tower_is_refused_before_math_verify_spends_its_time_bound():
    from rollout.answers import is_too_large

    assert is_too_large("10^{10^{10}}") and is_too_large("2^{100000}") and is_too_large("9^9^9") and is_too_large("3^{1,000,000}")
    assert not is_too_large("10^{100}") and not is_too_large("x^2+1") and not is_too_large("e^{i\\pi}") and not is_too_large("2^{-3}")
    assert not is_too_large("e^{-x^2}") and not is_too_large("2^{x^{2}}")  # symbolic exponents are math-verify's to compare
    reward = MathVerifyReward(timeout_s=60.0)
    try:
        started = time.perf_counter()
        result = reward.compare("so \\boxed{10^{10^{10}}}", "7")
        assert result.reason == "too_large" and result.extracted == "10^{10^{10}}" and time.perf_counter() - started < 1
        assert reward.compare("\\boxed{10^{3}}", "1000").reason in ("correct", "wrong")  # a small power still reaches math-verify
    finally:
        reward.close()


def test_the_verifier_process_is_bounded_and_dies_with_its_parent(tmp_path):
    import os
    import subprocess
    import sys

    from rollout.rewards import VERIFY_MEMORY_BYTES

    script = (
        "import os, sys\n"
        "from rollout.rewards import MathVerifyReward\n"
        "if __name__ == '__main__':\n"
        "    r = MathVerifyReward(timeout_s=120.0)\n"
        "    assert r.compare('\\\\boxed{3}', '3').reason == 'correct'\n"
        "    print(r._proc.pid, flush=True)\n"
        "    os.kill(os.getpid(), 9)\n"
    )
    (tmp_path / "parent.py").write_text(script)
    done = subprocess.run([sys.executable, str(tmp_path / "parent.py")], capture_output=True, text=True, timeout=120,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          env={**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))})
    assert done.returncode == -9, done.stderr[-2000:]
    child = int(done.stdout.split()[0])
    deadline = time.time() + 10
    while os.path.exists(f"/proc/{child}") and time.time() < deadline:
        try:
            if open(f"/proc/{child}/stat").read().split()[2] == "Z":
                break
        except OSError:
            break
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{child}") or open(f"/proc/{child}/stat").read().split()[2] == "Z"  # gone with its parent
    reward = MathVerifyReward(timeout_s=120.0)
    try:
        assert reward.compare("\\boxed{3}", "3").reason == "correct"
        limits = open(f"/proc/{reward._proc.pid}/limits").read()
        (line,) = [l for l in limits.splitlines() if l.startswith("Max address space")]
        assert line.split()[3] == str(VERIFY_MEMORY_BYTES)
    finally:
        reward.close()


def test_dataset_loader_reads_dapo_style_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist([
        {"prompt": [{"role": "user", "content": "Compute 6*7."}], "reward_model": {"ground_truth": "42"}},
        {"prompt": [{"role": "system", "content": "no user turn"}], "reward_model": {"ground_truth": "1"}},
    ])
    pq.write_table(table, tmp_path / "dapo.parquet")
    report = load_dataset(tmp_path / "dapo.parquet")
    assert [(p.prompt, p.ground_truth) for p in report.problems] == [("Compute 6*7.", "42")]
    assert report.skipped == [(2, "'prompt' messages must end with a non-empty user message")]
    assert report.problems[0].messages == ({"role": "user", "content": "Compute 6*7."},)  # the chat form is kept for the template
