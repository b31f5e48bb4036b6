"""Run under a Python whose path includes verl (see test_verl_adapter.py); prints JSON results.

Registers drpo's objectives in the installed verl, then evaluates them through verl's own
registry and config classes, next to drpo's direct computation and verl's built-in dppo_tv.
"""

from __future__ import annotations

import json
import sys

import torch
from verl.trainer.ppo import core_algos
from verl.workers.config import FSDPActorConfig

import objectives
from objectives import verl_adapter


def main() -> None:
    g = torch.Generator().manual_seed(0)
    shape = (6, 40)
    old = torch.empty(shape, dtype=torch.float64).uniform_(-12.0, 0.0, generator=g)
    new = (old + 0.3 * torch.randn(shape, dtype=torch.float64, generator=g)).clamp(max=-1e-4)
    adv = torch.randn(shape, dtype=torch.float64, generator=g)
    mask = (torch.rand(shape, generator=g) > 0.1).to(torch.float64)
    added = verl_adapter.register()
    out = {"added": added, "registry": sorted(core_algos.POLICY_LOSS_REGISTRY)}
    for delta in (0.2, 12.5):
        cfg = FSDPActorConfig(strategy="fsdp", clip_ratio=delta, ppo_micro_batch_size_per_gpu=2, rollout_n=4, ppo_mini_batch_size=8)
        lp = new.clone().requires_grad_()
        loss, metrics = core_algos.get_policy_loss_fn("drpo")(old, lp, adv, mask, "token-mean", cfg)
        (grad,) = torch.autograd.grad(loss, lp)
        ref_lp = new.clone().requires_grad_()
        ref = objectives.aggregate(
            objectives.token_loss("drpo", ref_lp, old, adv, delta=delta, mask=mask.bool()), mask.bool(), "token-mean"
        )
        (ref_grad,) = torch.autograd.grad(ref, ref_lp)
        out[f"drpo_{delta}"] = {
            "verl": loss.item(), "ours": ref.item(), "grad_max_diff": (grad - ref_grad).abs().max().item(),
            "metric_keys": sorted(metrics),
        }
    # drpo's DPPO Binary-TV against verl's own dppo_tv on the same data
    cfg = FSDPActorConfig(strategy="fsdp", clip_ratio=0.15, clip_ratio_low=0.15, clip_ratio_high=0.15, clip_ratio_c=10.0, ppo_micro_batch_size_per_gpu=2, rollout_n=4, ppo_mini_batch_size=8)
    lp = new.clone().requires_grad_()
    verl_loss, _ = core_algos.get_policy_loss_fn("dppo_tv")(old, lp, adv, mask, "seq-mean-token-mean", cfg)
    (verl_grad,) = torch.autograd.grad(verl_loss, lp)
    ours_lp = new.clone().requires_grad_()
    ours = objectives.aggregate(
        objectives.token_loss("dppo_binary_tv", ours_lp, old, adv, delta=0.15, is_cap=10.0, mask=mask.bool()),
        mask.bool(), "seq-mean-token-mean",
    )
    (ours_grad,) = torch.autograd.grad(ours, ours_lp)
    out["dppo_tv"] = {"verl": verl_loss.item(), "ours": ours.item(), "grad_max_diff": (verl_grad - ours_grad).abs().max().item()}
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
