"""A real Prometheus server scrapes a real training run on loopback; every dashboard panel and
alert rule returns data through its HTTP API. `ray job submit` runs a training job on a local head."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from controller.app import train
from learner.distributed import free_port
from rollout.config import EnvironmentConfig, PythonRewardConfig
from tests.prometheus_server import Prometheus, alert_rules, dashboard_queries, with_bool
from tests.test_controller_e2e import run_config

pytestmark = [pytest.mark.ray, pytest.mark.engine, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def scraped_run(ray_local, tiny_chat_model, module_tmp):
    """A 6-step async run with the decoupled anchor (so the dashboards' pi-vs-pi_prox panels have data
    too), a reward of one's own by import path (so the reward-component panel has data), 2-turn
    episodes with an environment of one's own (the episode panels) and 1 s scrapes; returns
    (prometheus, a time at which the run was live)."""
    tmp = module_tmp("observed")
    metrics_port = free_port()
    prom = Prometheus(tmp, f"127.0.0.1:{metrics_port}", free_port())
    cfg = run_config(tmp, tiny_chat_model, steps=6)
    cfg = cfg.model_copy(update={
        "metrics": cfg.metrics.model_copy(update={"port": metrics_port, "linger_seconds": 4.0}),
        "eval": cfg.eval.model_copy(update={"every": 3}), "learner": cfg.learner.model_copy(update={"anchor": "decoupled"}),
        "rollout": cfg.rollout.model_copy(update={
            "reward": PythonRewardConfig(function="tests.reward_fixtures:correct_and_length"),
            "environment": EnvironmentConfig(path="tests.env_fixtures:Scripted", kwargs={"turns": 2, "reward": 0.0}, max_turns=3),
        }),
    })
    try:
        train(cfg)
        # the time of the last scrape that found the run's endpoint up (it stays up metrics.linger_seconds
        # after the run, then closes, and the backend's shutdown follows): a query at any later time
        # finds the run's series marked stale, so every panel's instant query would return nothing
        scrapes = prom.query("drpo_step[10m]", time.time())
        assert scrapes, "prometheus never scraped the run"
        live_at = float(scrapes[0]["values"][-1][0])
        # every series the dashboards use was scraped at least twice by then (rate() needs two)
        assert prom.query("count_over_time(drpo_step[5m])", live_at)[0]["value"][1] not in ("0", "1")
        yield prom, live_at
    finally:
        prom.close()


@pytest.mark.parametrize("dashboard, title, expr", dashboard_queries(), ids=lambda v: str(v)[:60])
def test_every_dashboard_panel_returns_data(scraped_run, dashboard, title, expr):
    prom, at = scraped_run
    result = prom.query(expr, at)
    assert result, f"{dashboard} / {title}: {expr} returned no data"


def test_the_reward_of_ones_own_is_exported_by_component_and_failure_reason(scraped_run):
    prom, at = scraped_run
    assert {r["metric"]["component"] for r in prom.query("max_over_time(drpo_reward_component[5m])", at)} == {"correct", "length"}
    assert {r["metric"]["reason"] for r in prom.query("max_over_time(drpo_reward_errors[5m])", at)} == {"error", "timeout", "invalid", "unreachable"}
    evaluated = {(r["metric"]["set"], r["metric"]["reason"]) for r in prom.query("max_over_time(drpo_eval_reward_errors[5m])", at)}
    assert {why for _, why in evaluated} == {"error", "timeout", "invalid", "unreachable"} and len({s for s, _ in evaluated}) >= 1


def test_the_gap_is_split_by_version_lag(scraped_run):
    prom, at = scraped_run
    lags = {r["metric"]["lag"] for r in prom.query("max_over_time(drpo_gap_abs_shift_mean[5m])", at)}
    assert lags == {"0", "0-inflight", "1+", "all"}


@pytest.mark.parametrize("rule", alert_rules(), ids=lambda r: r.get("alert") or r.get("record"))
def test_every_alert_and_recording_rule_evaluates_with_data(scraped_run, rule):
    prom, at = scraped_run
    expr = with_bool(rule["expr"]) if "alert" in rule else rule["expr"]
    assert prom.query(expr, at), f"{expr} returned no data"
    loaded = {r["name"]: r for g in prom.api("rules")["groups"] for r in g["rules"]}
    name = rule.get("alert") or rule.get("record")
    assert loaded[name]["health"] == "ok", loaded[name]


@pytest.fixture(scope="module")
def ray_head(module_tmp):
    """`ray start --head --block` on 127.0.0.1 with its job API on loopback and token
    authentication on (a fresh token in tmp_path); stopped by signalling its own process group,
    so no other Ray instance on the machine is touched (`ray stop` would kill them all)."""
    ray_bin = str(Path(sys.executable).parent / "ray")
    token = module_tmp("ray-head") / "ray-token"  # one head for this module's job tests
    token.write_text(secrets.token_hex(32))
    dash = free_port()
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}
    env.pop("RAY_ADDRESS", None)
    env.pop("RAY_AUTH_TOKEN", None)  # tests/conftest.py's token for local clusters: this head has its own
    short_tmp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # Ray's socket paths must stay under 108 bytes
    head = subprocess.Popen(
        [ray_bin, "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={free_port()}", "--num-cpus=2",
         "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}", "--disable-usage-stats",
         # every per-node agent on its own free port: another Ray instance on this machine (this
         # module's local cluster) already holds the defaults, and the job agent would not start
         f"--dashboard-agent-listen-port={free_port()}", f"--dashboard-agent-grpc-port={free_port()}",
         f"--metrics-export-port={free_port()}", f"--runtime-env-agent-port={free_port()}",
         f"--ray-client-server-port={free_port()}", f"--temp-dir={short_tmp}"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    try:
        deadline = time.time() + 180
        while subprocess.run([ray_bin, "job", "list", "--address", f"http://127.0.0.1:{dash}"], env=env, capture_output=True).returncode:
            if time.time() > deadline or head.poll() is not None:
                raise RuntimeError("the Ray head did not start")
            time.sleep(2)
        yield ray_bin, f"http://127.0.0.1:{dash}", env
    finally:
        for sig, wait in ((signal.SIGTERM, 90), (signal.SIGKILL, 30)):
            try:
                os.killpg(head.pid, sig)
                head.wait(timeout=wait)
                break
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue
        shutil.rmtree(short_tmp, ignore_errors=True)


def test_ray_job_submit_runs_training_and_its_metrics_are_scraped(ray_head, tiny_chat_model, tmp_path):
    ray_bin, job_api, env = ray_head
    metrics_port = free_port()
    prom = Prometheus(tmp_path, f"127.0.0.1:{metrics_port}", free_port())
    config = tmp_path / "job.yaml"
    cfg = run_config(tmp_path, tiny_chat_model, steps=4).model_dump(mode="json")
    cfg["metrics"].update(port=metrics_port, linger_seconds=4.0)
    config.write_text(yaml.safe_dump(cfg))
    try:
        job = subprocess.run(
            ["bash", "deploy/submit.sh", "--config", str(config)], cwd=REPO, capture_output=True, text=True, timeout=600,
            env={**env, "RAY_ADDRESS": job_api, "RUNTIME_ENV": "deploy/runtime_env.local.yaml", "PYTHON": sys.executable, "RAY": ray_bin},
        )
        assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
        assert "succeeded" in (job.stdout + job.stderr).lower()
        steps = prom.query("max_over_time(drpo_step[10m])", time.time())
        assert steps and float(steps[0]["value"][1]) == 4.0  # the job's last step was scraped
        assert (tmp_path / "run" / "checkpoints" / "step-000004" / "controller.json").is_file()
    finally:
        prom.close()


def test_the_own_task_guides_job_command_ships_the_reward_module_with_its_working_dir(ray_head, tiny_chat_model, tmp_path):
    """The own-task guide's `ray job submit --working-dir ...` line, run as written against a local
    head (its address and token from the environment, the tiny model, 2 steps): the reward module
    travels in the job's working_dir and scores in the rollout workers, which only the job's
    runtime env puts it in reach of."""
    import re

    ray_bin, job_api, env = ray_head
    guide = (REPO / "docs" / "guides" / "own-task.md").read_text()
    (line,) = re.findall(r"`(ray job submit --working-dir \S+ -- drpo train [^`]+)`", guide)
    words = line.split()
    words[0] = ray_bin
    words[words.index("drpo")] = str(Path(sys.executable).parent / "drpo")
    run_dir = tmp_path / "run"
    words = [f"run_dir={run_dir}" if w.startswith("run_dir=") else w for w in words]
    words += ["--set", f"model.path={tiny_chat_model}", "--set", "train.steps=2", "--set", "eval.at_start=false", "--set", "eval.every=0",
              "--set", "checkpoint.every=0", "--set", "metrics.port=null", "--set", "metrics.progress=false"]
    job = subprocess.run(words, cwd=REPO, capture_output=True, text=True, timeout=600, env={**env, "RAY_ADDRESS": job_api})
    assert job.returncode == 0 and "succeeded" in (job.stdout + job.stderr).lower(), job.stdout[-3000:] + job.stderr[-3000:]
    steps = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "step"]
    assert [s["step"] for s in steps] == [1, 2]
    for s in steps:  # examples/own_task/my_reward.py scored every sample: its components, none failed
        assert s["reward/errors/error"] == 0 and s["reward/reason/scored"] == 1.0 and "reward/component/format" in s
    assert not (REPO / "examples" / "own_task" / "runs").exists()  # the run folder is the one named, not the job's unpacked copy


def test_ray_job_stop_winds_the_run_down_with_a_checkpoint_and_the_resume_command(ray_head, tiny_chat_model, tmp_path):
    ray_bin, job_api, env = ray_head
    config = tmp_path / "job.yaml"
    cfg = run_config(tmp_path, tiny_chat_model, steps=500).model_dump(mode="json")
    cfg["checkpoint"]["every"], cfg["eval"]["every"] = 0, 0
    config.write_text(yaml.safe_dump(cfg))
    env = {**env, "RAY_ADDRESS": job_api, "RUNTIME_ENV": "deploy/runtime_env.local.yaml", "PYTHON": sys.executable, "RAY": ray_bin}
    submitted = subprocess.run(["bash", "deploy/submit.sh", "--config", str(config)], cwd=REPO, capture_output=True, text=True,
                               timeout=300, env={**env, "SUBMIT_FLAGS": "--no-wait"})
    assert submitted.returncode == 0, submitted.stdout[-3000:] + submitted.stderr[-3000:]
    job_id = next(w.strip("'") for w in (submitted.stdout + submitted.stderr).split() if w.strip("'").startswith("raysubmit_"))
    run_dir = tmp_path / "run"
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 300
    while not (metrics.is_file() and metrics.read_text().count('"kind": "step"') >= 2):
        assert time.time() < deadline, "the job never trained two steps"
        time.sleep(1)
    subprocess.run([ray_bin, "job", "stop", job_id, "--address", job_api], env=env, capture_output=True, text=True, timeout=300)
    logs = subprocess.run([ray_bin, "job", "logs", job_id, "--address", job_api], env=env, capture_output=True, text=True, timeout=60).stdout
    status = subprocess.run([ray_bin, "job", "status", job_id, "--address", job_api], env=env, capture_output=True, text=True, timeout=60).stdout
    assert "was stopped" in status
    (stop,) = [r for r in map(json.loads, metrics.read_text().splitlines()) if r["kind"] == "stop"]
    assert stop["signal"] == "SIGTERM" and not stop["abandoned"] and stop["resume_step"] == stop["step"] >= 2
    assert (run_dir / "checkpoints" / f"step-{stop['step']:06d}" / "controller.json").is_file()
    assert f"drpo train --resume {run_dir}" in logs
