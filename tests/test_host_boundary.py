"""What learner ranks return to the driver lives on the host: a driver without a GPU never receives a
CUDA tensor. Checked here with 'meta' tensors standing in for any device but the CPU."""

from __future__ import annotations

import pytest
import torch

from learner.host import check_host, off_host, to_host
from objectives.logprobs import TokenLogProbs


def test_results_are_moved_to_the_host_whatever_holds_them():
    off = torch.ones(2, 3, device="meta")
    value = {"stats": TokenLogProbs(off, entropy=off), "parts": [off, (off, 1)], "n": 3}
    assert len(off_host(value)) == 4
    with pytest.raises(NotImplementedError):  # meta tensors hold no data to copy: the move is attempted on each
        to_host(value)
    cpu = TokenLogProbs(torch.zeros(2), entropy=torch.zeros(2, requires_grad=True))
    moved = to_host({"stats": cpu, "k": [torch.ones(1)]})
    assert off_host(moved) == [] and not moved["stats"].entropy.requires_grad


def test_the_driver_refuses_a_result_that_holds_a_device_tensor_by_call_name():
    stats = TokenLogProbs(torch.zeros(2), topk_logp=torch.ones(2, 4, device="meta"))
    with pytest.raises(RuntimeError, match=r"learner compute_logprobs returned tensors off the host \(\[0\]\.topk_logp on meta\)"):
        check_host([stats], "compute_logprobs")
    assert check_host([TokenLogProbs(torch.zeros(2))], "compute_logprobs")[0].logp.shape == (2,)
