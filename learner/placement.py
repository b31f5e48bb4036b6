"""Placing a role on the cluster: its bundles' share of a node resource, and waiting for a placement
group with an error that names what could not be placed."""

from __future__ import annotations

import ray
from ray.util.placement_group import remove_placement_group

PLACEMENT_SECONDS = 300.0
"""How long a placement group may wait for the cluster's resources before the run stops naming them."""
ROLE_RESOURCE_SHARE = 0.001
"""How much of a role's node resource (``*.node_resource``) each bundle requests: a node declaring 1
hosts up to 1,000 ranks or workers of that role, and none of the other."""


class PlacementError(RuntimeError):
    """The cluster cannot host a role: a resource no node declares, or bundles that never fit."""


def role_bundle(cpus: float, gpus: float, node_resource: str | None) -> dict[str, float]:
    """One bundle of a role: its CPUs, its GPUs (none asked when 0), and its share of the role's
    node resource (none when it has none)."""
    return {"CPU": cpus, **({"GPU": gpus} if gpus else {}), **({node_resource: ROLE_RESOURCE_SHARE} if node_resource else {})}


def wait_placed(pg, what: str, bundles: list[dict], timeout: float = PLACEMENT_SECONDS) -> None:
    """Wait for ``pg`` to be placed; past ``timeout`` remove it and raise PlacementError naming ``what``."""
    try:
        ray.get(pg.ready(), timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        raise PlacementError(
            f"{what}: Ray could not place {len(bundles)} bundle(s) of {bundles[0]} within {timeout:.0f} s; the cluster has "
            f"{ {k: v for k, v in ray.available_resources().items() if not k.startswith('node:')} } available"
        ) from None
