"""The learner on a CUDA GPU: NCCL, megatron's distributed optimizer, device placement."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

pytestmark = pytest.mark.gpu


def test_gpu_learner_steps_with_distributed_optimizer_and_matches_transformers():
    from learner import bridge, distributed
    from learner import model as modeling
    from learner.config import LearnerConfig, OptimizerConfig
    from learner.batch import TrainBatch
    from learner.learner import Learner
    from learner.optim import MegatronDistributedAdam

    cfg = LearnerConfig(optimizer=OptimizerConfig(lr=1e-3), micro_batch_size=2)
    distributed.init(cfg.parallel, 0, 1, master_port=distributed.free_port())
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, attn_implementation="eager")).eval()
    arch = modeling.ModelArch.from_hf_config(hf.config.to_dict())
    learner = Learner(cfg, arch, bridge.hf_to_megatron(hf.state_dict(), arch))
    assert isinstance(learner.optimizer, MegatronDistributedAdam) and learner.device.type == "cuda"
    ids = torch.randint(0, 96, (4, 12))
    with torch.no_grad():
        ref = torch.log_softmax(hf(ids).logits, -1)[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    logp = learner.compute_logprobs(ids).logp
    assert (logp[:, 1:].cpu() - ref).abs().max().item() < 1e-3  # TF32 matmuls on GPU
    mask = torch.zeros(4, 12, dtype=torch.bool)
    mask[:, 5:] = True
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])[:, None].expand(4, 12).contiguous()
    metrics = learner.train(TrainBatch(ids, mask, logp.cpu(), adv))
    assert metrics.grad_norm > 0 and metrics.version == 1
    after = learner.compute_logprobs(ids).logp.cpu()
    change = ((after - logp.cpu()) * mask).sum(1)
    assert (change[adv[:, 0] > 0] > 0).all() and (change[adv[:, 0] < 0] < 0).all()


def test_gpu_distributed_optimizer_checkpoint_resumes_the_same_step(tmp_path):
    """Save after one step, take a second; a fresh learner loaded from the checkpoint takes the same
    second step (megatron's dp_zero parameter state: main parameters and Adam moments)."""
    from learner import bridge, distributed
    from learner import model as modeling
    from learner.batch import TrainBatch
    from learner.config import LearnerConfig, OptimizerConfig
    from learner.learner import Learner

    cfg = LearnerConfig(optimizer=OptimizerConfig(lr=1e-3), micro_batch_size=2)
    if not torch.distributed.is_initialized():
        distributed.init(cfg.parallel, 0, 1, master_port=distributed.free_port())
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)).eval()
    arch = modeling.ModelArch.from_hf_config(hf.config.to_dict())
    weights = bridge.hf_to_megatron(hf.state_dict(), arch)
    ids = torch.randint(0, 96, (4, 12))
    mask = torch.zeros(4, 12, dtype=torch.bool)
    mask[:, 5:] = True
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])[:, None].expand(4, 12).contiguous()
    first = Learner(cfg, arch, weights)
    batch = TrainBatch(ids, mask, first.compute_logprobs(ids).logp.cpu(), adv)
    first.train(batch)
    first.save_checkpoint(tmp_path / "ckpt.pt")
    expected = first.train(batch)
    second = Learner(cfg, arch, weights)
    second.load_checkpoint(tmp_path / "ckpt.pt")
    got = second.train(batch)
    assert got.loss == pytest.approx(expected.loss, rel=1e-5) and got.grad_norm == pytest.approx(expected.grad_norm, rel=1e-4)
    assert torch.equal(first.compute_logprobs(ids).logp.cpu(), second.compute_logprobs(ids).logp.cpu())
