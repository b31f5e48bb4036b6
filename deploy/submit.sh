#!/usr/bin/env bash
# Submit a drpo training run to a Ray cluster as a Ray job.
#
#   RAY_ADDRESS=http://HEAD:8265 deploy/submit.sh [--config FILE] [--set KEY=VALUE ...]
#
# RAY_ADDRESS is the head's job API (the dashboard port, 8265 by default); it defaults to
# http://127.0.0.1:8265. RUNTIME_ENV picks the runtime_env file (default deploy/runtime_env.yaml),
# PYTHON the interpreter on the cluster (default python). The job's driver joins the cluster
# (Ray sets RAY_ADDRESS for it), so `drpo train` places its learner and rollout placement groups
# on the cluster's nodes. Extra arguments go to `drpo train`; with none, the cluster preset runs.
# Waits for the job and exits with its status (--no-wait via SUBMIT_FLAGS=--no-wait). A head that
# has just started may answer "No available agent to submit job": the submission is retried then
# (SUBMIT_RETRIES times, 5 s apart), and only then.
# The cluster is expected to run with token authentication (deploy/README.md): the ray CLI sends the
# token from RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token (RAY_AUTH_MODE=disabled for a
# cluster without it), and reports no usage.
set -euo pipefail
cd "$(dirname "$0")/.."
export RAY_ADDRESS="${RAY_ADDRESS:-http://127.0.0.1:8265}"
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-token}" RAY_USAGE_STATS_ENABLED=0
RUNTIME_ENV="${RUNTIME_ENV:-deploy/runtime_env.yaml}"
PYTHON="${PYTHON:-python}"
if [ "$#" -eq 0 ]; then
    set -- --config controller/presets/cluster-gpu.yaml
fi
RAY="${RAY:-ray}"
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
for _ in $(seq 1 "${SUBMIT_RETRIES:-12}"); do
    set +e
    "$RAY" job submit --address "$RAY_ADDRESS" --runtime-env "$RUNTIME_ENV" ${SUBMIT_FLAGS:-} \
        -- "$PYTHON" -m controller.cli train "$@" 2>&1 | tee "$log"
    status="${PIPESTATUS[0]}"
    set -e
    if [ "$status" -eq 0 ] || ! grep -q "No available agent to submit job" "$log"; then
        exit "$status"
    fi
    echo "submit.sh: the head's job agent is not ready yet; retrying in 5 s" >&2
    sleep 5
done
exit 1
