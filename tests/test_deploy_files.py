"""deploy/: the runtime envs and the RayJob manifest parse and name entry points that exist; the
dashboards are valid Grafana dashboard JSON and match their generator; the Prometheus files parse."""

from __future__ import annotations

import json
import re
import shlex
import tomllib
from pathlib import Path

import pytest
import yaml

from controller.config import load_config
from deploy import dashboards

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"


def _module_exists(module: str) -> bool:
    return (REPO / (module.replace(".", "/") + ".py")).is_file()


def _check_entrypoint(command: str) -> None:
    """``python -m MODULE train --config FILE``: the module and the config file exist, the config loads."""
    argv = shlex.split(command)
    assert argv[0] in ("python", "python3") and argv[1] == "-m" and _module_exists(argv[2]), command
    assert argv[3] == "train"
    config = argv[argv.index("--config") + 1]
    load_config(REPO / config)


@pytest.mark.parametrize("name", ["runtime_env.yaml", "runtime_env.local.yaml"])
def test_runtime_envs_parse(name):
    env = yaml.safe_load((DEPLOY / name).read_text())
    assert set(env) <= {"working_dir", "excludes", "pip", "env_vars", "py_modules", "conda", "container"}
    assert env["working_dir"] == "." and ".venv" in env["excludes"]
    assert all(isinstance(v, str) for v in env["env_vars"].values())  # Ray requires string values


def test_submit_script_runs_the_cli_module_with_the_cluster_preset():
    script = (DEPLOY / "submit.sh").read_text()
    assert '-m controller.cli train "$@"' in script and _module_exists("controller.cli")
    assert "--config controller/presets/cluster-gpu.yaml" in script
    load_config(REPO / "controller/presets/cluster-gpu.yaml")


def test_rayjob_manifest_has_learner_and_rollout_groups_and_a_real_entrypoint():
    job = yaml.safe_load((DEPLOY / "kuberay" / "rayjob.yaml").read_text())
    assert job["apiVersion"] == "ray.io/v1" and job["kind"] == "RayJob"
    _check_entrypoint(job["spec"]["entrypoint"])
    yaml.safe_load(job["spec"]["runtimeEnvYAML"])
    cluster = job["spec"]["rayClusterSpec"]
    groups = {g["groupName"]: g for g in cluster["workerGroupSpecs"]}
    assert set(groups) == {"learner", "rollout"}
    for g in groups.values():
        (container,) = g["template"]["spec"]["containers"]
        assert int(container["resources"]["limits"]["nvidia.com/gpu"]) >= 1
    assert cluster["headGroupSpec"]["template"]["spec"]["containers"][0]["image"]


def test_every_rayjob_pod_mounts_the_shared_claim_that_holds_the_cluster_presets_run_dir():
    job = yaml.safe_load((DEPLOY / "kuberay" / "rayjob.yaml").read_text())
    claim = yaml.safe_load((DEPLOY / "kuberay" / "shared-storage.yaml").read_text())
    assert claim["kind"] == "PersistentVolumeClaim" and claim["spec"]["accessModes"] == ["ReadWriteMany"]
    run_dir = load_config(REPO / "controller/presets/cluster-gpu.yaml").run_dir
    cluster = job["spec"]["rayClusterSpec"]
    pods = [cluster["headGroupSpec"]["template"]["spec"]] + [g["template"]["spec"] for g in cluster["workerGroupSpecs"]]
    for pod in pods:
        volumes = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"]}
        (container,) = pod["containers"]
        mounts = [m for m in container["volumeMounts"] if volumes.get(m["name"]) == claim["metadata"]["name"]]
        assert any(run_dir.startswith(m["mountPath"].rstrip("/") + "/") for m in mounts), container["name"]
    env = yaml.safe_load(job["spec"]["runtimeEnvYAML"])["env_vars"]
    assert int(env["RAY_JOB_STOP_WAIT_TIME_S"]) > load_config(REPO / "controller/presets/cluster-gpu.yaml").train.stop_grace_seconds
    for name in ("runtime_env.yaml", "runtime_env.local.yaml"):
        assert int(yaml.safe_load((DEPLOY / name).read_text())["env_vars"]["RAY_JOB_STOP_WAIT_TIME_S"]) > 120


def _pods(job: dict) -> dict[str, dict]:
    """Every pod template of the RayJob by role: head, each worker group, the job submitter."""
    cluster = job["spec"]["rayClusterSpec"]
    return {"head": cluster["headGroupSpec"]["template"], **{g["groupName"]: g["template"] for g in cluster["workerGroupSpecs"]},
            "submitter": job["spec"]["submitterPodTemplate"]}


def test_the_rayjob_is_safe_on_a_shared_cluster():
    job = yaml.safe_load((DEPLOY / "kuberay" / "rayjob.yaml").read_text())
    cluster, spec = job["spec"]["rayClusterSpec"], job["spec"]
    major, minor, *_ = map(int, cluster["rayVersion"].split("."))
    assert cluster["authOptions"] == {"mode": "token"} and (major, minor) >= (2, 52)  # token auth: Ray 2.52+
    assert int(spec["activeDeadlineSeconds"]) > 0
    preset = load_config(REPO / "controller/presets/cluster-gpu.yaml")
    stop_wait = int(yaml.safe_load(spec["runtimeEnvYAML"])["env_vars"]["RAY_JOB_STOP_WAIT_TIME_S"])
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    assert all(g["rayStartParams"].get("disable-usage-stats") == "true" for g in groups)
    label = job["metadata"]["labels"]["drpo/job"]
    for role, pod in _pods(job).items():
        assert pod["metadata"]["labels"]["drpo/job"] == label, role  # what the NetworkPolicy selects
        for container in pod["spec"]["containers"]:
            image = container["image"]
            assert re.fullmatch(r"[^@\s]+@sha256:[0-9a-f]{64}", image) and ":latest" not in image, (role, image)  # pinned by digest
            env = {e["name"]: e.get("value") for e in container.get("env", [])}
            assert env.get("RAY_USAGE_STATS_ENABLED") == "0" and env.get("DO_NOT_TRACK") == "1", role
        if role != "submitter":
            # an eviction must leave room for the graceful stop (grace + a checkpoint) that `ray job stop` gets
            assert pod["spec"]["terminationGracePeriodSeconds"] >= stop_wait > preset.train.stop_grace_seconds, role
    assert "working_dir" not in yaml.safe_load(spec["runtimeEnvYAML"])  # the checkout comes with the pinned image, not a mutable archive
    ports = {p["containerPort"] for p in cluster["headGroupSpec"]["template"]["spec"]["containers"][0]["ports"]}
    assert preset.metrics.host == "127.0.0.1" and preset.metrics.port not in ports  # drpo's metrics stay in the pod


def test_the_network_policy_admits_only_the_jobs_pods_and_the_operator():
    job = yaml.safe_load((DEPLOY / "kuberay" / "rayjob.yaml").read_text())
    policy = yaml.safe_load((DEPLOY / "kuberay" / "networkpolicy.yaml").read_text())
    assert policy["kind"] == "NetworkPolicy" and policy["spec"]["policyTypes"] == ["Ingress"]
    label = {"drpo/job": job["metadata"]["labels"]["drpo/job"]}
    assert policy["spec"]["podSelector"] == {"matchLabels": label}
    sources = [peer for rule in policy["spec"]["ingress"] for peer in rule["from"]]
    assert all("ipBlock" not in peer for peer in sources)  # no address range: nothing outside the cluster
    assert {"podSelector": {"matchLabels": label}} in sources
    (operator,) = [p for p in sources if p.get("podSelector", {}).get("matchLabels", {}).get("app.kubernetes.io/name") == "kuberay-operator"]
    (rule,) = [r for r in policy["spec"]["ingress"] if operator in r["from"]]
    assert rule["ports"] == [{"port": 8265, "protocol": "TCP"}]  # the operator reaches the job API only
    assert len(sources) == 2


@pytest.mark.parametrize("name", ["runtime_env.yaml", "runtime_env.local.yaml"])
def test_runtime_envs_pin_what_they_install_and_turn_reporting_off(name):
    env = yaml.safe_load((DEPLOY / name).read_text())
    assert all(re.fullmatch(r"[A-Za-z0-9_.\-\[\]]+==[0-9][0-9A-Za-z.]*", spec) for spec in env.get("pip", [])), env.get("pip")
    assert env["env_vars"]["RAY_USAGE_STATS_ENABLED"] == "0" and env["env_vars"]["VLLM_NO_USAGE_STATS"] == "1"


def test_rayjob_worker_groups_declare_the_role_resources_the_cluster_preset_requests():
    job = yaml.safe_load((DEPLOY / "kuberay" / "rayjob.yaml").read_text())
    cfg = load_config(REPO / "controller/presets/cluster-gpu.yaml")
    declared = {g["groupName"]: json.loads(yaml.safe_load(g["rayStartParams"]["resources"])) for g in job["spec"]["rayClusterSpec"]["workerGroupSpecs"]}
    assert cfg.learner_resources.node_resource in declared["learner"] and cfg.learner_resources.node_resource not in declared["rollout"]
    assert cfg.rollout.node_resource in declared["rollout"] and cfg.rollout.node_resource not in declared["learner"]


def test_dashboards_are_grafana_json_and_match_their_generator():
    built = dashboards.build()
    files = sorted((DEPLOY / "grafana" / "dashboards").glob("*.json"))
    assert {f.stem for f in files} == set(built)
    for f in files:
        model = json.loads(f.read_text())
        assert model == built[f.stem], f"{f.name} is stale: run python -m deploy.dashboards"
        assert model["uid"] == f.stem and model["schemaVersion"] >= 30 and model["panels"]
        ids = [p["id"] for p in model["panels"]]
        assert len(ids) == len(set(ids))
        for p in model["panels"]:
            assert p["type"] == "timeseries" and p["targets"] and set(p["gridPos"]) == {"h", "w", "x", "y"}
            assert all(t["expr"] and t["refId"] for t in p["targets"])


def test_prometheus_and_grafana_provisioning_parse():
    prom = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    assert {j["job_name"] for j in prom["scrape_configs"]} == {"drpo", "ray", "vllm"}
    assert prom["rule_files"] == ["alerts.yml"] and (DEPLOY / "prometheus" / "alerts.yml").is_file()
    rules = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())["groups"][0]["rules"]
    assert {r["alert"] for r in rules if "alert" in r} >= {"DrpoTrainingStalled", "DrpoOffPolicyGapExplosion", "DrpoCorrectiveFractionSpike"}
    ds = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text())
    assert ds["datasources"][0]["type"] == "prometheus"
    provider = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "dashboards" / "drpo.yml").read_text())
    assert provider["providers"][0]["type"] == "file"


def test_the_image_recipe_matches_the_rayjob():
    job = yaml.safe_load((DEPLOY / "kuberay" / "rayjob.yaml").read_text())
    recipe = (DEPLOY / "kuberay" / "Dockerfile").read_text()
    (base,) = [line.split()[1] for line in recipe.splitlines() if line.startswith("FROM ")]
    assert base.startswith(f"rayproject/ray:{job['spec']['rayClusterSpec']['rayVersion']}-")  # the cluster's Ray version
    packages = tomllib.loads((DEPLOY.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    assert "WORKDIR /app" in recipe and all(f"COPY {pkg} {pkg}" in recipe for pkg in (p.rstrip("*") for p in packages))
    for pod in _pods(job).values():
        if pod is not job["spec"]["submitterPodTemplate"]:
            assert pod["spec"]["containers"][0]["workingDir"] == "/app"
