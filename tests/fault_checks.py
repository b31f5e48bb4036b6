"""The invariant every fault-injection test asserts, read from a run's latest checkpoint: every drawn
prompt has exactly one outcome or is waiting to be drawn again, every dropped one says why, the
expected number of groups was trained, and no trained sample was older than the bound."""

from __future__ import annotations

import json
from pathlib import Path

from controller.ledger import PromptSampler
from controller.loop import latest_checkpoint


def assert_ledger_exact(run_dir: Path, train_ids: list[str], seed: int, steps: int, batch: int, eta: int) -> dict:
    state = json.loads((latest_checkpoint(run_dir) / "controller.json").read_text())
    entries = state["ledger"]
    keys = [(e["epoch"], e["id"]) for e in entries]
    assert len(keys) == len(set(keys)), "a prompt was consumed twice"
    trained = [e for e in entries if e["outcome"] == "trained"]
    assert state["step"] == steps and len(trained) == steps * batch
    assert all(0 <= e["lag"] <= eta for e in trained), "a trained sample was older than the bound"
    assert all(e["reason"] for e in entries if e["outcome"] != "trained"), "a dropped prompt has no reason"
    sampler = PromptSampler(train_ids, seed)
    sampler.load_state_dict(state["sampler"])
    pending = {(t["epoch"], t["id"]) for t in state["sampler"]["requeued"]}
    assert not pending & set(keys)
    for epoch in range(state["sampler"]["epoch"] + 1):
        drawn = {(epoch, i) for i in sampler.issued(epoch)}
        assert drawn == {k for k in set(keys) | pending if k[0] == epoch}, f"epoch {epoch}: a drawn prompt was lost"
    return state
