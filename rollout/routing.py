"""What an MoE engine routed: per position and MoE layer, the top-k expert ids (rollout routing replay).

The learner replays these ids (learner/routing.py) so its forward uses the experts the engine used,
the largest source of the lag-0 gap on MoE models. The hf engine records them from the routers'
outputs in its own forward (``RoutingRecorder``); the record travels in ``Completion.routed_experts``.
"""

from __future__ import annotations

import torch

NOT_ROUTED = -1
"""Id at positions the engine never routed (the last response token: it was never an input)."""


class RoutingRecorder:
    """Forward hooks on a transformers MoE model's routers (modules named ``mlp.gate`` beside
    ``mlp.experts``, e.g. Qwen3-MoE's TopKRouter, whose third output is [tokens, k] expert ids);
    each forward appends one [tokens, layers, k] tensor. ``active`` is False for dense models."""

    def __init__(self, model):
        self.calls: list[torch.Tensor] = []
        self._layer: list[torch.Tensor] = []
        routers = [layer.mlp.gate for layer in getattr(model.model, "layers", []) if hasattr(getattr(layer, "mlp", None), "experts")]
        self.layers = len(routers)
        for router in routers:
            router.register_forward_hook(self._hook)

    @property
    def active(self) -> bool:
        return self.layers > 0

    def _hook(self, module, args, output) -> None:
        self._layer.append(output[2].to("cpu", torch.int16))  # a record for the CPU-side completion
        if len(self._layer) == self.layers:
            self.calls.append(torch.stack(self._layer, dim=1))
            self._layer = []

    def take(self) -> list[torch.Tensor]:
        calls, self.calls, self._layer = self.calls, [], []
        return calls


def per_row(calls: list[torch.Tensor], prompts: list[list[int]], n: int, width: int, lengths: list[int]) -> list[torch.Tensor]:
    """Each row's routing as ``Completion.routed_experts`` from one generate call's recorded
    forwards: ``calls[0]`` the left-padded prefill of every prompt ([P * width, layers, k]), then
    one decoding step per call ([rows, layers, k]; step s routes the token sampled at step s - 1).
    ``lengths``: each row's response length."""
    prefill = calls[0].view(len(prompts), width, *calls[0].shape[1:])
    steps = calls[1:]
    out = []
    for row, length in enumerate(lengths):
        p = prompts[row // n]
        prompt = prefill[row // n, width - len(p):]
        response = [steps[s][row] for s in range(length - 1)]  # the inputs: tokens 0 .. length-2
        last = torch.full((1, *prompt.shape[1:]), NOT_ROUTED, dtype=torch.int16)
        out.append(torch.cat([prompt, *(r[None] for r in response), last]))
    return out
