"""Atomic, weights_only checkpoints of one learner rank.

A checkpoint is written to a temporary file in the target's folder, flushed and fsynced, then
renamed over the target: a crash or a full disk mid-write leaves the previous checkpoint intact
(rename within one filesystem is atomic). Loading uses ``torch.load(weights_only=True)``, so a
file from elsewhere cannot run code; its metadata must match the model that loads it.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: corrupt, unreadable, or for another model."""


def save(path: str | Path, state: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_folder(path.parent)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_durable(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` through a fsynced temporary file renamed over it, then fsync the
    folder: after a crash the file is either the old one or the new one, whole."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_folder(path.parent)


def fsync_folder(folder: str | Path) -> None:
    """Make the renames and new files in ``folder`` durable (a no-op where folders cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def load(path: str | Path, mmap: bool = False) -> dict:
    """``mmap``: map the file instead of reading it (an export touches only the model tensors, not
    the optimizer state that makes up most of the file)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as err:  # torch raises several types for truncated or foreign files
        raise CheckpointError(f"checkpoint {path} is corrupt or not a drpo learner checkpoint: {err}") from None
    if not isinstance(state, dict) or "meta" not in state or "model" not in state:
        raise CheckpointError(f"checkpoint {path} is not a drpo learner checkpoint (no meta/model entries)")
    return state


def check_compatible(state: dict, meta: dict) -> None:
    if state["meta"] != meta:
        raise CheckpointError(f"checkpoint was written for {state['meta']}, this learner is {meta}")


STORAGE_DIR = ".drpo-storage"
"""Where the shared-storage check of a run's start leaves its markers (inside the run folder)."""


def write_storage_marker(run_dir: str | Path, who: str, nonce: str | None = None) -> str:
    """Write ``RUN_DIR/.drpo-storage/<who>`` holding ``nonce`` (a fresh one if None); returns it."""
    import uuid

    nonce = nonce or uuid.uuid4().hex
    folder = Path(run_dir) / STORAGE_DIR
    folder.mkdir(parents=True, exist_ok=True)
    (folder / who).write_text(nonce)
    return nonce


def read_storage_marker(run_dir: str | Path, who: str) -> str | None:
    try:
        return (Path(run_dir) / STORAGE_DIR / who).read_text().strip()
    except OSError:
        return None


def storage_probe(run_dir: str | Path, rank: int, expected: str) -> dict:
    """On a learner rank: what it sees of the driver's marker in ``run_dir``; if it is the expected
    one, the rank writes its own marker back for the driver to read."""
    import socket

    seen = read_storage_marker(run_dir, "driver")
    who = f"rank-{rank:05d}"
    if seen == expected:
        write_storage_marker(run_dir, who, expected)
    return {"rank": rank, "who": who, "nonce": seen, "path": str(run_dir), "host": socket.gethostname()}
