"""glibc's allocator, told to keep freed memory for reuse in the CPU processes that train or generate.

By default glibc serves every allocation above its mmap threshold (at most 32 MiB) with a fresh
``mmap`` and returns it to the kernel on free. A learner step on CPU allocates and frees tensors of
hundreds of MiB (the logits of a micro-batch over a 49,152-token vocabulary are ~250 MiB), so every
step faults its pages in again: 0.3–0.8 s per GiB on the 2-core machines measured here, against
~0.05 s per GiB to touch memory already mapped. ``keep_freed_memory`` makes large allocations come
from the heap (``M_MMAP_MAX`` 0) and stops trimming it (``M_TRIM_THRESHOLD``), so a step reuses the
pages of the one before. The process's resident size stays at its high-water mark instead of
falling between steps. Measured with ``python -m benchmarks.learner.run --only heap``.
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
KEEP = 2**31 - 1
"""M_TRIM_THRESHOLD (an int): up to ~2 GiB of free memory at the top of the heap stays mapped."""


def keep_freed_memory() -> bool:
    """Large allocations from the heap, and the heap not trimmed, in this process (glibc); False
    where the C library has no ``mallopt`` (musl) or refuses a setting."""
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(libc.mallopt(M_TRIM_THRESHOLD, KEEP)) and bool(libc.mallopt(M_MMAP_MAX, 0))
