"""The invariant every fault-injection test asserts, read from a run's latest checkpoint: every drawn
prompt has exactly one outcome or is waiting to be drawn again, every dropped one says why, the
expected number of groups was trained, and no trained sample was older than the bound."""

from __future__ import annotations

import json
from pathlib import Path

from controller.ledger import audit
from controller.checkpoints import latest_checkpoint


def assert_ledger_exact(run_dir: Path, train_ids: list[str], seed: int, steps: int, batch: int, eta: int) -> dict:
    state = json.loads((latest_checkpoint(run_dir) / "controller.json").read_text())
    counts = audit(state, train_ids, seed)
    assert counts["double_counted"] == 0, "a prompt was consumed twice"
    assert counts["lost"] == 0 and counts["phantom"] == 0, "a drawn prompt was lost"
    assert counts["unexplained"] == 0, "a dropped prompt has no reason"
    assert state["step"] == steps and counts["trained"] == steps * batch
    assert all(0 <= e["lag"] <= eta for e in state["ledger"] if e["outcome"] == "trained"), "a trained sample was older than the bound"
    return state
