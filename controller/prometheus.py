"""The Prometheus view of a run's metrics: the catalog of metric families and the HTTP exporter.

Every step's namespaced keys (``gap/numerics/abs_shift_p99``, ``staleness/lag_hist/bin_2``,
``ledger/trained`` …) map to Prometheus families following its conventions: a ``drpo_`` prefix,
base units in the name (``_seconds``, ``_tokens``), ``_ratio`` for fractions, ``_total`` for counters,
and labels instead of name parts for the version lag of a gap metric (``lag="0"`` numerics,
``lag="0-inflight"`` lag-0 tokens of a request an update landed in, ``lag="1+"`` staleness, ``lag="all"``), histogram bins (``bin``) and ledger outcomes (``outcome``).
``gap/*`` is always the learner's pi at consumption against mu from the engine; ``gap/proximal/*``
(pi during the updates against pi at consumption: the batch's own drift, with the decoupled anchor, or
several mini-batches and ``learner.consumption_pass`` on) is its own family, ``drpo_gap_proximal_*``.
``CATALOG`` documents the families dashboards and alerts rely on; any other key is still exported
under its mechanical name. The exporter serves a snapshot of the latest values (a collector, not
client-side gauges, so labels come from the keys).
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    name: str
    kind: str  # "gauge" or "counter"
    help: str


_GAP = {
    "abs_shift_mean": "mean |pi - mu| over sampled tokens", "abs_shift_max": "max |pi - mu|",
    "abs_shift_p50": "median |pi - mu|", "abs_shift_p90": "90th percentile |pi - mu|", "abs_shift_p99": "99th percentile |pi - mu|",
    "kl_k1": "k1 estimate of KL(mu||pi)", "kl_k3": "k3 estimate of KL(mu||pi) (unbiased, >= 0)", "chi2": "chi^2(pi||mu) estimate",
    "ratio_p01": "1st percentile of pi/mu", "ratio_p50": "median pi/mu", "ratio_p99": "99th percentile of pi/mu",
    "ratio_max": "max pi/mu", "beyond_delta_ratio": "fraction of tokens with |pi - mu| > delta",
    "entropy_mean": "learner entropy per token (nats)",
}

CATALOG: dict[str, Family] = {
    **{f"drpo_gap_{k}": Family(f"drpo_gap_{k}", "gauge", f"Off-policy gap, learner pi vs engine mu: {h}; label lag = 0 (numerics), 0-inflight (lag 0, request began under older weights), 1+ (staleness), all") for k, h in _GAP.items()},
    **{
        f"drpo_gap_proximal_{k}": Family(f"drpo_gap_proximal_{k}", "gauge", f"The batch's own drift: {h.replace('mu', 'pi_prox')}, pi vs pi at consumption (decoupled anchor, or several mini-batches with learner.consumption_pass on)")
        for k, h in _GAP.items() if k != "entropy_mean"
    },
    "drpo_learner_behaviour_weight_mean": Family("drpo_learner_behaviour_weight_mean", "gauge", "Decoupled anchor: mean behaviour weight min(pi_prox/mu, cap)"),
    "drpo_learner_behaviour_weight_capped_ratio": Family("drpo_learner_behaviour_weight_capped_ratio", "gauge", "Decoupled anchor: fraction of tokens at the cap"),
    "drpo_objective_regularizer_mean": Family("drpo_objective_regularizer_mean", "gauge", "DRPO quadratic term |A|/(2 delta) mu (r-1)^2, mean per token"),
    "drpo_objective_regularizer_share": Family("drpo_objective_regularizer_share", "gauge", "Regularizer's share of the loss magnitude"),
    "drpo_objective_weight_hist": Family("drpo_objective_weight_hist", "gauge", "Tokens per bin of the DRPO gradient weight w (label bin)"),
    "drpo_objective_weight_mean": Family("drpo_objective_weight_mean", "gauge", "Mean DRPO gradient weight w"),
    "drpo_objective_weight_abs_dev_mean": Family("drpo_objective_weight_abs_dev_mean", "gauge", "Mean |w - 1| = mean |pi - mu| / delta over tokens with A != 0"),
    "drpo_objective_weight_above_one_ratio": Family(
        "drpo_objective_weight_above_one_ratio", "gauge", "Fraction of tokens whose DRPO weight w exceeds 1 + 0.001 (pi moved against A's sign)"),
    "drpo_gap_update_abs_shift_mean": Family(
        "drpo_gap_update_abs_shift_mean", "gauge", "Mean |pi - mu| at each update of a rollout batch (label update = 0, 1, ...: train.epochs x mini_batches)"),
    "drpo_objective_corrective_ratio": Family("drpo_objective_corrective_ratio", "gauge", "Fraction of tokens with a negative (corrective) weight"),
    "drpo_objective_masked_ratio": Family("drpo_objective_masked_ratio", "gauge", "DPPO: fraction of tokens masked"),
    "drpo_objective_masked_ratio_pos_adv": Family("drpo_objective_masked_ratio_pos_adv", "gauge", "DPPO: masked fraction among A > 0 tokens"),
    "drpo_objective_masked_ratio_nonpos_adv": Family("drpo_objective_masked_ratio_nonpos_adv", "gauge", "DPPO: masked fraction among A <= 0 tokens"),
    "drpo_objective_clip_ratio": Family("drpo_objective_clip_ratio", "gauge", "PPO: fraction of tokens clipped"),
    "drpo_objective_divergence_mean": Family("drpo_objective_divergence_mean", "gauge", "DPPO: mean divergence the trust region is on (binary or top-K TV/KL)"),
    "drpo_objective_is_truncated_ratio": Family("drpo_objective_is_truncated_ratio", "gauge", "DPPO: fraction of tokens whose importance weight min(r, C) is truncated"),
    "drpo_staleness_group_lag_groups": Family("drpo_staleness_group_lag_groups", "gauge", "Groups in the last step per version lag of their oldest token (label lag)"),
    "drpo_staleness_token_age_tokens": Family("drpo_staleness_token_age_tokens", "gauge", "Tokens in the last step per version lag (label lag)"),
    "drpo_staleness_lag_mean": Family("drpo_staleness_lag_mean", "gauge", "Mean version lag of the last step's groups"),
    "drpo_staleness_lag_max": Family("drpo_staleness_lag_max", "gauge", "Max version lag of the last step's groups"),
    "drpo_staleness_max": Family("drpo_staleness_max", "gauge", "The staleness bound eta"),
    "drpo_staleness_running": Family("drpo_staleness_running", "gauge", "Rollouts admitted and not finished (in flight)"),
    "drpo_staleness_buffered": Family("drpo_staleness_buffered", "gauge", "Finished groups waiting for a training step"),
    "drpo_staleness_capacity": Family("drpo_staleness_capacity", "gauge", "Rollouts the admission rule would start now"),
    "drpo_staleness_admitted": Family("drpo_staleness_admitted", "counter", "Rollouts admitted"),
    "drpo_prompts": Family("drpo_prompts", "counter", "Prompts with an outcome (label outcome: trained, filtered, stale = dropped over the bound, failed)"),
    "drpo_rollout_tokens_per_second": Family("drpo_rollout_tokens_per_second", "gauge", "Generated tokens per second since the previous step"),
    "drpo_rollout_weight_update_seconds": Family("drpo_rollout_weight_update_seconds", "gauge", "Seconds to publish the last weights"),
    "drpo_rollout_queue_depth": Family("drpo_rollout_queue_depth", "gauge", "Prompts queued or generating on the rollout workers"),
    "drpo_learner_tokens_per_second": Family("drpo_learner_tokens_per_second", "gauge", "Trained response tokens per learner second"),
    "drpo_learner_grad_norm": Family("drpo_learner_grad_norm", "gauge", "Global gradient norm before clipping (mean over the batch's updates)"),
    "drpo_learner_grad_norm_max": Family("drpo_learner_grad_norm_max", "gauge", "Largest gradient norm among the batch's updates"),
    "drpo_learner_updates": Family("drpo_learner_updates", "gauge", "Optimizer updates in the last step (mini-batches)"),
    "drpo_learner_loss": Family("drpo_learner_loss", "gauge", "Training loss"),
    "drpo_learner_entropy_mean": Family("drpo_learner_entropy_mean", "gauge", "Learner entropy per response token (nats)"),
    "drpo_learner_step_duration_seconds": Family("drpo_learner_step_duration_seconds", "gauge", "Learner seconds in the last step"),
    "drpo_step_duration_seconds": Family("drpo_step_duration_seconds", "gauge", "Wall seconds between the last two steps"),
    "drpo_reward_mean": Family("drpo_reward_mean", "gauge", "Mean reward of the last step's samples"),
    "drpo_reward_accuracy_ratio": Family("drpo_reward_accuracy_ratio", "gauge", "Fraction of the last step's samples with full reward"),
    "drpo_reward_errors": Family(
        "drpo_reward_errors", "gauge", "Samples the reward could not score since the previous step (label reason: error, timeout, invalid, unreachable)"),
    "drpo_reward_component": Family("drpo_reward_component", "gauge", "Mean of each named part of the reward over the last step's samples (label component)"),
    "drpo_reward_scoring_seconds": Family("drpo_reward_scoring_seconds", "gauge", "Seconds the reward took over the groups since the previous step"),
    "drpo_eval_accuracy_ratio": Family("drpo_eval_accuracy_ratio", "gauge", "mean@k of the first eval set in the last evaluation"),
    "drpo_eval_seconds": Family("drpo_eval_seconds", "gauge", "Wall seconds of the last evaluation round, from submission to its last answer"),
    "drpo_eval_mean_at_k_ratio": Family("drpo_eval_mean_at_k_ratio", "gauge", "mean@k per eval set (label set) in the last evaluation"),
    "drpo_eval_pass_at_k_ratio": Family("drpo_eval_pass_at_k_ratio", "gauge", "Unbiased pass@k per eval set (labels set, k)"),
    "drpo_eval_greedy_accuracy_ratio": Family("drpo_eval_greedy_accuracy_ratio", "gauge", "Greedy accuracy per eval set (label set)"),
    "drpo_eval_truncated_ratio": Family("drpo_eval_truncated_ratio", "gauge", "Share of eval responses cut at max_new_tokens (label set)"),
    "drpo_eval_answer_marker_ratio": Family("drpo_eval_answer_marker_ratio", "gauge", "Share of eval answers given after a final-answer marker (label set)"),
    "drpo_eval_response_tokens": Family("drpo_eval_response_tokens", "gauge", "Eval response length per set (labels set, stat: mean, median, max)"),
    "drpo_eval_prompts": Family("drpo_eval_prompts", "gauge", "Prompts per eval set (labels set; failed ones in drpo_eval_failed_prompts)"),
    "drpo_eval_failed_prompts": Family("drpo_eval_failed_prompts", "gauge", "Eval prompts whose group failed, per set"),
    "drpo_eval_episode_turns_mean": Family("drpo_eval_episode_turns_mean", "gauge", "Multi-turn evaluation: model turns per episode, mean (label set)"),
    "drpo_eval_episode_tool_calls_mean": Family("drpo_eval_episode_tool_calls_mean", "gauge", "Multi-turn evaluation: tool calls per episode, mean (label set)"),
    "drpo_eval_episode_tool_errors_mean": Family("drpo_eval_episode_tool_errors_mean", "gauge", "Multi-turn evaluation: failed tool calls per episode, mean (label set)"),
    "drpo_eval_reward_errors": Family(
        "drpo_eval_reward_errors", "gauge", "Eval samples the reward could not score in the last evaluation (labels set, reason: error, timeout, invalid, unreachable)"),
    "drpo_episode_turns_mean": Family("drpo_episode_turns_mean", "gauge", "Multi-turn episodes: model turns per trained episode, mean"),
    "drpo_episode_turns_max": Family("drpo_episode_turns_max", "gauge", "Multi-turn episodes: model turns of the longest trained episode"),
    "drpo_episode_tool_calls_mean": Family("drpo_episode_tool_calls_mean", "gauge", "Multi-turn episodes: tool calls per trained episode, mean"),
    "drpo_episode_tool_errors_mean": Family("drpo_episode_tool_errors_mean", "gauge", "Multi-turn episodes: failed tool calls per trained episode, mean"),
    "drpo_episode_environment_seconds_mean": Family("drpo_episode_environment_seconds_mean", "gauge", "Multi-turn episodes: seconds in the environment's steps per episode, mean"),
    "drpo_episode_environment_reward_mean": Family("drpo_episode_environment_reward_mean", "gauge", "Multi-turn episodes: the environment's summed step rewards per episode, mean"),
    "drpo_episode_environment_token_ratio": Family(
        "drpo_episode_environment_token_ratio", "gauge", "Multi-turn episodes: share of response tokens the environment inserted (context only, not trained)"),
    "drpo_episode_truncated_ratio": Family("drpo_episode_truncated_ratio", "gauge", "Multi-turn episodes: share of trained episodes a budget cut (label reason: max_turns, tokens)"),
    "drpo_step": Family("drpo_step", "gauge", "Training steps done"),
    "drpo_policy_version": Family("drpo_policy_version", "gauge", "Learner policy version"),
    "drpo_last_step_timestamp_seconds": Family("drpo_last_step_timestamp_seconds", "gauge", "Unix time of the last finished step (stall alerts)"),
    "drpo_stalled_seconds": Family("drpo_stalled_seconds", "gauge", "Seconds without progress when a stall was last reported (0 after a step)"),
}

_RENAMES = {
    "step": "drpo_step", "version": "drpo_policy_version", "step_seconds": "drpo_step_duration_seconds",
    "learner/seconds": "drpo_learner_step_duration_seconds", "rollout/publish_seconds": "drpo_rollout_weight_update_seconds",
    "learner/tokens": "drpo_learner_step_tokens", "last_step_timestamp_seconds": "drpo_last_step_timestamp_seconds",
    "staleness/accepted": "drpo_staleness_accepted", "staleness/admitted": "drpo_staleness_admitted",
}
_LAG_LABEL = {"numerics": "0", "inflight": "0-inflight", "staleness": "1+"}


def _name(path: str) -> str:
    name = "drpo_" + re.sub(r"[^a-zA-Z0-9_]", "_", path)
    return re.sub(r"_frac(?=_|$)", "_ratio", name)


def series(key: str) -> tuple[str, dict[str, str]] | None:
    """(family name, labels) for a metric key; None for keys that are not numbers to export."""
    if key in _RENAMES:
        return _RENAMES[key], {}
    parts = key.split("/")
    if parts[0] == "ledger":
        return "drpo_prompts", {"outcome": parts[1]}
    if parts[0] == "gap" and parts[1] == "proximal":
        return _name(key), {}
    if parts[0] == "gap" and parts[1].startswith("update_"):
        return _name("gap/update/" + "/".join(parts[2:])), {"update": parts[1].removeprefix("update_")}
    if parts[0] == "gap":
        lag = _LAG_LABEL.get(parts[1], "all")
        rest = parts[2:] if parts[1] in _LAG_LABEL else parts[1:]
        return _name("gap/" + "/".join(rest)), {"lag": lag}
    if len(parts) >= 2 and parts[-1].startswith("bin_"):
        index = parts[-1][4:]
        base = "/".join(parts[:-1])
        if base == "staleness/lag_hist":
            return "drpo_staleness_group_lag_groups", {"lag": index}
        if base == "staleness/token_lag_hist":
            return "drpo_staleness_token_age_tokens", {"lag": index}
        return _name(base), {"bin": index}
    if key == "eval/accuracy":
        return "drpo_eval_accuracy_ratio", {}
    if parts[0] == "eval" and len(parts) == 3:
        return _eval_series(parts[1], parts[2])
    if key == "reward/accuracy":
        return "drpo_reward_accuracy_ratio", {}
    if parts[0] == "episode" and len(parts) == 3 and parts[1] == "truncated":
        return "drpo_episode_truncated_ratio", {"reason": parts[2]}
    if parts[0] == "reward" and len(parts) == 3 and parts[1] in ("errors", "component"):
        return f"drpo_reward_{parts[1]}", {"reason" if parts[1] == "errors" else "component": parts[2]}
    return _name(key), {}


def _eval_series(name: str, metric: str) -> tuple[str, dict[str, str]] | None:
    """Per eval set metrics (controller/eval_metrics.py) as labelled families."""
    labels = {"set": name}
    if metric.startswith("pass_at_"):
        return "drpo_eval_pass_at_k_ratio", {**labels, "k": metric.removeprefix("pass_at_")}
    if metric.startswith("response_tokens_"):
        return "drpo_eval_response_tokens", {**labels, "stat": metric.removeprefix("response_tokens_")}
    if metric.startswith("reward_errors_"):
        return "drpo_eval_reward_errors", {**labels, "reason": metric.removeprefix("reward_errors_")}
    family = {"mean_at_k": "drpo_eval_mean_at_k_ratio", "greedy": "drpo_eval_greedy_accuracy_ratio", "truncated_frac": "drpo_eval_truncated_ratio",
              "answer_marker_frac": "drpo_eval_answer_marker_ratio", "prompts": "drpo_eval_prompts", "failed": "drpo_eval_failed_prompts",
              "turns_mean": "drpo_eval_episode_turns_mean", "tool_calls_mean": "drpo_eval_episode_tool_calls_mean",
              "tool_errors_mean": "drpo_eval_episode_tool_errors_mean"}.get(metric)
    return (family, labels) if family else None


class RunCollector:
    """A prometheus_client collector over the latest value of every key."""

    def __init__(self) -> None:
        self._values: dict[str, float] = {}
        self._lock = threading.Lock()

    def update(self, values: dict) -> None:
        with self._lock:
            for k, v in values.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    self._values[k] = float(v)

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        with self._lock:
            values = dict(self._values)
        families: dict[str, list[tuple[dict[str, str], float]]] = {}
        for key, value in values.items():
            mapped = series(key)
            if mapped is not None:
                families.setdefault(mapped[0], []).append((mapped[1], value))
        for name, samples in sorted(families.items()):
            known = CATALOG.get(name)
            labels = sorted({k for lab, _ in samples for k in lab})
            if known is not None and known.kind == "counter":
                family = CounterMetricFamily(name, known.help, labels=labels)
            else:
                family = GaugeMetricFamily(name, known.help if known else f"drpo metric {name}", labels=labels)
            for lab, value in samples:
                family.add_metric([lab.get(k, "") for k in labels], value)
            yield family


class PrometheusExporter:
    """Serves a RunCollector over HTTP from a daemon thread (port 0 = any free port)."""

    def __init__(self, host: str, port: int):
        from prometheus_client import CollectorRegistry, start_http_server

        self.collector = RunCollector()
        self.registry = CollectorRegistry()
        self.registry.register(self.collector)
        self.server, _ = start_http_server(port, addr=host, registry=self.registry)
        self.host, self.port = host, self.server.server_port

    def set(self, values: dict) -> None:
        self.collector.update(values)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
