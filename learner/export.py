"""Learner checkpoints -> a Hugging Face model folder, offline (no process group, no Ray).

A checkpoint folder holds one ``learner-rankNNNNN.pt`` per learner rank, each with that rank's
megatron tensors (tensor-parallel shards, expert-parallel local experts) and its ``layout``. The
full model is put back together here the way ``Learner.full_megatron_state`` gathers it live:
tensor-parallel shards concatenated along their split dimension, local experts renamed to their
global index; data-parallel replicas are identical and one is taken. The bridge turns that into
Hugging Face names; the non-weight files (config, tokenizer, chat template, generation config) come
from the model folder the run started from, whose architecture must be the checkpoint's.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from learner import bridge
from learner.checkpoint import CheckpointError, load
from learner.model import ModelArch

RANK_FILE = "learner-rank{rank:05d}.pt"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
"""Files of the source folder that hold weights (not copied: the export writes its own)."""
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def rank_states(folder: str | Path, world_size: int | None = None) -> list[dict]:
    """Every rank's checkpoint in ``folder``, in rank order; ``world_size``: how many must be there."""
    folder = Path(folder)
    files = sorted(folder.glob("learner-rank*.pt"))
    if not files and world_size is None:
        raise CheckpointError(f"{folder} holds no learner-rank*.pt files: not a drpo checkpoint")
    expected = [folder / RANK_FILE.format(rank=r) for r in range(world_size or len(files))]
    missing = [p.name for p in expected if not p.is_file()]
    if missing:
        raise CheckpointError(f"checkpoint {folder} is incomplete: {', '.join(missing)} missing")
    states = [load(p, mmap=True) for p in expected]
    if any(s["meta"]["arch"] != states[0]["meta"]["arch"] for s in states):
        raise CheckpointError(f"the rank files in {folder} were written for different models")
    return states


def _layout(state: dict) -> dict:
    """A rank's layout (checkpoints older than the ``layout`` entry: tensor parallelism only)."""
    meta = state["meta"]
    return state.get("layout") or {"tp_rank": meta["tp_rank"], "tp_size": meta["tp_size"], "ep_rank": 0, "ep_size": 1}


def merge(states: list[dict]) -> tuple[dict[str, torch.Tensor], ModelArch]:
    """The full megatron state dict (and the architecture) from every rank's checkpoint."""
    arch = ModelArch(**states[0]["meta"]["arch"])
    by_place: dict[tuple[int, int], dict] = {}
    for s in states:
        lay = _layout(s)
        by_place.setdefault((lay["ep_rank"], lay["tp_rank"]), s)  # data-parallel replicas are equal
    tp_size, ep_size = _layout(states[0])["tp_size"], _layout(states[0])["ep_size"]
    places = {(e, t) for e in range(ep_size) for t in range(tp_size)}
    if set(by_place) != places:
        raise CheckpointError(f"the rank files cover (expert, tensor) places {sorted(by_place)}, expected {sorted(places)}")
    full: dict[str, torch.Tensor] = {}
    for ep_rank in range(ep_size):
        shards = [by_place[(ep_rank, t)]["model"] for t in range(tp_size)]
        for name in shards[0]:
            is_expert = ".mlp.experts.local_experts." in name
            if ep_rank and not is_expert:
                continue  # dense tensors: every expert-parallel rank holds the same ones
            tensor = bridge.unshard(name, [s[name] for s in shards])
            if is_expert and ep_size > 1:
                name = bridge.expert_global_name(name, ep_rank, ep_size, arch.num_experts)
            full[name] = tensor
    return full, arch


def check_same_model(arch: ModelArch, source: str | Path) -> None:
    """Raise if the model folder ``source`` is not the architecture the checkpoint was trained on."""
    found = ModelArch.from_hf_folder(source)
    if found != arch:
        diff = {k: (v, getattr(found, k)) for k, v in arch.__dict__.items() if getattr(found, k) != v}
        raise CheckpointError(f"the checkpoint was trained on another model than {source} (checkpoint vs folder: {diff})")


def export(checkpoint: str | Path, source: str | Path, out_dir: str | Path, dtype: str = "fp32", world_size: int | None = None) -> Path:
    """Write a Hugging Face folder for the learner checkpoint in ``checkpoint`` (a step folder) to
    ``out_dir`` (new or empty), with the non-weight files of ``source``; weights in ``dtype``.
    Written into a temporary sibling and renamed, so ``out_dir`` is either complete or absent."""
    from safetensors.torch import save_file

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise FileExistsError(f"{out_dir} exists and is not an empty folder; choose a new output folder (or remove it)")
    full, arch = merge(rank_states(checkpoint, world_size))
    check_same_model(arch, source)
    hf = {name: t.to(DTYPES[dtype]).contiguous() for name, t in bridge.megatron_to_hf(full, arch)}
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    umask = os.umask(0)
    os.umask(umask)
    try:
        for f in Path(source).iterdir():
            if f.is_file() and not f.name.endswith(WEIGHT_SUFFIXES) and f.name != "model.safetensors.index.json":
                shutil.copy2(f, tmp / f.name)
        save_file(hf, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = json.loads((tmp / "config.json").read_text())
        for key in [k for k in ("dtype", "torch_dtype") if k in config] or ["torch_dtype"]:
            config[key] = str(DTYPES[dtype]).removeprefix("torch.")
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for f in tmp.iterdir():  # mkdtemp makes the folder private; a model folder is meant to be shared
            f.chmod(0o666 & ~umask)
        tmp.chmod(0o777 & ~umask)
        if out_dir.exists():
            out_dir.rmdir()
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
