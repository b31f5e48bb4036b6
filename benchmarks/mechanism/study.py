"""The mechanism study: where each objective's gradient weight goes as the off-policy gap grows, with
no LLM (runs in a few minutes, from the repo root):

    .venv/bin/python -m benchmarks.mechanism.study                         # tables + plots into OUT
    .venv/bin/python -m benchmarks.mechanism.study --docs docs/results.md  # and the report block

A softmax policy pi over SmolLM2's 49,152-token vocabulary at P positions, each a peaked head over a
Zipf tail (its head and tail shapes stated in ``POLICY``). The behaviour policy mu is pi with Gaussian
noise on every logit, its scale calibrated so the mean |pi - mu| at sampled tokens equals a mismatch
measured by drpo's own runs (``PROFILES``: bf16 and fp8 engines, staleness at lag 1-8). Tokens are
sampled from mu and given advantages of +-1.

For every objective, the per-token gradient weight w (the gradient of its loss with respect to
log pi(y) is -A w) is written in closed form (``weights``; tests/test_mechanism.py checks each
against the objectives library's autograd gradient), and the study reports:
- the weight against the token's signed shift sign(A)(pi - mu) (weights.png);
- the share of the update (sum of |A w|) that lands on tail tokens, mu < 1e-3 (tail_share.png);
- the drift of pi from mu over repeated updates on the same batch, with the library's own loss and
  autograd (SGD on the logits; drift.png): mean |pi - mu| and the share beyond DPPO's delta 0.15.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

import objectives
from objectives.anchor import decoupled_inputs

VOCAB = 49_152
TAIL = 1e-3
"""A tail token: mu below this."""
POLICY = {"zipf_exponent": (1.0, 1.6), "head_boost": (0.0, 12.0)}
"""Per position: logits -s log(rank + 1) over the vocabulary (a Zipf tail with exponent s drawn from
the first range) plus a boost of the top token drawn from the second (peaked positions, as most of an
LLM's are, and flat ones)."""

PROFILES = {
    # mean |pi - mu| at sampled tokens, measured by drpo (docs/results.md's grid and README):
    "bf16 (stand-in)": 0.002,  # bf16 engine vs fp32 learner, stand-in, lag 0
    "bf16 (SmolLM2)": 0.006,  # the default preset's lag-0 gap on SmolLM2
    "fp8 (stand-in)": 0.0034,  # fp8 weight-only engine vs fp32 learner, stand-in
    "fp8 (SmolLM2)": 0.03,  # SmolLM2's fp8 gap, ~10x the stand-in's
    "lag 1": 0.006,  # async eta 4 on the stand-in: 0.015 mean over lags 1-4 (mean lag ~2.5), ~0.006 per version
    # (the same size as SmolLM2's bf16 gap, so with the same noise its row repeats that one: a coincidence of the measurements)
    "lag 2": 0.012,
    "lag 4": 0.024,
    "lag 8": 0.048,
}


@dataclass(frozen=True)
class Objective:
    name: str
    config: dict
    tis_cap: float | None = None
    """Token-level TIS: the decoupled anchor with this cap (objectives/anchor.py) around ``config``."""


OBJECTIVES = (
    Objective("grpo", {"type": "ppo_clip"}),
    Objective("grpo_tis", {"type": "ppo_clip"}, tis_cap=2.0),
    Objective("spo", {"type": "spo"}),
    Objective("dppo_binary_tv", {"type": "dppo_binary_tv"}),
    Objective("drpo", {"type": "drpo", "delta": 12.5}),
    Objective("drpo_d0.15", {"type": "drpo", "delta": 0.15}),
)


# ---- the closed forms -----------------------------------------------------------------------------


def weights(obj: Objective, policy_logp: torch.Tensor, rollout_logp: torch.Tensor, adv: torch.Tensor) -> torch.Tensor:
    """w per token, where d loss / d log pi(y) = -A w, at the first update on a batch (pi_old = pi)."""
    cfg = objectives.make_config(obj.config["type"], **{k: v for k, v in obj.config.items() if k != "type"})
    r = (policy_logp - rollout_logp).exp()
    pi, mu = policy_logp.exp(), rollout_logp.exp()
    pos = adv > 0
    if obj.tis_cap is not None:  # the clip is on pi / pi_old = 1: never active; mu enters as min(pi_old/mu, C)
        return r.clamp(max=obj.tis_cap)
    kind = cfg.type
    if kind == "ppo_clip":
        active = torch.where(pos, r <= 1 + cfg.eps_high, r >= 1 - cfg.eps_low)
        if cfg.dual_clip_c is not None:
            active &= pos | (r <= cfg.dual_clip_c)
        return r * active
    if kind == "spo":
        return r * (1 - torch.sign(adv) * (r - 1) / cfg.eps)
    if kind == "dppo_binary_tv":
        masked = torch.where(pos, pi - mu > cfg.delta, pi - mu < -cfg.delta)
        return r.clamp(max=cfg.is_cap) * ~masked
    if kind == "drpo":
        return r * (1 - torch.sign(adv) * (pi - mu) / cfg.delta)
    raise ValueError(f"no closed form for {kind}")


def token_losses(obj: Objective, policy_logp: torch.Tensor, rollout_logp: torch.Tensor, adv: torch.Tensor,
                 proximal_logp: torch.Tensor | None = None) -> torch.Tensor:
    """The objectives library's per-token loss (what the learner runs); TIS anchors at
    ``proximal_logp`` (pi at the start of the step; default: pi now, the first update)."""
    cfg = objectives.make_config(obj.config["type"], **{k: v for k, v in obj.config.items() if k != "type"})
    mask = torch.ones_like(adv, dtype=torch.bool)
    if obj.tis_cap is not None:
        prox = policy_logp.detach() if proximal_logp is None else proximal_logp
        inputs, _ = decoupled_inputs(policy_logp, rollout_logp, prox, adv, mask, obj.tis_cap)
    else:
        inputs = objectives.ObjectiveInputs(policy_logp, rollout_logp, adv, mask)
    return objectives.compute(cfg, inputs).loss


# ---- the synthetic policy -------------------------------------------------------------------------


def policy_logits(positions: int, gen: torch.Generator, vocab: int = VOCAB) -> torch.Tensor:
    """[P, V] logits: a Zipf tail and a boosted top token per position (``POLICY``)."""
    lo, hi = POLICY["zipf_exponent"]
    s = lo + (hi - lo) * torch.rand(positions, 1, generator=gen)
    b_lo, b_hi = POLICY["head_boost"]
    boost = b_lo + (b_hi - b_lo) * torch.rand(positions, generator=gen)
    ranks = torch.arange(vocab, dtype=torch.float32)
    z = -s * torch.log1p(ranks)[None, :]
    z[:, 0] += boost
    perm = torch.argsort(torch.rand(positions, vocab, generator=gen), dim=1)  # which id holds which rank: unrelated per position
    return torch.gather(z, 1, perm)


def behaviour(z: torch.Tensor, sigma: float, noise: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(z + sigma * noise, dim=-1)


def calibrate(z: torch.Tensor, noise: torch.Tensor, u: torch.Tensor, target: float) -> tuple[float, torch.Tensor, torch.Tensor]:
    """sigma such that mean |pi - mu| at tokens sampled from mu is ``target`` (bisection on log sigma);
    returns sigma, log mu [P, V] and the sampled ids [P]."""
    log_pi = torch.log_softmax(z, dim=-1)

    def at(sigma):
        log_mu = behaviour(z, sigma, noise)
        y = sample(log_mu, u)
        gap = (log_pi.gather(1, y[:, None]).exp() - log_mu.gather(1, y[:, None]).exp()).abs().mean().item()
        return gap, log_mu, y

    lo, hi = math.log(1e-5), math.log(5.0)
    for _ in range(30):
        mid = (lo + hi) / 2
        gap, _, _ = at(math.exp(mid))
        lo, hi = (mid, hi) if gap < target else (lo, mid)
    sigma = math.exp((lo + hi) / 2)
    _, log_mu, y = at(sigma)
    return sigma, log_mu, y


def sample(log_p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One id per row by inverting the CDF at the uniforms ``u`` [P] (common random numbers across sigmas)."""
    cdf = log_p.double().exp().cumsum(dim=-1)
    return torch.searchsorted(cdf, (u.double() * cdf[:, -1]).unsqueeze(1)).squeeze(1).clamp(max=log_p.shape[1] - 1)


# ---- the study ------------------------------------------------------------------------------------


def drift(obj: Objective, z0: torch.Tensor, log_mu: torch.Tensor, y: torch.Tensor, adv: torch.Tensor, updates: int, lr: float) -> list[dict]:
    """Repeated SGD updates of the logits on one batch with the library's loss (its sum over the
    batch; TIS anchored at pi before the first update, as the learner holds it for the step): after
    each, mean and max |pi - mu| at the sampled tokens and the share beyond 0.15."""
    z = z0.clone().requires_grad_(True)
    mu_y = log_mu.gather(1, y[:, None]).squeeze(1).exp()
    start = (torch.log_softmax(z0, dim=-1).gather(1, y[:, None]).squeeze(1).exp() - mu_y).abs()
    rollout_logp = log_mu.gather(1, y[:, None]).squeeze(1)
    proximal = torch.log_softmax(z0, dim=-1).gather(1, y[:, None]).squeeze(1)  # the step's start: held for every update
    out = [{"mean": start.mean().item(), "max": start.max().item(), "beyond_0.15": (start > 0.15).float().mean().item(),
            "tail_mean": start[mu_y < TAIL].mean().item() if (mu_y < TAIL).any() else None}]  # before the first update
    for _ in range(updates):
        logp = torch.log_softmax(z, dim=-1).gather(1, y[:, None]).squeeze(1)
        loss = token_losses(obj, logp[None], rollout_logp[None], adv[None], proximal[None]).sum()
        (grad,) = torch.autograd.grad(loss, z)
        with torch.no_grad():
            z -= lr * grad
            shift = (torch.log_softmax(z, dim=-1).gather(1, y[:, None]).squeeze(1).exp() - mu_y).abs()
        out.append({"mean": shift.mean().item(), "max": shift.max().item(), "beyond_0.15": (shift > 0.15).float().mean().item(),
                    "tail_mean": shift[mu_y < TAIL].mean().item() if (mu_y < TAIL).any() else None})
    return out


def study(positions: int = 1024, seed: int = 0, updates: int = 8, lr: float = 0.5, log=print) -> dict:
    gen = torch.Generator().manual_seed(seed)
    z = policy_logits(positions, gen)
    noise = torch.randn(z.shape, generator=gen)
    u = torch.rand(positions, generator=gen)
    adv = torch.where(torch.rand(positions, generator=gen) < 0.5, 1.0, -1.0)
    log_pi = torch.log_softmax(z, dim=-1)
    entropy = -(log_pi.exp() * log_pi).sum(-1)
    out = {"positions": positions, "vocab": VOCAB, "seed": seed, "updates": updates, "lr": lr,
           "policy": {"entropy_mean": entropy.mean().item(), "top1_mean": log_pi.max(-1).values.exp().mean().item()}, "profiles": {}}
    for profile, target in PROFILES.items():
        sigma, log_mu, y = calibrate(z, noise, u, target)
        pi_y, mu_y = log_pi.gather(1, y[:, None]).squeeze(1), log_mu.gather(1, y[:, None]).squeeze(1)
        shift = pi_y.exp() - mu_y.exp()
        tail = mu_y.exp() < TAIL
        entry = {"target": target, "sigma": sigma, "gap_mean": shift.abs().mean().item(), "gap_p99": shift.abs().quantile(0.99).item(),
                 "gap_max": shift.abs().max().item(), "tail_tokens": tail.float().mean().item(), "objectives": {}}
        for obj in OBJECTIVES:
            w = weights(obj, pi_y, mu_y, adv)
            mass = w.abs()
            entry["objectives"][obj.name] = {
                "tail_share": (mass[tail].sum() / mass.sum().clamp_min(1e-30)).item(),
                "weight_tail_mean": mass[tail].mean().item() if tail.any() else None, "weight_head_mean": mass[~tail].mean().item(),
                "weight_max": mass.max().item(), "zero_frac": (w == 0).float().mean().item(), "negative_frac": (w < 0).float().mean().item(),
                "drift": drift(obj, z, log_mu, y, adv, updates, lr),
                "points": [[round(float(sh), 5), round(float(x), 5)] for sh, x in zip(torch.sign(adv) * shift, w)][:400],
            }
        log(f"{profile}: sigma {sigma:.4g}, mean |pi-mu| {entry['gap_mean']:.4f}, max {entry['gap_max']:.3f}, tail tokens {entry['tail_tokens']:.3f}")
        out["profiles"][profile] = entry
    return out


def shown(profiles: list[str]) -> list[str]:
    """The profiles the drift table and the per-profile plots show."""
    return [p for p in ("bf16 (SmolLM2)", "fp8 (SmolLM2)", "lag 8") if p in profiles]


def _f(v, d=3):
    return "–" if v is None else f"{v:.{d}g}"


def tables(result: dict) -> str:
    profiles = list(result["profiles"])
    names = [o.name for o in OBJECTIVES]
    head = "| profile | mean / p99 / max \\|π−μ\\| | tail tokens | " + " | ".join(names) + " |\n|" + "---|" * (3 + len(names)) + "\n"
    share = head + "".join(
        f"| {p} | {_f(e['gap_mean'])} / {_f(e['gap_p99'])} / {_f(e['gap_max'])} | {_f(e['tail_tokens'])} | "
        + " | ".join(_f(e["objectives"][n]["tail_share"]) for n in names) + " |\n" for p, e in result["profiles"].items())
    tail_w = "| profile | " + " | ".join(names) + " |\n|" + "---|" * (1 + len(names)) + "\n" + "".join(
        f"| {p} | " + " | ".join(f"{_f(e['objectives'][n]['weight_tail_mean'])} ({_f(e['objectives'][n]['weight_max'])})" for n in names) + " |\n"
        for p, e in result["profiles"].items())
    last = result["updates"]
    drift_t = "| profile | before | " + " | ".join(names) + " |\n|" + "---|" * (2 + len(names)) + "\n" + "".join(
        f"| {p} | {_f(e['objectives'][names[0]]['drift'][0]['mean'])} | "
        + " | ".join(f"{_f(e['objectives'][n]['drift'][-1]['mean'])} ({_f(e['objectives'][n]['drift'][-1]['beyond_0.15'], 2)})" for n in names) + " |\n"
        for p, e in result["profiles"].items() if p in shown(profiles))
    return (f"Policy: {result['positions']} positions over a {result['vocab']}-token vocabulary, mean entropy "
            f"{result['policy']['entropy_mean']:.2f} nats, mean top-1 probability {result['policy']['top1_mean']:.2f}.\n\n"
            f"**Share of the update on tail tokens**: Σ|A·w| over tail tokens (μ < {TAIL:g}) ÷ Σ|A·w| over all tokens, per objective; "
            f"the *tail tokens* column is the share of sampled tokens in the tail (what equal weights would give):\n\n{share}\n"
            f"**Weight on tail tokens**: mean |w| over tail tokens (max |w| over all tokens):\n\n{tail_w}\n"
            f"**Drift after {last} updates on one batch** (SGD on the logits, lr {result['lr']}): mean |π−μ| at the sampled tokens "
            f"before the first update and after the last (share of tokens beyond 0.15, DPPO's δ):\n\n{drift_t}")


BEGIN, END = "<!-- mechanism:begin (written by benchmarks/mechanism/study.py --docs) -->", "<!-- mechanism:end -->"
PLOTS = ("weights.png", "tail_share.png", "drift.png")


def plot(result: dict, folder: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder = Path(folder)
    names = [o.name for o in OBJECTIVES]
    profiles = list(result["profiles"])
    show = shown(profiles)
    fig, axes = plt.subplots(1, len(show), figsize=(4.5 * len(show), 3.4), squeeze=False)
    for ax, p in zip(axes[0], show):
        for i, n in enumerate(names):
            pts = result["profiles"][p]["objectives"][n]["points"]
            ax.scatter([a for a, _ in pts], [b for _, b in pts], s=4, color=f"C{i}", label=n, alpha=0.6)
        ax.set_yscale("symlog", linthresh=1.0)
        ax.set_xlabel("sign(A)(π − μ)")
        ax.set_ylabel("gradient weight w")
        ax.set_title(p, fontsize=8)
        ax.legend(fontsize=5)
    fig.tight_layout()
    fig.savefig(folder / PLOTS[0], dpi=80)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 3.4))
    width = 0.8 / len(names)
    for i, n in enumerate(names):
        ax.bar([j + (i - len(names) / 2) * width for j in range(len(profiles))],
               [result["profiles"][p]["objectives"][n]["tail_share"] for p in profiles], width, color=f"C{i}", label=n)
    ax.plot(range(len(profiles)), [result["profiles"][p]["tail_tokens"] for p in profiles], "k_", markersize=14, label="share of tail tokens")
    ax.set_xticks(range(len(profiles)), profiles, rotation=20, fontsize=7)
    ax.set_ylabel(f"share of Σ|A w| on μ < {TAIL:g}")
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(folder / PLOTS[1], dpi=80)
    plt.close(fig)

    fig, axes = plt.subplots(1, len(show), figsize=(4.5 * len(show), 3.4), squeeze=False)
    for ax, p in zip(axes[0], show):
        for i, n in enumerate(names):
            d = result["profiles"][p]["objectives"][n]["drift"]
            ax.plot(range(len(d)), [x["mean"] for x in d], marker="o", markersize=3, color=f"C{i}", label=n)
        ax.set_yscale("log")
        ax.set_xticks(range(len(d)))
        ax.set_xlabel("updates on the same batch (0: before the first)")
        ax.set_ylabel("mean |π − μ|")
        ax.set_title(p, fontsize=8)
        ax.legend(fontsize=5)
    fig.tight_layout()
    fig.savefig(folder / PLOTS[2], dpi=80)
    plt.close(fig)
    return [folder / name for name in PLOTS]


def write_docs(path: Path, result: dict, out: Path) -> None:
    from benchmarks.experiments.reporting import copy_assets, replace_block

    path = Path(path)
    assets = copy_assets(path, out, PLOTS)
    block = (f"\n\nCommand: `.venv/bin/python -m benchmarks.mechanism.study --docs {path}` "
             f"(seed {result['seed']}).\n\n{tables(result)}\n"
             + "".join(f"![{n}]({assets.name}/{n})\n\n" for n in PLOTS))
    replace_block(path, BEGIN, END, block)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--positions", type=int, default=1024)
    parser.add_argument("--updates", type=int, default=8)
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--docs", help="also write the report block into this page (docs/results.md)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(2)
    result = study(args.positions, args.seed, args.updates, args.lr)
    (out / "mechanism.json").write_text(json.dumps(result))
    plot(result, out)
    text = tables(result)
    (out / "mechanism.md").write_text(text)
    print(text)
    if args.docs:
        write_docs(Path(args.docs), result, out)


if __name__ == "__main__":
    main()
