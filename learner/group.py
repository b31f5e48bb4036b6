"""LearnerGroup: a placement group of LearnerWorker actors that act as one learner.

It places N = tensor * data workers (one bundle each, PACK: a multi-GPU node first),
starts the process group on rank 0's address, splits each batch across data-parallel ranks and fans
calls out. Data-parallel rank r (ranks are tensor-major, as megatron orders them) gets the r-th
contiguous slice of the batch's sequences.
"""

from __future__ import annotations

import ray
import torch

from learner.host import check_host
from learner import actor_pool
from learner.placement import role_bundle
from learner.weights.wire import DEFAULT_BUCKET_BYTES, Publication
from learner.config import LearnerConfig, LearnerResources
from learner.batch import TrainBatch
from learner.learner import StepMetrics
from learner.worker import LearnerWorker


SHUTDOWN_SECONDS = 10.0
"""How long shutdown waits for the ranks to leave their process groups before killing them."""


class LearnerTimeout(RuntimeError):
    """A learner call did not finish within its deadline; the message names the call and the ranks."""


def late_refs(refs: list) -> list[int]:
    """The positions of ``refs`` not done yet (after a bounded ``ray.get`` timed out)."""
    done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
    return [i for i, ref in enumerate(refs) if ref not in done]


def _get(refs: list, call: str, timeout: float | None):
    """``ray.get(refs)`` bounded by ``timeout`` seconds (None: unbounded); LearnerTimeout names the
    ranks that had not answered."""
    try:
        return ray.get(refs, timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        raise LearnerTimeout(f"learner {call} did not finish within {timeout:g} s (ranks {late_refs(refs)} had not answered)") from None


class LearnerGroup:
    def __init__(self, cfg: LearnerConfig, resources: LearnerResources, model_folder: str, *, wait: bool = True):
        """Use ``build``."""
        self.cfg = cfg
        n = cfg.parallel.world_size
        per_rank = resources.cpus_per_worker
        bundle = role_bundle(per_rank, resources.gpus_per_worker, resources.node_resource)
        p = cfg.parallel
        self._placed = actor_pool.place(
            LearnerWorker, [bundle] * n, "PACK",
            f"the learner group ({n} ranks: learner.parallel tensor {p.tensor} x data {p.data}, each learner_resources {bundle})",
            {"num_cpus": per_rank, "num_gpus": resources.gpus_per_worker}, [((cfg, i, n, resources.threads), {}) for i in range(n)],
        )
        self.pg, self.workers = self._placed.pg, self._placed.actors
        # rank 0's rendezvous goes to every rank as an object ref, not through this process: the
        # constructor returns while the ranks' processes still start (other actors start meanwhile)
        rendezvous = self.workers[0].address.remote()
        self._setup = [w.setup.remote(rendezvous, str(model_folder)) for w in self.workers]
        if wait:
            self.ready()

    @classmethod
    def build(cls, config: LearnerConfig, *, model_folder: str, resources: LearnerResources | None = None, wait: bool = True) -> "LearnerGroup":
        """A learner group of ``config.parallel.world_size`` ranks, each placed as ``resources`` say
        (default: one CPU, one thread), loading the HF model in ``model_folder``. ``wait=False``:
        return once the placement group is reserved and the ranks' processes are starting;
        ``ready()`` waits for them (so other actors can load meanwhile)."""
        LearnerConfig.expect(config, "LearnerGroup")
        resources = LearnerResources.expect(resources or LearnerResources(), "LearnerGroup (resources)")
        return cls(config, resources, model_folder, wait=wait)

    def ready(self, timeout: float | None = None) -> None:
        """Wait (up to ``timeout`` seconds: LearnerTimeout) until every rank has joined the process
        group and loaded the model."""
        if self._setup:
            _get(self._setup, "setup (joining the process group, loading the model)", timeout)
            self._setup = []

    def _dp_rank(self, rank: int) -> int:
        return rank // self.cfg.parallel.tensor

    def train(self, batch: TrainBatch, mini_batches: int = 1, epochs: int = 1) -> StepMetrics:
        """``batch`` trained as ``epochs`` passes of ``mini_batches`` updates, each split across
        data-parallel ranks (``submit_train``, waited for); rank 0's metrics (already reduced across ranks)."""
        return check_host(ray.get(self.submit_train(batch, mini_batches, epochs)[0]), "train")

    def submit_train(self, batch: TrainBatch, mini_batches: int = 1, epochs: int = 1) -> list:
        """Start ``epochs`` passes of ``mini_batches`` updates on consecutive slices of ``batch``
        (each split across data-parallel ranks); returns one ref per rank to its StepMetrics."""
        per_rank = list(zip(*(mb.split(self.cfg.parallel.data) for mb in batch.split(mini_batches))))
        return [w.train.remote(list(per_rank[self._dp_rank(i)]), epochs) for i, w in enumerate(self.workers)]

    def compute_logprobs(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Log-probs of every sequence (each data-parallel rank computes its slice)."""
        dp = self.cfg.parallel.data
        chunks = torch.tensor_split(input_ids, dp)
        outs = check_host(ray.get([w.compute_logprobs.remote(chunks[self._dp_rank(i)]) for i, w in enumerate(self.workers)]), "compute_logprobs")
        return torch.cat([outs[r * self.cfg.parallel.tensor].logp for r in range(dp)])

    def publish(self, max_bytes: int = DEFAULT_BUCKET_BYTES, dtype: str | None = None, timeout: float | None = None) -> Publication:
        """The current weights through the object store; ``dtype`` (torch dtype name): the engines'
        weight dtype (None: the learner's own)."""
        return _get([w.publish.remote(max_bytes, dtype) for w in self.workers], "publish", timeout)[0]

    def join_broadcast(self, host: str, port: int, world_size: int, timeout_s: float) -> list:
        """Start the learner's side of a weight broadcast group of ``world_size`` (1 + engine ranks),
        hosted on ``host:port`` (rank 0's node); the engines must join with ranks 1.. meanwhile.
        Returns the ranks' refs (wait for them together with the engines')."""
        return [w.join_broadcast.remote(host, port, world_size, timeout_s) for w in self.workers]

    def broadcast(self, max_bytes: int = DEFAULT_BUCKET_BYTES, dtype: str | None = None) -> list:
        """Start sending the current weights over the group; returns the ranks' refs (rank 0's
        resolves to the Publication, with ``error`` set if the broadcast failed)."""
        return [w.broadcast.remote(max_bytes, dtype) for w in self.workers]

    def hf_state(self) -> dict[str, torch.Tensor]:
        """The full weights under HF names (every rank takes part in the gathers; rank 0's copy)."""
        return check_host(ray.get([w.hf_state.remote() for w in self.workers])[0], "hf_state")

    def check_storage(self, run_dir: str | list[str], nonce: str) -> list[dict]:
        """Every rank's view of the driver's storage marker in ``run_dir`` (one path, or one per rank)."""
        paths = [run_dir] * len(self.workers) if isinstance(run_dir, str) else run_dir
        return ray.get([w.check_storage.remote(p, nonce) for w, p in zip(self.workers, paths)])

    def save_checkpoint(self, folder: str, timeout: float | None = None) -> list[str]:
        return _get([w.save_checkpoint.remote(folder) for w in self.workers], f"save_checkpoint into {folder}", timeout)

    def load_checkpoint(self, folder: str, timeout: float | None = None) -> None:
        _get([w.load_checkpoint.remote(folder) for w in self.workers], f"load_checkpoint from {folder}", timeout)

    def shutdown(self, timeout: float | None = SHUTDOWN_SECONDS) -> None:
        """Leave the process groups and stop every rank; a rank still busy after ``timeout`` seconds
        (a step in flight when the run is stopped at once) is killed."""
        clean = False
        try:
            ray.get([w.shutdown.remote() for w in self.workers], timeout=timeout)
            clean = True
        except (ray.exceptions.GetTimeoutError, ray.exceptions.RayTaskError):
            pass
        finally:
            actor_pool.release(self._placed, clean)  # killed, or kept for the driver's next run
