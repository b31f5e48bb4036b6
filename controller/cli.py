"""The ``drpo`` command: ``train`` (the main job), ``export``, ``eval``, ``report``, ``demo`` and ``objectives``."""

from __future__ import annotations

import argparse
import sys
import time
from contextlib import ExitStack


def _demo(args: argparse.Namespace) -> int:
    from objectives.demo import format_table, weight_table

    print("Gradient weight w on r*A*grad log pi for one sampled token, measured by autograd through each")
    print("objective (1 = plain importance-weighted PG; 0 = clipped or masked). DRPO: w = 1 - sign(A(r-1))|pi-mu|/delta,")
    print("below 1 when the update diverges, negative (corrective) past |pi-mu| = delta, bounded however small mu is.\n")
    for advantage in (1.0, -1.0):
        print(f"A = {advantage:+g}")
        print(format_table(weight_table(advantage)))
        print()
    return 0


def _objectives(args: argparse.Namespace) -> int:
    import objectives
    from objectives.base import registry

    for name in objectives.available():
        cfg = registry()[name].config_cls
        fields = ", ".join(f"{k}={v.default}" for k, v in cfg.model_fields.items() if k != "type")
        doc = (cfg.__doc__ or "").strip().splitlines()[0]
        print(f"{name:16s} {fields:40s} {doc}")
    return 0


_RAY_JOINED_HERE = False
"""Whether ``_init_ray`` joined or started the cluster this process is connected to (a cluster
joined before, by Python code that called ``main``, is left as it was)."""


def _init_ray(cfg) -> None:
    """Join the configured cluster, or start a local one on loopback in this process (``_shutdown_ray``
    stops it); controller/network.py says what listens where."""
    import os

    from controller.network import init_ray

    global _RAY_JOINED_HERE
    ray = sys.modules.get("ray")  # not imported here: controller.network.prepare must come first
    _RAY_JOINED_HERE = _RAY_JOINED_HERE or ray is None or not ray.is_initialized()

    needed = cfg.rollout.workers * cfg.rollout.cpus_per_worker + cfg.learner.parallel.world_size * cfg.learner_resources.cpus_per_worker
    init_ray(cfg.ray_address, num_cpus=max(os.cpu_count() or 1, int(needed + 0.999)))


def _train(args: argparse.Namespace) -> int:
    if args.resume and args.overwrite:
        print("drpo train: --resume continues a run and --overwrite deletes it; give one of them", file=sys.stderr)
        return 2
    with ExitStack() as held:
        return _train_holding(args, held)


def _train_holding(args: argparse.Namespace, held: ExitStack) -> int:
    """``drpo train`` with the run folder's lock taken into ``held`` before anything is read from
    the folder or written to it, and before Ray starts."""
    from pathlib import Path

    from controller.config import ConfigError, SimulationConfig, load_config
    from controller.run_folder import RunFolderError, holding, settle_aside

    def lock(run_dir) -> str | None:
        try:
            held.enter_context(holding(run_dir))  # one driver per run folder
        except RunFolderError as err:
            return str(err)
        return None

    overrides = list(args.set or [])
    config = args.config
    if args.resume:
        problem = _resume_problem(args.resume, overrides) or lock(args.resume)
        if problem is None:
            settle_aside(Path(args.resume))  # an --overwrite that never checkpointed: the old run comes back first
            if config is None and not (Path(args.resume) / "config.yaml").is_file():
                problem = "not a drpo run folder (no config.yaml)"
        if problem:
            print(f"drpo train: --resume {args.resume}: {problem}", file=sys.stderr)
            return 2
        config = config or str(Path(args.resume) / "config.yaml")
        overrides.append(f"run_dir={args.resume}")
    try:
        cfg = load_config(config, overrides)
        if args.simulate and cfg.simulation is None:
            cfg = cfg.model_copy(update={"simulation": SimulationConfig()})
    except ConfigError as err:
        print(f"drpo train: {err}", file=sys.stderr)
        return 2
    from controller.network import prepare

    prepare(cfg.ray_address)  # before anything imports ray
    problem = lock(cfg.run_dir)  # taken already on --resume
    if problem:
        print(f"drpo train: {problem}", file=sys.stderr)
        return 2
    from controller.stop import Interrupted, StopRequest

    stop = StopRequest()
    with stop.handling_signals():  # start-up included: a signal then stops at once
        try:
            return _run(cfg, args, stop)
        except Interrupted as err:
            from controller.checkpoints import checkpoint_step, latest_checkpoint

            last = latest_checkpoint(cfg.run_dir)
            where = f"its checkpoint of step {checkpoint_step(last)}" if last else "the start (no checkpoint yet)"
            print(f"\ndrpo train: {err}; resume continues from {where} with: drpo train --resume {cfg.run_dir}", file=sys.stderr)
            return 128 + err.signum
        finally:
            stop.closing = True  # signals now only say so: Ray's shutdown must not be cut short
            _shutdown_ray()


def _resume_problem(run_dir: str, overrides: list[str]) -> str | None:
    """Why ``--resume run_dir`` cannot start, before any config is read (None: it can)."""
    from pathlib import Path

    if "://" in run_dir:
        return "takes the run folder's filesystem path (object-store URIs are not supported)"
    if any(o.split("=", 1)[0].strip() == "run_dir" for o in overrides):
        return "names the run folder; drop --set run_dir (to move a run, move its folder and resume it there)"
    if not Path(run_dir).is_dir():
        return "no such folder"
    return None


def _run(cfg, args: argparse.Namespace, stop) -> int:
    from controller.app import check_layout, check_machine, problems, train
    from controller.backend import DeadlineExceeded, LearnerLost, WorkersGone
    from controller.loop import RolloutsFailing
    from controller.config import ConfigError
    from controller.network import NetworkError
    from controller.run_folder import RunFolderError, StorageError
    from controller.watchdog import Stalled
    from learner.checkpoint import CheckpointError
    from learner.placement import PlacementError

    startup, loaded = {}, None
    try:
        if cfg.simulation is None:
            check_machine(cfg)  # needs no file: before the data and the model, which may be large or far away
        loaded = problems(cfg)  # the data: before Ray starts or the run folder is touched
        if cfg.simulation is None:
            check_layout(cfg)
    except (ConfigError, FileNotFoundError, ValueError) as err:  # bad data or layout; a missing or unsupported model
        print(f"drpo train: {err}", file=sys.stderr)
        return 2
    if cfg.simulation is None:
        began = time.monotonic()
        try:
            _init_ray(cfg)
        except NetworkError as err:
            print(f"drpo train: {err}", file=sys.stderr)
            return 2
        stop.install()  # ray.init took SIGTERM over
        startup["ray_seconds"] = time.monotonic() - began
    print(f"drpo train: run folder {cfg.run_dir} ({cfg.train.mode}, {cfg.learner.objective.type}, {cfg.train.steps} steps)", file=sys.stderr)
    try:
        result = train(cfg, resume=bool(args.resume), startup=startup, overwrite=args.overwrite, stop=stop, loaded=loaded)
    except (LearnerLost, DeadlineExceeded, StorageError, Stalled, RolloutsFailing, WorkersGone) as err:
        print(f"drpo train: {err}", file=sys.stderr)
        if isinstance(err, Stalled):
            print(f"drpo train: resume from its newest checkpoint with: drpo train --resume {cfg.run_dir}", file=sys.stderr)
        return 1
    except (FileNotFoundError, CheckpointError, RunFolderError, PlacementError, ConfigError) as err:
        # a missing dataset or model, a bad checkpoint, an occupied folder, a cluster without the configured
        # roles, a learner layout that cannot split the model
        print(f"drpo train: {err}", file=sys.stderr)
        return 2
    print(result.summary)
    if result.stopped_by is None:
        return 0
    where = f"its checkpoint of step {result.resume_step}" if result.resume_step else "the start (nothing was checkpointed)"
    print(
        f"drpo train: stopped by {result.stopped_by} at step {result.steps}; resume continues from {where} with: "
        f"drpo train --resume {cfg.run_dir}", file=sys.stderr,
    )
    return 128 + stop.signum


def _shutdown_ray() -> None:
    """Stop the local Ray cluster ``_init_ray`` started (its raylet, GCS, agents and workers); a
    cluster it joined is only disconnected from, and one joined before ``main`` ran is kept."""
    global _RAY_JOINED_HERE
    if not _RAY_JOINED_HERE:
        return
    _RAY_JOINED_HERE = False
    import ray

    if ray.is_initialized():
        ray.shutdown()


def _export(args: argparse.Namespace) -> int:
    from controller.artifacts import export_run
    from learner.checkpoint import CheckpointError

    try:
        path = export_run(args.run_dir, args.out_dir, args.step, args.dtype)
    except (CheckpointError, OSError, ValueError) as err:  # OSError: an output folder that cannot be written
        print(f"drpo export: {err}", file=sys.stderr)
        return 2
    print(path)
    return 0


def _eval(args: argparse.Namespace) -> int:
    from pathlib import Path

    from controller.config import ConfigError, load_config
    from controller.backend import DeadlineExceeded
    from controller.network import NetworkError, prepare
    from learner.checkpoint import CheckpointError

    target = Path(args.path)
    is_run = (target / "config.yaml").is_file() and (target / "checkpoints").is_dir()
    try:
        if not is_run and not (target / "config.json").is_file():
            raise CheckpointError(f"{target} is neither a drpo run folder (config.yaml, checkpoints/) nor a Hugging Face model folder (config.json)")
        if is_run and args.config:
            raise ConfigError("--config: a run folder is evaluated with the config it was trained with (use --set to change eval settings)")
        if not is_run and args.step is not None:
            raise ConfigError(f"--step picks a run folder's checkpoint; {target} is a model folder")
        cfg = load_config(target / "config.yaml" if is_run else args.config, list(args.set or []))
        prepare(cfg.ray_address)  # before anything imports ray
        from controller.app import check_machine, problems
        from controller.eval_command import check_model_folder, evaluate_folder, evaluate_run

        if not is_run:
            check_model_folder(target)
        if not any(problems(cfg)[1].values()):  # the data, before Ray starts
            raise ConfigError("the config has no eval set (task.test_path is not set and eval.sets is empty)")
        check_machine(cfg, learner=False)
        _init_ray(cfg)
        if is_run:
            result, folder = evaluate_run(target, args.step, cfg)
            out = Path(args.out) if args.out else target / "eval" / f"{folder.name}-{result.tag()}.json"
        else:
            result = evaluate_folder(cfg, target)
            out = Path(args.out) if args.out else Path(f"eval-{target.resolve().name}-{result.tag()}.json")
    except (CheckpointError, ConfigError, ValueError, FileExistsError, FileNotFoundError, NetworkError, DeadlineExceeded) as err:
        print(f"drpo eval: {err}", file=sys.stderr)
        return 2
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(result.to_json() + "\n")
    print(result.table())
    print(f"written to {out}")
    return 0


def _report(args: argparse.Namespace) -> int:
    from controller.report import ReportError, write_report

    try:
        path = write_report(args.run_dir, args.out)
    except ReportError as err:
        print(f"drpo report: {err}", file=sys.stderr)
        return 2
    print(path)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="drpo", description="Distributed RL post-training with DRPO on Ray.")
    sub = parser.add_subparsers(dest="command", required=True)
    tr = sub.add_parser("train", help="run RL training (no arguments: SmolLM2-135M, arithmetic, DRPO, local Ray)")
    tr.add_argument("--config", help="run config YAML (default: the embedded default preset)")
    tr.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config field, e.g. --set train.steps=5")
    tr.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its latest checkpoint")
    tr.add_argument("--simulate", action="store_true", help="sampled durations instead of models (scheduling only)")
    tr.add_argument("--overwrite", action="store_true", help="start a new run in a folder that holds another drpo run: the old run is set aside, deleted at the new run's first checkpoint (and back if the new run ends before it)")
    tr.set_defaults(fn=_train)
    ex = sub.add_parser("export", help="write a run checkpoint as a Hugging Face model folder (transformers, vLLM)")
    ex.add_argument("run_dir", metavar="RUN_DIR")
    ex.add_argument("out_dir", metavar="OUT_DIR", help="a new (or empty) folder")
    ex.add_argument("--step", type=int, help="the checkpoint's step (default: the latest complete one)")
    ex.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32", help="weight dtype (default fp32, as trained)")
    ex.set_defaults(fn=_export)
    ev = sub.add_parser("eval", help="eval-set accuracy (mean@k, pass@k, greedy) of a model folder or a run checkpoint (training's own evaluation)")
    ev.add_argument("path", metavar="MODEL_DIR_OR_RUN_DIR")
    ev.add_argument("--step", type=int, help="a run folder's checkpoint step (default: the latest complete one)")
    ev.add_argument("--config", help="run config for a model folder: task, engine, eval settings (default: the embedded default)")
    ev.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config field, e.g. --set eval.greedy=true")
    ev.add_argument("--out", help="JSON file to write (default RUN_DIR/eval/step-N-t<T>-n<k>[-greedy].json, or ./eval-<model>-t<T>-n<k>[-greedy].json)")
    ev.set_defaults(fn=_eval)
    rep = sub.add_parser("report", help="write a self-contained HTML (and PNG) report of a run folder")
    rep.add_argument("run_dir", metavar="RUN_DIR")
    rep.add_argument("--out", help="output folder (default RUN_DIR/report)")
    rep.set_defaults(fn=_report)
    sub.add_parser("demo", help="print DRPO/DPPO/SPO/PPO gradient weights across mu and pi").set_defaults(fn=_demo)
    sub.add_parser("objectives", help="list registered objectives and their defaults").set_defaults(fn=_objectives)
    return parser


def main(argv: list[str] | None = None) -> int:
    from controller.network import quiet

    quiet()  # before anything imports Ray, vLLM or transformers: nothing phones home
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    finally:
        _shutdown_ray()  # a cluster a command started or joined (train stops it itself, before its summary)


if __name__ == "__main__":
    sys.exit(main())
