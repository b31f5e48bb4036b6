"""Chaos soak: one long async run with many faults, watched.

    python -m benchmarks.soak.run                  # about 15 minutes on a 2-core machine
    python -m benchmarks.soak.run --minutes 120    # longer: hundreds of steps

A multi-node Ray cluster on this machine (ray.cluster_utils: a learner node and three rollout
nodes), the experiments' stand-in model, `drpo train`'s own code (controller.app.train), async with
η = 2 and three rollout workers. Faults, all in one run: rollout workers killed at random intervals
(Ray restarts them), the learner's node removed once (the run stops with LearnerLost; a replacement
node joins and the run resumes from its last checkpoint), bad engine output and failing rewards
(chaos), malformed dataset rows. The run ends by a stop request at the deadline (the path SIGTERM
takes), which writes the last checkpoint. Watched meanwhile: every actor's RSS (by pid, so a
restarted worker is a new series), the run folder's size, and the Prometheus endpoint under 10
scrapes a second. Reported: faults survived, samples lost and counted twice (from the ledger of the
last checkpoint: both must be 0), RSS slope per 100 steps, folder size, scrape latency.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import signal
import socket
import statistics
import threading
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).parent
ROLES = {"ray::RolloutWorker": "rollout", "ray::LearnerWorker": "learner"}
SAMPLE_SECONDS = 5.0
SCRAPES_PER_SECOND = 10


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_dataset(folder: Path) -> tuple[Path, Path]:
    """Training rows with malformed ones mixed in (skipped and reported by the loader), and a test file."""
    from rollout.tasks import arithmetic_split

    rows = [json.dumps({"id": p.id, "prompt": p.prompt, "answer": p.ground_truth}) for p in arithmetic_split("train", 512)]
    bad = ["{not json", json.dumps({"prompt": "What is 2+2?"}), json.dumps({"prompt": "  ", "answer": "1"}), json.dumps(["a list"])]
    for i, line in enumerate(bad):
        rows.insert(50 * (i + 1), line)
    train, test = folder / "train.jsonl", folder / "test.jsonl"
    train.write_text("\n".join(rows) + "\n")
    test.write_text("\n".join(json.dumps({"id": p.id, "prompt": p.prompt, "answer": p.ground_truth}) for p in arithmetic_split("test", 32)) + "\n")
    return train, test


def soak_config(run_dir: Path, model: Path, train: Path, test: Path, port: int, seed: int):
    from controller.config import RunConfig

    return RunConfig.model_validate({
        "run_dir": str(run_dir), "seed": seed, "model": {"path": str(model)},
        "task": {"type": "dataset", "train_path": str(train), "test_path": str(test)},
        "rollout": {
            "workers": 3, "cpus_per_worker": 1, "samples_per_prompt": 4, "max_new_tokens": 4, "max_batch_prompts": 4,
            "max_restarts": 10_000, "chaos": {"nan_logp_rate": 0.03, "empty_response_rate": 0.03, "reward_error_rate": 0.03, "seed": seed},
        },
        "learner": {"optimizer": {"lr": 1e-4}, "objective": {"type": "drpo", "delta": 0.2}},
        "train": {"steps": 1_000_000, "prompts_per_step": 4, "mode": "async", "max_staleness": 2},
        "advantages": {"filter_zero_variance": False},
        "eval": {"every": 50, "at_start": False}, "checkpoint": {"every": 10, "keep": 2},
        "metrics": {"port": port, "progress": False},
    })


class Progress:
    """The run's latest step, read incrementally from metrics.jsonl (steps continue across a resume)."""

    def __init__(self, run_dir: Path):
        self.path, self.offset, self.step, self.lost_events = run_dir / "metrics.jsonl", 0, 0, 0

    def poll(self) -> int:
        if self.path.is_file():
            with self.path.open() as f:
                f.seek(self.offset)
                for line in f:
                    if not line.endswith("\n"):
                        break
                    self.offset += len(line.encode())
                    record = json.loads(line)
                    if record.get("kind") == "step":
                        self.step = record["step"]
                    elif record.get("kind") == "worker" and record.get("event") == "lost":
                        self.lost_events += 1
        return self.step


def sample_rss(progress: Progress, samples: list[dict], done: threading.Event) -> None:
    import os

    import psutil

    me = os.getpid()
    while not done.wait(SAMPLE_SECONDS):
        step, now = progress.poll(), time.time()
        for p in psutil.process_iter(["pid", "cmdline", "memory_info"]):
            cmd = " ".join(p.info["cmdline"] or [])
            role = "driver" if p.info["pid"] == me else next((r for prefix, r in ROLES.items() if cmd.startswith(prefix)), None)
            if role and p.info["memory_info"]:
                samples.append({"t": now, "step": step, "pid": p.info["pid"], "role": role, "rss_mib": p.info["memory_info"].rss / 2**20})


def scrape(port: int, latencies: list[float], errors: list[str], done: threading.Event) -> None:
    url = f"http://127.0.0.1:{port}/metrics"
    while not done.wait(1 / SCRAPES_PER_SECOND):
        began = time.perf_counter()
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                r.read()
            latencies.append(time.perf_counter() - began)
        except OSError as err:  # refused while no session serves (start-up, the learner-loss gap)
            errors.append(type(getattr(err, "reason", err)).__name__)


def kill_workers(state: dict, kills: list[dict], done: threading.Event, rng: random.Random, mean_gap: float) -> None:
    import ray

    while not done.wait(rng.uniform(0.5, 1.5) * mean_gap):
        backend = state.get("backend")
        if backend is None or state.get("pause"):
            continue
        worker = rng.randrange(backend.workers)
        try:
            ray.kill(backend.actors[worker], no_restart=False)  # Ray restarts it; the run re-queues its prompts
            kills.append({"t": time.time(), "worker": worker})
        except Exception as err:  # the backend is being shut down
            kills.append({"t": time.time(), "worker": worker, "error": type(err).__name__})


MIN_SPAN_STEPS = 100
"""A process's RSS series gets a slope only if its second half spans this many steps (a restarted
worker's first minutes are warm-up, not growth)."""


def slope_per_100_steps(points: list[tuple[int, float]]) -> float | None:
    """Least-squares MiB per 100 steps over a series' second half (after warm-up), None if too short."""
    points = points[len(points) // 2 :]
    steps = [s for s, _ in points]
    if len(points) < 5 or max(steps) - min(steps) < MIN_SPAN_STEPS:
        return None
    ms, mr = statistics.fmean(steps), statistics.fmean(r for _, r in points)
    var = sum((s - ms) ** 2 for s in steps)
    return 100 * sum((s - ms) * (r - mr) for s, r in points) / var


def rss_report(samples: list[dict]) -> dict:
    by_role: dict[str, dict] = {}
    series: dict[tuple[str, int], list[tuple[int, float]]] = {}
    for s in samples:
        series.setdefault((s["role"], s["pid"]), []).append((s["step"], s["rss_mib"]))
    for (role, _), points in series.items():
        r = by_role.setdefault(role, {"processes": 0, "max_rss_mib": 0.0, "slopes": []})
        r["processes"] += 1
        r["max_rss_mib"] = max(r["max_rss_mib"], max(v for _, v in points))
        slope = slope_per_100_steps(points)
        if slope is not None:
            r["slopes"].append(slope)
            r.setdefault("longest", []).append((points[-1][0] - points[0][0], points[0][1], points[len(points) // 2][1], points[-1][1]))
    for r in by_role.values():
        slopes = r.pop("slopes")
        r["slope_mib_per_100_steps_max"] = max(slopes) if slopes else None
        r["slope_mib_per_100_steps_median"] = statistics.median(slopes) if slopes else None
        r["series_with_a_slope"] = len(slopes)
        if r.get("longest"):
            span, first, middle, last = max(r.pop("longest"))
            r["longest_series"] = {"steps": span, "rss_mib_first": first, "rss_mib_middle": middle, "rss_mib_last": last}
    return by_role


def folder_mib(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 2**20


def run_session(cfg, state: dict, resume: bool, stop) -> object:
    from controller.app import train
    from controller.ray_backend import RayBackend

    state["backend"] = backend = RayBackend.build(cfg)
    try:
        return train(cfg, resume=resume, backend=backend, stop=stop)
    finally:
        state["backend"] = None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=13.0, help="training time (start-up not counted)")
    parser.add_argument("--kill-every", type=float, default=45.0, help="mean seconds between rollout worker kills")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(HERE / "results"))
    args = parser.parse_args()

    from controller.network import prepare

    prepare()  # a cluster on loopback, quiet, with token auth: before Ray is imported
    import ray
    from ray.cluster_utils import Cluster

    from benchmarks.experiments.standin import build_standin
    from controller.backend import LearnerLost
    from controller.ledger import audit
    from controller.checkpoints import latest_checkpoint
    from controller.stop import StopRequest
    from rollout.offline_model import materialize_smollm2
    from rollout.tasks import load_dataset

    out = Path(args.out)
    shutil.rmtree(out / "run", ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    model = build_standin(Path.home() / ".cache" / "drpo" / "standin", materialize_smollm2())
    train_path, test_path = write_dataset(out)
    port = free_port()
    cfg = soak_config(out / "run", model, train_path, test_path, port, args.seed)

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    nodes = [cluster.add_node(num_cpus=1) for _ in range(4)]  # the learner takes one, three rollout workers the rest
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)

    progress, samples, latencies, errors, kills = Progress(out / "run"), [], [], [], []
    done, state, rng = threading.Event(), {}, random.Random(args.seed)
    threads = [
        threading.Thread(target=sample_rss, args=(progress, samples, done), daemon=True),
        threading.Thread(target=scrape, args=(port, latencies, errors, done), daemon=True),
        threading.Thread(target=kill_workers, args=(state, kills, done, rng, args.kill_every), daemon=True),
    ]
    for t in threads:
        t.start()
    began = time.time()
    deadline = began + 60 * args.minutes
    learner_loss_at = began + 0.4 * 60 * args.minutes
    stop = StopRequest()

    def stop_at_deadline():
        while time.time() < deadline or not stop.graceful:
            time.sleep(1)
        stop.request(signal.SIGTERM)  # what `ray job stop` sends; the run winds down and checkpoints

    def lose_the_learner_node():
        while time.time() < learner_loss_at or latest_checkpoint(out / "run") is None:
            time.sleep(1)
        placement = next(json.loads(line) for line in (out / "run" / "metrics.jsonl").open() if '"placement"' in line)
        victim = next(n for n in nodes if n.node_id in placement["learner"])
        state["pause"] = True
        cluster.remove_node(victim, allow_graceful=False)

    threading.Thread(target=lose_the_learner_node, daemon=True).start()
    threading.Thread(target=stop_at_deadline, daemon=True).start()
    sessions, learner_losses = 0, 0
    try:
        resume = False
        while True:
            sessions += 1
            try:
                result = run_session(cfg, state, resume, stop)
                break
            except LearnerLost as err:
                learner_losses += 1
                print(f"soak: {err}", flush=True)
                nodes.append(cluster.add_node(num_cpus=1))  # a replacement node
                cluster.wait_for_nodes()
                state["pause"], resume = False, True
    finally:
        done.set()
        ray.shutdown()
        cluster.shutdown()

    checkpoint = latest_checkpoint(out / "run")
    ledger_state = json.loads((checkpoint / "controller.json").read_text())
    ids = [p.id for p in load_dataset(train_path).problems]
    counts = audit(ledger_state, ids, cfg.seed)
    lines = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    failed = [e["reason"] for e in ledger_state["ledger"] if e["outcome"] == "failed"]
    skipped = sum(len(r["skipped"]) for r in lines if r["kind"] == "dataset")
    ms = sorted(1000 * v for v in latencies)
    report = {
        "minutes": (time.time() - began) / 60, "steps": ledger_state["step"], "sessions": sessions, "stopped_by": result.stopped_by,
        "faults": {
            "rollout_worker_kills": sum("error" not in k for k in kills), "worker_lost_events": progress.lost_events,
            "learner_node_losses_resumed": learner_losses, "failed_groups": len(failed),
            "failed_nan_mu": sum("NaN or inf" in r for r in failed), "failed_every_response_empty": sum("every response is empty" in r for r in failed),
            "dataset_rows_skipped_per_session": skipped // max(1, sessions),
        },
        "ledger": counts,
        "rss": rss_report(samples),
        "run_folder_mib": folder_mib(out / "run"),
        "metrics_jsonl_kib_per_100_steps": (out / "run" / "metrics.jsonl").stat().st_size / 1024 / max(1, ledger_state["step"]) * 100,
        "scrapes": {
            "ok": len(ms), "refused_or_failed": len(errors),
            "p50_ms": ms[len(ms) // 2] if ms else None, "p99_ms": ms[int(len(ms) * 0.99)] if ms else None, "max_ms": ms[-1] if ms else None,
        },
    }
    (out / "soak.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "rss.jsonl").write_text("".join(json.dumps(x) + "\n" for x in samples))
    print(json.dumps(report, indent=2))
    if counts["lost"] or counts["double_counted"] or counts["phantom"]:
        raise SystemExit(f"soak: the ledger is not exact: {counts}")


if __name__ == "__main__":
    main()
