"""Packed micro-batches (learner/packing.py) equal the unpacked computation: per-token log-probs,
loss and gradients, for packing=sequences and for a group's prompt shared by its samples."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from learner import bridge, packing
from learner import model as modeling
from learner.batch import TrainBatch
from learner.config import LearnerConfig, OptimizerConfig
from learner.learner import Learner
from objectives.config import DRPOConfig

TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
PAD = 5


def _learner(**cfg) -> Learner:
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**TINY))
    arch = modeling.ModelArch.from_hf_config(hf.config.to_dict())
    base = dict(objective=DRPOConfig(delta=0.2), optimizer=OptimizerConfig(lr=1e-3, grad_clip=None), micro_batch_size=3)
    return Learner(LearnerConfig(**{**base, **cfg}), arch, bridge.hf_to_megatron(hf.state_dict(), arch))


def _grouped_batch(seed: int = 0) -> TrainBatch:
    """3 groups of 4 samples: prompts of 5, 7 and 4 tokens shared within a group, responses of
    1 to 9 tokens, right-padded to one width (an empty-response row included)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for plen, lens in ((5, (3, 9, 1, 6)), (7, (2, 2, 8, 4)), (4, (5, 0, 7, 3))):
        prompt = torch.randint(0, TINY["vocab_size"], (plen,), generator=g)
        for r in lens:
            rows.append((prompt, torch.randint(0, TINY["vocab_size"], (r,), generator=g)))
    width = max(len(p) + len(r) for p, r in rows)
    ids = torch.full((len(rows), width), PAD)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, (p, r) in enumerate(rows):
        ids[i, : len(p)], ids[i, len(p) : len(p) + len(r)] = p, r
        mask[i, len(p) : len(p) + len(r)] = True
    rollout = torch.where(mask, -2.0 + 0.3 * torch.randn(ids.shape, generator=g), 0.0)
    adv = torch.randn(len(rows), 1, generator=g).expand_as(ids) * mask
    return TrainBatch(ids, mask, rollout, adv)


def _grad_norm_and_logp(learner: Learner, batch: TrainBatch):
    """One update's loss and grad norm, and pi before it at the response tokens."""
    logp = learner.batch_logprobs(batch).logp
    metrics = learner.train(batch)
    return logp, metrics


@pytest.mark.parametrize("mode", ["sequences", "shared_prompt"])
def test_packed_micro_batches_equal_unpacked_logprobs_loss_and_gradients(megatron_single_rank, mode):
    batch = _grouped_batch()
    ref_logp, ref = _grad_norm_and_logp(_learner(), batch)
    logp, got = _grad_norm_and_logp(_learner(packing=mode, micro_batch_tokens=40), batch)
    mask = batch.response_mask
    torch.testing.assert_close(logp[mask], ref_logp[mask], atol=2e-5, rtol=1e-5)
    assert abs(got.loss - ref.loss) < 1e-5 * max(1.0, abs(ref.loss))
    assert abs(got.grad_norm - ref.grad_norm) < 1e-5 * ref.grad_norm
    assert got.values["learner/padding_frac"] < ref.values["learner/padding_frac"]
    # the prompt computed once per group: fewer forward slots than the sequences alone hold
    if mode == "shared_prompt":
        assert got.values["learner/forward_tokens"] < int(packing.spans(mask)[1].sum())


def test_shared_prompt_layout_sees_the_prompt_and_its_own_response_only():
    batch = _grouped_batch()
    plan = packing.micro_batches(batch.input_ids, batch.response_mask, "shared_prompt", token_budget=10_000)
    assert sorted(r for rows, _ in plan for r in rows) == list(range(12))
    (rows, packed), = plan
    # group 0 (rows 0..3) is one segment: its prompt's 5 tokens once, then 3 + 9 + 1 + 6 response tokens
    seg = [int(s) for s in packed.source[0, 1:6]]  # row 0's prompt tokens 0..4 predict tokens 1..5
    same = [int(s) for s in packed.source[1, 1:6]]
    assert seg == same  # the other samples read the same (shared) prompt states
    # row 1's first response token is predicted from the shared last prompt state; its later
    # tokens from its own response, which row 0 never sees
    r, w = packed.input_ids.shape
    own = packed.source[1, 6:5 + 9]
    q = int(own[-1])
    mask = packed.attention_mask.reshape(r, w, w)[q // w, q % w]
    row0_response = packed.source[0, 7:5 + 3]  # states of row 0's response tokens
    assert bool(mask[row0_response % w].all())
    assert not bool(mask[torch.tensor(seg) % w].any())
    assert packed.position_ids.reshape(-1)[own].tolist() == list(range(5, 13))


def test_a_group_longer_than_the_budget_is_cut_with_a_prompt_copy_each():
    batch = _grouped_batch()
    prompt, lengths = packing.spans(batch.response_mask)
    # group 0: prompt 5, responses 3, 9, 1, 6; a budget of 16 holds the prompt and 11 response tokens
    segs = packing.segments(batch.input_ids, lengths, prompt, "shared_prompt", token_budget=16)
    assert [(s.rows, s.prompt, s.size) for s in segs[:3]] == [((0,), 0, 8), ((1, 2), 5, 15), ((3,), 0, 11)]
    plan = packing.micro_batches(batch.input_ids, batch.response_mask, "shared_prompt", token_budget=16)
    assert all(p.input_ids.shape[1] <= 16 for _, p in plan)
    assert sorted(r for rows, _ in plan for r in rows) == list(range(12))


def test_a_group_whose_prompts_differ_is_not_shared():
    batch = _grouped_batch()
    ids = batch.input_ids.clone()
    ids[1, 0] = (ids[1, 0] + 1) % TINY["vocab_size"]  # row 1's prompt is not row 0's
    prompt, lengths = packing.spans(batch.response_mask)
    segs = packing.segments(ids, lengths, prompt, "shared_prompt")
    assert [s.rows for s in segs] == [(0,), (1,), (2, 3), (4, 5, 6, 7), (9,), (8, 10, 11)]  # row 9 is empty


def _episode_batch() -> tuple[TrainBatch, torch.Tensor]:
    """_grouped_batch as 2-turn episodes: inside each longer response a run of 2-3 tokens is an
    environment's (mask 0), with large made-up mu and advantages there that must not count.
    Returns the batch and the environment tokens' positions."""
    batch = _grouped_batch()
    mask, env = batch.response_mask.clone(), torch.zeros_like(batch.response_mask)
    prompt, end = packing.spans(batch.response_mask)
    for i in range(len(mask)):
        if end[i] - prompt[i] >= 5:
            start = int(prompt[i]) + 2
            env[i, start: start + (3 if i % 2 else 2)] = True
    mask &= ~env
    rollout = torch.where(env, 7.5, batch.rollout_logp)  # would be a log-prob > 0: nonsense if it were read
    adv = torch.where(env, -40.0, batch.advantages)
    return TrainBatch(batch.input_ids, mask, rollout, adv), env


@pytest.mark.parametrize("mode", ["none", "sequences", "shared_prompt"])
def test_an_environments_tokens_are_context_only_in_every_packing(megatron_single_rank, mode):
    """Multi-turn episodes: the environment's tokens (mask 0 inside a response) are attended to but
    never scored: the loss equals DRPO's token-mean over the model's tokens alone, computed
    independently from pi at those tokens; their mu and advantage do not change the update."""
    import objectives

    batch, env = _episode_batch()
    assert env.sum() >= 10 and not (env & batch.response_mask).any()
    learner = _learner(packing=mode, micro_batch_tokens=40)
    logp = learner.batch_logprobs(batch).logp
    model = batch.response_mask
    expected = objectives.token_loss("drpo", logp[model], batch.rollout_logp[model], batch.advantages[model], delta=0.2).mean()
    got = learner.train(batch)
    assert abs(got.loss - float(expected)) < 1e-5 * max(1.0, abs(float(expected)))
    # the environment's mu and advantages are never read: other values give the same update, bit for bit
    other = TrainBatch(batch.input_ids, model, torch.where(env, -3.0, batch.rollout_logp), torch.where(env, 9.0, batch.advantages))
    again = _learner(packing=mode, micro_batch_tokens=40).train(other)
    assert (again.loss, again.grad_norm) == (got.loss, got.grad_norm)


def test_the_gradient_at_the_logits_predicting_an_environments_tokens_is_exactly_zero():
    """The objective on logits: the rows that predict environment tokens get no gradient at all."""
    import objectives

    batch, env = _episode_batch()
    logits = torch.randn(*batch.input_ids.shape, TINY["vocab_size"], generator=torch.Generator().manual_seed(3), requires_grad=True)
    logp = torch.zeros(batch.input_ids.shape)
    logp[:, 1:] = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    loss = objectives.token_loss("drpo", logp, batch.rollout_logp, batch.advantages, delta=0.2, mask=batch.response_mask)
    objectives.aggregate(loss, batch.response_mask, "token-mean").backward()
    predicting_env = torch.zeros_like(env)
    predicting_env[:, :-1] = env[:, 1:]
    assert torch.all(logits.grad[predicting_env] == 0) and logits.grad[torch.roll(batch.response_mask, -1, 1)].abs().sum() > 0
