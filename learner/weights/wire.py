"""The wire format of weight publications: HF-named tensors in size-bounded buckets, tagged with
the policy version.

Rollout engines load weights by Hugging Face name. The learner streams its weights through the
bridge layer by layer and cuts them into buckets of at most ``max_bytes`` (a tensor larger than
the bound travels alone), so neither side holds a second full copy in one message. The same
buckets travel by either transport ``learner.weight_sync`` names: Ray's object store, or the
broadcast group (broadcast.py), on CPU and GPU alike.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch

DEFAULT_BUCKET_BYTES = 512 * 2**20


@dataclass(frozen=True)
class WeightBucket:
    """One slice of a weight publication."""

    version: int
    """Policy version these weights produce; increases by one per optimizer step."""
    index: int
    """Position of this bucket in the publication (0-based)."""
    last: bool
    """True on the publication's final bucket: the engine may swap weights after loading it."""
    tensors: dict[str, torch.Tensor]
    """HF name -> tensor (CPU, contiguous)."""

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def __reduce__(self):
        """Pickled (Ray's object store), each tensor travels as its bytes in a numpy array, which
        pickle protocol 5 carries out of band: Ray copies it into the store once and a consumer's
        ``ray.get`` maps it without a copy. A torch tensor would be copied on both sides (measured
        ~10x slower for a 0.54 GB publication). Any dtype (bf16, fp8) travels as bytes."""
        flat = [(name, str(t.dtype).removeprefix("torch."), tuple(t.shape), t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
                for name, t in self.tensors.items()]
        return _rebuild_bucket, (self.version, self.index, self.last, flat)


def _rebuild_bucket(version: int, index: int, last: bool, flat: list) -> WeightBucket:
    """A WeightBucket from ``__reduce__``'s form: each tensor a view of its received bytes. The
    bytes may be read-only (Ray's object store maps them so); consumers only read them (they copy
    into their own weights), so torch's warning about a non-writable array is silenced."""
    tensors = {}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        for name, dtype, shape, data in flat:
            tensors[name] = torch.from_numpy(data).view(getattr(torch, dtype)).reshape(shape)
    return WeightBucket(version, index, last, tensors)


@dataclass(frozen=True)
class Publication:
    """A published policy version: bucket references (object store) or a broadcast's outcome, and its cost."""

    version: int
    refs: list
    """Object-store refs of the buckets (empty for a broadcast: the buckets went to the group)."""
    nbytes: int
    seconds: float
    error: str | None = None
    """Why a broadcast failed (the group is then gone; the publication did not reach every engine)."""


def buckets(named: Iterable[tuple[str, torch.Tensor]], version: int, max_bytes: int = DEFAULT_BUCKET_BYTES) -> Iterator[WeightBucket]:
    """Group (name, tensor) pairs into WeightBuckets of at most ``max_bytes`` each."""
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    current: dict[str, torch.Tensor] = {}
    size = 0
    index = 0
    pending: WeightBucket | None = None
    for name, tensor in named:
        t = tensor.detach().to("cpu").contiguous()
        nbytes = t.numel() * t.element_size()
        if current and size + nbytes > max_bytes:
            if pending is not None:
                yield pending
            pending = WeightBucket(version, index, False, current)
            index, current, size = index + 1, {}, 0
        current[name] = t
        size += nbytes
    if pending is not None:
        yield pending
    yield WeightBucket(version, index, True, current)


def assemble(received: Iterable[WeightBucket]) -> tuple[int, dict[str, torch.Tensor]]:
    """A consumer's view: check one version, contiguous indices and a final bucket; merge."""
    version, expected, merged, done = None, 0, {}, False
    for b in received:
        if done:
            raise ValueError("bucket after the final bucket of a publication")
        if version is None:
            version = b.version
        if b.version != version or b.index != expected:
            raise ValueError(f"out-of-order bucket: version {b.version} index {b.index}, expected version {version} index {expected}")
        overlap = merged.keys() & b.tensors.keys()
        if overlap:
            raise ValueError(f"tensor published twice: {sorted(overlap)[:3]}")
        merged.update(b.tensors)
        expected, done = expected + 1, b.last
    if not done:
        raise ValueError("publication ended without its final bucket")
    return version, merged
