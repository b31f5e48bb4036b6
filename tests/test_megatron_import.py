"""learner/megatron_import.py in a fresh process: megatron-core imports without torch._dynamo,
torch._inductor and wandb, torch.compile is torch's own again afterwards, wandb still imports, and
megatron's fusion decorator is torch.compile deferred to a function's first call (a recording
compiler stands in to show when)."""

from __future__ import annotations

import json
import subprocess
import sys

CHECK = r"""
import json, sys
import torch
from learner import megatron_import

real = torch.compile
megatron_import.load()
after = {name: name in sys.modules for name in ("torch._dynamo", "torch._inductor", "wandb")}
restored = torch.compile is real
import functools
import megatron.core.jit as jit

wired = isinstance(jit.jit_fuser, functools.partial) and jit.jit_fuser.func is megatron_import._compile_on_first_call \
    and jit.jit_fuser.args == (real,)  # megatron's decorator defers torch's own compile
calls = []
fuser = functools.partial(jit.jit_fuser.func, lambda fn, **options: calls.append(fn.__name__) or fn)  # a recording compiler
@fuser
def double(x):
    return 2 * x
before_call = list(calls)
result = double(3), double(4)
try:
    import wandb  # noqa: F401
    wandb_imports = True
except ImportError as err:
    wandb_imports = "halted" not in str(err)  # not installed is fine; blocked is not
print(json.dumps({"after": after, "restored": restored, "wired": wired, "before_call": before_call, "calls": calls, "result": result,
                  "wandb_imports": wandb_imports}))
"""


def test_megatron_core_imports_without_dynamo_or_wandb_and_compiles_on_first_call():
    done = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["after"] == {"torch._dynamo": False, "torch._inductor": False, "wandb": False}
    assert seen["restored"] and seen["wired"] and seen["wandb_imports"]
    assert seen["before_call"] == [] and seen["calls"] == ["double"] and seen["result"] == [6, 8]  # compiled once, at the first call
