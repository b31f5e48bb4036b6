"""drpo training end to end on a real local Ray cluster: a tiny random-init Llama with SmolLM2's
tokenizer, real rollout worker, real megatron learner, async steps, checkpoints and resume."""

from __future__ import annotations

import json
import math
import shutil

import pytest

from controller.app import train
from controller.config import RunConfig

pytestmark = [pytest.mark.ray, pytest.mark.engine]


def run_config(tmp_path, model, **train) -> RunConfig:
    return RunConfig.model_validate({
        "run_dir": str(tmp_path / "run"), "model": {"path": str(model)},
        "task": {"type": "arithmetic", "train_size": 64, "test_size": 8, "extra_eval_size": 0},
        "rollout": {"workers": 1, "samples_per_prompt": 4, "max_new_tokens": 3, "max_batch_prompts": 4},
        "learner": {"optimizer": {"lr": 3e-3}, "micro_batch_size": 8, "objective": {"type": "drpo", "delta": 0.2}},
        "train": {"steps": 4, "prompts_per_step": 2, "mode": "async", "max_staleness": 1, **train},
        "eval": {"every": 2, "at_start": True}, "checkpoint": {"every": 2, "keep": 5},
        "metrics": {"port": 0, "progress": False},
    })


def records(run_dir, kind):
    """The run's metrics records of ``kind``, read while it may be writing: a last line not yet
    ended (a record longer than one write) is left for the next read."""
    lines = (run_dir / "metrics.jsonl").read_text().split("\n")[:-1]
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


ASYNC_STEPS = 4


@pytest.fixture(scope="module")
def async_run(ray_local, tiny_chat_model, module_tmp):
    tmp_path = module_tmp("async")
    cfg = run_config(tmp_path, tiny_chat_model, steps=ASYNC_STEPS)
    # Over-long shaping gives this model's groups reward variance (a reply cut at 3 tokens against one
    # that ended). Without it nearly every group scores all 0 on the arithmetic task and
    # the zero-variance filter drops it; the few kept were the last admitted, under the newest
    # version, so async trained no lag-1 sample.
    ro = cfg.rollout
    cfg = cfg.model_copy(update={"rollout": ro.model_copy(update={"scoring": ro.scoring.model_copy(update={"overlong_penalty": 0.5})})})
    return cfg, train(cfg), tmp_path / "run"


def test_async_steps_advance_versions_and_log_the_gap_by_lag(async_run):
    cfg, result, run_dir = async_run
    steps = records(run_dir, "step")
    assert [s["step"] for s in steps] == list(range(1, ASYNC_STEPS + 1)) and [s["version"] for s in steps] == list(range(1, ASYNC_STEPS + 1))
    assert result.ledger_counts["trained"] == ASYNC_STEPS * cfg.train.prompts_per_step
    assert all(s["staleness/lag_max"] <= 1 for s in steps)
    lagged = [s for s in steps if s["staleness/lag_mean"] > 0]
    assert lagged and sum(s["staleness/lag_hist/bin_1"] for s in steps) >= 1  # async ran ahead: lag-1 samples were trained
    # numerics (lag 0) and staleness (lag >= 1) are reported apart; stale tokens saw older weights
    assert all(math.isfinite(s["gap/numerics/abs_shift_mean"]) for s in steps if s["staleness/lag_hist/bin_0"] > 0)
    stale = [s["gap/staleness/abs_shift_mean"] for s in lagged]
    assert all(math.isfinite(v) for v in stale) and max(stale) > 0
    assert steps[0]["gap/abs_shift_mean"] < 1e-4  # same fp32 weights in engine and learner at version 0
    assert all(math.isfinite(s["objective/corrective_frac"]) and math.isfinite(s["learner/grad_norm"]) for s in steps)
    evals = records(run_dir, "eval")
    assert evals[0]["version"] == 0 and evals[-1]["version"] == ASYNC_STEPS and all(e["samples"] == 8 for e in evals)
    assert (run_dir / "checkpoints" / f"step-{ASYNC_STEPS:06d}" / "learner-rank00000.pt").is_file()
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


def test_sync_mode_with_the_decoupled_anchor_trains_on_policy(ray_local, tiny_chat_model, tmp_path):
    cfg = run_config(tmp_path, tiny_chat_model, steps=3, mode="sync", max_staleness=0, mini_batches=2)
    cfg = cfg.model_copy(update={
        "eval": cfg.eval.model_copy(update={"at_start": False, "every": 0}), "learner": cfg.learner.model_copy(update={"anchor": "decoupled"}),
    })
    train(cfg)
    steps = records(tmp_path / "run", "step")
    assert [s["version"] for s in steps] == [1, 2, 3]  # two updates per batch, one version
    assert all(s["staleness/lag_max"] == 0 and s["learner/updates"] == 2 for s in steps)
    # on-policy with fp32 on both sides: the behaviour weight proximal/mu is 1 up to float error
    assert all(abs(s["learner/behaviour_weight_mean"] - 1.0) < 1e-3 for s in steps)
    assert all(s["staleness/lag_hist/bin_0"] == cfg.train.prompts_per_step for s in steps)


def test_report_from_a_real_run_folder_has_every_plot(async_run, tmp_path):
    from controller.cli import main
    from controller.report import PLOTS

    _, _, run_dir = async_run
    assert main(["report", str(run_dir), "--out", str(tmp_path / "report")]) == 0
    page = (tmp_path / "report" / "report.html").read_text()
    for name in PLOTS:
        assert f'alt="{name}" src="data:image/png;base64,' in page
        png = (tmp_path / "report" / f"{name}.png").read_bytes()
        assert png.startswith(b"\x89PNG") and len(png) > 5000
    assert (tmp_path / "report" / "report.png").read_bytes().startswith(b"\x89PNG")
    assert "eval accuracy, last" in page and "eval set heldout" in page and "no data in this run" not in page  # every plot had its metrics


def test_report_names_what_is_wrong_with_a_run_folder(tmp_path, capsys):
    from controller.cli import main

    assert main(["report", str(tmp_path)]) == 2
    assert "has no metrics.jsonl" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text('{"kind": "eval", "accuracy": 0.5}\n{not json\n')
    assert main(["report", str(tmp_path)]) == 2
    assert "no step records (1 unreadable lines)" in capsys.readouterr().err


@pytest.mark.parametrize("updates", [{"epochs": 2, "oversample": 2.0}, {"mini_batches": 2}], ids=["2 epochs, oversampled", "2 mini-batches"])
def test_two_updates_per_sync_batch_make_drpo_act_on_policy(ray_local, tiny_chat_model, tmp_path, updates):
    """train.epochs 2 (each update sees the whole batch) or train.mini_batches 2 (each sees half; the
    default preset): the second update of each batch sees pi moved by the first (fp32 on both sides,
    so the first sees pi = mu up to float error), and DRPO's regularizer acts; with train.oversample 2
    with the zero-variance filter on: each round asks for twice the missing groups, the batch takes
    B and the rest is ledgered as surplus. The summary says all of it."""
    cfg = run_config(tmp_path, tiny_chat_model, steps=3, mode="sync", max_staleness=0, **updates)
    ro = cfg.rollout
    cfg = cfg.model_copy(update={
        "eval": cfg.eval.model_copy(update={"every": 0}),
        # over-long shaping gives this model's groups reward variance, so the filter keeps some
        "rollout": ro.model_copy(update={"scoring": ro.scoring.model_copy(update={"overlong_penalty": 0.5})}),
        "advantages": cfg.advantages.model_copy(update={"filter_zero_variance": True}),
    })
    result = train(cfg)
    steps = records(tmp_path / "run", "step")
    assert [s["version"] for s in steps] == [1, 2, 3] and all(s["learner/updates"] == 2 and s["staleness/lag_max"] == 0 for s in steps)
    for s in steps:
        # update 0: float error only (6e-6 to 1e-4 on this model); update 1: what the first update moved
        assert s["gap/update_0/abs_shift_mean"] < 1e-3 and s["gap/update_1/abs_shift_mean"] > max(1e-4, 10 * s["gap/update_0/abs_shift_mean"]), s
        assert s["objective/regularizer_share"] > 0 and s["objective/weight_abs_dev_mean"] > 0
    assert result.ledger_counts["trained"] == 3 * cfg.train.prompts_per_step
    assert (result.ledger_counts.get("surplus", 0) > 0) == (cfg.train.oversample > 1)
    evals = records(tmp_path / "run", "eval")
    assert evals and all(e["seconds"] > 0 for e in evals)
    for row in ("updates per rollout batch", "|pi-mu| mean by update", "DRPO mean |w-1|, regularizer share", "evaluation seconds per round"):
        assert row in result.summary, result.summary


def test_sync_run_with_a_bf16_packed_learner_shares_prompts_and_waits_for_its_evaluations(ray_local, tiny_chat_model, tmp_path):
    """The default preset's learner shape through drpo train: bf16 mixed precision, each group's
    prompt packed once, evaluations that the run waits for (eval.concurrent=false)."""
    cfg = run_config(tmp_path, tiny_chat_model, steps=4, mode="sync", max_staleness=0)
    cfg = cfg.model_copy(update={
        "learner": cfg.learner.model_copy(update={"precision": "bf16", "packing": "shared_prompt", "micro_batch_tokens": 128}),
        "eval": cfg.eval.model_copy(update={"concurrent": False}),
    })
    result = train(cfg)
    run_dir = tmp_path / "run"
    steps = records(run_dir, "step")
    assert [s["version"] for s in steps] == [1, 2, 3, 4] and all(s["staleness/lag_max"] == 0 for s in steps)
    # a group's 4 samples share their chat prompt: far fewer forward slots than the 8 rows hold
    from transformers import AutoTokenizer

    from rollout.tasks import arithmetic_split

    tok = AutoTokenizer.from_pretrained(tiny_chat_model)
    ids = tok.apply_chat_template([{"role": "user", "content": arithmetic_split("train", 1)[0].prompt}], add_generation_prompt=True, tokenize=True)
    prompt = len(ids["input_ids"] if hasattr(ids, "keys") else ids)
    for s in steps:
        rows = s["learner/tokens"] + cfg.train.prompts_per_step * cfg.rollout.samples_per_prompt * prompt
        assert s["learner/forward_tokens"] < 0.5 * rows and 0 <= s["learner/padding_frac"] < 0.5, (s["learner/forward_tokens"], rows)
    assert all(math.isfinite(s["learner/grad_norm"]) and s["learner/grad_norm"] > 0 for s in steps)
    # the evaluation after step 2 finished before step 3 began, and evaluated version 2
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    order = [(r["kind"], r.get("step")) for r in lines if r["kind"] in ("step", "eval")]
    assert order.index(("eval", 2)) < order.index(("step", 3))
    assert [e["version"] for e in records(run_dir, "eval")] == [0, 2, 4]
    (startup,) = records(run_dir, "startup")
    assert startup["backend_seconds"] > 0 and startup["first_eval_seconds"] > 0
    assert startup["total_seconds"] >= startup["backend_seconds"] + startup["first_eval_seconds"]
    assert result.eval_history[-1]["version"] == 4
