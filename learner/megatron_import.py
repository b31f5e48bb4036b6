"""The first import of megatron-core in a process, without two things its import does that the
learner never uses (together ~2 of the ~6.7 CPU-seconds a learner rank's process took to start on a
2-core CPU):

- ``megatron.core.jit`` takes ``torch.compile`` as its fusion decorator, and decorating a function
  with it imports torch._dynamo and torch._inductor (~1.8 s on a 2-core EPYC). Here the
  decorator compiles on a function's first call instead, which is ``torch.compile``'s own
  behaviour (it compiles lazily too); only the import moves to that call, and the fused functions
  the learner's layers do not call are never compiled, as before.
- Its timers and its inference context import wandb when it is installed (~0.7 s), for logging
  of their own; drpo's trackers run in the driver. While megatron-core imports, ``import wandb``
  fails (each of megatron's wandb imports catches the ImportError), and the process can import
  wandb afterwards.

``learner.distributed.init`` calls ``load`` first, so every learner process goes through it."""

from __future__ import annotations

import functools
import sys

import torch


def load() -> None:
    """Import megatron.core (idempotent: nothing to do once it is imported)."""
    if "megatron.core" in sys.modules:
        return
    compile_now = torch.compile
    torch.compile = functools.partial(_compile_on_first_call, compile_now)  # type: ignore[assignment]
    blocked = "wandb" not in sys.modules
    if blocked:
        sys.modules["wandb"] = None  # type: ignore[assignment]  # `import wandb` raises ImportError
    try:
        import megatron.core  # noqa: F401
    finally:
        torch.compile = compile_now  # type: ignore[assignment]
        if blocked:
            del sys.modules["wandb"]


def _compile_on_first_call(compile_now, model=None, **options):
    """``torch.compile(fn, **options)`` for a function, or the decorator ``torch.compile(**options)``,
    whose compiling (and importing torch._dynamo) waits for the first call; a module is compiled
    as ``torch.compile`` does it."""
    if model is None:
        return lambda fn: _compile_on_first_call(compile_now, fn, **options)
    if isinstance(model, torch.nn.Module):
        return compile_now(model, **options)
    compiled = None

    @functools.wraps(model)
    def call(*args, **kwargs):
        nonlocal compiled
        if compiled is None:
            compiled = compile_now(model, **options)
        return compiled(*args, **kwargs)

    return call
