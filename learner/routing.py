"""Rollout routing replay (R3) in the learner's megatron-core routers, and the routing gap.

MoE routing is a large source of the lag-0 gap: the engine and the learner route the same token to
different experts when their numerics differ (Megatron-LM's router-replay work reports ~10% of
decisions). With ``learner.routing_replay`` the learner's routers use the experts the engine
recorded (TrainBatch.routed_experts) for the forward and backward of the step; the gate weights are
gathered from the learner's own router scores at those experts, so the router still trains.

megatron-core 0.16 ships ``RouterReplay`` (moe/router_replay.py), and its routers call whatever
object sits in ``router.router_replay``. Its class is not used as is, for three reasons: it binds
replay data to routers by their position in a process-global list of every router ever built (a
second model in the process shifts every layer), it cannot replay part of a batch (positions the
engine never routed: a response's last token, padding), and while replaying it does not record what
the router itself would have chosen, which the disagreement metric needs. ``LayerReplay`` keeps the
same protocol (``get_replay_topk``), bound to one router of one model.
"""

from __future__ import annotations

import torch

from objectives.base import Metric


class LayerReplay:
    """One router's replay: ``target`` [tokens, k] expert ids (rows with an id < 0 keep the
    router's own choice; None: route normally); ``own`` the router's own top-k of the last forward."""

    def __init__(self):
        self.target: torch.Tensor | None = None
        self.own: torch.Tensor | None = None
        self.chosen: torch.Tensor | None = None
        """The experts the last forward used (the target where replayed, else ``own``)."""

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        values, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        self.own = self.chosen = own.detach()
        if self.target is None:
            return values, own
        target = self.target.to(scores.device)
        if target.shape != own.shape:
            raise ValueError(f"replayed routing has shape {tuple(target.shape)}, the router routes {tuple(own.shape)}")
        chosen = torch.where((target >= 0).all(-1, keepdim=True), target, own)
        self.chosen = chosen
        return scores.gather(1, chosen), chosen  # gate weights from the learner's own scores: the router keeps its gradient


class Routing:
    """Every MoE router of ``module`` (in layer order) fitted with a LayerReplay."""

    def __init__(self, module):
        from megatron.core.transformer.moe.router import TopKRouter

        self.layers: list[LayerReplay] = []
        for m in module.modules():
            if isinstance(m, TopKRouter):
                m.router_replay = LayerReplay()
                self.layers.append(m.router_replay)
        self._engine: torch.Tensor | None = None

    def prepare(self, routed: torch.Tensor | None, replay: bool) -> None:
        """Before a forward of rows [B, S]: ``routed`` [B, S, layers, k] the engine's ids (or None);
        with ``replay`` the routers use them. Megatron routes tokens in [S, B] order."""
        self._engine = None
        for layer in self.layers:
            layer.target = None
        if routed is None:
            return
        if routed.shape[2] != len(self.layers):
            raise ValueError(f"the engine recorded routing for {routed.shape[2]} MoE layers, the learner's model has {len(self.layers)}")
        seq_major = routed.transpose(0, 1).reshape(-1, routed.shape[2], routed.shape[3]).long()  # [S * B, layers, k]
        self._engine = seq_major
        if replay:
            for i, layer in enumerate(self.layers):
                layer.target = seq_major[:, i]

    def metrics(self) -> dict[str, Metric]:
        """After the forward: of the (position, layer) decisions the engine made, the fraction where
        the learner's own routers chose another set of experts (what replay removes), and the fraction replayed."""
        if self._engine is None or not self.layers:
            return {}
        engine = self._engine.to(self.layers[0].own.device)
        own = torch.stack([layer.own for layer in self.layers], dim=1)  # [S * B, layers, k]
        routed = (engine >= 0).all(-1)
        differs = (engine.sort(-1).values != own.sort(-1).values).any(-1) & routed
        count = routed.sum().float()
        replayed = self.layers[0].target is not None
        return {
            "routing_disagreement_frac": Metric(differs.sum() / count.clamp(min=1), "mean", count=count),
            "routing_replayed_frac": Metric(torch.tensor(float(replayed)), "mean", count=count),
        }
