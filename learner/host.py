"""The driver may have no GPU: what learner ranks return to it lives on the host.

``to_host`` moves every tensor of a result (bare, in dicts, lists, tuples or dataclasses such as
TokenLogProbs) to the CPU on the rank, before Ray serializes it; ``check_host`` is the driver's side
of the boundary and refuses, by call name, a result that still holds a tensor anywhere else (a
CUDA tensor would make Ray deserialize it onto a GPU the driver may not have).
"""

from __future__ import annotations

import dataclasses

import torch


def to_host(value):
    """``value`` with every tensor in it on the CPU (detached); other values as they are."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: to_host(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_host(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{f.name: to_host(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init})
    return value


def off_host(value, path: str = "") -> list[str]:
    """Where in ``value`` a tensor lives on a device other than the CPU (paths like ``.logp``)."""
    if isinstance(value, torch.Tensor):
        return [] if value.device.type == "cpu" else [f"{path or 'the value'} on {value.device}"]
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in off_host(v, f"{path}[{k!r}]")]
    if isinstance(value, (list, tuple)):
        return [p for i, v in enumerate(value) for p in off_host(v, f"{path}[{i}]")]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [p for f in dataclasses.fields(value) for p in off_host(getattr(value, f.name), f"{path}.{f.name}")]
    return []


def check_host(value, call: str):
    """``value`` if it holds no off-host tensor, else a RuntimeError naming ``call`` and where."""
    where = off_host(value)
    if where:
        raise RuntimeError(f"learner {call} returned tensors off the host ({', '.join(where[:3])}); ranks must return CPU tensors (learner/host.py)")
    return value
