#!/usr/bin/env bash
# Runs the full test suite in .venv (every marker: CI runs ray, engine and slow tests too; gpu tests
# skip themselves without a GPU). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python -m pytest "$@"
