"""Every objective's value and gradient against a hand-written formula."""

from __future__ import annotations

import math

import pytest
import torch

import objectives
from objectives.base import LOG_RATIO_CLAMP


def _ratio(lp, rl):
    """r and the factor d(clamped log r)/d(log pi): 0 where the clamp is active."""
    diff = lp - rl
    return torch.exp(diff.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)), (diff.abs() < LOG_RATIO_CLAMP).double()


def _bern_kl(mu, pi):
    return mu * torch.log(mu / pi) + (1 - mu) * torch.log((1 - mu) / (1 - pi))


def ref_ppo_clip(lp, rl, A, eps_low=0.2, eps_high=0.2, dual_clip_c=3.0):
    r, inside = _ratio(lp, rl)
    l1, l2 = -A * r, -A * r.clamp(1 - eps_low, 1 + eps_high)
    loss = torch.maximum(l1, l2)
    clipped = ((A > 0) & (r > 1 + eps_high)) | ((A < 0) & (r < 1 - eps_low))
    dual = (A < 0) & (loss > -A * dual_clip_c)
    loss = torch.where(dual, -A * dual_clip_c, loss)
    grad = torch.where(clipped | dual, torch.zeros_like(r), -A * r * inside)
    return loss, grad


def ref_cispo(lp, rl, A, eps_low=1.0, eps_high=0.28):
    r, _ = _ratio(lp, rl)
    w = r.clamp(1 - eps_low, 1 + eps_high)
    return -w * A * lp, -w * A


def ref_spo(lp, rl, A, eps=0.2):
    r, inside = _ratio(lp, rl)
    return -(r * A - A.abs() * (r - 1) ** 2 / (2 * eps)), -(A * r - A.abs() * (r - 1) * r / eps) * inside


def _dppo(lp, rl, A, masked, is_cap=10.0):
    r, _ = _ratio(lp, rl)
    keep = (~masked).double()
    return -A * r.clamp(max=is_cap) * keep * lp, -A * r.clamp(max=is_cap) * keep


def ref_dppo_binary_tv(lp, rl, A, delta=0.15):
    shift = lp.exp() - rl.exp()
    return _dppo(lp, rl, A, torch.where(A > 0, shift > delta, shift < -delta))


def ref_dppo_binary_kl(lp, rl, A, delta=0.05):
    mu, pi = rl.exp(), lp.exp()
    harmful = torch.where(A > 0, pi > mu, pi < mu)
    return _dppo(lp, rl, A, (_bern_kl(mu, pi) > delta) & harmful)


def ref_drpo(lp, rl, A, delta=12.5):
    r, inside = _ratio(lp, rl)
    mu = rl.exp()
    loss = -(r * A - A.abs() / (2 * delta) * mu * (r - 1) ** 2)
    return loss, -(A * r - A.abs() / delta * mu * (r - 1) * r) * inside


def ref_mask_drpo(lp, rl, A, delta=0.15):
    r, inside = _ratio(lp, rl)
    mu = rl.exp()
    out = ((mu * (r - 1)).abs() > delta).double()
    loss = -(r * A - out * A.abs() / (2 * delta) * mu * (r - 1) ** 2)
    return loss, -(A * r - out * A.abs() / delta * mu * (r - 1) * r) * inside


def ref_drpo_no_abs_adv(lp, rl, A, delta=12.5):
    r, inside = _ratio(lp, rl)
    mu = rl.exp()
    return -(r * A - mu * (r - 1) ** 2 / (2 * delta)), -(A * r - mu * (r - 1) * r / delta) * inside


def ref_tv_penalty(lp, rl, A, delta=12.5):
    r, inside = _ratio(lp, rl)
    mu = rl.exp()
    loss = -(r * A - A.abs() / delta * (mu * (r - 1)).abs())
    return loss, -(A * r - A.abs() / delta * torch.sign(r - 1) * mu * r) * inside


def ref_kl_penalty(lp, rl, A, delta=12.5):
    r, inside = _ratio(lp, rl)
    mu, pi = rl.exp(), lp.exp()
    loss = -(r * A - A.abs() / delta * _bern_kl(mu, pi))
    dkl = pi * (1 - mu) / (1 - pi) - mu
    return loss, -(A * r * inside - A.abs() / delta * dkl)


REFERENCES = {
    "ppo_clip": (ref_ppo_clip, [{}, {"eps_low": 0.2, "eps_high": 0.28, "dual_clip_c": 3.0}]),
    "cispo": (ref_cispo, [{}, {"eps_low": 0.5, "eps_high": 2.0}]),
    "spo": (ref_spo, [{}, {"eps": 0.05}]),
    "dppo_binary_tv": (ref_dppo_binary_tv, [{}, {"delta": 0.05}]),
    "dppo_binary_kl": (ref_dppo_binary_kl, [{}, {"delta": 0.2}]),
    "drpo": (ref_drpo, [{}, {"delta": 0.1}, {"delta": 0.5}]),
    "mask_drpo": (ref_mask_drpo, [{}, {"delta": 0.05}]),
    "drpo_no_abs_adv": (ref_drpo_no_abs_adv, [{}, {"delta": 0.2}]),
    "tv_penalty": (ref_tv_penalty, [{}, {"delta": 0.2}]),
    "kl_penalty": (ref_kl_penalty, [{}, {"delta": 0.2}]),
}

CASES = [(name, params) for name, (_, plist) in REFERENCES.items() for params in plist]


@pytest.mark.parametrize("name,params", CASES, ids=[f"{n}-{p}" for n, p in CASES])
def test_objective_value_and_gradient_match_hand_formula(off_policy_batch, name, params):
    lp, rl, A, mask = off_policy_batch
    loss = objectives.token_loss(name, lp, rl, A, mask=mask, **params)
    (grad,) = torch.autograd.grad(loss.sum(), lp)
    ref_loss, ref_grad = REFERENCES[name][0](lp.detach(), rl, A, **params)
    zero = torch.zeros_like(ref_loss)
    torch.testing.assert_close(loss, torch.where(mask, ref_loss, zero), rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(grad, torch.where(mask, ref_grad, zero), rtol=1e-9, atol=1e-12)
    assert loss.shape == lp.shape
    assert torch.isfinite(loss).all() and torch.isfinite(grad).all()


def test_batch_has_extreme_ratios_and_zero_advantages(off_policy_batch):
    lp, rl, A, _ = off_policy_batch
    log_r = lp.detach() - rl
    assert log_r.max() > 10 and log_r.min() < -10  # ratios beyond e^10 both ways
    assert (A == 0).sum() > 20
    assert rl.exp().min() < 1e-5


def test_gspo_matches_sequence_level_formula(off_policy_batch):
    lp, rl, A_tok, mask = off_policy_batch
    # GSPO's advantage is per sequence; broadcast one value per row.
    A = A_tok[:, :1].expand_as(A_tok).contiguous()
    eps_low, eps_high = 0.1, 0.2
    loss = objectives.token_loss("gspo", lp, rl, A, mask=mask, eps_low=eps_low, eps_high=eps_high)
    (grad,) = torch.autograd.grad(loss.sum(), lp)
    m = mask.double()
    s = torch.exp(((lp.detach() - rl) * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True)).expand_as(lp)
    ref = torch.maximum(-A * s, -A * s.clamp(1 - eps_low, 1 + eps_high))
    active = ~(((A > 0) & (s > 1 + eps_high)) | ((A < 0) & (s < 1 - eps_low)))
    ref_grad = -A * s * active.double()
    torch.testing.assert_close(loss, ref * m)
    torch.testing.assert_close(grad, ref_grad * m)


def test_gspo_sequence_gradient_equals_mean_token_gradient():
    """Summed per row and divided by its length, GSPO's token gradients are d(s_i A)/d theta."""
    lp = torch.log(torch.tensor([[0.5, 0.2, 0.9]], dtype=torch.float64)).requires_grad_()
    rl = torch.log(torch.tensor([[0.45, 0.25, 0.85]], dtype=torch.float64))
    A = torch.full_like(rl, 0.7)
    loss = objectives.token_loss("gspo", lp, rl, A, eps_low=0.9, eps_high=10.0)
    (g_token,) = torch.autograd.grad(loss.mean(), lp)
    lp2 = lp.detach().clone().requires_grad_()
    s = torch.exp((lp2 - rl).mean())
    (g_seq,) = torch.autograd.grad(-(s * 0.7), lp2)
    torch.testing.assert_close(g_token, g_seq)


def test_drpo_gradient_is_minus_a_r_w(off_policy_batch):
    lp, rl, A, _ = off_policy_batch
    for delta in (12.5, 0.5, 0.1):
        (grad,) = torch.autograd.grad(objectives.token_loss("drpo", lp, rl, A, delta=delta).sum(), lp)
        pi, mu = lp.detach().exp(), rl.exp()
        r = pi / mu
        w = 1 - torch.sign(A * (r - 1)) * (pi - mu).abs() / delta
        torch.testing.assert_close(grad, -A * r * w, rtol=1e-9, atol=1e-12)


def _drpo_w(mu: float, pi: float, A: float, delta: float) -> float:
    lp = torch.tensor([[math.log(pi)]], dtype=torch.float64, requires_grad=True)
    rl = torch.tensor([[math.log(mu)]], dtype=torch.float64)
    loss = objectives.token_loss("drpo", lp, rl, torch.tensor([[A]], dtype=torch.float64), delta=delta)
    (g,) = torch.autograd.grad(loss.sum(), lp)
    return -g.item() / (A * pi / mu)


@pytest.mark.parametrize("A,direction", [(1.0, +1), (-1.0, -1)])
def test_drpo_weight_zero_at_boundary_negative_beyond_and_above_one_when_converging(A, direction):
    mu, delta = 0.5, 0.2
    # diverging: pi moves the way A pushes it
    assert _drpo_w(mu, mu + direction * 0.1, A, delta) == pytest.approx(0.5)
    assert _drpo_w(mu, mu + direction * delta, A, delta) == pytest.approx(0.0, abs=1e-12)
    assert _drpo_w(mu, mu + direction * 0.3, A, delta) == pytest.approx(-0.5)
    # converging: pi moved against A's push, the update pulls it back towards mu harder
    assert _drpo_w(mu, mu - direction * 0.1, A, delta) == pytest.approx(1.5)
    assert _drpo_w(mu, mu - direction * delta, A, delta) == pytest.approx(2.0)


def test_drpo_weight_bounded_as_mu_vanishes_while_spo_weight_explodes():
    delta, eps, pi = 0.5, 0.2, 0.3
    drpo_w, spo_w = [], []
    for mu in (1e-1, 1e-2, 1e-3, 1e-4, 1e-5, 1e-6):
        for A in (1.0, -1.0):
            w = _drpo_w(mu, pi, A, delta)
            assert 1 - 1 / delta - 1e-9 <= w <= 1 + 1 / delta + 1e-9
            drpo_w.append(abs(w))
        lp = torch.tensor([[math.log(pi)]], dtype=torch.float64, requires_grad=True)
        rl = torch.tensor([[math.log(mu)]], dtype=torch.float64)
        (g,) = torch.autograd.grad(objectives.token_loss("spo", lp, rl, torch.ones(1, 1, dtype=torch.float64), eps=eps).sum(), lp)
        spo_w.append(abs(g.item() / (pi / mu)))
    assert max(drpo_w) <= 1 + 1 / delta
    assert all(b > 5 * a for a, b in zip(spo_w, spo_w[1:]))  # grows ~10x per decade of mu
    assert spo_w[-1] > 1e5


def test_drpo_released_recipe_weight_stays_within_8_percent(off_policy_batch):
    lp, rl, A, mask = off_policy_batch
    out = objectives.compute(objectives.make_config("drpo"), objectives.ObjectiveInputs(lp, rl, A, mask))
    hist = out.metrics["weight_hist"]
    assert hist.edges[0].item() == pytest.approx(0.92) and hist.edges[-1].item() == pytest.approx(1.08)
    assert out.metrics["corrective_frac"].value.item() == 0.0
    assert hist.value.sum().item() == (mask & (A != 0)).sum().item()


def test_drpo_metrics_count_corrective_tokens():
    mu = torch.tensor([[0.5, 0.5, 0.5, 0.5]], dtype=torch.float64)
    pi = torch.tensor([[0.9, 0.6, 0.2, 0.9]], dtype=torch.float64)
    A = torch.tensor([[1.0, 1.0, 1.0, -1.0]], dtype=torch.float64)
    out = objectives.compute(
        objectives.make_config("drpo", delta=0.2), objectives.ObjectiveInputs(pi.log().requires_grad_(), mu.log(), A)
    )
    # w: 1-0.4/0.2=-1 (corrective), 1-0.1/0.2=0.5, 1+0.3/0.2=2.5 (above one), 1+0.4/0.2=3
    assert out.metrics["corrective_frac"].value.item() == pytest.approx(0.25)
    assert out.metrics["weight_above_one_frac"].value.item() == pytest.approx(0.5)
    assert out.metrics["beyond_delta_frac"].value.item() == pytest.approx(0.75)
    assert out.metrics["weight_mean"].value.item() == pytest.approx((-1 + 0.5 + 2.5 + 3) / 4)
    reg = 1 / 0.4 * 0.5 * (pi / mu - 1) ** 2
    surr = (pi / mu * A).abs()
    assert out.metrics["regularizer_share"].value.item() == pytest.approx((reg.sum() / (reg.sum() + surr.sum())).item())


def test_drpo_weight_histogram_bins():
    mu = torch.full((1, 5), 0.5, dtype=torch.float64)
    pi = torch.tensor([[0.85, 0.65, 0.25, 0.95, 0.7]], dtype=torch.float64)
    A = torch.tensor([[1.0, 1.0, 1.0, -1.0, 0.0]], dtype=torch.float64)
    out = objectives.compute(
        objectives.make_config("drpo", delta=0.2), objectives.ObjectiveInputs(pi.log().requires_grad_(), mu.log(), A)
    )
    hist = out.metrics["weight_hist"]
    # w = -0.75, 0.25, 2.25, 3.25 (the A = 0 token carries no gradient and is not counted)
    torch.testing.assert_close(hist.edges, torch.linspace(-4.0, 6.0, 11))
    expected = torch.zeros(10)
    expected[[3, 4, 6, 7]] = 1.0
    assert torch.equal(hist.value, expected)
    assert out.metrics["weight_mean"].value.item() == pytest.approx((-0.75 + 0.25 + 2.25 + 3.25) / 4)


@pytest.mark.parametrize(
    "name,delta", [("dppo_binary_tv", 0.15), ("dppo_binary_kl", 0.05)]
)
def test_dppo_masks_follow_harmful_direction(name, delta):
    mu = 0.5
    # (pi, A, expected masked)
    cases = [
        (0.9, 1.0, True),  # A > 0 pushed up past the region: harmful
        (0.1, 1.0, False),  # A > 0 but pi fell: the update repairs it
        (0.1, -1.0, True),  # A < 0 pushed down past the region: harmful
        (0.9, -1.0, False),
        (0.1, 0.0, True),  # A = 0 follows the negative rule
        (0.9, 0.0, False),
        (0.52, 1.0, False),  # inside the region
        (0.48, -1.0, False),
    ]
    pi = torch.tensor([[c[0] for c in cases]], dtype=torch.float64)
    A = torch.tensor([[c[1] for c in cases]], dtype=torch.float64)
    lp = pi.log().requires_grad_()
    rl = torch.full_like(pi, math.log(mu))
    out = objectives.compute(objectives.make_config(name, delta=delta), objectives.ObjectiveInputs(lp, rl, A))
    (grad,) = torch.autograd.grad(out.loss.sum(), lp)
    expected_masked = torch.tensor([[c[2] for c in cases]])
    nonzero_adv = A != 0
    assert torch.equal((grad == 0) & nonzero_adv, expected_masked & nonzero_adv)
    assert out.metrics["masked_frac_pos_adv"].value.item() == pytest.approx(1 / 3)
    assert out.metrics["masked_frac_nonpos_adv"].value.item() == pytest.approx(2 / 5)


def test_dppo_truncates_importance_weight_at_cap():
    lp = torch.log(torch.tensor([[0.2]], dtype=torch.float64)).requires_grad_()
    rl = torch.log(torch.tensor([[0.001]], dtype=torch.float64))
    A = torch.tensor([[-1.0]], dtype=torch.float64)
    (g,) = torch.autograd.grad(objectives.token_loss("dppo_binary_tv", lp, rl, A, delta=0.9, is_cap=10.0).sum(), lp)
    assert g.item() == pytest.approx(10.0)  # -A * min(200, 10)


def test_drpo_weight_fractions_ignore_float_noise_of_an_on_policy_step():
    """On policy, pi and mu differ by float noise only: no token counts as above one or corrective."""
    mu = torch.full((1, 64), 0.3, dtype=torch.float64)
    noise = torch.linspace(-2e-5, 2e-5, 64, dtype=torch.float64).unsqueeze(0)
    A = torch.ones(1, 64, dtype=torch.float64)
    out = objectives.compute(objectives.make_config("drpo", delta=0.2), objectives.ObjectiveInputs((mu + noise).log().requires_grad_(), mu.log(), A))
    assert out.metrics["weight_above_one_frac"].value.item() == 0.0 and out.metrics["corrective_frac"].value.item() == 0.0
    shifted = objectives.compute(objectives.make_config("drpo", delta=0.2), objectives.ObjectiveInputs((mu - 0.01).log().requires_grad_(), mu.log(), A))
    assert shifted.metrics["weight_above_one_frac"].value.item() == 1.0  # w = 1.05: a real shift counts
