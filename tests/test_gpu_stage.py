"""The staged GPU check's transport, run here end to end: scripts/gpu-stage.sh cuts a payload of
wheels into parts with checksums and a manifest of device calls; scripts/gpu-check.sh receives
each part, joins and checks them, installs the wheels with pip (--no-index --no-deps --target),
and in its dry mode names and skips every GPU check."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GPU_CHECKS = ["cuda", "gpu-tests", "train-resume", "nccl-one-gpu", "train-broadcast", "train-vllm", "train-sglang"]


def make_wheel(folder: Path, name: str, payload: bytes) -> Path:
    """A pure-Python wheel holding ``name/__init__.py`` and ``name/data.bin`` (``payload``, stored uncompressed)."""
    dist = f"{name}-1.0.dist-info"
    files = {
        f"{name}/__init__.py": b"from pathlib import Path\nDATA = (Path(__file__).parent / 'data.bin').read_bytes()\n",
        f"{name}/data.bin": payload,
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n".encode(),
        f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(
        f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},{len(data)}\n"
        for path, data in files.items()
    ) + f"{dist}/RECORD,,\n"
    wheel = folder / f"{name}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_STORED) as z:
        for path, data in {**files, f"{dist}/RECORD": record.encode()}.items():
            z.writestr(path, data)
    return wheel


def run(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})})


@pytest.fixture
def staged(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    big = os.urandom(int(2.5 * 2**20))  # random: the parts are byte ranges of it, no compression hides a damaged one
    make_wheel(wheels, "probe_big", big)
    make_wheel(wheels, "probe_small", b"small")
    stage = tmp_path / "stage"
    done = run(["bash", "scripts/gpu-stage.sh", "--wheels", str(wheels), "--part-mib", "1", "--out", str(stage)])
    assert done.returncode == 0, done.stderr
    env = {"GPU_STAGE": str(stage), "GPU_RECEIVED": str(tmp_path / "received"), "GPU_SITE": str(tmp_path / "site"),
           "GPU_WORK": str(tmp_path / "work"), "OUT": str(tmp_path / "out"), "PYTHON": sys.executable}
    return stage, env, big, done.stdout


def test_the_payload_goes_in_parts_and_installs_from_them_in_the_dry_run(staged, tmp_path):
    stage, env, big, printed = staged
    manifest = json.loads((stage / "MANIFEST.json").read_text())
    n = len(manifest["parts"])
    assert n == 3 and all(p["bytes"] <= 2**20 for p in manifest["parts"])  # 2.5 MiB of wheels and a tar's headers
    assert manifest["wheels"] == ["probe_big-1.0-py3-none-any.whl", "probe_small-1.0-py3-none-any.whl"]
    assert [c["command"] for c in manifest["commands"]] == ["bash scripts/gpu-check.sh receive 1", "bash scripts/gpu-check.sh receive 2",
                                                           "bash scripts/gpu-check.sh final"]
    assert [c["carry"] for c in manifest["commands"]] == [[".gpu-stage/part-01"], [".gpu-stage/part-02"], [".gpu-stage/part-03"]]
    assert printed.startswith("3 device calls") and "3. run: bash scripts/gpu-check.sh final" in printed
    for part in manifest["parts"]:  # each part travels with the manifest that checks it
        assert json.loads((stage / part["name"] / "MANIFEST.json").read_text()) == manifest

    done = run(["bash", "scripts/gpu-check.sh", "dry"], env)
    lines = done.stdout.splitlines()
    assert done.returncode == 0, done.stdout + done.stderr
    assert [line.split()[:2] for line in lines[:n + 2]] == [["PASS", f"receive-{k}"] for k in range(1, n + 1)] + [["PASS", "assemble"], ["PASS", "install"]]
    assert [line.split(":")[0] for line in lines[n + 2:-1]] == [f"SKIP {name}" for name in GPU_CHECKS]
    assert lines[-1].startswith("gpu-check: 0 failed")
    back = Path(env["OUT"])  # what a device call brings back: the summary and every log in one file
    assert (back / "summary.txt").read_text() == done.stdout
    assert "===== install.log" in (back / "logs.txt").read_text() and len(list(back.iterdir())) <= 8
    installed = subprocess.run([sys.executable, "-c", "import sys, probe_big, probe_small; sys.stdout.buffer.write(probe_big.DATA)"],
                               capture_output=True, env={**os.environ, "PYTHONPATH": env["GPU_SITE"]}, timeout=60)
    assert installed.returncode == 0 and installed.stdout == big  # the bytes that went in, out of the installed package


def test_a_damaged_or_missing_part_is_named(staged, tmp_path):
    stage, env, _, _ = staged
    assert run(["bash", "scripts/gpu-check.sh", "receive", "1"], env).returncode == 0
    part = stage / "part-02" / "payload.part"
    data = bytearray(part.read_bytes())
    data[1000] ^= 0xFF
    part.write_bytes(bytes(data))
    damaged = run(["bash", "scripts/gpu-check.sh", "receive", "2"], env)
    assert damaged.returncode != 0 and "part 2 arrived damaged" in damaged.stderr + damaged.stdout
    final = run(["bash", "scripts/gpu-check.sh", "final"], env)  # brings part 3; part 2 never arrived
    assert final.returncode != 0
    assert "FAIL assemble" in final.stdout and "parts [2] were not received" in (Path(env["GPU_WORK"]) / "assemble.log").read_text()
    assert "install" not in final.stdout  # nothing is installed from an incomplete payload


def test_parts_too_large_for_one_call_are_refused_by_name(tmp_path):
    done = run(["bash", "scripts/gpu-stage.sh", "--wheels", str(tmp_path), "--part-mib", "63", "--out", str(tmp_path / "stage")])
    assert done.returncode != 0 and "--part-mib" in done.stderr and "64 MiB" in done.stderr
