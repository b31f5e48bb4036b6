"""Copies of a run's metrics in the tools researchers already watch runs in: TensorBoard, Weights &
Biases and MLflow (``metrics.loggers``, any subset; each an optional extra).

metrics.jsonl stays the source of truth: every logger gets the same step, evaluation and gap values
it holds, under the same slash names, at the training step they belong to. Nothing leaves the
machine unless the user asked for it: W&B runs offline by default (a local run folder under
RUN_DIR/wandb that ``wandb sync`` can upload later; ``metrics.wandb_mode: online`` or
WANDB_MODE=online sends it live), MLflow writes a local store under RUN_DIR/mlruns unless
``metrics.mlflow_tracking_uri`` names a server, TensorBoard writes event files under RUN_DIR/tensorboard.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Protocol

from controller.config import dotted

_SKIP = ("kind", "step", "time")
"""Record fields that are not metrics (the step is the x axis)."""
EXTRAS = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}


class MetricLogger(Protocol):
    def log(self, values: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


def numeric(record: dict) -> dict[str, float]:
    """The metrics of a metrics.jsonl record: its numbers, without the bookkeeping fields."""
    return {k: float(v) for k, v in record.items() if k not in _SKIP and isinstance(v, (int, float)) and not isinstance(v, bool)}


class TensorBoardLogger:
    def __init__(self, run_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def log(self, values: dict[str, float], step: int) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    def __init__(self, run_dir: Path, project: str, mode: str, config: dict):
        import wandb

        self.run = wandb.init(
            project=project, dir=str(run_dir), name=run_dir.name, config=config, mode=os.environ.get("WANDB_MODE", mode),
            settings=wandb.Settings(console="off", quiet=True),
        )

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


class MLflowLogger:
    """Through ``MlflowClient`` (no global active run, so several runs can share a process)."""

    def __init__(self, run_dir: Path, experiment: str, tracking_uri: str | None, config: dict, config_yaml: str):
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        if tracking_uri is None:
            # the local store drpo defaults to is MLflow's file store, which MLflow 3 keeps working but
            # refuses unless asked (its database store needs SQLAlchemy, which mlflow-skinny leaves out)
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri or (run_dir / "mlruns").resolve().as_uri())
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
        self.run_id = self.client.create_run(experiment_id, run_name=run_dir.name).info.run_id
        self.client.log_text(self.run_id, config_yaml, "config.yaml")
        params = [Param(k, str(v)[:6000]) for k, v in dotted(config).items()]
        for start in range(0, len(params), 100):  # MLflow's batch limit for params
            self.client.log_batch(self.run_id, params=params[start : start + 100])

    def log(self, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        # MLflow stores NaN but not inf; metrics.jsonl keeps both, the comparison tools get the finite ones
        metrics = [Metric(k, v, now, step) for k, v in values.items() if math.isfinite(v) or math.isnan(v)]
        for start in range(0, len(metrics), 1000):  # MLflow's batch limit
            self.client.log_batch(self.run_id, metrics=metrics[start : start + 1000])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def build(names: list[str], run_dir: Path, cfg, config: dict, config_yaml: str) -> list[MetricLogger]:
    """The loggers ``names`` for a run (``cfg``: its MetricsConfig); a missing library fails by name."""
    loggers: list[MetricLogger] = []
    try:
        for name in names:
            try:
                if name == "tensorboard":
                    loggers.append(TensorBoardLogger(run_dir))
                elif name == "wandb":
                    loggers.append(WandbLogger(run_dir, cfg.project, cfg.wandb_mode, config))
                elif name == "mlflow":
                    loggers.append(MLflowLogger(run_dir, cfg.project, cfg.mlflow_tracking_uri, config, config_yaml))
            except ImportError as err:
                raise RuntimeError(
                    f"metrics.loggers has {name!r} but its library is not installed ({err.name}): pip install 'drpo[{EXTRAS[name]}]'"
                ) from None
    except BaseException:
        for logger in loggers:
            logger.close()
        raise
    return loggers
