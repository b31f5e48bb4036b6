"""One's own task through `drpo train` for real: a reward module outside the drpo package, a chat
dataset with system prompts and extra columns, a reward that fails every sample, and a reward
service that goes down mid-run and comes back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from controller.app import train
from rollout.config import HttpRewardConfig
from tests.test_controller_e2e import records, run_config

pytestmark = [pytest.mark.ray, pytest.mark.engine, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[1]

MODULE = '''
import json, os

def judge_rows(sample, weight=0.0, seen=None):
    with open(seen, "a") as f:  # what the worker handed over, for the test to read back
        f.write(json.dumps({"messages": list(sample.messages), "metadata": sample.metadata, "truth": sample.ground_truth,
                            "ids": len(sample.response_ids), "finish": sample.finish_reason}) + "\\n")
    correct = float(sample.ground_truth in sample.response)
    return {"score": correct, "components": {"correct": correct, "weight": weight, "tests": float(len(sample.metadata["tests"]))}}
'''


def drpo_train(config: Path, cwd: Path, env: dict) -> subprocess.CompletedProcess:
    env = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, **env}
    return subprocess.run([sys.executable, "-m", "controller.cli", "train", "--config", str(config)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=900)


def test_a_reward_module_outside_drpo_trains_smollm2_on_chat_rows_with_their_columns(tmp_path):
    mine = tmp_path / "my_rewards"  # a module of one's own, found through PYTHONPATH as README says
    mine.mkdir()
    (mine / "scoring.py").write_text(MODULE)
    rows = [{"id": f"r{k}", "chat": [{"role": "user", "content": f"What is {k} plus 1?"}], "solution": str(k + 1),
             "tests": list(range(k % 3)), "source": "mine", **({"system": "Answer with a number."} if k % 2 else {})} for k in range(8)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    seen = tmp_path / "seen.jsonl"
    config = {
        "run_dir": str(tmp_path / "run"),
        "task": {"type": "dataset", "train_path": str(tmp_path / "rows.jsonl"), "prompt_field": "chat", "answer_field": "solution",
                 "instruction": "Reply with only the number."},
        "rollout": {"samples_per_prompt": 2, "max_new_tokens": 6, "max_batch_prompts": 4,
                    "reward": {"type": "python", "function": "scoring:judge_rows", "kwargs": {"weight": 0.5, "seen": str(seen)}}},
        "advantages": {"filter_zero_variance": False},
        "train": {"steps": 2, "prompts_per_step": 2, "mode": "sync"},
        "eval": {"every": 0, "at_start": False}, "checkpoint": {"every": 0, "hf": False}, "metrics": {"port": None, "progress": False},
    }
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    done = drpo_train(tmp_path / "run.yaml", REPO, {"PYTHONPATH": f"{mine}{os.pathsep}{REPO}"})
    assert done.returncode == 0, done.stderr[-3000:]
    steps = records(tmp_path / "run", "step")
    assert [s["step"] for s in steps] == [1, 2]
    for s in steps:  # the components, the kwargs and the row's columns arrived through the real workers
        assert s["reward/component/weight"] == 0.5 and 0 <= s["reward/component/correct"] <= 1
        assert s["reward/component/tests"] in {0.0, 0.5, 1.0, 1.5, 2.0} and s["reward/errors/error"] == 0
        assert s["reward/mean"] == pytest.approx(s["reward/component/correct"]) and s["reward/reason/scored"] == 1.0
    (summary,) = [line for line in done.stdout.splitlines() if line.startswith("reward components, first -> last step")]
    assert "correct " in summary and "tests " in summary and "weight 0.500 -> 0.500" in summary
    calls = [json.loads(line) for line in seen.read_text().splitlines()]
    assert len(calls) == 2 * 2 * 2  # steps x prompts x samples, each scored once
    by_id = {r["id"]: r for r in rows}
    for call in calls:
        row = next(r for r in rows if r["chat"][0]["content"] in call["messages"][-1]["content"])
        assert call["metadata"] == {"id": row["id"], "tests": row["tests"], "source": "mine"} and call["truth"] == row["solution"]
        system = [m for m in call["messages"] if m["role"] == "system"]
        assert system == ([{"role": "system", "content": "Answer with a number."}] if "system" in by_id[row["id"]] else [])
        assert call["messages"][-1] == {"role": "user", "content": f"{row['chat'][0]['content']} Reply with only the number."}
        assert 0 < call["ids"] <= 6 and call["finish"] in ("stop", "length")


def test_a_reward_that_fails_every_sample_stops_the_run_naming_it_and_its_first_error(tiny_chat_model, tmp_path):
    cfg = run_config(tmp_path, tiny_chat_model, steps=4, mode="sync", max_staleness=0, max_failures_in_a_row=4)
    data = cfg.model_dump(mode="json")
    data["rollout"]["reward"] = {"type": "python", "function": "tests.reward_fixtures:always_raises"}
    data["eval"].update(every=0, at_start=True)
    data["metrics"].update(port=None)
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(data))
    done = drpo_train(tmp_path / "run.yaml", REPO, {})
    (evaluation,) = records(tmp_path / "run", "eval")  # the evaluation before the first step counts its samples by reason too
    for name, summary in evaluation["sets"].items():  # drop_group: every prompt failed, none enters the means
        assert summary["reward_errors_error"] >= summary["failed"] > 0 == summary["samples"], (name, summary)
        assert summary["reward_errors_timeout"] == summary["reward_errors_unreachable"] == 0
    assert done.returncode == 1, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert "every rollout failed: 4 groups in a row" in last
    assert "reward tests.reward_fixtures:always_raises failed on every sample (error): KeyError: 'no rubric for arith-train-" in last
    assert "drpo train: reward tests.reward_fixtures:always_raises: first sample it could not score (error): KeyError" in done.stderr
    assert not records(tmp_path / "run", "step")  # nothing was trained on the zeros
    (first,) = records(tmp_path / "run", "reward_error")
    assert first["reward"] == "tests.reward_fixtures:always_raises" and first["reason"] == "error"


class _Scorer:
    """A reward service on 127.0.0.1 that can be stopped and started again on the same port."""

    def __init__(self):
        self.port, self.server, self.calls = 0, None, 0

    def start(self):
        scorer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                scorer.calls += 1
                data = json.dumps({"score": float(body["ground_truth"] in body["response"])}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self):
        self.server.shutdown()
        self.server.server_close()


def test_a_reward_service_that_goes_down_mid_run_fails_samples_by_reason_and_scoring_resumes(ray_local, tiny_chat_model, tmp_path):
    service = _Scorer()
    service.start()
    url = f"http://127.0.0.1:{service.port}/score"
    cfg = run_config(tmp_path, tiny_chat_model, steps=4, mode="sync", max_staleness=0, max_failures_in_a_row=10_000, max_failing_seconds=600)
    cfg = cfg.model_copy(update={
        "rollout": cfg.rollout.model_copy(update={"reward": HttpRewardConfig(url=url, retries=0, timeout_s=5)}),
        "eval": cfg.eval.model_copy(update={"every": 0, "at_start": False}),
        "metrics": cfg.metrics.model_copy(update={"port": None}),
    })
    run_dir, events = tmp_path / "run", []

    def outage():  # down once step 1 is written, up again once drpo has reported the first failed sample
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            kinds = [json.loads(line)["kind"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()[:-1]] if (run_dir / "metrics.jsonl").is_file() else []
            if "step" in kinds and not events:
                service.stop()
                events.append("down")
            if "reward_error" in kinds and events == ["down"]:
                service.start()
                events.append("up")
                return
            time.sleep(0.05)

    watcher = threading.Thread(target=outage, daemon=True)
    watcher.start()
    try:
        train(cfg)
    finally:
        watcher.join(timeout=10)
        if events == ["down", "up"] or not events:
            service.stop()
    assert events == ["down", "up"]
    steps = records(run_dir, "step")
    assert [s["step"] for s in steps] == [1, 2, 3, 4]  # the run went on and finished
    assert sum(s["reward/errors/unreachable"] for s in steps) > 0 and all(s["reward/errors/error"] == 0 for s in steps)
    (first,) = records(run_dir, "reward_error")
    assert first["reason"] == "unreachable" and url in first["error"]
    # what was trained on was scored by the service, but for samples of a group cut off mid-way (scored 0)
    assert all(s["reward/reason/scored"] + s["reward/reason/unreachable"] == pytest.approx(1.0) for s in steps)
