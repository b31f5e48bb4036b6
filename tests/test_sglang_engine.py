"""The sglang engine on a CUDA GPU (SGLang has no CPU build): mu, top-K and weight updates."""

from __future__ import annotations

import pytest

from learner.weights import wire
from rollout.engine import SamplingParams
from tests.engine_checks import recompute_logp

pytestmark = pytest.mark.gpu


def test_sglang_mu_matches_transformers_and_weight_updates_apply(smollm2_folder, reference):
    pytest.importorskip("sglang")
    from rollout.sglang_engine import SGLangEngine

    engine = SGLangEngine(str(smollm2_folder), precision="fp32")
    try:
        prompt = [engine.chat_prompt("Ben has 4 apples. He gets 3 more. How many apples does Ben have now?")]
        (group,) = engine.generate(prompt, SamplingParams(n=2, max_new_tokens=12, temperature=0.8, topk_logprobs=3, seed=0))
        for c in group:
            assert (c.rollout_logp - recompute_logp(reference, c, 0.8)).abs().max().item() <= 1e-2  # GPU kernels, TF32
            assert (c.topk_logp.exp().sum(-1) <= 1 + 1e-4).all()
        state = {k: v * 1.01 for k, v in reference.state_dict().items() if k.endswith("mlp.down_proj.weight")}
        engine.update_weights(wire.buckets(state.items(), version=1))
        assert engine.version == 1
        (after,) = engine.generate(prompt, SamplingParams(n=1, max_new_tokens=4, temperature=1.0, seed=1))
        assert (after[0].versions == 1).all()
    finally:
        engine.close()


def test_sglang_request_in_flight_across_an_update_records_both_versions(smollm2_folder, reference):
    """The update lands between decoding steps (in-place pause): each response holds old-version
    tokens then new-version ones, with nothing dropped; the old-version tokens' mu matches the old
    weights in transformers (each stamp is the version that sampled the token)."""
    pytest.importorskip("sglang")
    import threading
    import time


    from rollout.sglang_engine import SGLangEngine

    from rollout.engine import Completion
    from tests.engine_checks import recompute_logp

    engine = SGLangEngine(str(smollm2_folder), precision="fp32")
    try:
        state = {k: v * 1.01 for k, v in reference.state_dict().items() if k.endswith("mlp.up_proj.weight")}
        prompt = [engine.chat_prompt("Write a long story about a dragon.")]
        result = {}
        thread = threading.Thread(target=lambda: result.update(group=engine.generate(prompt, SamplingParams(n=2, max_new_tokens=256, seed=3))[0]))
        thread.start()
        deadline = time.time() + 120
        while engine.tokens_received < 10 and time.time() < deadline:
            time.sleep(0.002)
        engine.update_weights(wire.buckets(state.items(), version=1))
        thread.join(timeout=300)
        for c in result["group"]:
            v = c.versions.tolist()
            assert v == sorted(v) and v[0] == 0, v
            split = v.index(1) if 1 in v else len(v)
            head = Completion(c.prompt_ids, c.response_ids[:split], c.rollout_logp[:split], c.versions[:split], "length", c.prompt_version)
            assert (c.rollout_logp[:split] - recompute_logp(reference, head, 1.0)).abs().max().item() <= 1e-2
        assert any(1 in c.versions.tolist() for c in result["group"]), "the update did not land mid-response"
    finally:
        engine.close()


def test_sglang_fp8_rollout_serves_block_fp8_weights_and_follows_updates(smollm2_folder, reference):
    """fp8 rollout (rollout/fp8.py): SGLang starts from the block-fp8 copy and takes publications
    quantized the same way; its mu tracks transformers holding the dequantized weights (what the
    engine serves, up to fp8 activations), before and after an update."""
    pytest.importorskip("sglang")
    import copy

    from rollout.fp8 import dequantize_block, quantize_named
    from rollout.sglang_engine import SGLangEngine

    def served(model, state):  # transformers with the weights the engine holds
        out = dict(quantize_named(state.items(), 64))
        model.load_state_dict({k: dequantize_block(out[k], out[k + "_scale_inv"], 64) if k + "_scale_inv" in out else v for k, v in state.items()}, strict=False)
        return model

    engine = SGLangEngine(str(smollm2_folder), precision="fp8", fp8_block=64)
    try:
        prompt = [engine.chat_prompt("Ben has 4 apples. He gets 3 more. How many apples does Ben have now?")]
        before = served(copy.deepcopy(reference), reference.state_dict())
        (group,) = engine.generate(prompt, SamplingParams(n=2, max_new_tokens=12, temperature=1.0, seed=0))
        gap0 = max((c.rollout_logp - recompute_logp(before, c, 1.0)).abs().mean().item() for c in group)
        assert gap0 < 0.1, gap0
        state = {k: v * 1.05 for k, v in reference.state_dict().items() if k.endswith("mlp.down_proj.weight")}
        engine.update_weights(wire.buckets(state.items(), version=1))
        after = served(copy.deepcopy(reference), {**reference.state_dict(), **state})
        (group,) = engine.generate(prompt, SamplingParams(n=2, max_new_tokens=12, temperature=1.0, seed=1))
        assert all((c.versions == 1).all() for c in group)
        new = max((c.rollout_logp - recompute_logp(after, c, 1.0)).abs().mean().item() for c in group)
        old = max((c.rollout_logp - recompute_logp(before, c, 1.0)).abs().mean().item() for c in group)
        assert new < 0.1 and new < old, (new, old)  # the update was served, quantized
    finally:
        engine.close()
