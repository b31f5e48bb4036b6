"""What a drpo run puts on the network, and what it keeps off it.

A local run (``drpo train`` or ``drpo eval`` without ``ray_address``/RAY_ADDRESS, the benchmarks, the
tests' clusters) starts its Ray cluster on 127.0.0.1 and binds every socket of every process to
loopback: Ray's GCS, raylet, agents and workers (``_node_ip_address``), the learner's and the weight
broadcast's rendezvous stores (``learner.distributed.listen``: a socket bound to the node address,
handed to the store), gloo's pairs (``GLOO_SOCKET_IFNAME``, the interface holding that address) and
vLLM's own process group (``VLLM_HOST_IP``). A cluster run binds the node address Ray gave each node.

Nothing leaves the machine unless configured: QUIET_ENV turns off Ray's usage reporting (and with it
the cloud-metadata probe of its dashboard agent), vLLM's usage stats, Hugging Face's hub and
telemetry, and anything else that honours DO_NOT_TRACK. It is set in this process before Ray is
imported, so every process the local cluster starts inherits it; deploy/ sets the same variables on
every node of a cluster.
"""

from __future__ import annotations

import ipaddress
import os
import secrets

QUIET_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",  # Ray's usage report, and its agent's probe of 169.254.169.254
    "VLLM_NO_USAGE_STATS": "1",  # vLLM's usage report from every engine
    "VLLM_DO_NOT_TRACK": "1",
    "DO_NOT_TRACK": "1",  # the cross-tool convention (vLLM, Hugging Face, others)
    "HF_HUB_OFFLINE": "1",  # weights and tokenizers come from local folders only
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "TRANSFORMERS_OFFLINE": "1",
}
"""Set in every process of a run: nothing phones home."""
LOCAL_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # Ray's own "this machine only" switch (read at import)
    "RAY_AUTH_MODE": "token",  # Ray generates the token (~/.ray/auth_token) when none is set
    "VLLM_HOST_IP": "127.0.0.1",  # vLLM's process group address (it asks a route to 8.8.8.8 otherwise)
    "VLLM_LOOPBACK_IP": "127.0.0.1",
}
"""Set, on top of QUIET_ENV, for a local cluster this process starts."""
LOOPBACK = "127.0.0.1"
PROXY_VARS = ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY")
DEAD_PROXY = "http://127.0.0.1:9"
"""The discard port on loopback: nothing listens there, so a request through it fails at once."""


class NetworkError(RuntimeError):
    """A run that would listen where it was told not to."""


def quiet() -> None:
    """QUIET_ENV into this process's environment (a value the user set is kept)."""
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)


def prepare(address: str | None = None) -> bool:
    """Set this process's environment for a run that joins ``address`` (or RAY_ADDRESS) or, with
    neither, starts a local cluster: QUIET_ENV, and for a local one LOCAL_ENV and a token of its own
    (RAY_AUTH_TOKEN, never written to disk; a token the user gave is kept). Ray reads these when it
    is imported: call this first. Returns whether the run is local."""
    quiet()
    local = (address or os.environ.get("RAY_ADDRESS") or "local") == "local"
    if local:
        for key, value in LOCAL_ENV.items():
            os.environ.setdefault(key, value)
        if not (os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH")):
            os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
    return local


def is_loopback(address: str) -> bool:
    """127.0.0.0/8, ::1 or an IPv4-mapped loopback (::ffff:127.0.0.1), or "localhost"."""
    try:
        ip = ipaddress.ip_address(address.split("%")[0])
    except ValueError:
        return address == "localhost"
    return ip.is_loopback or bool(getattr(ip, "ipv4_mapped", None) and ip.ipv4_mapped.is_loopback)


def init_ray(address: str | None = None, num_cpus: int | None = None) -> str:
    """Join the Ray cluster at ``address`` (or RAY_ADDRESS), or start a local one on loopback in this
    process; returns this node's address. A local cluster whose node is not on loopback is refused
    (NetworkError) before anything runs on it: the sign that Ray was imported before ``prepare``."""
    local = prepare(address)
    import ray

    if ray.is_initialized():  # called from Python with a cluster already joined
        return ray.util.get_node_ip_address()
    if not local:
        ray.init(address=address or os.environ["RAY_ADDRESS"], log_to_driver=False)
        return ray.util.get_node_ip_address()
    from ray._private import ray_constants

    if ray_constants.ENABLE_RAY_CLUSTER:
        raise NetworkError(
            "Ray was imported before controller.network.prepare() set RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0: its local "
            "cluster would listen on this machine's network address. Call prepare() before importing ray"
        )
    # Ray's dashboard process (started even without the dashboard, for its usage-stats module) asks
    # the cloud metadata endpoints (169.254.169.254, metadata.google.internal) which cloud it runs on
    # before it reads RAY_USAGE_STATS_ENABLED. Its HTTP client honours http_proxy: while Ray's own
    # processes start, that points at a closed loopback port, so the probe fails on this machine. The
    # workers (the run's code: loggers, reward services) get the user's environment back.
    dead_proxy = not any(k in os.environ for k in PROXY_VARS)
    if dead_proxy:
        os.environ["http_proxy"] = DEAD_PROXY
    try:
        ray.init(
            address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False, _node_ip_address=LOOPBACK,
            runtime_env={"env_vars": {"http_proxy": ""}} if dead_proxy else None,
        )
    finally:
        if dead_proxy:
            del os.environ["http_proxy"]
    node = ray.util.get_node_ip_address()
    if not is_loopback(node):
        ray.shutdown()
        raise NetworkError(f"the local Ray cluster came up on {node}, not loopback; drpo refuses to run it off this machine")
    return node
