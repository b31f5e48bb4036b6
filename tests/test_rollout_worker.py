"""A RolloutWorker on a local Ray cluster produces scored groups with the real model."""

from __future__ import annotations

import pytest
import torch

from learner import publish
from rollout.tasks import Problem, arithmetic_split

pytestmark = [pytest.mark.ray, pytest.mark.engine]


def test_rollout_worker_scores_groups_and_takes_weight_updates(ray_local, smollm2_folder):
    from rollout.worker import RolloutWorker

    ray = ray_local
    worker = ray.remote(RolloutWorker).options(num_cpus=1).remote(
        str(smollm2_folder), {"n": 3, "max_new_tokens": 12, "temperature": 1.0, "seed": 0}, "literal"
    )
    problems = arithmetic_split("test", 2) + [Problem("empty", "", "0")]
    ray.get(worker.submit.remote(problems))
    groups = ray.get(worker.collect.remote(min_groups=3, timeout_s=240))
    assert [g.problem.id for g in groups] == [p.id for p in problems]
    for g in groups[:2]:
        assert g.error is None and len(g.completions) == 3 and len(g.texts) == 3
        assert all(r.score in (0.0, 1.0) for r in g.rewards)
        assert all(r.reason in ("correct", "wrong", "no_answer", "not_literal") for r in g.rewards)
        assert all((c.versions == 0).all() and len(c.rollout_logp) == len(c.response_ids) for c in g.completions)
    beat = ray.get(worker.heartbeat.remote())
    assert beat["alive"] and beat["groups"] == 3 and beat["tokens"] > 0 and beat["queue_depth"] == 0
    # a bad request comes back as a group with its reason, and the worker lives on
    assert groups[2].error == "empty prompt" and groups[2].completions == [] and beat["failures"] == 1
    state = {"model.norm.weight": torch.ones(576) * 1.01}
    refs = [ray.put(b) for b in publish.buckets(state.items(), version=4)]
    assert ray.get(worker.update_weights.remote(refs)) == 4
    ray.get(worker.submit.remote(problems[:1]))
    (group,) = ray.get(worker.collect.remote(min_groups=1, timeout_s=120))
    assert all((c.versions == 4).all() for c in group.completions)
    assert ray.get(worker.heartbeat.remote())["version"] == 4
