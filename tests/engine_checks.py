"""Checks shared by the engine tests."""

from __future__ import annotations

import torch


def recompute_logp(model, completion, temperature: float) -> torch.Tensor:
    """The response tokens' log-probs under softmax(logits / T) from an independent transformers
    forward over prompt + response: what an engine's mu must equal."""
    ids = torch.cat([completion.prompt_ids, completion.response_ids])[None]
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float() / temperature, -1)
    start = len(completion.prompt_ids)
    return logp[start - 1 : -1].gather(-1, completion.response_ids[:, None]).squeeze(-1)
