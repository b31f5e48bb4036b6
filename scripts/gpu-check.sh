#!/usr/bin/env bash
# The staged GPU check, for a machine with one NVIDIA GPU, no network and at most 64 MiB carried per
# call (the lent H200: Python 3.12, torch with CUDA, transformers; no Ray, pydantic, megatron-core).
# What drpo needs beyond that image travels in parts made here by `bash scripts/gpu-stage.sh`
# (.gpu-stage/MANIFEST.txt lists the calls, back to back: the machine keeps files for 30 s after each):
#   bash scripts/gpu-check.sh receive K   calls 1..N-1, carry [".gpu-stage/part-K"]: check part K, keep it
#   bash scripts/gpu-check.sh final       call N, carry the last part: receive it, join and check the
#                                         payload, install it (--no-index --no-deps --target), run the checks
#   bash scripts/gpu-check.sh dry         here, without a GPU: every call's steps on local folders, then
#                                         each GPU check named and skipped
# The checks, each under a deadline, one line each (PASS/FAIL/SKIP name (seconds): last line of its log
# that is not a library's warning):
#   cuda            torch sees a CUDA device
#   gpu-tests       the gpu-marked tests that need neither vLLM nor SGLang (tests/test_learner_gpu.py:
#                   megatron's distributed optimizer, its checkpoint and the exact next step)
#   train-resume    `drpo train` on SmolLM2: hf engine on CUDA, megatron learner in bf16 (distributed
#                   optimizer), learner and engine sharing the GPU (0.4 each), 5 steps and a checkpoint,
#                   then --resume for a 6th; then a throughput line (learner and engine tokens/s, MFU)
#   nccl-one-gpu    two processes on the one GPU: NCCL refuses them ("Duplicate GPU"), and the weight
#                   broadcast group, seeing the shared device, goes over gloo and delivers bit-exactly
#   train-broadcast `drpo train` with learner.weight_sync=broadcast on the shared GPU, 3 steps
#   train-vllm, train-sglang   as train-resume with that engine (fp8 rollout), where it is installed:
#                   on a CUDA host set up with the engine's extra; never on the lent machine
# GPU_CHECKS="NAME ..." runs only those checks (and the payload steps and cuda): a rerun of what failed.
# Work goes to $GPU_WORK (/tmp/drpo-gpu-work); $OUT gets what the device tool brings back (at most 8 files):
# summary.txt, logs.txt (every log's tail), throughput.txt and each run's metrics. Exit code: the number of FAILs.
set -uo pipefail
cd "$(dirname "$0")/.."
ACTION="${1:-}"
STAGE="${GPU_STAGE:-.gpu-stage}"
RECEIVED="${GPU_RECEIVED:-$STAGE/received}"
SITE="${GPU_SITE:-/tmp/drpo-gpu-site}"
OUT="${OUT:-/tmp/drpo-gpu-check}"  # what comes back: at most 8 files (collect, below)
WORK="${GPU_WORK:-/tmp/drpo-gpu-work}"  # logs, runs and the model's cache
PY="${PYTHON:-python3}"
export STAGE RECEIVED SITE WORK PY
mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 DRPO_CACHE="$WORK/cache"
fails=0
exec > >(tee "$OUT/summary.txt") 2>&1

last_line() {  # a log's last line that is not a library's warning (NCCL's exit warning would hide pytest's tally)
  grep -v -E '(Warning|warnings.warn)' "$1" | tail -n 1 | cut -c1-240
}

check() {  # check NAME SECONDS COMMAND...: runs it under a deadline, logs to $WORK/NAME.log, prints one line
  local name=$1 limit=$2 started=$SECONDS
  shift 2
  if [ -n "${GPU_CHECKS:-}" ] && [[ $name != receive* && " $GPU_CHECKS assemble install cuda " != *" $name "* ]]; then
    echo "SKIP $name: not in GPU_CHECKS"  # a rerun of the checks that failed: GPU_CHECKS="gpu-tests train-resume"
    return
  fi
  if timeout -k 10 "$limit" bash -c '"$@"' check "$@" >"$WORK/$name.log" 2>&1; then  # bash -c: the functions below, exported
    echo "PASS $name ($((SECONDS - started)) s): $(last_line "$WORK/$name.log")"
  else
    local rc=$?
    [ "$rc" = 124 ] && echo "deadline of $limit s passed" >>"$WORK/$name.log"
    echo "FAIL $name ($((SECONDS - started)) s): $(last_line "$WORK/$name.log")"
    fails=$((fails + 1))
  fi
}

payload() { "$PY" scripts/gpu_payload.py "$@" --out "$STAGE" --into "$RECEIVED"; }

parts() { "$PY" -c "import json, sys; print(len(json.load(open(sys.argv[1]))['parts']))" "$1"; }

install() {  # the joined payload into $SITE; off Python 3.12 (the dry run here) pip installs for 3.12 without running it
  local for312=()
  "$PY" -c "import sys; sys.exit(sys.version_info[:2] != (3, 12))" || for312=(--python-version 3.12 --implementation cp --only-binary=:all:)
  rm -rf "$SITE"
  "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "${for312[@]}" "$RECEIVED"/wheels/*.whl &&
    "$PY" - "$RECEIVED/wheels" "$SITE" <<'PY'
import pathlib, sys
wheels, site = map(pathlib.Path, sys.argv[1:])
names = [w.name.split("-")[0] + "-" + w.name.split("-")[1] for w in wheels.glob("*.whl")]
absent = [n for n in names if not (site / f"{n}.dist-info").is_dir()]
assert not absent, f"installed without their dist-info: {absent}"
print(f"{len(names)} distributions installed in {site}")
PY
}

train_and_resume() {  # ENGINE [--set ...]: 5 steps on SmolLM2, megatron learner in bf16 on CUDA, then --resume for a 6th
  local engine=$1 run="$WORK/run-$1"
  shift
  "$PY" -m controller.cli train --set "rollout.engine=$engine" --set learner.precision=bf16 "$@" \
    --set rollout.gpus_per_worker=0.4 --set learner_resources.gpus_per_worker=0.4 --set eval.at_start=false --set eval.every=0 \
    --set metrics.progress=false --set checkpoint.hf=false --set train.steps=5 --set "run_dir=$run" --overwrite &&
    "$PY" -m controller.cli train --resume "$run" --set train.steps=6 &&
    "$PY" - "$run" <<'PY'
import json, sys
import torch
from transformers import AutoConfig, AutoModelForCausalLM

run = sys.argv[1]
records = [json.loads(line) for line in open(f"{run}/metrics.jsonl")]
steps = [r for r in records if r["kind"] == "step"]
assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6], [r["step"] for r in steps]
assert [r["version"] for r in steps][-1] == 6, "the resumed run did not continue the policy version"
from rollout.offline_model import materialize_smollm2

config = AutoConfig.from_pretrained(materialize_smollm2())  # the folder the runs made (DRPO_CACHE)
with torch.device("meta"):
    params = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
peak = 989.4e12  # H200 (SXM) dense bf16 tensor-core peak
learner_tps = [r["learner/tokens_per_second"] for r in steps[1:] if "learner/tokens_per_second" in r]
engine_tps = [r["rollout/tokens_per_second"] for r in steps[1:] if "rollout/tokens_per_second" in r]
step_s = [r["step_seconds"] for r in steps[1:]]
mean = lambda xs: sum(xs) / max(len(xs), 1)
line = (f"steps 2-6: step {mean(step_s):.2f} s, learner {mean(learner_tps):.0f} tokens/s "
        f"(MFU {6 * params * mean(learner_tps) / peak:.2%} of 989 TFLOP/s, 6 x {params / 1e6:.1f} M params per token), "
        f"engine {mean(engine_tps):.0f} tokens/s; resume continued at step 6, reward {steps[-1]['reward/mean']:.3f}")
open(f"{run}.throughput.txt", "w").write(line + "\n")
print(line)
PY
}

nccl_one_gpu() {  # NCCL on two ranks of one GPU is refused; the broadcast group picks gloo and delivers
  # from a file, not stdin: torch.multiprocessing's spawned ranks import the main module by its path
  cat >"$WORK/nccl_one_gpu.py" <<'PY' && "$PY" "$WORK/nccl_one_gpu.py"
import os, tempfile
import torch
import torch.multiprocessing as mp

def nccl(rank, port, out):
    import torch.distributed as dist
    from datetime import timedelta
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timedelta(seconds=60))
    try:
        pg = dist.ProcessGroupNCCL(store, rank, 2)
        t = torch.ones(4, device="cuda")
        pg.broadcast(t, 0).wait()
        torch.cuda.synchronize()
        open(f"{out}.{rank}", "w").write("delivered")
    except Exception as e:
        open(f"{out}.{rank}", "w").write(f"refused: {str(e).splitlines()[0][:160]}")

def group(rank, port, out):
    from learner.weights import wire
    from learner.weights.broadcast import WeightBroadcastGroup
    torch.manual_seed(0)
    weights = {f"w{i}": torch.randn(256, 256, device="cuda", dtype=torch.bfloat16) for i in range(8)}
    g = WeightBroadcastGroup("127.0.0.1", port, rank, 2, timeout_s=60)
    if rank == 0:
        for bucket in wire.buckets(weights.items(), version=1, max_bytes=300_000):
            g.send(bucket)
        g.flush()
    else:
        version, got = wire.assemble(g.receive_publication())
        exact = all(torch.equal(got[n].to(w.device), w) for n, w in weights.items())
        open(out, "w").write(f"{g.backend} {'bit-exact' if exact else 'DIFFERENT'}")

if __name__ == "__main__":
    from learner.distributed import free_port
    out = tempfile.mktemp()
    mp.spawn(nccl, args=(free_port(), out), nprocs=2, join=True)
    raw = [open(f"{out}.{r}").read() for r in range(2)]
    print("plain NCCL, two ranks on one GPU:", raw)
    mp.spawn(group, args=(free_port(), out), nprocs=2, join=True)
    result = open(out).read()
    print("WeightBroadcastGroup:", result)
    assert result == "gloo bit-exact", result
PY
}

train_broadcast() {
  local run="$WORK/run-broadcast"
  "$PY" -m controller.cli train --set rollout.engine=hf --set learner.precision=bf16 --set rollout.precision=bf16 \
    --set learner.weight_sync=broadcast --set rollout.gpus_per_worker=0.4 --set learner_resources.gpus_per_worker=0.4 \
    --set eval.at_start=false --set eval.every=0 --set metrics.progress=false --set checkpoint.hf=false --set train.steps=3 \
    --set "run_dir=$run" --overwrite &&
    "$PY" - "$run" <<'PY'
import json, sys
steps = [r for r in map(json.loads, open(f"{sys.argv[1]}/metrics.jsonl")) if r["kind"] == "step"]
assert [r["step"] for r in steps] == [1, 2, 3], [r["step"] for r in steps]
print(f"3 steps with weights broadcast: publish {steps[-1].get('rollout/publish_seconds', float('nan')):.2f} s, "
      f"|pi-mu| {steps[-1].get('gap/numerics/abs_shift_mean', float('nan')):.4f}")
PY
}

export -f payload parts install train_and_resume nccl_one_gpu train_broadcast

CHECKS=(cuda gpu-tests train-resume nccl-one-gpu train-broadcast train-vllm train-sglang)
for name in ${GPU_CHECKS:-}; do  # a misspelled name would skip every check and pass
  [[ " ${CHECKS[*]} " == *" $name "* ]] || { echo "FAIL GPU_CHECKS: no check is named $name (checks: ${CHECKS[*]})"; exit 1; }
done

gpu_checks() {  # $1 = 1 when the GPU checks run, else each is named and skipped
  local names=("${CHECKS[@]}")
  if [ "$1" != 1 ]; then
    for name in "${names[@]}"; do echo "SKIP $name: dry run, no GPU here"; done
    return
  fi
  export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
  check cuda 60 "$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name(0), torch.__version__)"
  if ! "$PY" -c "import torch, sys; sys.exit(not torch.cuda.is_available())" >/dev/null 2>&1; then
    for name in "${names[@]:1}"; do echo "SKIP $name: no CUDA device"; done
    return
  fi
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >"$WORK/nvidia-smi.log" 2>&1
  check gpu-tests 120 "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/test_learner_gpu.py
  check train-resume 240 train_and_resume hf --set rollout.precision=bf16
  check nccl-one-gpu 90 nccl_one_gpu
  check train-broadcast 150 train_broadcast
  # on a CUDA host with the engines installed (their CUDA wheels are far larger than a call carries)
  for engine in vllm sglang; do
    if "$PY" -c "import $engine" >/dev/null 2>&1; then
      check "train-$engine" 420 train_and_resume "$engine" --set rollout.precision=fp8 --set rollout.fp8_block=64
    else
      echo "SKIP train-$engine: python module $engine is not installed here (its CUDA wheels exceed what a device call carries)"
    fi
  done
}

case "$ACTION" in
  receive)
    payload receive "${2:?receive needs the part number}" || exit 1
    ;;
  final)
    [ -f "$STAGE/MANIFEST.json" ] || cp "$(ls "$STAGE"/part-*/MANIFEST.json | tail -n 1)" "$STAGE/MANIFEST.json" 2>/dev/null
    last=$(parts "$STAGE/MANIFEST.json") || { echo "FAIL receive: no part of the payload is here (carry the last part)"; exit 1; }
    if [ -f "$STAGE/part-$(printf %02d "$last")/payload.part" ]; then
      check receive 60 payload receive "$last"
    fi
    check assemble 120 payload assemble
    [ "$fails" = 0 ] && check install 180 install
    [ "$fails" = 0 ] && gpu_checks 1
    ;;
  dry)
    [ -f "$STAGE/MANIFEST.json" ] || { echo "FAIL stage: $STAGE/MANIFEST.json is missing: run bash scripts/gpu-stage.sh first"; exit 1; }
    rm -rf "$RECEIVED"
    n=$(parts "$STAGE/MANIFEST.json")
    for k in $(seq 1 "$n"); do check "receive-$k" 60 payload receive "$k"; done
    check assemble 120 payload assemble
    [ "$fails" = 0 ] && check install 180 install
    gpu_checks 0
    ;;
  *)
    echo "usage: bash scripts/gpu-check.sh receive K | final | dry   (see the header; .gpu-stage/MANIFEST.txt lists the device calls)" >&2
    exit 2
    ;;
esac
collect() {  # into $OUT, which brings back at most 8 files: every log in one, and each run's metrics and throughput
  for log in "$WORK"/*.log; do [ -f "$log" ] && { echo "===== $(basename "$log")"; tail -n 400 "$log"; }; done >"$OUT/logs.txt"
  for run in "$WORK"/run-*; do
    [ -f "$run/metrics.jsonl" ] && cp "$run/metrics.jsonl" "$OUT/$(basename "$run").metrics.jsonl"
    [ -f "$run.throughput.txt" ] && cat "$run.throughput.txt" >>"$OUT/throughput.txt"
  done
  return 0
}
collect
echo "gpu-check: $fails failed (summary.txt, logs.txt, throughput.txt and each run's metrics in $OUT)"
exit "$fails"
