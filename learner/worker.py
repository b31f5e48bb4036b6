"""Ray actors around the Learner: thin; every method takes and returns typed data."""

from __future__ import annotations

import dataclasses
import os
import time

import ray
import torch

from cpu.allocator import keep_freed_memory
from learner import checkpoint, distributed
from learner.weights import wire
from learner.weights.broadcast import Membership
from learner.config import LearnerConfig
from learner.host import to_host
from learner.batch import TrainBatch
from learner.learner import Learner, StepMetrics
from objectives.logprobs import TokenLogProbs


class LearnerWorker:
    """One learner rank in its own process. Create with ``ray.remote(LearnerWorker)``."""

    def __init__(self, cfg: LearnerConfig, rank: int, world_size: int, num_threads: int = 1):
        self.cfg = LearnerConfig.expect(cfg, "LearnerWorker")
        self.rank, self.world_size = rank, world_size
        torch.set_num_threads(num_threads)
        if not torch.cuda.is_available():
            keep_freed_memory()  # a CPU step reuses the last one's pages instead of faulting them in again
        self.learner: Learner | None = None
        self._broadcast = Membership()
        self._listener = None
        """The socket ``address`` opened, for the group rank 0 hosts next (``setup`` or ``join_broadcast``)."""

    def address(self) -> tuple[str, int]:
        """Where rank 0 will host the next group's rendezvous (called on rank 0 only): a socket on
        this node's address only (loopback on a local cluster), listening until that group takes it."""
        if self._listener is not None:
            self._listener.close()
        host = ray.util.get_node_ip_address()
        self._listener = distributed.listen(host)
        return host, self._listener.getsockname()[1]

    def _take_listener(self):
        listener, self._listener = self._listener, None
        return listener

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def check_storage(self, run_dir: str, nonce: str) -> dict:
        """What this rank sees of the driver's marker in ``run_dir`` (learner.checkpoint.storage_probe)."""
        return {**checkpoint.storage_probe(run_dir, self.rank, nonce), "node": self.node_id()}

    def setup(self, rendezvous: tuple[str, int], model_folder: str) -> None:
        """Join the process group hosted at ``rendezvous`` (rank 0's ``address``) and load the
        model; every rank must call this concurrently."""
        master_addr, master_port = rendezvous
        distributed.init(self.cfg.parallel, self.rank, self.world_size, master_addr, master_port, self._take_listener())
        self.learner = Learner.build(self.cfg, model_folder=model_folder)

    def train(self, mini_batches: list[TrainBatch], epochs: int = 1) -> StepMetrics:
        """One rollout batch (this rank's slice of each mini-batch): Learner.train."""
        return to_host(self.learner.train(mini_batches, epochs))

    def compute_logprobs(self, input_ids: torch.Tensor) -> TokenLogProbs:
        return to_host(self.learner.compute_logprobs(input_ids))

    def _send_buckets(self, max_bytes: int, send, dtype: str | None = None) -> wire.Publication | None:
        """Stream the weights as buckets through ``send`` on rank 0; every other rank only takes
        part in the tensor-parallel gathers, which happen lazily, layer by layer. ``dtype`` (a
        torch dtype name, e.g. "bfloat16"): the engines' weight dtype, cast to before sending."""
        started = time.perf_counter()
        named = self.learner.hf_named_tensors()
        if dtype is not None and self.rank == 0:
            cast = getattr(torch, dtype)
            named = ((name, t.to(cast)) for name, t in named)
        if self.rank != 0:
            for _ in named:
                pass
            return None
        refs, nbytes = [], 0
        for bucket in wire.buckets(named, self.learner.version, max_bytes):
            ref = send(bucket)
            if ref is not None:
                refs.append(ref)
            nbytes += bucket.nbytes
        return wire.Publication(self.learner.version, refs, nbytes, time.perf_counter() - started)

    def publish(self, max_bytes: int, dtype: str | None = None) -> wire.Publication | None:
        """Put the weights in the object store (rank 0), as ``dtype``; the Publication carries the refs."""
        return self._send_buckets(max_bytes, ray.put, dtype)

    def join_broadcast(self, host: str, port: int, world_size: int, timeout_s: float = 600.0) -> None:
        """Rank 0 joins a weight broadcast group with the engines as its rank 0 (hosting its store);
        the other ranks only leave any group they had. A group formed again replaces the old one."""
        if self.rank == 0:
            self._broadcast.join(host, port, 0, world_size, timeout_s, self._take_listener())
        else:
            self._broadcast.leave()

    def broadcast(self, max_bytes: int, dtype: str | None = None) -> wire.Publication | None:
        """Send the current weights to the engines over the broadcast group (GPU: NCCL), as ``dtype``.
        A collective that fails or times out (an engine died) leaves the group: the Publication
        carries the error, and the caller forms a new group before the next broadcast."""
        if self.rank != 0:
            return self._send_buckets(max_bytes, None, dtype)  # ranks > 0 only take part in the gathers

        def publication(group) -> wire.Publication:
            sent = self._send_buckets(max_bytes, group.send, dtype)
            group.flush()  # the last bucket has reached every engine
            return dataclasses.replace(sent, seconds=time.perf_counter() - started)

        started = time.perf_counter()
        try:
            return self._broadcast.run(publication)
        except RuntimeError as err:  # torch.distributed's errors (a peer died, a timeout), or no group
            return wire.Publication(self.learner.version, [], 0, time.perf_counter() - started, error=f"{type(err).__name__}: {err}")

    def hf_state(self) -> dict[str, torch.Tensor]:
        """This rank's current weights under HF names (tests and consumers check against it)."""
        return to_host(dict(self.learner.hf_named_tensors()))

    def save_checkpoint(self, folder: str) -> str:
        path = os.path.join(folder, f"learner-rank{self.rank:05d}.pt")
        self.learner.save_checkpoint(path)
        return path

    def load_checkpoint(self, folder: str) -> None:
        self.learner.load_checkpoint(os.path.join(folder, f"learner-rank{self.rank:05d}.pt"))

    def shutdown(self) -> None:
        distributed.shutdown()
