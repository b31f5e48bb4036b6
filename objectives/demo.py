"""The effective per-token gradient weight of each objective, measured by autograd.

For a token with behaviour probability mu and learner probability pi, every objective's gradient
with respect to log pi is -A * r * w, r = pi/mu; this module reports w, the multiplier on the
importance-weighted policy gradient r A grad log pi (1 for plain off-policy PG, 0 where PPO clips or
DPPO masks), for A = +1 and A = -1 across mu and pi. It is what ``drpo demo`` prints: DRPO's w is
1 - sign(A(r-1))|pi-mu|/delta, bounded in [1-1/delta, 1+1/delta]; SPO's grows with r.
"""

from __future__ import annotations

import math

import torch

import objectives

DEFAULT_POINTS: tuple[tuple[float, float], ...] = (
    (0.5, 0.5),
    (0.5, 0.6),
    (0.5, 0.75),
    (0.5, 0.9),
    (0.5, 0.3),
    (0.1, 0.3),
    (1e-3, 0.2),
    (1e-6, 0.05),
)

DEFAULT_COLUMNS: tuple[tuple[str, str, dict], ...] = (
    ("ppo_clip", "ppo_clip", {}),
    ("spo", "spo", {}),
    ("dppo_tv", "dppo_binary_tv", {"delta": 0.15}),
    ("drpo d=12.5", "drpo", {"delta": 12.5}),
    ("drpo d=0.15", "drpo", {"delta": 0.15}),
)


def gradient_weights(name: str, mu: float, pi: float, advantage: float, **params) -> float:
    """w where dL/dlog(pi) = -A r w for one token, computed by autograd through the objective."""
    policy_logp = torch.tensor([[math.log(pi)]], dtype=torch.float64, requires_grad=True)
    rollout_logp = torch.tensor([[math.log(mu)]], dtype=torch.float64)
    adv = torch.tensor([[advantage]], dtype=torch.float64)
    loss = objectives.token_loss(name, policy_logp, rollout_logp, adv, **params)
    (grad,) = torch.autograd.grad(loss.sum(), policy_logp)
    # round() drops float64 noise such as 2e-16; + 0.0 turns -0.0 into 0.0.
    return round(float(-grad.item() / (advantage * pi / mu)), 10) + 0.0


def weight_table(advantage: float = 1.0, points=DEFAULT_POINTS, columns=DEFAULT_COLUMNS) -> list[list[str]]:
    """Rows of [mu, pi, r, weight per column] as formatted strings, header first."""
    rows = [["mu", "pi", "r=pi/mu", *(label for label, _, _ in columns)]]
    for mu, pi in points:
        cells = [f"{mu:g}", f"{pi:g}", f"{pi / mu:.4g}"]
        cells += [f"{gradient_weights(name, mu, pi, advantage, **params):.4g}" for _, name, params in columns]
        rows.append(cells)
    return rows


def format_table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
