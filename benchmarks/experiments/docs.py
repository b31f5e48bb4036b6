"""Regenerate docs/results.md's tables and plots in one command (from the repo root):

    .venv/bin/python -m benchmarks.experiments.docs            # docs/results.md

Rewrites the frontier blocks (frontier.yaml's and frontier_words.yaml's) from the cells that have
finished (runs none: ``benchmarks.experiments.frontier --slice ...`` runs them) and the mechanism study's block (reruns
the study: a few minutes). The first grid's block (``benchmarks.experiments.run --docs``) is left as
it is: it is regenerated only by rerunning that grid. Prose outside the blocks is kept.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--docs", default="docs/results.md")
    parser.add_argument("--frontier-out", default=None, help="the frontier's results folder (default: the frontier's own)")
    args = parser.parse_args()
    from benchmarks.experiments import frontier
    from benchmarks.mechanism import study

    sys.argv = ["frontier", "--report", "--docs", args.docs] + (["--out", args.frontier_out] if args.frontier_out else [])
    frontier.main()
    sys.argv = ["frontier", "--grid", str(frontier.HERE / "frontier_words.yaml"), "--report", "--docs", args.docs]  # its own block
    frontier.main()
    sys.argv = ["study", "--docs", args.docs]
    study.main()
    print(f"wrote {Path(args.docs)}")


if __name__ == "__main__":
    main()
