"""Answer extraction and the two rewards on a table of responses: every marker, the last-number
fallback, closed forms through math-verify, computations refused, truncated and degenerate output."""

from __future__ import annotations

import time

import pytest

from rollout.answers import TAIL_CHARS, extract, is_computation, is_literal
from rollout.rewards import LiteralNumberReward, MathVerifyReward

EXTRACTION = [
    # (response, (answer, marker)) — None: no answer
    ("Tom has 3 + 4 = 7 apples.\n#### 7", ("7", "####")),
    ("#### $1,234", ("1,234", "####")),
    ("So 12 - 5 = 7. The answer is 7.", ("7", "answer is")),
    ("The answer is 12 apples.", ("12", "answer is")),
    ("Final answer: 3.5", ("3.5", "answer is")),
    ("The final answer is $\\frac{3}{4}$.", ("\\frac{3}{4}", "answer is")),
    ("The answer is 2.5. Then I checked 9 twice.", ("2.5", "answer is")),
    ("Thus the answer is \\boxed{42}.", ("42", "boxed")),  # the box stands last
    ("The answer is 12. Wait, no.\n#### 13", ("13", "####")),  # the last marker decides
    ("I think 5, then 8", ("8", "last number")),
    ("Final Answer: The final answer is $12$. I hope it is correct.", ("12", "answer is")),  # Minerva's MATH format
    ("the answer is 5.\n#### Step 2", ("5", "answer is")),  # a markdown header is no marker
    ("the answer is not clear, but 7", ("7", "last number")),  # a marker in prose states no answer
    ("The answer is 12, because 5+7", ("12", "answer is")),
    ("The answer is +5?", ("5", "answer is")),
    ("The answer is", None),  # cut right after the marker
    ("so it is \\boxed{\\frac{1}{2}", None),  # cut inside the box
    ("no numbers at all", None),
    ("\u2603\x00\x7f garbage", None),
]


@pytest.mark.parametrize("text,expected", EXTRACTION)
def test_extraction_takes_the_last_marker_then_the_last_number(text, expected):
    found = extract(text)
    assert (None if found is None else (found.answer, found.marker)) == expected


def test_a_required_marker_turns_the_last_number_fallback_off():
    assert extract("I think 5, then 8", require_marker=True) is None
    assert extract("The answer is 8.", require_marker=True).answer == "8"


def test_literals_and_computations():
    for literal in ("12", "-3.5", "1,234", "3/4", "\\frac{3}{4}", "\\dfrac{1}{2}"):
        assert is_literal(literal) and not is_computation(literal), literal
    for computation in ("7*27", "3 + 4", "2^10", "7 \\times 27", "1/2+1/3", "\\frac{7 \\times 27}{1}"):
        assert is_computation(computation), computation
    for closed_form in ("3+\\sqrt{2}", "x^2+1", "2\\sqrt{2}", "\\pi", "(1, 2)"):
        assert not is_literal(closed_form) and not is_computation(closed_form), closed_form
    assert not is_literal("1" * 100)  # a run of digits is degenerate output, not an answer


LITERAL = [
    # (response, ground truth, reason)
    ("The answer is 7.", "7", "correct"),
    ("#### 1,000", "1000", "correct"),
    ("The answer is \\frac{1}{2}.", "0.5", "correct"),  # a fraction equals its decimal exactly
    ("The answer is 8.", "7", "wrong"),
    ("The answer is \\sqrt{2}.", "\\sqrt{2}", "not_literal"),  # literal mode compares numbers only
    ("\\boxed{7 * 27}", "189", "not_literal"),
    ("The answer is", "7", "no_answer"),
    ("garbage \u2603", "7", "no_answer"),
]


@pytest.mark.parametrize("text,truth,reason", LITERAL)
def test_the_literal_reward(text, truth, reason):
    result = LiteralNumberReward().compare(text, truth)
    assert result.reason == reason and result.score == (1.0 if reason == "correct" else 0.0)


def test_math_verify_scores_closed_forms_refuses_computations_and_stays_bounded():
    reward = MathVerifyReward(timeout_s=60.0)
    try:
        assert reward.compare("The answer is $\\frac{1}{2}$.", "0.5").reason == "correct"
        assert reward.compare("The answer is \\boxed{\\dfrac{3}{4}}", "\\frac{3}{4}").reason == "correct"
        assert reward.compare("So \\boxed{2\\sqrt{2}}", "\\sqrt{8}").reason == "correct"  # literal mode would refuse this
        assert reward.compare("The answer is 3.", "\\frac{1}{2}").reason == "wrong"
        assert reward.compare("\\boxed{7 * 27}", "189").reason == "computation"  # math-verify would evaluate it to 189
        assert reward.compare("#### 13", "13").marker == "####"
        started = time.perf_counter()
        megabyte = "x" * 1_000_000 + " The answer is 12."
        assert reward.compare(megabyte, "12").score == 1.0 and len(megabyte) > 60 * TAIL_CHARS
        assert time.perf_counter() - started < 10
        reward.timeout_s = 0.0  # no time at all: the verifier is killed and the call still returns
        assert any(reward.compare("\\boxed{3}", "3").reason == "verify_timeout" for _ in range(5))  # a warm verifier can beat poll(0) now and then
        reward.timeout_s = 60.0
        assert reward.compare("\\boxed{3}", "3").reason == "correct"  # a fresh verifier
    finally:
        reward.close()


def test_a_megabyte_of_digits_is_refused_quickly_in_both_modes():
    from rollout.rewards import MAX_ANSWER_CHARS

    reward = MathVerifyReward(timeout_s=60.0)
    try:
        for mode in (LiteralNumberReward(), reward):
            started = time.perf_counter()
            result = mode.compare("1" * 1_000_000, "1")
            assert result.reason == "too_long" and result.score == 0.0 and len(result.extracted) == MAX_ANSWER_CHARS
            assert time.perf_counter() - started < 5  # refused before math-verify is even started
        assert reward._proc is None
        assert LiteralNumberReward().compare("1" * 100, "1").reason == "not_literal"  # short of the cap: still not a number
    finally:
        reward.close()


def test_overlong_shaping_is_zero_before_the_buffer_then_a_linear_ramp_to_the_penalty():
    from rollout.rewards import overlong_shaping

    # DAPO's soft over-long punishment: 0 up to max - buffer tokens, -penalty at the limit, linear between
    assert overlong_shaping(100, 192, False, 0.2, 32) == 0.0
    assert overlong_shaping(160, 192, False, 0.2, 32) == 0.0
    assert overlong_shaping(176, 192, False, 0.2, 32) == pytest.approx(-0.1)
    assert overlong_shaping(192, 192, True, 0.2, 32) == pytest.approx(-0.2)
    # no buffer: the whole penalty for a truncated response only, whatever its length
    assert overlong_shaping(192, 192, True, 0.2, 0) == -0.2 and overlong_shaping(191, 192, False, 0.2, 0) == 0.0
    assert overlong_shaping(192, 192, True, 0.0, 32) == 0.0  # off
