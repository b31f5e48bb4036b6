"""Every registered objective, in every mode and anchor, trains through `drpo train` (the config
path of ``drpo train --set``, then ``controller.app.train``) on a real local Ray cluster with the
tiny chat model; and in a decoupled async run, gap/* is pi against mu, checked independently."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch

import objectives
from controller.app import train
from controller.config import load_config
from controller.ray_backend import RayBackend

pytestmark = [pytest.mark.ray, pytest.mark.engine, pytest.mark.slow]

SHAPES = [("async", "bypass"), ("sync", "decoupled"), ("async", "decoupled"), ("sync", "bypass")]
CASES = [(name, *shape) for name, shape in zip(objectives.available(), itertools.cycle(SHAPES))]


def overrides(tmp_path, model, mode: str, anchor: str, objective: dict, steps: int = 2) -> list[str]:
    eta = 1 if mode == "async" else 0
    return [
        f"run_dir={tmp_path / 'run'}", f"model.path={model}", "task.train_size=64", "task.test_size=4",
        "rollout.workers=1", "rollout.samples_per_prompt=4", "rollout.max_new_tokens=3", "rollout.max_batch_prompts=4",
        "rollout.precision=fp32", "learner.precision=fp32", "learner.optimizer.lr=3e-3", f"learner.anchor={anchor}",
        f"learner.objective={json.dumps(objective)}", "advantages.filter_zero_variance=false",
        # one update per batch (the default preset trains two): in sync mode pi = mu up to float error,
        # and the gap between pi now and pi at consumption is the anchor's alone
        f"train.steps={steps}", "train.prompts_per_step=2", "train.mini_batches=1", f"train.mode={mode}", f"train.max_staleness={eta}",
        "eval.at_start=false", "eval.every=0", "checkpoint.every=0", "metrics.port=null", "metrics.progress=false",
        "learner_resources.threads=1",
    ]


def step_records(run_dir) -> list[dict]:
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "step"]


def test_every_objective_is_covered_in_every_mode_and_anchor():
    assert {name for name, *_ in CASES} == set(objectives.available())
    assert {(mode, anchor) for _, mode, anchor in CASES} == set(SHAPES)


@pytest.mark.parametrize(("name", "mode", "anchor"), CASES)
def test_objective_trains_two_steps_through_drpo_train(ray_local, tiny_chat_model, tmp_path, name, mode, anchor):
    cfg = load_config(None, overrides(tmp_path, tiny_chat_model, mode, anchor, {"type": name}))
    result = train(cfg)
    steps = step_records(tmp_path / "run")
    assert [s["step"] for s in steps] == [1, 2] and [s["version"] for s in steps] == [1, 2]
    assert result.ledger_counts["trained"] == 2 * cfg.train.prompts_per_step
    for s in steps:
        assert math.isfinite(s["learner/loss"]) and math.isfinite(s["learner/grad_norm"]), s
        assert math.isfinite(s["gap/abs_shift_mean"]) and s["learner/tokens"] > 0
        assert s["staleness/lag_max"] <= cfg.train.max_staleness
        if anchor == "decoupled":
            assert math.isfinite(s["learner/behaviour_weight_mean"]) and "gap/proximal/abs_shift_mean" in s
        else:
            assert not any(k.startswith("gap/proximal/") for k in s)
    if objectives.required_topk(cfg.learner.objective):
        # the engine's top-K reached the learner: the divergence is measured on every response token;
        # sync is on-policy with fp32 on both sides, where it is float error only (either sign), and a
        # top-K that did not line up with the learner's (other ids, zero rows) would be far from 0
        divergence = [s["objective/divergence_mean"] for s in steps]
        assert all(math.isfinite(d) for d in divergence)
        assert all(abs(d) < 1e-4 for d in divergence) if mode == "sync" else all(d > 0 for d in divergence)


class RecordingBackend(RayBackend):
    """The real backend, keeping each batch and the learner's weights at the moment it was handed over."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.seen = []

    def train(self, batch):
        import ray

        self.seen.append((batch, ray.get(self.learner.workers[0].hf_state.remote())))
        super().train(batch)


def test_decoupled_async_gap_is_pi_against_mu_and_the_proximal_gap_has_its_own_names(ray_local, tiny_chat_model, tmp_path):
    from transformers import AutoModelForCausalLM

    # only groups with reward variance train (nonzero advantages), so every step moves the weights
    settings = [*overrides(tmp_path, tiny_chat_model, "async", "decoupled", {"type": "drpo", "delta": 0.2}, steps=8), "advantages.filter_zero_variance=true",
                "rollout.scoring.overlong_penalty=0.5"]  # reward variance from lengths too: fewer groups filtered, however lucky the answers
    cfg = load_config(None, settings)
    backend = RecordingBackend(cfg)
    train(cfg, backend=backend)
    steps = step_records(tmp_path / "run")
    assert len(backend.seen) == len(steps) == 8  # eight chances for a lag-1 batch: a fast learner can keep the rollout on its version
    model = AutoModelForCausalLM.from_pretrained(tiny_chat_model, torch_dtype=torch.float32, attn_implementation="eager").eval()
    stale_gaps, proximal_gaps = [], []
    for (batch, weights), record in zip(backend.seen, steps):
        model.load_state_dict(weights)
        with torch.no_grad():
            logq = torch.log_softmax(model(batch.input_ids).logits.double() / cfg.learner.temperature, -1)
        pi = torch.cat([torch.zeros(len(batch.input_ids), 1, dtype=torch.float64), logq[:, :-1].gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)], 1)
        mask = batch.response_mask
        shift = (pi.exp() - batch.rollout_logp.double().exp()).abs()[mask]
        assert record["gap/abs_shift_mean"] == pytest.approx(float(shift.mean()), abs=1e-5)
        assert record["gap/abs_shift_max"] == pytest.approx(float(shift.max()), abs=1e-5)
        assert record["gap/proximal/abs_shift_mean"] < 1e-5  # one update per batch: pi is still pi_prox
        proximal_gaps.append(record["gap/proximal/abs_shift_mean"])
        stale = (batch.version_lag >= 1) & mask
        if stale.any():
            stale_gaps.append(float((pi.exp() - batch.rollout_logp.double().exp()).abs()[stale].mean()))
            assert record["gap/staleness/abs_shift_mean"] == pytest.approx(stale_gaps[-1], abs=1e-5)
    # samples from older weights were trained on, and their gap is real, far from the ~0 of pi vs pi_prox
    assert stale_gaps and max(stale_gaps) > 1e-5 and max(stale_gaps) > 100 * max(proximal_gaps)
