"""Off-policy gap diagnostics."""

from __future__ import annotations

import math

import pytest
import torch

from objectives.diagnostics import gap_metrics, gap_metrics_by_lag, masked_quantile


def test_gap_metrics_by_hand():
    mu = torch.tensor([[0.5, 0.5, 0.2, 0.9]])
    pi = torch.tensor([[0.5, 0.6, 0.1, 0.1]])
    mask = torch.tensor([[True, True, True, False]])
    m = gap_metrics(pi.log(), mu.log(), mask, delta=0.05, entropy=torch.tensor([[1.0, 2.0, 3.0, 100.0]]))
    shift = [0.0, 0.1, 0.1]
    r = [1.0, 1.2, 0.5]
    assert m["abs_shift_mean"].value.item() == pytest.approx(sum(shift) / 3, rel=1e-5)
    assert m["abs_shift_max"].value.item() == pytest.approx(0.1, rel=1e-5)
    assert m["kl_k1"].value.item() == pytest.approx(sum(-math.log(x) for x in r) / 3, rel=1e-5)
    assert m["kl_k3"].value.item() == pytest.approx(sum(x - 1 - math.log(x) for x in r) / 3, rel=1e-5)
    assert m["chi2"].value.item() == pytest.approx(sum((x - 1) ** 2 for x in r) / 3, rel=1e-5)
    assert m["ratio_max"].value.item() == pytest.approx(1.2, rel=1e-5)
    assert m["beyond_delta_frac"].value.item() == pytest.approx(2 / 3)
    assert m["abs_shift_mean"].reduction == "mean" and m["abs_shift_mean"].count.item() == 3
    assert m["abs_shift_max"].reduction == "max"
    assert m["entropy_mean"].value.item() == pytest.approx(2.0)


def test_masked_quantile_matches_lower_quantile_of_valid_entries():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 33, generator=g)
    mask = torch.rand(7, 33, generator=g) > 0.3
    for q in (0.0, 0.01, 0.5, 0.9, 0.99, 1.0):
        expected = torch.quantile(x[mask], q, interpolation="lower")
        assert masked_quantile(x, mask, q).value.item() == pytest.approx(expected.item())
    assert math.isnan(masked_quantile(x, torch.zeros_like(mask), 0.5).value.item())


def test_gap_split_by_version_lag_separates_numerics_from_staleness():
    mu = torch.full((1, 6), 0.5)
    pi = torch.tensor([[0.51, 0.49, 0.5, 0.8, 0.2, 0.9]])
    lag = torch.tensor([[0, 0, 0, 1, 2, 3]])
    m = gap_metrics_by_lag(pi.log(), mu.log(), lag)
    assert m["numerics/abs_shift_mean"].value.item() == pytest.approx(0.02 / 3, rel=1e-4)
    assert m["staleness/abs_shift_mean"].value.item() == pytest.approx(1.0 / 3, rel=1e-4)
    assert m["all/abs_shift_mean"].count.item() == 6
    assert m["staleness/abs_shift_max"].value.item() == pytest.approx(0.4, rel=1e-5)
    assert "inflight/abs_shift_mean" not in m  # no context lags: every lag-0 token is numerics


def test_lag_0_tokens_of_a_request_an_update_landed_in_are_not_numerics():
    """A token sampled by the learner's version, in a request whose prompt KV is older: inflight."""
    mu = torch.full((1, 6), 0.5)
    pi = torch.tensor([[0.51, 0.49, 0.8, 0.3, 0.2, 0.9]])
    lag = torch.tensor([[0, 0, 0, 0, 1, 1]])
    context = torch.tensor([[0, 0, 1, 1, 1, 2]])  # tokens 2 and 3: sampled at lag 0 after an update mid-request
    m = gap_metrics_by_lag(pi.log(), mu.log(), lag, context_lag=context)
    assert m["numerics/abs_shift_mean"].value.item() == pytest.approx(0.01, rel=1e-4)
    assert m["inflight/abs_shift_mean"].value.item() == pytest.approx(0.25, rel=1e-4) and m["inflight/abs_shift_mean"].count.item() == 2
    assert m["staleness/abs_shift_mean"].value.item() == pytest.approx(0.35, rel=1e-4)
