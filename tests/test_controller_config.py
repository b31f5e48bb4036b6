"""Run config: every preset loads; bad values and unknown keys fail at load with the field's name."""

from __future__ import annotations

from pathlib import Path

import pytest

from controller.cli import main
from controller.config import PRESETS, ConfigError, RunConfig, load_config
from controller.hardware import cpu_has_bf16, resolve_precision

REPO = Path(__file__).resolve().parents[1]


def repo_run_configs() -> list[Path]:
    """Every run-config YAML in the repository (presets and anything else with a train section)."""
    found = []
    for path in REPO.rglob("*.yaml"):
        if any(part.startswith(".") or part in ("runs", "node_modules") for part in path.relative_to(REPO).parts):
            continue
        if path.parent == PRESETS or "train:" in path.read_text():
            found.append(path)
    return sorted(found)


def test_presets_exist():
    names = {p.name for p in PRESETS.glob("*.yaml")}
    assert {"default.yaml", "cluster-gpu.yaml"} <= names


@pytest.mark.parametrize("path", repo_run_configs(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_config_file_in_the_repo_loads(path):
    assert isinstance(load_config(path), RunConfig)


def test_the_default_preset_is_the_embedded_default():
    cfg = load_config()
    assert cfg.model.path is None and cfg.task.type == "arithmetic" and cfg.rollout.engine == "hf"
    assert cfg.learner.objective.type == "drpo" and cfg.train.mode == "sync" and cfg.metrics.host == "127.0.0.1"
    assert cfg.train.max_staleness == 0 and cfg.learner.packing == "shared_prompt"
    # precision auto, resolved at load for this machine: bf16 only where the CPU computes it fast
    assert cfg.learner.precision == cfg.rollout.precision == ("bf16" if cpu_has_bf16() else "fp32")
    # async from the command line gets the staleness bound 1 the preset leaves to the mode
    assert load_config(overrides=["train.mode=async"]).train.max_staleness == 1


AMX = "processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
AVX2 = "processor\t: 0\nflags\t\t: fpu sse avx2 fma\n"
ARM_BF16 = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n"


def test_precision_auto_is_bf16_only_with_gpus_or_bf16_arithmetic():
    assert cpu_has_bf16(AMX) and cpu_has_bf16(ARM_BF16) and not cpu_has_bf16(AVX2) and not cpu_has_bf16("")
    cfg = load_config(overrides=["rollout.precision=auto", "learner.precision=auto"])  # resolved: never auto after loading
    assert cfg.rollout.precision in ("bf16", "fp32") and cfg.learner.precision in ("bf16", "fp32")
    raw = RunConfig.model_validate({"rollout": {"precision": "auto"}, "learner": {"precision": "auto"}})
    on_avx2 = resolve_precision(raw, cpu_bf16=False)
    assert (on_avx2.rollout.precision, on_avx2.learner.precision) == ("fp32", "fp32")
    assert (resolve_precision(raw, cpu_bf16=True).rollout.precision, resolve_precision(raw, cpu_bf16=True).learner.precision) == ("bf16", "bf16")
    gpu = raw.model_copy(update={"learner_resources": raw.learner_resources.model_copy(update={"gpus_per_worker": 1.0})})
    assert resolve_precision(gpu, cpu_bf16=False).learner.precision == "bf16" and resolve_precision(gpu, cpu_bf16=False).rollout.precision == "fp32"
    explicit = load_config(overrides=["rollout.precision=bf16", "learner.precision=fp32"])
    assert (explicit.rollout.precision, explicit.learner.precision) == ("bf16", "fp32")  # an explicit choice is kept


def test_overrides_apply_with_yaml_types():
    cfg = load_config(overrides=["train.steps=7", "learner.objective={type: ppo_clip, eps_high: 0.28}", "rollout.precision=bf16"])
    assert cfg.train.steps == 7 and cfg.learner.objective.type == "ppo_clip" and cfg.learner.objective.eps_high == 0.28
    assert cfg.rollout.precision == "bf16"


@pytest.mark.parametrize(
    "override, field",
    [
        ("train.steps=many", "train.steps"),
        ("train.stepz=3", "train.stepz"),
        ("rollout.workers=0", "rollout.workers"),
        ("learner.objective.delta=-1", "learner.objective.drpo.delta"),
        ("learner.objective={type: nonsense}", "learner.objective"),
        ("metrics.port=70000", "metrics.port"),
        ("task.type=video", "task"),
    ],
)
def test_bad_values_fail_with_the_field_name(override, field):
    with pytest.raises(ConfigError) as err:
        load_config(overrides=[override])
    assert field in str(err.value)


def test_cross_field_checks_name_the_fields():
    with pytest.raises(ConfigError, match="train.max_staleness must be 0 in sync mode"):
        load_config(overrides=["train.mode=sync", "train.max_staleness=2"])



def test_the_learner_takes_log_probs_at_the_sampling_temperature_unless_set_apart():
    shared = load_config(overrides=["rollout.temperature=0.7"])
    assert shared.learner.temperature == 0.7 and shared.temperature_note() is None
    apart = load_config(overrides=["rollout.temperature=0.7", "learner.temperature=1.0"])
    assert apart.learner.temperature == 1.0 and "learner.temperature 1.0 differs from rollout.temperature 0.7" in apart.temperature_note()
    assert RunConfig.model_validate({"rollout": {"temperature": 0.5}}).learner.temperature == 0.5  # built in code too


def test_unreadable_or_malformed_files_are_named(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_cli_reports_a_bad_config_and_exits_2(capsys):
    assert main(["train", "--set", "train.prompts_per_step=zero"]) == 2
    assert "train.prompts_per_step" in capsys.readouterr().err


def test_a_field_in_the_wrong_section_is_named_with_its_section(tmp_path):
    """No field is read under another name: one in the wrong section is refused, by its dotted name."""
    old = tmp_path / "config.yaml"
    old.write_text("train: {steps: 3, anchor: decoupled}\n")
    with pytest.raises(ConfigError, match=r"is invalid:\n  train\.anchor: Extra inputs are not permitted"):
        load_config(old)
    with pytest.raises(ConfigError, match=r"with the --set overrides is invalid:\n  train\.anchor: Extra inputs"):
        load_config(None, ["train.anchor=decoupled"])
    assert load_config(None, ["learner.anchor=decoupled"]).learner.anchor == "decoupled"


def test_a_run_records_the_precision_it_resolved_never_auto(tmp_path):
    """config.yaml says what ran (a resume on another machine keeps it), built in code or loaded."""
    import yaml

    from controller.app import train

    cfg = RunConfig.model_validate({
        "run_dir": str(tmp_path / "run"), "rollout": {"precision": "auto", "workers": 1, "samples_per_prompt": 2},
        "learner": {"precision": "auto"}, "task": {"type": "arithmetic", "train_size": 20, "test_size": 4},
        "train": {"steps": 1, "prompts_per_step": 2}, "eval": {"every": 0, "at_start": False}, "checkpoint": {"every": 0},
        "metrics": {"port": None, "progress": False}, "simulation": {"gen_seconds": 0.01, "train_seconds": 0.01},
    })
    train(cfg)
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    expected = "bf16" if cpu_has_bf16() else "fp32"
    assert saved["rollout"]["precision"] == saved["learner"]["precision"] == expected
    from rollout.config import RolloutConfig
    from rollout.engine import Engine

    with pytest.raises(ValueError, match="precision 'auto' reached the engine unresolved"):
        Engine.build(RolloutConfig(precision="auto"), model_folder="unused")


def test_a_deadline_at_or_past_the_stall_limit_is_refused_by_name():
    from controller.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"deadlines.engine_call_seconds=1800 must be below train.stall_fail_seconds=1800.*lower the deadline"):
        load_config(None, ["deadlines.engine_call_seconds=1800"])
    cfg = load_config(None, ["deadlines.engine_call_seconds=1800", "train.stall_fail_seconds=0"])  # no stall limit: any deadline
    assert cfg.deadlines.engine_call_seconds == 1800
    assert load_config(None, []).deadlines.engine_call_seconds < load_config(None, []).train.stall_fail_seconds


def test_the_config_modules_import_neither_torch_nor_ray():
    """A config is read and checked before anything heavy loads (the CLI refuses bad input at once)."""
    import subprocess
    import sys

    code = ("import sys, controller.config, learner.config, objectives.config, rollout.config; "
            "print(sorted(m for m in ('torch', 'ray', 'megatron', 'transformers', 'vllm') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout


def test_code_defaults_equal_the_embedded_presets_except_where_a_reason_is_written():
    from controller.config import PRESET_DIFFERENCES, preset_differences

    found = preset_differences()
    assert set(found) == set(PRESET_DIFFERENCES), {"undocumented": set(found) - set(PRESET_DIFFERENCES), "no longer different": set(PRESET_DIFFERENCES) - set(found)}
    assert found["train.mode"] == ("sync", "async") and found["learner.precision"] == ("auto", "fp32")


def test_a_config_extends_a_preset_or_a_file_and_merges_its_mappings_key_by_key(tmp_path):
    shipped = load_config(PRESETS / "on-policy.yaml")
    default = load_config()
    assert (shipped.train.mini_batches, default.train.mini_batches) == (1, 2) and shipped.run_dir == "runs/on-policy"
    assert (shipped.learner.optimizer.lr, default.learner.optimizer.lr) == (2e-5, 1.5e-5)
    assert shipped.learner.optimizer.grad_clip == default.learner.optimizer.grad_clip  # a mapping merged key by key
    assert shipped.model_dump(exclude={"train", "learner", "run_dir"}) == default.model_dump(exclude={"train", "learner", "run_dir"})
    assert shipped.train.model_dump(exclude={"mini_batches"}) == default.train.model_dump(exclude={"mini_batches"})
    assert shipped.learner.model_dump(exclude={"optimizer"}) == default.learner.model_dump(exclude={"optimizer"})
    (tmp_path / "base.yaml").write_text("extends: default\nrollout: {samples_per_prompt: 4}\neval: {sets: [{name: a, path: a.jsonl}]}\n")
    (tmp_path / "run.yaml").write_text("extends: base.yaml\nrollout: {max_new_tokens: 8}\neval: {sets: []}\n")
    cfg = load_config(tmp_path / "run.yaml", ["rollout.threads=1"])
    assert (cfg.rollout.samples_per_prompt, cfg.rollout.max_new_tokens, cfg.rollout.threads) == (4, 8, 1)  # merged over two levels
    assert cfg.rollout.temperature == default.rollout.temperature and cfg.eval.sets == []  # kept from the preset; a list replaced
    (tmp_path / "loop.yaml").write_text("extends: loop2.yaml\n")
    (tmp_path / "loop2.yaml").write_text("extends: loop.yaml\n")
    with pytest.raises(ConfigError, match="comes back to a file it extends"):
        load_config(tmp_path / "loop.yaml")
    (tmp_path / "typo.yaml").write_text("extends: defualt\n")
    with pytest.raises(ConfigError, match=r"extends 'defualt': no file .*defualt.yaml \(shipped presets: .*default"):
        load_config(tmp_path / "typo.yaml")
