"""The stability frontier: each objective on a ladder of off-policy pressure (from the repo root):

    .venv/bin/python -m benchmarks.experiments.frontier                          # every cell of frontier.yaml
    .venv/bin/python -m benchmarks.experiments.frontier --slice base,updates:3   # some rungs (run one after another)
    .venv/bin/python -m benchmarks.experiments.frontier --report --docs docs/results.md   # tables and plots of what ran

The ladder (``ladder`` in the grid file) climbs one kind of pressure at a time from one common base:
a cell is the base config plus one rung's overrides (plus its objective's and its seed), so every
rung of every dimension differs from the base in exactly one respect. Rung 0 of every dimension is
the base itself, run once. Cells of the same seed draw the same completions until their policies
differ (the engine's sampling is seeded per run seed, epoch, prompt and sample), so objectives are
compared on paired differences; the report measures what the pairing buys.

A cell runs as a real ``drpo train`` into OUT/cells/NAME; a finished cell is not run again, so an
interrupted slice resumes and slices add up. Each finished cell's summary row also goes to the
archive (ARCHIVE for the default grid, the grid's own ``archive`` for another; committed), which a fresh checkout
resumes and reports from. ``calibration`` cells run SmolLM2 at a few rungs to put its measured gap next to the
stand-in's (the stand-in is used because SmolLM2 takes ~40 s a step here); in a SmolLM2 grid (frontier_words.yaml)
they are short cells that measure its rungs' gap where its full cells are too slow to run.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import yaml

from benchmarks.experiments.frontier_grid import Cell, calibration_cells, cells
from benchmarks.experiments.frontier_report import plot, report, write_docs
from benchmarks.experiments.reporting import overrides
from benchmarks.experiments.run import HERE, run_cells


ARCHIVE = Path(__file__).resolve().parents[2] / "docs" / "results" / "frontier.jsonl"
"""The default grid's finished cells, one summary row each, committed with the page it builds: the
raw run folders (OUT/cells, ~1 MB a cell) are not kept in the repository, so this file is what lets
a later checkout add slices to what ran before and regenerate the report."""


def base_overrides(grid: dict, cell: Cell) -> list[str]:
    """The overrides a cell runs with before its own (the grid's base, and the calibration base for a
    calibration cell); the model's path is not among them (it is this machine's)."""
    calib = grid.get("calibration", {})
    return [*overrides(grid["base"]), *(overrides(calib.get("base", {})) if cell.calibration else [])]


def read_archive(path: Path | None, grid: dict) -> tuple[dict[str, dict], list[dict]]:
    """The archived rows that are cells of ``grid`` as it is now (same name, model, base and own
    overrides), by cell name; and the other rows (cells of another version of the grid), kept in the
    file untouched."""
    if path is None or not Path(path).is_file():
        return {}, []
    current = {c.name: c for c in [*cells(grid), *calibration_cells(grid)]}
    kept, other = {}, []
    for n, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            name = row["cell"]
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(f"{path}:{n}: not a frontier cell row ({err}); fix or remove that line") from err
        cell = current.get(name)
        if (cell is not None and row.get("model") == cell.model and row.get("overrides") == list(cell.overrides)
                and row.get("base") == base_overrides(grid, cell)):
            kept[name] = row
        else:
            other.append(row)
    return kept, other


def write_archive(path: Path, rows: list[dict], other: list[dict]) -> None:
    """Rewrite the archive atomically: ``rows`` (this grid's finished cells, in grid order) then ``other``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _replace_text(path, "".join(json.dumps(r, allow_nan=True) + "\n" for r in [*rows, *other]))


def _replace_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename (an interrupted write leaves the old file)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _stamp(cell: Cell, grid: dict) -> dict:
    """What a run folder records of the cell it ran: its base, own overrides and model."""
    return {"base": base_overrides(grid, cell), "overrides": list(cell.overrides), "model": cell.model}


def _finished_here(out: Path, grid: dict, cell: Cell, log) -> bool:
    """A finished run folder of ``cell`` that ran the cell as the grid defines it now (base, own
    overrides, model). A folder that ran something else, or does not say, or whose summary cannot be
    read, is moved aside to NAME.stale-N (kept) and the cell runs again."""
    folder = out / "cells" / cell.name
    done = folder / "summary.json"
    if not done.is_file():
        return False
    try:
        summary = json.loads(done.read_text())
        want = _stamp(cell, grid)  # a folder stamped before overrides and model were recorded says only its base
        same = summary.get("base") == want["base"] and all(summary.get(k, want[k]) == want[k] for k in ("overrides", "model"))
    except (OSError, ValueError, AttributeError):
        same = False
    if same:
        return True
    n = 1
    while folder.with_name(f"{cell.name}.stale-{n}").exists():
        n += 1
    folder.rename(folder.with_name(f"{cell.name}.stale-{n}"))
    log(f"{cell.name}: its run folder ran another version of the cell (or is unreadable); moved to {cell.name}.stale-{n}, the cell runs again")
    return False


def run(grid: dict, out: Path, models: dict[str, str], todo: list[Cell], log=print, archive: Path | None = None) -> list[dict]:
    """Run ``todo`` (finished cells, in OUT/cells or in ``archive``, are not run again), then return
    the rows of every finished cell of the grid. A cell's raw folder wins over its archived row (it is
    re-read, so new summary fields reach it); the archive is rewritten after every cell."""
    kept, other = read_archive(archive, grid)
    every = [*cells(grid), *calibration_cells(grid)]
    order, by_name = [c.name for c in every], {c.name: c for c in every}
    rows_by = dict(kept)

    def keep(row: dict | None = None) -> None:
        if row is not None:
            stamp = _stamp(by_name[row["cell"]], grid)
            rows_by[row["cell"]] = {**row, **stamp}
            done = out / "cells" / row["cell"] / "summary.json"  # the run folder records what it ran
            _replace_text(done, json.dumps({**json.loads(done.read_text()), **stamp}))
        if archive is not None:
            write_archive(archive, [rows_by[n] for n in order if n in rows_by], other)

    finished = [c for c in every if _finished_here(out, grid, c, log)]
    skipped = [c.name for c in todo if c.name in kept and not (out / "cells" / c.name / "summary.json").is_file()]
    if skipped:
        log(f"{len(skipped)} cell(s) already finished in {archive}: not run again")
    todo = [c for c in todo if c.name not in skipped]
    rows_by.update((r["cell"], {**r, **_stamp(by_name[r["cell"]], grid)})
                   for r in run_cells(finished, out, lambda c: [], grid["target_accuracy"], log))
    keep()  # the run folders' cells are in the archive before anything runs
    run_cells(todo, out, lambda c: [f"model.path={models[c.model]}", *base_overrides(grid, c)], grid["target_accuracy"], log, on_row=keep)

    rows = [rows_by[n] for n in order if n in rows_by]
    out.mkdir(parents=True, exist_ok=True)
    (out / "frontier.json").write_text(json.dumps(rows, indent=1))
    return rows


def archive_of(grid: dict, grid_path: str, given: str | None) -> Path | None:
    """The archive a run reads and writes: ``given`` ('none' for none), else ARCHIVE for the default
    grid, else the grid's own ``archive`` (a path from the repo root), else none."""
    if given:
        return None if given == "none" else Path(given)
    if Path(grid_path).resolve() == (HERE / "frontier.yaml").resolve():
        return ARCHIVE
    return ARCHIVE.parents[2] / grid["archive"] if grid.get("archive") else None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--grid", default=str(HERE / "frontier.yaml"))
    parser.add_argument("--out", help="the run folders (default: benchmarks/experiments/results/GRID_NAME)")
    parser.add_argument("--slice", help="comma-separated: base, DIMENSION (all its rungs), DIMENSION:RUNG, calibration")
    parser.add_argument("--only", help="comma-separated objective names")
    parser.add_argument("--report", action="store_true", help="run nothing: tables and plots of the cells already finished "
                        "(it still adds finished run folders' rows to the archive and moves stale folders aside)")
    parser.add_argument("--docs", help="also write the report block into this page (docs/results.md)")
    parser.add_argument("--archive", help=f"the finished cells' rows (default: {ARCHIVE.relative_to(ARCHIVE.parents[2])} for the default "
                        "grid, the grid's own `archive` (a path from the repo root) for another, else none); 'none' to use OUT/cells only")
    args = parser.parse_args()
    grid = yaml.safe_load(Path(args.grid).read_text())
    out = Path(args.out) if args.out else HERE / "results" / Path(args.grid).stem
    out.mkdir(parents=True, exist_ok=True)
    slices = args.slice.split(",") if args.slice else None
    calibrate = bool(slices and "calibration" in slices)
    slices = [s for s in slices or [] if s != "calibration"] or (None if not calibrate else [])
    todo = [] if args.report else [*(cells(grid, set(args.only.split(",")) if args.only else None, slices) if slices != [] else []),
                                   *(calibration_cells(grid) if calibrate or not args.slice else [])]

    from benchmarks.experiments.standin import StandinSpec, build_standin
    from controller.cli import _init_ray
    from controller.config import load_config
    from rollout.offline_model import materialize_smollm2

    models: dict[str, str] = {}
    if todo:  # report mode reads finished cells only: no model is built
        smollm2 = materialize_smollm2()
        models = {"smollm2": str(smollm2), "standin": str(build_standin(HERE / "results" / "standin", smollm2, StandinSpec(**grid.get("standin", {}))))}
        _init_ray(load_config())
    archive = archive_of(grid, args.grid, args.archive)
    rows = run(grid, out, models, todo, archive=archive)
    plot(rows, grid, out)
    text = report(rows, grid)
    (out / "frontier.md").write_text(text)
    print(text)
    if args.docs:
        write_docs(Path(args.docs), rows, grid, out, args.grid)


if __name__ == "__main__":
    main()
