"""The experiments grid runner, on its CI smoke subset (benchmarks/experiments/smoke.yaml) with a tiny
model: every cell trains for real, the table and the plot come out, and a rerun skips finished cells."""

from __future__ import annotations

import math

import pytest
import yaml

from benchmarks.experiments.reporting import fmt
from benchmarks.experiments.run import (
    BEGIN, END, HERE, grid_cells, grid_summary_table, noise_floor, objective_table, plot_grid, run_grid, table, write_grid_docs,
)

pytestmark = [pytest.mark.ray, pytest.mark.engine, pytest.mark.slow]


def test_the_full_grid_names_every_cell_once():
    grid = yaml.safe_load((HERE / "grid.yaml").read_text())
    names = [c.name for c in grid_cells(grid)]
    assert len(names) == len(set(names)) == 6 * 4 * 2 + 3
    assert {c.setting for c in grid_cells(grid)} == {"fp32", "bf16", "fp8", "async-eta4"}


def test_smoke_grid_runs_every_cell_and_writes_the_table(ray_local, tiny_chat_model, tmp_path):
    grid = yaml.safe_load((HERE / "smoke.yaml").read_text())
    rows = run_grid(grid, tmp_path, str(tiny_chat_model))
    assert [r["cell"] for r in rows] == [c.name for c in grid_cells(grid)] and len(rows) == 5
    for r in rows:
        assert r["error"] is None, r["error"]
        assert r["eval_samples"] == 8 and 0.0 <= r["final_accuracy"] <= 1.0 and len(r["curve"]) == 3  # start + 2 steps
    fp8 = [r for r in rows if r["setting"] == "fp8"]
    assert all(r["gap_lag0"] is not None and r["gap_lag0"] > 0 for r in fp8)  # fp8 rollout vs fp32 learner: a real gap
    drpo = [r for r in rows if r["objective"].startswith("drpo")]
    assert all(r["regularizer_mean"] is not None and math.isfinite(r["corrective_frac"]) for r in drpo)
    text = table(rows)
    assert text.count("\n") == len(rows) + 2 and "| drpo δ=0.5 | fp8 | 0 |" in text
    pngs = plot_grid(rows, tmp_path)
    assert [p.name for p in pngs] == ["accuracy.png", "gain.png"] and all(p.read_bytes().startswith(b"\x89PNG") for p in pngs)
    means = grid_summary_table(rows)  # one line per (objective, setting); one seed here, so the mean is the cell
    assert means.count("\n") == len(rows) + 2
    drpo_fp8 = next(r for r in rows if r["cell"] == "drpo-fp8-s0")
    assert f"| drpo | fp8 | 1 | {fmt(drpo_fp8['start_accuracy'])} | {fmt(drpo_fp8['final_accuracy'])} |" in means
    assert drpo_fp8["train_reward_last5"] is not None and drpo_fp8["grad_norm_max"] > 0 and drpo_fp8["gap_max"] >= drpo_fp8["gap_lag0"]
    pooled = objective_table(rows)  # grpo: 2 cells (fp8, async); drpo: 2; drpo δ=0.5: 1
    assert "| grpo | 2 |" in pooled and "| drpo δ=0.5 | 1 |" in pooled
    assert noise_floor(rows).startswith(f"Evaluation noise: the starting model's held-out accuracy over the {len(rows)} cells'")
    page = tmp_path / "docs" / "results.md"
    write_grid_docs(page, rows, tmp_path, str(HERE / "smoke.yaml"), grid)
    page.write_text("# Results\n\nA written reading.\n" + page.read_text().split("# Results\n\n", 1)[1] + "\nMore reading.\n")
    write_grid_docs(page, rows, tmp_path, str(HERE / "smoke.yaml"), grid)  # regenerating keeps the prose around the block
    text = page.read_text()
    assert text.startswith("# Results\n\nA written reading.\n" + BEGIN) and text.endswith(END + "\n\nMore reading.\n")
    assert text.count(BEGIN) == 1 and means in text and "--grid benchmarks/experiments/smoke.yaml" in text
    assert all((tmp_path / "docs" / "results" / p.name).read_bytes() == p.read_bytes() for p in pngs)
    stamps = {r["cell"]: (tmp_path / "cells" / r["cell"] / "metrics.jsonl").stat().st_mtime_ns for r in rows}
    again = run_grid(grid, tmp_path, str(tiny_chat_model))  # finished cells are not run again
    assert again == rows
    assert stamps == {r["cell"]: (tmp_path / "cells" / r["cell"] / "metrics.jsonl").stat().st_mtime_ns for r in rows}
