"""Multi-node Ray clusters on this machine (ray.cluster_utils: one raylet per node) for tests."""

from __future__ import annotations

import os
from contextlib import contextmanager


@contextmanager
def local_cluster(nodes: dict[str, dict]):
    """A CPU-less head plus one node per entry (``add_node`` arguments); the driver joins it.
    Yields (cluster, {name: node})."""
    import ray
    from ray.cluster_utils import Cluster

    previous = os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    try:
        added = {name: c.add_node(**spec) for name, spec in nodes.items()}
        c.wait_for_nodes()
        ray.init(address=c.address, log_to_driver=False)
        yield c, added
    finally:
        ray.shutdown()
        c.shutdown()
        if previous is None:
            os.environ.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)
        else:
            os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = previous
