"""The deploy/ manifests an operator applies: they parse and carry what the agent needs to run."""

from __future__ import annotations

import configparser
import shutil
import subprocess
from pathlib import Path

import yaml

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
EBPF_CAPS = {"BPF", "PERFMON", "SYS_RESOURCE", "SYS_PTRACE"}


def docs(name: str) -> list[dict]:
    with open(DEPLOY / "kubernetes" / name) as fh:
        out = [d for d in yaml.safe_load_all(fh) if d is not None]
    for d in out:
        assert d.get("apiVersion") and d.get("kind"), f"{name}: a document without apiVersion/kind"
        assert d["metadata"].get("name"), f"{name}: {d['kind']} without metadata.name"
    return out


def by_kind(name: str, kind: str) -> dict:
    found = [d for d in docs(name) if d["kind"] == kind]
    assert len(found) == 1, f"{name}: expected one {kind}"
    return found[0]


def test_the_daemonset_runs_in_the_host_pid_namespace_with_resources_and_the_mounts_nvml_and_bcc_need():
    ds = by_kind("daemonset.yaml", "DaemonSet")
    assert ds["apiVersion"] == "apps/v1"
    spec = ds["spec"]
    assert spec["selector"]["matchLabels"].items() <= spec["template"]["metadata"]["labels"].items()
    pod = spec["template"]["spec"]
    assert pod["hostPID"] is True
    (agent,) = pod["containers"]
    assert agent["args"][0] == "agent"
    for part in ("requests", "limits"):
        assert {"cpu", "memory"} <= set(agent["resources"][part]), part
    mounts = {m["mountPath"]: m for m in agent["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    for m in agent["volumeMounts"]:
        assert m["name"] in volumes, f"mount {m['mountPath']} names no volume"
    for path in ("/sys/kernel/debug", "/sys/kernel/tracing", "/sys/kernel/btf", "/lib/modules", "/usr/src",
                 "/host/proc", "/var/lib/gpudiag", "/etc/gpudiag"):
        assert path in mounts, f"{path} not mounted"
    for path in ("/lib/modules", "/usr/src", "/host/proc", "/sys/kernel/btf"):
        assert mounts[path].get("readOnly") is True, f"{path} must be read-only"
    assert volumes[mounts["/host/proc"]["name"]]["hostPath"]["path"] == "/proc"
    sec = agent["securityContext"]
    assert sec["privileged"] is False and sec["allowPrivilegeEscalation"] is False
    assert sec["capabilities"]["drop"] == ["ALL"]
    assert EBPF_CAPS <= set(sec["capabilities"]["add"])
    assert "SYS_ADMIN" not in sec["capabilities"]["add"]
    ready = agent["readinessProbe"]["httpGet"]
    assert ready["path"] == "/metrics" and ready["port"] in ("metrics", 9400)


def test_the_daemonset_mounts_what_pod_attribution_reads_read_only():
    """The pod-resources socket's folder and the kubelet's log names, read-only; no cgroup filesystem (the
    cgroup path comes from /proc/PID/cgroup in the host PID namespace) and no API server token."""
    from gpudiag.agent.config import parse

    pod = by_kind("daemonset.yaml", "DaemonSet")["spec"]["template"]["spec"]
    (agent,) = pod["containers"]
    mounts = {m["mountPath"]: m for m in agent["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    for path in ("/var/lib/kubelet/pod-resources", "/var/log/containers", "/var/log/pods"):
        assert mounts[path].get("readOnly") is True, f"{path} must be read-only"
        assert volumes[mounts[path]["name"]]["hostPath"]["path"] == path
    assert not any(p.startswith("/sys/fs/cgroup") for p in mounts)
    assert pod["hostPID"] is True and pod["automountServiceAccountToken"] is False
    cfg = parse(by_kind("daemonset.yaml", "ConfigMap")["data"]["agent.toml"], "daemonset.yaml ConfigMap")
    assert cfg.get("kubernetes.mode") == "on"
    assert cfg.get("kubernetes.pod_resources_socket").startswith(mounts["/var/lib/kubelet/pod-resources"]["mountPath"])


def test_the_daemonset_config_is_a_valid_agent_config_that_may_listen_beyond_loopback():
    from gpudiag.agent.config import parse

    cm = by_kind("daemonset.yaml", "ConfigMap")
    cfg = parse(cm["data"]["agent.toml"], "daemonset.yaml ConfigMap")
    assert cfg.get("exporter.allow_non_loopback") is True
    assert cfg.get("exporter.listen").endswith(":9400")


def test_the_service_and_servicemonitor_select_the_daemonset_pods_on_the_metrics_port():
    pod_labels = by_kind("daemonset.yaml", "DaemonSet")["spec"]["template"]["metadata"]["labels"]
    svc = by_kind("service.yaml", "Service")
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    assert [p["name"] for p in svc["spec"]["ports"]] == ["metrics"]
    sm = by_kind("servicemonitor.yaml", "ServiceMonitor")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert [e["port"] for e in sm["spec"]["endpoints"]] == ["metrics"]


def test_the_systemd_unit_runs_gpudiag_agent_with_exactly_the_ebpf_capabilities():
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str
    unit.read(DEPLOY / "gpudiag-agent.service")
    svc = unit["Service"]
    assert svc["ExecStart"].split()[1:3] == ["agent", "--config"]
    assert svc["ExecStart"].split()[0].endswith("/gpudiag")
    caps = {c.removeprefix("CAP_") for c in svc["CapabilityBoundingSet"].split()}
    assert EBPF_CAPS <= caps and "SYS_ADMIN" not in caps
    assert set(svc["AmbientCapabilities"].split()) == set(svc["CapabilityBoundingSet"].split())
    assert svc["NoNewPrivileges"] == "yes" and svc["ProtectSystem"] == "strict"
    assert "/var/lib/gpudiag" in svc["ReadWritePaths"].split()
    assert unit["Install"]["WantedBy"] == "multi-user.target"


def test_the_example_agent_config_validates():
    from gpudiag.agent.config import AgentConfig, load

    cfg = load(str(DEPLOY / "agent.toml"))
    assert cfg.diff(AgentConfig()) == ["store.path"]  # every other key shown at its default


def test_the_static_scrape_config_passes_promtool():
    path = DEPLOY / "prometheus" / "scrape.yaml"
    doc = yaml.safe_load(path.read_text())
    assert all(job["job_name"].startswith("gpudiag-agent") for job in doc["scrape_configs"])
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing: scripts/system-deps.d/20-prometheus.sh installs Debian's prometheus"
    res = subprocess.run([promtool, "check", "config", str(path)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr


def test_the_kubernetes_scrape_config_is_well_formed():
    # Debian's promtool is built without Kubernetes service discovery, so this file is
    # checked for the fields Prometheus needs instead of by promtool.
    doc = yaml.safe_load((DEPLOY / "prometheus" / "scrape-kubernetes.yaml").read_text())
    jobs = doc["scrape_configs"]
    assert jobs and all(job["job_name"].startswith("gpudiag-agent") for job in jobs)
    for job in jobs:
        sd = job["kubernetes_sd_configs"]
        assert sd and all(c["role"] in ("pod", "endpoints", "service", "node") for c in sd)
        for rule in job.get("relabel_configs", []):
            assert rule.get("action", "replace") in ("keep", "drop", "replace", "labelmap", "labeldrop", "labelkeep")
