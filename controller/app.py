"""Wire a run together: config -> problems -> backend -> telemetry -> Controller, and resume."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import objectives
from controller.artifacts import export_run
from controller.config import ConfigError, RunConfig, dump
from rollout.config import ArithmeticTask, WordProblemTask
from controller.hardware import cuda_gpus, resolve_precision
from controller.loggers import build as build_loggers
from controller.checkpoints import checkpoint_step, latest_checkpoint
from controller.loop import Controller
from controller.run_folder import check_shared, holding, prepare, settle_aside
from controller.stop import StopRequest
from controller.telemetry import Telemetry
from rollout.tasks import Problem, arithmetic_split, load_dataset
from rollout.word_problems import word_problem_split


@dataclass(frozen=True)
class RunResult:
    run_dir: Path
    steps: int
    eval_history: list[dict]
    ledger_counts: dict[str, int]
    summary: str
    metrics_url: str | None
    model_dir: Path | None = None
    """The Hugging Face folder of the last checkpoint (``checkpoint.hf``), or None."""
    stopped_by: str | None = None
    """The signal that stopped the run before its last step (SIGINT, SIGTERM), or None."""
    resume_step: int = 0
    """The step its newest checkpoint holds (where ``--resume`` continues; 0: from the start)."""


def problems(cfg: RunConfig) -> tuple[list[Problem], dict[str, list[Problem]], dict[str, list]]:
    """Training problems, the eval sets by name (``cfg.eval_set_names()`` order: the task's, then
    ``eval.sets``), and the rows skipped per dataset load, by the field that named the file
    ("task.train_path", "eval.sets[0] (name)"...): (path, [(row, reason)]). One file loaded twice
    (say as training data in auto format and as an eval set in gsm8k format) is reported per load."""
    task, evals, reports = cfg.task, {}, {}
    builtin = cfg.rollout.reward.type in ("literal", "math_verify")  # they compare with a ground truth: rows without one are skipped

    def rows(section, path: str, max_chars: int):
        return load_dataset(
            path, max_chars, section.format, section.instruction, prompt_field=section.prompt_field, answer_field=section.answer_field,
            system_prompt=section.system_prompt, require_answer=builtin,
        )

    if isinstance(task, ArithmeticTask):
        train = arithmetic_split("train", task.train_size, task.seed, task.max_operand)
        for name in task.eval_set_names():
            size = task.test_size if name == "heldout" else task.extra_eval_size
            evals[name] = arithmetic_split(name, size, task.seed, task.max_operand)
    elif isinstance(task, WordProblemTask):
        train = word_problem_split("train", task.train_size, task.level, task.seed, task.test_size, tuple(task.eval_levels))
        evals["heldout"] = word_problem_split("test", task.test_size, task.level, task.seed)
        for level in task.eval_levels:
            evals[f"level-{level}"] = word_problem_split("test", task.test_size, level, task.seed)
    else:
        for field, path in (("task.train_path", task.train_path), ("task.test_path", task.test_path)):
            if path:
                try:
                    reports[field] = path, rows(task, path, task.max_prompt_chars)
                except (FileNotFoundError, ValueError) as err:
                    raise type(err)(f"{field}: {err}") from None
        train = reports["task.train_path"][1].problems
        if task.test_path:
            evals["heldout"] = reports["task.test_path"][1].problems
    for i, extra in enumerate(cfg.eval.sets):
        try:
            report = rows(extra, extra.path, 8192)
            reports[f"eval.sets[{i}] ({extra.name})"] = extra.path, report
        except (FileNotFoundError, ValueError) as err:
            raise type(err)(f"eval.sets[{i}] ({extra.name}): {err}") from None
        evals[extra.name] = report.problems[: extra.limit]
    return train, evals, {field: (path, r.skipped) for field, (path, r) in reports.items() if r.skipped}


def check_layout(cfg: RunConfig) -> None:
    """The learner's parallel layout must split the model (heads, widths, experts), and sglang's
    block-fp8 rollout must tile it: refused by field."""
    from learner.model import ModelArch, layout_problems
    from rollout.engine import engine_problems
    from rollout.offline_model import materialize_smollm2

    folder = cfg.model.path or str(materialize_smollm2())
    p = cfg.learner.parallel
    problems = layout_problems(ModelArch.from_hf_folder(folder), p.tensor, p.expert)
    problems += engine_problems(cfg.rollout, json.loads((Path(folder) / "config.json").read_text()))
    if problems:
        raise ConfigError(f"{'; '.join(problems)} (model {folder})")


def _ray_joined() -> bool:
    """Whether this process already joined a Ray cluster (``ray.init`` called from Python): that
    cluster, not this machine, hosts the roles."""
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


def check_machine(cfg: RunConfig, learner: bool = True) -> None:
    """What a local cluster (the one drpo starts on this machine) cannot host is refused by field
    before Ray starts: an engine whose package is not installed, GPUs the machine does not have
    (``learner=False``: rollout workers only, as ``drpo eval`` places). Joining a cluster
    (ray_address, RAY_ADDRESS, or ``ray.init`` called before) skips this: its nodes host the roles.
    The GPU count asked is a lower bound (fractional asks summed), so nothing placeable is refused."""
    if cfg.ray_address or os.environ.get("RAY_ADDRESS") or _ray_joined():
        return
    problems = []
    from rollout.config import ENGINE_PACKAGES

    package = ENGINE_PACKAGES.get(cfg.rollout.engine)
    if package and importlib.util.find_spec(package) is None:
        problems.append(
            f"rollout.engine={cfg.rollout.engine} needs the {package} package, which is not installed here "
            "(scripts/setup.sh installs vLLM's CPU build; SGLang comes with the sglang extra, on a CUDA machine)"
        )
    wanted = {
        "rollout.gpus_per_worker": cfg.rollout.workers * cfg.rollout.gpus_per_worker,
        "learner_resources.gpus_per_worker": cfg.learner.parallel.world_size * cfg.learner_resources.gpus_per_worker if learner else 0,
    }
    gpus = cuda_gpus() if any(wanted.values()) else 0
    if sum(wanted.values()) > gpus:
        asked = ", ".join(f"{field} asks for {n:g} in all" for field, n in wanted.items() if n)
        problems.append(
            f"{asked}, and this machine, where drpo starts a local Ray cluster, has {gpus} GPU(s): set them to 0 to run "
            "here, or join a cluster that has them (ray_address, or RAY_ADDRESS as `ray job submit` sets it)"
        )
    problems += reward_problems(cfg.rollout.reward) + environment_problems(cfg.rollout.environment)
    if problems:
        raise ConfigError("; ".join(problems))


def _importable(load, path: str) -> list[str]:
    """``load(path)``'s error as the workers would meet it (they run from this directory and import from it)."""
    try:
        _imported(load, path)
    except ImportError as err:
        return [str(err)]
    return []


def _imported(load, path: str):
    """``load(path)`` with this directory on the path, as the workers import."""
    added = os.getcwd() not in sys.path
    if added:
        sys.path.insert(0, os.getcwd())
    try:
        return load(path)
    finally:
        if added:
            sys.path.remove(os.getcwd())


def environment_problems(environment) -> list[str]:
    """An environment class a local cluster's workers could not import, or a tool of a
    ToolEnvironment's ``kwargs.tools`` they could not."""
    if environment is None:
        return []
    from rollout.environment import load_environment
    from rollout.tools import ToolEnvironment, load_tool

    problems = _importable(load_environment, environment.path)
    if problems or not issubclass(_imported(load_environment, environment.path), ToolEnvironment):
        return problems
    tools = environment.kwargs.get("tools", [])
    return [p for tool in (tools if isinstance(tools, (list, tuple)) else [tools]) for p in _importable(load_tool, str(tool))]


def reward_problems(reward) -> list[str]:
    """A reward of one's own that a local cluster's workers could not load: a function they cannot
    import (their path is this process's) or an API key variable that is not set."""
    from rollout.config import JudgeRewardConfig, PythonRewardConfig

    if isinstance(reward, PythonRewardConfig):
        from rollout.reward_functions import load_function

        if problems := _importable(load_function, reward.function):
            return problems
    if isinstance(reward, JudgeRewardConfig) and reward.api_key_env and not os.environ.get(reward.api_key_env):
        return [f"rollout.reward.api_key_env={reward.api_key_env!r} is not set in this environment, which the rollout workers inherit"]
    return []


def make_backend(cfg: RunConfig):
    if cfg.simulation is not None:
        from controller.simulation import SimulatedBackend

        return SimulatedBackend.build(cfg.simulation, workers=cfg.rollout.workers, topk=objectives.required_topk(cfg.learner.objective))
    from controller.ray_backend import RayBackend

    return RayBackend.build(cfg)


def train(
    cfg: RunConfig, resume: bool = False, backend=None, startup: dict[str, float] | None = None, overwrite: bool = False,
    stop: StopRequest | None = None, loaded: tuple | None = None,
) -> RunResult:
    """Run (or with ``resume``, continue from the run folder's latest checkpoint) to ``train.steps``.
    A new run refuses a folder that holds another run unless ``overwrite`` (controller/run_folder.py).
    ``startup``: seconds already spent starting (e.g. ``ray_seconds``), for the start-up record.
    ``stop``: set by the caller's signal handlers (controller/stop.py); the run then winds down early.
    ``loaded``: ``problems(cfg)`` already loaded (the CLI loads them before Ray starts)."""
    began = time.monotonic()
    cfg = resolve_precision(cfg)  # config.yaml records what ran, never auto
    run_dir = Path(cfg.run_dir)
    if cfg.simulation is None and backend is None:
        check_machine(cfg)  # before the run folder is touched
        check_layout(cfg)
    train_set, eval_sets, skipped = loaded or problems(cfg)  # a missing or empty data file fails here, nothing written yet
    with holding(run_dir):  # one driver per run folder (the CLI took it already, before Ray started)
        try:
            checkpoint = prepare(cfg, resume, overwrite)
            return _train(cfg, run_dir, checkpoint, began, backend, startup, stop, train_set, eval_sets, skipped)
        finally:
            settle_aside(run_dir)  # an --overwrite's old run comes back unless this run checkpointed


def _train(cfg, run_dir, checkpoint, began, backend, startup, stop, train_set, eval_sets, skipped) -> RunResult:
    loggers = build_loggers(cfg.metrics.loggers, run_dir, cfg.metrics, cfg.model_dump(mode="json"), dump(cfg))
    try:
        backend = backend or make_backend(cfg)
    except BaseException:
        for logger in loggers:
            logger.close()
        raise
    telemetry = Telemetry(run_dir, cfg.metrics, cfg.train.steps, backend.now, loggers, reward=cfg.rollout.reward.label)
    telemetry.startup_phase(**(startup or {}), backend_seconds=time.monotonic() - began)
    for field, (path, rows) in skipped.items():
        telemetry.dataset_rows_skipped(path, rows, field)
        print(f"drpo train: skipped {len(rows)} bad rows of {path} ({field}; first: row {rows[0][0]}: {rows[0][1]}); all in metrics.jsonl",
              file=sys.stderr)
    if getattr(backend, "placement", None):
        telemetry.placement(backend.placement)
    if cfg.temperature_note():
        print(f"drpo train: {cfg.temperature_note()}", file=sys.stderr)
    if telemetry.exporter is not None and cfg.metrics.progress:
        print(f"drpo train: Prometheus metrics on http://{telemetry.exporter.host}:{telemetry.exporter.port}/metrics", file=sys.stderr)
    try:
        check_shared(run_dir, lambda nonce: backend.probe_storage(str(run_dir.resolve()), nonce))
        ctl = Controller.build(cfg, backend=backend, train=train_set, evals=eval_sets, telemetry=telemetry, stop=stop)
        if checkpoint is not None:
            ctl.restore(checkpoint)
        ctl.run()
        model_dir = None
        if cfg.checkpoint.hf and cfg.simulation is None and not ctl.stop.requested:
            last = latest_checkpoint(run_dir)
            model_dir = export_run(run_dir, run_dir / "hf" / last.name, checkpoint_step(last), cfg.checkpoint.hf_dtype, replace=True)
        summary = telemetry.summary(ctl.eval_history, ctl.ledger.counts(), model_dir)
        url = f"http://{telemetry.exporter.host}:{telemetry.exporter.port}/metrics" if telemetry.exporter else None
        return RunResult(run_dir, ctl.step, ctl.eval_history, ctl.ledger.counts(), summary, url, model_dir, ctl.stop.name, ctl.checkpointed)
    finally:
        telemetry.close()
        backend.shutdown()
