"""A central Prometheus finds trainwatch's exporters: the bundle `trainwatch
dashboards --out DIR` writes passes promtool, and the shipped Slurm (file_sd
on a shared directory) and Kubernetes (pod relabelling) configs make a real
Prometheus scrape a live job on a fixed port."""

from __future__ import annotations

import json

import shutil
import subprocess

import pytest
import requests
import yaml

from trainwatch import dashboards, netbind
from util import BIN, ROOT, SCRIPTS, env_for, job_json, prometheus_server, reap, stop_group, wait_for

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (Debian package `prometheus`)")
PORT_NAME = "tw-metrics"


@pytest.fixture
def bundle(tmp_path):
    out = tmp_path / "monitoring"
    r = subprocess.run([str(BIN / "trainwatch"), "dashboards", "--out", str(out)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    return out


def test_the_bundle_is_everything_a_pip_install_needs(bundle):
    names = {p.relative_to(bundle).as_posix() for p in bundle.rglob("*") if p.is_file()}
    assert names == set(dashboards.rendered())
    assert {"prometheus.yml", "alert-rules.yml", "alert-rules.test.yml", "prometheus-slurm.yml",
            "prometheus-kubernetes.yml", "kubernetes-podmonitor.yaml", "trainwatch-overview.json",
            "provisioning/datasources/trainwatch.yaml"} <= names
    monitor = yaml.safe_load((bundle / "kubernetes-podmonitor.yaml").read_text())
    assert monitor["kind"] == "PodMonitor" and monitor["spec"]["podMetricsEndpoints"][0]["port"] == PORT_NAME
    k8s = yaml.safe_load((bundle / "prometheus-kubernetes.yml").read_text())
    keep = k8s["scrape_configs"][0]["relabel_configs"][0]
    assert keep["action"] == "keep" and keep["regex"] == PORT_NAME


@needs_promtool
def test_the_bundle_passes_promtool(bundle):
    for config in sorted(bundle.glob("prometheus*.yml")):
        r = subprocess.run([PROMTOOL, "check", "config", str(config)], capture_output=True, text=True)
        if r.returncode != 0 and "kubernetes_sd_configs not found" in r.stdout + r.stderr:
            continue  # Debian's Prometheus is built without Kubernetes discovery; the relabelling is run below
        assert r.returncode == 0, config.name + r.stdout + r.stderr
    unit = subprocess.run([PROMTOOL, "test", "rules", str(bundle / "alert-rules.test.yml")], capture_output=True,
                          text=True)
    assert unit.returncode == 0 and "SUCCESS" in unit.stdout, unit.stdout + unit.stderr


def test_the_cluster_recipes_set_a_port_and_the_capability():
    readme = (ROOT / "README.md").read_text()
    slurm = readme[readme.index("### Slurm"):readme.index("### Kubernetes")]
    k8s = readme[readme.index("### Kubernetes"):readme.index("## State")]
    assert "TRAINWATCH_METRICS_PORT=9470" in slurm and "TRAINWATCH_TARGETS_DIR" in slurm
    assert '"--metrics-port", "9470"' in k8s and f"name: {PORT_NAME}" in k8s and "containerPort: 9470" in k8s
    assert "SYS_PTRACE" in k8s and 'trainwatch.io/scrape: "true"' in k8s


@pytest.mark.slow
def test_a_central_prometheus_finds_a_live_job_on_a_fixed_port(bundle, tmp_path):
    """The Slurm recipe's file_sd over a shared target directory and the
    Kubernetes config's relabelling (fed the labels pod discovery gives, through
    a target file: no cluster here) both reach a job started with a fixed port."""
    home, shared = tmp_path / "home", tmp_path / "shared-targets"
    home.mkdir(mode=0o700)
    shared.mkdir()
    port = netbind.free_port()
    cfg = yaml.safe_load((bundle / "prometheus-slurm.yml").read_text())
    slurm = cfg["scrape_configs"][0]
    slurm["file_sd_configs"][0]["files"] = [str(shared / "*.json")]
    slurm["file_sd_configs"][0]["refresh_interval"] = "1s"
    pods = tmp_path / "pods.json"
    pod = {"__meta_kubernetes_pod_phase": "Running", "__meta_kubernetes_namespace": "ml",
           "__meta_kubernetes_pod_name": "train-0"}
    pods.write_text(json.dumps([
        {"targets": [f"127.0.0.1:{port}"], "labels": {**pod, "__meta_kubernetes_pod_container_port_name": PORT_NAME}},
        {"targets": ["127.0.0.1:1"], "labels": {**pod, "__meta_kubernetes_pod_container_port_name": "http"}},
    ]))
    k8s = yaml.safe_load((bundle / "prometheus-kubernetes.yml").read_text())["scrape_configs"][0]
    k8s.pop("kubernetes_sd_configs")
    k8s.update(job_name="trainwatch-pods", file_sd_configs=[{"files": [str(pods)], "refresh_interval": "1s"}])
    cfg["scrape_configs"].append(k8s)
    cfg["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    cfg_dir = tmp_path / "prometheus"
    cfg_dir.mkdir()
    shutil.copy(bundle / "alert-rules.yml", cfg_dir / "alert-rules.yml")
    job = "fixed-port"
    with prometheus_server(cfg_dir, yaml.safe_dump(cfg)) as url:
        log_path = tmp_path / "launch.log"
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                [str(BIN / "trainwatch"), "launch", "--nproc-per-node", "2", "--job", job,
                 str(SCRIPTS / "plain_ddp.py"), "--steps", "100000", "--sleep", "0.05"],
                env=env_for(home, TRAINWATCH_METRICS_PORT=str(port), TRAINWATCH_TARGETS_DIR=str(shared)),
                stdout=log, stderr=subprocess.STDOUT, cwd=str(ROOT), start_new_session=True)
        try:
            wait_for(lambda: (job_json(home, job) or {}).get("metrics"), 120, interval=0.2, what="the exporter")
            assert job_json(home, job)["metrics"] == f"127.0.0.1:{port}"  # the port asked for, not a free one

            def targets() -> dict:
                active = requests.get(f"{url}/api/v1/targets", timeout=10).json()["data"]["activeTargets"]
                return {(t["scrapePool"], t["labels"].get("pod"), t["labels"].get("trainwatch_job")): t["health"]
                        for t in active}

            wait_for(lambda: targets().get(("trainwatch", None, job)) == "up"
                     and targets().get(("trainwatch-pods", "train-0", None)) == "up", 90, interval=0.5,
                     what="Prometheus to scrape the job through both configs")
            assert len([k for k in targets() if k[0] == "trainwatch-pods"]) == 1  # the other port was dropped

            def series() -> list:
                r = requests.get(f"{url}/api/v1/query", params={"query": 'trainwatch_step{namespace="ml"}'},
                                 timeout=10).json()
                return r["data"]["result"]

            found = wait_for(series, 60, interval=0.5, what="per-rank series with the pod's labels")
            assert {s["metric"]["pod"] for s in found} == {"train-0"}
        finally:
            stop_group(proc)
            reap(home)
    assert not list(shared.glob("*.json"))  # the job's target left the shared directory with it
