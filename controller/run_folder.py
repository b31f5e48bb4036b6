"""A run folder holds exactly one run: its identity, what a new run may overwrite, what a resume
must keep, and the check that every node of a cluster sees the same folder.

    RUN_DIR/run.json         the run's id (written once, when the run starts)
    RUN_DIR/config.yaml      the config of the latest start (each checkpoint keeps its own copy)
    RUN_DIR/metrics.jsonl    every session's lines, appended
    RUN_DIR/checkpoints/     step-N folders (learner rank parts, controller.json, config.yaml)
    RUN_DIR/.drpo-storage/   the shared-storage markers of the latest start
    RUN_DIR/.drpo-lock       the driver that uses the folder now (RunLock)

One driver at a time: RunLock is taken before anything is written and refuses a second driver by
name. A new run refuses a folder that already holds another run's metrics or checkpoints; with
``--overwrite`` it sets what the old run wrote (OWNED, never through a symlink) aside and deletes it
only once the new run has written its first checkpoint, so a new run that fails to start leaves the
old one whole. ``--resume`` refuses a checkpoint whose model, task, objective family or learner
layout differ from the config.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import threading
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

import yaml

from controller.config import RunConfig, dotted, dump
from controller.checkpoints import (
    CONFIG_FILE, STATE_FILE, checkpoint_folders, checkpoint_step, complete_checkpoints, read_state, recover_replaced,
)
from learner.checkpoint import STORAGE_DIR, read_storage_marker, write_durable, write_storage_marker

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


LOCK_FILE = ".drpo-lock"
LOCK_HEARTBEAT_SECONDS = 10.0
"""How often the driver holding a run folder rewrites its lock's heartbeat."""
LOCK_STALE_SECONDS = 120.0
"""A lock whose heartbeat is older than this (on another host; on this one, a lock whose process is
gone) belongs to a driver that died: the next driver takes it over, saying so."""
ASIDE_FILE = ".drpo-previous.json"
"""The list of an overwritten run's paths set aside (original -> moved), until the new run's first checkpoint."""
ASIDE_PREFIX = ".drpo-previous."


class RunFolderError(ValueError):
    """A run folder that cannot be used as asked; the message names it and the ways on."""


class RunLock:
    """One driver per run folder: a lock file created with O_EXCL (atomic on local disks and NFS v3+)
    holding the driver's host, pid, start time and a heartbeat that a thread rewrites (by rename, so a
    reader never sees half a file). A second driver is refused naming the holder; a lock whose holder
    is gone (on this host: its process; elsewhere: a heartbeat older than ``stale_after``) is taken
    over with a message. ``release`` removes the lock if it is still this driver's."""

    def __init__(self, run_dir: str | Path, stale_after: float = LOCK_STALE_SECONDS, heartbeat: float = LOCK_HEARTBEAT_SECONDS):
        """Cross-host staleness compares the holder's heartbeat with this host's clock: keep the
        hosts' clocks in step (NTP) well within ``stale_after``."""
        self.path = Path(run_dir) / LOCK_FILE
        self.stale_after, self.interval = stale_after, heartbeat
        self.token = uuid.uuid4().hex
        self.lost = False
        """Another driver took the lock over (this one's heartbeat had stopped for ``stale_after``)."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _record(self) -> dict:
        me = _process_start()
        return {"host": socket.gethostname(), "pid": os.getpid(), "started": me, "heartbeat": time.time(), "token": self.token,
                "command": " ".join(sys.argv)[:300]}

    def acquire(self) -> None:
        if self.path.parent.exists() and not self.path.parent.is_dir():
            raise RunFolderError(f"run_dir {self.path.parent} is a file, not a folder")
        self._created = not self.path.parent.exists()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._read()
                why = self._stale(holder)
                if why is None:
                    raise RunFolderError(f"run folder {self.path.parent} is in use by another drpo driver ({describe_holder(holder)}); "
                                         "two drivers would overwrite each other's checkpoints. Wait until it ends (after `ray job stop` "
                                         "it may still checkpoint for a few minutes) and start again; a lock whose driver is gone is "
                                         f"taken over at once on the same host, and from another host once its heartbeat is "
                                         f"{self.stale_after:.0f} s old") from None
                aside = self.path.with_name(f"{LOCK_FILE}.stale-{self.token}")
                try:
                    os.rename(self.path, aside)  # exactly one taker wins the rename
                except FileNotFoundError:
                    continue
                try:
                    moved = json.loads(aside.read_text())
                except (OSError, ValueError):
                    moved = {}
                if moved.get("token") != holder.get("token"):  # another driver's fresh lock, made after we read the stale one
                    try:
                        os.link(aside, self.path)  # put it back unless yet another lock is there now
                    except OSError:
                        pass
                    aside.unlink(missing_ok=True)
                    continue
                aside.unlink(missing_ok=True)
                print(f"drpo train: took over the lock of run folder {self.path.parent} from a driver that is gone "
                      f"({describe_holder(holder)}: {why})", file=sys.stderr)
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(self._record(), f)
                f.flush()
                os.fsync(f.fileno())
            break
        else:
            raise RunFolderError(f"run folder {self.path.parent}: could not take its lock {self.path} (other drivers keep taking it)")
        self._thread = threading.Thread(target=self._beat, name="drpo-run-lock", daemon=True)
        self._thread.start()

    def _read(self) -> dict:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}  # being created just now, or unreadable: judged by the file's age

    def _stale(self, holder: dict) -> str | None:
        """Why ``holder``'s lock may be taken over, or None while it is held."""
        now = time.time()
        if not holder:
            try:
                age = now - self.path.stat().st_mtime
            except FileNotFoundError:
                return "its lock is gone"
            return f"an unreadable lock {age:.0f} s old" if age > self.stale_after else None
        if holder.get("host") == socket.gethostname():
            pid = holder.get("pid")
            if _process_start(pid) is None or abs(_process_start(pid) - holder.get("started", 0)) > 1.0:
                return f"process {pid} is not running"
            return None
        age = now - float(holder.get("heartbeat", 0))
        return f"no heartbeat for {age:.0f} s" if age > self.stale_after else None

    def _beat(self) -> None:
        tmp = self.path.with_name(f"{LOCK_FILE}.{self.token}.tmp")
        while not self._stop.wait(self.interval):
            if self._read().get("token") not in (self.token, None):
                self.lost = True
                print(f"drpo train: another driver took over the lock of run folder {self.path.parent} "
                      f"({describe_holder(self._read())}): this driver's heartbeat had stopped", file=sys.stderr)
                return
            try:
                tmp.write_text(json.dumps(self._record()))
                os.replace(tmp, self.path)
            except OSError as err:  # a full disk or a storage hiccup: the next beat tries again
                print(f"drpo train: could not refresh the lock of {self.path.parent}: {err}", file=sys.stderr)

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._read().get("token") == self.token:
            self.path.unlink(missing_ok=True)
        if getattr(self, "_created", False):
            try:
                self.path.parent.rmdir()  # a folder this driver made and left empty (a start refused early)
            except OSError:
                pass


def describe_holder(holder: dict) -> str:
    if not holder:
        return "holder unknown: the lock file is empty or unreadable"
    beat = time.time() - float(holder.get("heartbeat", 0))
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(holder.get("started") or 0)))
    return f"host {holder.get('host')}, pid {holder.get('pid')}, started {started}, last heartbeat {beat:.0f} s ago"


def _process_start(pid: int | None = None) -> float | None:
    """When process ``pid`` (default: this one) started, or None if it is not running."""
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError, TypeError):
        return None


_held: dict[Path, RunLock] = {}


def check_held(run_dir: str | Path) -> None:
    """Before writing a checkpoint: refuse if another driver took this process's lock over (its
    heartbeat had stopped long enough to look dead); two drivers would overwrite each other."""
    lock = _held.get(Path(run_dir).resolve())
    if lock is not None and lock.lost:
        raise RunFolderError(
            f"another drpo driver took over run folder {lock.path.parent} while this one was not heartbeating; this driver "
            "stops without writing (resume from that driver's checkpoints once it ends)"
        )


@contextmanager
def holding(run_dir: str | Path):
    """Hold ``run_dir``'s RunLock inside (re-entrant in one process: the CLI takes it before Ray
    starts, ``controller.app.train`` inside); released on every way out."""
    key = Path(run_dir).resolve()
    if key in _held:
        yield _held[key]
        return
    lock = _held[key] = RunLock(run_dir)
    try:
        lock.acquire()
    except BaseException:
        del _held[key]
        raise
    try:
        yield lock
    finally:
        del _held[key]
        lock.release()


def prepare(cfg: RunConfig, resume: bool, overwrite: bool = False) -> Path | None:
    """Make ``cfg.run_dir`` ready for this start; returns the checkpoint to resume from (None: from
    step 0). A new run refuses an occupied folder (``overwrite``: delete what drpo wrote first)."""
    run_dir = Path(cfg.run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise RunFolderError(f"run_dir {run_dir} is a file, not a folder")
    settle_aside(run_dir)  # an overwrite that never reached its first checkpoint: the old run comes back
    recover_replaced(run_dir)
    if resume:
        return _prepare_resume(cfg, run_dir)
    held = occupant(run_dir)
    foreign = [p for p in owned(run_dir) if p.name != LOCK_FILE] if run_dir.is_dir() and not (run_dir / RUN_FILE).is_file() else []
    if foreign and not overwrite:
        names = ", ".join(str(p.relative_to(run_dir)) for p in foreign[:5])
        raise RunFolderError(
            f"run folder {run_dir} holds files a run would write ({names}) but no {RUN_FILE}: it is not a drpo run folder, and "
            "a new run would replace them. Give this run a folder of its own (--set run_dir=...)"
        )
    if held and not overwrite:
        raise RunFolderError(
            f"run folder {run_dir} already holds a run ({held}). Continue it with `drpo train --resume {run_dir}`, "
            f"or give this run another folder (--set run_dir=...), or start over in it with --overwrite "
            "(deletes what drpo wrote there: checkpoints, metrics, exports, eval results, logger files; nothing else)"
        )
    if overwrite:
        links = [p for p in owned(run_dir) if p.is_symlink()]
        set_aside(run_dir)
        if held:
            print(f"drpo train: --overwrite: the run in {run_dir} ({held}) is set aside; it is deleted when this run writes its "
                  "first checkpoint, and comes back if this run ends before that", file=sys.stderr)
        for link in links:
            print(f"drpo train: --overwrite: {link} was a symlink; the link is removed with the old run and its target is left "
                  f"alone; this run writes {link.name}/ inside the run folder", file=sys.stderr)
    run_dir.mkdir(parents=True, exist_ok=True)
    _new_identity(run_dir)
    (run_dir / CONFIG_FILE).write_text(dump(cfg))
    return None


def owned(run_dir: Path) -> list[Path]:
    """What drpo wrote into ``run_dir`` (OWNED), never reached through a symlink: a path below a
    symlinked folder stands for that link (removing the link leaves its target alone)."""
    found: dict[Path, None] = {}
    for pattern in OWNED:
        for path in sorted(run_dir.glob(pattern)):
            rel = path.relative_to(run_dir)
            for depth in range(1, len(rel.parts) + 1):
                part = run_dir.joinpath(*rel.parts[:depth])
                if part.is_symlink() or depth == len(rel.parts):
                    if not part.name.startswith(ASIDE_PREFIX):
                        found[part] = None
                    break
    return list(found)


def set_aside(run_dir: Path) -> None:
    """``--overwrite``: rename what the old run wrote (``owned``) beside itself, under ASIDE_PREFIX;
    ``discard_aside`` deletes it at the new run's first checkpoint and ``settle_aside`` renames it
    back if the new run ends without one. ASIDE_FILE lists the renames, written before the first
    one ("moving") and marked done after the last ("aside"), so a crash in between is undone by
    renaming back, never by deleting. Refuses a folder whose drpo-like files are not a drpo run's
    (no run.json)."""
    paths = owned(run_dir)
    if not paths:
        return
    if not (run_dir / RUN_FILE).is_file():
        names = ", ".join(str(p.relative_to(run_dir)) for p in paths[:5])
        raise RunFolderError(
            f"--overwrite: {run_dir} holds files drpo would replace ({names}) but no {RUN_FILE}: it is not a drpo run folder, and "
            "--overwrite replaces only a drpo run. Give this run a folder of its own (--set run_dir=...), or move those files yourself"
        )
    # beside itself: the same filesystem, even below a mount point
    plan = [[str(p.relative_to(run_dir)), str(p.with_name(ASIDE_PREFIX + p.name).relative_to(run_dir))] for p in paths]
    write_durable(run_dir / ASIDE_FILE, json.dumps({"phase": "moving", "moved": plan}))
    for original, aside in plan:
        try:
            os.rename(run_dir / original, run_dir / aside)
        except OSError as err:  # the start's cleanup (settle_aside) renames back what moved; nothing is deleted
            raise RunFolderError(f"--overwrite: could not set {run_dir / original} of the old run aside ({err}); the old run stays as it was") from None
    write_durable(run_dir / ASIDE_FILE, json.dumps({"phase": "aside", "moved": plan}))


def _aside_plan(run_dir: Path) -> tuple[str, list] | None:
    listed = run_dir / ASIDE_FILE
    if not listed.is_file():
        return None
    record = json.loads(listed.read_text())
    return record["phase"], record["moved"]


def _exists(path: Path) -> bool:
    return path.exists() or path.is_symlink()


def discard_aside(run_dir: str | Path) -> None:
    """The new run has its first checkpoint: delete the old run set aside (a symlink: the link only).
    Best effort: what cannot be deleted is named and stays listed for the next start to retry."""
    run_dir = Path(run_dir)
    plan = _aside_plan(run_dir)
    if plan is None:
        return
    left = []
    for original, aside in plan[1]:
        try:
            if _exists(run_dir / aside):
                _remove(run_dir / aside)
        except OSError as err:
            left.append([original, aside])
            print(f"drpo train: could not delete {run_dir / aside} of the overwritten run ({err}); the next start tries again",
                  file=sys.stderr)
    if left:
        write_durable(run_dir / ASIDE_FILE, json.dumps({"phase": "discarding", "moved": left}))
    else:
        (run_dir / ASIDE_FILE).unlink()


def settle_aside(run_dir: Path) -> None:
    """An overwrite left an old run aside. Interrupted while setting it aside: rename back what was
    moved, delete nothing. Set aside, and the new run checkpointed (or it was being discarded):
    delete it. Set aside and the new run did not checkpoint: remove what the new run wrote and
    rename the old run back, so it is whole and resumable again."""
    plan = _aside_plan(run_dir)
    if plan is None:
        return
    phase, moved = plan
    if phase == "discarding" or (phase == "aside" and complete_checkpoints(run_dir)):
        discard_aside(run_dir)
        return
    if phase == "aside":
        for path in owned(run_dir):  # the new run's files (the old run's are all aside)
            _remove(path)
    for original, aside in moved:
        if _exists(run_dir / aside) and not _exists(run_dir / original):
            os.rename(run_dir / aside, run_dir / original)
    (run_dir / ASIDE_FILE).unlink()
    print(f"drpo train: {run_dir}: the run an --overwrite had set aside is back (the new run ended before its first checkpoint)", file=sys.stderr)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def occupant(run_dir: Path) -> str | None:
    """What of another run ``run_dir`` holds (checkpoints, metrics lines), or None."""
    parts = []
    checkpoints = checkpoint_folders(run_dir)
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
    if not (run_dir / RUN_FILE).is_file():
        raise RunFolderError(
            f"--resume: {run_dir} has a {CONFIG_FILE} but no {RUN_FILE}: it was written by a drpo that gave runs no id, and this "
            "one cannot continue it. Start a new run (another run_dir, or --overwrite)"
        )
    done = complete_checkpoints(run_dir)
    checkpoint = done[-1] if done else None
    if checkpoint is None and checkpoint_folders(run_dir):
        raise RunFolderError(f"--resume: no complete checkpoint under {run_dir / 'checkpoints'} (each step-N lacks {STATE_FILE})")
    if checkpoint is not None:
        read_state(checkpoint)  # a truncated or corrupt state fails by name here, before any engine or learner starts
    saved = checkpoint / CONFIG_FILE if checkpoint is not None and (checkpoint / CONFIG_FILE).is_file() else run_dir / CONFIG_FILE
    if saved.is_file():
        check_compatible(yaml.safe_load(saved.read_text()) or {}, cfg.model_dump(mode="json"), saved)
    if checkpoint is not None and checkpoint_step(checkpoint) >= cfg.train.steps:
        raise RunFolderError(
            f"--resume: {run_dir} is already at step {checkpoint_step(checkpoint)} (train.steps is {cfg.train.steps}); "
            f"to train further, raise it: --set train.steps=N"
        )
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
            f"--resume: {source} was written by a drpo whose arithmetic task drew training prompts from its eval facts: "
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
