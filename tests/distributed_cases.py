"""Multi-rank cases run in fresh processes (torch.multiprocessing.spawn) by test_learner_parallel.py.

Each process joins a gloo group of ``world`` ranks, builds a Learner from full megatron weights in
``data_path`` and writes rank 0's results to ``out_path``.
"""

from __future__ import annotations

import torch


def run(rank: int, world: int, port: int, case: str, data_path: str, out_path: str) -> None:
    torch.set_num_threads(1)
    from learner import distributed
    from learner.config import LearnerConfig, OptimizerConfig, ParallelConfig
    from learner.batch import TrainBatch
    from learner.learner import Learner
    from learner.model import ModelArch

    data = torch.load(data_path, weights_only=True)
    arch = ModelArch(**data["arch"])
    if case == "tp":
        parallel = ParallelConfig(tensor=world)
    else:
        parallel = ParallelConfig(data=world, expert=world)
    cfg = LearnerConfig(parallel=parallel, optimizer=OptimizerConfig(lr=1e-3, grad_clip=None), micro_batch_size=8)
    distributed.init(parallel, rank, world, master_port=port)
    learner = Learner(cfg, arch, data["weights"])
    out = {}
    if case == "tp":
        stats = learner.compute_logprobs(data["input_ids"])
        out["logp"], out["entropy"] = stats.logp, stats.entropy
        batch = TrainBatch(data["input_ids"], data["mask"], stats.logp.detach(), data["advantages"])
        metrics = learner.train(batch)
        out["loss"], out["grad_norm"] = metrics.loss, metrics.grad_norm
        out["logp_after"] = learner.compute_logprobs(data["input_ids"]).logp
        out["weights"] = learner.full_megatron_state()  # every rank gathers; rank 0 writes
    else:
        n = data["input_ids"].shape[0] // world
        part = slice(rank * n, (rank + 1) * n)
        batch = TrainBatch(data["input_ids"][part], data["mask"][part], data["rollout_logp"][part], data["advantages"][part])
        metrics = learner.train(batch)
        out["loss"], out["grad_norm"], out["tokens"] = metrics.loss, metrics.grad_norm, metrics.tokens
        out["weights"] = learner.full_megatron_state()  # every rank gathers; rank 0 writes
    # every rank's checkpoint part, for the offline merge (learner/export.py)
    learner.save_checkpoint(f"{out_path}.ckpt/learner-rank{rank:05d}.pt")
    if rank == 0:
        torch.save(out, out_path)
    distributed.shutdown()


def broadcast(rank: int, world: int, port: int, data_path: str, out_path: str) -> None:
    """Rank 0 publishes the buckets in data_path over a WeightBroadcastGroup; rank 1 receives."""
    from learner.weights import wire
    from learner.weights.broadcast import WeightBroadcastGroup

    data = torch.load(data_path, weights_only=True)
    group = WeightBroadcastGroup("127.0.0.1", port, rank, world)
    if rank == 0:
        for bucket in wire.buckets(data["weights"].items(), version=data["version"], max_bytes=data["max_bytes"]):
            group.send(bucket)
        group.flush()
    else:
        version, merged = wire.assemble(group.receive_publication())
        # the received tensors are typed views of one buffer per bucket, which torch.save refuses
        torch.save({"version": version, "weights": {n: t.clone() for n, t in merged.items()}, "backend": group.backend}, out_path)
