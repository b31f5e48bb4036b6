"""Combine objective ``Metric``s across micro-batches and data-parallel ranks by their reduction."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from objectives.base import Metric


class MetricAccumulator:
    """Accumulates Metrics by name; ``reduce`` returns floats (histograms as name/bin_i).

    Every value is kept on ``device`` (the learner's: a CUDA learner's data-parallel group is NCCL,
    which reduces CUDA tensors only), whichever device an objective computed a metric on."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._sums: dict[str, list[torch.Tensor]] = {}  # name -> [weighted sum, weight]
        self._max: dict[str, torch.Tensor] = {}
        self._min: dict[str, torch.Tensor] = {}
        self._hist: dict[str, torch.Tensor] = {}

    def add(self, prefix: str, metrics: dict[str, Metric]) -> None:
        for key, m in metrics.items():
            name = prefix + key
            value = m.value.detach().to(self.device, torch.float64)
            zero = torch.zeros((), dtype=torch.float64, device=self.device)
            if m.reduction in ("mean", "quantile"):
                count = m.count.detach().to(self.device, torch.float64) if m.count is not None else zero + 1
                value = torch.nan_to_num(value) * count  # an empty micro-batch contributes nothing
                acc = self._sums.setdefault(name, [zero.clone(), zero.clone()])
                acc[0] += value
                acc[1] += count
            elif m.reduction == "sum":
                acc = self._sums.setdefault(name, [zero.clone(), None])
                acc[0] += value
            elif m.reduction == "max":
                self._max[name] = torch.maximum(self._max[name], value) if name in self._max else value
            elif m.reduction == "min":
                self._min[name] = torch.minimum(self._min[name], value) if name in self._min else value
            elif m.reduction == "histogram":
                self._hist[name] = self._hist[name] + value if name in self._hist else value.clone()

    def reduce(self, group=None) -> dict[str, float]:
        """Final values; with a process group, combined across its ranks first."""
        names = sorted(self._sums)
        weights = [self._sums[n][1] if self._sums[n][1] is not None else torch.ones_like(self._sums[n][0]) for n in names]
        packed = torch.stack([self._sums[n][0] for n in names] + weights) if names else torch.zeros(0, dtype=torch.float64, device=self.device)
        hist_names = sorted(self._hist)
        hists = [self._hist[n] for n in hist_names]
        if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(packed, group=group)
            for h in hists:
                dist.all_reduce(h, group=group)
            for table, op in ((self._max, dist.ReduceOp.MAX), (self._min, dist.ReduceOp.MIN)):
                for v in table.values():
                    dist.all_reduce(v, op=op, group=group)
        out: dict[str, float] = {}
        for i, n in enumerate(names):
            total, weight = packed[i].item(), packed[len(names) + i].item()
            out[n] = total if self._sums[n][1] is None else (total / weight if weight > 0 else math.nan)
        # a max or min over no tokens (an empty lag bucket) is its identity, -inf / +inf: reported as
        # NaN, like the mean of nothing (and metrics.jsonl keeps no infinities)
        out.update({n: math.nan if v.item() == -math.inf else v.item() for n, v in self._max.items()})
        out.update({n: math.nan if v.item() == math.inf else v.item() for n, v in self._min.items()})
        for n, h in zip(hist_names, hists):
            out.update({f"{n}/bin_{i}": c for i, c in enumerate(h.tolist())})
        return out
