"""Multi-node Ray clusters on this machine (ray.cluster_utils: one raylet per node) for tests."""

from __future__ import annotations

from contextlib import contextmanager


def leave_local_ray() -> None:
    """Stop the local cluster an earlier module of this test process kept (tests/conftest.py
    ray_local): a test that joins a cluster of its own must not find this process joined to another."""
    import ray

    if ray.is_initialized():
        ray.shutdown()


@contextmanager
def local_cluster(nodes: dict[str, dict]):
    """A CPU-less head plus one node per entry (``add_node`` arguments), on loopback (tests/conftest.py
    ran controller.network.prepare before Ray was imported); the driver joins it. Yields (cluster, {name: node})."""
    import ray
    from ray.cluster_utils import Cluster

    leave_local_ray()
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    try:
        added = {name: c.add_node(**spec) for name, spec in nodes.items()}
        c.wait_for_nodes()
        ray.init(address=c.address, log_to_driver=False)
        yield c, added
    finally:
        ray.shutdown()
        c.shutdown()
