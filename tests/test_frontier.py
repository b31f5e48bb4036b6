"""The stability frontier's grid (benchmarks/experiments/frontier.yaml) and its analysis: every cell
is the base plus one rung, the paired/unpaired noise and the frontier verdicts are what their
definitions say, and the CI smoke ladder trains every cell through drpo train and reports."""

from __future__ import annotations

import json
import statistics

import pytest
import yaml

from benchmarks.experiments.frontier import ARCHIVE, archive_of, base_overrides, read_archive, run, write_archive
from benchmarks.experiments.frontier_grid import BASE, calibration_cells, cells, rungs
from benchmarks.experiments.frontier_report import (
    RESULTS_BEGIN, RESULTS_END, collapses, docs_markers, entropy_collapsed, frontier, learns, paired_noise, plot, report, write_docs,
)
from benchmarks.experiments.run import HERE


def _grid(name="frontier.yaml"):
    return yaml.safe_load((HERE / name).read_text())


def test_every_cell_is_the_base_plus_one_rung_and_its_objective_and_seed():
    grid = _grid()
    every = cells(grid)
    objectives, seeds, ladder = grid["objectives"], grid["seeds"], rungs(grid)
    assert len(seeds) >= 3 and len(every) == len(objectives) * len(ladder) * len(seeds) == len({c.name for c in every})
    names = {o["name"] for o in objectives}
    assert {"grpo", "grpo_tis", "spo", "dppo_binary_tv", "drpo", "drpo_d0.15"} <= names
    assert {"updates", "staleness", "lr", "precision"} <= set(grid["ladder"])
    by_obj = {o["name"]: o for o in objectives}
    for c in every:
        obj = by_obj[c.objective]
        own = [f"learner.objective={json.dumps(obj['objective'])}", *[f"{k}={json.dumps(v)}" for k, v in obj.get("overrides", {}).items()]]
        assert list(c.overrides[: len(own)]) == own and c.overrides[-1] == f"seed={c.seed}"
        middle = c.overrides[len(own):-1]
        rung = {} if c.rung == 0 else grid["ladder"][c.dimension][c.rung - 1]
        assert list(middle) == [f"{k}={json.dumps(v)}" for k, v in rung.items() if k != "model"]  # one rung, nothing else
        assert (c.dimension == BASE) == (c.rung == 0)
    flat = {}
    for key, value in grid["base"].items():  # nested mappings as dotted keys, as overrides name them
        flat.update({f"{key}.{k}": v for k, v in value.items()} if isinstance(value, dict) else {key: value})
    for dimension, rung, over in ladder:  # a rung changes what the base sets (it is not the base again)
        for key, value in over.items():
            assert key in flat and flat[key] != value, (dimension, rung, key)
    assert [c.setting for c in calibration_cells(grid)] == grid["calibration"]["rungs"]
    with pytest.raises(ValueError, match="unknown slice"):
        cells(grid, slices=["updates:9"])
    assert {c.setting for c in cells(grid, slices=["base", "updates:3"])} == {"base", "updates:3"}


def _row(objective, rung, seed, start, final, dimension="updates", collapses=0):
    return {"objective": objective, "dimension": BASE if rung == 0 else dimension, "rung": rung, "seed": seed,
            "start_accuracy": start, "final_accuracy": final, "collapses": collapses, "error": None}


def test_paired_noise_and_frontier_verdicts_follow_their_definitions():
    # two objectives, three seeds: the seed moves both objectives alike (what common random numbers pair away)
    seed_effect = {0: 0.0, 1: 0.2, 2: 0.4}
    rows = [_row(o, 0, s, 0.1, 0.3 + seed_effect[s] + (0.01 * s if o == "b" else 0.0)) for o in "ab" for s in range(3)]
    noise = paired_noise(rows)
    # paired differences are 0, -0.01, -0.02: sd 0.01; unpaired: var(a) + var(b) carries the seed effect twice
    a_vals, b_vals = [0.2 + seed_effect[s] for s in range(3)], [0.2 + seed_effect[s] + 0.01 * s for s in range(3)]
    assert noise["paired_sd"] == pytest.approx(0.01) and noise["dof"] == 2
    assert noise["unpaired_sd"] == pytest.approx((statistics.variance(a_vals) + statistics.variance(b_vals)) ** 0.5)
    rows += [_row("a", 1, s, 0.1, 0.3 + seed_effect[s]) for s in range(3)]  # the same as its base: still learning
    rows += [_row("a", 2, s, 0.1, 0.12 + 0.001 * s) for s in range(3)]  # learns a little, but a paired drop from base
    rows += [_row("b", 1, s, 0.1, 0.05, collapses=int(s == 0)) for s in range(3)]  # a collapse at rung 1
    result = frontier(rows)
    a, b = result[("a", "updates")], result[("b", "updates")]
    assert learns(a["rungs"][1]) and a["highest_learning"] == 1 and a["first_degraded"] == 2
    assert b["first_degraded"] == 1 and b["highest_learning"] == 0
    assert a["rungs"][2]["vs_base"] == pytest.approx(-0.18 - 0.2 + 0.001, abs=0.01)


def test_a_collapse_of_the_training_reward_is_a_fall_of_its_moving_average_below_half_its_best():
    steady = {"reward_curve": [[i, 0.3] for i in range(20)], "error": None}
    assert collapses(steady, "reward") == 0
    fall = {"reward_curve": [[i, 0.4 if i < 10 else 0.05] for i in range(20)], "error": None, "nonfinite_steps": 1}
    assert collapses(fall, "reward") == 1 + 1  # one fall (counted once while it stays down) and one non-finite step
    floor = {"reward_curve": [[i, 0.04 if i % 2 else 0.0] for i in range(20)], "error": None}
    assert collapses(floor, "reward") == 0  # at the noise floor nothing can collapse
    assert collapses({"collapses": 2, "error": None}, "heldout") == 2


def test_curves_are_smoothed_per_seed_then_averaged_over_seeds():
    from benchmarks.experiments.frontier_report import _seed_mean_curve

    rs = [{"reward_curve": [[0, 0.0], [1, 1.0], [2, None], [3, 1.0]]}, {"reward_curve": [[0, 1.0], [1, 1.0], [3, float("nan")]]}]
    assert _seed_mean_curve(rs, "reward_curve") == ([0, 1, 3], [0.5, 1.0, 1.0])  # missing and non-finite points are skipped
    assert _seed_mean_curve(rs, "reward_curve", 2) == ([0, 1, 3], [0.5, 0.75, 1.0])  # seed 0: 0, 0.5, 1 (its last two points)


def test_an_entropy_collapse_degrades_a_rung_the_training_reward_cannot_see():
    # the reward (of the groups still trained) holds while the policy goes deterministic
    cooling = [[i, 1.1 * 0.75 ** i] for i in range(20)]  # 5-step mean falls below a tenth of the first 5 steps'
    assert entropy_collapsed({"entropy_curve": cooling}) and not entropy_collapsed({"entropy_curve": [[i, 1.1 - 0.02 * i] for i in range(20)]})
    assert not entropy_collapsed({"entropy_curve": cooling[:5]})  # too short to tell
    assert entropy_collapsed({"entropy_curve": cooling[:14]})  # a cell the filtered-groups guard stopped early
    assert entropy_collapsed({"entropy_curve": [[i, 1.1 + 0.5 * i] for i in range(20)]})  # a blow-up toward uniform (lr too high)
    rows = [{**_row("a", r, s, 0.1, 0.1), "reward_curve": [[i, 0.2 + 0.02 * i] for i in range(20)],
             "train_reward_first5": 0.24, "train_reward_last5": 0.54 + 0.01 * s,
             "entropy_curve": cooling if (r == 1 and s == 1) else [[i, 1.0] for i in range(20)]} for r in (0, 1) for s in range(3)]
    result = frontier(rows, "reward")[("a", "updates")]
    assert collapses(rows[4], "reward") == 0 and result["rungs"][1]["entropy_collapses"] == 1
    assert learns(result["rungs"][0]) and result["first_degraded"] == 1 and result["highest_learning"] == 0




@pytest.mark.ray
@pytest.mark.engine
@pytest.mark.slow
def test_smoke_ladder_trains_every_cell_and_reports_the_frontier(ray_local, tiny_chat_model, tmp_path):
    grid = _grid("frontier_smoke.yaml")
    todo = cells(grid)
    archive = tmp_path / "archive.jsonl"
    rows = run(grid, tmp_path, {"given": str(tiny_chat_model)}, todo, archive=archive)
    assert sorted(r["cell"] for r in rows) == sorted(c.name for c in todo) and len(rows) == 8
    for r in rows:
        assert r["error"] is None, r["error"]
        assert r["gap_numerics_mean"] is not None and r["gap_numerics_mean"] > 0  # bf16 engine vs fp32 learner
        assert r["response_tokens_mean"] >= 1 and 0 <= r["truncated_frac"] <= 1 and r["kl_k3_numerics"] >= 0  # responses, KL per token
    tis = [r for r in rows if r["objective"] == "grpo_tis"]
    assert all(r["behaviour_capped_frac"] is not None for r in tis)  # the decoupled anchor's weight was applied
    split = [r for r in rows if r["rung"] == 1]
    assert all(r["gap_proximal_max"] is not None for r in split)  # two updates per batch: the drift within the step is measured
    pairs = {(r["objective"], r["seed"]): r["start_accuracy"] for r in rows if r["rung"] == 0}
    assert pairs[("grpo_tis", 0)] == pairs[("drpo", 0)] and pairs[("grpo_tis", 1)] == pairs[("drpo", 1)]  # paired draws at step 0
    text = report(rows, grid)
    assert "Common random numbers" in text and "| grpo_tis | mini_batches=2 | 2 |" in text
    pngs = plot(rows, grid, tmp_path)
    assert len(pngs) == 3 and all(p.read_bytes().startswith(b"\x89PNG") for p in pngs)
    page = tmp_path / "results.md"
    page.write_text(f"# Results\n\nprose\n\n{RESULTS_BEGIN}\n{RESULTS_END}\n\nmore prose\n")
    write_docs(page, rows, grid, tmp_path, str(HERE / "frontier_smoke.yaml"))
    assert page.read_text().startswith("# Results\n\nprose\n\n" + RESULTS_BEGIN) and page.read_text().endswith(RESULTS_END + "\n\nmore prose\n")
    stamps = {r["cell"]: (tmp_path / "cells" / r["cell"] / "metrics.jsonl").stat().st_mtime_ns for r in rows}
    assert run(grid, tmp_path, {"given": str(tiny_chat_model)}, todo) == rows  # resumed: nothing runs again
    assert stamps == {r["cell"]: (tmp_path / "cells" / r["cell"] / "metrics.jsonl").stat().st_mtime_ns for r in rows}
    # a fresh checkout has no run folders, only the archive: nothing runs again (no model is given) and the rows are the same
    assert [r["cell"] for r in map(json.loads, archive.read_text().splitlines())] == [c.name for c in todo]
    assert run(grid, tmp_path / "fresh", {}, todo, archive=archive) == rows and not (tmp_path / "fresh" / "cells").exists()


def test_archive_keeps_this_grids_cells_and_leaves_other_rows_alone(tmp_path):
    grid = _grid("frontier_smoke.yaml")
    a, b = cells(grid)[:2]
    base = base_overrides(grid, a)
    stale = {**a.row(), "base": base, "cell": b.name, "overrides": ["learner.optimizer.lr=0.5"], "final_accuracy": 0.9}  # another grid version's rung
    old_base = {**b.row(), "base": [*base, "train.steps=99"]}  # b as it is now, but from a grid whose base differed
    foreign = {"cell": "not-in-this-grid", "final_accuracy": 0.1}
    path = tmp_path / "archive.jsonl"
    write_archive(path, [{**a.row(), "base": base, "final_accuracy": 0.4}], [stale, old_base, foreign])
    kept, other = read_archive(path, grid)
    assert list(kept) == [a.name] and kept[a.name]["final_accuracy"] == 0.4 and other == [stale, old_base, foreign]
    rows = run(grid, tmp_path / "out", {}, [a], archive=path)  # a is finished: not run (no model is given), b's stale row is not its result
    assert [r["cell"] for r in rows] == [a.name]
    assert [json.loads(line) for line in path.read_text().splitlines()] == [kept[a.name], stale, old_base, foreign]  # nothing dropped
    path.write_text(path.read_text() + "{not json\n")
    with pytest.raises(ValueError, match=r"archive.jsonl:5: not a frontier cell row"):
        read_archive(path, grid)


@pytest.mark.parametrize("name", ["frontier.yaml", "frontier_words.yaml", "frontier_smoke.yaml"])
def test_every_cell_of_every_grid_is_a_valid_drpo_train_config_with_its_rung_applied(name, tmp_path):
    from controller.config import load_config

    grid = _grid(name)
    for cell in [*cells(grid), *calibration_cells(grid)]:
        cfg = load_config(overrides=[f"model.path={tmp_path}", *base_overrides(grid, cell), *cell.overrides, f"run_dir={tmp_path / cell.name}"])
        rung = {} if cell.rung == 0 else grid["ladder"][cell.dimension][cell.rung - 1]
        for key, value in rung.items():  # the rung's value reached the config
            node = cfg
            for part in key.split("."):
                node = getattr(node, part)
            assert node == value, (cell.name, key)
        assert cfg.seed == cell.seed
    if name == "frontier_words.yaml":  # the reasoning task reaches the experiments
        assert type(cfg.task).__name__ == "WordProblemTask" and cfg.rollout.reward.type == "math_verify"


def test_a_run_folder_from_another_base_is_moved_aside_not_reported(tmp_path):
    grid = _grid("frontier_smoke.yaml")
    a, b = cells(grid)[:2]
    for cell, base in ((a, ["train.steps=99"]), (b, base_overrides(grid, b))):
        (tmp_path / "cells" / cell.name).mkdir(parents=True)
        (tmp_path / "cells" / cell.name / "summary.json").write_text(json.dumps(
            {"base": base, "overrides": list(cell.overrides), "model": cell.model, "error": "stand-in", "collapses": 1}))
    rows = run(grid, tmp_path, {}, [], log=lambda *_: None)
    assert [r["cell"] for r in rows] == [b.name]  # b ran with this base; a's folder is kept aside, not reported
    assert (tmp_path / "cells" / f"{a.name}.stale-1" / "summary.json").is_file() and not (tmp_path / "cells" / a.name).exists()


def test_a_smollm2_grids_short_cells_report_into_their_own_block(tmp_path):
    # frontier_words.yaml: CPU-sized calibration cells measure the length rung's gap; no frontier cell ran
    grid = _grid("frontier_words.yaml")
    short = calibration_cells(grid)
    assert [c.setting for c in short] == grid["calibration"]["rungs"] * len(grid["calibration"]["objectives"])
    assert [c.objective for c in short[:3]] == ["drpo"] * 3  # one objective's rungs, then the next's
    from controller.config import load_config

    cfg = load_config(overrides=[f"model.path={tmp_path}", *base_overrides(grid, short[2]), *short[2].overrides])
    assert (cfg.train.steps, cfg.task.test_size, cfg.eval.samples_per_prompt, cfg.rollout.max_new_tokens) == (3, 8, 1, 768)
    rows = [{**c.row(), "error": None, "reward_curve": [[1, 0.1], [2, 0.2], [3, 0.1]], "response_tokens_mean": 100.0 * (1 + c.rung),
             "truncated_frac": 0.25 * c.rung, "gap_numerics_mean": 0.006, "gap_numerics_p99": 0.03, "gap_numerics_max": 0.07,
             "kl_k3_numerics": 0.001, "entropy_curve": [[1, 2.0], [2, 3.0], [3, 4.0]], "wall_seconds": 60.0} for c in short]
    text = report(rows, grid)
    assert "no frontier cell" in text and "Short SmolLM2 cells" in text and "Common random numbers" not in text
    assert "| drpo | max_new_tokens=768 | 3 | 300 | 0.5 | 3 | 0.006 / 0.03 / 0.07 | 0.001 | 0.3 |" in text  # per response: k3 x tokens  # the rung's responses next to its gap
    page = tmp_path / "results.md"
    begin, end = docs_markers(grid)
    assert begin != RESULTS_BEGIN
    page.write_text(f"# Results\n\n{RESULTS_BEGIN}\nthe default grid's block\n{RESULTS_END}\n\n{begin}\n{end}\n")
    write_docs(page, rows, grid, tmp_path, str(HERE / "frontier_words.yaml"))
    written = page.read_text()
    assert f"{RESULTS_BEGIN}\nthe default grid's block\n{RESULTS_END}" in written  # the default grid's block is untouched
    assert "max_new_tokens=384" in written.split(begin, 1)[1] and not (tmp_path / "results").exists()  # no plots: no frontier cell
    for bad in ({"objectives": ["nope"]}, {"rungs": ["length:9"]}):
        with pytest.raises(ValueError, match="does not have"):
            calibration_cells({**grid, "calibration": {**grid["calibration"], **bad}})
    words = str(HERE / "frontier_words.yaml")
    assert archive_of(grid, words, None) == ARCHIVE.parent / "frontier_words.jsonl" != archive_of(_grid(), str(HERE / "frontier.yaml"), None)
    assert archive_of(grid, words, "none") is None and archive_of(_grid("frontier_smoke.yaml"), str(HERE / "frontier_smoke.yaml"), None) is None
