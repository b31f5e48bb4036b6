"""SIGINT (Ctrl-C: the whole foreground process group) and SIGTERM (`ray job stop`, an eviction: the
driver) on a real `drpo train` (tiny chat Llama, local Ray started by the driver): the run winds down
with a checkpoint, exits 130 / 143, prints the resume command, leaves none of its Ray processes behind
(checked by pid), and the resumed run continues the ledger exactly (`drpo train --resume` called in
this process, on the tests' shared Ray cluster: a second driver with a cluster of its own would only
repeat their start-up)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from controller.cli import main
from controller.run_folder import LOCK_FILE
from tests.test_controller_e2e import run_config
from tests.test_faults import REPO, exact, records, when

pytestmark = [pytest.mark.ray, pytest.mark.engine, pytest.mark.slow]


def descendants(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


def alive(processes: list[psutil.Process]) -> list[str]:
    """Those still running (the same process: pid and start time, not a reused pid)."""
    out = []
    for p in processes:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(f"{p.pid} {' '.join(p.cmdline())[:80]}")
        except psutil.NoSuchProcess:
            pass
    return out


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["sigint", "sigterm"])
def test_a_signal_stops_the_run_with_a_checkpoint_and_it_resumes_exactly(ray_local, tiny_chat_model, tmp_path, signum):
    cfg = run_config(tmp_path, tiny_chat_model, steps=200)
    cfg = cfg.model_copy(update={"checkpoint": cfg.checkpoint.model_copy(update={"every": 0}), "eval": cfg.eval.model_copy(update={"every": 0})})
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    drpo = [sys.executable, "-m", "controller.cli", "train"]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    driver = subprocess.Popen([*drpo, "--config", str(config)], cwd=REPO, env=env, start_new_session=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run_dir = Path(cfg.run_dir)
    when(lambda: len(records(run_dir, "step")) >= 3 or driver.poll() is not None)
    assert driver.poll() is None, "the run ended before the signal"
    ray_processes = descendants(driver.pid)
    assert any("raylet" in " ".join(p.cmdline()) for p in ray_processes)  # the local cluster this driver started
    if signum == signal.SIGINT:
        os.killpg(driver.pid, signum)  # what Ctrl-C in a terminal does
    else:
        os.kill(driver.pid, signum)
    began = time.monotonic()
    out, err = driver.communicate(timeout=180)
    assert driver.returncode == 128 + signum, err[-3000:]
    assert time.monotonic() - began < cfg.train.stop_grace_seconds + 60
    (stop,) = records(run_dir, "stop")
    name = signal.Signals(signum).name
    assert stop["signal"] == name and not stop["abandoned"] and stop["resume_step"] == stop["step"] >= 3
    assert f"stopped by {name} at step {stop['step']}" in err and f"drpo train --resume {run_dir}" in err
    assert "Traceback" not in err
    assert not (run_dir / LOCK_FILE).exists()  # the run folder is free for the resume
    exact(cfg, steps=stop["step"])
    deadline = time.monotonic() + 30
    while alive(ray_processes) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not alive(ray_processes), "Ray processes of the run outlived it"

    steps = stop["step"] + 2
    assert main(["train", "--resume", str(run_dir), "--set", f"train.steps={steps}"]) == 0
    exact(cfg, steps=steps)
    assert [r["step"] for r in records(run_dir, "step")] == list(range(1, steps + 1))  # nothing redone, nothing skipped
