"""`drpo train` on the multi-step word-problem task with math-verify rewards, over-long shaping, and
eval sets of four formats (the task's own held-out split, a GSM8K, a MATH and an AIME file): every
evaluation reports mean@k, pass@k, greedy accuracy, response lengths and truncation per set, in
metrics.jsonl, on the Prometheus endpoint's families and in `drpo report` (real Ray, real
math-verify, the tiny chat model whose replies run to tens of digits: some end, some are cut at
the token limit)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from controller.app import train
from controller.config import RunConfig
from controller.prometheus import RunCollector
from controller.report import write_report
from tests.test_controller_e2e import records

pytestmark = [pytest.mark.ray, pytest.mark.engine, pytest.mark.slow]

PENALTY = 0.5


def write_rows(path: Path, rows: list[dict]) -> str:
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def word_run(ray_local, tiny_vllm_long_model, module_tmp):
    tmp = module_tmp("word")
    gsm8k = write_rows(tmp / "gsm8k.jsonl", [
        {"question": "Tom has 3 apples and buys 4 more. How many apples does he have?", "answer": "3 + 4 = 7\n#### 7"},
        {"question": "A box holds 6 pens. How many pens are in 2 boxes?", "answer": "6 * 2 = 12\n#### 12"},
        {"question": "Mia had 10 cards and gave away 3. How many are left?", "answer": "10 - 3 = 7\n#### 7"},
    ])
    math = write_rows(tmp / "math.jsonl", [
        {"problem": "What is half of 1?", "solution": "Half of 1 is $\\boxed{\\frac{1}{2}}$."},
        {"problem": "Compute $2 + 3$.", "solution": "$2+3=\\boxed{5}$."},
    ])
    aime = write_rows(tmp / "aime.jsonl", [
        {"problem": "Find the number of positive divisors of 12.", "answer": 6},
        {"problem": "What is 7 times 8?", "answer": "56"},
    ])
    cfg = RunConfig.model_validate({
        "run_dir": str(tmp / "run"), "model": {"path": str(tiny_vllm_long_model)},
        "task": {"type": "word_problems", "level": 2, "train_size": 32, "test_size": 3},
        "rollout": {"workers": 1, "samples_per_prompt": 4, "max_new_tokens": 24, "max_batch_prompts": 4, "max_eval_rows": 6, "reward": "math_verify",
                    "scoring": {"overlong_penalty": PENALTY}, "precision": "auto"},
        "learner": {"optimizer": {"lr": 1e-5}, "micro_batch_size": 8, "objective": {"type": "drpo", "delta": 0.2}},
        "advantages": {"filter_zero_variance": False},
        "train": {"steps": 2, "prompts_per_step": 2, "mode": "sync"},
        "eval": {"every": 0, "at_start": True, "samples_per_prompt": 2, "pass_k": [1, 2], "greedy": True,
                 "sets": [{"name": "gsm8k", "path": gsm8k, "format": "gsm8k"}, {"name": "math", "path": math, "format": "math"},
                          {"name": "aime", "path": aime, "format": "aime"}]},
        "checkpoint": {"every": 0, "hf": False}, "metrics": {"port": None, "progress": False},
    })
    train(cfg)
    return Path(cfg.run_dir)


def test_every_eval_set_reports_mean_and_pass_at_k_greedy_lengths_and_truncation(word_run):
    evals = records(word_run, "eval")
    assert [e["step"] for e in evals] == [0, 2]
    for e in evals:
        assert list(e["sets"]) == ["heldout", "gsm8k", "math", "aime"]
        assert [e["sets"][name]["prompts"] for name in e["sets"]] == [3, 3, 2, 2]
        for name, s in e["sets"].items():
            assert s["k"] == 2 and s["samples"] == 2 * s["prompts"] and s["failed"] == 0, name
            assert s["mean_at_k"] == pytest.approx(s["pass_at_1"]), name
            assert 0.0 <= s["pass_at_1"] <= s["pass_at_2"] <= 1.0, name
            assert 0.0 <= s["greedy"] <= 1.0 and 0 < s["response_tokens_mean"] <= 24 and 0.0 <= s["truncated_frac"] <= 1.0, name
        assert e["accuracy"] == e["sets"]["heldout"]["mean_at_k"]
        # one worker, 10 prompts: the sampled ones (n = 2) three to a call of <= 6 rows, then the
        # greedy ones six to a call, the sets sharing calls
        assert e["engine_calls"] == math.ceil(10 / (6 // 2)) + math.ceil(10 / 6)


def test_training_used_math_verify_verdicts_and_the_over_long_penalty(word_run):
    steps = records(word_run, "step")
    assert len(steps) == 2
    for s in steps:
        reasons = {k.removeprefix("reward/reason/"): v for k, v in s.items() if k.startswith("reward/reason/")}
        assert sum(reasons.values()) == pytest.approx(1.0)
        # (math_verify's verdicts on closed forms are tests/test_answers.py's: this model replies with digit strings)
        # the trained reward is correctness minus the penalty on every truncated response
        assert s["reward/mean"] == pytest.approx(s["reward/accuracy"] - PENALTY * s["rollout/truncated_frac"], abs=1e-9)
        assert 0 < s["rollout/response_tokens_mean"] <= 24
    assert any(s["rollout/truncated_frac"] > 0 for s in steps)  # some replies ran past 24 tokens: the penalty applied


def test_eval_sets_reach_prometheus_families_and_the_report(word_run):
    last = records(word_run, "eval")[-1]
    collector = RunCollector()
    collector.update({f"eval/{name}/{k}": v for name, s in last["sets"].items() for k, v in s.items()})
    families = {f.name: f for f in collector.collect()}
    pass_at = {(x.labels["set"], x.labels["k"]) for x in families["drpo_eval_pass_at_k_ratio"].samples}
    assert pass_at == {(name, k) for name in ("heldout", "gsm8k", "math", "aime") for k in ("1", "2")}
    assert {x.labels["set"] for x in families["drpo_eval_greedy_accuracy_ratio"].samples} == {"heldout", "gsm8k", "math", "aime"}
    assert {x.labels["stat"] for x in families["drpo_eval_response_tokens"].samples} == {"mean", "median", "max"}
    page = write_report(word_run).read_text()
    assert all(f"eval set {name}" in page for name in ("heldout", "gsm8k", "math", "aime")) and "pass@2" in page
