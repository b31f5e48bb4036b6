"""Every `drpo …` command line in the bash blocks of README.md and the documentation pages (docs/)
runs as written, so the docs cannot drift from the code. `drpo train` lines run with `--simulate` added (and few steps unless the line sets
them) in one folder; export/eval/report lines run in another, against a real 2-step run of the tiny
model in `runs/default` (what `make run` leaves there). Each command must also leave what it says
it makes: steps in metrics.jsonl, a model folder, an evaluation JSON, a report."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from controller.config import load_config

pytestmark = [pytest.mark.ray, pytest.mark.engine, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[1]
DRPO = str(Path(sys.executable).parent / "drpo")
QUIET = ["--set", "metrics.port=null", "--set", "metrics.progress=false"]


def doc_pages() -> list[Path]:
    """README.md and every page of the docs site (the generated reference pages hold no commands)."""
    return [REPO / "README.md", *sorted(p for p in (REPO / "docs").rglob("*.md") if "_build" not in p.parts)]


def readme_commands() -> list[list[str]]:
    """Every command of a ```bash block whose program is drpo (after optional VAR=value words), in
    README.md and the docs pages, each once, in page order."""
    commands = []
    for page in doc_pages():
        for block in re.findall(r"```bash\n(.*?)```", page.read_text(), flags=re.S):
            for line in block.replace("\\\n", " ").splitlines():
                if not re.match(r"^\s*(\w+=\S+\s+)*drpo\s", line):
                    continue
                words = shlex.split(line, comments=True)
                if words not in commands:
                    commands.append(words)
    return commands


def run(words: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env_words = [w for w in words[: words.index("drpo")]]
    env = {**os.environ, **dict(w.split("=", 1) for w in env_words)}
    args = [DRPO, *words[words.index("drpo") + 1 :]]
    done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"{shlex.join(words)} failed ({done.returncode}):\n{done.stderr[-3000:]}"
    return done


def steps(run_dir: Path) -> list[dict]:
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "step"]


def test_readme_has_the_commands_this_test_runs():
    subcommands = {words[words.index("drpo") + 1] for words in readme_commands()}
    assert {"train", "export", "eval", "report"} <= subcommands


def test_every_readme_train_line_runs_simulated(tmp_path):
    """Each line in a fresh folder (one run folder never holds two runs), but --resume continues the
    run the line before it left."""
    cwd = None
    for i, words in enumerate(w for w in readme_commands() if w[w.index("drpo") + 1] == "train"):
        if "--resume" not in words:
            cwd = tmp_path / f"line-{i}"
            cwd.mkdir()
            for folder in ("controller", "examples"):  # --config controller/presets/… or examples/… as from the repo root
                (cwd / folder).symlink_to(REPO / folder)
        extra = [] if "train.steps" in " ".join(words) else ["--set", "train.steps=3"]
        if "--config" in words:
            extra += ["--set", "run_dir=runs/default"]
        if "--config" in words and load_config(cwd / words[words.index("--config") + 1]).task.type == "dataset":
            # a cluster preset's data are on shared storage: stand-ins here
            rows = "".join(json.dumps({"id": f"q{k}", "prompt": f"What is {k} + 1?", "answer": str(k + 1)}) + "\n" for k in range(40))
            (cwd / "data.jsonl").write_text(rows)
            extra += ["--set", "task.train_path=data.jsonl", "--set", "task.test_path=data.jsonl",
                      "--set", "eval.sets=[{name: aime-2024, path: data.jsonl}]"]
        run_dir = cwd / "runs" / "default"
        before = len(steps(run_dir)) if (run_dir / "metrics.jsonl").is_file() else 0
        done = run([*words, "--simulate", *QUIET, *extra], cwd)
        assert len(steps(run_dir)) > before and "ledger" in done.stdout, shlex.join(words)
        if "metrics.loggers" in " ".join(words):
            assert (run_dir / "tensorboard").is_dir() and list((run_dir / "wandb").glob("offline-run-*")) and (run_dir / "mlruns").is_dir()


def test_every_readme_export_eval_and_report_line_runs_on_a_real_run(ray_local, tiny_chat_model, tmp_path):
    """The run the lines read is trained in this process, on the tests' shared Ray cluster; the
    lines themselves run as written, each a process of its own."""
    from controller.cli import main

    setup = [
        "train", "--set", f"run_dir={tmp_path / 'runs' / 'default'}", "--set", f"model.path={tiny_chat_model}", "--set", "train.steps=2",
        "--set", "train.prompts_per_step=2", "--set", "rollout.samples_per_prompt=4", "--set", "rollout.max_new_tokens=3",
        "--set", "task.test_size=4", "--set", "eval.every=0", *QUIET,
    ]
    assert main(setup) == 0
    assert (tmp_path / "runs" / "default" / "hf" / "step-000002" / "model.safetensors").is_file()
    for words in readme_commands():
        sub = words[words.index("drpo") + 1]
        if sub not in ("export", "eval", "report"):
            continue
        if sub == "eval" and "runs/default-model" in words:
            words = [*words, "--set", "task.test_size=8"]  # the default preset's 128 prompts, fewer for CI
        done = run(words, tmp_path)
        target = tmp_path / words[words.index(sub) + 1]
        if sub == "export":
            out = tmp_path / words[words.index(sub) + 2]
            assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file(), shlex.join(words)
        elif sub == "eval":
            written = Path(done.stdout.strip().splitlines()[-1].removeprefix("written to "))
            result = json.loads((written if written.is_absolute() else tmp_path / written).read_text())
            assert 0.0 <= result["accuracy"] <= 1.0 and result["samples"] > 0, shlex.join(words)
        else:
            assert (target / "report" / "report.html").is_file()


def test_readmes_own_task_command_trains_its_example_for_real(tiny_chat_model, tmp_path):
    """The "Train on your own task" line (README and its guide), run as written (2 steps of 2
    prompts, no evaluation, the tiny chat model) in a copy of examples/own_task: the example's reward runs in the workers, its kwargs
    and components arrive."""
    import shutil

    lines = {m for page in doc_pages() for m in re.findall(r"cd examples/own_task && drpo train [^#`\n]+", page.read_text())}
    (line,) = {" ".join(line.split()) for line in lines}
    folder, command = re.match(r"cd (\S+) && (drpo train [^#]+)", line).groups()
    shutil.copytree(REPO / folder, tmp_path / "own_task")
    extra = ["--set", "train.steps=2", "--set", "train.prompts_per_step=2", "--set", "eval.at_start=false", "--set", "eval.every=0",
             "--set", "checkpoint.every=0", "--set", f"model.path={tiny_chat_model}", *QUIET]  # what the assertions need
    done = run([*shlex.split(command), *extra], tmp_path / "own_task")
    records = steps(tmp_path / "own_task" / "runs" / "own-task")
    assert [s["step"] for s in records] == [1, 2] and "reward components, first -> last step" in done.stdout
    for s in records:  # score = correct + format_weight x format, with task.yaml's format_weight 0.2 (the default is 0.1)
        assert s["reward/mean"] == pytest.approx(s["reward/component/correct"] + 0.2 * s["reward/component/format"])
        assert s["reward/errors/error"] == 0 and s["reward/reason/scored"] == 1.0
