#!/usr/bin/env bash
# Runs the full test suite in .venv (every marker: CI runs ray, engine and slow tests too; gpu tests
# skip themselves without a GPU), in DRPO_TEST_WORKERS processes (default 2, pytest-xdist): a
# test module's tests stay together in one process (`--dist loadfile`), so its module fixtures (a
# Ray cluster, an engine) start once. DRPO_TEST_WORKERS=0 runs everything in this process.
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
workers="${DRPO_TEST_WORKERS:-2}"
parallel=()
[ "$workers" != 0 ] && parallel=(-n "$workers" --dist loadfile)
exec .venv/bin/python -m pytest "${parallel[@]}" "$@"
