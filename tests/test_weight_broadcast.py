"""Weight buckets broadcast from a learner rank to an engine rank over a separate gloo group."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
from transformers import LlamaConfig, LlamaForCausalLM

from learner.distributed import free_port
from tests import distributed_cases


def test_broadcast_group_delivers_every_tensor_bit_exactly(tmp_path):
    torch.manual_seed(0)
    weights = LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2)).state_dict()
    weights["model.norm.weight"] = weights["model.norm.weight"].to(torch.bfloat16)  # mixed dtypes travel too
    weights["odd.bf16"] = torch.arange(3, dtype=torch.bfloat16)  # 6 bytes: what follows must still be aligned
    weights["odd.int64"] = torch.arange(5, dtype=torch.int64)
    weights["odd.empty"] = torch.empty(0, 4)
    data = tmp_path / "data.pt"
    torch.save({"weights": weights, "version": 4, "max_bytes": 50_000}, data)
    out = tmp_path / "out.pt"
    mp.spawn(distributed_cases.broadcast, args=(2, free_port(), str(data), str(out)), nprocs=2, join=True)
    got = torch.load(out, weights_only=True)
    assert got["version"] == 4 and got["weights"].keys() == weights.keys()
    assert got["backend"] == "gloo"  # both members posted "cpu" to the rendezvous store
    for name, tensor in weights.items():
        assert got["weights"][name].dtype == tensor.dtype and torch.equal(got["weights"][name], tensor), name


def test_nccl_only_when_every_member_has_a_gpu_of_its_own():
    from learner.weights.broadcast import choose_backend

    assert choose_backend(["cuda:GPU-a", "cuda:GPU-b", "cuda:GPU-c"]) == "nccl"
    # a learner and an engine on one GPU (fractional GPUs): NCCL would refuse "Duplicate GPU detected"
    assert choose_backend(["cuda:GPU-a", "cuda:GPU-a"]) == "gloo"
    assert choose_backend(["cuda:GPU-a", "cuda:GPU-b", "cuda:GPU-a"]) == "gloo"
    assert choose_backend(["cuda:GPU-a", "cpu"]) == "gloo"  # an engine on the CPU cannot join NCCL
    assert choose_backend(["cpu", "cpu"]) == "gloo"


def test_only_rank_zero_sends():
    from learner.weights.broadcast import WeightBroadcastGroup
    from learner.weights.wire import WeightBucket

    group = WeightBroadcastGroup.__new__(WeightBroadcastGroup)
    group.rank = 1
    with pytest.raises(RuntimeError, match="only rank 0"):
        group.send(WeightBucket(0, 0, True, {}))
