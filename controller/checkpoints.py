"""A run folder's checkpoints: layout, naming, listing, the atomic write and retention.

    RUN_DIR/checkpoints/step-000012/   one per checkpointed step (zero-padded: names sort by step)
        <the learner's files>          written by the backend (learner/checkpoint.py: one file per rank)
        config.yaml                    the run's config, which --resume checks a changed config against
        controller.json                the controller's state; written last, so a folder holding it is complete

A step is written under ``.tmp-step-N`` and renamed into place; a step written again keeps its old
copy under ``.old-step-N`` until the new one is in place (``recover_replaced`` settles a driver that
died between the two renames). The newest ``keep`` complete checkpoints stay. The training loop,
run folders, export and evaluation all find checkpoints here.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Callable

from learner.checkpoint import CheckpointError, fsync_folder, write_durable

STATE_FILE = "controller.json"
CONFIG_FILE = "config.yaml"
REPLACED_PREFIX = ".old-"
"""A checkpoint of the same step being replaced waits under this name until the new one is in place."""
_STEP_RE = re.compile(r"step-\d+")


def checkpoint_folder(run_dir: str | Path, step: int) -> Path:
    """Where the checkpoint of ``step`` lives (complete once it holds STATE_FILE)."""
    return Path(run_dir) / "checkpoints" / f"step-{step:06d}"


def checkpoint_step(folder: Path) -> int:
    """The step of a checkpoint folder (the inverse of ``checkpoint_folder``)."""
    return int(folder.name.removeprefix("step-"))


def checkpoint_folders(run_dir: str | Path) -> list[Path]:
    """Every ``checkpoints/step-N`` folder, complete or not, oldest step first; anything else there
    (``step-000004.bad``, a user's own folder) is not a checkpoint."""
    found = [p for p in (Path(run_dir) / "checkpoints").glob("step-*") if p.is_dir() and _STEP_RE.fullmatch(p.name)]
    return sorted(found, key=checkpoint_step)


def complete_checkpoints(run_dir: str | Path) -> list[Path]:
    """Every complete checkpoint of a run folder, oldest step first."""
    return [p for p in checkpoint_folders(run_dir) if (p / STATE_FILE).is_file()]


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    done = complete_checkpoints(run_dir)
    return done[-1] if done else None


def write(run_dir: str | Path, step: int, save_learner: Callable[[Path], None], state: dict, config_text: str, keep: int) -> Path:
    """Write the checkpoint of ``step`` atomically and keep the newest ``keep``: ``save_learner(folder)``
    writes the learner's files into the temporary folder, then the config and ``state`` (the
    controller's, as JSON) follow, the state last."""
    root = Path(run_dir) / "checkpoints"
    final = checkpoint_folder(run_dir, step)
    tmp = root / f".tmp-{final.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_learner(tmp)
    write_durable(tmp / CONFIG_FILE, config_text)
    write_durable(tmp / STATE_FILE, json.dumps(state))  # last: a folder with it is complete
    replaced = final.with_name(f"{REPLACED_PREFIX}{final.name}")
    if final.exists():  # this step written again: the old copy goes only once the new one is in place
        shutil.rmtree(replaced, ignore_errors=True)
        os.replace(final, replaced)
    try:
        os.replace(tmp, final)
    except BaseException:
        if replaced.exists() and not final.exists():
            os.replace(replaced, final)
        raise
    fsync_folder(root)
    shutil.rmtree(replaced, ignore_errors=True)
    older = [p for p in checkpoint_folders(run_dir) if p != final]  # the one just written always stays
    for old in older[: max(0, len(older) - (keep - 1))]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def read_state(folder: str | Path) -> dict:
    """The controller's state of a checkpoint, or a CheckpointError that names the file and what to do."""
    path = Path(folder) / STATE_FILE
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(
            f"checkpoint state {path} is truncated or corrupt ({err}); resume from an earlier checkpoint by moving {Path(folder).name} "
            "out of checkpoints/"
        ) from None
    except OSError as err:
        raise CheckpointError(f"checkpoint state {path} is unreadable ({err})") from None


def recover_replaced(run_dir: str | Path) -> None:
    """A driver that died between moving a step's old checkpoint away and renaming the new one in:
    the old copy takes its place again (or goes, if the new one made it)."""
    for old in (Path(run_dir) / "checkpoints").glob(f"{REPLACED_PREFIX}step-*"):
        final = old.with_name(old.name.removeprefix(REPLACED_PREFIX))
        if (final / STATE_FILE).is_file():
            shutil.rmtree(old, ignore_errors=True)
        else:
            shutil.rmtree(final, ignore_errors=True)
            os.replace(old, final)
