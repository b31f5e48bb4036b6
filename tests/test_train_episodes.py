"""`drpo train` with an environment of one's own (a module written outside the drpo package, found
through PYTHONPATH): multi-turn episodes through the whole data path, with the hf and vLLM engines."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.test_controller_e2e import records, run_config
from tests.test_own_task import drpo_train

pytestmark = [pytest.mark.ray, pytest.mark.engine, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[1]

MODULE = '''
import time

from rollout.environment import Environment, StepResult


class Quiz(Environment):
    """Asks the model to check its answer until it has answered `turns` times; a reward of 0.1 per check.
    Each answer takes `think` seconds (a checker's or a tool's latency): an episode outlasts a learner step."""

    def __init__(self, turns=3, think=0.0):
        super().__init__()
        self.turns, self.seen, self.think = turns, 0, think

    def reset(self, problem):
        return [{"role": "system", "content": "Answer, then check when asked."}, *problem.chat_messages()]

    def step(self, response):
        time.sleep(self.think)
        self.seen += 1
        if self.seen >= self.turns:
            return StepResult(done=True)
        return StepResult(messages=[{"role": "user", "content": "Check it once more."}], reward=0.1)
'''


def episode_run(tmp_path: Path, model, steps: int, think: float = 0.0, **rollout) -> tuple[Path, object]:
    mine = tmp_path / "my_envs"
    mine.mkdir()
    (mine / "quiz.py").write_text(MODULE)
    cfg = run_config(tmp_path, model, steps=steps).model_dump(mode="json")
    cfg["rollout"].update(environment={"path": "quiz:Quiz", "kwargs": {"turns": 3, "think": think}, "max_turns": 3, "max_episode_tokens": 96}, **rollout)
    cfg["advantages"] = {**cfg.get("advantages", {}), "filter_zero_variance": False}  # the tiny model scores 0: train every group
    cfg["metrics"].update(port=None, rollouts=True)
    cfg["eval"].update(every=0, at_start=True)
    cfg["checkpoint"].update(every=0)
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    done = drpo_train(tmp_path / "run.yaml", tmp_path, {"PYTHONPATH": f"{mine}:{REPO}"})
    assert done.returncode == 0, done.stderr[-4000:]
    return tmp_path / "run", done


def test_async_episodes_span_publications_and_train_on_the_models_tokens_only(tiny_chat_model, tmp_path):
    # each environment step takes 0.1 s, so the episodes admitted ahead (eta 1) are still running
    # when the learner publishes (16 of 32 spanned one here): their later turns are sampled by the newer weights
    run_dir, done = episode_run(tmp_path, tiny_chat_model, steps=4, think=0.1)
    steps = records(run_dir, "step")
    assert [s["step"] for s in steps] == [1, 2, 3, 4] and steps[-1]["ledger/trained"] == 4 * 2  # the ledger is exact
    for s in steps:
        assert s["episode/turns_mean"] == 3 and s["episode/truncated/max_turns"] == 0 and s["episode/truncated/tokens"] == 0
        assert 0.3 < s["episode/environment_token_frac"] < 1 and s["episode/environment_reward_mean"] == pytest.approx(0.2)
        assert s.get("reward/component/environment", 0.2) == pytest.approx(0.2) and s["staleness/lag_max"] <= 1  # groups that arrived since the last step
    assert any("reward/component/environment" in s for s in steps)
    for evaluation in records(run_dir, "eval"):  # evaluation runs episodes too (at the start and the end)
        heldout = evaluation["sets"]["heldout"]
        assert heldout["samples"] > 0 and heldout["failed"] == 0 and heldout["turns_mean"] == 3 and heldout["tool_calls_mean"] == 0
    episodes = [json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text().splitlines()]
    assert len(episodes) == 4 * 2 * 4 and all(e["episode"]["turns"] == 3 for e in episodes)
    for e in episodes:
        roles = [m["role"] for m in e["episode"]["messages"]]
        assert roles == ["system", "user", "assistant", "user", "assistant", "user", "assistant"]
        turns = e["episode"]["turn_versions"]
        assert len(turns) == 3 and all(a[1] <= b[0] for a, b in zip(turns, turns[1:]))  # versions never go back along an episode
        assert e["episode"]["model_tokens"] < len(e["response_ids"])
    # async: the learner published between an episode's turns, so later turns were sampled by newer weights
    assert any(e["episode"]["turn_versions"][-1][1] > e["episode"]["turn_versions"][0][0] for e in episodes)


def test_episodes_continue_from_their_token_prefix_on_vllm(tiny_vllm_model, tmp_path):
    run_dir, _ = episode_run(tmp_path, tiny_vllm_model, steps=2, engine="vllm")
    steps = records(run_dir, "step")
    assert [s["step"] for s in steps] == [1, 2] and all(s["episode/turns_mean"] == 3 for s in steps)
    assert all(s["gap/abs_shift_mean"] < 1e-3 for s in steps)  # the learner scored what vLLM sampled, token for token (fp32 both sides)


def test_an_environment_that_fails_every_episode_stops_the_run_naming_it(tiny_chat_model, tmp_path):
    cfg = run_config(tmp_path, tiny_chat_model, steps=4, mode="sync", max_staleness=0, max_failures_in_a_row=4).model_dump(mode="json")
    cfg["rollout"]["environment"] = "tests.env_fixtures:Raises"  # the bare form: the class path alone
    cfg["eval"].update(every=0, at_start=False)
    cfg["metrics"].update(port=None)
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    done = drpo_train(tmp_path / "run.yaml", REPO, {})
    assert done.returncode == 1, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert "every rollout failed: 4 groups in a row" in last
    assert "its environment failed on every sample (error): environment tests.env_fixtures:Raises: step raised KeyError: 'no such state'" in last
    assert "drpo train: an environment: first sample it could not score (error): environment tests.env_fixtures:Raises" in done.stderr
    assert not records(tmp_path / "run", "step")  # nothing was trained


def test_a_chat_template_that_renders_tools_describes_the_calculator_in_drpo_train(tiny_chat_model, tmp_path):
    """The built-in tool environment through `drpo train` on a model whose chat template renders a
    tools= list (Qwen's layout): every trained sample's prompt carries the calculator's JSON schema
    in the template's <tools> section, and none carries the system message used for templates without one."""
    from transformers import AutoTokenizer

    from rollout.tools import calculator, schema
    from tests.env_fixtures import with_qwen_style_template

    model = with_qwen_style_template(tiny_chat_model, tmp_path / "qwen-style")
    cfg = run_config(tmp_path, model, steps=2, mode="sync", max_staleness=0).model_dump(mode="json")
    cfg["rollout"]["environment"] = {"path": "rollout.tools:ToolEnvironment", "max_turns": 2, "max_episode_tokens": 32}
    cfg["advantages"] = {**cfg.get("advantages", {}), "filter_zero_variance": False}
    cfg["metrics"].update(port=None, rollouts=True)
    cfg["eval"].update(every=0, at_start=False)
    cfg["checkpoint"].update(every=0)
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    done = drpo_train(tmp_path / "run.yaml", REPO, {})
    assert done.returncode == 0, done.stderr[-4000:]
    tokenizer = AutoTokenizer.from_pretrained(model)
    samples = [json.loads(line) for line in (tmp_path / "run" / "rollouts.jsonl").read_text().splitlines()]
    assert len(samples) == 2 * 2 * 4 and all(s["episode"]["tool_calls"] == 0 and s["episode"]["turns"] == 1 for s in samples)  # the tiny model writes digits only
    described = json.dumps(schema(calculator))
    for s in samples:
        prompt = tokenizer.decode(s["prompt_ids"])
        assert "<tools>" in prompt and described in prompt and "You can use tools" not in prompt, prompt
        assert s["episode"]["messages"][0]["role"] == "user"  # the opening is the problem's own: the template added the tools
