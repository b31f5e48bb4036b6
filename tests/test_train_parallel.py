"""`drpo train` with a learner group of several ranks (real Ray, real megatron-core over gloo, the
tiny chat Llama, fp32): data parallel 2 and tensor parallel 2 train the same batches as one rank —
each run's sampling is seeded from the run's seed per engine call, so the runs draw the same
completions while their weights agree — and their losses and gradient norms match one rank's.
A layout that cannot split the model is refused at start, naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from controller.app import train
from controller.config import ConfigError
from tests.test_controller_e2e import records, run_config

pytestmark = [pytest.mark.ray, pytest.mark.engine, pytest.mark.slow]

STEPS = 3
LAYOUTS = {"one rank": {}, "data 2": {"data": 2}, "tensor 2": {"tensor": 2}}


def layout_config(tmp_path, model, name: str, parallel: dict):
    cfg = run_config(tmp_path / name.replace(" ", "-"), model, steps=STEPS, mode="sync", max_staleness=0)
    return cfg.model_copy(update={
        "rollout": cfg.rollout.model_copy(update={"cpus_per_worker": 0.5}),
        "learner": cfg.learner.model_copy(update={"parallel": cfg.learner.parallel.model_copy(update=parallel), "precision": "fp32"}),
        "learner_resources": cfg.learner_resources.model_copy(update={"cpus_per_worker": 0.5}),
        "advantages": cfg.advantages.model_copy(update={"filter_zero_variance": False}),  # the same groups train in every run
        "eval": cfg.eval.model_copy(update={"every": 0, "at_start": False}),
        "checkpoint": cfg.checkpoint.model_copy(update={"every": 0, "hf": False}),
    })


@pytest.fixture(scope="module")
def layout_runs(ray_local, tiny_chat_model, module_tmp):
    tmp = module_tmp("layouts")
    steps = {}
    for name, parallel in LAYOUTS.items():
        cfg = layout_config(tmp, tiny_chat_model, name, parallel)
        train(cfg)
        steps[name] = records(tmp / name.replace(" ", "-") / "run", "step")
    return steps


@pytest.mark.parametrize("layout", ["data 2", "tensor 2"])
def test_several_learner_ranks_train_like_one(layout_runs, layout):
    one, many = layout_runs["one rank"], layout_runs[layout]
    assert len(one) == len(many) == STEPS
    for a, b in zip(one, many):
        # the same batch: same trained tokens and rewards (the completions were drawn alike)
        assert a["learner/tokens"] == b["learner/tokens"] and a["reward/mean"] == b["reward/mean"], a["step"]
        assert b["learner/loss"] == pytest.approx(a["learner/loss"], rel=1e-4, abs=1e-6), a["step"]
        assert b["learner/grad_norm"] == pytest.approx(a["learner/grad_norm"], rel=1e-4), a["step"]
    assert any(s["learner/grad_norm"] > 0 for s in many)  # it trained


def test_a_layout_that_cannot_split_the_model_is_refused_by_field(ray_local, tiny_chat_model, tmp_path):
    cfg = layout_config(tmp_path, tiny_chat_model, "tensor 3", {"tensor": 3})  # 4 heads, 2 kv heads
    with pytest.raises(ConfigError, match=r"learner\.parallel\.tensor=3 must divide the model's attention heads \(4\)"):
        train(cfg)
    cfg = layout_config(tmp_path, tiny_chat_model, "expert 2", {"expert": 2})
    with pytest.raises(ConfigError, match=r"learner\.parallel\.expert=2 needs an MoE model"):
        train(cfg)


def test_a_crash_mid_checkpoint_keeps_the_previous_one_and_data_parallel_resume_continues_the_run(ray_local, tiny_chat_model, tmp_path, monkeypatch):
    """Data parallel 2, checkpoints every 2 steps: the last rank's file of the step-4 checkpoint is
    cut short and the run dies there. The step-2 checkpoint is intact, and resuming from it trains
    steps 3 and 4 exactly as the first run did (every rank's weights and Adam moments came back:
    step 4's loss depends on step 3's update, which depends on the restored moments)."""
    from controller.ray_backend import RayBackend

    cfg = layout_config(tmp_path, tiny_chat_model, "data 2 resume", {"data": 2})
    cfg = cfg.model_copy(update={
        "train": cfg.train.model_copy(update={"steps": 4}), "checkpoint": cfg.checkpoint.model_copy(update={"every": 2, "keep": 5}),
    })
    real_save, saves = RayBackend.save, []

    def crash_in_second_save(self, folder):
        real_save(self, folder)
        saves.append(folder)
        if len(saves) == 2:  # the process dies while the last rank's file is half written
            rank_file = Path(folder) / "learner-rank00001.pt"
            rank_file.write_bytes(rank_file.read_bytes()[:1000])
            raise RuntimeError("crash while writing the checkpoint")

    monkeypatch.setattr(RayBackend, "save", crash_in_second_save)
    with pytest.raises(RuntimeError, match="crash while writing"):
        train(cfg)
    checkpoints = Path(cfg.run_dir) / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir() if not p.name.startswith(".")) == ["step-000002"]
    first = {r["step"]: r for r in records(Path(cfg.run_dir), "step")}
    assert sorted(first) == [1, 2, 3, 4]

    monkeypatch.setattr(RayBackend, "save", real_save)
    train(cfg, resume=True)
    resumed = records(Path(cfg.run_dir), "step")[4:]
    assert [r["step"] for r in resumed] == [3, 4]
    for r in resumed:
        a = first[r["step"]]
        assert r["learner/tokens"] == a["learner/tokens"] and r["reward/mean"] == a["reward/mean"], r["step"]
        assert r["learner/loss"] == pytest.approx(a["learner/loss"], rel=1e-6, abs=1e-9), r["step"]
        assert r["learner/grad_norm"] == pytest.approx(a["learner/grad_norm"], rel=1e-6), r["step"]
    assert not (checkpoints / ".tmp-step-000004").exists()  # the half-written attempt was cleared, not renamed into place
    assert (checkpoints / "step-000004" / "controller.json").is_file()
