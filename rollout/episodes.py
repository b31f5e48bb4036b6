"""Running multi-turn episodes on an engine, token in, token out.

Every turn is one engine call over the episodes still going, each continued from its own token
prefix (the prompt, then every id so far): the engine samples the model's turn with mu and a
version per token, exactly as for a single response (an update landing mid-turn is recorded token
by token; a later turn runs on whatever weights are current, so versions increase along the
episode). The environment's answer is appended as ids rendered from its messages alone
(``ChatTurns``), after the template's end-of-turn tokens the model did not sample; the whole
conversation is never re-tokenized, so the ids the learner scores are the ids the engine sampled.
Appended ids are context only: loss mask 0, mu 0, the preceding model token's version (so a
response's oldest and newest versions are its model tokens'), zero top-K rows.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from rollout.config import EnvironmentConfig
from rollout.engine import Completion, Engine, Episode, SamplingParams, mix_seed
from rollout.environment import EnvironmentFailed, Episodes
from rollout.tasks import Problem


def _ids(rendered) -> list[int]:
    return list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)


class ChatTurns:
    """How a chat template ends a model turn and renders messages appended after one."""

    _BASE = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.before = self._render(self._BASE, False)
        opened = self._render(self._BASE[:1], True)
        content = tokenizer.encode("y", add_special_tokens=False)
        tail = self.before[len(opened):]
        if self.before[: len(opened)] != opened or tail[: len(content)] != content:
            raise ValueError("this chat template does not render an assistant turn as the generation prompt followed by its "
                             "content, so an episode cannot be continued token by token")
        self.closing = tail[len(content):]
        """The template's tokens after an assistant turn's content (e.g. <|im_end|> and a newline)."""
        self.tools_text = self._tools_text()
        """What the template says about a ``tools=`` list ("" when it renders none: SmolLM2's; Qwen2.5/Qwen3's do)."""
        self.renders_tools = bool(self.tools_text)

    def _tools_text(self) -> str:
        probe = {"type": "function", "function": {"name": "drpo_probe_tool", "description": "probe",
                                                  "parameters": {"type": "object", "properties": {}}}}
        try:
            text = self.tokenizer.apply_chat_template(self._BASE[:1], tools=[probe], add_generation_prompt=True, tokenize=False)
        except Exception:  # noqa: BLE001 - a template that refuses tools does not render them
            return ""
        return text if "drpo_probe_tool" in text else ""

    def teaches(self, env) -> bool:
        """The template describes tools and, for an environment with a call tag (``open_tag``), teaches
        that tag: a template with another call format (Llama 3's bare JSON) leaves the tools to the environment."""
        tag = getattr(env, "open_tag", None)
        return self.renders_tools and (not isinstance(tag, str) or tag in self.tools_text)

    def _render(self, messages: list[dict], generation_prompt: bool) -> list[int]:
        return _ids(self.tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True))

    def appended(self, messages: list[dict]) -> list[int]:
        """The ids of ``messages`` after a finished assistant turn, the next generation prompt included."""
        after = self._render(self._BASE + list(messages), True)
        if after[: len(self.before)] != self.before:
            raise ValueError("the chat template renders earlier turns differently once more messages follow; "
                             "an episode cannot be continued token by token")
        return after[len(self.before):]

    def close(self, response_ids: list[int]) -> list[int]:
        """The end-of-turn ids the model did not sample: the rest of ``closing`` after its own
        end-of-turn token, or all of it after a turn cut at its length limit."""
        if self.closing and response_ids and response_ids[-1] == self.closing[0]:
            return self.closing[1:]
        return list(self.closing)


@dataclass
class _Run:
    """One episode in progress."""

    env: Any
    prompt_ids: list[int]
    seed: int | None
    messages: list[dict]
    ids: list[int] = field(default_factory=list)
    logp: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    top_ids: list[torch.Tensor] = field(default_factory=list)
    top_logp: list[torch.Tensor] = field(default_factory=list)
    prompt_version: int | None = None
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    reward: float = 0.0
    seconds: float = 0.0
    last_text: str = ""
    finish: str = "stop"
    truncated: str | None = None
    error: tuple[str, str] | None = None
    done: bool = False

    def add(self, ids, logp, versions, model: bool, top_ids=None, top_logp=None, topk: int = 0) -> None:
        self.ids += [int(x) for x in ids]
        self.logp += [float(x) for x in logp]
        self.versions += [int(x) for x in versions]
        self.mask += [model] * len(ids)
        if topk:
            self.top_ids += list(top_ids) if top_ids is not None else [torch.zeros(topk, dtype=torch.long)] * len(ids)
            self.top_logp += list(top_logp) if top_logp is not None else [torch.zeros(topk)] * len(ids)

    def completion(self, topk: int) -> Completion:
        episode = Episode(self.turns, self.tool_calls, self.tool_errors, self.reward, self.seconds, self.truncated, self.error, tuple(self.messages))
        return Completion(
            prompt_ids=torch.tensor(self.prompt_ids), response_ids=torch.tensor(self.ids, dtype=torch.long),
            rollout_logp=torch.tensor(self.logp, dtype=torch.float32), versions=torch.tensor(self.versions, dtype=torch.long),
            finish_reason=self.finish, prompt_version=self.prompt_version or 0,
            topk_ids=torch.stack(self.top_ids) if topk and self.top_ids else None,
            topk_logp=torch.stack(self.top_logp) if topk and self.top_logp else None,
            loss_mask=torch.tensor(self.mask, dtype=torch.bool), episode=episode,
        )


class EpisodeRunner:
    """Multi-turn rollouts on one engine with one ``rollout.environment``."""

    def __init__(self, engine: Engine, config: EnvironmentConfig, max_new_tokens: int, decode: Callable[[Any], str]):
        self.engine, self.config, self.max_new_tokens, self.decode = engine, config, max_new_tokens, decode
        self.episodes = Episodes(config.path, config.kwargs, config.step_timeout_s)
        self.turns = ChatTurns(engine.tokenizer)

    def open(self, problem: Problem, seed: int | None) -> _Run:
        """A new episode on ``problem``: its environment and opening prompt (raises EnvironmentFailed
        or ValueError for a bad opening, which fails the submission)."""
        env = self.episodes.call(self.episodes.new)
        template_tools = self.turns.teaches(env)
        try:
            env.template_tools = template_tools  # an environment of one's own need not subclass Environment
        except AttributeError:
            pass
        opening = self.episodes.call(env.reset, problem) or problem.chat_messages()
        tools = self.episodes.call(env.tools) if template_tools and callable(getattr(env, "tools", None)) else None
        return _Run(env, self.engine.chat_prompt(opening, tools=tools), seed, [dict(m) for m in opening])

    def run(self, runs: list[list[_Run]], params: SamplingParams) -> list[list[Completion]]:
        """Every episode of ``runs`` (one list per submission) to its end; one engine call per turn.
        Engine errors propagate (the caller fails the submissions, or restarts a dead engine)."""
        flat = [r for group in runs for r in group]
        try:
            while active := [r for r in flat if not r.done]:
                room = max(self.config.max_episode_tokens - len(r.ids) for r in active)  # a row with less is cut to its own
                seeded = all(r.seed is not None for r in active)
                call = dataclasses.replace(params, n=1, max_new_tokens=max(1, min(self.max_new_tokens, room)), seed=None,
                                           prompt_seeds=tuple(mix_seed(r.seed, r.turns) for r in active) if seeded else None)
                results = self.engine.generate([r.prompt_ids + r.ids for r in active], call)
                for r, (c,) in zip(active, results):
                    self._model_turn(r, c, params.topk_logprobs)
        finally:
            for r in flat:
                try:
                    r.env.close()
                except Exception:  # noqa: BLE001 - closing is best effort
                    pass
        return [[r.completion(params.topk_logprobs) for r in group] for group in runs]

    def _model_turn(self, r: _Run, c: Completion, topk: int) -> None:
        room = self.config.max_episode_tokens - len(r.ids)
        ids, logp, versions = c.response_ids[:room], c.rollout_logp[:room], c.versions[:room]
        cut = len(ids) < len(c.response_ids)
        r.prompt_version = c.prompt_version if r.prompt_version is None else r.prompt_version
        r.add(ids, logp, versions, True, c.topk_ids[:room] if c.topk_ids is not None else None,
              c.topk_logp[:room] if c.topk_logp is not None else None, topk)
        r.turns += 1
        r.finish = "length" if cut else c.finish_reason
        r.last_text = self.decode(ids)
        r.messages.append({"role": "assistant", "content": r.last_text})
        spent = len(r.ids) >= self.config.max_episode_tokens
        began = time.perf_counter()  # the environment judges every turn, one that spent the budget too
        try:
            step = self.episodes.step(r.env, r.last_text)
        except EnvironmentFailed as err:
            r.error, r.done = (err.reason, str(err)), True
            return
        finally:
            r.seconds += time.perf_counter() - began
        r.tool_calls += step.tool_calls
        r.tool_errors += step.tool_errors
        r.reward += float(step.reward or 0.0)
        if step.done or not step.messages:
            r.done = True
            return
        if spent:
            r.truncated, r.done = "tokens", True
            return
        if r.turns >= self.config.max_turns:
            r.truncated, r.done = "max_turns", True
            return
        inserted = self.turns.close(r.ids) + self.turns.appended(step.messages)
        if len(r.ids) + len(inserted) >= self.config.max_episode_tokens:  # no room left for a model token after it
            r.truncated, r.done = "tokens", True
            return
        last = r.versions[-1] if r.versions else (r.prompt_version or 0)
        r.add(inserted, [0.0] * len(inserted), [last] * len(inserted), False, topk=topk)
        r.messages += [dict(m) for m in step.messages]

    def close(self) -> None:
        self.episodes.close()
