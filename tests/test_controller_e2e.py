"""drpo training end to end on a real local Ray cluster: a tiny random-init Llama with SmolLM2's
tokenizer, real rollout worker, real megatron learner, async steps, checkpoints and resume."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from controller.app import train
from controller.config import RunConfig

pytestmark = [pytest.mark.ray, pytest.mark.engine]


@pytest.fixture(scope="module")
def tiny_chat_model(tmp_path_factory, smollm2_folder):
    """2 layers, hidden 32, SmolLM2's 49,152-token vocabulary and chat template. The output head is
    zero except for the digit and end-of-turn rows (random), so replies are short digit strings:
    some right, most wrong, which gives groups reward variance to learn from."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("tiny-chat-llama")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(smollm2_folder / name, folder / name)
    tok = AutoTokenizer.from_pretrained(folder)
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )
    model = LlamaForCausalLM(cfg)
    rows = tok.convert_tokens_to_ids(list("0123456789")) + [2]
    with torch.no_grad():
        head = torch.zeros_like(model.lm_head.weight)
        head[rows] = torch.randn(len(rows), cfg.hidden_size) * 0.3
        model.lm_head.weight.copy_(head)
    model.save_pretrained(folder)
    return folder


def run_config(tmp_path, model, **train) -> RunConfig:
    return RunConfig.model_validate({
        "run_dir": str(tmp_path / "run"), "model": {"path": str(model)},
        "task": {"type": "arithmetic", "train_size": 64, "test_size": 8},
        "rollout": {"workers": 1, "samples_per_prompt": 4, "max_new_tokens": 3, "max_batch_prompts": 4},
        "learner": {"optimizer": {"lr": 3e-3}, "micro_batch_size": 8, "objective": {"type": "drpo", "delta": 0.2}},
        "train": {"steps": 4, "prompts_per_step": 2, "mode": "async", "max_staleness": 1, **train},
        "eval": {"every": 2, "at_start": True}, "checkpoint": {"every": 2, "keep": 5},
        "metrics": {"port": 0, "progress": False},
    })


def records(run_dir, kind):
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["kind"] == kind]


def test_async_steps_advance_versions_and_log_the_gap_by_lag(ray_local, tiny_chat_model, tmp_path):
    cfg = run_config(tmp_path, tiny_chat_model)
    result = train(cfg)
    run_dir = tmp_path / "run"
    steps = records(run_dir, "step")
    assert [s["step"] for s in steps] == [1, 2, 3, 4] and [s["version"] for s in steps] == [1, 2, 3, 4]
    assert result.ledger_counts["trained"] == 4 * cfg.train.prompts_per_step
    assert all(s["staleness/lag_max"] <= 1 for s in steps)
    lagged = [s for s in steps if s["staleness/lag_mean"] > 0]
    assert lagged, "async mode never trained on a sample from older weights"
    # numerics (lag 0) and staleness (lag >= 1) are reported apart; stale tokens saw older weights
    assert all(math.isfinite(s["gap/numerics/abs_shift_mean"]) for s in steps if s["staleness/lag_hist/bin_0"] > 0)
    stale = [s["gap/staleness/abs_shift_mean"] for s in lagged]
    assert all(math.isfinite(v) for v in stale) and max(stale) > 0
    assert steps[0]["gap/abs_shift_mean"] < 1e-4  # same fp32 weights in engine and learner at version 0
    assert all(math.isfinite(s["objective/corrective_frac"]) and math.isfinite(s["learner/grad_norm"]) for s in steps)
    evals = records(run_dir, "eval")
    assert evals[0]["version"] == 0 and evals[-1]["version"] == 4 and all(e["samples"] == 8 for e in evals)
    assert (run_dir / "checkpoints" / "step-000004" / "learner-rank00000.pt").is_file()
    assert result.metrics_url.startswith("http://127.0.0.1:")


def test_resume_after_a_stop_continues_the_ledger(ray_local, tiny_chat_model, tmp_path):
    cfg = run_config(tmp_path, tiny_chat_model, steps=4)
    train(cfg)
    checkpoints = tmp_path / "run" / "checkpoints"
    shutil.rmtree(checkpoints / "step-000004")  # stopped after the step-2 checkpoint
    before = json.loads((checkpoints / "step-000002" / "controller.json").read_text())
    train(cfg.model_copy(update={"train": cfg.train.model_copy(update={"steps": 5})}), resume=True)
    after = json.loads((checkpoints / "step-000005" / "controller.json").read_text())
    assert after["step"] == 5 and after["version"] == 5
    assert after["ledger"][: len(before["ledger"])] == before["ledger"]
    keys = [(e["epoch"], e["id"]) for e in after["ledger"]]
    assert len(keys) == len(set(keys))
    assert sum(e["outcome"] == "trained" for e in after["ledger"]) == 5 * cfg.train.prompts_per_step
    resumed_steps = [s["step"] for s in records(tmp_path / "run", "step")][4:]
    assert resumed_steps == [3, 4, 5]  # the resumed session picked up at step 3
