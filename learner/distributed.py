"""torch.distributed and megatron parallel_state set-up, gloo on CPU and nccl on GPU."""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from learner import cpu_shims, megatron_import
from learner.config import ParallelConfig


def init(
    parallel: ParallelConfig, rank: int, world_size: int, master_addr: str = "127.0.0.1", master_port: int = 29500,
    listener: socket.socket | None = None,
) -> None:
    """Join the process group (if not joined) and build megatron's tensor/pipeline/expert groups.
    Rank 0 hosts the rendezvous store on ``listener`` (from ``listen``), or on a socket it binds to
    ``master_addr:master_port``; either way only that address listens, and gloo binds the interface
    that holds it."""
    if world_size != parallel.world_size:
        raise ValueError(f"world size {world_size} does not match parallel config (tensor*data = {parallel.world_size})")
    megatron_import.load()
    cpu_shims.apply()
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count())))
        timeout = timedelta(minutes=30)
        bind_gloo_to(master_addr)
        store = rendezvous(master_addr, master_port, world_size, rank, timeout, listener)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=parallel.tensor,
            pipeline_model_parallel_size=1,
            expert_model_parallel_size=parallel.expert,
        )
    cpu_shims.init_rng_tracker()


def shutdown() -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def tp_rank_size() -> tuple[int, int]:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()


def free_port() -> int:
    """A port free on loopback now (a test's single-rank group; ``listen`` has no race)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listen(host: str, port: int = 0) -> socket.socket:
    """A TCP socket listening on ``host`` only (port 0: any free one): what a rendezvous store's
    host hands to ``rendezvous``. torch's TCPStore binds every interface when it opens its own."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, port))
    s.listen(512)
    return s


def rendezvous(host: str, port: int, world_size: int, rank: int, timeout: timedelta, listener: socket.socket | None = None) -> dist.TCPStore:
    """The TCPStore of a group: rank 0 serves it on ``listener`` (or a new one on ``host:port``),
    the others connect to ``host:port``."""
    if rank != 0:
        return dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    listener = listener or listen(host, port)
    port = listener.getsockname()[1]
    # the store takes the descriptor over (detach: the socket object must not close it when collected)
    return dist.TCPStore(host, port, world_size, is_master=True, timeout=timeout, wait_for_workers=False, master_listen_fd=listener.detach())


def bind_gloo_to(host: str) -> None:
    """Make gloo's pairs listen on this node's interface toward ``host`` (the group's rendezvous
    address: on rank 0's node, the interface holding it; on another node, the one its route leaves
    by) through GLOO_SOCKET_IFNAME (a value the user set is kept). Without it gloo binds whatever the
    machine's hostname resolves to."""
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return
    import psutil

    interfaces = psutil.net_if_addrs()
    local = host
    if not any(a.address.split("%")[0] == host for addrs in interfaces.values() for a in addrs):
        try:
            with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect((host, 9))  # UDP: picks the route, sends nothing
                local = probe.getsockname()[0]
        except OSError:
            return
    for name, addrs in interfaces.items():
        if any(a.address.split("%")[0] == local for a in addrs):
            os.environ["GLOO_SOCKET_IFNAME"] = name
            return


class GatherVocabShards(torch.autograd.Function):
    """All-gather the vocab-parallel output weight; backward keeps this rank's rows.

    Every tensor-parallel rank computes the same loss from the same hidden states, so each already
    holds the full weight's gradient; its shard's gradient is its slice, not a sum over ranks.
    Costs one full [V, H] weight per rank: fine for the models this runs today; a vocab-parallel
    kernel (reduce max and sum-exp over the group) is the scalable replacement.
    """

    @staticmethod
    def forward(ctx, shard, group, rank, size):
        parts = all_gather_parts(shard, size, group)
        ctx.rank, ctx.rows = rank, shard.shape[0]
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad):
        return grad[ctx.rank * ctx.rows : (ctx.rank + 1) * ctx.rows], None, None, None


def all_gather_parts(t: torch.Tensor, size: int, group) -> list[torch.Tensor]:
    """Every rank's ``t`` over ``group`` (of ``size`` ranks), in rank order."""
    parts = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return parts
