"""Environments of one's own that tests load by import path (``tests.env_fixtures:NAME``), as a user's
module outside the drpo package would be."""

from __future__ import annotations

import time

from rollout.environment import Environment, StepResult


class Scripted(Environment):
    """Answers every model turn with the same observation (a word that tokenizes differently alone and
    inside longer text) until ``turns`` model turns have run, with a reward of 0.25 per step."""

    def __init__(self, turns: int = 2, observation: str = "hello there 42", reward: float = 0.25):
        super().__init__()
        self.turns, self.observation, self.reward, self.seen = turns, observation, reward, 0

    def step(self, response: str) -> StepResult:
        self.seen += 1
        if self.seen >= self.turns:
            return StepResult(done=True, reward=self.reward)
        return StepResult(messages=[{"role": "user", "content": self.observation}], reward=self.reward)


class AsyncScripted(Scripted):
    """The same as a coroutine: step is ``async def``."""

    async def step(self, response: str) -> StepResult:  # type: ignore[override]
        return Scripted.step(self, response)


class Raises(Environment):
    """Fails every episode at its first step."""

    def step(self, response: str) -> StepResult:
        raise KeyError("no such state")


class Slow(Environment):
    """Takes ``seconds`` per step (past a short step_timeout_s)."""

    def __init__(self, seconds: float = 5.0):
        super().__init__()
        self.seconds = seconds

    def step(self, response: str) -> StepResult:
        time.sleep(self.seconds)
        return StepResult(done=True)


# A chat template that describes a tools= list itself, worded and laid out as Qwen2.5's is (the
# tools as JSON in <tools></tools> in the system turn, calls in <tool_call></tool_call>, results as
# <tool_response> in a user turn); Qwen's own models are not packaged offline here.
QWEN_STYLE_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}{% else %}You are a helpful assistant.{% endif %}"
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n"
    "<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n"
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if not (loop.first and m.role == 'system') %}"
    "{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def with_qwen_style_template(model, folder):
    """A copy of the model folder ``model`` whose chat template is QWEN_STYLE_TEMPLATE."""
    import shutil

    from transformers import AutoTokenizer

    shutil.copytree(model, folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = QWEN_STYLE_TEMPLATE
    tokenizer.save_pretrained(folder)
    return folder
