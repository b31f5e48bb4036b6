"""Telemetry: the Prometheus endpoint on loopback, metrics.jsonl lines, and `drpo train --simulate`."""

from __future__ import annotations

import json
import urllib.request

from controller.cli import main
from controller.telemetry import PrometheusExporter, prometheus_name


def test_prometheus_endpoint_serves_gauges_on_loopback():
    exporter = PrometheusExporter("127.0.0.1", 0)
    try:
        exporter.set({"gap/numerics/abs_shift_mean": 0.25, "staleness/lag_hist/bin_1": 3, "note": "text is skipped"})
        assert exporter.server.server_address[0] == "127.0.0.1"
        body = urllib.request.urlopen(f"http://127.0.0.1:{exporter.port}/metrics", timeout=10).read().decode()
        assert "drpo_gap_numerics_abs_shift_mean 0.25" in body
        assert "drpo_staleness_lag_hist_bin_1 3.0" in body
        assert "note" not in body
        exporter.set({"gap/numerics/abs_shift_mean": 0.5})
        body = urllib.request.urlopen(f"http://127.0.0.1:{exporter.port}/metrics", timeout=10).read().decode()
        assert "drpo_gap_numerics_abs_shift_mean 0.5" in body
    finally:
        exporter.close()


def test_prometheus_names_are_legal():
    assert prometheus_name("objective/weight_hist/bin_0") == "drpo_objective_weight_hist_bin_0"
    assert prometheus_name("gap/p99-x.y") == "drpo_gap_p99_x_y"


def test_drpo_train_simulate_writes_metrics_and_a_summary(tmp_path, capsys):
    run_dir = tmp_path / "sim"
    code = main([
        "train", "--simulate", "--set", f"run_dir={run_dir}", "--set", "train.steps=6", "--set", "rollout.workers=8",
        "--set", "train.max_staleness=2", "--set", "eval.every=3", "--set", "metrics.port=null",
    ])
    assert code == 0
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in lines if r["kind"] == "step"]
    assert [r["step"] for r in steps] == list(range(1, 7))
    assert {r["kind"] for r in lines} == {"step", "eval", "checkpoint"}
    assert all(r["staleness/lag_max"] <= 2 for r in steps)
    out = capsys.readouterr()
    assert "held-out accuracy, start" in out.out and "ledger" in out.out
    assert "step 6/6" in out.err  # the progress line
    assert (run_dir / "config.yaml").is_file() and (run_dir / "checkpoints" / "step-000006" / "controller.json").is_file()
