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
