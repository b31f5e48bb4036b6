"""The mechanism study's closed-form gradient weights are the objectives library's autograd
gradients (d loss / d log pi = -A w) on the study's own tensors, for every objective it reports,
TIS included; and a small study runs end to end."""

from __future__ import annotations

import pytest
import torch

from benchmarks.mechanism.study import OBJECTIVES, PROFILES, calibrate, policy_logits, study, tables, token_losses, weights


@pytest.mark.parametrize("obj", OBJECTIVES, ids=lambda o: o.name)
@pytest.mark.parametrize("sigma", [0.05, 0.5, 2.0])
def test_closed_form_weights_equal_the_library_gradient(obj, sigma):
    gen = torch.Generator().manual_seed(3)
    z = policy_logits(64, gen, vocab=512)
    log_pi = torch.log_softmax(z, -1)
    log_mu = torch.log_softmax(z + sigma * torch.randn(z.shape, generator=gen), -1)
    y = torch.multinomial(log_mu.exp(), 1, generator=gen).squeeze(1)
    adv = torch.where(torch.rand(64, generator=gen) < 0.5, 1.0, -1.0)
    pi_y = log_pi.gather(1, y[:, None]).squeeze(1).clone().requires_grad_(True)
    mu_y = log_mu.gather(1, y[:, None]).squeeze(1)
    loss = token_losses(obj, pi_y[None], mu_y[None], adv[None]).sum()
    (grad,) = torch.autograd.grad(loss, pi_y)
    w = weights(obj, pi_y.detach(), mu_y, adv)
    torch.testing.assert_close(-grad / adv, w, rtol=1e-4, atol=1e-5)
    if sigma == 2.0:  # a large gap: the objectives' weights really differ somewhere (not all r)
        r = (pi_y.detach() - mu_y).exp()
        assert obj.name == "drpo" or not torch.allclose(w, r, rtol=1e-3), obj.name


def test_calibration_hits_the_measured_gap_and_a_small_study_reports():
    gen = torch.Generator().manual_seed(0)
    z = policy_logits(128, gen, vocab=2048)
    noise, u = torch.randn(z.shape, generator=gen), torch.rand(128, generator=gen)
    for target in (0.003, 0.03):
        _, log_mu, y = calibrate(z, noise, u, target)
        gap = (torch.log_softmax(z, -1).gather(1, y[:, None]).exp() - log_mu.gather(1, y[:, None]).exp()).abs().mean().item()
        assert gap == pytest.approx(target, rel=0.15)
    result = study(positions=64, updates=2, lr=0.5, log=lambda *_: None)
    assert set(result["profiles"]) == set(PROFILES)
    for entry in result["profiles"].values():
        for name, o in entry["objectives"].items():
            assert 0.0 <= o["tail_share"] <= 1.0 and len(o["drift"]) == 3, name  # before, after each of 2 updates
    text = tables(result)
    assert "tail tokens" in text and "grpo_tis" in text
