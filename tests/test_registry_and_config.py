"""The registry entry points and objective configs."""

from __future__ import annotations

import typing

import pytest
import torch
from pydantic import TypeAdapter, ValidationError

import objectives
from objectives.config import ObjectiveConfig

REQUIRED = {
    "ppo_clip", "cispo", "gspo", "spo", "dppo_binary_tv", "dppo_binary_kl", "dppo_topk_tv", "dppo_topk_kl",
    "drpo", "mask_drpo", "drpo_no_abs_adv", "tv_penalty", "kl_penalty",
}


def test_available_lists_every_required_objective():
    names = objectives.available()
    assert REQUIRED <= set(names) and names == sorted(names)


def test_every_registered_objective_is_in_the_config_union():
    union_types = {cls.model_fields["type"].default for cls in typing.get_args(typing.get_args(ObjectiveConfig)[0])}
    assert union_types == set(objectives.available())
    adapter = TypeAdapter(ObjectiveConfig)
    assert adapter.validate_python({"type": "drpo", "delta": 0.2}).delta == 0.2


def test_unknown_objective_and_bad_params_name_the_problem():
    x = torch.zeros(1, 2, requires_grad=True)
    with pytest.raises(ValueError, match="unknown objective 'drpoo'"):
        objectives.token_loss("drpoo", x, x.detach(), x.detach())
    with pytest.raises(ValueError, match="eps_hi"):
        objectives.token_loss("ppo_clip", x, x.detach(), x.detach(), eps_hi=0.3)
    with pytest.raises(ValueError, match="delta"):
        objectives.token_loss("drpo", x, x.detach(), x.detach(), delta=-1.0)
    with pytest.raises(ValidationError, match="delta"):
        TypeAdapter(ObjectiveConfig).validate_python({"type": "dppo_binary_tv", "delta": 2.0})


def test_configs_are_frozen_and_forbid_extra_fields():
    cfg = objectives.make_config("drpo")
    with pytest.raises(ValidationError):
        cfg.delta = 1.0  # type: ignore[misc]
    with pytest.raises(ValidationError, match="extra"):
        TypeAdapter(ObjectiveConfig).validate_python({"type": "spo", "eps": 0.2, "delta": 1.0})


def test_mismatched_shapes_are_rejected_with_names():
    lp = torch.zeros(2, 3, requires_grad=True)
    with pytest.raises(ValueError, match="advantages has shape"):
        objectives.token_loss("drpo", lp, torch.zeros(2, 3), torch.zeros(3, 2))
    with pytest.raises(ValueError, match="mask has shape"):
        objectives.token_loss("drpo", lp, torch.zeros(2, 3), torch.zeros(2, 3), mask=torch.ones(2, 2, dtype=torch.bool))


def test_compute_returns_metrics_with_reductions():
    lp = torch.log(torch.full((2, 3), 0.4)).requires_grad_()
    out = objectives.compute(
        objectives.make_config("ppo_clip"), objectives.ObjectiveInputs(lp, torch.log(torch.full((2, 3), 0.5)), torch.ones(2, 3))
    )
    assert set(out.metrics) == {"clip_frac_low", "clip_frac_high", "dual_clip_frac"}
    assert all(m.reduction == "mean" for m in out.metrics.values())


def test_demo_table_shows_drpo_weight_reverse_past_boundary():
    from objectives.demo import gradient_weights

    assert gradient_weights("drpo", 0.5, 0.75, 1.0, delta=0.15) == pytest.approx(1 - 0.25 / 0.15)
    assert gradient_weights("ppo_clip", 0.5, 0.75, 1.0) == 0.0
    assert gradient_weights("spo", 0.5, 0.75, 1.0) == pytest.approx(1 - 0.5 / 0.2)
