"""Pure rules of the fleet and the learner layout (no Ray, no model): which broadcast failures
restart a worker, and which layouts an MoE model refuses."""

from __future__ import annotations

from controller.broadcast_sync import Outcome
from learner.model import ModelArch, layout_problems

MOE = ModelArch(vocab_size=96, hidden_size=64, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                num_experts=4, router_topk=2, moe_intermediate_size=64)


def test_a_worker_failing_alone_is_restarted_but_a_publication_nobody_took_is_an_error():
    one_failed = Outcome(received={0: {"version": 3, "seconds": 0.1}, 1: {"error": "KeyError: x"}}, sent=True)
    assert one_failed.failed_alone == [1]
    nobody = Outcome(received={0: {"error": "KeyError: x"}, 1: {"error": "KeyError: x"}}, sent=True)
    assert nobody.failed_alone == []  # the publication failed, not an engine: no restarts, the error surfaces
    died = Outcome(received={0: {"error": "timeout"}, 1: {"version": 3}}, dead={2}, sent=True)
    assert died.failed_alone == []  # a dead peer makes the others fail too: not their fault
    assert Outcome(received={0: {"error": "x"}, 1: {"version": 3}}, sent=False).failed_alone == []


def test_moe_layouts_are_refused_by_field():
    assert layout_problems(MOE, tensor=1, expert=2) == []
    assert any("learner.parallel.tensor=2 on an MoE model" in p for p in layout_problems(MOE, tensor=2, expert=1))
    assert any("must divide the model's experts (4)" in p for p in layout_problems(MOE, tensor=1, expert=3))
