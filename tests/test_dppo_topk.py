"""Top-K DPPO: the divergences with a rest bucket, and the masks they drive."""

from __future__ import annotations

import pytest
import torch

import objectives
from objectives.dppo import topk_kl, topk_tv


def _two_distributions(vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    mu_logits = 3 * torch.randn(4, 6, vocab, dtype=torch.float64, generator=g)
    pi_logits = mu_logits + 0.5 * torch.randn(4, 6, vocab, dtype=torch.float64, generator=g)
    return mu_logits.log_softmax(-1), pi_logits.log_softmax(-1)


def test_topk_tv_and_kl_equal_full_vocabulary_when_k_is_vocab():
    mu_logp, pi_logp = _two_distributions(vocab=50)
    ids = torch.argsort(mu_logp, dim=-1, descending=True)
    mu_k, pi_k = mu_logp.gather(-1, ids), pi_logp.gather(-1, ids)
    full_tv = 0.5 * (mu_logp.exp() - pi_logp.exp()).abs().sum(-1)
    full_kl = (mu_logp.exp() * (mu_logp - pi_logp)).sum(-1)
    torch.testing.assert_close(topk_tv(mu_k, pi_k), full_tv, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(topk_kl(mu_k, pi_k), full_kl, rtol=1e-9, atol=1e-12)


def test_topk_divergences_merge_the_tail_into_one_rest_bucket():
    mu_logp, pi_logp = _two_distributions(vocab=30, seed=1)
    k = 5
    ids = torch.argsort(mu_logp, dim=-1, descending=True)[..., :k]
    mu, pi = mu_logp.exp(), pi_logp.exp()
    mu_k, pi_k = mu.gather(-1, ids), pi.gather(-1, ids)
    mu_rest, pi_rest = 1 - mu_k.sum(-1), 1 - pi_k.sum(-1)
    tv = 0.5 * ((mu_k - pi_k).abs().sum(-1) + (mu_rest - pi_rest).abs())
    kl = (mu_k * (mu_k / pi_k).log()).sum(-1) + mu_rest * (mu_rest / pi_rest).log()
    torch.testing.assert_close(topk_tv(mu_k.log(), pi_k.log()), tv)
    torch.testing.assert_close(topk_kl(mu_k.log(), pi_k.log()), kl)
    # merging buckets never increases a divergence (data processing inequality)
    full_tv = 0.5 * (mu - pi).abs().sum(-1)
    assert (topk_tv(mu_k.log(), pi_k.log()) <= full_tv + 1e-12).all()


@pytest.mark.parametrize("name,divergence", [("dppo_topk_tv", topk_tv), ("dppo_topk_kl", topk_kl)])
def test_topk_dppo_masks_large_divergence_in_harmful_direction(name, divergence):
    mu_logp, pi_logp = _two_distributions(vocab=40, seed=2)
    k = 8
    ids = torch.argsort(mu_logp, dim=-1, descending=True)[..., :k]
    sampled = ids[..., 0]  # the engine sampled its most likely token
    rollout_logp = mu_logp.gather(-1, sampled[..., None]).squeeze(-1)
    policy_logp = pi_logp.gather(-1, sampled[..., None]).squeeze(-1).clone().requires_grad_()
    A = torch.randn(rollout_logp.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    delta = 0.1
    div = divergence(mu_logp.gather(-1, ids), pi_logp.gather(-1, ids))
    shift = policy_logp.detach() - rollout_logp
    harmful = torch.where(A > 0, shift > 0, shift < 0)
    masked = (div > delta) & harmful
    assert masked.any() and (~masked).any()
    loss = objectives.token_loss(
        name, policy_logp, rollout_logp, A, delta=delta,
        rollout_topk_logp=mu_logp.gather(-1, ids), policy_topk_logp=pi_logp.gather(-1, ids),
    )
    (grad,) = torch.autograd.grad(loss.sum(), policy_logp)
    r = (policy_logp.detach() - rollout_logp).exp().clamp(max=10.0)
    torch.testing.assert_close(grad, torch.where(masked, torch.zeros_like(r), -A * r))


def test_topk_dppo_without_topk_tensors_names_what_is_missing():
    x = torch.zeros(2, 3, dtype=torch.float64, requires_grad=True)
    with pytest.raises(ValueError, match="rollout_topk_logp and policy_topk_logp"):
        objectives.token_loss("dppo_topk_tv", x, x.detach(), x.detach())
