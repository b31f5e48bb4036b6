"""Worker processes kept across the runs of one driver (learner/actor_pool.py), through `drpo train`
(controller.app.train on the tests' Ray cluster, whose ray_local fixture holds ``actor_pool.reuse()``
for the module): a second run asking for the same placement takes the first run's processes and
builds its own workers in them (its own config: here its group size); a worker Ray restarts inside a
kept process comes back with the arguments of the run it serves, and that process is not kept
afterwards; a drain leaves nothing on the cluster; a host with a call of its run still running is
not kept."""

from __future__ import annotations

import json
import signal
import threading
from collections import defaultdict

import pytest
import ray
from ray.exceptions import RayActorError

from controller.app import train
from controller.ray_backend import RayBackend
from controller.stop import StopRequest
from learner import actor_pool
from tests.conftest import _cluster_is_clean
from tests.test_controller_e2e import run_config
from tests.test_faults import records, when

pytestmark = [pytest.mark.ray, pytest.mark.engine, pytest.mark.slow]


def config(tmp_path, model, name: str, samples: int, steps: int = 2):
    cfg = run_config(tmp_path / name, model, steps=steps)
    return cfg.model_copy(update={
        "rollout": cfg.rollout.model_copy(update={"samples_per_prompt": samples}),
        "advantages": cfg.advantages.model_copy(update={"filter_zero_variance": False}),  # every group trains
        "eval": cfg.eval.model_copy(update={"every": 0, "at_start": False}),
        "metrics": cfg.metrics.model_copy(update={"rollouts": True}),
    })


def pids(backend) -> list[int]:
    """The process ids of the run's rollout workers, then its learner ranks."""
    return ray.get([a.pid.remote() for a in [*backend.actors, *backend.learner.workers]], timeout=60)


def group_sizes(run_dir) -> set[int]:
    """The number of samples of every trained group (rollouts.jsonl: one line per sample)."""
    samples = defaultdict(set)
    for row in map(json.loads, (run_dir / "rollouts.jsonl").read_text().splitlines()):
        samples[(row["step"], row["prompt_id"], row["epoch"])].add(row["sample"])
    return {len(s) for s in samples.values()}


def test_a_second_run_builds_its_own_workers_in_the_first_runs_processes(ray_local, tiny_chat_model, tmp_path):
    first_cfg = config(tmp_path, tiny_chat_model, "first", samples=4)
    first = RayBackend.build(first_cfg)
    first_pids = pids(first)
    train(first_cfg, backend=first)
    second_cfg = config(tmp_path, tiny_chat_model, "second", samples=2)
    second = RayBackend.build(second_cfg)
    assert pids(second) == first_pids  # the same processes, rollout workers and learner rank
    result = train(second_cfg, backend=second)
    assert result.steps == 2 and [s["step"] for s in records(tmp_path / "second" / "run", "step")] == [1, 2]
    assert group_sizes(tmp_path / "first" / "run") == {4}
    assert group_sizes(tmp_path / "second" / "run") == {2}  # the kept process built the second run's worker


def test_a_restarted_worker_serves_the_current_run_and_its_process_is_not_kept(ray_local, tiny_chat_model, tmp_path):
    warm_cfg = config(tmp_path, tiny_chat_model, "warm", samples=4)
    warm = RayBackend.build(warm_cfg)
    train(warm_cfg, backend=warm)
    cfg = config(tmp_path, tiny_chat_model, "restarted", samples=2, steps=1000)
    backend = RayBackend.build(cfg)
    rollout_pid, learner_pid = pids(backend)
    run_dir = tmp_path / "restarted" / "run"
    stop = StopRequest()

    def kill_then_stop():
        try:
            when(lambda: len(records(run_dir, "step")) >= 2)
            ray_local.kill(backend.actors[0], no_restart=False)  # Ray restarts it in a new process
            when(lambda: [e["event"] for e in records(run_dir, "worker")] == ["lost", "back"], timeout=120)
            back_at = len(records(run_dir, "step"))
            when(lambda: len(records(run_dir, "step")) >= back_at + 2)
        finally:
            stop.request(signal.SIGTERM)

    killer = threading.Thread(target=kill_then_stop, daemon=True)
    killer.start()
    result = train(cfg, backend=backend, stop=stop)
    killer.join(timeout=5)
    assert result.stopped_by == "SIGTERM" and [e["event"] for e in records(run_dir, "worker")] == ["lost", "back"]
    assert group_sizes(run_dir) == {2}  # before and after the restart: the restarted worker was built with this run's config
    with pytest.raises(RayActorError):  # the restarted process was stopped at the end of the run, not kept
        ray.get(backend.actors[0].pid.remote(), timeout=60)
    assert ray.get(backend.learner.workers[0].pid.remote(), timeout=60) == learner_pid  # the learner rank's was kept
    assert rollout_pid != learner_pid
    actor_pool.drain()
    assert _cluster_is_clean(ray_local)  # nothing kept stays on the cluster


def test_a_host_with_a_call_of_its_run_still_running_is_stopped_and_a_kept_one_builds_the_next_runs_object(ray_local):
    import time

    class Napper:  # the pool's own logic: a stand-in role (defined here, so Ray ships it by value)
        def __init__(self, tag: str):
            self.tag = tag

        def nap(self, seconds: float) -> str:
            time.sleep(seconds)
            return self.tag

    def place(tag: str):
        return actor_pool.place(Napper, [{"CPU": 0.01}], "PACK", "a napper", {"num_cpus": 0.01, "max_concurrency": 2}, [((tag,), {})])

    first = place("first")
    assert ray.get(first.actors[0].nap.remote(0), timeout=60) == "first"
    pid = ray.get(first.actors[0].pid.remote(), timeout=60)
    actor_pool.release(first, clean=True)
    second = place("second")
    assert ray.get(second.actors[0].pid.remote(), timeout=60) == pid  # kept, and built with the second run's arguments
    assert ray.get(second.actors[0].nap.remote(0), timeout=60) == "second"
    hung = second.actors[0].nap.remote(120)  # a call of the run that still runs when the run ends
    time.sleep(3)  # it has started (a threaded actor may start calls out of order)
    actor_pool.release(second, clean=True)
    assert second not in actor_pool.kept()
    with pytest.raises(RayActorError):  # stopped, not kept
        ray.get(hung, timeout=60)
    third = place("third")
    assert ray.get(third.actors[0].pid.remote(), timeout=60) != pid
    actor_pool.release(third, clean=False)  # a run that did not end cleanly: stopped
    assert not actor_pool.kept() and _cluster_is_clean(ray_local)
