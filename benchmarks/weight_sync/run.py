"""Weight sync, object store vs broadcast, side by side:

    python -m benchmarks.weight_sync.run [--rounds 5] [--engine hf|vllm] [--precision fp32|bf16]

SmolLM2-135M, one learner rank and two rollout workers per transport (two RayBackends on one local
Ray cluster, the same config but ``learner.weight_sync``). Each round: one real optimizer step on a
synthetic batch in each backend, then ``publish(wait=True)`` — seconds from the end of the optimizer
step until every worker serves the new version (``worker_version`` says so) — alternating which
transport goes first. Prints the medians and broadcast / object store.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def backend_for(transport: str, engine: str, precision: str, run_dir: str):
    from controller.config import load_config
    from controller.ray_backend import RayBackend

    cfg = load_config(overrides=[
        f"run_dir={run_dir}", f"rollout.engine={engine}", f"rollout.precision={precision}", "rollout.workers=2",
        "rollout.cpus_per_worker=0.5", "learner_resources.cpus_per_worker=0.5", "learner.precision=fp32",
        f"learner.weight_sync={transport}", *(["rollout.kv_cache_gib=0.5"] if engine == "vllm" else []),
    ])
    return RayBackend.build(cfg)


def step(backend, seed: int) -> None:
    from learner.batch import TrainBatch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 49152, (4, 32), generator=g)
    mask = torch.zeros(4, 32, dtype=torch.bool)
    mask[:, 16:] = True
    rollout = backend.learner.compute_logprobs(ids)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])[:, None].expand(4, 32).contiguous()
    backend.learner.train(TrainBatch(ids, mask, rollout, adv))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--engine", default="hf", choices=("hf", "vllm"))
    parser.add_argument("--precision", default="bf16", choices=("fp32", "bf16"))
    args = parser.parse_args()

    import tempfile

    from controller.network import init_ray

    init_ray(num_cpus=4)
    seconds: dict[str, list[float]] = {"object_store": [], "broadcast": []}
    nbytes = {}
    with tempfile.TemporaryDirectory() as tmp:
        backends = {t: backend_for(t, args.engine, args.precision, f"{tmp}/{t}") for t in seconds}
        try:
            for r in range(1, args.rounds + 1):
                order = list(seconds) if r % 2 else list(reversed(seconds))
                for transport in order:
                    backend = backends[transport]
                    step(backend, r)
                    began = time.perf_counter()
                    report = backend.publish(r, wait=True)
                    assert all(backend.worker_version(w) == r for w in range(backend.workers)), transport
                    seconds[transport].append(time.perf_counter() - began)
                    nbytes[transport] = report.nbytes
        finally:
            for b in backends.values():
                b.shutdown()
    med = {t: statistics.median(v[1:] if len(v) > 2 else v) for t, v in seconds.items()}  # round 1 warms up
    print(f"SmolLM2-135M, {args.engine} workers ({args.precision}), 2 workers, {args.rounds} rounds (first dropped)")
    for t in seconds:
        print(f"  {t:12s} {med[t]:.3f} s  ({nbytes[t] / 2**20:.0f} MiB)  all: {', '.join(f'{x:.2f}' for x in seconds[t])}")
    print(f"  broadcast / object_store: {med['broadcast'] / med['object_store']:.2f}")


if __name__ == "__main__":
    main()
