"""The Controller over the simulated backend: staleness invariant, wait/drop policies, resume."""

from __future__ import annotations

import dataclasses
import json
import random
import shutil

import pytest

from controller.app import train
from controller.config import RunConfig
from controller.ledger import PromptSampler
from controller.checkpoints import latest_checkpoint
from controller.loop import Controller
from controller.simulation import SimulatedBackend
from controller.staleness import StalenessViolation
from controller.telemetry import Telemetry
from objectives.config import DPPOTopKTVConfig
from rollout.records import TrainTicket
from rollout.tasks import arithmetic_split


def sim_config(tmp_path, **train) -> RunConfig:
    sim = train.pop("sim", {})
    workers = train.pop("workers", 4)
    checkpoint_every = train.pop("checkpoint_every", 0)
    return RunConfig.model_validate({
        "run_dir": str(tmp_path / "run"), "seed": train.pop("seed", 0),
        "task": {"type": "arithmetic", "train_size": train.pop("train_size", 500), "test_size": 10},
        "rollout": {"workers": workers, "samples_per_prompt": 4},
        "train": {"steps": 20, "prompts_per_step": 8, "mode": "async", "max_staleness": 2, **train},
        "eval": {"every": 0, "at_start": False}, "checkpoint": {"every": checkpoint_every, "keep": 10},
        "metrics": {"port": None, "progress": False},
        "simulation": {"gen_seconds": 1.0, "gen_cv": 1.0, "train_seconds": 1.0, **sim},
    })


def trained_lags(run_dir) -> list[int]:
    state = json.loads((latest_checkpoint(run_dir) / "controller.json").read_text())
    return [e["lag"] for e in state["ledger"] if e["outcome"] == "trained"]


@pytest.mark.parametrize("trial", range(12))
def test_no_trained_sample_is_older_than_the_bound_under_random_durations(tmp_path, trial):
    rng = random.Random(trial)
    eta = rng.choice([0, 1, 2, 4])
    cfg = sim_config(
        tmp_path, seed=trial, workers=rng.choice([1, 3, 8, 64]), max_staleness=eta, mode="sync" if eta == 0 else "async",
        over_bound=rng.choice(["wait", "drop"]), steps=rng.randint(10, 30),
        sim={"gen_cv": rng.uniform(0, 3), "train_seconds": rng.uniform(0.1, 5), "train_cv": rng.uniform(0, 1),
             "publish_seconds": rng.choice([0.0, 0.5, 3.0]), "accuracy": rng.uniform(0.05, 0.95), "seed": trial},
    )
    result = train(cfg)
    lags = trained_lags(cfg.run_dir)
    assert result.steps == cfg.train.steps
    assert len(lags) == cfg.train.steps * cfg.train.prompts_per_step
    assert max(lags) <= eta and min(lags) >= 0
    if eta > 0 and cfg.rollout.workers > 1:
        assert max(lags) >= 1  # async really ran ahead


def test_wait_policy_never_drops_and_drop_policy_drops_only_over_bound_samples(tmp_path):
    heavy_tail = {"gen_cv": 4.0, "train_seconds": 0.2, "seed": 3}
    waited = train(sim_config(tmp_path / "w", workers=16, max_staleness=1, over_bound="wait", steps=40, sim=heavy_tail))
    dropped = train(sim_config(tmp_path / "d", workers=16, max_staleness=1, over_bound="drop", steps=40, sim=heavy_tail))
    assert "stale" not in waited.ledger_counts
    assert dropped.ledger_counts.get("stale", 0) > 0
    state = json.loads((latest_checkpoint(tmp_path / "d" / "run") / "controller.json").read_text())
    for e in state["ledger"]:
        if e["outcome"] == "stale":
            sampled, learner = [int(w) for w in e["reason"].replace(",", "").split() if w.isdigit()]
            assert learner - sampled > 1  # dropped only beyond eta = 1
    assert max(trained_lags(tmp_path / "d" / "run")) <= 1


def test_a_sample_over_the_bound_that_reaches_the_learner_raises(tmp_path):
    cfg = sim_config(tmp_path, max_staleness=1)
    ctl = Controller.build(cfg, backend=SimulatedBackend.build(cfg.simulation, workers=1), train=arithmetic_split("train", 50), evals={},
                           telemetry=Telemetry(tmp_path, cfg.metrics, 1, lambda: 0.0))
    ctl.version = 5
    backend = ctl.backend
    backend._serving[0] = 2  # the worker still serves version 2
    problem = next(iter(ctl.problems.values()))
    backend.submit(0, [(TrainTicket(0, problem.id), problem, 4)])
    groups = []
    while not groups:
        groups = backend.wait().groups
    (group,) = groups
    batch = ctl.builder.batch([group], ctl.version)
    assert batch.lags == (3,) and int(batch.train.version_lag[batch.train.response_mask].max()) == 3
    with pytest.raises(StalenessViolation, match="3 versions old"):
        ctl.staleness.check(batch.lags[0])


def _controller(cfg, tmp_path):
    backend = SimulatedBackend.build(cfg.simulation, workers=cfg.rollout.workers)
    train_set = arithmetic_split("train", cfg.task.train_size)
    return Controller.build(cfg, backend=backend, train=train_set, evals={}, telemetry=Telemetry(tmp_path / "t", cfg.metrics, cfg.train.steps, backend.now))


def test_resume_admits_no_burst(tmp_path):
    cfg = sim_config(tmp_path, workers=8, max_staleness=2, steps=9, checkpoint_every=3)
    train(cfg)
    ctl = _controller(cfg, tmp_path)
    ctl.restore(tmp_path / "run" / "checkpoints" / "step-000006")
    stats = ctl.staleness.stats()
    assert stats.running == 0 and stats.accepted == 6 * cfg.train.prompts_per_step
    ctl.admit()
    # exactly what a run at this step boundary with nothing in flight may start: (eta + 1) * B
    assert len(ctl.in_flight) == (cfg.train.max_staleness + 1) * cfg.train.prompts_per_step


def test_resume_after_a_crash_neither_reconsumes_nor_skips_prompts(tmp_path):
    # a small training set so the run crosses epochs, where a prompt legitimately recurs
    cfg = sim_config(tmp_path, workers=6, max_staleness=2, steps=10, checkpoint_every=4, train_size=60)
    train(cfg)
    checkpoints = tmp_path / "run" / "checkpoints"
    before = json.loads((checkpoints / "step-000008" / "controller.json").read_text())
    shutil.rmtree(checkpoints / "step-000010")  # the driver died between step 8 and the end
    resumed = cfg.model_copy(update={"train": cfg.train.model_copy(update={"steps": 20})})
    train(resumed, resume=True)
    after = json.loads((latest_checkpoint(tmp_path / "run") / "controller.json").read_text())
    assert after["ledger"][: len(before["ledger"])] == before["ledger"]  # history kept as checkpointed
    keys = [(e["epoch"], e["id"]) for e in after["ledger"]]
    assert len(keys) == len(set(keys))  # no (epoch, prompt) has two outcomes
    trained = [e for e in after["ledger"] if e["outcome"] == "trained"]
    assert len(trained) == 20 * cfg.train.prompts_per_step
    # nothing skipped: every prompt drawn so far has an outcome or is waiting to be drawn again
    sampler = PromptSampler([p.id for p in arithmetic_split("train", 60)], cfg.seed)
    sampler.load_state_dict(after["sampler"])
    pending = {(t["epoch"], t["id"]) for t in after["sampler"]["requeued"]}
    for epoch in range(after["sampler"]["epoch"] + 1):
        drawn = {(epoch, i) for i in sampler.issued(epoch)}
        assert drawn == {k for k in keys if k[0] == epoch} | {k for k in pending if k[0] == epoch}
    assert not pending & set(keys)


def test_failed_groups_are_recorded_and_replaced(tmp_path):
    cfg = sim_config(tmp_path, workers=4, steps=10, sim={"failure_rate": 0.3})
    result = train(cfg)
    assert result.ledger_counts["failed"] > 0
    assert result.ledger_counts["trained"] == 10 * cfg.train.prompts_per_step


def test_a_run_whose_rollouts_always_fail_stops_with_the_reason(tmp_path):
    from controller.loop import RolloutsFailing

    cfg = sim_config(tmp_path, workers=4, steps=10, sim={"failure_rate": 1.0})
    with pytest.raises(RolloutsFailing, match=r"every rollout failed: 32 groups in a row .* The first failed with: simulated engine failure"):
        train(cfg)
    errors = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if '"worker_error"' in line]
    assert sorted(e["worker"] for e in errors) == [0, 1, 2, 3] and all(e["error"] == "simulated engine failure" for e in errors)


@pytest.mark.parametrize("seed", range(4))
def test_worker_crashes_lose_no_prompt_and_count_none_twice(tmp_path, seed):
    cfg = sim_config(
        tmp_path, seed=seed, workers=8, steps=25, max_staleness=2, checkpoint_every=5, train_size=120,
        sim={"crash_rate": 0.05, "restart_seconds": 3.0, "publish_seconds": 0.5, "seed": seed},
    )
    backend = SimulatedBackend.build(cfg.simulation, workers=cfg.rollout.workers)
    result = train(cfg, backend=backend)
    assert backend.crashes > 0
    state = json.loads((latest_checkpoint(cfg.run_dir) / "controller.json").read_text())
    keys = [(e["epoch"], e["id"]) for e in state["ledger"]]
    assert len(keys) == len(set(keys))
    assert result.ledger_counts["trained"] == 25 * cfg.train.prompts_per_step
    assert max(trained_lags(cfg.run_dir)) <= 2
    sampler = PromptSampler([p.id for p in arithmetic_split("train", 120)], cfg.seed)
    sampler.load_state_dict(state["sampler"])
    pending = {(t["epoch"], t["id"]) for t in state["sampler"]["requeued"]}
    for epoch in range(state["sampler"]["epoch"] + 1):
        assert {(epoch, i) for i in sampler.issued(epoch)} == {k for k in keys + list(pending) if k[0] == epoch}


def test_a_task_without_signal_stops_with_the_reason(tmp_path):
    cfg = sim_config(tmp_path, workers=4, steps=10, max_filtered_in_a_row=300, sim={"accuracy": 0.0})
    with pytest.raises(RuntimeError, match=r"300 groups in a row were filtered \(last: all rewards 0\)"):
        train(cfg)


def test_simulated_runs_build_their_batches_with_the_controllers_batch_builder(tmp_path):
    """The simulated backend returns the same Group records as the rollout workers, so every step's
    TrainBatch comes out of the Controller's BatchBuilder (top-K included when the objective needs it)."""
    cfg = sim_config(tmp_path, workers=6, steps=8, max_staleness=2, sim={"tokens_per_sample": 5, "publish_seconds": 0.5})
    cfg = cfg.model_copy(update={"learner": cfg.learner.model_copy(update={"objective": DPPOTopKTVConfig(k=3)})})
    result = train(cfg)
    assert result.steps == 8
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    tokens = cfg.train.prompts_per_step * cfg.rollout.samples_per_prompt * 5
    for s in (s for s in steps if s["kind"] == "step"):
        hist = [s[f"staleness/token_lag_hist/bin_{i}"] for i in range(8)]
        assert sum(hist) == s["learner/tokens"] == tokens  # the batch the simulated learner trained on
        assert max(i for i, c in enumerate(hist) if c) == s["staleness/lag_max"] <= 2  # one lag, token and group views agree


def test_held_out_problems_with_the_same_id_are_refused_before_anything_runs(tmp_path):
    cfg = sim_config(tmp_path)
    test = arithmetic_split("test", 3)
    test[2] = dataclasses.replace(test[2], id=test[0].id)
    with pytest.raises(ValueError, match=f"eval set 'heldout' has repeated problem ids \\({test[0].id}\\)"):
        Controller.build(cfg, backend=SimulatedBackend.build(cfg.simulation, workers=1), train=arithmetic_split("train", 20), evals={"heldout": test}, telemetry=None)


def test_an_evaluation_round_cut_short_by_a_stop_is_recorded_as_cancelled_not_as_a_result(tmp_path):
    cfg = sim_config(tmp_path, workers=1)
    backend = SimulatedBackend.build(cfg.simulation, workers=1)
    telemetry = Telemetry(tmp_path / "t", cfg.metrics, cfg.train.steps, backend.now)
    ctl = Controller.build(cfg, backend=backend, train=arithmetic_split("train", 20), evals={"heldout": arithmetic_split("test", 5)},
                           telemetry=telemetry)
    ctl.evaluate(blocking=False)  # one worker: the first prompt starts, four wait in its queue
    ctl.requeue_unstarted()  # what a stop does before winding down
    while ctl.eval_pending:
        ctl.handle(backend.wait())
    lines = [json.loads(line) for line in (tmp_path / "t" / "metrics.jsonl").read_text().splitlines()]
    assert [r for r in lines if r["kind"] == "eval"] == [] and ctl.eval_history == []
    (cut,) = [r for r in lines if r["kind"] == "eval_cancelled"]
    assert (cut["round"], cut["answered"], cut["cancelled"]) == (0, 1, 4)


class _Rounds(SimulatedBackend):
    """Records the simulated time of every training submission: submissions at one instant are one
    engine round."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.submitted: list[float] = []

    def submit(self, worker, items):
        self.submitted += [self.now() for ticket, _, _ in items if isinstance(ticket, TrainTicket)]
        super().submit(worker, items)


def test_sync_oversampling_fills_filtered_batches_from_the_surplus_instead_of_refill_rounds(tmp_path):
    """At accuracy 0.8 a third of the groups of 4 are all correct and filtered. One prompt per missing
    group needs a refill round after most rounds; asking for twice the missing groups fills nearly every
    batch in one round, drops the rest as 'surplus', and still trains B on-policy groups a step."""
    runs = {}
    for oversample in (1.0, 2.0):
        cfg = sim_config(tmp_path / str(oversample), workers=1, mode="sync", max_staleness=0, steps=12, oversample=oversample, checkpoint_every=12,
                         sim={"accuracy": 0.8, "gen_cv": 0.0, "seed": 5})
        backend = _Rounds(cfg.simulation, workers=1)
        result = train(cfg, backend=backend)
        assert result.ledger_counts["trained"] == 12 * cfg.train.prompts_per_step and max(trained_lags(cfg.run_dir)) == 0
        runs[oversample] = (result.ledger_counts, len(set(backend.submitted)))
    (plain, plain_rounds), (over, over_rounds) = runs[1.0], runs[2.0]
    assert "surplus" not in plain and over["surplus"] > 0 and plain["filtered"] > 0
    assert plain_rounds > 12 * 1.5 and over_rounds < 12 * 1.2  # rounds per step: refills vs (nearly) none
    with pytest.raises(ValueError, match="train.oversample 2 needs train.mode sync"):
        sim_config(tmp_path, mode="async", oversample=2.0)
    unfiltered = {**sim_config(tmp_path, mode="sync", max_staleness=0, oversample=2.0).model_dump(), "advantages": {"filter_zero_variance": False}}
    with pytest.raises(ValueError, match="over-samples for the zero-variance filter, which is off"):
        RunConfig.model_validate(unfiltered)
