"""Fault injection for tests (``rollout.chaos``, rollout.config.ChaosConfig): the one seam through
which a rollout worker misbehaves on purpose. A worker always calls these hooks; with no chaos
configured (``Chaos.build(None, ...)``) every hook does nothing, so production code never branches on chaos.

Faults that model a broken worker (hangs, deaths, lost groups, failed loads) fire on worker 0 only,
and most only in its first life, so the restarted worker recovers; corrupted engine output and
failing rewards fire at their rates on every worker, drawn from the seeded generator.
"""

from __future__ import annotations

import dataclasses
import os
import random
import threading

import torch

from rollout.config import ChaosConfig
from rollout.engine import Completion, Engine, EngineDied
from rollout.records import Group, TrainTicket


def _restarted() -> bool:
    """Whether this actor is a restart (Ray reconstructed it after its process died)."""
    import ray

    return ray.is_initialized() and ray.get_runtime_context().was_current_actor_reconstructed


class Chaos:
    def __init__(self, config: ChaosConfig | None, worker_id: int):
        """Use ``build``."""
        self.active = config is not None
        self.config = config or ChaosConfig()
        self.rng = random.Random(self.config.seed)
        self.worker_id = worker_id
        self._train_groups = 0

    @classmethod
    def build(cls, config: ChaosConfig | None, *, worker_id: int) -> "Chaos":
        """Worker ``worker_id``'s faults as ``config`` (rollout.chaos) sets them; None: none."""
        if config is not None:
            ChaosConfig.expect(config, "Chaos")
        return cls(config, worker_id)

    def _first_life(self, option: str, count: int) -> bool:
        """Whether ``option`` fires now: worker 0, in its first life, at its N-th call."""
        return getattr(self.config, option) == count and self.worker_id == 0 and not _restarted()

    def hang(self, option: str, count: int) -> None:
        """hang_generate / hang_weight_load: worker 0, in its first life, blocks forever at the N-th call."""
        if self._first_life(option, count):
            threading.Event().wait()

    def before_generate(self, engine: Engine, call: int) -> None:
        """Before the N-th engine call: hang_generate, then kill_engine (the engine's processes are
        killed, or the hf engine marked dead, and the call raises EngineDied as a real death would)."""
        self.hang("hang_generate", call)
        if self._first_life("kill_engine", call):
            engine.kill_for_chaos()
        if getattr(engine, "_chaos_dead", False):
            raise EngineDied("chaos: the engine died (kill_engine)")

    def on_receive(self, count: int) -> None:
        """Before the N-th broadcast receive: exit_on_receive (the process dies mid-publication)."""
        if self._first_life("exit_on_receive", count):
            os._exit(1)

    def after_receive(self, count: int) -> None:
        """After the N-th broadcast receive: fail_on_receive (the engine reports a failed load)."""
        if self._first_life("fail_on_receive", count):
            raise RuntimeError("chaos: the engine failed to load the publication")

    def lose(self, groups: list[Group]) -> list[Group]:
        """lose_group: worker 0 never returns its N-th training group (a request that hangs)."""
        n = self.config.lose_group
        if n is None or self.worker_id != 0:
            return groups
        kept = []
        for g in groups:
            if isinstance(g.ticket, TrainTicket):
                self._train_groups += 1
                if self._train_groups == n:
                    continue
            kept.append(g)
        return kept

    def corrupt(self, completions: list[Completion]) -> list[Completion]:
        """nan_logp_rate (a whole group's mu NaN) and empty_response_rate (a response cut to nothing)."""
        if not self.active:
            return completions
        if self.rng.random() < self.config.nan_logp_rate:
            completions = [dataclasses.replace(c, rollout_logp=torch.full_like(c.rollout_logp, float("nan"))) for c in completions]
        return [
            dataclasses.replace(c, response_ids=c.response_ids[:0], rollout_logp=c.rollout_logp[:0], versions=c.versions[:0],
                                topk_ids=None if c.topk_ids is None else c.topk_ids[:0], topk_logp=None if c.topk_logp is None else c.topk_logp[:0])
            if self.rng.random() < self.config.empty_response_rate else c
            for c in completions
        ]

    def reward_fails(self) -> bool:
        """reward_error_rate: whether this sample's reward raises."""
        return self.active and self.rng.random() < self.config.reward_error_rate
