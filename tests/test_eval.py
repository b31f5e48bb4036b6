"""`drpo eval` is training's own evaluation: on the base model folder it reproduces a run's
start-of-run greedy accuracy, and on the run folder (its last checkpoint, exported) the end-of-run
one, with the same seed and settings (greedy decoding: no sampling noise)."""

from __future__ import annotations

import json

import pytest

from controller.app import train
from controller.cli import main
from tests.test_controller_e2e import run_config

pytestmark = [pytest.mark.ray, pytest.mark.engine, pytest.mark.slow]


def test_drpo_eval_reproduces_the_runs_start_and_end_accuracy(ray_local, smollm2_folder, tmp_path, capsys):
    cfg = run_config(tmp_path, smollm2_folder, steps=2, mode="sync", max_staleness=0)
    cfg = cfg.model_copy(update={
        "eval": cfg.eval.model_copy(update={"greedy": True, "every": 0}),
        "rollout": cfg.rollout.model_copy(update={"max_batch_prompts": 1, "max_new_tokens": 6, "samples_per_prompt": 2}),
        "learner": cfg.learner.model_copy(update={"optimizer": cfg.learner.optimizer.model_copy(update={"lr": 1e-4})}),
        "advantages": cfg.advantages.model_copy(update={"filter_zero_variance": False}),
    })
    result = train(cfg)
    start, end = result.eval_history[0], result.eval_history[-1]
    assert (start["version"], end["version"]) == (0, 2)

    assert main(["eval", str(smollm2_folder), "--config", str(result.run_dir / "config.yaml"), "--out", str(tmp_path / "base.json")]) == 0
    base = json.loads((tmp_path / "base.json").read_text())
    held_out = lambda record: {k: record["sets"]["heldout"][k] for k in ("greedy", "prompts", "samples")}  # noqa: E731
    assert held_out(base) == held_out(start) and base["samples"] == start["samples"]
    assert base["settings"]["greedy"] is True and "eval set heldout" in capsys.readouterr().out

    assert main(["eval", str(result.run_dir)]) == 0
    trained = json.loads((result.run_dir / "eval" / "step-000002-t1-n1-greedy.json").read_text())
    assert held_out(trained) == held_out(end)
    assert trained["model"].endswith("@step-000002")


def test_drpo_eval_names_what_it_cannot_evaluate(tmp_path, tiny_chat_model, capsys):
    assert main(["eval", str(tmp_path)]) == 2
    assert "is neither a drpo run folder (config.yaml, checkpoints/) nor a Hugging Face model folder" in capsys.readouterr().err
    assert main(["eval", str(tiny_chat_model), "--step", "3"]) == 2
    assert "--step picks a run folder's checkpoint" in capsys.readouterr().err
    no_tokenizer = tmp_path / "no-tokenizer"
    no_tokenizer.mkdir()
    for name in ("config.json", "model.safetensors"):
        (no_tokenizer / name).write_bytes((tiny_chat_model / name).read_bytes())
    assert main(["eval", str(no_tokenizer)]) == 2
    assert "has no tokenizer" in capsys.readouterr().err
