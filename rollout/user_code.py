"""User code by import path (``package.module:name``): reward functions, environments, tools."""

from __future__ import annotations

import importlib
from typing import Any, Callable


def load(path: str, field: str, accept: Callable[[Any], bool], what: str) -> Any:
    """The object at ``path`` imported on this process's path; ``field`` (the config key) and
    ``what`` (e.g. "callable", "class with a step method") name it in the error when the module is
    missing or the object is not ``accept``-able."""
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ImportError(
            f"{field}={path!r}: cannot import {module_name!r} ({err}); the module must be on the rollout "
            "workers' Python path (PYTHONPATH for a local run; runtime_env working_dir or py_modules with ray job submit)"
        ) from err
    obj = getattr(module, attr, None)
    if obj is None or not accept(obj):
        raise ImportError(f"{field}={path!r}: {module_name} has no {what} {attr!r}")
    return obj
