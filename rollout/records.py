"""The records a sample travels in, from the engine that drew it to the component that batches it.

    engine ──Completion──▶ RolloutWorker ──scores──▶ Sample ─┐
                                                             ├─▶ Group ──backend──▶ Controller ──▶ TrainBatch
    controller ──Ticket──▶ (submission, echoed back) ───────┘

A ``Group`` is one submission's result: the ticket the controller submitted it under, the worker
and version that served it, and one ``Sample`` per sampled response (the engine's ``Completion``
with its text and ``RewardResult``). Rewards have exactly this one representation; group-level
views (``scores``, ``oldest_version``, ``tokens``) are computed from it. The RolloutWorker and the
simulated backend produce the same records, so the controller's batch builder runs on both.
Immutable: nothing downstream edits a record; a failed group carries no samples and its reason.
Samples and groups compare by identity (their tensors have no single truth value).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from rollout.engine import Completion
from rollout.rewards import RewardResult


@dataclass(frozen=True)
class TrainTicket:
    """One draw of a training prompt; ``epoch`` tells draws of the same prompt apart (the ledger's key)."""

    epoch: int
    id: str
    """The problem id."""


@dataclass(frozen=True)
class EvalTicket:
    """One prompt of eval set ``set`` in evaluation round ``round``, sampled or decoded greedily."""

    round: int
    id: str
    """The problem id (unique within its set)."""
    set: str = "heldout"
    greedy: bool = False
    """One greedy response (most likely token at every step) instead of eval.samples_per_prompt sampled ones."""


Ticket = Union[TrainTicket, EvalTicket]


@dataclass(frozen=True)
class Started:
    """A worker began generating the submission ``ticket`` while serving weights of ``version``."""

    ticket: Ticket
    worker: int
    version: int


@dataclass(frozen=True, eq=False)
class Sample:
    """One sampled response and its verdict."""

    completion: Completion
    """The engine's output: prompt and response ids, per-token mu and versions, finish reason, top-K."""
    text: str
    """The response decoded (special tokens skipped), as the reward function saw it."""
    reward: RewardResult


@dataclass(frozen=True, eq=False)
class Group:
    """The n samples of one submission (or why there are none)."""

    ticket: Ticket
    worker: int
    """Index of the rollout worker that produced it."""
    samples: tuple[Sample, ...]
    started_version: int
    """The policy version the worker served when it began the group: a lower bound on its tokens'
    (a publication staged just before may serve from the first token on)."""
    seconds: float
    """Generation and scoring time, the share of one engine call that fell to this group."""
    error: str | None = None
    """Why the group failed (bad prompt, engine or reward failure, bad engine output); None if it did not."""
    scoring_seconds: float = 0.0
    """Of ``seconds``, the time the reward took."""
    reward_failures: tuple[RewardResult, ...] = ()
    """A group failed by its reward: the failed samples' results (their reasons are counted)."""
    call: tuple[int, int, int] | None = None
    """The inbox batch (one engine call for single-turn prompts) that generated it: (worker, process
    id, the worker's batch number); an evaluation counts its distinct calls by it."""

    def __post_init__(self) -> None:
        if self.error is None and not self.samples:
            raise ValueError(f"group {self.ticket} has neither samples nor an error")

    @property
    def reward_errors(self) -> tuple[RewardResult, ...]:
        """Every sample the reward could not score: those scored 0 in its samples, or those that failed the group."""
        return self.reward_failures or tuple(s.reward for s in self.samples if s.reward.failed)

    @property
    def scores(self) -> tuple[float, ...]:
        """The reward's score per sample (the built-ins: correctness, 1.0 or 0.0): accuracy and evaluation."""
        return tuple(s.reward.score for s in self.samples)

    @property
    def rewards(self) -> tuple[float, ...]:
        """The reward trained on per sample: correctness plus shaping (advantages)."""
        return tuple(s.reward.value for s in self.samples)

    @property
    def tokens(self) -> int:
        """Response tokens over all samples."""
        return sum(len(s.completion.response_ids) for s in self.samples)

    @property
    def oldest_version(self) -> int | None:
        """Version of the oldest weights that sampled any of its tokens (None without tokens)."""
        versions = [int(s.completion.versions.min()) for s in self.samples if len(s.completion.versions)]
        return min(versions, default=None)
