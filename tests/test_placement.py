"""Placement by role on a multi-node cluster (ray.cluster_utils): learner ranks only on nodes that
declare the learner resource, rollout workers only on rollout nodes, even with a roomier unlabelled
node present; a resource no node declares stops the run at start, naming the field."""

from __future__ import annotations

import pytest

from controller.app import train
from learner.placement import PlacementError
from tests.clusters import local_cluster
from tests.fault_checks import assert_ledger_exact
from tests.test_controller_e2e import run_config
from tests.test_faults import TRAIN_IDS

pytestmark = [pytest.mark.ray, pytest.mark.engine, pytest.mark.slow]


@pytest.fixture
def labelled_cluster():
    nodes = {
        "learner": {"num_cpus": 1, "resources": {"learner_node": 1}},
        "rollout0": {"num_cpus": 1, "resources": {"rollout_node": 1}},
        "rollout1": {"num_cpus": 1, "resources": {"rollout_node": 1}},
        "unlabelled": {"num_cpus": 3},  # room for everything: only the roles keep work off it
    }
    with local_cluster(nodes) as (_, added):
        yield {k: n.node_id for k, n in added.items()}


def role_config(tmp_path, model, **roles):
    cfg = run_config(tmp_path, model, steps=2)
    return cfg.model_copy(update={
        "rollout": cfg.rollout.model_copy(update={"workers": 2, "cpus_per_worker": 1, "node_resource": roles.get("rollout", "rollout_node")}),
        "learner_resources": cfg.learner_resources.model_copy(update={"node_resource": roles.get("learner", "learner_node")}),
        "eval": cfg.eval.model_copy(update={"every": 0, "at_start": False}),
    })


def test_learner_ranks_and_rollout_workers_land_on_their_role_nodes(labelled_cluster, tiny_chat_model, tmp_path):
    from ray.util import placement_group_table

    from controller.ray_backend import RayBackend

    cfg = role_config(tmp_path, tiny_chat_model)
    backend = RayBackend.build(cfg)
    learner_nodes = set(placement_group_table(backend.learner.pg)["bundles_to_node_id"].values())
    rollout_nodes = list(placement_group_table(backend.pg)["bundles_to_node_id"].values())
    assert learner_nodes == {labelled_cluster["learner"]}
    assert sorted(rollout_nodes) == sorted([labelled_cluster["rollout0"], labelled_cluster["rollout1"]])  # SPREAD: one each
    train(cfg, backend=backend)
    assert_ledger_exact(tmp_path / "run", TRAIN_IDS, cfg.seed, 2, cfg.train.prompts_per_step, cfg.train.max_staleness)


@pytest.mark.parametrize("role, field", [("rollout", "rollout.node_resource"), ("learner", "learner_resources.node_resource")])
def test_a_role_resource_no_node_declares_fails_at_start_by_name(labelled_cluster, tiny_chat_model, tmp_path, role, field):
    cfg = role_config(tmp_path, tiny_chat_model, **{role: "gpu_pool"})
    with pytest.raises(PlacementError, match=rf"{field}: no node of this Ray cluster declares the resource 'gpu_pool'"):
        train(cfg)
