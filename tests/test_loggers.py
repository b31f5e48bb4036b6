"""metrics.loggers: a real run's step, eval and gap metrics reach TensorBoard event files, an offline
W&B run folder and a local MLflow store, and read back equal to metrics.jsonl."""

from __future__ import annotations

import json
import math
import sys

import pytest

from controller.app import train
from controller.config import MetricsConfig
from controller.loggers import build
from tests.test_controller_e2e import run_config
from tests.wandb_records import history

pytestmark = [pytest.mark.ray, pytest.mark.engine, pytest.mark.slow]
KEYS = ("gap/abs_shift_mean", "reward/mean", "learner/loss", "staleness/lag_mean")


@pytest.fixture(scope="module")
def logged(ray_local, tiny_chat_model, module_tmp):
    tmp = module_tmp("loggers")
    cfg = run_config(tmp, tiny_chat_model, steps=3)
    cfg = cfg.model_copy(update={
        "metrics": cfg.metrics.model_copy(update={"loggers": ["tensorboard", "wandb", "mlflow"], "project": "drpo-test"}),
        "eval": cfg.eval.model_copy(update={"every": 2}),
    })
    result = train(cfg)
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in records if r["kind"] == "step"}
    evals = {r["step"]: r["accuracy"] for r in records if r["kind"] == "eval"}
    assert sorted(steps) == [1, 2, 3] and sorted(evals) == [0, 2, 3]
    return result.run_dir, steps, evals


def _same(got: float, want: float) -> bool:
    return (math.isnan(got) and math.isnan(want)) or got == pytest.approx(want, rel=1e-6, abs=1e-7)


def test_tensorboard_event_files_hold_the_runs_metrics(logged):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, steps, evals = logged
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    for key in KEYS:
        got = {e.step: e.value for e in events.Scalars(key)}
        assert got.keys() == steps.keys() and all(_same(got[s], steps[s][key]) for s in steps), key
    assert {e.step: e.value for e in events.Scalars("eval/accuracy")} == pytest.approx(evals)


def test_wandb_runs_offline_into_a_local_folder_that_holds_the_runs_metrics(logged):
    run_dir, steps, evals = logged
    (folder,) = (run_dir / "wandb").glob("offline-run-*")  # offline: nothing was sent; `wandb sync` uploads it
    rows = history(folder)
    for key in KEYS:
        got = {r["_step"]: r[key] for r in rows if key in r}
        assert got.keys() == steps.keys() and all(_same(got[s], steps[s][key]) for s in steps), key
    assert {r["_step"]: r["eval/accuracy"] for r in rows if "eval/accuracy" in r} == pytest.approx(evals)


def test_mlflow_local_store_holds_the_runs_metrics_and_config(logged):
    from mlflow.tracking import MlflowClient

    run_dir, steps, evals = logged
    client = MlflowClient((run_dir / "mlruns").resolve().as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("drpo-test").experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == run_dir.name
    for key in KEYS:
        got = {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
        assert got.keys() == steps.keys() and all(_same(got[s], steps[s][key]) for s in steps), key
    assert {m.step: m.value for m in client.get_metric_history(run.info.run_id, "eval/accuracy")} == pytest.approx(evals)
    assert "config.yaml" in [a.path for a in client.list_artifacts(run.info.run_id)]
    assert run.data.params["learner.objective.type"] == "drpo" and run.data.params["train.steps"] == "3"


def test_a_logger_whose_library_is_missing_fails_by_name(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    with pytest.raises(RuntimeError, match=r"metrics.loggers has 'wandb' but its library is not installed .*pip install 'drpo\[wandb\]'"):
        build(["tensorboard", "wandb"], tmp_path, MetricsConfig(), {}, "")
