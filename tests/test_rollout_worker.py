"""A RolloutWorker on a local Ray cluster produces Group records with the real model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from learner.weights import wire
from rollout.config import RolloutConfig
from rollout.records import EvalTicket, TrainTicket
from rollout.tasks import Problem, arithmetic_split

pytestmark = [pytest.mark.ray, pytest.mark.engine]


def poll_groups(ray, worker, count: int, timeout_s: float) -> list:
    """The worker's finished groups through ``poll``, as the controller takes them, until ``count`` came."""
    import time

    groups, deadline = [], time.monotonic() + timeout_s
    while len(groups) < count and time.monotonic() < deadline:
        groups += ray.get(worker.poll.remote(timeout_s=1.0))[0]
    return groups


def test_rollout_worker_scores_groups_and_takes_weight_updates(ray_local, smollm2_folder):
    from learner import actor_pool
    from rollout.worker import RolloutWorker

    actor_pool.drain()  # this actor asks for a CPU: worker processes kept for the module's next runs hold them
    ray = ray_local
    config = RolloutConfig(samples_per_prompt=3, max_new_tokens=12, temperature=1.0, max_batch_prompts=1)
    worker = ray.remote(RolloutWorker).options(num_cpus=1).remote(config, model_folder=str(smollm2_folder), worker_id=7, seed=0, topk_logprobs=4)
    problems = arithmetic_split("test", 2) + [Problem("empty", "", "0")]
    tickets = [TrainTicket(0, p.id) for p in problems]
    ray.get(worker.submit.remote([(t, p, None) for t, p in zip(tickets, problems)]))
    groups = poll_groups(ray, worker, 3, timeout_s=240)
    assert [g.ticket for g in groups] == tickets and all(g.worker == 7 and g.started_version == 0 for g in groups)
    for g in groups[:2]:
        assert g.error is None and len(g.samples) == 3 and all(s.text for s in g.samples)
        assert all(s.reward.score in (0.0, 1.0) for s in g.samples) and g.scores == tuple(s.reward.score for s in g.samples)
        assert all(s.reward.reason in ("correct", "wrong", "no_answer", "not_literal") for s in g.samples)
        for c in (s.completion for s in g.samples):
            assert (c.versions == 0).all() and len(c.rollout_logp) == len(c.response_ids)
            assert c.topk_ids.shape == (len(c.response_ids), 4)  # training groups carry the engine's top-K
        assert g.oldest_version == 0 and g.tokens == sum(len(s.completion.response_ids) for s in g.samples)
    beat = ray.get(worker.heartbeat.remote())
    assert beat["alive"] and beat["groups"] == 3 and beat["tokens"] > 0 and beat["queue_depth"] == 0
    # a bad request comes back as a group with its reason, and the worker lives on
    assert groups[2].error == "empty prompt" and groups[2].samples == () and beat["failures"] == 1
    state = {"model.norm.weight": torch.ones(576) * 1.01}
    refs = [ray.put(b) for b in wire.buckets(state.items(), version=4)]
    assert ray.get(worker.update_weights.remote(refs)) == 4
    ray.get(worker.submit.remote([(EvalTicket(0, problems[0].id), problems[0], None)]))
    (group,) = poll_groups(ray, worker, 1, timeout_s=120)
    assert group.ticket == EvalTicket(0, problems[0].id) and group.started_version <= group.oldest_version == 4
    assert all((s.completion.versions == 4).all() and s.completion.topk_ids is None for s in group.samples)  # eval: no top-K
    assert ray.get(worker.heartbeat.remote())["version"] == 4


def test_inbox_serves_training_before_evaluation_and_fills_engine_rows():
    """A worker's queue: training prompts first (an evaluation never delays the learner's next
    batch) but never more than 2 calls ahead of a waiting evaluation, each kind in submission
    order; evaluation (1 sample each) takes as many prompts as the rows training uses, or its own
    row count (rollout.max_eval_rows)."""
    from rollout.scheduler import Inbox

    inbox = Inbox()
    evals = [(EvalTicket(0, f"e{i}"), Problem(f"e{i}", "q", "1"), 1) for i in range(20)]
    trains = [(TrainTicket(0, f"t{i}"), Problem(f"t{i}", "q", "1"), 8) for i in range(3)]
    inbox.put(evals[:10] + trains + evals[10:])

    rows = 2 * 8  # max_batch_prompts=2 prompts of 8 samples: 16 rows
    assert [t.id for t, _, _ in inbox.take(rows)] == ["t0", "t1"]
    assert [t.id for t, _, _ in inbox.take(rows)] == ["t2"]
    assert [t.id for t, _, _ in inbox.take(rows)] == [f"e{i}" for i in range(16)]
    assert inbox.qsize() == 4 and [t.id for t, _, _ in inbox.drain()] == ["e16", "e17", "e18", "e19"]
    # evaluation rows of their own: training calls keep theirs, an evaluation call takes more prompts
    inbox.put(trains + evals)
    assert [t.id for t, _, _ in inbox.take(rows, eval_rows=12)] == ["t0", "t1"]
    assert [t.id for t, _, _ in inbox.take(rows, eval_rows=12)] == ["t2"]
    assert [t.id for t, _, _ in inbox.take(rows, eval_rows=12)] == [f"e{i}" for i in range(12)]
    assert [t.id for t, _, _ in inbox.take(rows, eval_rows=12)] == [f"e{i}" for i in range(12, 20)]
    # with training always queued (rollout the slower stage), evaluation still gets its turn
    inbox.put([(TrainTicket(1, f"u{i}"), Problem(f"u{i}", "q", "1"), 8) for i in range(5)])
    inbox.put([evals[0]])
    kinds = [type(inbox.take(1)[0][0]).__name__ for _ in range(4)]
    assert kinds == ["TrainTicket", "TrainTicket", "EvalTicket", "TrainTicket"]
    inbox.close()
    assert inbox.take(rows) is None


def test_an_engines_private_folders_of_dead_processes_are_swept_by_the_next_one(tmp_path):
    import subprocess
    import sys

    from rollout.engine import private_folder

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f"drpo-vllm-weights-{dead.pid}-abcd"  # left by a worker killed before it closed its engine
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"x" * 1024)
    live = tmp_path / f"drpo-vllm-weights-{os.getpid()}-efgh"  # another engine of a live process
    live.mkdir()
    other = tmp_path / "drpo-vllm-weights-notapid"
    other.mkdir()
    made = Path(private_folder("drpo-vllm-weights-", str(tmp_path)))
    assert made.is_dir() and made.name.startswith(f"drpo-vllm-weights-{os.getpid()}-")
    assert not stale.exists() and live.is_dir() and other.is_dir()


def test_closing_an_engine_sweeps_the_folders_of_a_worker_that_died_after_it_started(tmp_path):
    """A killed worker's replacement can start while the dead process is still being torn down (a
    zombie not yet reaped, as a loaded CI machine showed): the folders it left go when an engine
    closes, and a zombie's count as gone."""
    import subprocess
    import sys
    import time

    from rollout.engine import private_folder, remove_private_folder

    import psutil

    mine = private_folder("drpo-vllm-weights-", str(tmp_path))
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])  # exits, and is not reaped until the end
    deadline = time.monotonic() + 30
    while psutil.Process(zombie.pid).status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
        time.sleep(0.05)
    left = tmp_path / f"drpo-vllm-weights-{zombie.pid}-ijkl"
    left.mkdir()
    live = tmp_path / f"drpo-vllm-weights-{os.getpid()}-mnop"
    live.mkdir()
    assert psutil.pid_exists(zombie.pid)  # what the sweep used to ask, and why the folder stayed
    remove_private_folder(mine, "drpo-vllm-weights-")
    zombie.wait()
    assert not Path(mine).exists() and not left.exists() and live.is_dir()


GATED_REWARD = '''
import threading

GATE = threading.Event()
SCORING = threading.Event()


def gated(sample):
    SCORING.set()
    if not GATE.wait(120):
        raise TimeoutError("the test never opened the gate")
    return 1.0
'''


def test_the_next_engine_call_generates_while_a_slow_reward_scores(tmp_path, monkeypatch, tiny_chat_model):
    """Scoring runs on its own thread: while the first call's groups sit in a reward that blocks,
    the worker has already started (and finished) generating the second call's prompts."""
    import sys
    import time

    from rollout.config import PythonRewardConfig
    from rollout.worker import RolloutWorker

    (tmp_path / "gated_reward.py").write_text(GATED_REWARD)
    monkeypatch.syspath_prepend(str(tmp_path))
    import gated_reward

    config = RolloutConfig(samples_per_prompt=2, max_new_tokens=4, max_batch_prompts=1, reward=PythonRewardConfig(function="gated_reward:gated"))
    worker = RolloutWorker.build(config, model_folder=str(tiny_chat_model), seed=0)
    try:
        problems = arithmetic_split("test", 3)
        worker.submit([(TrainTicket(0, p.id), p, None) for p in problems])
        started, deadline = [], time.monotonic() + 120
        while len(started) < 3 and time.monotonic() < deadline:
            groups, new = worker.poll(timeout_s=1.0)
            assert groups == []  # nothing is scored while the gate is shut
            started += new
        assert gated_reward.SCORING.is_set() and [s.ticket.id for s in started] == [p.id for p in problems]
        # the second call was generated and waits for the scorer; the third is in the engine
        assert worker._to_score.full() and worker.heartbeat()["queue_depth"] == 0
        gated_reward.GATE.set()
        groups = []
        while len(groups) < 3 and time.monotonic() < deadline:
            groups += worker.poll(timeout_s=1.0)[0]
        assert [g.ticket.id for g in groups] == [p.id for p in problems]
        assert all(g.error is None and [s.reward.score for s in g.samples] == [1.0, 1.0] for g in groups)
    finally:
        gated_reward.GATE.set()
        worker.shutdown(timeout_s=30)
        sys.modules.pop("gated_reward", None)
