"""Multi-turn episodes: token in, token out through a real engine; the calculator tool; failures."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from rollout.config import EnvironmentConfig, RolloutConfig
from rollout.engine import SamplingParams
from rollout.episodes import ChatTurns
from rollout.generator import Generator
from rollout.grader import Grader
from rollout.records import TrainTicket
from rollout.tasks import Problem
from rollout.tools import ToolEnvironment, ToolError, calculator

pytestmark = [pytest.mark.engine]
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def hf_engine(tiny_chat_model):
    from rollout.hf_engine import HFEngine

    return HFEngine(str(tiny_chat_model))


def generator(engine, environment: dict, n: int = 2, max_new_tokens: int = 6, seed: int | None = 0) -> Generator:
    config = RolloutConfig(samples_per_prompt=n, max_new_tokens=max_new_tokens, environment=environment)
    return Generator.build(config, engine=engine, seed=seed, topk_logprobs=2)


def run(gen: Generator, problems: list[Problem]):
    return gen.generate([(TrainTicket(0, p.id), p, gen.sampling.n) for p in problems])


def test_the_learner_scores_exactly_the_engines_ids_plus_the_environments_rendered_alone(hf_engine):
    """A scripted 2-turn environment on the tiny chat model (SmolLM2's template, special tokens
    <|im_start|>/<|im_end|>): the episode's ids are turn 1's sampled ids, the template's end of turn,
    the observation rendered alone, then turn 2's sampled ids, token for token; only the model's
    tokens are in the loss mask, with their mu."""
    gen = generator(hf_engine, {"path": "tests.env_fixtures:Scripted", "kwargs": {"turns": 2}})
    (out,) = run(gen, [Problem("p1", "What is 2+2?", "4")])
    turns = ChatTurns(hf_engine.tokenizer)
    observation = turns.appended([{"role": "user", "content": "hello there 42"}])
    for k, c in enumerate(out.completions):
        ids, mask = c.response_ids.tolist(), c.loss_mask.tolist()
        env_at = [i for i, m in enumerate(mask) if not m]
        assert c.episode.turns == 2 and c.episode.error is None and c.episode.environment_reward == pytest.approx(0.5)
        first = ids[: env_at[0]]
        inserted = ids[env_at[0]: env_at[-1] + 1]
        assert inserted == turns.close(first) + observation  # the environment's ids: end of turn, then the message alone
        second = ids[env_at[-1] + 1:]
        assert all(mask[: env_at[0]]) and all(mask[env_at[-1] + 1:]) and len(second) > 0
        # the engine continued from exactly this prefix: scoring prompt + first turn + inserted ids again gives turn 2's mu
        again = hf_engine.generate([c.prompt_ids.tolist() + first + inserted], SamplingParams(n=1, max_new_tokens=1, greedy=True))[0][0]
        assert again.prompt_ids.tolist() == c.prompt_ids.tolist() + first + inserted
        assert torch.all(c.rollout_logp[~c.loss_mask] == 0) and torch.all(c.rollout_logp[c.loss_mask] <= 0)
        assert c.topk_ids.shape == (len(ids), 2) and torch.all(c.topk_ids[~c.loss_mask] == 0)
        assert c.versions.tolist() == [0] * len(ids) and c.model_tokens == len(first) + len(second)
        # the reward reads the last model turn; the conversation is the episode's record
        assert [m["role"] for m in c.episode.messages] == ["user", "assistant", "user", "assistant"]
        assert c.episode.messages[-1]["content"] == hf_engine.tokenizer.decode(second, skip_special_tokens=True) == out.texts[k]


def test_a_whole_conversation_retokenized_differs_from_the_sampled_ids(hf_engine):
    """Why episodes append ids instead of re-rendering: a model that sampled "hel" + "lo" wrote the
    text "hello", which the tokenizer encodes as one token."""
    tok = hf_engine.tokenizer
    sampled = tok.encode("hel", add_special_tokens=False) + tok.encode("lo", add_special_tokens=False)
    turns = ChatTurns(tok)
    opening = [{"role": "user", "content": "Say hello."}]
    prompt = hf_engine.chat_prompt(opening)
    appended = prompt + sampled + turns.close(sampled) + turns.appended([{"role": "user", "content": "again"}])
    whole = hf_engine.chat_prompt(opening + [{"role": "assistant", "content": tok.decode(sampled)}, {"role": "user", "content": "again"}])
    assert tok.decode(appended) == tok.decode(whole) and appended != whole


def test_seeded_episodes_repeat_and_an_async_step_works(hf_engine):
    env = {"path": "tests.env_fixtures:AsyncScripted", "kwargs": {"turns": 3}}
    a = run(generator(hf_engine, env, seed=5), [Problem("p", "What is 1+2?", "3")])[0]
    b = run(generator(hf_engine, env, seed=5), [Problem("p", "What is 1+2?", "3")])[0]
    assert [c.response_ids.tolist() for c in a.completions] == [c.response_ids.tolist() for c in b.completions]
    assert all(c.episode.turns == 3 for c in a.completions)


def test_budgets_truncate_by_name(hf_engine):
    turns = run(generator(hf_engine, {"path": "tests.env_fixtures:Scripted", "kwargs": {"turns": 9}, "max_turns": 2}), [Problem("p", "Hi", "1")])[0]
    assert all(c.episode.truncated == "max_turns" and c.episode.turns == 2 for c in turns.completions)
    tokens = run(generator(hf_engine, {"path": "tests.env_fixtures:Scripted", "kwargs": {"turns": 9}, "max_episode_tokens": 20}), [Problem("p", "Hi", "1")])[0]
    assert all(c.episode.truncated == "tokens" and len(c.response_ids) <= 20 for c in tokens.completions)
    # the environment judged the turn that spent the budget too: a step reward for every model turn
    assert all(c.episode.environment_reward == pytest.approx(0.25 * c.episode.turns) for c in tokens.completions)


def test_an_environment_that_raises_or_times_out_fails_its_episodes_by_name_and_the_group(hf_engine):
    grader = Grader.build(RolloutConfig(reward={"type": "python", "function": "tests.reward_fixtures:correct_and_length"}))
    for path, kwargs, reason, words in (("tests.env_fixtures:Raises", {}, "error", "step raised KeyError: 'no such state'"),
                                        ("tests.env_fixtures:Slow", {"seconds": 3.0}, "timeout", "step took longer than 0.5 s")):
        gen = generator(hf_engine, {"path": path, "kwargs": kwargs, "step_timeout_s": 0.5})
        (out,) = run(gen, [Problem("p", "Hi", "1")])
        assert all(c.episode.error == (reason, f"environment {path}: {words}") for c in out.completions)
        group = grader.grade(out.ticket, out.problem, out.completions, out.texts, 0, out.seconds, out.topk)
        assert group.error == f"its environment failed on every sample ({reason}): environment {path}: {words}"
        assert [r.reason for r in group.reward_failures] == [reason, reason]


def test_a_missing_environment_is_named():
    with pytest.raises(ImportError, match="rollout.environment.path='no_such_module:Env': cannot import 'no_such_module'"):
        from rollout.environment import load_environment

        load_environment("no_such_module:Env")
    assert RolloutConfig(environment="tests.env_fixtures:Scripted").environment == EnvironmentConfig(path="tests.env_fixtures:Scripted")
    # before Ray starts, drpo train imports the class and, for tool calls, every tool
    from controller.app import environment_problems

    assert environment_problems(EnvironmentConfig(path="rollout.tools:ToolEnvironment", kwargs={"tools": ["rollout.tools:calculator"]})) == []
    (problem,) = environment_problems(EnvironmentConfig(path="rollout.tools:ToolEnvironment", kwargs={"tools": ["my_tools:lookup"]}))
    assert problem.startswith("rollout.environment.kwargs.tools='my_tools:lookup': cannot import 'my_tools'")


def test_the_calculator_computes_and_refuses_code_huge_exponents_and_long_input_by_name():
    assert calculator("(3 + 4) * 12") == "84" and calculator("7 / 2") == "3.5" and calculator("-2 ** 3") == "-8" and calculator("2**64") == "18446744073709551616"
    for expression, words in (
        ("__import__('os').system('true')", "not code (Call)"), ("x + 1", "not code (Name)"), ("(1).real", "not code (Attribute)"),
        ("2 ** 1000", "exponent 1000 is larger than 64"), ("9 ** 9 ** 9", "exponent 387420489 is larger than 64"),
        ("1" * 201, "expression is 201 characters, more than 200"), ("1 / 0", "division by zero"), ("10**30 * 10**30", "result is too large"),
        ("1 +", "not an arithmetic expression"), ("True + 1", "not code (Constant)"), ("1e400", "number inf is too large"),
        ("2 * 1e40", "number 1e+40 is too large"),
    ):
        with pytest.raises(ToolError, match=re.escape(words)):
            calculator(expression)


def test_tool_calls_are_run_and_their_errors_go_back_to_the_model():
    env = ToolEnvironment()
    opening = env.reset(Problem("p", "What is 12 times 13?", "156"))
    assert opening[0]["role"] == "system" and '"name": "calculator"' in opening[0]["content"] and opening[1]["content"] == "What is 12 times 13?"
    step = env.step('Let me compute. <tool_call>{"name": "calculator", "arguments": {"expression": "12*13"}}</tool_call>')
    assert step.messages == [{"role": "tool", "content": "156"}] and (step.tool_calls, step.tool_errors, step.done) == (1, 0, False)
    bad = env.step('<tool_call>{"name": "calculator", "arguments": {"expression": "2**999"}}</tool_call><tool_call>{"name": "search"}</tool_call>')
    assert [m["content"] for m in bad.messages] == ["error: exponent 999 is larger than 64", "error: no tool named 'search'; tools: calculator"]
    assert (bad.tool_calls, bad.tool_errors) == (2, 2)
    assert env.step("The answer is 156.").done


def test_the_tools_are_described_by_a_chat_template_that_renders_them_and_by_a_system_message_otherwise(hf_engine, tiny_chat_model, tmp_path):
    """A template with a tools= list (Qwen's layout) gets the calculator's JSON schema there and no
    system message of ours; SmolLM2's template, which ignores tools=, gets our system message. The
    tool results go back in the template's own form either way."""
    from rollout.hf_engine import HFEngine
    from rollout.tools import schema
    from tests.env_fixtures import with_qwen_style_template

    qwen = HFEngine(str(with_qwen_style_template(tiny_chat_model, tmp_path / "qwen-style")))
    tools = {"path": "rollout.tools:ToolEnvironment"}
    texts = {}
    for name, engine in (("smollm2", hf_engine), ("qwen-style", qwen)):
        (out,) = run(generator(engine, tools, n=1), [Problem("p", "What is 12 times 13?", "156")])
        texts[name] = engine.tokenizer.decode(out.completions[0].prompt_ids)
        assert ChatTurns(engine.tokenizer).renders_tools == (name == "qwen-style")
    described = json.dumps(schema(calculator))
    assert "<tools>" in texts["qwen-style"] and described in texts["qwen-style"] and "You can use tools" not in texts["qwen-style"]
    assert "<tools>" not in texts["smollm2"] and "You can use tools" in texts["smollm2"] and '"name": "calculator"' in texts["smollm2"]
    answer = qwen.tokenizer.decode(ChatTurns(qwen.tokenizer).appended([{"role": "tool", "content": "156"}]))
    assert answer == "<|im_start|>user\n<tool_response>\n156\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert schema(calculator)["function"]["parameters"] == {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}
    # a template whose tool format is not the environment's tags leaves the tools to our system message
    other = ToolEnvironment(open_tag="<call>", close_tag="</call>")
    assert ChatTurns(qwen.tokenizer).teaches(ToolEnvironment()) and not ChatTurns(qwen.tokenizer).teaches(other)
    (out,) = run(generator(qwen, {"path": "rollout.tools:ToolEnvironment", "kwargs": {"open_tag": "<call>", "close_tag": "</call>"}}, n=1),
                 [Problem("p", "What is 12 times 13?", "156")])
    text = qwen.tokenizer.decode(out.completions[0].prompt_ids)
    assert "<tools>" not in text and "You can use tools. To call one, write <call>" in text

    def lookup(term: str, limit: "int | None" = None, *rest, **options) -> str:
        """Look a term up."""
    assert schema(lookup)["function"]["parameters"] == {
        "type": "object", "properties": {"term": {"type": "string"}, "limit": {"type": "integer"}}, "required": ["term"]}


def test_the_guides_retry_environment_tells_a_wrong_answer_and_ends_at_a_right_one(hf_engine, monkeypatch):
    """examples/environment/retry.py, from its own folder as a user's module: a wrong answer gets the
    feedback and a penalty, a right one ends the episode; through the engine, an episode ends at its
    first right answer or runs to max_turns, with the feedback between its turns."""
    monkeypatch.syspath_prepend(str(REPO / "examples" / "environment"))
    from rollout.environment import load_environment

    env = load_environment("retry:Retry")(penalty=0.25)
    assert env.reset(Problem("p", "Ann has 3 apples and gets 4 more. How many?", "7")) is None
    wrong = env.step("She has 8 apples.")
    assert wrong.messages == [{"role": "user", "content": "That is not right. Check your work and try again."}] and wrong.reward == -0.25
    assert env.step("3 + 4 = 7, so the answer is 7.").done
    (out,) = run(generator(hf_engine, {"path": "retry:Retry", "kwargs": {"penalty": 0.1}, "max_turns": 3}, n=4),
                 [Problem("p", "Ann has 3 apples and gets 4 more. How many?", "7")])
    for c in out.completions:
        answers = [m["content"] for m in c.episode.messages if m["role"] == "assistant"]
        right = [env.step(a).done for a in answers]
        assert c.episode.turns == len(answers) and not any(right[:-1])  # it ended at the first right answer, if any
        assert [m["role"] for m in c.episode.messages] == ["user"] + ["assistant", "user"] * (len(answers) - 1) + ["assistant"]
        # the environment judges every turn, the last too: a penalty per wrong answer
        assert c.episode.environment_reward == pytest.approx(-0.1 * right.count(False))
        assert c.episode.truncated == (None if right[-1] else "max_turns") and (right[-1] or len(answers) == 3)


def test_the_batch_trains_and_ages_the_models_tokens_only():
    """An episode's environment tokens (here stamped with a nonsense version 0 and mu 0) are in the
    rows as context but not in the response mask: neither the group's lag, the token-lag histogram
    nor the advantages see them."""
    from controller.batch_builder import BatchBuilder
    from objectives.config import AdvantageConfig
    from rollout.engine import Completion, Episode
    from rollout.records import Group, Sample
    from rollout.rewards import RewardResult

    def episode(reward: float) -> Sample:
        mask = torch.tensor([True, True, False, False, False, True])
        c = Completion(torch.tensor([1, 2, 3]), torch.tensor([10, 11, 2, 198, 1, 12]), torch.tensor([-0.5, -0.4, 0.0, 0.0, 0.0, -0.3]),
                       torch.tensor([4, 4, 0, 0, 0, 5]), "stop", 4, loss_mask=mask, episode=Episode(turns=2))
        return Sample(c, "x", RewardResult(reward))

    group = Group(TrainTicket(0, "p"), 0, (episode(1.0), episode(0.0)), 4, 1.0)
    batch = BatchBuilder.build(AdvantageConfig(filter_zero_variance=False)).batch([group], version=6)
    mask = batch.train.response_mask
    assert mask[0].tolist() == [False] * 3 + [True, True, False, False, False, True]
    assert batch.lags == (2,)  # version 6 minus the oldest model token's 4, not the environment's 0
    assert batch.metrics["staleness/token_lag_hist/bin_2"] == 4 and batch.metrics["staleness/token_lag_hist/bin_1"] == 2
    assert torch.all(batch.train.advantages[~mask] == 0) and batch.metrics["episode/environment_token_frac"] == 0.5
