"""Tensor and expert parallelism over 2 gloo ranks agree with a single rank on the same weights, and
their checkpoint parts merge offline (learner/export.py) into the weights the ranks gather live."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.multiprocessing as mp

from learner import export
from learner.distributed import free_port
from learner.model import ModelArch
from tests import distributed_cases

pytestmark = pytest.mark.slow

DENSE = ModelArch(vocab_size=96, hidden_size=64, intermediate_size=80, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
MOE = dataclasses.replace(DENSE, num_experts=4, router_topk=2, moe_intermediate_size=48)


def _random_weights(arch: ModelArch, seed: int) -> dict[str, torch.Tensor]:
    """Full megatron-named weights; built by hand so no process group is needed here."""
    g = torch.Generator().manual_seed(seed)
    h, d = arch.hidden_size, arch.head_dim
    qkv_rows = (arch.num_heads + 2 * arch.num_kv_heads) * d
    w = {"embedding.word_embeddings.weight": 0.2 * torch.randn(arch.vocab_size, h, generator=g), "decoder.final_layernorm.weight": 1 + 0.1 * torch.randn(h, generator=g)}
    if not arch.tie_embeddings:
        w["output_layer.weight"] = 0.2 * torch.randn(arch.vocab_size, h, generator=g)
    for i in range(arch.num_layers):
        p = f"decoder.layers.{i}."
        w[p + "input_layernorm.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
        w[p + "pre_mlp_layernorm.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
        w[p + "self_attention.linear_qkv.weight"] = 0.2 * torch.randn(qkv_rows, h, generator=g)
        w[p + "self_attention.linear_proj.weight"] = 0.2 * torch.randn(h, arch.num_heads * d, generator=g)
        if arch.num_experts:
            f = arch.moe_intermediate_size
            w[p + "mlp.router.weight"] = 0.5 * torch.randn(arch.num_experts, h, generator=g)
            for e in range(arch.num_experts):
                w[p + f"mlp.experts.local_experts.{e}.linear_fc1.weight"] = 0.2 * torch.randn(2 * f, h, generator=g)
                w[p + f"mlp.experts.local_experts.{e}.linear_fc2.weight"] = 0.2 * torch.randn(h, f, generator=g)
        else:
            w[p + "mlp.linear_fc1.weight"] = 0.2 * torch.randn(2 * arch.intermediate_size, h, generator=g)
            w[p + "mlp.linear_fc2.weight"] = 0.2 * torch.randn(h, arch.intermediate_size, generator=g)
    return w


def _data(arch: ModelArch, tmp_path) -> str:
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, arch.vocab_size, (8, 10), generator=g)
    mask = torch.zeros(8, 10, dtype=torch.bool)
    mask[:, 4:] = True
    path = tmp_path / "data.pt"
    torch.save(
        {
            "arch": dataclasses.asdict(arch), "weights": _random_weights(arch, 0), "input_ids": ids, "mask": mask,
            "rollout_logp": -3.0 + 0.3 * torch.randn(8, 10, generator=g),
            "advantages": torch.randn(8, 1, generator=g).expand(8, 10).contiguous(),
        },
        path,
    )
    return str(path)


def _run(case: str, world: int, data_path: str, tmp_path) -> dict:
    out = tmp_path / f"{case}-{world}.pt"
    mp.spawn(distributed_cases.run, args=(world, free_port(), case, data_path, str(out)), nprocs=world, join=True)
    result = torch.load(out, weights_only=True)
    # the offline merge of every rank's checkpoint part equals the live all-gather
    merged, _ = export.merge(export.rank_states(f"{out}.ckpt", world))
    assert merged.keys() == result["weights"].keys()
    assert all(torch.equal(merged[k], v) for k, v in result["weights"].items())
    return result


def test_tensor_parallel_2_gives_the_same_logprobs_and_step_as_1(tmp_path):
    data = _data(DENSE, tmp_path)
    one, two = _run("tp", 1, data, tmp_path), _run("tp", 2, data, tmp_path)
    torch.testing.assert_close(two["logp"], one["logp"], atol=1e-5, rtol=0)
    torch.testing.assert_close(two["entropy"], one["entropy"], atol=1e-5, rtol=0)
    assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5)
    torch.testing.assert_close(two["logp_after"], one["logp_after"], atol=1e-5, rtol=0)
    assert not torch.allclose(one["logp_after"], one["logp"])  # the step did something


def test_moe_expert_parallel_2_gives_the_same_loss_and_grad_norm_as_1(tmp_path):
    data = _data(MOE, tmp_path)
    one, two = _run("ep", 1, data, tmp_path), _run("ep", 2, data, tmp_path)
    assert two["tokens"] == one["tokens"] == 48
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-5, abs=1e-7)
    assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5)
    # after the step, the gathered expert-parallel weights (experts under global names) match
    assert two["weights"].keys() == one["weights"].keys()
    for name, tensor in one["weights"].items():
        torch.testing.assert_close(two["weights"][name], tensor, atol=1e-6, rtol=1e-5)
