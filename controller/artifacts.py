"""What a run folder holds for use after training: its checkpoints, the model it started from, and
its Hugging Face export (``drpo export``, ``checkpoint.hf``)."""

from __future__ import annotations

import shutil
from pathlib import Path

from controller.config import ConfigError, RunConfig, load_config
from controller.checkpoints import checkpoint_folder, checkpoint_step, complete_checkpoints
from learner.checkpoint import CheckpointError


def run_config(run_dir: str | Path) -> RunConfig:
    """The config a run was started with (RUN_DIR/config.yaml)."""
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise CheckpointError(f"{run_dir} is not a drpo run folder: it has no config.yaml")
    try:
        return load_config(path)
    except ConfigError as err:
        raise CheckpointError(f"{path} does not load: {err}") from None


def step_folder(run_dir: str | Path, step: int | None = None) -> Path:
    """The complete checkpoint of ``step`` (default: the latest complete one) in a run folder."""
    complete = complete_checkpoints(run_dir)
    if step is None:
        if not complete:
            raise CheckpointError(f"{run_dir} has no complete checkpoint under {Path(run_dir) / 'checkpoints'}")
        return complete[-1]
    folder = checkpoint_folder(run_dir, step)
    if folder not in complete:
        have = ", ".join(str(checkpoint_step(p)) for p in complete) or "none"
        raise CheckpointError(f"{run_dir} has no complete checkpoint of step {step} (complete steps: {have})")
    return folder


def source_model(cfg: RunConfig) -> Path:
    """The Hugging Face folder the run's learner started from."""
    if cfg.model.path is not None:
        return Path(cfg.model.path)
    from rollout.offline_model import materialize_smollm2

    return materialize_smollm2()


def export_run(run_dir: str | Path, out_dir: str | Path, step: int | None = None, dtype: str = "fp32", replace: bool = False) -> Path:
    """A Hugging Face folder of a run's checkpoint (``replace``: an existing ``out_dir`` is replaced)."""
    from learner.export import export

    cfg = run_config(run_dir)
    folder = step_folder(run_dir, step)
    out_dir = Path(out_dir)
    if replace and out_dir.exists():
        shutil.rmtree(out_dir)
    return export(folder, source_model(cfg), out_dir, dtype, world_size=cfg.learner.parallel.world_size)
