"""What the experiments report with: statistics over cells' rows that skip missing and non-finite
values, markdown tables, the docs page's generated block and its plots, and cells' --set strings.
The first grid (run.py), the stability frontier (frontier.py, frontier_report.py) and the
mechanism study (benchmarks/mechanism) all use these, and nothing here knows either study."""

from __future__ import annotations

import json
import math
import shutil
import statistics
from pathlib import Path

COLLAPSE_DROP = 0.5
"""A collapse: held-out accuracy falls below half its best so far, or the loss or gradient norm is not finite."""


def overrides(values: dict) -> list[str]:
    """--set strings; values as JSON, which YAML reads back unchanged (null, numbers, mappings)."""
    return [f"{k}={json.dumps(v)}" for k, v in values.items()]


def finite(values) -> list[float]:
    return [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]


def mean(values):
    got = finite(values)
    return sum(got) / len(got) if got else None


def largest(values):
    return max(finite(values), default=None)


def sd(values):
    got = finite(values)
    return statistics.stdev(got) if len(got) > 1 else None


def se(values) -> float | None:
    """Standard error of the mean of the finite values."""
    got = finite(values)
    return statistics.stdev(got) / math.sqrt(len(got)) if len(got) > 1 else None


def fmt(v, digits=3):
    return "–" if v is None else (f"{v:.{digits}g}" if isinstance(v, float) else str(v))


def markdown(head: list[str], lines: list[list]) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(fmt(v) if not isinstance(v, str) else v for v in line) + " |" for line in lines]
    return "\n".join(out) + "\n"


def copy_assets(path: Path, out: Path, names, prefix: str = "") -> Path:
    """Copy the plots ``names`` from ``out`` into the page's assets folder (PAGE_STEM/ beside it), as PREFIX + name."""
    assets = Path(path).parent / Path(path).stem
    assets.mkdir(parents=True, exist_ok=True)
    for name in names:
        shutil.copy(Path(out) / name, assets / (prefix + name))
    return assets


def replace_block(path: Path, begin: str, end: str, body: str) -> None:
    """Write ``body`` between the page's ``begin`` and ``end`` markers, keeping the text around them
    (a missing page is created with only the block; a page without the markers is refused)."""
    path = Path(path)
    old = path.read_text() if path.is_file() else f"# Results\n\n{begin}\n{end}\n"
    if begin not in old or end not in old:
        raise ValueError(f"{path} has no '{begin}' ... '{end}' block to replace")
    head, rest = old.split(begin, 1)
    path.write_text(head + begin + body + end + rest.split(end, 1)[1])
