"""A LearnerGroup of 2 data-parallel workers on a real local Ray cluster."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from learner.weights import wire
from learner.config import LearnerConfig, OptimizerConfig, ParallelConfig
from learner.batch import TrainBatch

pytestmark = pytest.mark.ray

TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(LlamaConfig(**TINY)).save_pretrained(folder)
    return folder


def test_two_worker_group_steps_and_publishes_weights_a_consumer_can_load(ray_local, tiny_folder):
    from learner.group import LearnerGroup

    cfg = LearnerConfig(parallel=ParallelConfig(data=2), optimizer=OptimizerConfig(lr=1e-3), micro_batch_size=2)
    group = LearnerGroup.build(cfg, model_folder=str(tiny_folder))
    try:
        g = torch.Generator().manual_seed(3)
        ids = torch.randint(0, TINY["vocab_size"], (4, 12), generator=g)
        mask = torch.zeros(4, 12, dtype=torch.bool)
        mask[:, 5:] = True
        rollout = group.compute_logprobs(ids)
        adv = torch.tensor([1.0, -1.0, 1.0, -1.0])[:, None].expand(4, 12).contiguous()
        metrics = group.train(TrainBatch(ids, mask, rollout, adv))
        assert metrics.version == 1 and metrics.tokens == int(mask.sum())  # both ranks' tokens counted
        pub = group.publish(max_bytes=64_000)
        assert pub.version == 1 and pub.nbytes > 0 and pub.seconds > 0
        version, weights = wire.assemble(ray_local.get(ref) for ref in pub.refs)
        # the consumer: an ordinary transformers model loading the published buckets
        consumer = LlamaForCausalLM(LlamaConfig(**TINY))
        consumer.load_state_dict(weights, strict=False)
        learner_states = ray_local.get([w.hf_state.remote() for w in group.workers])
        for name, tensor in consumer.state_dict().items():
            if name in weights:
                assert torch.equal(tensor, learner_states[0][name]), name
                assert torch.equal(learner_states[0][name], learner_states[1][name]), name  # ranks in sync
        initial = LlamaForCausalLM.from_pretrained(tiny_folder).state_dict()
        assert not torch.equal(initial["model.layers.0.mlp.up_proj.weight"], weights["model.layers.0.mlp.up_proj.weight"])
    finally:
        group.shutdown()


def test_the_storage_check_fails_at_start_naming_the_rank_that_sees_another_folder(ray_local, tiny_folder, tmp_path):
    from controller.run_folder import StorageError, check_shared
    from learner.group import LearnerGroup

    run_dir, node_local = tmp_path / "run", tmp_path / "not-shared"
    run_dir.mkdir(), node_local.mkdir()
    group = LearnerGroup.build(LearnerConfig(parallel=ParallelConfig(data=2)), model_folder=str(tiny_folder))
    try:
        check_shared(run_dir, lambda nonce: group.check_storage(str(run_dir), nonce))  # one folder: passes
        node = ray_local.get(group.workers[1].node_id.remote())
        # rank 1 is given another path: what a node-local run_dir looks like from a second machine
        with pytest.raises(StorageError, match=f"learner rank 1 on node {node} .* at {node_local} it found no marker"):
            check_shared(run_dir, lambda nonce: group.check_storage([str(run_dir), str(node_local)], nonce))
    finally:
        group.shutdown()


def test_a_learner_call_past_its_deadline_names_the_call_and_the_late_ranks(ray_local):
    import time

    from learner.group import LearnerTimeout, _get

    @ray_local.remote(num_cpus=0)  # kept learner groups hold the CPUs (learner/actor_pool.py)
    def rank(seconds):
        time.sleep(seconds)
        return seconds

    assert _get([rank.remote(0), rank.remote(0)], "save_checkpoint", 30) == [0, 0]
    with pytest.raises(LearnerTimeout, match=r"learner save_checkpoint into /x did not finish within 1 s \(ranks \[1\] had not answered\)"):
        _get([rank.remote(0), rank.remote(60)], "save_checkpoint into /x", 1)
