"""Chunked log-prob, entropy and top-K equal the naive full-logits computation."""

from __future__ import annotations

import pytest
import torch

from objectives.logprobs import chunk_size, logprobs_from_hidden, logprobs_from_logits, naive_logprobs


@pytest.mark.parametrize("vocab", [49_152, 151_936])
def test_chunked_from_hidden_equals_naive_with_gradients(vocab):
    g = torch.Generator().manual_seed(vocab)
    hidden = torch.randn(3, 11, 32, generator=g, requires_grad=True)
    weight = (0.2 * torch.randn(vocab, 32, generator=g)).requires_grad_()
    targets = torch.randint(0, vocab, (3, 11), generator=g)
    temperature = 0.7
    # a budget of 8 tokens per chunk forces several chunks and a ragged last one
    chunked = logprobs_from_hidden(hidden, weight, targets, temperature, entropy=True, topk=20, max_chunk_elements=8 * vocab)
    # the reference is the naive computation on the same fp32 logits, evaluated in float64
    naive = naive_logprobs(hidden @ weight.t(), targets, temperature, entropy=True, topk=20, dtype=torch.float64)
    for a, b in ((chunked.logp, naive.logp), (chunked.entropy, naive.entropy), (chunked.topk_logp, naive.topk_logp)):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a.double(), b, atol=1e-5, rtol=0)
    assert torch.equal(chunked.topk_ids, naive.topk_ids)
    coef_lp, coef_ent = torch.randn(3, 11, generator=g), torch.randn(3, 11, generator=g)
    g_chunked = torch.autograd.grad((coef_lp * chunked.logp + coef_ent * chunked.entropy).sum(), [hidden, weight])
    g_naive = torch.autograd.grad((coef_lp * naive.logp + coef_ent * naive.entropy).sum(), [hidden, weight])
    for a, b in zip(g_chunked, g_naive):
        torch.testing.assert_close(a.double(), b.double(), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("vocab", [49_152, 151_936])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_from_logits_equals_naive_with_gradients(vocab, dtype):
    g = torch.Generator().manual_seed(vocab + 1)
    logits = (4 * torch.randn(2, 9, vocab, generator=g)).to(dtype).requires_grad_()
    targets = torch.randint(0, vocab, (2, 9), generator=g)
    chunked = logprobs_from_logits(logits, targets, 1.3, entropy=True, topk=5, max_chunk_elements=4 * vocab)
    naive = naive_logprobs(logits, targets, 1.3, entropy=True, topk=5, dtype=torch.float64)
    for a, b in ((chunked.logp, naive.logp), (chunked.entropy, naive.entropy), (chunked.topk_logp, naive.topk_logp)):
        torch.testing.assert_close(a.double(), b, atol=1e-5, rtol=0)
    (g_chunked,) = torch.autograd.grad((chunked.logp - 0.5 * chunked.entropy).sum(), logits)
    (g_naive,) = torch.autograd.grad((naive.logp - 0.5 * naive.entropy).sum(), logits)
    assert g_chunked.dtype == dtype
    torch.testing.assert_close(g_chunked.double(), g_naive.double(), atol=1e-5 if dtype == torch.float32 else 1e-2, rtol=0)


def test_logp_only_gradient_without_entropy():
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(17, 8, generator=g, requires_grad=True)
    weight = torch.randn(300, 8, generator=g, requires_grad=True)
    targets = torch.randint(0, 300, (17,), generator=g)
    chunked = logprobs_from_hidden(hidden, weight, targets, max_chunk_elements=300 * 4)
    assert chunked.entropy is None and chunked.topk_logp is None
    naive = naive_logprobs(hidden @ weight.t(), targets)
    for a, b in zip(torch.autograd.grad(chunked.logp.sum(), [hidden, weight]), torch.autograd.grad(naive.logp.sum(), [hidden, weight])):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_chunk_size_respects_element_budget():
    assert chunk_size(151_936, 2**25) == 220
    assert chunk_size(10, 5) == 1


def test_bad_shapes_and_temperature_are_rejected():
    h, w = torch.randn(4, 8), torch.randn(20, 8)
    with pytest.raises(ValueError, match="targets shape"):
        logprobs_from_hidden(h, w, torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature"):
        logprobs_from_hidden(h, w, torch.zeros(4, dtype=torch.long), temperature=0.0)
    with pytest.raises(ValueError, match="hidden size"):
        logprobs_from_hidden(h, torch.randn(20, 7), torch.zeros(4, dtype=torch.long))


def test_log_probs_at_given_ids_equal_the_naive_ones_on_both_paths():
    """Top-K DPPO needs pi on the engine's ids, which are not the learner's own top-K."""
    g = torch.Generator().manual_seed(11)
    vocab = 5_000
    hidden = torch.randn(2, 7, 16, generator=g)
    weight = 0.3 * torch.randn(vocab, 16, generator=g)
    targets = torch.randint(0, vocab, (2, 7), generator=g)
    ids = torch.randint(0, vocab, (2, 7, 6), generator=g)
    naive = naive_logprobs(hidden @ weight.t(), targets, 0.8, ids=ids, dtype=torch.float64)
    from_hidden = logprobs_from_hidden(hidden, weight, targets, 0.8, ids=ids, max_chunk_elements=3 * vocab)
    from_logits = logprobs_from_logits(hidden @ weight.t(), targets, 0.8, ids=ids, max_chunk_elements=3 * vocab)
    for got in (from_hidden, from_logits):
        assert got.ids_logp.shape == (2, 7, 6) and not got.ids_logp.requires_grad
        torch.testing.assert_close(got.ids_logp.double(), naive.ids_logp, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="ids shape"):
        logprobs_from_hidden(hidden, weight, targets, ids=ids[0])
