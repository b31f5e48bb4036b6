"""What a local run puts on the network (controller/network.py): a real `drpo train` (tiny chat Llama,
weight broadcast, local Ray started by the driver) under strace: every socket any process of the run
binds is on loopback, every listening socket of its process tree (found by pid) is on loopback, the
Ray node is 127.0.0.1, Ray's processes carry RAY_USAGE_STATS_ENABLED=0, and no process connects to
an address off this machine. The one packet that leaves is named and checked: torch's TCPStore asks
the system resolver for the name of the IPv4-mapped loopback address it connects to (glibc's hosts
file does not list that form), a PTR query for 1.0.0.127.in-addr.arpa."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from datetime import timedelta

import psutil
import pytest
import yaml

from controller.network import LOCAL_ENV, QUIET_ENV, is_loopback
from tests.test_controller_e2e import records, run_config
from tests.test_faults import REPO

CONNECT = re.compile(r'^(\d+)\s+connect\((\d+), \{sa_family=AF_INET6?, sin6?_port=htons\((\d+)\), (?:sin6_flowinfo=htonl\(\d+\), )?(?:sin_addr=inet_addr|inet_pton)\((?:AF_INET6, )?"([^"]+)"')
BIND = re.compile(r'^(\d+)\s+bind\(\d+, \{sa_family=AF_INET6?, sin6?_port=htons\((\d+)\), (?:sin6_flowinfo=htonl\(\d+\), )?(?:sin_addr=inet_addr|inet_pton)\((?:AF_INET6, )?"([^"]+)"')
SEND = re.compile(r'^(\d+)\s+send(?:to|mmsg)\((\d+), (.*)$')
LOOPBACK_PTR = re.compile(r'\\0011\\0010\\0010\\003127\\7in-addr\\4arpa\\0\\0\\f')
"""The DNS question 1.0.0.127.in-addr.arpa PTR, as strace prints it."""


def loopback(address: str) -> bool:
    return is_loopback(address)


def test_loopback_addresses():
    assert loopback("127.0.0.1") and loopback("::1") and loopback("::ffff:127.0.0.1") and is_loopback("::ffff:127.0.0.1")
    assert not loopback("0.0.0.0") and not loopback("::") and not loopback("192.0.2.2") and not loopback("::ffff:10.0.0.1")


def listening(pid: int) -> set[str]:
    out = set()
    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return out
    for p in procs:
        try:
            out |= {f"{c.laddr.ip}:{c.laddr.port} ({p.name()})" for c in p.net_connections("inet") if c.status == psutil.CONN_LISTEN}
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return out


def ray_processes(pid: int) -> dict[int, tuple[str, dict]]:
    """pid -> (command line, environment) of the Ray daemons under ``pid``."""
    out = {}
    for p in psutil.Process(pid).children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
            if "raylet" in cmd or "gcs_server" in cmd:
                out[p.pid] = (cmd, p.environ())
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return out


@pytest.mark.ray
@pytest.mark.engine
@pytest.mark.slow
def test_a_local_run_binds_listens_and_connects_on_loopback_only(tiny_chat_model, tmp_path):
    assert shutil.which("strace"), "strace is missing (scripts/setup.sh installs Debian's strace)"
    cfg = run_config(tmp_path, tiny_chat_model, steps=2)
    data = cfg.model_dump(mode="json")
    data["learner"]["weight_sync"] = "broadcast"  # the broadcast group's rendezvous store too
    data["checkpoint"]["every"] = 0
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(data))
    # a user's shell: none of what drpo sets for itself
    env = {k: v for k, v in os.environ.items() if k not in {*QUIET_ENV, *LOCAL_ENV, "RAY_ADDRESS", "RAY_AUTH_TOKEN", "GLOO_SOCKET_IFNAME"}}
    trace = tmp_path / "strace.txt"
    driver = subprocess.Popen(
        ["strace", "-f", "--seccomp-bpf", "-qq",  # --seccomp-bpf: only the traced calls stop a process (ptrace on every call slowed the run)
         "-s", "100", "-e", "trace=connect,bind,sendto,sendmmsg", "-o", str(trace),
         sys.executable, "-m", "controller.cli", "train", "--config", str(config)],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    listeners, daemons = set(), {}
    while driver.poll() is None:
        listeners |= listening(driver.pid)
        try:
            daemons.update(ray_processes(driver.pid))
        except psutil.NoSuchProcess:
            pass
        time.sleep(0.3)
    out, err = driver.communicate()
    assert driver.returncode == 0, err[-3000:]
    assert [s["step"] for s in records(tmp_path / "run", "step")] == [1, 2]

    assert listeners and all(loopback(s.split(" ")[0].rsplit(":", 1)[0]) for s in listeners), sorted(listeners)
    raylets = [cmd for cmd, _ in daemons.values() if "raylet" in cmd]
    assert raylets and all("--node-ip-address=127.0.0.1" in cmd or "--node_ip_address=127.0.0.1" in cmd for cmd in raylets), raylets
    assert daemons and all(e.get("RAY_USAGE_STATS_ENABLED") == "0" and e.get("RAY_AUTH_MODE") == "token" for _, e in daemons.values())

    lines = trace.read_text(errors="replace").splitlines()
    binds = [m.groups() for m in map(BIND.match, lines) if m]
    assert binds and all(loopback(addr) for _, _, addr in binds), sorted({addr for _, _, addr in binds if not loopback(addr)})
    outside, asked = [], {}  # asked: (pid, fd) of a DNS socket -> what the next send on it must be
    for line in lines:
        if m := CONNECT.match(line):
            pid, fd, port, addr = m.groups()
            if loopback(addr):
                continue
            if port == "53":
                asked[(pid, fd)] = addr  # judged by the query it sends
            else:
                outside.append(f"pid {pid}: {addr}:{port}")
        elif (m := SEND.match(line)) and (m[1], m[2]) in asked:
            addr = asked.pop((m[1], m[2]))
            if not LOOPBACK_PTR.search(m[3]):  # TCPStore naming its own loopback peer is the one exception (module docstring)
                outside.append(f"pid {m[1]}: DNS {addr} {m[3][:100]}")
    outside += [f"pid {pid}: DNS {addr}, nothing sent" for (pid, _), addr in asked.items()]
    assert not outside, outside


def test_a_rendezvous_store_listens_on_its_address_only():
    from learner import distributed
    from learner.weights.broadcast import WeightBroadcastGroup

    def listening() -> set:  # this process's listeners (a Ray cluster an earlier test module kept has its own)
        return {c.laddr for c in psutil.Process().net_connections("inet") if c.status == psutil.CONN_LISTEN}

    before = listening()
    store = distributed.rendezvous("127.0.0.1", 0, 1, 0, timedelta(seconds=10))
    mine = listening() - before
    assert mine and all(a.ip == "127.0.0.1" for a in mine), mine
    del store
    group = WeightBroadcastGroup("127.0.0.1", 0, 0, 1, timeout_s=10)
    mine = listening() - before
    assert mine and all(a.ip == "127.0.0.1" for a in mine), mine  # the store and gloo's pair listener
    group.close()


def test_a_local_cluster_after_ray_was_imported_is_refused_by_name():
    env = {k: v for k, v in os.environ.items() if k not in {*LOCAL_ENV, "RAY_ADDRESS"}}
    done = subprocess.run(
        [sys.executable, "-c", "import ray\nfrom controller.network import init_ray\ninit_ray()"], cwd=REPO, env=env,
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode != 0 and "NetworkError" in done.stderr and "imported before" in done.stderr, done.stderr[-2000:]


def test_prepare_sets_the_quiet_and_local_environment_and_keeps_what_the_user_set(monkeypatch):
    from controller import network

    for key in (*QUIET_ENV, *LOCAL_ENV, "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("DO_NOT_TRACK", "yes")
    assert network.prepare(None) is True
    assert os.environ["RAY_USAGE_STATS_ENABLED"] == "0" and os.environ["VLLM_NO_USAGE_STATS"] == "1"
    assert os.environ["RAY_AUTH_MODE"] == "token" and len(os.environ["RAY_AUTH_TOKEN"]) == 64
    assert os.environ["DO_NOT_TRACK"] == "yes"  # the user's value stays
    for key in (*LOCAL_ENV, "RAY_AUTH_TOKEN"):
        monkeypatch.delenv(key, raising=False)
    assert network.prepare("ray://head:10001") is False
    assert "RAY_AUTH_MODE" not in os.environ and "VLLM_HOST_IP" not in os.environ  # a cluster's nodes bring their own
