"""Node loss on a multi-node cluster (ray.cluster_utils: several raylets on this machine): losing a
rollout node slows training down but it goes on; losing the learner's node stops the run with a
clear message, and it resumes from the last checkpoint."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from controller.app import train
from controller.backend import LearnerLost
from tests.clusters import local_cluster
from tests.fault_checks import assert_ledger_exact
from tests.test_controller_e2e import run_config
from tests.test_faults import TRAIN_IDS, records, when

pytestmark = [pytest.mark.ray, pytest.mark.engine, pytest.mark.slow]


@pytest.fixture
def cluster():
    """A CPU-less head; node "learner" (1 CPU, resource learner_node) and two 1-CPU rollout nodes."""
    nodes = {"learner": {"num_cpus": 1, "resources": {"learner_node": 1}}, "rollout0": {"num_cpus": 1}, "rollout1": {"num_cpus": 1}}
    with local_cluster(nodes) as (c, added):
        yield c, added


def cluster_config(tmp_path, model, steps):
    cfg = run_config(tmp_path, model, steps=steps)
    return cfg.model_copy(update={
        "rollout": cfg.rollout.model_copy(update={"workers": 2, "cpus_per_worker": 1}),
        "checkpoint": cfg.checkpoint.model_copy(update={"every": 2}),
        "eval": cfg.eval.model_copy(update={"every": 0}),
    })


def test_losing_a_rollout_node_slows_training_but_it_goes_on(cluster, tiny_chat_model, tmp_path):
    c, nodes = cluster
    cfg = cluster_config(tmp_path, tiny_chat_model, steps=6)
    run_dir = Path(cfg.run_dir)

    def kill_a_rollout_node():
        when(lambda: len(records(run_dir, "step")) >= 2)
        placement = records(run_dir, "placement")[0]
        victim = next(n for key, n in nodes.items() if key != "learner" and n.node_id in placement["rollout"] and n.node_id not in placement["learner"])
        c.remove_node(victim, allow_graceful=False)

    killer = threading.Thread(target=kill_a_rollout_node, daemon=True)
    killer.start()
    train(cfg)
    killer.join(timeout=5)
    assert [e["event"] for e in records(run_dir, "worker")].count("lost") == 1
    assert_ledger_exact(run_dir, TRAIN_IDS, cfg.seed, 6, cfg.train.prompts_per_step, cfg.train.max_staleness)


def test_losing_the_learner_node_stops_clearly_and_the_run_resumes(cluster, tiny_chat_model, tmp_path):
    c, nodes = cluster
    cfg = cluster_config(tmp_path, tiny_chat_model, steps=6)
    run_dir = Path(cfg.run_dir)

    def kill_the_learner_node():
        when(lambda: (run_dir / "checkpoints" / "step-000002" / "controller.json").is_file())
        placement = records(run_dir, "placement")[0]
        victim = next(n for n in nodes.values() if n.node_id in placement["learner"])
        c.remove_node(victim, allow_graceful=False)

    killer = threading.Thread(target=kill_the_learner_node, daemon=True)
    killer.start()
    with pytest.raises(LearnerLost, match=f"drpo train --resume {cfg.run_dir}"):
        train(cfg)
    killer.join(timeout=5)
    c.add_node(num_cpus=1)  # a replacement node for the learner
    c.wait_for_nodes()
    train(cfg, resume=True)
    assert_ledger_exact(run_dir, TRAIN_IDS, cfg.seed, 6, cfg.train.prompts_per_step, cfg.train.max_staleness)
