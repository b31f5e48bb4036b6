"""A real Prometheus server for tests (the Debian package, installed by scripts/setup.sh)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import yaml

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"


def prometheus_binary() -> str:
    found = shutil.which("prometheus")
    if found is None:
        raise RuntimeError("the prometheus binary is missing; scripts/setup.sh installs it (apt-get install prometheus)")
    return found


class Prometheus:
    """deploy/prometheus/prometheus.yml with the drpo target replaced, 1 s scrapes, on loopback."""

    def __init__(self, folder: Path, drpo_target: str, port: int):
        config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
        config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
        config["rule_files"] = [str(DEPLOY / "prometheus" / "alerts.yml")]
        for job in config["scrape_configs"]:
            if job["job_name"] == "drpo":
                job["static_configs"] = [{"targets": [drpo_target]}]
        path = folder / "prometheus.yml"
        path.write_text(yaml.safe_dump(config))
        self.url = f"http://127.0.0.1:{port}"
        self.log = (folder / "prometheus.log").open("w")
        self.proc = subprocess.Popen(
            [prometheus_binary(), f"--config.file={path}", f"--storage.tsdb.path={folder / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{port}"],
            stdout=self.log, stderr=subprocess.STDOUT,
        )
        deadline = time.time() + 60
        while True:
            try:
                if urllib.request.urlopen(f"{self.url}/-/ready", timeout=2).status == 200:
                    break
            except OSError:
                pass
            if time.time() > deadline or self.proc.poll() is not None:
                raise RuntimeError(f"prometheus did not start: {(folder / 'prometheus.log').read_text()[-2000:]}")
            time.sleep(0.5)

    def api(self, path: str, **params) -> dict:
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=30) as r:
            body = json.load(r)
        if body.get("status") != "success":
            raise AssertionError(f"{path} {params}: {body}")
        return body["data"]

    def query(self, expr: str, at: float) -> list:
        return self.api("query", query=expr, time=f"{at:.3f}")["result"]

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def with_bool(expr: str) -> str:
    """``lhs OP scalar`` -> ``lhs OP bool scalar``: the alert's expression, returning 0/1 instead of
    filtering, so it must return data whether or not the alert would fire."""
    match = re.fullmatch(r"(.*\S)\s*(>=|<=|==|!=|>|<)\s*([-+0-9.e]+)", expr.strip(), flags=re.S)
    if match is None:
        raise ValueError(f"alert expression is not 'lhs OP scalar': {expr}")
    return f"{match.group(1)} {match.group(2)} bool {match.group(3)}"


def dashboard_queries() -> list[tuple[str, str, str]]:
    """(dashboard file, panel title, PromQL) for every target of every dashboard."""
    out = []
    for path in sorted((DEPLOY / "grafana" / "dashboards").glob("*.json")):
        for panel in json.loads(path.read_text())["panels"]:
            out += [(path.name, panel["title"], t["expr"]) for t in panel["targets"]]
    return out


def alert_rules() -> list[dict]:
    groups = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())["groups"]
    return [rule for g in groups for rule in g["rules"]]
