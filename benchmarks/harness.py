"""Shared by the benchmarks: peak-RSS measurement and fresh-subprocess workers.

Peak memory is the rise of the process's resident-set high-water mark (VmHWM, reset through
/proc/self/clear_refs) over its RSS before the measured call.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

MMAP_THRESHOLD = "65536"


def rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak() -> int:
    """Reset VmHWM to the current RSS; returns that RSS in KiB."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return rss_kib("VmRSS")


def peak_mib_since(before_kib: int) -> float:
    return (rss_kib("VmHWM") - before_kib) / 1024


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_worker(module: str, kind: str, spec: dict, mmap_threshold: bool = False) -> dict:
    """Run ``python -m MODULE --worker KIND SPEC`` from the repo root in a fresh interpreter; its
    last stdout line is JSON. (Run as modules: a benchmarks/ folder on sys.path would shadow the
    objectives and learner packages with benchmarks/objectives and benchmarks/learner.)"""
    env = dict(os.environ)
    if mmap_threshold:
        env["MALLOC_MMAP_THRESHOLD_"] = MMAP_THRESHOLD
    cmd = [sys.executable, "-m", module, "--worker", kind, json.dumps(spec)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
        return {"error": f"worker exited {proc.returncode}: {tail[0][:160]}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def interleaved_medians(module: str, kind: str, specs: dict[str, dict], rounds: int, keys: tuple[str, ...]) -> dict[str, dict]:
    """Run every spec once per round, in turn, each in a fresh process; per label, the median of
    ``keys`` over its successful runs, or {"error": ...} when none succeeded."""
    import statistics

    runs: dict[str, list[dict]] = {label: [] for label in specs}
    for _ in range(rounds):
        for label, spec in specs.items():
            runs[label].append(run_worker(module, kind, spec))
    out = {}
    for label, rs in runs.items():
        ok = [r for r in rs if "error" not in r]
        out[label] = {k: statistics.median(r[k] for r in ok) for k in keys} if ok else {"error": rs[-1]["error"]}
    return out
