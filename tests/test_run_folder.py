"""One run per folder, resume that keeps a run's identity, retention, graceful stop and the shared-storage
check, through `drpo train --simulate` (the same Controller, run folder and checkpoint code as a real run)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
from pathlib import Path

import pytest

from controller.app import train
from controller.cli import main
from controller.config import ConfigError, load_config
from controller.checkpoints import complete_checkpoints
from controller.run_folder import RunFolderError, StorageError, check_shared
from controller.stop import Interrupted, StopRequest
from learner.checkpoint import storage_probe
from rollout.tasks import arithmetic_split
from tests.fault_checks import assert_ledger_exact
from tests.test_controller_sim import sim_config

FAST = ["--simulate", "--set", "metrics.port=null", "--set", "metrics.progress=false", "--set", "eval.every=0", "--set", "eval.at_start=false"]


def drpo_train(run_dir: Path, *args: str) -> int:
    return main(["train", *FAST, "--set", f"run_dir={run_dir}", *args])


def lines(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_second_run_into_an_occupied_folder_is_refused_by_name_and_overwrite_starts_clean(tmp_path, capsys):
    run_dir = tmp_path / "run"
    (tmp_path / "run").mkdir()
    (run_dir / "notes.txt").write_text("the user's own file")
    assert drpo_train(run_dir, "--set", "train.steps=4", "--set", "checkpoint.every=2") == 0
    before = (run_dir / "metrics.jsonl").read_text()
    capsys.readouterr()
    assert drpo_train(run_dir, "--set", "train.steps=1") == 2
    err = capsys.readouterr().err
    assert f"run folder {run_dir} already holds a run" in err and f"drpo train --resume {run_dir}" in err and "--overwrite" in err
    assert (run_dir / "metrics.jsonl").read_text() == before  # nothing of the first run was touched
    assert [p.name for p in complete_checkpoints(run_dir)] == ["step-000002", "step-000004"]
    first_id = json.loads((run_dir / "run.json").read_text())["run_id"]

    assert drpo_train(run_dir, "--set", "train.steps=1", "--overwrite") == 0
    assert [p.name for p in complete_checkpoints(run_dir)] == ["step-000001"]
    assert [r["step"] for r in lines(run_dir) if r["kind"] == "step"] == [1]  # no old lines
    assert json.loads((run_dir / "run.json").read_text())["run_id"] != first_id
    assert (run_dir / "notes.txt").read_text() == "the user's own file"  # overwrite deletes only what drpo wrote
    (run_dir / "eval").mkdir()
    (run_dir / "eval" / "mine.txt").write_text("kept")
    (run_dir / "eval" / "step-000001-greedy.json").write_text("{}")  # what `drpo eval` writes
    linked = tmp_path / "elsewhere"
    linked.mkdir()
    shutil.move(run_dir / "checkpoints", linked / "checkpoints")
    (run_dir / "checkpoints").symlink_to(linked / "checkpoints")  # checkpoints put on other storage
    assert drpo_train(run_dir, "--set", "train.steps=2", "--overwrite") == 0
    assert sorted(p.name for p in (run_dir / "eval").iterdir()) == ["mine.txt"]
    # the link is removed, never followed: its target keeps what it held, the new run writes a folder of its own
    assert [p.name for p in (linked / "checkpoints").iterdir()] == ["step-000001"]
    assert not (run_dir / "checkpoints").is_symlink() and [p.name for p in complete_checkpoints(run_dir)] == ["step-000002"]
    assert not any(p.name.startswith(".drpo-previous") for p in run_dir.rglob("*"))  # the old run is gone once the new one checkpointed
    assert main(["train", "--resume", str(run_dir), "--overwrite"]) == 2


def test_overwrite_refuses_a_folder_that_is_not_a_drpo_run_and_deletes_nothing(tmp_path, capsys):
    folder = tmp_path / "project"
    (folder / "mlruns").mkdir(parents=True)
    (folder / "mlruns" / "exp.txt").write_text("the user's MLflow runs")
    (folder / "config.yaml").write_text("the user's own config\n")
    assert drpo_train(folder, "--set", "train.steps=1", "--overwrite") == 2
    err = capsys.readouterr().err
    assert "not a drpo run folder" in err and "mlruns" in err and "config.yaml" in err
    assert (folder / "mlruns" / "exp.txt").read_text() == "the user's MLflow runs" and (folder / "config.yaml").read_text() == "the user's own config\n"
    assert sorted(p.name for p in folder.iterdir()) == ["config.yaml", "mlruns"]  # no lock, no run.json left behind


def test_an_overwrite_that_fails_to_start_leaves_the_old_run_whole_and_resumable(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert drpo_train(run_dir, "--set", "train.steps=2", "--set", "checkpoint.every=1") == 0
    before = {p.relative_to(run_dir): p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    from controller.config import SimulationConfig

    cfg = load_config(None, [v for v in FAST if v not in ("--simulate", "--set")] + [f"run_dir={run_dir}", "train.steps=3"])
    cfg = cfg.model_copy(update={"simulation": SimulationConfig()})  # what `drpo train --simulate` runs

    class Broken(Exception):
        pass

    def no_backend(*_):
        raise Broken("the new run's backend failed to start")

    import controller.app as app

    original, app.make_backend = app.make_backend, no_backend
    try:
        with pytest.raises(Broken):
            train(cfg, overwrite=True)
    finally:
        app.make_backend = original
    after = {p.relative_to(run_dir): p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    assert after == before  # byte for byte: metrics, run.json, config.yaml, both checkpoints
    assert main(["train", *FAST, "--resume", str(run_dir), "--set", "train.steps=3"]) == 0
    assert [r["step"] for r in lines(run_dir) if r["kind"] == "step"] == [1, 2, 3]


def test_an_overwrite_killed_before_its_first_checkpoint_gives_the_old_run_back_at_the_next_start(tmp_path, capsys):
    from controller.run_folder import ASIDE_FILE, set_aside

    run_dir = tmp_path / "run"
    assert drpo_train(run_dir, "--set", "train.steps=2", "--set", "checkpoint.every=1") == 0
    set_aside(run_dir)  # what --overwrite did before the driver was killed
    (run_dir / "metrics.jsonl").write_text('{"kind": "start"}\n')  # the new run's first line
    assert (run_dir / ASIDE_FILE).is_file() and not complete_checkpoints(run_dir)
    assert main(["train", *FAST, "--resume", str(run_dir), "--set", "train.steps=3"]) == 0
    assert "set aside is back" in capsys.readouterr().err
    assert [r["step"] for r in lines(run_dir) if r["kind"] == "step"] == [1, 2, 3]


def test_two_drivers_one_folder_the_second_refuses_naming_the_first_and_a_stale_lock_is_taken_over(tmp_path, capsys):
    import socket
    import subprocess
    import sys

    from controller.run_folder import LOCK_FILE, RunLock
    from tests.test_faults import REPO

    run_dir = tmp_path / "run"
    assert drpo_train(run_dir, "--set", "train.steps=1") == 0
    assert not (run_dir / LOCK_FILE).exists()  # released when the run ended
    first = RunLock(run_dir, heartbeat=0.2)  # a live driver: this process
    first.acquire()
    try:
        done = subprocess.run([sys.executable, "-m", "controller.cli", "train", *FAST, "--resume", str(run_dir), "--set", "train.steps=2"],
                              cwd=REPO, capture_output=True, text=True, timeout=300)
        assert done.returncode == 2 and "in use by another drpo driver" in done.stderr, done.stderr[-2000:]
        assert f"pid {os.getpid()}" in done.stderr and f"host {socket.gethostname()}" in done.stderr
        beat = json.loads((run_dir / LOCK_FILE).read_text())["heartbeat"]
        threading.Event().wait(0.5)
        assert json.loads((run_dir / LOCK_FILE).read_text())["heartbeat"] > beat  # the heartbeat moves
    finally:
        first.release()
    assert not (run_dir / LOCK_FILE).exists()

    # a driver that was killed on this host: its process is gone, the lock is taken over at once
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (run_dir / LOCK_FILE).write_text(json.dumps({"host": socket.gethostname(), "pid": dead.pid, "started": 1.0, "heartbeat": 1.0, "token": "x"}))
    capsys.readouterr()
    assert main(["train", *FAST, "--resume", str(run_dir), "--set", "train.steps=2"]) == 0
    assert "took over the lock" in capsys.readouterr().err and not (run_dir / LOCK_FILE).exists()
    # a driver on another host: refused while its heartbeat is fresh, taken over once it is stale
    import time

    other = {"host": "another-node", "pid": 1, "started": time.time(), "heartbeat": time.time(), "token": "y"}
    (run_dir / LOCK_FILE).write_text(json.dumps(other))
    assert main(["train", *FAST, "--resume", str(run_dir), "--set", "train.steps=3"]) == 2
    assert "host another-node" in capsys.readouterr().err
    (run_dir / LOCK_FILE).write_text(json.dumps({**other, "heartbeat": time.time() - 600}))
    assert main(["train", *FAST, "--resume", str(run_dir), "--set", "train.steps=3"]) == 0
    assert "no heartbeat for 600 s" in capsys.readouterr().err


def test_resume_refuses_a_changed_model_or_objective_family_by_name_and_a_moved_folder_continues_with_more_steps(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert drpo_train(run_dir, "--set", "train.steps=2", "--set", "checkpoint.every=1") == 0
    for change, field in (("model.path=/elsewhere/model", "model.path"), ("learner.objective.type=dppo_binary_tv", "learner.objective.type")):
        capsys.readouterr()
        assert main(["train", "--resume", str(run_dir), "--set", change]) == 2
        err = capsys.readouterr().err
        assert f"--resume: {field} is" in err and "step-000002" in err
    capsys.readouterr()
    assert main(["train", "--resume", str(run_dir)]) == 2
    assert "is already at step 2 (train.steps is 2); to train further, raise it" in capsys.readouterr().err
    for folder, why in ((tmp_path / "nowhere", "no such folder"), (tmp_path, "not a drpo run folder")):
        assert main(["train", "--resume", str(folder)]) == 2 and why in capsys.readouterr().err
    assert main(["train", "--resume", str(run_dir), "--set", f"run_dir={tmp_path}/x"]) == 2
    assert "drop --set run_dir" in capsys.readouterr().err
    moved = tmp_path / "moved"
    run_dir.rename(moved)  # an operator moves the run: it resumes where it now is
    run_dir = moved
    assert main(["train", "--resume", str(run_dir), "--set", "train.steps=4", "--set", "learner.optimizer.lr=1e-6"]) == 0
    assert load_config(run_dir / "config.yaml").run_dir == str(run_dir)
    steps = [r["step"] for r in lines(run_dir) if r["kind"] == "step"]
    assert steps == [1, 2, 3, 4]
    cfg = load_config(run_dir / "config.yaml")
    assert_ledger_exact(run_dir, [p.id for p in arithmetic_split("train", cfg.task.train_size)], cfg.seed, 4, cfg.train.prompts_per_step, 0)


def test_retention_never_deletes_the_newest_checkpoint_of_the_run(tmp_path):
    cfg = sim_config(tmp_path, steps=6, checkpoint_every=2)
    cfg = cfg.model_copy(update={"checkpoint": cfg.checkpoint.model_copy(update={"keep": 1})})
    train(cfg)
    root = Path(cfg.run_dir) / "checkpoints"
    assert [p.name for p in complete_checkpoints(cfg.run_dir)] == ["step-000006"]
    (root / "step-000099").mkdir()  # a foreign, higher-numbered folder that sorts last
    train(cfg.model_copy(update={"train": cfg.train.model_copy(update={"steps": 8})}), resume=True)
    assert (root / "step-000008" / "controller.json").is_file()


def test_a_run_dir_uri_is_refused_at_load_time(tmp_path):
    with pytest.raises(ConfigError, match="run_dir: Value error, must be a filesystem path"):
        load_config(None, ["run_dir=s3://bucket/runs/x"])


def test_sigterm_winds_a_run_down_with_a_checkpoint_and_resume_is_exact(tmp_path):
    cfg = sim_config(tmp_path, steps=100_000, max_staleness=2)
    stop = StopRequest()
    timer = threading.Timer(2.0, os.kill, (os.getpid(), signal.SIGTERM))
    with stop.handling_signals():
        timer.start()
        result = train(cfg, stop=stop)
    assert result.stopped_by == "SIGTERM" and 0 < result.steps < 100_000 and result.resume_step == result.steps
    record = [r for r in lines(Path(cfg.run_dir)) if r["kind"] == "stop"][-1]
    assert record == {**record, "signal": "SIGTERM", "step": result.steps, "abandoned": False}
    ids = [p.id for p in arithmetic_split("train", cfg.task.train_size)]
    assert_ledger_exact(Path(cfg.run_dir), ids, cfg.seed, result.steps, cfg.train.prompts_per_step, 2)  # in-flight work re-queued
    more = cfg.model_copy(update={"train": cfg.train.model_copy(update={"steps": result.steps + 3})})
    train(more, resume=True)
    assert_ledger_exact(Path(cfg.run_dir), ids, cfg.seed, result.steps + 3, cfg.train.prompts_per_step, 2)


def test_a_second_signal_or_one_during_start_up_stops_at_once():
    stop = StopRequest()
    with pytest.raises(Interrupted, match="SIGINT"):
        stop.request(signal.SIGINT)  # start-up: nothing to save yet
    stop.graceful = True
    stop.request(signal.SIGTERM)
    assert stop.requested and stop.name == "SIGTERM"
    with pytest.raises(Interrupted) as second:
        stop.request(signal.SIGTERM)
    assert second.value.signum == signal.SIGTERM
    stop.closing = True  # the driver is shutting Ray down: a signal must not cut that short
    stop.request(signal.SIGINT)


def test_the_storage_check_names_the_rank_that_sees_another_folder(tmp_path):
    shared, elsewhere = tmp_path / "shared", tmp_path / "node-local"
    shared.mkdir(), elsewhere.mkdir()

    def probe(nonce):  # rank 1 mounts something else at the run folder's path
        return [{**storage_probe(path, rank, nonce), "node": f"node-{rank}"} for rank, path in enumerate([shared, elsewhere])]

    with pytest.raises(StorageError, match=r"learner rank 1 on node node-1 .*found no marker"):
        check_shared(shared, probe)
    check_shared(shared, lambda nonce: [{**storage_probe(shared, r, nonce), "node": "n"} for r in range(2)])  # same folder: passes


def test_resume_of_a_folder_that_is_not_a_run_is_refused(tmp_path):
    cfg = sim_config(tmp_path, steps=1)
    with pytest.raises(RunFolderError, match="is not a drpo run folder"):
        train(cfg, resume=True)
    train(cfg)
    (Path(cfg.run_dir) / "run.json").unlink()  # as a drpo that gave runs no id left its folders
    with pytest.raises(RunFolderError, match="has a config.yaml but no run.json: .* cannot continue it. Start a new run"):
        train(cfg.model_copy(update={"train": cfg.train.model_copy(update={"steps": 2})}), resume=True)


def test_a_truncated_checkpoint_state_is_named_at_resume(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert drpo_train(run_dir, "--set", "train.steps=2", "--set", "checkpoint.every=1") == 0
    state = complete_checkpoints(run_dir)[-1] / "controller.json"
    state.write_text(state.read_text()[: len(state.read_text()) // 2])  # a crash mid-write on storage without fsync
    capsys.readouterr()
    assert main(["train", *FAST, "--resume", str(run_dir), "--set", "train.steps=3"]) == 2
    err = capsys.readouterr().err
    assert f"checkpoint state {state} is truncated or corrupt" in err and "step-000002 out of checkpoints/" in err


def test_a_checkpoint_of_the_same_step_replaces_the_old_one_only_once_it_is_complete(tmp_path, monkeypatch, capsys):
    import controller.checkpoints as checkpoints
    from controller.checkpoints import checkpoint_folder
    from controller.loop import Controller

    run_dir = tmp_path / "run"
    assert drpo_train(run_dir, "--set", "train.steps=2", "--set", "checkpoint.every=1") == 0
    final = checkpoint_folder(run_dir, 2)
    before = {p.name: p.read_bytes() for p in final.iterdir()}
    ctl = Controller.__new__(Controller)  # only what checkpoint() touches
    from controller.config import load_config as _load

    ctl.cfg = _load(run_dir / "config.yaml", [])
    ctl.step = 2

    class Failing(Exception):
        pass

    real = os.replace

    def replace(src, dst):
        if Path(dst) == final and Path(src).name.startswith(".tmp-"):
            raise Failing("the rename of the new checkpoint failed")
        return real(src, dst)

    class Backend:
        def save(self, folder):
            (Path(folder) / "learner-rank00000.pt").write_bytes(b"new")

    ctl.backend = Backend()
    ctl.sampler = ctl.ledger = ctl.staleness = None
    monkeypatch.setattr(Controller, "_start_bound", lambda self, f: 0)
    monkeypatch.setattr(checkpoints.os, "replace", replace)
    ctl.in_flight, ctl.buffer, ctl.eval_history, ctl.eval_rounds, ctl.version = {}, [], [], 0, 2

    class State:
        def state_dict(self, *a, **k):
            return {}

    ctl.sampler = ctl.ledger = ctl.staleness = State()
    with pytest.raises(Failing):
        ctl.checkpoint()
    assert {p.name: p.read_bytes() for p in final.iterdir()} == before  # the old step-2 is whole
    monkeypatch.setattr(checkpoints.os, "replace", real)
    # a driver killed between the two renames: the next start puts the old copy back
    os.replace(final, final.with_name(".old-" + final.name))
    assert main(["train", *FAST, "--resume", str(run_dir), "--set", "train.steps=3"]) == 0
    assert [r["step"] for r in lines(run_dir) if r["kind"] == "step"] == [1, 2, 3]


def test_an_overwrite_that_cannot_set_the_old_run_aside_puts_back_what_it_moved_and_deletes_nothing(tmp_path, monkeypatch, capsys):
    import controller.run_folder as run_folder

    run_dir = tmp_path / "run"
    assert drpo_train(run_dir, "--set", "train.steps=2", "--set", "checkpoint.every=1") == 0
    (run_dir / "eval").mkdir()
    (run_dir / "eval" / "step-000002-t1-n1.json").write_text("{}")
    before = {p.relative_to(run_dir): p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    real, calls = os.rename, []

    def rename(src, dst):
        calls.append(src)
        if len(calls) == 3:
            raise PermissionError(13, "Permission denied", str(src))
        return real(src, dst)

    monkeypatch.setattr(run_folder.os, "rename", rename)
    capsys.readouterr()
    assert drpo_train(run_dir, "--set", "train.steps=1", "--overwrite") == 2
    err = capsys.readouterr().err
    assert "could not set" in err and "the old run stays as it was" in err
    monkeypatch.setattr(run_folder.os, "rename", real)
    after = {p.relative_to(run_dir): p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    assert after == before
    assert main(["train", *FAST, "--resume", str(run_dir), "--set", "train.steps=3"]) == 0


def test_a_driver_whose_lock_was_taken_over_writes_no_checkpoint(tmp_path):
    from controller.run_folder import LOCK_FILE, RunLock, _held, check_held

    run_dir = tmp_path / "run"
    lock = RunLock(run_dir, heartbeat=0.1)
    lock.acquire()
    _held[run_dir.resolve()] = lock
    try:
        check_held(run_dir)  # held: fine
        record = json.loads((run_dir / LOCK_FILE).read_text())
        (run_dir / LOCK_FILE).write_text(json.dumps({**record, "token": "another-driver"}))  # taken over while we slept
        threading.Event().wait(0.5)
        assert lock.lost
        with pytest.raises(RunFolderError, match="another drpo driver took over"):
            check_held(run_dir)
    finally:
        del _held[run_dir.resolve()]
        lock.release()
    assert json.loads((run_dir / LOCK_FILE).read_text())["token"] == "another-driver"  # release leaves the other driver's lock


def test_a_new_run_refuses_a_folder_of_the_users_own_files_named_like_a_runs(tmp_path, capsys):
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "config.yaml").write_text("the user's own config\n")
    assert drpo_train(folder, "--set", "train.steps=1") == 2  # no --overwrite: still not replaced
    err = capsys.readouterr().err
    assert "holds files a run would write (config.yaml) but no run.json" in err
    assert (folder / "config.yaml").read_text() == "the user's own config\n" and sorted(p.name for p in folder.iterdir()) == ["config.yaml"]


def test_a_folder_in_checkpoints_that_is_not_a_step_is_not_taken_for_a_checkpoint(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert drpo_train(run_dir, "--set", "train.steps=4", "--set", "checkpoint.every=2") == 0
    newest = complete_checkpoints(run_dir)[-1]
    os.replace(newest, newest.with_name(newest.name + ".bad"))  # a user moved a corrupt checkpoint aside in place
    assert [p.name for p in complete_checkpoints(run_dir)] == ["step-000002"]
    assert main(["train", *FAST, "--resume", str(run_dir), "--set", "train.steps=5"]) == 0
    assert (run_dir / "checkpoints" / "step-000004.bad").is_dir()  # left alone, retention included
