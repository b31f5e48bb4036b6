"""The Grafana dashboards, as data: ``python -m deploy.dashboards`` writes deploy/grafana/dashboards/*.json.

Each panel is a title, its PromQL targets (with legends) and a unit; every expression is checked
against a real Prometheus scraping a real run (tests/test_observability.py). The JSON is Grafana's
dashboard model (schemaVersion 39): timeseries panels on a 24-column grid, a Prometheus datasource
picked through the ``datasource`` template variable.
"""

from __future__ import annotations

import json
from pathlib import Path

OUT = Path(__file__).parent / "grafana" / "dashboards"
LAG = "lag {{lag}}"

DASHBOARDS = {
    "drpo-offpolicy-gap": ("drpo — off-policy gap, learner π vs engine μ (numerics: lag 0, inflight: lag 0 after an update mid-request, staleness: lag 1+)", [
        ("|π−μ| mean by version lag", [("drpo_gap_abs_shift_mean", LAG)], "none"),
        ("|π−μ| p99 by version lag", [("drpo_gap_abs_shift_p99", LAG)], "none"),
        ("|π−μ| max by version lag", [("drpo_gap_abs_shift_max", LAG)], "none"),
        ("KL(μ‖π), k3 estimate", [("drpo_gap_kl_k3", LAG)], "none"),
        ("χ²(π‖μ)", [("drpo_gap_chi2", LAG)], "none"),
        ("ratio π/μ quantiles (all tokens)", [
            ('drpo_gap_ratio_p01{lag="all"}', "p01"), ('drpo_gap_ratio_p50{lag="all"}', "p50"), ('drpo_gap_ratio_p99{lag="all"}', "p99"),
        ], "none"),
        ("fraction of tokens beyond δ", [("drpo_gap_beyond_delta_ratio", LAG)], "percentunit"),
        ("|π−μ| at each update of a rollout batch (train.epochs × mini_batches; update 0 is on-policy up to numerics and staleness)", [
            ("drpo_gap_update_abs_shift_mean", "update {{update}}"),
        ], "none"),
        ("|π−π_prox|: the batch's own drift over its updates, not the gap to μ (decoupled or mini-batches > 1)", [
            ("drpo_gap_proximal_abs_shift_mean", "mean"), ("drpo_gap_proximal_abs_shift_max", "max"),
        ], "none"),
        ("decoupled anchor only: behaviour weight min(π_prox/μ, cap)", [
            ("drpo_learner_behaviour_weight_mean", "mean"), ("drpo_learner_behaviour_weight_capped_ratio", "fraction at the cap"),
        ], "none"),
    ]),
    "drpo-regularizer": ("drpo — DRPO regularizer", [
        ("regularizer magnitude (mean quadratic term per token)", [("drpo_objective_regularizer_mean", "regularizer")], "none"),
        ("regularizer share of the loss", [("drpo_objective_regularizer_share", "share")], "percentunit"),
        ("weights past their bounds (by more than 0.001): corrective w < 0, w > 1", [
            ("drpo_objective_corrective_ratio", "corrective (w < 0)"), ("drpo_objective_weight_above_one_ratio", "w > 1"),
        ], "percentunit"),
        ("gradient weight w: mean and mean |w − 1|", [
            ("drpo_objective_weight_mean", "mean w"), ("drpo_objective_weight_abs_dev_mean", "mean |w − 1|"),
        ], "none"),
        ("gradient weight w: histogram (tokens per bin)", [("drpo_objective_weight_hist", "bin {{bin}}")], "none"),
        ("learner entropy", [("drpo_learner_entropy_mean", "entropy")], "none"),
    ]),
    "drpo-staleness": ("drpo — staleness and admission", [
        ("token age (tokens per version lag, last step)", [("drpo_staleness_token_age_tokens", LAG)], "none"),
        ("version lag of trained groups vs the bound", [
            ("drpo_staleness_lag_mean", "mean"), ("drpo_staleness_lag_max", "max"), ("drpo_staleness_max", "bound η"),
        ], "none"),
        ("in flight, buffered, admission capacity", [
            ("drpo_staleness_running", "in flight"), ("drpo_staleness_buffered", "buffered"), ("drpo_staleness_capacity", "capacity"),
        ], "none"),
        ("prompt outcomes per second", [("sum by (outcome) (rate(drpo_prompts_total[5m]))", "{{outcome}}")], "ops"),
        ("admissions per second", [("rate(drpo_staleness_admitted_total[5m])", "admitted")], "ops"),
    ]),
    "drpo-throughput": ("drpo — throughput and learning", [
        ("tokens per second", [("drpo_rollout_tokens_per_second", "rollout"), ("drpo_learner_tokens_per_second", "learner")], "none"),
        ("step and weight-update seconds", [
            ("drpo_step_duration_seconds", "step"), ("drpo_learner_step_duration_seconds", "learner"),
            ("drpo_rollout_weight_update_seconds", "weight update"),
        ], "s"),
        ("rollout queue depth", [("drpo_rollout_queue_depth", "queued + generating")], "none"),
        ("evaluation round seconds (submission to last answer)", [("drpo_eval_seconds", "last round")], "s"),
        ("reward and accuracy", [
            ("drpo_reward_mean", "train reward"), ("drpo_reward_accuracy_ratio", "train accuracy"), ("drpo_eval_accuracy_ratio", "eval accuracy (first set)"),
        ], "percentunit"),
        ("reward components (mean over the step's samples)", [("drpo_reward_component", "{{component}}")], "none"),
        ("multi-turn episodes: turns, tool calls and tool errors per episode", [
            ("drpo_episode_turns_mean", "turns"), ("drpo_episode_tool_calls_mean", "tool calls"), ("drpo_episode_tool_errors_mean", "tool errors"),
            ("drpo_eval_episode_turns_mean", "eval {{set}} turns"), ("drpo_eval_episode_tool_calls_mean", "eval {{set}} tool calls"),
        ], "none"),
        ("multi-turn episodes: environment tokens (context only) and truncation", [
            ("drpo_episode_environment_token_ratio", "environment tokens"), ("drpo_episode_truncated_ratio", "truncated: {{reason}}"),
        ], "percentunit"),
        ("reward: samples it could not score, and its seconds", [
            ("drpo_reward_errors", "{{reason}}"), ("drpo_reward_scoring_seconds", "scoring seconds"),
            ("drpo_eval_reward_errors", "eval {{set}} {{reason}}"),
        ], "none"),
        ("eval sets: mean@k and pass@k", [
            ("drpo_eval_mean_at_k_ratio", "{{set}} mean@k"), ("drpo_eval_pass_at_k_ratio", "{{set}} pass@{{k}}"),
        ], "percentunit"),
        ("eval sets: truncated responses and answers after a marker", [
            ("drpo_eval_truncated_ratio", "{{set}} truncated"), ("drpo_eval_answer_marker_ratio", "{{set}} marker"),
        ], "percentunit"),
        ("response tokens (train mean, eval mean per set)", [
            ("drpo_rollout_response_tokens_mean", "train"), ('drpo_eval_response_tokens{stat="mean"}', "{{set}}"),
        ], "none"),
        ("loss and gradient norm", [("drpo_learner_loss", "loss"), ("drpo_learner_grad_norm", "grad norm")], "none"),
        ("seconds since the last step", [("drpo:seconds_since_last_step", "stall")], "s"),
        ("policy version", [("drpo_policy_version", "version"), ("drpo_step", "step")], "none"),
    ]),
}


def panel(index: int, title: str, targets: list[tuple[str, str]], unit: str) -> dict:
    return {
        "id": index + 1, "type": "timeseries", "title": title,
        "gridPos": {"h": 8, "w": 12, "x": 12 * (index % 2), "y": 8 * (index // 2)},
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
        "targets": [
            {"refId": chr(ord("A") + i), "expr": expr, "legendFormat": legend, "datasource": {"type": "prometheus", "uid": "${datasource}"}}
            for i, (expr, legend) in enumerate(targets)
        ],
    }


def dashboard(uid: str, title: str, panels: list) -> dict:
    return {
        "uid": uid, "title": title, "tags": ["drpo"], "schemaVersion": 39, "version": 1, "editable": True,
        "time": {"from": "now-6h", "to": "now"}, "refresh": "10s", "timezone": "",
        "templating": {"list": [{"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Prometheus"}]},
        "annotations": {"list": []},
        "panels": [panel(i, *p) for i, p in enumerate(panels)],
    }


def build() -> dict[str, dict]:
    return {uid: dashboard(uid, title, panels) for uid, (title, panels) in DASHBOARDS.items()}


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for uid, model in build().items():
        (OUT / f"{uid}.json").write_text(json.dumps(model, indent=2, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
