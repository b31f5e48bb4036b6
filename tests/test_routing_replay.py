"""Rollout routing replay (R3) on the tiny chat Qwen3-MoE: the hf engine records the experts it routed
each position to, the learner (real megatron-core, one gloo rank) replays them; the replayed routing
equals the engine's at every routed position and layer, the router still trains, and the lag-0 gap
and the routing disagreement with and without replay are measured (bf16 engine, fp32 learner)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from controller.batch_builder import completion_batch
from learner.config import LearnerConfig
from rollout.engine import SamplingParams
from rollout.tasks import arithmetic_split

pytestmark = [pytest.mark.engine]


@pytest.fixture(scope="module")
def sampled(tiny_moe_model):
    from rollout.hf_engine import HFEngine

    engine = HFEngine(str(tiny_moe_model), precision="bf16")
    prompts = [engine.chat_prompt(p.prompt) for p in arithmetic_split("train", 4)]
    completions = [c for group in engine.generate(prompts, SamplingParams(n=2, max_new_tokens=8, seed=0)) for c in group]
    rows = completion_batch(completions)
    return replace(rows, advantages=torch.tensor([1.0, -1.0] * (len(completions) // 2))[:, None] * rows.response_mask)


def learner(folder, replay: bool):
    from learner.learner import Learner

    cfg = LearnerConfig(routing_replay=replay, packing="none", precision="fp32", micro_batch_size=8, optimizer={"lr": 1e-2, "grad_clip": None})
    return Learner.build(cfg, model_folder=folder)


def test_the_engine_records_every_position_and_layer(sampled):
    routed = sampled.routed_experts
    assert routed.shape[2:] == (2, 2)  # 2 MoE layers, top-2
    for i in range(routed.shape[0]):
        length = int(sampled.response_mask[i].nonzero().max()) + 1  # prompt + response
        assert (routed[i, : length - 1] >= 0).all() and (routed[i, length - 1 :] == -1).all()
        assert (routed[i, : length - 1] < 4).all()


def test_replayed_routing_equals_the_engines_and_the_router_still_trains(megatron_single_rank, tiny_moe_model, sampled):
    model = learner(tiny_moe_model, replay=True)
    model.batch_logprobs(sampled)
    engine = sampled.routed_experts.transpose(0, 1).reshape(-1, 2, 2).long()  # megatron's [S * B] token order
    known = (engine >= 0).all(-1)
    for layer, replay in enumerate(model.routing.layers):
        chosen = replay.chosen.reshape(-1, 2)
        assert torch.equal(chosen[known[:, layer]], engine[:, layer][known[:, layer]])
    routers = [p for name, p in model.module.named_parameters() if name.endswith("router.weight")]
    before = [p.detach().clone() for p in routers]
    metrics = model.train(sampled)
    assert len(routers) == 2 and all(not torch.equal(b, p.detach()) for b, p in zip(before, routers))  # the router got gradient
    assert metrics.values["gap/routing_replayed_frac"] == 1.0


def test_replay_removes_the_routing_disagreement_and_its_gap(megatron_single_rank, tiny_moe_model, sampled, capsys):
    gaps, disagreement = {}, {}
    for replay in (False, True):
        model = learner(tiny_moe_model, replay)
        pi = model.batch_logprobs(sampled).logp
        m = model.routing.metrics()
        mask = sampled.response_mask
        gaps[replay] = ((pi.exp() - sampled.rollout_logp.exp()).abs()[mask]).mean().item()
        disagreement[replay] = (m["routing_disagreement_frac"].value.item())
    with capsys.disabled():
        print(f"\ntiny Qwen3-MoE, bf16 hf engine vs fp32 learner, lag 0: mean |pi - mu| {gaps[False]:.5f} without replay, "
              f"{gaps[True]:.5f} with; learner's own routing differs from the engine's at {disagreement[False]:.4f} of decisions")
    assert disagreement[False] == disagreement[True]  # the learner's own choice is measured either way
    assert gaps[True] <= gaps[False] + 1e-6
