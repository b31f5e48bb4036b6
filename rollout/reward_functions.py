"""The reward ``rollout.reward`` configures, as one interface: ``score(samples) -> results``.

Five kinds, all behind ``Reward.score``: the two built-in comparisons (rollout/rewards.py), a
function of one's own by import path (``python``: per sample, or per group with ``batch: true``), a
reward service (``http``: one POST per sample) and an LLM judge (``judge``: one chat completion per
sample on an OpenAI-compatible server). Services are called from a pool of ``max_concurrency``
threads, each request bounded by ``timeout_s`` and retried ``retries`` times.

A sample the reward cannot score gets a failed ``RewardResult`` (reason ``error``, ``timeout``,
``invalid`` or ``unreachable``, the error in ``detail``); nothing raises out of ``score``. What a
failed sample does to its group (``on_error``) is the grader's business (rollout/grader.py).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from rollout.config import (
    HttpRewardConfig, JudgeRewardConfig, LiteralRewardConfig, MathVerifyRewardConfig, PythonRewardConfig, RewardConfig, ScoringConfig,
)
from rollout.rewards import LiteralNumberReward, MathVerifyReward, RewardInput, RewardResult
from rollout.user_code import load

DETAIL_CHARS = 300
"""How much of an error a failed sample keeps."""


def failure(reason: str, err: BaseException | str) -> RewardResult:
    text = err if isinstance(err, str) else f"{type(err).__name__}: {err}"
    return RewardResult(0.0, reason=reason, detail=text[:DETAIL_CHARS])


def _number(value: Any) -> bool:
    """A real number: int, float, numpy scalars, 0-d tensors (anything float() takes but text and bools)."""
    if isinstance(value, (bool, str, bytes)) or not hasattr(value, "__float__"):
        return False
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return True


def as_result(value: Any, score_range: tuple[float, float] | None = None) -> RewardResult:
    """What a reward returned, as a ``RewardResult``: a number, a dict {score, components?, reason?}
    or a RewardResult; anything else, a non-finite score, or one outside ``score_range`` is a
    failed sample (reason invalid) naming what came back."""
    if isinstance(value, RewardResult):
        result = value
    elif _number(value):
        result = RewardResult(float(value))
    elif isinstance(value, dict) and _number(value.get("score")):
        components = value.get("components") or {}
        if not isinstance(components, dict) or not all(isinstance(k, str) and _number(v) and math.isfinite(float(v)) for k, v in components.items()):
            return failure("invalid", f"components must map names to finite numbers, got {str(components)[:120]}")
        result = RewardResult(float(value["score"]), reason=str(value.get("reason", "scored")), components={k: float(v) for k, v in components.items()})
    else:
        return failure("invalid", f"returned {type(value).__name__} {str(value)[:80]!r}; expected a number, a dict with 'score', or a RewardResult")
    if not math.isfinite(result.score):
        return failure("invalid", f"score {result.score} is not finite")
    if score_range is not None and not score_range[0] <= result.score <= score_range[1]:
        return failure("invalid", f"score {result.score:g} is outside score_range [{score_range[0]:g}, {score_range[1]:g}]")
    return result


class Reward:
    """Scores a group's samples; ``name`` is how logs and errors call it."""

    def __init__(self, config: RewardConfig):
        self.config, self.name = config, config.label

    def score(self, samples: list[RewardInput]) -> list[RewardResult]:
        out = []
        for sample in samples:
            try:
                out.append(as_result(self.score_one(sample), self.config.score_range))
            except Exception as err:  # noqa: BLE001 - one sample's failure is that sample's
                out.append(failure("error", err))
        return out

    def score_one(self, sample: RewardInput) -> Any:
        raise NotImplementedError

    def close(self) -> None:
        pass


class BuiltinReward(Reward):
    """literal or math_verify: the comparison of rollout/rewards.py."""

    def __init__(self, config: RewardConfig, comparison):
        super().__init__(config)
        self.comparison = comparison

    def score_one(self, sample: RewardInput) -> RewardResult:
        return self.comparison(sample)

    def close(self) -> None:
        close = getattr(self.comparison, "close", None)
        if close is not None:
            close()


def load_function(path: str) -> Callable:
    """``package.module:name`` imported on this process's path; a clear error naming what is missing."""
    return load(path, "rollout.reward.function", callable, "callable")


class PythonFunctionReward(Reward):
    """One's own function: ``fn(sample, **kwargs)`` per sample, or ``fn(samples, **kwargs)`` per group
    (``batch``), which must return one result per sample."""

    def __init__(self, config: PythonRewardConfig):
        super().__init__(config)
        self.fn = load_function(config.function)

    def score_one(self, sample: RewardInput) -> Any:
        return self.fn(sample, **self.config.kwargs)

    def score(self, samples: list[RewardInput]) -> list[RewardResult]:
        if not self.config.batch:
            return super().score(samples)
        try:
            values = list(self.fn(list(samples), **self.config.kwargs))
            if len(values) != len(samples):
                return [failure("invalid", f"the batch call returned {len(values)} results for {len(samples)} samples")] * len(samples)
            return [as_result(v, self.config.score_range) for v in values]
        except Exception as err:  # noqa: BLE001
            return [failure("error", err)] * len(samples)


def sample_json(sample: RewardInput) -> dict:
    """A sample as the services receive it (docs/guides/own-task.md)."""
    return {**dataclasses.asdict(sample), "response_ids": list(sample.response_ids), "messages": list(sample.messages)}


def _jsonable(value: Any) -> Any:
    """What JSON has no type for in a dataset column (dates, decimals, bytes, numpy values): numbers
    stay numbers, arrays become lists, the rest its text."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if _number(value):
        return float(value)
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


class _Unreachable(Exception):
    """The service could not be reached or answered 5xx after every attempt."""


class _ServiceReward(Reward):
    """A reward behind HTTP: one request per sample from a pool of ``max_concurrency`` threads, each
    attempt bounded by ``timeout_s``, ``retries`` more attempts after a connection failure, a
    timeout or a 5xx (backing off 0.5 s, 1 s, 2 s ...)."""

    def __init__(self, config: HttpRewardConfig | JudgeRewardConfig):
        super().__init__(config)
        self.pool = ThreadPoolExecutor(config.max_concurrency, thread_name_prefix=f"drpo-{config.type}-reward")

    def score(self, samples: list[RewardInput]) -> list[RewardResult]:
        return list(self.pool.map(self._score_safely, samples))

    def _score_safely(self, sample: RewardInput) -> RewardResult:
        try:
            return as_result(self.score_one(sample), self.config.score_range)
        except _Unreachable as err:
            return failure("timeout" if isinstance(err.__cause__, TimeoutError) else "unreachable", str(err))
        except Exception as err:  # noqa: BLE001
            return failure("error", err)

    def post(self, url: str, body: dict, headers: dict | None = None) -> Any:
        data = json.dumps(body, default=_jsonable).encode()
        last: BaseException | None = None
        for attempt in range(self.config.retries + 1):
            if attempt:
                time.sleep(min(0.5 * 2 ** (attempt - 1), 8.0))
            request = urllib.request.Request(url, data, {"Content-Type": "application/json", **(headers or {})}, method="POST")
            try:
                with urllib.request.urlopen(request, timeout=self.config.timeout_s) as response:
                    return json.loads(response.read())
            except urllib.error.HTTPError as err:
                if err.code < 500:  # the request is wrong: another attempt would be too
                    raise RuntimeError(f"{url} answered HTTP {err.code}: {err.read()[:200].decode('utf-8', 'replace')}") from err
                last = err
            except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as err:
                last = err.reason if isinstance(err, urllib.error.URLError) and isinstance(err.reason, BaseException) else err
        attempts = self.config.retries + 1
        raise _Unreachable(f"{url}: {type(last).__name__}: {last} ({attempts} attempt{'s' if attempts > 1 else ''})") from (
            TimeoutError() if isinstance(last, TimeoutError) else last
        )

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


class HttpReward(_ServiceReward):
    """POST ``url`` one sample (``sample_json``); the answer is a number or {score, components?}."""

    def score_one(self, sample: RewardInput) -> Any:
        return self.post(self.config.url, sample_json(sample))


_YES_NO = re.compile(r"^\W*(yes|no)\b", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


class _Fields(dict):
    def __missing__(self, key: str) -> str:
        raise KeyError(f"prompt_template names {{{key}}}, which is neither prompt, response, ground_truth nor a column of the row")


class JudgeReward(_ServiceReward):
    """An LLM judge: ``prompt_template`` filled with the sample as the user message of a chat
    completion (temperature 0); the reply parsed as yes/no or a number."""

    def __init__(self, config: JudgeRewardConfig):
        super().__init__(config)
        self.url = config.base_url.rstrip("/") + "/chat/completions"
        key = os.environ.get(config.api_key_env) if config.api_key_env else None
        if config.api_key_env and not key:
            raise ValueError(f"rollout.reward.api_key_env={config.api_key_env!r} is not set in the rollout worker's environment")
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}

    def score_one(self, sample: RewardInput) -> RewardResult:
        fields = _Fields({**{str(k): v for k, v in sample.metadata.items()}, "prompt": sample.prompt, "response": sample.response,
                          "ground_truth": sample.ground_truth if sample.ground_truth is not None else ""})
        body = {"model": self.config.model, "messages": [{"role": "user", "content": self.config.prompt_template.format_map(fields)}],
                "max_tokens": self.config.max_tokens, "temperature": 0.0}
        answer = self.post(self.url, body, self.headers)
        try:
            reply = answer["choices"][0]["message"]["content"] or ""
        except (KeyError, IndexError, TypeError):
            return failure("invalid", f"the judge's answer has no choices[0].message.content: {str(answer)[:120]}")
        if self.config.parse == "yes_no":
            verdict = _YES_NO.match(reply)
            if verdict is None:
                return failure("invalid", f"the judge replied neither yes nor no: {reply[:120]!r}")
            yes = verdict.group(1).lower() == "yes"
            return RewardResult(1.0 if yes else 0.0, extracted=reply[:80], reason="correct" if yes else "wrong")
        number = _NUMBER.search(reply)
        if number is None:
            return failure("invalid", f"the judge's reply holds no number: {reply[:120]!r}")
        return RewardResult(float(number.group()), extracted=reply[:80])


def build_reward(config: RewardConfig, scoring: ScoringConfig) -> Reward:
    """The reward ``rollout.reward`` configures (the built-ins as ``rollout.scoring`` says)."""
    if isinstance(config, LiteralRewardConfig):
        return BuiltinReward(config, LiteralNumberReward(scoring.require_marker))
    if isinstance(config, MathVerifyRewardConfig):
        return BuiltinReward(config, MathVerifyReward(scoring.verify_timeout_s, scoring.require_marker))
    if isinstance(config, PythonRewardConfig):
        return PythonFunctionReward(config)
    if isinstance(config, HttpRewardConfig):
        return HttpReward(config)
    if isinstance(config, JudgeRewardConfig):
        return JudgeReward(config)
    raise TypeError(f"no reward is built from a {type(config).__name__}")
