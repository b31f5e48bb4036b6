"""Weight broadcast from the learner to rollout engines over a dedicated process group.

The group holds the learner's first rank (rank 0, the publisher) and one rank per engine worker,
and is separate from the learner's training group: a TCPStore rendezvous and a ProcessGroupNCCL
on GPU (tensors move GPU to GPU) or ProcessGroupGloo on CPU, built directly so neither side has to
join the other's default torch.distributed world. Each WeightBucket is sent as three broadcasts:
the metadata length, the metadata (JSON: version, index, last, names, dtypes, shapes) and one flat
byte buffer of all its tensors, so a bucket costs three collectives whatever its tensor count.
"""

from __future__ import annotations

import json
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from learner.publish import WeightBucket


class WeightBroadcastGroup:
    def __init__(self, host: str, port: int, rank: int, world_size: int, backend: str | None = None, timeout_s: float = 600.0):
        """Join the group; rank 0 hosts the rendezvous store on ``host:port``. All ranks must call."""
        self.rank, self.world_size = rank, world_size
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")
        self.timeout = timeout = timedelta(seconds=timeout_s)
        self._store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout)
        if self.backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout  # NCCL's own default is 10 minutes
            self._pg = dist.ProcessGroupNCCL(self._store, rank, world_size, options)
        else:
            self._pg = dist.ProcessGroupGloo(self._store, rank, world_size, timeout)

    def _broadcast(self, tensor: torch.Tensor) -> None:
        """One broadcast from rank 0, bounded by the group's timeout (a peer that died raises)."""
        self._pg.broadcast(tensor, 0).wait(self.timeout)
        if self.backend == "nccl":
            torch.cuda.current_stream().synchronize()  # NCCL's wait only orders streams: finish it on the host too

    def close(self) -> None:
        """Leave the group (NCCL: abort the communicator, whose resources a failed peer would keep)."""
        if self.backend == "nccl" and hasattr(self._pg, "abort"):
            self._pg.abort()
        self._pg = self._store = None

    def send(self, bucket: WeightBucket) -> float:
        """Publisher side (rank 0): broadcast one bucket; returns seconds spent."""
        if self.rank != 0:
            raise RuntimeError("only rank 0 of a WeightBroadcastGroup sends")
        started = time.perf_counter()
        names = list(bucket.tensors)
        meta = {
            "version": bucket.version, "index": bucket.index, "last": bucket.last, "names": names,
            "dtypes": [str(bucket.tensors[n].dtype).removeprefix("torch.") for n in names],
            "shapes": [list(bucket.tensors[n].shape) for n in names],
        }
        meta_bytes = torch.frombuffer(bytearray(json.dumps(meta).encode()), dtype=torch.uint8)
        self._broadcast(torch.tensor([meta_bytes.numel()], dtype=torch.int64, device=self.device))
        self._broadcast(meta_bytes.to(self.device))
        flat = torch.cat([bucket.tensors[n].contiguous().reshape(-1).view(torch.uint8) for n in names]) if names else torch.empty(0, dtype=torch.uint8)
        self._broadcast(flat.to(self.device))
        return time.perf_counter() - started

    def receive(self) -> WeightBucket:
        """Engine side (rank > 0): receive the next bucket, tensors on this group's device."""
        length = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._broadcast(length)
        meta_bytes = torch.empty(int(length.item()), dtype=torch.uint8, device=self.device)
        self._broadcast(meta_bytes)
        meta = json.loads(bytes(meta_bytes.cpu().tolist()).decode())
        dtypes = [getattr(torch, d) for d in meta["dtypes"]]
        sizes = [int(torch.Size(s).numel()) * torch.empty(0, dtype=d).element_size() for s, d in zip(meta["shapes"], dtypes)]
        flat = torch.empty(sum(sizes), dtype=torch.uint8, device=self.device)
        self._broadcast(flat)
        tensors, offset = {}, 0
        for name, shape, dtype, size in zip(meta["names"], meta["shapes"], dtypes, sizes):
            # clone: independent tensors a consumer may keep, instead of typed views of one buffer
            tensors[name] = flat[offset : offset + size].view(dtype).reshape(shape).clone()
            offset += size
        return WeightBucket(meta["version"], meta["index"], meta["last"], tensors)

    def receive_publication(self) -> list[WeightBucket]:
        """Receive buckets until the publication's last one."""
        received = [self.receive()]
        while not received[-1].last:
            received.append(self.receive())
        return received
