#!/usr/bin/env bash
# Runs the full test suite in .venv (every marker: CI runs ray, engine and slow tests too; gpu tests
# skip themselves without a GPU), in DRPO_TEST_WORKERS processes (default 2, pytest-xdist): a
# test module's tests stay together in one process (`--dist loadfile`), so its module fixtures (a
# Ray cluster, an engine) start once, and modules go out in the order tests/conftest.py collects them
# (longest first; xdist would otherwise order them by their number of tests). DRPO_TEST_WORKERS=0
# runs everything in this process.
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
workers="${DRPO_TEST_WORKERS:-2}"
parallel=()
[ "$workers" != 0 ] && parallel=(-n "$workers" --dist loadfile --no-loadscope-reorder)
exec .venv/bin/python -m pytest "${parallel[@]}" "$@"
