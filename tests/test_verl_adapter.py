"""drpo's objectives inside a real verl install (verl 0.9.1, CPU, set up by scripts/setup.sh).

verl pins transformers < 5.11 while drpo uses a newer one, so setup.sh installs verl and the few
packages its loss module imports with --no-deps into .venv/verl-site, and the probe runs in a
subprocess with that folder on its path; the assertions are on the numbers it reports.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VERL_SITE = Path(os.environ.get("DRPO_VERL_SITE", ROOT / ".venv" / "verl-site"))


@pytest.fixture(scope="module")
def probe():
    if not (VERL_SITE / "verl").is_dir():
        pytest.skip(f"verl is not installed at {VERL_SITE} (scripts/setup.sh installs it)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(VERL_SITE), str(ROOT)]))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "verl_probe.py")], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_drpo_losses_are_added_to_verls_registry_without_replacing_verls_own(probe):
    assert probe["added"] == ["drpo", "mask_drpo", "drpo_no_abs_adv", "spo"]
    assert {"drpo", "mask_drpo", "dppo_tv", "vanilla"} <= set(probe["registry"])


@pytest.mark.parametrize("delta", ["0.2", "12.5"])
def test_drpo_through_verl_equals_drpo_direct(probe, delta):
    r = probe[f"drpo_{delta}"]
    assert r["verl"] == pytest.approx(r["ours"], rel=1e-12)
    assert r["grad_max_diff"] < 1e-12
    assert "actor/drpo/corrective_frac" in r["metric_keys"]


def test_dppo_binary_tv_matches_verls_dppo_tv(probe):
    r = probe["dppo_tv"]
    assert r["verl"] == pytest.approx(r["ours"], rel=1e-9)
    assert r["grad_max_diff"] < 1e-9
