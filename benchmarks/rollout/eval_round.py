"""One evaluation round of the embedded default, as the hf engine runs it and without each of its two prefill savings (from the repo root):

    .venv/bin/python -m benchmarks.rollout.eval_round [--rounds 2] [--rows 64]

The default's three eval sets (heldout 128, wording 64, range 64 prompts), generated as the rollout
worker does (n = 1, the preset's max_new_tokens and temperature, max_batch_prompts x
rollout.max_eval_rows prompts per engine call) by the hf engine at the precision ``precision: auto``
picks on this CPU, with its threads. ``shared prefix``: the tokens every prompt of a call starts
with (the chat template's system turn) are prefilled once per call; ``whole prompts``: each prompt
is prefilled whole. The two alternate in one process on one engine, so both see the same machine;
the samples are seeded per prompt, so both draw the same tokens unless a logit's last bits flip one.
``all prompt logits``: the prefill projects every prompt position onto the vocabulary, not only the
last one (which is all sampling needs). ``calls of N rows``: the engine as it runs, with N
prompts per call (``--rows``; 64 is a training call's rows, what ``rollout.max_eval_rows``
None gives). The modes alternate in one process on one engine.
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2, help="rounds of each mode, alternating")
    parser.add_argument("--rows", default="64", help="comma-separated prompts per call to compare with the preset's ('' for none)")
    args = parser.parse_args()

    import torch

    from controller.config import load_config
    from controller.hardware import resolve_precision
    from rollout.engine import SamplingParams
    from rollout.hf_engine import HFEngine
    from rollout.offline_model import materialize_smollm2
    from rollout.tasks import arithmetic_split

    cfg = resolve_precision(load_config())
    rollout, task = cfg.rollout, cfg.task
    torch.set_num_threads(rollout.threads)
    engine = HFEngine(str(materialize_smollm2()), precision=rollout.precision)
    sizes = {"heldout": task.test_size, "wording": task.extra_eval_size, "range": task.extra_eval_size}
    problems = [p for name, size in sizes.items() for p in arithmetic_split(name, size, task.seed, task.max_operand)]
    prompts = [engine.chat_prompt(p.chat_messages()) for p in problems]
    per_call = rollout.max_eval_rows or rollout.max_batch_prompts * rollout.samples_per_prompt

    def split(rows: int) -> list[list[str]]:
        return [prompts[i : i + rows] for i in range(0, len(prompts), rows)]

    calls = split(per_call)
    temperature = cfg.eval.temperature or rollout.temperature

    keep_last = engine._last_logits
    modes = {"engine as it runs": (True, keep_last, per_call), "whole prompts": (False, keep_last, per_call),
             "all prompt logits": (True, {}, per_call)}
    modes.update({f"calls of {rows} rows": (True, keep_last, rows) for rows in map(int, filter(None, args.rows.split(","))) if rows != per_call})

    def one_round(mode: str) -> tuple[float, list[list[int]]]:
        engine.share_prefix, engine._last_logits, rows = modes[mode]
        began = time.perf_counter()
        calls = split(rows)
        out = []
        for c, call in enumerate(calls):
            params = SamplingParams(n=1, max_new_tokens=rollout.max_new_tokens, temperature=temperature, seed=1000 + c)
            out += [g[0].response_ids.tolist() for g in engine.generate(call, params)]
        return time.perf_counter() - began, out

    engine.generate(calls[0][:2], SamplingParams(n=1, max_new_tokens=2))  # warm-up
    seconds = {mode: [] for mode in modes}
    samples = {}
    for _ in range(args.rounds):
        for mode in modes:
            s, samples[mode] = one_round(mode)
            seconds[mode].append(s)
    engine.share_prefix, engine._last_logits, _ = modes["engine as it runs"]
    prefix = engine._shared_prefix(calls[0])
    print(f"One evaluation round of the default: {len(prompts)} prompts in {len(calls)} calls of <= {per_call}, hf engine "
          f"{rollout.precision}, {rollout.threads} threads, <= {rollout.max_new_tokens} new tokens; median of {args.rounds} alternating rounds")
    print(f"  prompt tokens {statistics.mean(map(len, prompts)):.1f} mean, {prefix} shared by every prompt of a call")
    base = statistics.median(seconds["engine as it runs"])
    for mode in modes:
        median = statistics.median(seconds[mode])
        same = sum(a == b for a, b in zip(samples[mode], samples["engine as it runs"]))
        alike = f"; {same} of {len(prompts)} samples equal to its" if modes[mode][2] == per_call else " (other calls draw other samples)"
        print(f"  {mode:18} {median:6.1f} s  ({', '.join(f'{s:.1f}' for s in seconds[mode])})  x{median / base:.2f} of the engine's time{alike}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
