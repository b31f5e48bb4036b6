"""Typed rollout config: the task, the engine and its sampling, scoring and fault injection.
Imports neither torch, Ray nor an engine; the run config (controller/config.py) composes it."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Field, field_validator, model_validator

from objectives.config import Section


class ArithmeticTask(Section):
    """The synthetic single-step word-problem task (rollout/tasks.py). A seeded quarter of the
    (a, op, b) facts never occurs in training; its eval sets: ``heldout`` (those facts, training
    wordings), ``wording`` (those facts, wordings never trained on), ``range`` (larger operands)."""

    type: Literal["arithmetic"] = "arithmetic"
    train_size: int = Field(2048, ge=1, description="Training prompts per epoch.")
    test_size: int = Field(128, ge=1, description="Prompts of the heldout eval set.")
    extra_eval_size: int = Field(64, ge=0, description="Prompts of each of the wording and range eval sets (0 = heldout only).")
    max_operand: int = Field(9, ge=2, description="Largest operand in training.")
    seed: int = Field(0, description="Seed of the problem generator (train and eval sets use disjoint streams).")

    def eval_set_names(self) -> list[str]:
        return ["heldout", "wording", "range"] if self.extra_eval_size else ["heldout"]


class WordProblemTask(Section):
    """Generated multi-step word problems (rollout/word_problems.py): reason, then answer after
    "The answer is". Training skips every problem whose text or chain is in the heldout set."""

    type: Literal["word_problems"] = "word_problems"
    level: int = Field(2, ge=1, le=5, description="Difficulty (steps, operations, number sizes; rollout/word_problems.py LEVELS).")
    train_size: int = Field(2048, ge=1, description="Training prompts per epoch.")
    test_size: int = Field(128, ge=1, description="Prompts of the heldout eval set.")
    eval_levels: list[Annotated[int, Field(ge=1, le=5)]] = Field(
        default_factory=list, description="Other levels evaluated too, as eval sets level-N (test_size prompts each)."
    )
    seed: int = Field(0, description="Seed of the problem generator.")

    @model_validator(mode="after")
    def _other_levels(self) -> "WordProblemTask":
        if self.level in self.eval_levels or len(set(self.eval_levels)) != len(self.eval_levels):
            raise ValueError(f"task.eval_levels {self.eval_levels} must be other levels than task.level={self.level}, each once")
        return self

    def eval_set_names(self) -> list[str]:
        return ["heldout"] + [f"level-{n}" for n in self.eval_levels]


DatasetFormat = Literal["auto", "dapo", "gsm8k", "math", "aime"]


class _Rows(Section):
    """Where a dataset row's prompt, answer and system message are (rollout/tasks.py load_dataset)."""

    prompt_field: str | None = Field(
        None, min_length=1, description="The column holding the prompt: text, or a list of chat messages {role: system|user|"
        "assistant, content} ending with a user turn. None: the first of prompt, problem, question.",
    )
    answer_field: str | None = Field(
        None, min_length=1, description="The column holding the ground truth. None: the format's (answer, solution, "
        "reward_model.ground_truth...). The built-in rewards skip rows without one; a reward of one's own gets None.",
    )
    system_prompt: str | None = Field(
        None, description="A system message for every prompt; a row's own 'system' column, or a system message in its chat "
        "prompt, takes its place. None: the chat template's default.",
    )


class DatasetTask(_Rows):
    """A dataset of one's own (jsonl, parquet, or a folder saved by datasets' save_to_disk): prompts as
    text or chat messages, every other column passed to the reward; the DAPO-Math, GSM8K, MATH and
    AIME row formats are read as they are (rollout/tasks.py). Bad rows skipped and reported."""

    type: Literal["dataset"] = "dataset"
    train_path: str = Field(description="Training rows (.jsonl, .parquet, or a save_to_disk folder).")
    test_path: str | None = Field(None, description="Rows of the heldout eval set; None: no task eval set.")
    format: DatasetFormat = Field(
        "auto", description="Row format: gsm8k (question, answer ending '#### N'), math (problem, solution with \\boxed{}), "
        "aime (problem, integer answer), dapo (prompt, reward_model.ground_truth); auto: detected per row.",
    )
    instruction: str | None = Field(
        None, description="Appended to every prompt; None: the format's default (gsm8k: think step by step, answer after "
        "'####'; math/aime: reason step by step, answer in \\boxed{}; dapo: none); '' for none.",
    )
    max_prompt_chars: int = Field(8192, ge=1, description="Rows whose prompt is longer (characters of all its messages, system and earlier turns included) are skipped.")

    def eval_set_names(self) -> list[str]:
        return ["heldout"] if self.test_path else []


TaskConfig = Annotated[Union[ArithmeticTask, WordProblemTask, DatasetTask], Field(discriminator="type")]


class EvalSetFile(_Rows):
    """One more eval set from a dataset file (the same row formats and fields as task.type=dataset)."""

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9_.-]*$", description="Its name in metrics (eval/<name>/...).")
    path: str = Field(description="Rows (.jsonl or .parquet).")
    format: DatasetFormat = Field("auto", description="Row format (see task.format).")
    instruction: str | None = Field(None, description="Appended to every prompt; None: the format's default.")
    limit: int | None = Field(None, ge=1, description="Use only the first this many usable rows.")

    @field_validator("name")
    @classmethod
    def _not_a_record_key(cls, value: str) -> str:
        if value in ("accuracy", "samples", "version", "prompts", "failed"):
            raise ValueError(f"{value!r} names a field of the eval record itself; choose another eval set name")
        return value


class ChaosConfig(Section):
    """Fault injection in rollout workers, for testing what the controller survives. Off by default."""

    nan_logp_rate: float = Field(0.0, ge=0.0, le=1.0, description="Probability a group's mu comes back NaN (bad engine output).")
    empty_response_rate: float = Field(0.0, ge=0.0, le=1.0, description="Probability a sample's response is cut to zero tokens.")
    reward_error_rate: float = Field(0.0, ge=0.0, le=1.0, description="Probability the reward function raises for a sample.")
    exit_on_receive: int | None = Field(
        None, ge=1, description="Worker 0 exits (its process dies) at its N-th broadcast receive, in its first life only: "
        "a worker dying during a publication.",
    )
    fail_on_receive: int | None = Field(
        None, ge=1, description="Worker 0 receives its N-th broadcast, then reports a failed load, in its first life only: "
        "a live engine that cannot take a publication.",
    )
    lose_group: int | None = Field(
        None, ge=1, description="Worker 0 never returns its N-th training group (a request that hangs): the run stalls.",
    )
    hang_generate: int | None = Field(
        None, ge=1, description="Worker 0's N-th engine call blocks forever, in its first life only: a hung engine "
        "(deadlines.engine_call_seconds kills and restarts the worker).",
    )
    kill_engine: int | None = Field(
        None, ge=1, description="Worker 0's engine dies at its N-th engine call, in its first life only (vLLM and SGLang: "
        "their engine processes are killed; hf: the engine raises EngineDied): the worker is restarted with the engine's error.",
    )
    hang_weight_load: int | None = Field(
        None, ge=1, description="Worker 0's N-th object-store weight load blocks forever, in its first life only: a hung "
        "engine during a publication (deadlines.weight_load_seconds kills and restarts the worker).",
    )
    seed: int = Field(0, description="Seed of the injected faults.")


class ScoringConfig(Section):
    """How a response is scored beyond the reward function (rollout/answers.py, rollout/rewards.py)."""

    require_marker: bool = Field(
        False, description="Only an answer after a final-answer marker (####, 'The answer is', \\boxed{}) counts: no last-number fallback.",
    )
    verify_timeout_s: float = Field(5.0, gt=0.0, le=600.0, description="math_verify: seconds per comparison; past it the sample scores 0 (reason timeout).")
    overlong_penalty: float = Field(
        0.0, ge=0.0, le=10.0, description="Over-long shaping: subtracted from the trained reward of a response cut at max_new_tokens "
        "(it never reached an answer's end); correctness and accuracy are unchanged. 0 = off.",
    )
    overlong_buffer: int = Field(
        0, ge=0, description="DAPO's soft over-long punishment: the penalty ramps up linearly over the last this many tokens "
        "before max_new_tokens (0: truncated responses only, in full).",
    )


class _RewardBase(Section):
    """What every reward does with a sample it cannot score (rollout/reward_functions.py)."""

    on_error: Literal["zero", "drop_group"] = Field(
        "zero", description="A sample the reward cannot score (it raised, timed out, gave a non-finite or out-of-range score, "
        "or its service was unreachable): zero scores it 0 and trains on the rest of its group; drop_group fails the whole "
        "group (not trained on, counted like any failed group). Either way a group whose every sample failed fails, so a "
        "broken reward stops the run after train.max_failures_in_a_row groups, naming its first error.",
    )
    score_range: tuple[float, float] | None = Field(
        None, description="[low, high]: a score outside it is a failed sample (reason invalid); None: any finite score.",
    )

    @property
    def label(self) -> str:
        """How messages name this reward."""
        return self.type

    @model_validator(mode="after")
    def _ordered(self) -> "_RewardBase":
        if self.score_range is not None and not self.score_range[0] <= self.score_range[1]:
            raise ValueError(f"score_range {list(self.score_range)} must be [low, high] with low <= high")
        return self


class LiteralRewardConfig(_RewardBase):
    """The answer must be a literal number equal to the ground truth."""

    type: Literal["literal"] = "literal"


class MathVerifyRewardConfig(_RewardBase):
    """math-verify equivalence (closed forms like \\frac{1}{2} or 2\\sqrt{2} count; computations such as 7*27 are refused)."""

    type: Literal["math_verify"] = "math_verify"


class PythonRewardConfig(_RewardBase):
    """A reward function of one's own, by import path, called in the rollout worker's process."""

    type: Literal["python"] = "python"
    function: str = Field(
        pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$", description="'package.module:name' on the rollout workers' Python path: "
        "a callable taking a RewardInput (or a list of them with batch: true) and the kwargs, returning a float, a dict "
        "{score, components} or a RewardResult (rollout/rewards.py).",
    )
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments every call gets.")
    batch: bool = Field(False, description="Call it once per group with the group's samples (a list), returning one score each.")

    @property
    def label(self) -> str:
        return self.function


class HttpRewardConfig(_RewardBase):
    """A reward service: each sample is POSTed as JSON to ``url``, which answers with its score (the
    schema is in the docs, docs/guides/own-task.md)."""

    type: Literal["http"] = "http"
    url: str = Field(pattern=r"^https?://", description="The service's scoring endpoint.")
    timeout_s: float = Field(30.0, gt=0.0, le=3600.0, description="Seconds per request; past it the attempt fails.")
    retries: int = Field(2, ge=0, le=10, description="More attempts after a failed one (connection refused, timeout, HTTP 5xx).")
    max_concurrency: int = Field(8, ge=1, le=256, description="Requests in flight at once from one rollout worker.")

    @property
    def label(self) -> str:
        return self.url


class JudgeRewardConfig(_RewardBase):
    """An LLM judge behind an OpenAI-compatible chat-completions endpoint (vLLM's ``vllm serve``,
    SGLang's server, a hosted API): the template filled with the sample is the judge's user message,
    and its reply is parsed into a score."""

    type: Literal["judge"] = "judge"
    base_url: str = Field(pattern=r"^https?://", description="The server's OpenAI API root, e.g. http://127.0.0.1:8000/v1.")
    model: str = Field(min_length=1, description="The model name the server serves.")
    prompt_template: str = Field(
        "Question: {prompt}\nReference answer: {ground_truth}\nResponse: {response}\n"
        "Is the response's final answer correct? Reply with YES or NO.",
        description="The judge's user message; {prompt}, {response}, {ground_truth} and any dataset column by name are filled in.",
    )
    parse: Literal["yes_no", "number"] = Field(
        "yes_no", description="yes_no: 1.0 when the reply's first word is yes, 0.0 when no; number: the first number in the "
        "reply (a reply without one is a failed sample, reason invalid).",
    )
    api_key_env: str | None = Field(None, description="Environment variable holding the API key sent as a bearer token; None: none.")
    max_tokens: int = Field(16, ge=1, description="The judge's reply length limit.")
    timeout_s: float = Field(60.0, gt=0.0, le=3600.0, description="Seconds per request; past it the attempt fails.")
    retries: int = Field(2, ge=0, le=10, description="More attempts after a failed one.")
    max_concurrency: int = Field(8, ge=1, le=256, description="Requests in flight at once from one rollout worker.")

    @property
    def label(self) -> str:
        return f"judge {self.model} at {self.base_url}"


RewardConfig = Annotated[Union[LiteralRewardConfig, MathVerifyRewardConfig, PythonRewardConfig, HttpRewardConfig, JudgeRewardConfig], Field(discriminator="type")]
REWARD_TYPES = ("literal", "math_verify", "python", "http", "judge")


class EnvironmentConfig(Section):
    """Multi-turn episodes (rollout/environment.py): the model's turns alternate with an environment's,
    whose inserted tokens are context only (no mu, no gradient, no gap metric)."""

    path: str = Field(
        pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$", description="'package.module:Class' on the rollout workers' Python path: an "
        "Environment subclass (reset(problem) -> messages, step(response) -> StepResult), one instance per episode; "
        "rollout.tools:ToolEnvironment runs tool calls (kwargs: tools, a list of 'module:function').",
    )
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of the class.")
    max_turns: int = Field(4, ge=1, le=64, description="Model turns per episode; an episode still going after them is truncated (max_turns).")
    max_episode_tokens: int = Field(
        512, ge=1, description="Tokens after the prompt per episode, the model's and the environment's; a model turn gets at "
        "most what is left (and rollout.max_new_tokens); an episode that runs out is truncated (tokens).",
    )
    step_timeout_s: float = Field(30.0, gt=0.0, le=3600.0, description="Seconds one environment step may take; past it the episode fails (timeout).")

    @property
    def label(self) -> str:
        return self.path


ENGINE_PACKAGES = {"vllm": "vllm", "sglang": "sglang"}
"""The package each engine other than hf needs installed where its workers run."""


class RolloutConfig(Section):
    """Rollout workers: one engine each."""

    engine: Literal["hf", "vllm", "sglang"] = Field("hf", description="Inference backend.")
    precision: Literal["auto", "fp32", "bf16", "fp8"] = Field(
        "fp32", description="Engine weight precision (fp8 on CPU is fake-quantized); auto: bf16 with GPUs or on a CPU with bf16 "
        "arithmetic, else fp32 (controller/hardware.py; resolved when the config loads).",
    )
    fp8_block: int = Field(
        128, ge=16, le=1024, description="sglang fp8 rollout: weights are block-wise fp8 with one scale per fp8_block x fp8_block "
        "tile (DeepSeek-V3's format; 128 there), a power of two; every fused projection part must be a multiple (SmolLM2-135M needs 64).",
    )

    @field_validator("fp8_block")
    @classmethod
    def _power_of_two(cls, v: int) -> int:
        if v & (v - 1):
            raise ValueError("must be a power of two (SGLang's fp8 kernels tile by it)")
        return v
    workers: int = Field(1, ge=1, description="Number of rollout workers.")
    cpus_per_worker: float = Field(1.0, ge=0.0, description="Ray CPUs per worker.")
    gpus_per_worker: float = Field(0.0, ge=0.0, description="Ray GPUs per worker.")
    threads: int = Field(1, ge=1, description="torch threads per worker (CPU engines).")
    samples_per_prompt: int = Field(8, ge=1, description="n: samples per prompt (a group).")
    max_new_tokens: int = Field(16, ge=1, description="Response length limit.")
    max_prompt_tokens: int = Field(512, ge=1, description="Longer prompts fail their group (recorded, not trained on).")
    temperature: float = Field(1.0, gt=0.0, description="Sampling temperature (the learner takes log-probs at the same one).")
    max_batch_prompts: int = Field(
        8, ge=1, description="Queued training prompts a worker generates together in one engine call (an evaluation call fills rollout.max_eval_rows rows)."
    )
    max_eval_rows: int | None = Field(
        None, ge=1, description="Rows (prompts x samples) of one evaluation engine call; None: a training call's rows "
        "(max_batch_prompts x samples_per_prompt). Larger calls amortize each decoding step over more prompts.",
    )
    reward: RewardConfig = Field(
        default_factory=LiteralRewardConfig, description="The reward, by type: literal (the answer must be a number equal to the "
        "ground truth), math_verify (math-verify equivalence), python (a function of one's own by import path), http (a "
        "reward service), judge (an LLM judge on an OpenAI-compatible server). A bare name ('literal', 'math_verify') "
        "is that built-in.",
    )

    @field_validator("reward", mode="before")
    @classmethod
    def _bare_name(cls, value):
        if isinstance(value, str):
            if value not in REWARD_TYPES:
                raise ValueError(f"unknown reward {value!r}; expected one of {', '.join(REWARD_TYPES)} (python, http and judge need more keys)")
            return {"type": value}
        return value

    environment: EnvironmentConfig | None = Field(
        None, description="Multi-turn episodes with an environment or tools (each model turn generated from the episode's "
        "token prefix, the environment's messages appended as context-only tokens); None: one response per prompt. A bare "
        "'module:Class' is {path: 'module:Class'}.",
    )
    scoring: ScoringConfig = Field(default_factory=ScoringConfig, description="Answer marker, verifier time bound, over-long shaping.")
    chaos: ChaosConfig | None = Field(None, description="Fault injection (tests); None = off.")
    max_restarts: int = Field(3, ge=0, description="Times Ray restarts a dead worker (it then loads the current weights before serving).")
    kv_cache_gib: float | None = Field(
        None, gt=0.0, description="vllm: KV cache per engine in GiB. None: 1 GiB on CPU (vLLM's CPU default would reserve most "
        "of the machine per worker); on GPU vLLM's gpu_memory_utilization decides.",
    )
    engine_kwargs: dict[str, int | float | str | bool] = Field(default_factory=dict, description="Extra engine arguments (e.g. vLLM's max_model_len).")
    node_resource: str | None = Field(
        None, min_length=1, description="Ray custom resource a node must declare to host rollout workers (each worker's bundle "
        "requests ROLE_RESOURCE_SHARE of it), e.g. rollout_node as deploy/kuberay/rayjob.yaml declares; None = any node.",
    )

    @field_validator("environment", mode="before")
    @classmethod
    def _bare_path(cls, value):
        return {"path": value} if isinstance(value, str) else value

    @model_validator(mode="after")
    def _buffer_fits(self) -> "RolloutConfig":
        if self.scoring.overlong_buffer >= self.max_new_tokens:
            raise ValueError(
                f"rollout.scoring.overlong_buffer={self.scoring.overlong_buffer} must be below rollout.max_new_tokens={self.max_new_tokens}"
            )
        return self
