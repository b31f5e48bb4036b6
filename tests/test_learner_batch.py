"""One rollout batch through the Learner on one gloo rank: metrics merged by kind across
mini-batches, the decoupled anchor computed by the learner itself, and pi on the engine's top-K ids."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import objectives
from learner import bridge
from learner import model as modeling
from learner.batch import TrainBatch
from learner.config import LearnerConfig, OptimizerConfig
from learner.learner import Learner
from learner.metrics import MetricAccumulator
from objectives.config import DPPOTopKTVConfig, DRPOConfig
from objectives.diagnostics import gap_metrics
from objectives.dppo import topk_tv

TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
FROZEN = OptimizerConfig(lr=1e-30, grad_clip=None)
"""An update that does not move the weights: what the step reports is checkable against the start."""


def _tiny(cfg: LearnerConfig) -> tuple[Learner, LlamaForCausalLM]:
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**TINY)).eval()
    arch = modeling.ModelArch.from_hf_config(hf.config.to_dict())
    return Learner(cfg, arch, bridge.hf_to_megatron(hf.state_dict(), arch)), hf


def _reference_logp(hf: LlamaForCausalLM, ids: torch.Tensor, at: torch.Tensor | None = None) -> torch.Tensor:
    """log pi of each token (or of the ids ``at`` [N, S, K]) from transformers, aligned with ids."""
    with torch.no_grad():
        logq = torch.log_softmax(hf(ids).logits.double(), -1)[:, :-1]
    picked = logq.gather(-1, ids[:, 1:, None]).squeeze(-1) if at is None else logq.gather(-1, at[:, 1:])
    return torch.cat([torch.zeros_like(picked[:, :1]), picked], dim=1).float()


def _batch(hf: LlamaForCausalLM, noise: float, seed: int = 1) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, TINY["vocab_size"], (6, 14), generator=g)
    mask = torch.zeros(6, 14, dtype=torch.bool)
    mask[:, 6:] = True
    mask[0, 10:] = False
    rollout = _reference_logp(hf, ids) + noise * torch.randn(6, 14, generator=g)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0])[:, None].expand(6, 14).contiguous()
    return TrainBatch(ids, mask, rollout.clamp(max=0.0), adv)


def test_two_mini_batches_merge_maxima_histograms_and_means_by_kind(megatron_single_rank):
    """A real update between the two mini-batches: gap/* is still pi at consumption against mu for
    both halves, the second half's objective sees the weights after the first update, and every
    metric is the merge of the two halves' by its kind."""
    cfg = LearnerConfig(objective=DRPOConfig(delta=0.05), optimizer=OptimizerConfig(lr=1e-2, grad_clip=None), micro_batch_size=2)
    learner, hf = _tiny(cfg)
    batch = _batch(hf, noise=0.5)
    halves = batch.split(2)
    got = learner.train(halves).values
    assert got["learner/updates"] == 2
    after_first, _ = _tiny(cfg)  # the same learner, stopped after the first update
    after_first.train([halves[0]])
    per_half = []
    for half, policy in ((halves[0], _reference_logp(hf, halves[0].input_ids)), (halves[1], after_first.compute_logprobs(halves[1].input_ids).logp)):
        acc = MetricAccumulator()
        acc.add("gap/", gap_metrics(_reference_logp(hf, half.input_ids), half.rollout_logp, half.response_mask, 0.05))
        acc.add("gap/proximal/", gap_metrics(policy, _reference_logp(hf, half.input_ids), half.response_mask, 0.05))
        inputs = objectives.ObjectiveInputs(policy, half.rollout_logp, half.advantages, half.response_mask)
        acc.add("objective/", objectives.compute(cfg.objective, inputs).metrics)
        per_half.append(acc.reduce())
    a, b = per_half
    assert b["gap/proximal/abs_shift_max"] > 1e-4 and a["gap/proximal/abs_shift_max"] < 1e-6  # the first update moved pi
    assert a["gap/abs_shift_max"] != pytest.approx(b["gap/abs_shift_max"], abs=1e-3)  # the test can tell max from mean
    for key in ("gap/abs_shift_max", "gap/ratio_max", "gap/proximal/abs_shift_max"):
        assert got[key] == pytest.approx(max(a[key], b[key]), rel=1e-4, abs=1e-6), key
    bins = [k for k in got if k.startswith("objective/weight_hist/bin_")]
    assert bins and all(got[k] == a[k] + b[k] for k in bins)
    assert sum(got[k] for k in bins) == int(batch.response_mask.sum())  # every token counted once
    na, nb = (int(h.response_mask.sum()) for h in halves)
    for key in ("gap/abs_shift_mean", "objective/weight_mean"):
        assert got[key] == pytest.approx((a[key] * na + b[key] * nb) / (na + nb), abs=1e-5), key


def test_without_the_consumption_pass_two_mini_batches_train_alike_and_gap_is_the_first_halfs(megatron_single_rank):
    """learner.consumption_pass false (bypass, two mini-batches): no log-prob pass before the
    updates; the updates are the same (the pass only measures), gap/* is pi at consumption against
    mu on the first half alone, gap/proximal/* is not reported, and gap/update_1 still is."""
    cfg = LearnerConfig(objective=DRPOConfig(delta=0.05), optimizer=OptimizerConfig(lr=1e-2, grad_clip=None), micro_batch_size=2)
    with_pass, hf = _tiny(cfg)
    without, _ = _tiny(cfg.model_copy(update={"consumption_pass": False}))
    batch = _batch(hf, noise=0.5)
    halves = batch.split(2)
    calls = []
    real = without.batch_logprobs
    without.batch_logprobs = lambda b: calls.append(b) or real(b)  # counts the passes
    got, ref = without.train(halves).values, with_pass.train(halves).values
    assert calls == []
    assert got["learner/updates"] == 2 and not any(k.startswith("gap/proximal/") for k in got) and "gap/proximal/abs_shift_max" in ref
    for key in ("objective/weight_mean", "gap/update_0/abs_shift_mean", "gap/update_1/abs_shift_mean", "learner/grad_norm_max", "learner/entropy_mean"):
        assert got[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-7), key  # the same two updates
    first = MetricAccumulator()
    first.add("gap/", gap_metrics(_reference_logp(hf, halves[0].input_ids), halves[0].rollout_logp, halves[0].response_mask, 0.05))
    first = first.reduce()
    for key in ("gap/abs_shift_mean", "gap/abs_shift_max"):
        assert got[key] == pytest.approx(first[key], abs=1e-5), key  # the first half's, not both halves'
    assert got["gap/abs_shift_mean"] != pytest.approx(ref["gap/abs_shift_mean"], abs=1e-4)  # which both halves' would differ from


@pytest.mark.parametrize("shape", ["decoupled, 2 mini-batches", "bypass, 2 epochs"])
def test_the_consumption_pass_off_still_runs_where_the_anchor_needs_it_and_skips_every_epochs_pass(megatron_single_rank, shape):
    """decoupled: its objective needs pi at consumption, so consumption_pass false changes nothing;
    bypass with 2 epochs: no pass at all (a second epoch would need one for every mini-batch)."""
    anchor, epochs, parts = ("decoupled", 1, 2) if shape.startswith("decoupled") else ("bypass", 2, 1)
    cfg = LearnerConfig(objective=DRPOConfig(delta=0.05), optimizer=OptimizerConfig(lr=1e-2, grad_clip=None), micro_batch_size=2, anchor=anchor)
    with_pass, hf = _tiny(cfg)
    without, _ = _tiny(cfg.model_copy(update={"consumption_pass": False}))
    batch = _batch(hf, noise=0.5)
    calls = []
    real = without.batch_logprobs
    without.batch_logprobs = lambda b: calls.append(b) or real(b)
    got, ref = without.train(batch.split(parts), epochs).values, with_pass.train(batch.split(parts), epochs).values
    assert got["learner/updates"] == ref["learner/updates"] == 2
    if anchor == "decoupled":
        assert len(calls) == 1 and set(got) == set(ref)  # the second mini-batch's pass, as with it on
        assert all(got[k] == pytest.approx(ref[k], rel=1e-5, abs=1e-7) for k in ref if not k.endswith("seconds")), "decoupled differs"
    else:
        assert calls == [] and not any(k.startswith("gap/proximal/") for k in got) and "gap/proximal/abs_shift_max" in ref
        assert got["gap/update_1/abs_shift_mean"] == pytest.approx(ref["gap/update_1/abs_shift_mean"], rel=1e-5)  # the same updates


def test_decoupled_anchor_is_computed_by_the_learner_and_gap_stays_pi_against_mu(megatron_single_rank):
    cap = 1.5
    cfg = LearnerConfig(objective=DRPOConfig(delta=0.02), optimizer=FROZEN, anchor="decoupled", behaviour_weight_cap=cap)
    learner, hf = _tiny(cfg)
    batch = _batch(hf, noise=0.4)
    got = learner.train([dataclasses.replace(batch, version=0)]).values
    policy, mask = _reference_logp(hf, batch.input_ids), batch.response_mask
    weight = (policy - batch.rollout_logp).exp().clamp(max=cap)
    assert got["learner/behaviour_weight_mean"] == pytest.approx(float(weight[mask].mean()), rel=1e-4)
    assert 0 < got["learner/behaviour_weight_capped_frac"] < 1
    shift = (policy.exp() - batch.rollout_logp.exp()).abs()[mask]
    assert got["gap/abs_shift_mean"] == pytest.approx(float(shift.mean()), abs=1e-5) and got["gap/abs_shift_mean"] > 1e-3
    assert got["gap/proximal/abs_shift_mean"] < 1e-7  # one update: pi is still pi_prox
    # the objective is anchored at pi_prox, not mu: DRPO's weight w is exactly 1 at pi = pi_prox
    assert got["objective/weight_mean"] == pytest.approx(1.0, abs=1e-5)
    bypass, _ = _tiny(cfg.model_copy(update={"anchor": "bypass"}))
    assert abs(bypass.train([batch]).values["objective/weight_mean"] - 1.0) > 0.01
    with pytest.raises(RuntimeError, match="consumed at version 0 reached the learner at version 1"):
        learner.train([dataclasses.replace(batch, version=0)])


def test_top_k_dppo_uses_pi_on_the_engine_ids(megatron_single_rank):
    cfg = LearnerConfig(objective=DPPOTopKTVConfig(delta=0.05, k=4), optimizer=FROZEN)
    learner, hf = _tiny(cfg)
    batch = _batch(hf, noise=0.0)
    g = torch.Generator().manual_seed(3)
    engine_ids = torch.randint(0, TINY["vocab_size"], (6, 14, 4), generator=g)  # not the learner's own top-K
    engine_logp = (_reference_logp(hf, batch.input_ids, engine_ids) + 0.7 * torch.randn(6, 14, 4, generator=g)).clamp(max=-0.05)
    batch = dataclasses.replace(batch, rollout_topk_ids=engine_ids, rollout_topk_logp=engine_logp)
    stats = learner.compute_logprobs(batch.input_ids, engine_ids)
    reference = _reference_logp(hf, batch.input_ids, engine_ids)
    torch.testing.assert_close(stats.ids_logp[:, 1:], reference[:, 1:], atol=1e-4, rtol=0)
    got = learner.train([batch]).values
    tv = topk_tv(engine_logp, reference)[batch.response_mask]
    assert got["objective/divergence_mean"] == pytest.approx(float(tv.mean()), abs=1e-4)
    assert 0 < got["objective/masked_frac"] < 1 and math.isfinite(got["learner/entropy_mean"])
    with pytest.raises(ValueError, match="dppo_topk_tv needs the engine's top-K log-probs: TrainBatch.rollout_topk_ids"):
        learner.train([dataclasses.replace(batch, rollout_topk_ids=None, rollout_topk_logp=None)])


def test_epochs_train_the_whole_batch_again_and_drpo_acts_from_the_second_update(megatron_single_rank):
    """Two passes over an on-policy batch (mu = the learner's own log-probs): the first update sees
    pi = mu (w = 1 everywhere, no regularizer), the second sees pi moved by the first, so DRPO's
    weights leave 1 and its quadratic term has a share of the loss; the version advances once."""
    cfg = LearnerConfig(objective=DRPOConfig(delta=0.05), optimizer=OptimizerConfig(lr=1e-2, grad_clip=None), micro_batch_size=2)
    learner, hf = _tiny(cfg)
    batch = _batch(hf, noise=0.0)
    one = _tiny(cfg)[0].train([batch]).values
    got = learner.train([batch], epochs=2).values
    assert got["learner/updates"] == 2 and learner.version == 1 and learner.step_count == 2
    assert one["learner/updates"] == 1 and "gap/update_1/abs_shift_mean" not in one
    assert got["gap/update_0/abs_shift_mean"] < 1e-5 < 1e-3 < got["gap/update_1/abs_shift_mean"]
    assert got["gap/abs_shift_mean"] < 1e-5  # gap/* is pi at consumption against mu: on-policy here
    assert got["gap/proximal/abs_shift_mean"] == pytest.approx(got["gap/update_1/abs_shift_mean"] / 2, rel=1e-3)  # mean of 0 and it
    assert one["objective/regularizer_share"] < 1e-9 and got["objective/regularizer_share"] > 1e-6
    assert one["objective/weight_abs_dev_mean"] < 1e-4 < got["objective/weight_abs_dev_mean"]
    # the first update moved pi the advantage's way: w = 1 - sign(A)(pi - mu)/delta falls below 1 on the second
    assert got["objective/weight_mean"] < 1 - 1e-3 and one["objective/weight_mean"] == pytest.approx(1.0, abs=1e-5)
    assert one["objective/weight_above_one_frac"] == 0 == one["objective/corrective_frac"]
