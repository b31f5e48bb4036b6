"""Telemetry: the Prometheus endpoint on loopback, metrics.jsonl lines, and `drpo train --simulate`."""

from __future__ import annotations

import json
import math
import re
import urllib.request

from controller.cli import main
from controller.prometheus import CATALOG, PrometheusExporter, series
from controller.telemetry import Telemetry


def test_prometheus_endpoint_serves_gauges_on_loopback():
    exporter = PrometheusExporter("127.0.0.1", 0)
    try:
        exporter.set({
            "gap/numerics/abs_shift_mean": 0.25, "gap/staleness/abs_shift_mean": 0.5, "gap/abs_shift_mean": 0.4,
            "staleness/lag_hist/bin_1": 3, "ledger/trained": 16, "ledger/stale": 2, "objective/corrective_frac": 0.01,
            "rollout/publish_seconds": 1.5, "note": "text is skipped",
        })
        assert exporter.server.server_address[0] == "127.0.0.1"
        body = urllib.request.urlopen(f"http://127.0.0.1:{exporter.port}/metrics", timeout=10).read().decode()
        assert 'drpo_gap_abs_shift_mean{lag="0"} 0.25' in body and 'drpo_gap_abs_shift_mean{lag="1+"} 0.5' in body
        assert 'drpo_gap_abs_shift_mean{lag="all"} 0.4' in body
        assert 'drpo_staleness_group_lag_groups{lag="1"} 3.0' in body
        assert 'drpo_prompts_total{outcome="trained"} 16.0' in body and "# TYPE drpo_prompts_total counter" in body
        assert "drpo_objective_corrective_ratio 0.01" in body and "drpo_rollout_weight_update_seconds 1.5" in body
        assert "note" not in body
        exporter.set({"gap/numerics/abs_shift_mean": 0.75})
        body = urllib.request.urlopen(f"http://127.0.0.1:{exporter.port}/metrics", timeout=10).read().decode()
        assert 'drpo_gap_abs_shift_mean{lag="0"} 0.75' in body
    finally:
        exporter.close()


def test_metric_keys_map_to_conventional_families():
    assert series("objective/weight_hist/bin_0") == ("drpo_objective_weight_hist", {"bin": "0"})
    assert series("gap/staleness/kl_k3") == ("drpo_gap_kl_k3", {"lag": "1+"})
    assert series("gap/beyond_delta_frac") == ("drpo_gap_beyond_delta_ratio", {"lag": "all"})
    assert series("objective/masked_frac_pos_adv") == ("drpo_objective_masked_ratio_pos_adv", {})
    assert series("staleness/token_lag_hist/bin_3") == ("drpo_staleness_token_age_tokens", {"lag": "3"})
    assert series("learner/seconds") == ("drpo_learner_step_duration_seconds", {})
    assert series("gap/proximal/abs_shift_p99") == ("drpo_gap_proximal_abs_shift_p99", {})  # pi vs pi_prox: not the gap to mu
    assert series("learner/behaviour_weight_capped_frac") == ("drpo_learner_behaviour_weight_capped_ratio", {})
    for name, family in CATALOG.items():
        assert name == family.name and name.startswith("drpo_") and family.kind in ("gauge", "counter")


def test_drpo_train_simulate_writes_metrics_and_a_summary(tmp_path, capsys):
    run_dir = tmp_path / "sim"
    code = main([
        "train", "--simulate", "--set", f"run_dir={run_dir}", "--set", "train.steps=6", "--set", "rollout.workers=8",
        "--set", "train.mode=async", "--set", "train.max_staleness=2", "--set", "eval.every=3", "--set", "metrics.port=null",
    ])
    assert code == 0
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in lines if r["kind"] == "step"]
    assert [r["step"] for r in steps] == list(range(1, 7))
    assert {r["kind"] for r in lines} == {"startup", "step", "eval", "checkpoint"}
    assert all(r["staleness/lag_max"] <= 2 for r in steps)
    out = capsys.readouterr()
    assert "eval accuracy, start" in out.out and "ledger" in out.out
    assert "step 6/6" in out.err  # the progress line
    assert (run_dir / "config.yaml").is_file() and (run_dir / "checkpoints" / "step-000006" / "controller.json").is_file()


def test_the_summary_shows_start_to_end_per_eval_set_only_when_two_evaluations_ran(tmp_path):
    from controller.config import MetricsConfig

    telemetry = Telemetry(tmp_path, MetricsConfig(port=None, progress=False), 1, lambda: 0.0)
    sets = lambda acc: {"heldout": {"mean_at_k": acc, "k": 1, "pass_at_1": acc, "response_tokens_mean": 4, "truncated_frac": 0.0}}  # noqa: E731
    first, last = {"version": 0, "accuracy": 0.1, "samples": 8, "sets": sets(0.1)}, {"version": 2, "accuracy": 0.5, "samples": 8, "sets": sets(0.5)}
    assert "mean@1 0.100 → 0.500" in telemetry.summary([first, last], {"trained": 4})
    only = telemetry.summary([last], {"trained": 4})  # eval.at_start false: the end is the only evaluation
    assert "eval set heldout" in only and "mean@1 0.500" in only and "→" not in only


def test_a_figure_with_nothing_to_measure_reads_n_a_not_nan(tmp_path):
    """Every reward 0 leaves no token with a nonzero advantage: DRPO's corrective fraction is
    undefined (NaN in metrics.jsonl); a sync run has no lag >= 1 token. The summary says n/a."""
    from controller.config import MetricsConfig
    from controller.telemetry import shown

    assert shown(math.nan, 4) == "n/a" and shown(0.01234, 3) == "0.012"
    telemetry = Telemetry(tmp_path, MetricsConfig(port=None, progress=False), 1, lambda: 0.0)
    telemetry.steps.append({
        "step": 1, "step_seconds": 2.0, "learner/tokens_per_second": 10.0, "rollout/tokens_per_second": 20.0, "reward/mean": 0.0,
        "gap/numerics/abs_shift_mean": 0.001, "objective/corrective_frac": math.nan, "staleness/lag_mean": 0.0,
    })
    text = telemetry.summary([], {"trained": 1})
    assert re.search(r"corrective fraction\s+n/a", text) and re.search(r"\|pi-mu\| mean, lag >= 1 \(staleness\)\s+n/a", text), text
    assert re.search(r"\|pi-mu\| mean, lag 0 \(numerics\)\s+0\.00100", text) and "nan" not in text, text
