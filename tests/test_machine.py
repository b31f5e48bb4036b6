"""What a local cluster on this machine cannot host is refused by field when the config loads,
before the data, the model or Ray are touched (controller/app.py check_machine)."""

from __future__ import annotations

import importlib.util
import os
import subprocess

import pytest

from controller.app import check_machine
from controller.config import PRESETS, ConfigError, load_config
from tests.clusters import leave_local_ray
from tests.test_readme_commands import DRPO


def test_the_cluster_preset_as_shipped_is_refused_here_by_its_gpu_fields_before_anything_runs(tmp_path):
    """`drpo train --config controller/presets/cluster-gpu.yaml` on a machine without GPUs (CUDA
    hidden, so a GPU machine checks the same): exit 2 in seconds, both GPU fields named, nothing
    written, although its data and model (on shared storage) do not exist here either."""
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([DRPO, "train", "--config", str(PRESETS / "cluster-gpu.yaml"), "--set", f"run_dir={run_dir}"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("drpo train: ") and "rollout.gpus_per_worker asks for 8 in all, learner_resources.gpus_per_worker asks for 8 in all, " \
        "and this machine, where drpo starts a local Ray cluster, has 0 GPU(s)" in last, last
    assert "dapo-math-17k" not in done.stderr and "run folder" not in done.stderr and not run_dir.exists()


def test_an_engine_whose_package_is_missing_is_refused_unless_a_cluster_is_joined(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    leave_local_ray()  # this process joined to the cluster an earlier module kept would count as joined
    cfg = load_config(PRESETS / "default.yaml", ["rollout.engine=sglang", "rollout.gpus_per_worker=0"])
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sglang" else real(name, *a))
    with pytest.raises(ConfigError, match=r"^rollout.engine=sglang needs the sglang package, which is not installed here"):
        check_machine(cfg)
    check_machine(cfg.model_copy(update={"ray_address": "127.0.0.1:6379"}))  # a joined cluster's nodes host the workers
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")
    check_machine(cfg)
