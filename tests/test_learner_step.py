"""Learner steps on one gloo rank: DRPO on real SmolLM2 completions, resume, checkpoints, buckets."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from learner import bridge, checkpoint, packing

from learner.weights import wire
from learner import model as modeling
from learner.config import LearnerConfig, OptimizerConfig
from learner.batch import TrainBatch
from learner.learner import Learner
from objectives.config import DRPOConfig

REPO = Path(__file__).resolve().parents[1]

TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def _tiny_learner(cfg: LearnerConfig, seed: int = 0) -> Learner:
    torch.manual_seed(seed)
    hf = LlamaForCausalLM(LlamaConfig(**TINY))
    arch = modeling.ModelArch.from_hf_config(hf.config.to_dict())
    return Learner(cfg, arch, bridge.hf_to_megatron(hf.state_dict(), arch))


def _tiny_batch(learner: Learner, seed: int = 1) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, TINY["vocab_size"], (6, 14), generator=g)
    mask = torch.zeros(6, 14, dtype=torch.bool)
    mask[:, 6:] = True
    mask[0, 10:] = False  # a shorter response
    rollout = learner.compute_logprobs(ids).logp + 0.05 * torch.randn(6, 14, generator=g)
    adv = torch.randn(6, 1, generator=g).expand(6, 14).contiguous()
    return TrainBatch(ids, mask, rollout, adv)


@pytest.fixture(scope="module")
def smollm2_completions(smollm2_folder):
    """4 prompts x 2 sampled completions from SmolLM2 with the sampler's own per-token log-probs."""
    tok = AutoTokenizer.from_pretrained(smollm2_folder)
    hf = AutoModelForCausalLM.from_pretrained(smollm2_folder, attn_implementation="eager").eval()
    prompts = ["What is 12 + 7? Answer:", "Name a color:", "2 * 8 =", "The opposite of hot is"]
    torch.manual_seed(0)
    rows = []
    for p in prompts:
        enc = tok(p, return_tensors="pt")
        out = hf.generate(**enc, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=12, num_return_sequences=2,
                          output_scores=True, return_dict_in_generate=True, pad_token_id=tok.eos_token_id)
        for seq in out.sequences:
            rows.append((seq, enc.input_ids.shape[1]))
    width = max(len(s) for s, _ in rows)
    ids = torch.full((len(rows), width), tok.eos_token_id)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, (seq, plen) in enumerate(rows):
        ids[i, : len(seq)] = seq
        mask[i, plen : len(seq)] = True
    with torch.no_grad():
        logp = torch.log_softmax(hf(ids).logits.float(), -1)[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    rollout = torch.cat([torch.zeros(len(rows), 1), logp], dim=1)
    return ids, mask, rollout


def _steps_move_logprobs_with_the_advantage(learner, ids, mask, rollout, before, steps=3):
    """``steps`` DRPO steps with one advantage sign per prompt (two samples of a prompt can be
    identical, and opposite signs would cancel); each row's mean log-prob moves with its sign.
    Returns the last step's metrics."""
    sign = torch.tensor([1.0, 1.0, -1.0, -1.0] * 2)[:, None]
    batch = TrainBatch(ids, mask, rollout, sign.expand_as(rollout).contiguous())
    for _ in range(steps):
        metrics = learner.train(batch)
    after = learner.compute_logprobs(ids).logp
    change = ((after - before) * mask).sum(1) / mask.sum(1)
    assert (change[sign[:, 0] > 0] > 0).all() and (change[sign[:, 0] < 0] < 0).all(), change
    return metrics


def test_drpo_steps_on_smollm2_completions_move_logprobs_with_the_advantage(megatron_single_rank, smollm2_folder, smollm2_completions):
    ids, mask, rollout = smollm2_completions
    cfg = LearnerConfig(objective=DRPOConfig(delta=12.5), optimizer=OptimizerConfig(lr=2e-5, grad_clip=1.0), micro_batch_size=4)
    learner = Learner.build(cfg, model_folder=smollm2_folder)
    before = learner.compute_logprobs(ids).logp
    # the learner reproduces the sampler's log-probs: the off-policy gap at version 0 is numerics only
    assert (before - rollout)[mask].abs().max().item() < 1e-3
    metrics = _steps_move_logprobs_with_the_advantage(learner, ids, mask, rollout, before)
    assert metrics.version == 3 and metrics.tokens == int(mask.sum())
    assert 0.92 <= metrics.values["objective/weight_mean"] <= 1.08
    assert "gap/kl_k3" in metrics.values and "objective/weight_hist/bin_0" in metrics.values


BF16_LOGP_TOLERANCE = 0.25
"""Largest |log pi_bf16 - log pi_fp32| at SmolLM2's response tokens that the bf16 learner may show
(measured here: mean ~0.02, max ~0.1 over 8 sampled completions; bf16 keeps 8 mantissa bits)."""


@pytest.mark.slow  # ~50 s on a CPU without bf16 units (the AVX2-only EPYC): out of `make test-fast`
def test_bf16_learner_agrees_with_fp32_and_drpo_moves_logprobs_with_the_advantage(megatron_single_rank, smollm2_folder, smollm2_completions):
    ids, mask, rollout = smollm2_completions
    cfg = LearnerConfig(
        objective=DRPOConfig(delta=12.5), optimizer=OptimizerConfig(lr=1e-4, grad_clip=1.0), precision="bf16", packing="shared_prompt",
    )  # one step at 5x the fp32 test's lr: a bf16 step of SmolLM2 takes ~25 s on a CPU without bf16 units
    learner = Learner.build(cfg, model_folder=smollm2_folder)
    assert next(learner.module.parameters()).dtype == torch.bfloat16
    before = learner.compute_logprobs(ids).logp
    assert before.dtype == torch.float32
    gap = (before - rollout)[mask].abs()  # rollout: the fp32 transformers sampler's own log-probs
    print(f"bf16 learner vs fp32 sampler: mean |dlogp| {gap.mean():.4f}, max {gap.max():.4f}")
    assert 0 < gap.max().item() < BF16_LOGP_TOLERANCE and gap.mean().item() < 0.05
    metrics = _steps_move_logprobs_with_the_advantage(learner, ids, mask, rollout, before, steps=1)
    # the shared prompts (2 samples each) were computed once: fewer forward slots than the rows hold
    assert metrics.values["learner/forward_tokens"] < int(packing.spans(mask)[1].sum())
    # the optimizer's fp32 main parameters are what the bf16 weights are rounded from
    main = learner.optimizer.main[0]
    assert main.dtype == torch.float32 and torch.equal(main.to(torch.bfloat16), learner.optimizer.params[0].detach())


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_resume_reproduces_the_next_step_exactly(megatron_single_rank, tmp_path, precision):
    cfg = LearnerConfig(
        optimizer=OptimizerConfig(lr=1e-3, warmup_steps=2, schedule="cosine", total_steps=10), micro_batch_size=2, precision=precision,
    )
    first = _tiny_learner(cfg)
    batch = _tiny_batch(first)
    for _ in range(2):
        first.train(batch)
    first.save_checkpoint(tmp_path / "ckpt.pt")
    expected = first.train(batch)
    resumed = _tiny_learner(cfg, seed=99)  # different initial weights: everything must come from the checkpoint
    resumed.load_checkpoint(tmp_path / "ckpt.pt")
    got = resumed.train(batch)
    assert got.loss == expected.loss and got.grad_norm == expected.grad_norm and got.lr == expected.lr
    assert (got.updates, got.version) == (expected.updates, expected.version) == (3, 3)
    for (name, a), (_, b) in zip(first.full_megatron_state().items(), resumed.full_megatron_state().items()):
        assert torch.equal(a, b), name
    if precision == "bf16":  # the fp32 main parameters came back too, not their bf16 rounding
        assert all(torch.equal(a, b) for a, b in zip(first.optimizer.main, resumed.optimizer.main))
        assert any(not torch.equal(m, m.to(torch.bfloat16).float()) for m in resumed.optimizer.main)


def test_checkpoint_write_failure_keeps_the_previous_checkpoint(megatron_single_rank, tmp_path, monkeypatch):
    learner = _tiny_learner(LearnerConfig())
    path = tmp_path / "ckpt.pt"
    learner.save_checkpoint(path)
    good = path.read_bytes()

    def disk_full(obj, f, *args, **kwargs):
        f.write(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint.torch, "save", disk_full)
    with pytest.raises(OSError, match="No space left"):
        learner.save_checkpoint(path)
    assert path.read_bytes() == good
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]  # no temporary left behind


def test_corrupt_and_foreign_checkpoints_are_rejected_clearly(megatron_single_rank, tmp_path):
    learner = _tiny_learner(LearnerConfig())
    (tmp_path / "corrupt.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(checkpoint.CheckpointError, match="corrupt"):
        learner.load_checkpoint(tmp_path / "corrupt.pt")
    torch.save({"meta": {"arch": "other"}, "model": {}}, tmp_path / "foreign.pt")
    with pytest.raises(checkpoint.CheckpointError, match="written for"):
        learner.load_checkpoint(tmp_path / "foreign.pt")
    with pytest.raises(checkpoint.CheckpointError, match="does not exist"):
        learner.load_checkpoint(tmp_path / "missing.pt")
    learner.save_checkpoint(tmp_path / "ckpt.pt")
    state = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    dropped = sorted(state["model"])[0]
    del state["model"][dropped]  # a checkpoint missing a weight: refused by name, never half-loaded
    torch.save(state, tmp_path / "partial.pt")
    with pytest.raises(checkpoint.CheckpointError, match=f"1 missing \\({dropped}"):
        learner.load_checkpoint(tmp_path / "partial.pt")


def test_weight_buckets_are_bounded_and_reassemble_to_hf_weights(megatron_single_rank):
    learner = _tiny_learner(LearnerConfig())
    named = dict(learner.hf_named_tensors())
    limit = 40_000
    out = list(wire.buckets(learner.hf_named_tensors(), version=7, max_bytes=limit))
    assert len(out) > 2 and out[-1].last and not any(b.last for b in out[:-1])
    for b in out:
        assert b.nbytes <= limit or len(b.tensors) == 1
    version, merged = wire.assemble(out)
    assert version == 7 and merged.keys() == named.keys()
    assert all(torch.equal(merged[k], named[k]) for k in named)
    with pytest.raises(ValueError, match="out-of-order"):
        wire.assemble([out[1], out[0]])
    with pytest.raises(ValueError, match="final bucket"):
        wire.assemble(out[:-1])


def test_a_pickled_bucket_carries_its_tensors_out_of_band_and_comes_back_bit_exact():
    """Ray's object store pickles buckets with protocol 5: each tensor must travel as an out-of-band
    buffer (mapped by the consumer without a copy), whatever its dtype, shape or layout."""
    import pickle

    tensors = {
        "w": torch.randn(6, 4), "bf16": torch.randn(5).bfloat16(), "fp8": torch.randn(3, 2).to(torch.float8_e4m3fn),
        "scalar": torch.tensor(2.5), "transposed": torch.randn(3, 2).t(), "empty": torch.zeros(0, 4),
    }
    bucket = wire.WeightBucket(5, 2, True, tensors)
    buffers = []
    data = pickle.dumps(bucket, protocol=5, buffer_callback=buffers.append)
    assert len(buffers) == len(tensors) and len(data) < 4096  # the bytes went out of band, not into the pickle
    back = pickle.loads(data, buffers=buffers)
    assert (back.version, back.index, back.last) == (5, 2, True) and back.tensors.keys() == tensors.keys()
    for name, t in tensors.items():
        got = back.tensors[name]
        assert got.dtype == t.dtype and got.shape == t.shape and torch.equal(got.reshape(-1).view(torch.uint8), t.contiguous().reshape(-1).view(torch.uint8)), name
    assert pickle.loads(pickle.dumps(bucket)).tensors["bf16"].equal(tensors["bf16"])  # in-band (older protocols) too


def test_keep_freed_memory_keeps_a_freed_tensors_pages_mapped():
    """cpu/allocator.py in a fresh process: after it, freeing a 256 MiB tensor leaves the process's
    resident size where it was (the pages are kept for the next step); glibc's default unmaps them."""
    import subprocess
    import sys

    probe = (
        "import sys, torch\n"
        "from cpu.allocator import keep_freed_memory\n"
        "kept = keep_freed_memory() if sys.argv[1] == 'keep' else None\n"
        "rss = lambda: int([l for l in open('/proc/self/status') if l.startswith('VmRSS')][0].split()[1]) // 1024\n"
        "x = torch.ones(64 * 2**20); before = rss(); del x\n"
        "print(kept, before - rss())\n"
    )
    dropped = {}
    for mode in ("keep", "default"):
        out = subprocess.run([sys.executable, "-c", probe, mode], capture_output=True, text=True, check=True, cwd=REPO)
        kept, mib = out.stdout.split()
        dropped[mode] = int(mib)
        assert kept == ("True" if mode == "keep" else "None")
    assert dropped["default"] >= 200 and dropped["keep"] < 16, dropped


def test_bad_batches_are_rejected_with_the_field_name():
    ids = torch.zeros(2, 5, dtype=torch.long)
    ok = torch.zeros(2, 5)
    mask = torch.zeros(2, 5, dtype=torch.bool)
    mask[:, 2:] = True
    with pytest.raises(ValueError, match="advantages has shape"):
        TrainBatch(ids, mask, ok, torch.zeros(2, 4))
    with pytest.raises(ValueError, match="NaN or inf"):
        TrainBatch(ids, mask, torch.full((2, 5), float("nan")), ok)
    bad = mask.clone()
    bad[0, 0] = True
    with pytest.raises(ValueError, match="position 0"):
        TrainBatch(ids, bad, ok, ok)
