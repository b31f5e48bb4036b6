"""Every component is built as ``Component.build(config, **runtime handles)`` from its own config
section, and refuses a section of another component's type by name, before it places or loads anything."""

from __future__ import annotations

import pytest

from controller.batch_builder import BatchBuilder
from controller.config import RunConfig, SimulationConfig
from controller.loop import Controller
from controller.ray_backend import RayBackend
from controller.simulation import SimulatedBackend
from learner.config import LearnerConfig, LearnerResources
from learner.group import LearnerGroup
from learner.learner import Learner
from objectives.config import AdvantageConfig
from rollout.chaos import Chaos
from rollout.config import ChaosConfig, RolloutConfig, ScoringConfig
from rollout.engine import Engine
from rollout.generator import Generator
from rollout.grader import Grader
from rollout.worker import RolloutWorker

HANDLES = {"model_folder": "/nonexistent"}

# (component, the section it builds from, a build call taking the config)
BUILDS = [
    ("RolloutWorker", RolloutConfig, lambda c: RolloutWorker.build(c, **HANDLES)),
    ("Engine", RolloutConfig, lambda c: Engine.build(c, **HANDLES)),
    ("Generator", RolloutConfig, lambda c: Generator.build(c, engine=None)),
    ("Grader", RolloutConfig, lambda c: Grader.build(c)),
    ("Chaos", ChaosConfig, lambda c: Chaos.build(c, worker_id=0)),
    ("LearnerGroup", LearnerConfig, lambda c: LearnerGroup.build(c, **HANDLES)),
    ("Learner", LearnerConfig, lambda c: Learner.build(c, **HANDLES)),
    ("BatchBuilder", AdvantageConfig, lambda c: BatchBuilder.build(c)),
    ("SimulatedBackend", SimulationConfig, lambda c: SimulatedBackend.build(c, workers=1)),
    ("RayBackend", RunConfig, lambda c: RayBackend.build(c, **HANDLES)),
    ("Controller", RunConfig, lambda c: Controller.build(c, backend=None, train=[], evals={}, telemetry=None)),
]
SECTIONS = [RolloutConfig(), ChaosConfig(), ScoringConfig(), LearnerConfig(), LearnerResources(), AdvantageConfig(), SimulationConfig(), RunConfig()]


@pytest.mark.parametrize("name,own,build", BUILDS, ids=[b[0] for b in BUILDS])
def test_each_build_refuses_a_config_of_another_components_type(name, own, build):
    others = [s for s in SECTIONS if not isinstance(s, own)]
    assert len(others) == len(SECTIONS) - 1
    for other in others:
        with pytest.raises(TypeError, match=rf"^{name}\.build takes a {own.__name__}, not a {type(other).__name__}$"):
            build(other)


def test_learner_group_refuses_resources_of_another_type_before_placing_anything():
    with pytest.raises(TypeError, match=r"LearnerGroup \(resources\)\.build takes a LearnerResources, not a RolloutConfig"):
        LearnerGroup.build(LearnerConfig(), model_folder="/nonexistent", resources=RolloutConfig())


def test_parts_built_from_their_section_take_its_values_with_no_defaults_of_their_own():
    rollout = RolloutConfig(samples_per_prompt=3, max_new_tokens=20, temperature=0.7, max_prompt_tokens=99,
                            scoring=ScoringConfig(overlong_penalty=0.25, overlong_buffer=4, require_marker=True))
    grader = Grader.build(rollout, worker_id=5)
    assert grader.scoring is rollout.scoring and grader.max_new_tokens == 20 and grader.worker_id == 5
    assert grader.reward.comparison.require_marker and not grader.chaos.active
    gen = Generator.build(rollout, engine=None, topk_logprobs=4, seed=11, eval_temperature=0.3)
    assert (gen.sampling.n, gen.sampling.max_new_tokens, gen.sampling.temperature, gen.sampling.topk_logprobs, gen.sampling.seed) == (3, 20, 0.7, 4, 11)
    assert (gen.eval_sampling.temperature, gen.eval_sampling.topk_logprobs, gen.max_prompt_tokens) == (0.3, 0, 99)
    assert Generator.build(rollout, engine=None).eval_sampling.temperature == 0.7  # evaluation follows training unless set apart
    chaos = Chaos.build(ChaosConfig(reward_error_rate=1.0), worker_id=0)
    assert chaos.active and chaos.reward_fails()
    built = SimulatedBackend.build(SimulationConfig(seed=3), workers=2, topk=2)
    assert (built.workers, built.topk, built.cfg.seed) == (2, 2, 3)
