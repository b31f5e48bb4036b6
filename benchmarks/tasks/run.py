"""Base accuracy of SmolLM2-135M-Instruct per word-problem level (rollout/word_problems.py).

    .venv/bin/python -m benchmarks.tasks.run [--levels 1,2,3,4] [--prompts 48] [--k 4] [--max-new-tokens 192]

For each level: the held-out split's first ``--prompts`` problems, ``--k`` samples each at
temperature 1 with the hf engine (fp32, one process), scored with the literal reward after the
task's marker ("The answer is"), last number as fallback. Prints n, mean@k, pass@k, the share of
responses that reached the marker, mean/median response tokens and the truncation rate.
"""

from __future__ import annotations

import argparse
import time


def measure(level: int, prompts: int, k: int, max_new_tokens: int, engine, batch: int) -> dict:
    from controller.eval_metrics import summarize
    from rollout.engine import SamplingParams
    from rollout.rewards import LiteralNumberReward
    from rollout.word_problems import word_problem_split

    reward = LiteralNumberReward()
    problems = word_problem_split("test", prompts, level)
    sampled, lengths, truncated, marked = [], [], [], []
    started = time.perf_counter()
    for first in range(0, len(problems), batch):
        chunk = problems[first : first + batch]
        ids = [engine.chat_prompt(p.prompt) for p in chunk]
        params = SamplingParams(n=k, max_new_tokens=max_new_tokens, temperature=1.0, prompt_seeds=tuple(range(first, first + len(chunk))))
        for problem, group in zip(chunk, engine.generate(ids, params)):
            scores = []
            for c in group:
                verdict = reward.compare(engine.tokenizer.decode(c.response_ids, skip_special_tokens=True), problem.ground_truth)
                scores.append(verdict.score)
                lengths.append(len(c.response_ids))
                truncated.append(c.finish_reason == "length")
                marked.append(verdict.marker not in (None, "last number"))
            sampled.append(scores)
    return {"level": level, "seconds": time.perf_counter() - started, **summarize(sampled, [1, k], lengths, truncated, marked)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--levels", default="1,2,3,4")
    parser.add_argument("--prompts", type=int, default=48)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=192)
    parser.add_argument("--batch", type=int, default=8, help="prompts per engine call")
    args = parser.parse_args()

    from rollout.hf_engine import HFEngine
    from rollout.offline_model import materialize_smollm2

    engine = HFEngine(str(materialize_smollm2()), precision="fp32", num_threads=2)
    print(f"SmolLM2-135M-Instruct, hf fp32, temperature 1, k={args.k}, <= {args.max_new_tokens} new tokens")
    print("| level | steps / ops / numbers | n | mean@k | pass@k | marker | tokens mean / median | truncated | s |")
    print("|---|---|---|---|---|---|---|---|---|")
    from rollout.word_problems import LEVELS

    for level in map(int, args.levels.split(",")):
        r = measure(level, args.prompts, args.k, args.max_new_tokens, engine, args.batch)
        spec = LEVELS[level]
        print(f"| {level} | {spec.steps} / {spec.ops} / <= {spec.max_number} | {r['prompts']} | {r['mean_at_k']:.3f} | {r[f'pass_at_{args.k}']:.3f} | "
              f"{r['answer_marker_frac']:.2f} | {r['response_tokens_mean']:.0f} / {r['response_tokens_median']:.0f} | {r['truncated_frac']:.2f} | {r['seconds']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
