"""Rewards of one's own, without Ray or an engine: a function by import path (per sample and in
batches, with kwargs and components), a reward service and an LLM judge behind real HTTP servers on
127.0.0.1, what a failing reward does to a group, and dataset rows as the reward sees them (chat
prompts, system prompts, extra columns, a save_to_disk folder)."""

from __future__ import annotations

import json
import math
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rollout.config import HttpRewardConfig, JudgeRewardConfig, PythonRewardConfig, RolloutConfig
from rollout.grader import Grader, reward_input
from rollout.records import TrainTicket
from rollout.reward_functions import as_result, build_reward
from rollout.rewards import RewardInput
from rollout.tasks import Problem, load_dataset
from tests.test_grader import completion, decoded

SCORER = '''
from rollout.rewards import RewardResult

def length_bonus(sample, bonus=0.0, fail_on=None):
    if fail_on is not None and sample.response == fail_on:
        raise ValueError(f"cannot score {sample.response!r}")
    correct = float(sample.ground_truth is not None and sample.ground_truth in sample.response)
    return {"score": correct + bonus, "components": {"correct": correct, "bonus": bonus, "rubric": float(len(sample.metadata.get("rubric", "")))}}

def length_bonus_batch(samples, bonus=0.0, fail_on=None):
    return [length_bonus(s, bonus, fail_on) for s in samples]

def not_a_number(sample):
    return "yes"

def infinite(sample):
    return float("inf")
'''


@pytest.fixture
def scorer(tmp_path, monkeypatch):
    """A module of one's own, outside the drpo package, on the path as PYTHONPATH would put it."""
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "my_scorer.py").write_text(SCORER)
    monkeypatch.syspath_prepend(str(folder))
    yield "my_scorer"
    sys.modules.pop("my_scorer", None)


def sample(response: str, truth: str | None = "42", **metadata) -> RewardInput:
    return RewardInput("p", "What is 6*7?", ({"role": "user", "content": "What is 6*7?"},), response, (1, 2), "stop", truth, metadata)


def test_a_function_by_import_path_gets_its_kwargs_and_reports_components(scorer):
    reward = build_reward(PythonRewardConfig(function=f"{scorer}:length_bonus", kwargs={"bonus": 0.25}), None)
    results = reward.score([sample("it is 42", rubric="abc"), sample("no idea")])
    assert [r.score for r in results] == [1.25, 0.25] and [r.reason for r in results] == ["scored", "scored"]
    assert results[0].components == {"correct": 1.0, "bonus": 0.25, "rubric": 3.0}
    with pytest.raises(ImportError, match="cannot import 'no_such_module'.*PYTHONPATH"):
        build_reward(PythonRewardConfig(function="no_such_module:f"), None)
    with pytest.raises(ImportError, match="has no callable 'nothing'"):
        build_reward(PythonRewardConfig(function=f"{scorer}:nothing"), None)


def test_the_batch_form_gives_the_per_sample_scores(scorer):
    samples = [sample(t, rubric="r" * i) for i, t in enumerate(["42", "7", "it is 42", "", "fail me"])]
    one = build_reward(PythonRewardConfig(function=f"{scorer}:length_bonus", kwargs={"bonus": 0.5}), None).score(samples)
    batch = build_reward(PythonRewardConfig(function=f"{scorer}:length_bonus_batch", kwargs={"bonus": 0.5}, batch=True), None).score(samples)
    assert one == batch and len(one) == 5
    failing = build_reward(PythonRewardConfig(function=f"{scorer}:length_bonus_batch", kwargs={"fail_on": "7"}, batch=True), None)
    assert {r.reason for r in failing.score(samples)} == {"error"}  # a batch call that raises fails its whole group's samples


def test_what_is_not_a_usable_score_is_a_named_failure(scorer):
    assert as_result("yes").reason == "invalid" and "expected a number" in as_result("yes").detail
    assert as_result(float("nan")).reason == "invalid" and as_result(True).reason == "invalid"
    assert as_result({"score": 1.0, "components": {"a": "x"}}).reason == "invalid"
    assert as_result(1.5, (0.0, 1.0)).detail == "score 1.5 is outside score_range [0, 1]"
    assert as_result({"score": 0.5, "components": {"f": 1}}).components == {"f": 1.0}
    (r,) = build_reward(PythonRewardConfig(function=f"{scorer}:infinite"), None).score([sample("x")])
    assert r.reason == "invalid" and r.score == 0.0 and math.isfinite(r.score)


def test_one_failing_sample_of_eight_is_counted_and_every_failing_sample_fails_the_group(scorer):
    texts = {i: f"answer {i}" for i in range(1, 9)}
    decode = lambda ids: texts[int(ids[0])]  # noqa: E731
    ticket, problem = TrainTicket(0, "p"), Problem("p", "What is 6*7?", "answer 1")
    config = PythonRewardConfig(function=f"{scorer}:length_bonus", kwargs={"fail_on": "answer 3"})
    group = Grader.build(RolloutConfig(reward=config)).grade(ticket, problem, *decoded([completion(i) for i in texts], decode), 0, 0.1, 0)
    assert group.error is None and len(group.samples) == 8
    assert [s.reward.reason for s in group.samples].count("scored") == 7
    (failed,) = group.reward_errors
    assert failed.reason == "error" and failed.detail == "ValueError: cannot score 'answer 3'" and failed.score == 0.0
    assert group.scoring_seconds > 0
    dropped = Grader.build(RolloutConfig(reward=config.model_copy(update={"on_error": "drop_group"})))
    group = dropped.grade(ticket, problem, *decoded([completion(i) for i in texts], decode), 0, 0.1, 0)
    assert group.samples == () and group.error.startswith(f"reward {scorer}:length_bonus failed on 1 of 8 samples (error): ValueError")
    broken = Grader.build(RolloutConfig(reward=PythonRewardConfig(function=f"{scorer}:not_a_number")))
    group = broken.grade(ticket, problem, *decoded([completion(i) for i in texts], decode), 0, 0.1, 0)
    assert group.error.startswith(f"reward {scorer}:not_a_number failed on every sample (invalid): returned str 'yes'")


class _Service:
    """A real HTTP server on 127.0.0.1 in a thread; ``answer(path, body)`` -> (status, JSON)."""

    def __init__(self, answer):
        service = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                service.requests.append((self.path, body, dict(self.headers)))
                status, reply = answer(self.path, body)
                data = json.dumps(reply).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.requests = []
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def test_a_reward_service_scores_over_http_and_an_unreachable_one_fails_each_sample_by_name():
    service = _Service(lambda path, body: (200, {"score": float(body["ground_truth"] in body["response"]), "components": {"len": len(body["response"])}}))
    try:
        reward = build_reward(HttpRewardConfig(url=f"http://127.0.0.1:{service.port}/score", retries=0, max_concurrency=4), None)
        results = reward.score([sample("42", level=3), sample("41")])
        assert [r.score for r in results] == [1.0, 0.0] and results[0].components == {"len": 2.0}
        ((path, body, _),) = [r for r in service.requests if r[1]["response"] == "42"]  # the pool sends them in any order
        assert path == "/score" and body["metadata"] == {"level": 3} and body["messages"] == [{"role": "user", "content": "What is 6*7?"}]
        assert set(body) == {"problem_id", "prompt", "messages", "response", "response_ids", "finish_reason", "ground_truth", "metadata"}
    finally:
        service.close()
    down = build_reward(HttpRewardConfig(url=f"http://127.0.0.1:{service.port}/score", retries=1, timeout_s=2), None)
    (r,) = down.score([sample("42")])
    assert r.reason == "unreachable" and "(2 attempts)" in r.detail and f"127.0.0.1:{service.port}" in r.detail
    wrong = _Service(lambda path, body: (422, {"detail": "bad sample"}))
    try:
        (r,) = build_reward(HttpRewardConfig(url=f"http://127.0.0.1:{wrong.port}/", retries=3), None).score([sample("42")])
        assert r.reason == "error" and "HTTP 422" in r.detail and len(wrong.requests) == 1  # a 4xx is not retried
    finally:
        wrong.close()


def test_an_llm_judge_on_an_openai_compatible_server_scores_with_its_parsed_verdict(monkeypatch):
    """A minimal server speaking OpenAI's chat-completions protocol (what vLLM's `vllm serve` and
    SGLang's server offer): it answers YES when the reference answer is in the judged response."""

    def judge(path, body):
        content = body["messages"][0]["content"]
        verdict = "No."
        if "Response: " in content:  # the default template
            response = content.split("Response: ", 1)[1].split("\n")[0]
            reference = content.split("Reference answer: ", 1)[1].split("\n")[0]
            verdict = "YES, it is." if reference in response else "No."
        return 200, {"id": "x", "object": "chat.completion", "choices": [{"index": 0, "message": {"role": "assistant", "content": verdict}}]}

    server = _Service(judge)
    monkeypatch.setenv("MY_JUDGE_KEY", "sekret")
    try:
        config = JudgeRewardConfig(base_url=f"http://127.0.0.1:{server.port}/v1", model="judge-1", api_key_env="MY_JUDGE_KEY")
        results = build_reward(config, None).score([sample("it is 42"), sample("it is 41")])
        assert [(r.score, r.reason) for r in results] == [(1.0, "correct"), (0.0, "wrong")]
        path, body, headers = server.requests[0]
        assert path == "/v1/chat/completions" and body["model"] == "judge-1" and body["temperature"] == 0.0
        assert headers["Authorization"] == "Bearer sekret"
        custom = config.model_copy(update={"prompt_template": "Grade {response} for level {level}", "parse": "number"})
        (r,) = build_reward(custom, None).score([sample("x", level=2)])
        assert r.reason == "invalid" and "holds no number" in r.detail  # the server said neither: no number in "No."
        (r,) = build_reward(config.model_copy(update={"prompt_template": "{missing}"}), None).score([sample("x")])
        assert r.reason == "error" and "names {missing}" in r.detail
    finally:
        server.close()


def test_chat_prompts_system_prompts_and_extra_columns_reach_the_reward_unchanged(tmp_path):
    rows = [
        {"messages": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Add 2 and 3."}], "truth": "5",
         "tests": [{"in": 1, "out": 2}], "difficulty": 0.5},
        {"messages": "Say hi.", "system": "You greet people.", "truth": "hi", "tests": [], "difficulty": 0.1},
        {"messages": [{"role": "assistant", "content": "no user turn"}], "truth": "x"},
        {"messages": "No answer here."},
    ]
    path = tmp_path / "mine.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = load_dataset(path, prompt_field="messages", answer_field="truth", instruction="", system_prompt="Default system.")
    chat, plain = report.problems
    assert chat.messages == ({"role": "system", "content": "Be terse."}, {"role": "user", "content": "Add 2 and 3."})
    assert plain.messages == ({"role": "system", "content": "You greet people."}, {"role": "user", "content": "Say hi."})
    assert [r for r, _ in report.skipped] == [3, 4]
    got = reward_input(chat, completion(1), "5")
    assert got.messages == chat.messages and got.prompt == "Add 2 and 3." and got.ground_truth == "5"
    assert got.metadata == {"tests": [{"in": 1, "out": 2}], "difficulty": 0.5}  # every other column, unchanged
    free = load_dataset(path, prompt_field="messages", answer_field="truth", instruction="", require_answer=False)
    assert len(free.problems) == 3 and free.problems[-1].ground_truth is None  # a reward of one's own may need no answer
    assert free.problems[-1].messages == ()  # a plain prompt without any system message renders as one user turn


def test_a_save_to_disk_folder_loads(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = {"question": ["What is 2+2?", "What is 3+3?"], "answer": ["4", "6"], "source": ["a", "b"]}
    datasets.Dataset.from_dict(rows).save_to_disk(str(tmp_path / "saved"))
    report = load_dataset(tmp_path / "saved", instruction="")
    assert [(p.prompt, p.ground_truth, p.metadata) for p in report.problems] == [
        ("What is 2+2?", "4", {"answer": "4", "source": "a"}), ("What is 3+3?", "6", {"answer": "6", "source": "b"})]
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows)}).save_to_disk(str(tmp_path / "splits"))
    with pytest.raises(FileNotFoundError, match="several splits \\(train\\); give one split's folder"):
        load_dataset(tmp_path / "splits")


def test_the_reward_config_keeps_bare_names_and_refuses_unknown_ones():
    assert RolloutConfig(reward="math_verify").reward.type == "math_verify"
    with pytest.raises(ValueError, match="unknown reward 'exact'"):
        RolloutConfig(reward="exact")
    with pytest.raises(ValueError, match="function"):
        RolloutConfig(reward={"type": "python", "function": "no colon"})


def test_numpy_scores_count_dataset_values_json_has_no_type_for_are_posted_and_overrides_reach_a_named_reward(scorer, tmp_path):
    import datetime
    import decimal

    import numpy as np

    from controller.app import reward_problems
    from controller.config import PRESETS, load_config
    from rollout.reward_functions import _jsonable

    assert as_result(np.float32(0.5)).score == 0.5 and as_result({"score": np.int64(1), "components": {"c": np.float64(2)}}).components == {"c": 2.0}
    row = {"when": datetime.date(2026, 1, 2), "price": decimal.Decimal("1.5"), "raw": b"ab", "vec": np.arange(2)}
    assert json.loads(json.dumps(row, default=_jsonable)) == {"when": "2026-01-02", "price": 1.5, "raw": "ab", "vec": [0, 1]}
    cfg = load_config(PRESETS / "default.yaml", ["rollout.reward.on_error=drop_group"])  # the preset names its reward
    assert (cfg.rollout.reward.type, cfg.rollout.reward.on_error) == ("literal", "drop_group")
    assert reward_problems(PythonRewardConfig(function=f"{scorer}:length_bonus")) == []
    (problem,) = reward_problems(PythonRewardConfig(function="missing_mod:f"))
    assert "cannot import 'missing_mod'" in problem
    (problem,) = reward_problems(JudgeRewardConfig(base_url="http://127.0.0.1:1/v1", model="m", api_key_env="DRPO_NO_SUCH_KEY"))
    assert "DRPO_NO_SUCH_KEY" in problem
