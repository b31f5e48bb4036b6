"""The sglang engine on a CUDA GPU (SGLang has no CPU build): mu, top-K and weight updates."""

from __future__ import annotations

import pytest

from learner import publish
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
        engine.update_weights(publish.buckets(state.items(), version=1))
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
        engine.update_weights(publish.buckets(state.items(), version=1))
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
