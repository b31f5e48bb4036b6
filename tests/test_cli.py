"""The drpo command."""

from __future__ import annotations

import pytest

from controller.cli import main


def test_demo_prints_weight_tables_for_both_advantage_signs(capsys):
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "A = +1" in out and "A = -1" in out
    rows = [line.split() for line in out.splitlines() if line.strip().startswith("0.5") and "0.75" in line.split()[:2]]
    # mu = 0.5, pi = 0.75, A = +1: ppo clips (0), drpo delta=0.15 reverses: 1 - 0.25/0.15
    first = rows[0]
    assert float(first[3]) == 0.0 and float(first[-1]) == pytest.approx(1 - 0.25 / 0.15, abs=1e-3)


def test_objectives_lists_registry_with_defaults(capsys):
    assert main(["objectives"]) == 0
    out = capsys.readouterr().out
    assert "drpo" in out and "delta=12.5" in out and "dppo_topk_kl" in out


def test_unknown_subcommand_exits_with_usage(capsys):
    with pytest.raises(SystemExit) as err:
        main(["trian"])
    assert err.value.code == 2
    assert "invalid choice" in capsys.readouterr().err
