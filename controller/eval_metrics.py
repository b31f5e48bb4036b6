"""Evaluation metrics of one eval set: mean@k, pass@k, greedy accuracy, response lengths, truncation.

pass@k uses the unbiased estimator of Chen et al. 2021 (arXiv 2107.03374, the HumanEval paper):
from n samples of a prompt of which c are correct, pass@k = 1 - C(n-c, k) / C(n, k), the chance
that k samples drawn without replacement from the n include a correct one; averaged over prompts.
mean@k is the mean correctness of k samples per prompt (pass@1 averaged over k samples).
"""

from __future__ import annotations

from math import comb
from statistics import median

from rollout.rewards import FAILURES


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with ``c`` correct among ``n`` samples (k <= n)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def summarize(sampled: list[list[float]], ks: list[int], lengths: list[int], truncated: list[bool], marked: list[bool]) -> dict:
    """One eval set's sampled results: ``sampled`` holds each prompt's score per sample (the built-ins: 0/1;
    mean@k is the mean score, pass@k counts a sample correct when its score is >= 1),
    ``lengths``/``truncated``/``marked`` one entry per sample (response tokens, cut at the length
    limit, answered after a final-answer marker). pass@k is reported for every k of ``ks`` that
    every prompt has enough samples for."""
    scores = [s for prompt in sampled for s in prompt]
    n = min((len(p) for p in sampled), default=0)
    out = {
        "prompts": len(sampled), "samples": len(scores), "mean_at_k": sum(scores) / len(scores) if scores else 0.0, "k": n,
        "response_tokens_mean": sum(lengths) / len(lengths) if lengths else 0.0,
        "response_tokens_median": float(median(lengths)) if lengths else 0.0, "response_tokens_max": max(lengths, default=0),
        "truncated_frac": sum(truncated) / len(truncated) if truncated else 0.0,
        "answer_marker_frac": sum(marked) / len(marked) if marked else 0.0,
    }
    for k in ks:
        if sampled and k <= n:
            out[f"pass_at_{k}"] = sum(pass_at_k(len(p), sum(s >= 1.0 for s in p), k) for p in sampled) / len(sampled)
    return out


def set_summary(groups: list, ks: list[int]) -> dict:
    """One eval set's record from its result groups (rollout.records.Group with EvalTickets):
    sampled groups give mean@k, pass@k and the response statistics, greedy ones ``greedy``
    accuracy; failed groups are counted in ``failed`` and left out of the means. Samples the reward
    could not score (scored 0, or failing their group) are counted by reason in
    ``reward_errors_<reason>`` (FAILURES: error, timeout, invalid, unreachable)."""
    sampled = [g for g in groups if not g.ticket.greedy and g.error is None]
    greedy = [g for g in groups if g.ticket.greedy and g.error is None]
    samples = [s for g in sampled for s in g.samples]
    out = summarize(
        [list(g.scores) for g in sampled], ks, [len(s.completion.response_ids) for s in samples],
        [s.completion.finish_reason == "length" for s in samples], [s.reward.marker not in (None, "last number") for s in samples],
    )
    out["failed"] = sum(g.error is not None for g in groups)
    reasons = [r.reason for g in groups for r in g.reward_errors]
    out.update({f"reward_errors_{why}": reasons.count(why) for why in FAILURES})
    if greedy:
        out["greedy"] = sum(g.scores[0] for g in greedy) / len(greedy)
    episodes = [s.completion.episode for g in sampled + greedy for s in g.samples if s.completion.episode is not None]
    if episodes:  # multi-turn evaluation (rollout.environment): turns and tool calls per episode
        n = len(episodes)
        out.update(turns_mean=sum(e.turns for e in episodes) / n, tool_calls_mean=sum(e.tool_calls for e in episodes) / n,
                   tool_errors_mean=sum(e.tool_errors for e in episodes) / n)
    return out


def engine_calls(groups: list) -> int:
    """The engine calls that generated these groups: their distinct calls, a group without one
    (a simulated backend's) counted alone."""
    return len({g.call for g in groups if g.call is not None}) + sum(g.call is None for g in groups)


def describe_set(start: dict, last: dict) -> str:
    """mean@k, pass@k and greedy accuracy of one eval set, first -> last evaluation, in one line."""
    keys = ["mean_at_k"] + sorted(k for k in last if k.startswith("pass_at_")) + (["greedy"] if "greedy" in last else [])
    label = lambda k: f"mean@{last.get('k', '?')}" if k == "mean_at_k" else k.replace("_at_", "@")  # noqa: E731
    parts = [f"{label(k)} {start[k]:.3f} → {last[k]:.3f}" if k in start else f"{label(k)} {last[k]:.3f}" for k in keys]
    errors = ", ".join(f"{why} {last[f'reward_errors_{why}']}" for why in FAILURES if last.get(f"reward_errors_{why}"))
    turns = f"; {last['turns_mean']:.1f} turns, {last['tool_calls_mean']:.2f} tool calls per episode" if "turns_mean" in last else ""
    return (", ".join(parts) + f"; {last.get('response_tokens_mean', 0):.0f} tokens, {last.get('truncated_frac', 0):.2f} truncated" + turns
            + (f"; reward errors in the last evaluation: {errors}" if errors else ""))
