"""Megatron's distributed optimizer on CPU: where exactly it fails (it is exercised on
CPU wherever the library allows). The learner builds it only on CUDA (learner/optim.py,
MegatronDistributedAdam); its checkpoint round trip is a `gpu` test (tests/test_learner_gpu.py).
If a megatron-core release lets it build on CPU, this test fails and that round trip can move here."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

SCRIPT = textwrap.dedent("""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from learner import bridge, distributed
    from learner import model as modeling
    from learner.config import LearnerConfig, OptimizerConfig
    from learner.learner import Learner
    from learner.optim import MegatronDistributedAdam, TorchAdamW

    cfg = LearnerConfig(optimizer=OptimizerConfig(lr=1e-3), micro_batch_size=2)
    distributed.init(cfg.parallel, 0, 1, master_port=distributed.free_port())
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2))
    arch = modeling.ModelArch.from_hf_config(hf.config.to_dict())
    learner = Learner(cfg, arch, bridge.hf_to_megatron(hf.state_dict(), arch))
    assert isinstance(learner.optimizer, TorchAdamW), type(learner.optimizer)  # the CPU learner's optimizer
    print("building the distributed optimizer", flush=True)
    MegatronDistributedAdam(learner.model, cfg.optimizer, 1)
    print("built", flush=True)
""")


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA the distributed optimizer builds (tests/test_learner_gpu.py)")
def test_megatrons_distributed_optimizer_cannot_be_built_on_cpu_and_fails_where_documented():
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=root, capture_output=True, text=True, timeout=300)
    out = done.stdout + done.stderr
    assert "building the distributed optimizer" in done.stdout, out[-3000:]  # the model and the CPU learner were built
    assert "built\n" not in done.stdout and done.returncode != 0
    # megatron's mixed-precision optimizer allocates a scalar on "cuda" in its constructor (optimizer.py)
    assert "megatron/core/optimizer/optimizer.py" in out and "device='cuda'" in out, out[-3000:]
    assert "Torch not compiled with CUDA enabled" in out, out[-3000:]


class StandInPart:
    """One of megatron's optimizer parts (dense or expert), as far as MegatronDistributedAdam's
    checkpointing calls it: the dp_zero gather answers on data-parallel rank 0 only, the scatter
    takes the state there and None elsewhere."""

    def __init__(self, dp_rank: int, main_params: torch.Tensor):
        import types

        self.data_parallel_group = types.SimpleNamespace(rank=lambda: dp_rank)
        self.main_params, self.loaded = main_params, "never called"
        step = torch.tensor(7.0)  # megatron's load_state_dict gives every parameter's Adam state this one tensor
        self.optimizer = types.SimpleNamespace(state={i: {"step": step, "exp_avg": torch.zeros(2)} for i in range(3)})

    def get_parameter_state_dp_zero(self, use_gloo_comm: bool):
        assert use_gloo_comm  # gathered over gloo: no CUDA-side tensors in the file
        return {"param": self.main_params.clone(), "exp_avg": self.main_params * 0.1} if self.data_parallel_group.rank() == 0 else None

    def load_parameter_state_from_dp_zero(self, state):
        # megatron copies the gathered tensors into every entry of each parameter's state, in place
        # into main parameters that require grad: a "step" entry is a KeyError, autograd an error
        assert not any("step" in s for s in self.optimizer.state.values()) and not torch.is_grad_enabled()
        self.loaded = state


class StandInChained:
    def __init__(self, parts):
        self.chained_optimizers, self.restored = parts, None

    def state_dict(self):
        return {"param_groups": [{"lr": 1e-3}], "steps": 7}

    def load_state_dict(self, state):
        self.restored = state


def wrapper(dp_rank: int, parts: int = 2):
    from learner.optim import MegatronDistributedAdam

    optim = MegatronDistributedAdam.__new__(MegatronDistributedAdam)  # its constructor needs CUDA (above)
    optim.optimizer, optim._step = StandInChained([StandInPart(dp_rank, torch.arange(4.0) + i) for i in range(parts)]), 0
    return optim


def test_the_distributed_optimizers_checkpoint_gathers_to_dp_rank_0_and_scatters_from_it(tmp_path):
    """The wrapper's own protocol around megatron's dp_zero calls (the calls themselves need CUDA):
    each part's gathered state is in data-parallel rank 0's file and None in the others', survives
    torch.save/load, goes back to the part that saved it, and a layout with another part count is
    refused by name."""
    saved = {}
    for rank in (0, 1):
        optim = wrapper(rank)
        optim._step = 7
        torch.save(optim.state_dict(), tmp_path / f"rank{rank}.pt")
        saved[rank] = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
    assert saved[1]["param_state"] == [None, None] and torch.equal(saved[0]["param_state"][1]["param"], torch.arange(4.0) + 1)
    for rank in (0, 1):
        fresh = wrapper(rank)
        fresh.load_state_dict(saved[rank])
        assert fresh._step == 7 and fresh.optimizer.restored == {"param_groups": [{"lr": 1e-3}], "steps": 7}
        for i, part in enumerate(fresh.optimizer.chained_optimizers):
            steps = [state["step"] for state in part.optimizer.state.values()]
            assert [s.item() for s in steps] == [7.0] * 3 and len({id(s) for s in steps}) == 3  # kept, one tensor each
            if rank == 0:
                assert torch.equal(part.loaded["param"], torch.arange(4.0) + i)  # each part gets its own state back
            else:
                assert part.loaded is None  # the scatter's receivers pass None: rank 0 sends
    with pytest.raises(ValueError, match="the checkpoint holds 2 optimizer parts, this learner has 1"):
        wrapper(0, parts=1).load_state_dict(saved[0])


def test_a_step_tensor_shared_by_every_parameter_is_unshared_so_each_advances_once_per_update():
    """megatron's DistributedOptimizer.load_state_dict puts one "step" tensor into every parameter's
    Adam state (torch's Adam without Apex/TE); torch adds 1 to each in place, so a shared one jumps by
    the number of parameters per update. Reproduced with torch's Adam and that same shared load."""
    from learner.optim import unshare_steps

    def resumed(unshare: bool) -> list[float]:
        params = [torch.nn.Parameter(torch.ones(3)) for _ in range(4)]
        adam = torch.optim.Adam(params, lr=1e-3)
        step = torch.tensor(1.0)  # what megatron's loader does: `s["step"] = step` for every state
        state = {i: {"step": step, "exp_avg": torch.zeros(3), "exp_avg_sq": torch.zeros(3)} for i in range(4)}
        adam.load_state_dict({"state": state, "param_groups": adam.state_dict()["param_groups"]})
        if unshare:
            unshare_steps(adam)
        for p in params:
            p.grad = torch.ones(3)
        adam.step()
        return [adam.state[p]["step"].item() for p in params]

    assert resumed(unshare=False) == [5.0] * 4  # the bug: 1 + one increment per parameter
    assert resumed(unshare=True) == [2.0] * 4
