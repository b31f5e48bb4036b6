"""The stability frontier's grid (frontier.yaml): its ladder of rungs and its cells.

A cell is the grid's base config plus one rung's overrides (plus its objective's and its seed), so
every rung of every dimension differs from the base in exactly one respect; rung 0 of every
dimension is the base itself, run once. ``calibration`` cells run SmolLM2 at a few rungs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from benchmarks.experiments.reporting import overrides

BASE = "base"


@dataclass(frozen=True)
class Cell:
    name: str
    objective: str
    dimension: str
    """The kind of pressure this cell's rung climbs ("base" for the common base)."""
    rung: int
    """0 for the base; 1.. up the dimension's ladder."""
    label: str
    seed: int
    overrides: tuple[str, ...]
    model: str = "standin"
    calibration: bool = False
    """A SmolLM2 gap-calibration cell (``calibration`` in the grid), not a frontier cell."""

    @property
    def setting(self) -> str:
        return BASE if self.rung == 0 else f"{self.dimension}:{self.rung}"

    def row(self) -> dict:
        return {"cell": self.name, "objective": self.objective, "dimension": self.dimension, "rung": self.rung, "label": self.label,
                "setting": self.setting, "seed": self.seed, "model": self.model, "calibration": self.calibration,
                "overrides": list(self.overrides)}


def rung_label(values: dict) -> str:
    return ", ".join(f"{k.split('.')[-1]}={v}" for k, v in values.items())


def rungs(grid: dict) -> list[tuple[str, int, dict]]:
    """(dimension, rung, overrides): the base once, then every dimension's rungs in order."""
    out = [(BASE, 0, {})]
    for dimension, ladder in grid["ladder"].items():
        for i, over in enumerate(ladder, start=1):
            if not isinstance(over, dict) or not over or "model" in over:
                raise ValueError(f"ladder.{dimension}[{i - 1}] must be a non-empty mapping of config overrides (the model is the grid's), got {over!r}")
            out.append((dimension, i, over))
    return out


def cells(grid: dict, only: set[str] | None = None, slices: list[str] | None = None) -> list[Cell]:
    """Every cell (objective x rung x seed), or those of ``slices`` ("base", "DIMENSION" for all
    its rungs, "DIMENSION:RUNG") and of the objectives in ``only``."""
    chosen = None if not slices else set(slices)
    known = {BASE} | set(grid["ladder"]) | {f"{d}:{r}" for d, r, _ in rungs(grid) if r}
    if chosen and chosen - known:
        raise ValueError(f"unknown slice(s) {sorted(chosen - known)}; the grid has {sorted(known)} and calibration "
                         "(DIMENSION:N is the dimension's N-th rung, 1-based)")
    names = {o["name"] for o in grid["objectives"]}
    if only and only - names:
        raise ValueError(f"unknown objective(s) {sorted(only - names)}; the grid has {sorted(names)}")
    out = []
    for dimension, rung, over in rungs(grid):
        if chosen and not ({dimension, f"{dimension}:{rung}"} & chosen):
            continue
        model = grid.get("model", "standin")
        for obj in grid["objectives"]:
            if only and obj["name"] not in only:
                continue
            for seed in grid["seeds"]:
                setting = BASE if rung == 0 else f"{dimension}{rung}"
                over_cell = [f"learner.objective={json.dumps(obj['objective'])}", *overrides(obj.get("overrides", {})),
                             *overrides(over), f"seed={seed}"]
                out.append(Cell(f"{obj['name']}-{setting}-s{seed}", obj["name"], dimension, rung, rung_label(over) or "base",
                                seed, tuple(over_cell), model))
    return out


def calibration_cells(grid: dict) -> list[Cell]:
    """SmolLM2 at a few rungs, one seed, for ``objective`` (or each of ``objectives``, one objective's
    rungs after another): its measured gap next to the stand-in's, or (a SmolLM2 grid) a few short
    cells that measure the rungs' gap where the full cells are too slow to run."""
    cal = grid.get("calibration")
    if not cal:
        return []
    by_key = {(BASE if r == 0 else f"{d}:{r}"): (d, r, o) for d, r, o in rungs(grid)}
    by_name = {o["name"]: o for o in grid["objectives"]}
    names = cal.get("objectives") or [cal["objective"]]
    unknown = [n for n in names if n not in by_name] + [k for k in cal["rungs"] if k not in by_key]
    if unknown:
        raise ValueError(f"calibration names {unknown}, which the grid does not have (objectives {sorted(by_name)}, rungs {sorted(by_key)})")
    out = []
    for obj in (by_name[n] for n in names):
        for key in cal["rungs"]:
            dimension, rung, over = by_key[key]
            over_cell = [f"learner.objective={json.dumps(obj['objective'])}", *overrides(obj.get("overrides", {})),
                         *overrides(over), f"seed={cal['seed']}"]
            setting = BASE if rung == 0 else f"{dimension}{rung}"
            out.append(Cell(f"smollm2-{obj['name']}-{setting}-s{cal['seed']}", obj["name"], dimension, rung, rung_label(over) or "base",
                            cal["seed"], tuple(over_cell), "smollm2", calibration=True))
    return out


def labels_of(grid: dict) -> dict:
    return {(d, r): (rung_label(o) if r else "base") for d, r, o in rungs(grid)}
