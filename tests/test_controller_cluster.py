"""`drpo train --config FILE` joins an existing multi-node Ray cluster (RAY_ADDRESS) and places the
learner and the rollout workers on nodes by their resources."""

from __future__ import annotations

import json
import os

import pytest
import yaml

from controller.cli import main
from tests.clusters import leave_local_ray

pytestmark = [pytest.mark.ray, pytest.mark.engine, pytest.mark.slow]


@pytest.fixture
def three_node_cluster(monkeypatch):
    """A head with no CPUs and two 1-CPU worker nodes, each its own raylet on this machine."""
    import ray
    from ray.cluster_utils import Cluster

    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    leave_local_ray()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    nodes = [cluster.add_node(num_cpus=1) for _ in range(2)]
    cluster.wait_for_nodes()
    monkeypatch.setenv("RAY_ADDRESS", cluster.address)
    yield cluster, nodes
    ray.shutdown()
    cluster.shutdown()


def test_train_on_an_existing_cluster_places_learner_and_rollout_on_their_nodes(three_node_cluster, tiny_chat_model, tmp_path):
    cluster, nodes = three_node_cluster
    config = tmp_path / "cluster.yaml"
    config.write_text(yaml.safe_dump({
        "run_dir": str(tmp_path / "run"), "model": {"path": str(tiny_chat_model)},
        "task": {"type": "arithmetic", "train_size": 32, "test_size": 4, "extra_eval_size": 0},
        "rollout": {"workers": 1, "cpus_per_worker": 1, "samples_per_prompt": 4, "max_new_tokens": 3},
        "learner_resources": {"cpus_per_worker": 1},
        "train": {"steps": 2, "prompts_per_step": 2, "mode": "async", "max_staleness": 1},
        "eval": {"every": 0, "at_start": False}, "checkpoint": {"every": 0},
        "metrics": {"port": None, "progress": False},
    }))
    assert main(["train", "--config", str(config)]) == 0
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    (placement,) = [r for r in records if r["kind"] == "placement"]
    worker_nodes = {n.node_id for n in nodes}
    assert set(placement["learner"]) | set(placement["rollout"]) <= worker_nodes  # the CPU-less head hosts neither
    assert set(placement["learner"]).isdisjoint(placement["rollout"])  # one CPU per node: they had to split
    assert [r["step"] for r in records if r["kind"] == "step"] == [1, 2]
    assert os.environ["RAY_ADDRESS"] == cluster.address
