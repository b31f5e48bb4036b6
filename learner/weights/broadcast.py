"""Weight broadcast from the learner to rollout engines over a dedicated process group.

The group holds the learner's first rank (rank 0, the publisher) and one rank per engine worker,
and is separate from the learner's training group: a TCPStore rendezvous and a ProcessGroupNCCL
on GPU (tensors move GPU to GPU) or ProcessGroupGloo on CPU, built directly so neither side has to
join the other's default torch.distributed world. Each WeightBucket is sent as three broadcasts:
the metadata length, the metadata (JSON: version, index, last, names, dtypes, shapes) and one flat
byte buffer of all its tensors, so a bucket costs three collectives whatever its tensor count.
NCCL is used only when every member holds a CUDA device of its own: NCCL refuses two ranks on one
GPU ("Duplicate GPU detected"), so a learner and an engine sharing a GPU (fractional GPUs), or a
member on the CPU, make the group gloo, through host memory. Every member decides alike, from the
devices all of them post to the rendezvous store.
Sends are asynchronous with one bucket in flight: the publisher exports and packs bucket k+1 while
bucket k travels, and the receiver takes each tensor as a view of its bucket's buffer (no copy).
"""

from __future__ import annotations

import json
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from learner.distributed import bind_gloo_to, rendezvous
from learner.weights.wire import WeightBucket


class WeightBroadcastGroup:
    def __init__(
        self, host: str, port: int, rank: int, world_size: int, backend: str | None = None, timeout_s: float = 600.0, listener=None,
    ):
        """Join the group; rank 0 hosts the rendezvous store on ``host:port`` (on ``listener``, a
        socket from ``learner.distributed.listen``, if given). All ranks must call."""
        self.rank, self.world_size = rank, world_size
        self._in_flight: list = []
        self.timeout = timeout = timedelta(seconds=timeout_s)
        bind_gloo_to(host)
        self._store = rendezvous(host, port, world_size, rank, timeout, listener)
        self.backend = backend or choose_backend(self._exchange_devices())
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")
        if self.backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout  # NCCL's own default is 10 minutes
            self._pg = dist.ProcessGroupNCCL(self._store, rank, world_size, options)
        else:
            self._pg = dist.ProcessGroupGloo(self._store, rank, world_size, timeout)

    def _exchange_devices(self) -> list[str]:
        """Every member's device (``device_id``), posted to and read from the rendezvous store."""
        self._store.set(f"device/{self.rank}", device_id())
        return [self._store.get(f"device/{r}").decode() for r in range(self.world_size)]

    def _broadcast(self, tensor: torch.Tensor):
        """Start one broadcast from rank 0; returns its work (``_finish`` it)."""
        return self._pg.broadcast(tensor, 0)

    def _finish(self, work) -> None:
        """Wait for a broadcast, bounded by the group's timeout (a peer that died raises)."""
        work.wait(self.timeout)
        if self.backend == "nccl":
            torch.cuda.current_stream().synchronize()  # NCCL's wait only orders streams: finish it on the host too

    def close(self) -> None:
        """Leave the group (NCCL: abort the communicator, whose resources a failed peer would keep)."""
        self._in_flight = []
        if self.backend == "nccl" and hasattr(self._pg, "abort"):
            self._pg.abort()
        self._pg = self._store = None

    def send(self, bucket: WeightBucket) -> float:
        """Publisher side (rank 0): start broadcasting one bucket and return (seconds spent); the
        bucket travels while the caller prepares the next one. ``flush`` waits for what is in flight."""
        if self.rank != 0:
            raise RuntimeError("only rank 0 of a WeightBroadcastGroup sends")
        started = time.perf_counter()
        names = list(bucket.tensors)
        meta = {
            "version": bucket.version, "index": bucket.index, "last": bucket.last, "names": names,
            "dtypes": [str(bucket.tensors[n].dtype).removeprefix("torch.") for n in names],
            "shapes": [list(bucket.tensors[n].shape) for n in names],
        }
        offsets, total = _layout(meta)
        flat = torch.empty(total, dtype=torch.uint8, device=self.device)
        for name, offset in zip(names, offsets):
            t = bucket.tensors[name].reshape(-1)
            flat[offset : offset + t.numel() * t.element_size()].view(t.dtype).copy_(t)
        meta_bytes = torch.frombuffer(bytearray(json.dumps(meta).encode()), dtype=torch.uint8)
        self.flush()  # at most one bucket in flight: its buffers are released before the next is sent
        pieces = [torch.tensor([meta_bytes.numel()], dtype=torch.int64).to(self.device), meta_bytes.to(self.device), flat]
        self._in_flight = [(self._broadcast(p), p) for p in pieces]  # the work keeps its tensor alive
        return time.perf_counter() - started

    def flush(self) -> None:
        """Wait until every bucket sent has reached every engine (the group's timeout bounds it)."""
        in_flight, self._in_flight = self._in_flight, []
        for work, _ in in_flight:
            self._finish(work)

    def receive(self) -> WeightBucket:
        """Engine side (rank > 0): receive the next bucket, tensors on this group's device (views
        into one buffer per bucket, aligned so every tensor is a plain typed view; clone one to keep
        it apart from its buffer, or to torch.save it)."""
        length = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._finish(self._broadcast(length))
        meta_bytes = torch.empty(int(length.item()), dtype=torch.uint8, device=self.device)
        self._finish(self._broadcast(meta_bytes))
        meta = json.loads(bytes(meta_bytes.cpu().tolist()).decode())
        offsets, total = _layout(meta)
        flat = torch.empty(total, dtype=torch.uint8, device=self.device)
        self._finish(self._broadcast(flat))
        tensors = {}
        for name, shape, dtype, offset in zip(meta["names"], meta["shapes"], meta["dtypes"], offsets):
            dtype = getattr(torch, dtype)
            n = torch.Size(shape).numel()
            tensors[name] = flat[offset:].view(dtype)[:n].view(shape) if n else torch.empty(shape, dtype=dtype, device=self.device)
        return WeightBucket(meta["version"], meta["index"], meta["last"], tensors)

    def receive_publication(self) -> list[WeightBucket]:
        """Receive buckets until the publication's last one."""
        received = [self.receive()]
        while not received[-1].last:
            received.append(self.receive())
        return received



def device_id() -> str:
    """This process's broadcast device: "cuda:<the GPU's UUID>" (unique across hosts), or "cpu"."""
    if not torch.cuda.is_available():
        return "cpu"
    index = torch.cuda.current_device()
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    return f"cuda:{uuid}" if uuid is not None else f"cuda:{socket.gethostname()}/{index}"


def choose_backend(devices: list[str]) -> str:
    """nccl when every member has a CUDA device and no two share one, else gloo (NCCL refuses two
    ranks on one GPU, and a CPU member cannot join an NCCL group)."""
    cuda = [d for d in devices if d.startswith("cuda:")]
    return "nccl" if len(cuda) == len(devices) and len(set(cuda)) == len(cuda) else "gloo"


class Membership:
    """The broadcast group one process is in: joined again whenever the group is formed again (the
    old group is closed first), and left when one of its collectives fails, so the next formation
    starts clean. A failure that arrives late must not drop a group joined since."""

    def __init__(self):
        self.group: WeightBroadcastGroup | None = None

    def join(self, host: str, port: int, rank: int, world_size: int, timeout_s: float, listener=None) -> None:
        """Close any group held, then join the new one as ``rank`` (all its members call at once;
        rank 0 hosts the rendezvous, on ``listener`` if given)."""
        self.leave()
        self.group = WeightBroadcastGroup(host, port, rank, world_size, timeout_s=timeout_s, listener=listener)

    def leave(self) -> None:
        """Close the group held, if any."""
        old, self.group = self.group, None
        if old is not None:
            old.close()

    def run(self, fn):
        """``fn(group)``; a torch.distributed error (a peer died, a timeout; a RuntimeError) leaves the group and is raised."""
        group = self.group
        if group is None:
            raise RuntimeError("this process is in no weight broadcast group (not joined, or its last collective failed)")
        try:
            return fn(group)
        except RuntimeError:
            if self.group is group:  # a late failure must not drop a group joined since
                self.group = None
            group.close()  # NCCL: abort the communicator a failed peer would hold (closing twice is harmless)
            raise

    def receive_publication(self) -> list[WeightBucket]:
        """Engine side: the next publication's buckets (``run``'s failure handling)."""
        return self.run(WeightBroadcastGroup.receive_publication)


ALIGN_BYTES = 64
"""Every tensor of a bucket's buffer starts at a multiple of this, so the receiver can view it as
its dtype without a copy (64: any dtype's alignment, and a cache line)."""


def _layout(meta: dict) -> tuple[list[int], int]:
    """Byte offset of each tensor of a bucket in its flat buffer, and the buffer's size."""
    offsets, total = [], 0
    for shape, dtype in zip(meta["shapes"], meta["dtypes"]):
        offsets.append(total)
        nbytes = torch.Size(shape).numel() * torch.empty(0, dtype=getattr(torch, dtype)).element_size()
        total += -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES
    return offsets, total
