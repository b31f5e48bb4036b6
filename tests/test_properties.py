"""Property tests: shapes, finiteness, masking and DRPO's weight bounds for arbitrary inputs."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import objectives
from objectives import aggregate

probs = st.floats(min_value=1e-8, max_value=1.0 - 1e-6)
advs = st.floats(min_value=-10.0, max_value=10.0)
NAMES = [n for n in objectives.available() if not n.startswith("dppo_topk")]


@st.composite
def batches(draw):
    b = draw(st.integers(1, 4))
    t = draw(st.integers(1, 6))
    n = b * t
    pi = torch.tensor(draw(st.lists(probs, min_size=n, max_size=n)), dtype=torch.float64).reshape(b, t)
    mu = torch.tensor(draw(st.lists(probs, min_size=n, max_size=n)), dtype=torch.float64).reshape(b, t)
    a = torch.tensor(draw(st.lists(advs, min_size=n, max_size=n)), dtype=torch.float64).reshape(b, t)
    mask = torch.tensor(draw(st.lists(st.booleans(), min_size=n, max_size=n))).reshape(b, t)
    return pi, mu, a, mask


@settings(max_examples=60, deadline=None)
@given(batches(), st.sampled_from(NAMES))
def test_every_objective_keeps_shape_is_finite_and_zero_where_masked(batch, name):
    pi, mu, a, mask = batch
    lp = pi.log().requires_grad_()
    loss = objectives.token_loss(name, lp, mu.log(), a, mask=mask)
    (grad,) = torch.autograd.grad(loss.sum(), lp)
    assert loss.shape == lp.shape
    assert torch.isfinite(loss).all() and torch.isfinite(grad).all()
    assert (loss[~mask] == 0).all() and (grad[~mask] == 0).all()


@settings(max_examples=200, deadline=None)
@given(probs, probs, advs.filter(lambda x: abs(x) > 1e-6), st.floats(min_value=0.05, max_value=20.0))
def test_drpo_weight_always_within_bounds(pi, mu, a, delta):
    lp = torch.tensor([[math.log(pi)]], dtype=torch.float64, requires_grad=True)
    loss = objectives.token_loss("drpo", lp, torch.tensor([[math.log(mu)]], dtype=torch.float64), torch.tensor([[a]], dtype=torch.float64), delta=delta)
    (g,) = torch.autograd.grad(loss.sum(), lp)
    w = -g.item() / (a * pi / mu)
    assert 1 - 1 / delta - 1e-6 <= w <= 1 + 1 / delta + 1e-6
    # the sign of w - 1 says whether the update diverges from mu
    if abs(pi - mu) > 1e-9:
        assert (w < 1) == (a * (pi - mu) > 0)


@settings(max_examples=60, deadline=None)
@given(batches(), st.sampled_from(["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]))
def test_aggregate_of_constant_loss(batch, mode):
    _, _, _, mask = batch
    loss = torch.full(mask.shape, 2.0, dtype=torch.float64)
    out = aggregate(loss, mask, mode)
    if not mask.any():
        assert out.item() == 0.0
    elif mode == "seq-mean-token-sum":
        rows = mask.sum(-1)
        assert out.item() == 2.0 * rows[rows > 0].double().mean().item()
    else:
        assert abs(out.item() - 2.0) < 1e-12
