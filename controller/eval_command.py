"""``drpo eval``: held-out accuracy of a model folder or a run checkpoint, outside a training run.

The evaluation is the training run's own: the Controller's ``evaluate`` over rollout workers
(RayBackend without a learner) with the config's engine, task, held-out split and eval settings
(samples per prompt, temperature, greedy). A run folder is evaluated with the config it was trained
with, on its checkpoint exported to a Hugging Face folder first (learner/export.py).
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

from controller.config import RunConfig


@dataclass(frozen=True)
class EvalResult:
    model: str
    """What was evaluated: a model folder, or RUN_DIR@step-N."""
    record: dict
    """The evaluation record (accuracy, samples, prompts, failed, and per eval set ``sets``), as in metrics.jsonl."""
    settings: dict

    def table(self) -> str:
        rows = [("model", self.model), ("task", self.settings["task"]), ("engine", self.settings["engine"]),
                ("samples per prompt", f"{self.settings['samples_per_prompt']} at temperature {self.settings['temperature']:g}"
                                       + (" + 1 greedy" if self.settings["greedy"] else ""))]
        for name, s in self.record.get("sets", {}).items():
            scores = [f"mean@{s['k']} {s['mean_at_k']:.4f}"] + [f"{k.replace('_at_', '@')} {v:.4f}" for k, v in s.items() if k.startswith("pass_at_")]
            if "greedy" in s:
                scores.append(f"greedy {s['greedy']:.4f}")
            rows.append((f"eval set {name}", f"{', '.join(scores)} ({s['prompts']} prompts, {s['failed']} failed; "
                                             f"{s['response_tokens_mean']:.0f} tokens mean, {s['truncated_frac']:.2f} truncated)"))
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)

    def tag(self) -> str:
        """The decoding settings in a file name: evaluations of one model under other settings do not overwrite each other."""
        s = self.settings
        return f"t{s['temperature']:g}-n{s['samples_per_prompt']}{'-greedy' if s['greedy'] else ''}"

    def to_json(self) -> str:
        return json.dumps({"model": self.model, "settings": self.settings, **self.record}, indent=2)


def check_model_folder(folder: str | Path) -> None:
    """Raise ValueError naming what a Hugging Face folder lacks for evaluation (before any worker starts)."""
    folder = Path(folder)
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{folder}/config.json does not load: {err}") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise ValueError(f"{folder}/config.json has no model_type: not a Hugging Face model config")
    if not any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        raise ValueError(f"{folder} has no tokenizer (tokenizer.json or tokenizer_config.json)")
    if not any(folder.glob("*.safetensors")) and not any(folder.glob("*.bin")):
        raise ValueError(f"{folder} has no weights (*.safetensors or *.bin)")


def evaluate_folder(cfg: RunConfig, model_folder: str | Path, label: str | None = None) -> EvalResult:
    """One evaluation round of ``model_folder`` under ``cfg`` (on the Ray cluster already initialized)."""
    from controller.app import problems
    from controller.loop import Controller
    from controller.ray_backend import RayBackend
    from controller.telemetry import Telemetry

    train_set, eval_sets, _ = problems(cfg)
    if not any(eval_sets.values()):
        raise ValueError("the config has no eval set (task.test_path is not set and eval.sets is empty)")
    quiet = cfg.metrics.model_copy(update={"port": None, "progress": False, "loggers": []})
    backend = RayBackend.build(cfg, model_folder=str(model_folder), learner=False)
    cfg = backend.cfg  # precision resolved: the record never says auto
    with tempfile.TemporaryDirectory(prefix="drpo-eval-") as scratch:
        telemetry = Telemetry(scratch, quiet, 1, backend.now)
        try:
            ctl = Controller.build(cfg, backend=backend, train=train_set, evals=eval_sets, telemetry=telemetry)
            ctl.evaluate(blocking=True)
        finally:
            telemetry.close()
            backend.shutdown()
    record = {k: v for k, v in ctl.eval_history[-1].items() if k in ("accuracy", "samples", "prompts", "failed", "sets")}
    settings = {
        "task": cfg.task.type, "engine": cfg.rollout.engine, "precision": cfg.rollout.precision, "samples_per_prompt": cfg.eval.samples_per_prompt,
        "temperature": cfg.eval.temperature or cfg.rollout.temperature, "greedy": cfg.eval.greedy, "max_new_tokens": cfg.rollout.max_new_tokens,
        "seed": cfg.seed,
    }
    return EvalResult(label or str(model_folder), record, settings)


def evaluate_run(run_dir: str | Path, step: int | None, cfg: RunConfig) -> tuple[EvalResult, Path]:
    """A run checkpoint under ``cfg`` (the run's own config, --set overrides applied); returns the
    result and the checkpoint folder evaluated."""
    from controller.artifacts import export_run, step_folder
    from controller.checkpoints import checkpoint_step

    folder = step_folder(run_dir, step)
    with tempfile.TemporaryDirectory(prefix="drpo-eval-model-") as scratch:
        model = export_run(run_dir, Path(scratch) / "model", checkpoint_step(folder))
        return evaluate_folder(cfg, model, label=f"{run_dir}@{folder.name}"), folder
