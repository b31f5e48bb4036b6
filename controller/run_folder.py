"""A run folder holds exactly one run: its identity, what a new run may overwrite, what a resume
must keep, and the check that every node of a cluster sees the same folder.

    RUN_DIR/run.json         the run's id (written once, when the run starts)
    RUN_DIR/config.yaml      the config of the latest start (each checkpoint keeps its own copy)
    RUN_DIR/metrics.jsonl    every session's lines, appended
    RUN_DIR/checkpoints/     step-N folders (learner rank parts, controller.json, config.yaml)
    RUN_DIR/.drpo-storage/   the shared-storage markers of the latest start

A new run refuses a folder that already holds another run's metrics or checkpoints (unless told to
overwrite, which deletes only what drpo wrote there: OWNED); ``--resume`` refuses a checkpoint whose model,
task, objective family or learner layout differ from the config.
"""

from __future__ import annotations

import json
import shutil
import socket
import time
import uuid
from pathlib import Path

import yaml

from controller.config import RunConfig, dotted, dump
from controller.loop import CONFIG_FILE, STATE_FILE, checkpoint_step, complete_checkpoints
from learner.checkpoint import STORAGE_DIR, read_storage_marker, write_storage_marker

RUN_FILE = "run.json"
OWNED = (
    "checkpoints/step-*", "checkpoints/.tmp-step-*", "metrics.jsonl", CONFIG_FILE, RUN_FILE, STORAGE_DIR, "hf/step-*",
    "eval/step-*.json", "report/*.html", "report/*.png", "tensorboard/events.out.tfevents.*", "wandb/*run-*", "wandb/latest-run",
    "mlruns",
)
"""What a run writes into its folder (globs): what ``overwrite`` deletes. Anything else there, the
user's own files in those sub-folders included, stays."""
IDENTITY = ("model", "task", "learner.objective.type", "learner.parallel")
"""Config fields a resumed run must keep (dotted prefixes): the weights, the prompts the ledger
counts, the objective family and the rank layout of the checkpoint's parts. Everything else (steps,
learning rate and other schedules, evaluation, checkpoint cadence, objective hyper-parameters) may
change on resume."""


class RunFolderError(ValueError):
    """A run folder that cannot be used as asked; the message names it and the ways on."""


def prepare(cfg: RunConfig, resume: bool, overwrite: bool = False) -> Path | None:
    """Make ``cfg.run_dir`` ready for this start; returns the checkpoint to resume from (None: from
    step 0). A new run refuses an occupied folder (``overwrite``: delete what drpo wrote first)."""
    run_dir = Path(cfg.run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise RunFolderError(f"run_dir {run_dir} is a file, not a folder")
    if resume:
        return _prepare_resume(cfg, run_dir)
    held = occupant(run_dir)
    if held and not overwrite:
        raise RunFolderError(
            f"run folder {run_dir} already holds a run ({held}). Continue it with `drpo train --resume {run_dir}`, "
            f"or give this run another folder (--set run_dir=...), or start over in it with --overwrite "
            "(deletes what drpo wrote there: checkpoints, metrics, exports, eval results, logger files; nothing else)"
        )
    if overwrite:
        for pattern in OWNED:
            for path in run_dir.glob(pattern):
                shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
    run_dir.mkdir(parents=True, exist_ok=True)
    _new_identity(run_dir)
    (run_dir / CONFIG_FILE).write_text(dump(cfg))
    return None


def occupant(run_dir: Path) -> str | None:
    """What of another run ``run_dir`` holds (checkpoints, metrics lines), or None."""
    parts = []
    checkpoints = sorted((run_dir / "checkpoints").glob("step-*"))
    if checkpoints:
        parts.append(f"{len(checkpoints)} checkpoint(s), newest {checkpoints[-1].name}")
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size:
        with metrics.open("rb") as f:
            parts.append(f"metrics.jsonl with {sum(1 for _ in f)} lines")
    return ", ".join(parts) or None


def _prepare_resume(cfg: RunConfig, run_dir: Path) -> Path | None:
    """The latest complete checkpoint, or None for a run stopped before its first one (it starts over
    at step 0 in the same folder)."""
    if not (run_dir / RUN_FILE).is_file() and not (run_dir / CONFIG_FILE).is_file():
        raise RunFolderError(f"--resume: {run_dir} is not a drpo run folder (no {RUN_FILE} or {CONFIG_FILE})")
    done = complete_checkpoints(run_dir)
    checkpoint = done[-1] if done else None
    if checkpoint is None and any((run_dir / "checkpoints").glob("step-*")):
        raise RunFolderError(f"--resume: no complete checkpoint under {run_dir / 'checkpoints'} (each step-N lacks {STATE_FILE})")
    saved = checkpoint / CONFIG_FILE if checkpoint is not None and (checkpoint / CONFIG_FILE).is_file() else run_dir / CONFIG_FILE
    if saved.is_file():
        check_compatible(yaml.safe_load(saved.read_text()) or {}, cfg.model_dump(mode="json"), saved)
    if checkpoint is not None and checkpoint_step(checkpoint) >= cfg.train.steps:
        raise RunFolderError(
            f"--resume: {run_dir} is already at step {checkpoint_step(checkpoint)} (train.steps is {cfg.train.steps}); "
            f"to train further, raise it: --set train.steps=N"
        )
    if not (run_dir / RUN_FILE).is_file():  # a folder from before run ids
        _new_identity(run_dir)
    (run_dir / CONFIG_FILE).write_text(dump(cfg))
    return checkpoint


def _at(tree: dict, dotted: str):
    for key in dotted.split("."):
        tree = tree.get(key) if isinstance(tree, dict) else None
    return tree


def check_compatible(saved: dict, config: dict, source: Path) -> None:
    """Refuse to resume under a config whose identity fields (IDENTITY) differ from ``saved``'s. A
    field the saved config lacks was added since it was written and keeps its default."""
    task = saved.get("task") or {}
    if task.get("type", "arithmetic") == "arithmetic" and "extra_eval_size" not in task:
        raise RunFolderError(
            f"--resume: {source} was written before the arithmetic task kept its eval facts out of training (2026-12-01): "
            "this version generates other training prompts under the same ids, so the run cannot continue its prompt "
            "ledger. Start a new run (another run_dir, or --overwrite)"
        )
    for field in IDENTITY:
        old, new = dotted(_at(saved, field), field), dotted(_at(config, field), field)
        for key in sorted(set(old) | set(new)):
            if key not in old and key in new:
                continue
            if old.get(key) != new.get(key):
                raise RunFolderError(
                    f"--resume: {key} is {new.get(key)!r} in this config but the checkpoint was trained with {old.get(key)!r} "
                    f"({source}). A resumed run keeps its model, task, objective family and learner layout; steps, schedules and "
                    "evaluation may change. Start a different run in another folder (--set run_dir=...)"
                )


def _new_identity(run_dir: Path) -> None:
    (run_dir / RUN_FILE).write_text(json.dumps({"run_id": uuid.uuid4().hex, "created": time.time(), "host": socket.gethostname()}) + "\n")


class StorageError(RuntimeError):
    """The run folder is not the same storage on every node that writes to it."""


def check_shared(run_dir: str | Path, probe) -> None:
    """The driver writes a marker; ``probe(nonce)`` has every learner rank read it and write its own
    back (``learner.checkpoint.storage_probe``), returning what each saw; the driver then reads the
    ranks' markers. Any rank that saw a different folder fails the start, named with its node."""
    run_dir = Path(run_dir)
    nonce = write_storage_marker(run_dir, "driver")
    advice = (
        "a cluster run needs run_dir on storage every node mounts at the same path (NFS, EFS, Lustre, a "
        "CSI volume; see deploy/README.md)"
    )
    for seen in probe(nonce):
        where = f"learner rank {seen['rank']} on node {seen['node']} (host {seen['host']})"
        if seen["nonce"] != nonce:
            found = "no marker" if seen["nonce"] is None else f"another run's marker {seen['nonce'][:8]}"
            raise StorageError(f"{where} does not see the run folder the driver writes: at {seen['path']} it found {found}; {advice}")
        if read_storage_marker(run_dir, seen["who"]) != nonce:
            raise StorageError(f"the driver does not see what {where} wrote into {seen['path']}; {advice}")
