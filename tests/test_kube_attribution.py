"""Pod attribution of GPU processes: cgroup + kubelet log links + pod-resources, on rows, series, findings, top.

The node's records are laid out as a kubelet lays them out (a /proc tree of
cgroup files in tmp_path, /var/log/containers and /var/log/pods names) and
the pod-resources API is a real gRPC server of the v1 proto.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from store_support import write_window

from gpudiag.analyzers.registry import run_all
from gpudiag.catalog import CATALOG, M
from gpudiag.frames import Frame, Window
from gpudiag.probes.kube import PodResolver, container_log_names, pod_log_dirs

grpc = pytest.importorskip("grpc", reason="grpcio (the kubernetes extra) is not installed")

from kubelet_support import KubeletPodResources  # noqa: E402

GPU0 = "GPU-5a1a3c7e-0b0e-6f1d-2c3b-4a5d6e7f8091"
GPU1 = "GPU-6b2b4d8f-1c1f-7a2e-3d4c-5b6e7f809102"
VLLM_UID, NB_UID, BATCH_UID = ("1f2e3d4c-5b6a-4987-a6b5-c4d3e2f1a0b9", "2a3b4c5d-6e7f-4081-92a3-b4c5d6e7f809",
                               "3b4c5d6e-7f80-4192-a3b4-c5d6e7f8091a")
VLLM_CID, NB_CID, BATCH_CID = "a" * 64, "b" * 64, "c" * 64
PODS = [
    ("vllm-llama-0", "serving", [("vllm", "nvidia.com/gpu", [GPU0])]),
    ("notebook-ana", "research", [("jupyter", "nvidia.com/gpu", [f"{GPU1}::0"])]),
    ("batch-embed-7f9c", "batch", [("embedder", "nvidia.com/gpu", [f"{GPU1}::1"])]),
]


def systemd_cgroup(uid, cid, qos="burstable"):
    return (f"0::/kubepods.slice/kubepods-{qos}.slice/kubepods-{qos}-pod{uid.replace('-', '_')}.slice/"
            f"cri-containerd-{cid}.scope\n")


@pytest.fixture
def node(tmp_path):
    """/proc, /var/log/containers and /var/log/pods of a node with three GPU pods, and its kubelet."""
    proc, links, pods = tmp_path / "proc", tmp_path / "containers", tmp_path / "pods"
    for d in (proc, links, pods):
        d.mkdir()
    cgroups = {
        101: systemd_cgroup(VLLM_UID, VLLM_CID, "guaranteed").replace("kubepods-guaranteed.slice/", "").replace(
            "kubepods-guaranteed-pod", "kubepods-pod"),
        202: f"0::/kubepods/besteffort/pod{NB_UID}/{NB_CID}\n",           # cgroupfs driver
        303: systemd_cgroup(BATCH_UID, BATCH_CID),                         # no log link yet
        404: "0::/user.slice/user-1000.slice/session-4.scope\n",          # a host process on GPU 0
    }
    for pid, text in cgroups.items():
        (proc / str(pid)).mkdir()
        (proc / str(pid) / "cgroup").write_text(text)
    for name in (f"vllm-llama-0_serving_vllm-{VLLM_CID}.log", f"notebook-ana_research_jupyter-{NB_CID}.log"):
        (links / name).symlink_to("/nonexistent")  # the kubelet's links point into /var/log/pods
    for name in (f"serving_vllm-llama-0_{VLLM_UID}", f"research_notebook-ana_{NB_UID}",
                 f"batch_batch-embed-7f9c_{BATCH_UID}"):
        (pods / name).mkdir()
    sock = str(tmp_path / "kubelet.sock")
    server = KubeletPodResources(PODS).start(sock)
    yield {"proc": str(proc), "links": str(links), "pods": str(pods), "sock": sock}
    server.stop()


def resolver(node, **kw):
    args = dict(proc_root=node["proc"], pod_resources_socket=node["sock"], container_logs_dir=node["links"],
                pod_logs_dir=node["pods"])
    args.update(kw)
    return PodResolver(**args)


def test_the_kubelets_names_parse():
    assert container_log_names([f"my-app-5d8f_default_web-server-{VLLM_CID}.log", "junk.log"]) == {
        VLLM_CID: ("my-app-5d8f", "default", "web-server")}
    assert pod_log_dirs([f"kube-system_coredns-abc_{VLLM_UID}", "nope"]) == {VLLM_UID: ("coredns-abc", "kube-system")}


def test_each_process_gets_its_pod(node):
    r = resolver(node)
    r.refresh()
    assert r.resolve(101, GPU0) == {"pod": "vllm-llama-0", "namespace": "serving", "container": "vllm",
                                    "pod_uid": VLLM_UID, "container_id": VLLM_CID}
    assert r.resolve(202, GPU1)["pod"] == "notebook-ana"
    # No log link yet: the pod's log folder names pod and namespace from the cgroup's UID.
    got = r.resolve(303, GPU1)
    assert (got["pod"], got["namespace"], got.get("container")) == ("batch-embed-7f9c", "batch", None)
    # A host process on a GPU the kubelet gave to a pod is not that pod's.
    assert r.resolve(404, GPU0) == {}
    assert r.sharing(GPU1) == [("batch", "batch-embed-7f9c", "embedder"), ("research", "notebook-ana", "jupyter")]


def test_pod_resources_alone_names_a_gpus_one_holder_and_never_guesses_on_a_shared_one(node):
    r = resolver(node, proc_root=node["proc"] + "-absent", container_logs_dir=None, pod_logs_dir=None)
    r.refresh()
    assert r.resolve(101, GPU0) == {"pod": "vllm-llama-0", "namespace": "serving", "container": "vllm"}
    assert r.resolve(202, GPU1) == {}  # two pods share GPU 1 (time-sliced): no guess


def test_a_missing_kubelet_socket_leaves_the_cgroup_path_working(node, caplog):
    r = resolver(node, pod_resources_socket=node["sock"] + ".gone")
    frames = r.annotate([Frame("process", 1.0, [{"pid": 101, "gpu": 0, "uuid": GPU0}])])
    assert frames[0].rows[0]["pod"] == "vllm-llama-0"
    st = r.status()
    assert not st["sources"]["pod_resources"] and "not found" in st["errors"]["pod_resources"]
    assert sum("not found" in m for m in caplog.messages) == 1  # said once, not every tick
    r.refresh(force=True)
    assert sum("not found" in m for m in caplog.messages) == 1


def test_process_series_carry_pod_namespace_container(node):
    from gpudiag.exposition import LatestFrames, catalog_samples

    r = resolver(node)
    frames = r.annotate([Frame("process", 1.0, [
        {"node": "n1", "gpu": 0, "uuid": GPU0, "pid": 101, "process": "vllm", M.process_gpu_memory_bytes: 7e10},
        {"node": "n1", "gpu": 0, "uuid": GPU0, "pid": 404, "process": "nvidia-smi", M.process_gpu_memory_bytes: 1e8},
    ])])
    latest = LatestFrames(node="n1")
    latest.update(frames)
    series = catalog_samples(latest.snapshot())[M.process_gpu_memory_bytes]
    labels = CATALOG[M.process_gpu_memory_bytes].labels
    by_pid = {dict(zip(labels, k))["pid"]: dict(zip(labels, k)) for k in series}
    assert (by_pid["101"]["pod"], by_pid["101"]["namespace"], by_pid["101"]["container"]) == (
        "vllm-llama-0", "serving", "vllm")
    assert by_pid["404"]["pod"] == ""  # absent to Prometheus


def _window(rows_by_kind):
    ts = [r["t"] for rows in rows_by_kind.values() for r in rows]
    return Window.from_rows(rows_by_kind, start_s=min(ts), end_s=max(ts), node="n1")


def test_the_cotenant_finding_names_both_pods():
    gib, n = 1024**3, 900
    base = [{"t": float(t), "node": "n1", "gpu": 0, "uuid": GPU1} for t in range(1, n + 1)]
    engine_pod = {"pod": "vllm-llama-0", "namespace": "serving", "container": "vllm"}
    other_pod = {"pod": "notebook-ana", "namespace": "research", "container": "jupyter"}
    proc = [{**r, "pid": 4100, "process": "gpudiag-engine", **engine_pod, M.process_gpu_memory_bytes: 30 * gib}
            for r in base]
    proc += [{**r, "pid": 777, "process": "python train.py", **other_pod, M.process_gpu_memory_bytes: 38 * gib}
             for r in base]
    eng = [{**r, "engine": "gpudiag-engine", M.engine_kv_capacity_bytes: 9 * gib} for r in base]
    gpu = [{**r, M.gpu_memory_total_bytes: 80 * gib} for r in base]
    found = [f for f in run_all(_window({"process": proc, "engine": eng, "gpu": gpu})) if f.kind == "gpu_cotenant"]
    assert len(found) == 1
    f = found[0]
    assert "in pod research/notebook-ana" in f.summary and "engine pod serving/vllm-llama-0" in f.summary
    assert (f.pod, f.namespace, f.container) == ("notebook-ana", "research", "jupyter")
    assert f.details["cotenant_pods"] == ["research/notebook-ana"]
    d = f.to_dict()
    assert (d["pod"], d["namespace"]) == ("notebook-ana", "research")


def test_findings_off_kubernetes_keep_their_schema():
    gib, n = 1024**3, 900
    base = [{"t": float(t), "node": "n1", "gpu": 0, "uuid": GPU1} for t in range(1, n + 1)]
    proc = [{**r, "pid": 4100, "process": "gpudiag-engine", M.process_gpu_memory_bytes: 30 * gib} for r in base]
    proc += [{**r, "pid": 777, "process": "python train.py", M.process_gpu_memory_bytes: 38 * gib} for r in base]
    eng = [{**r, "engine": "gpudiag-engine", M.engine_kv_capacity_bytes: 9 * gib} for r in base]
    found = [f for f in run_all(_window({"process": proc, "engine": eng})) if f.kind == "gpu_cotenant"]
    d = found[0].to_dict()
    assert "pod" not in d and "cotenant_pods" not in d["details"] and " pod " not in d["summary"]


def test_top_shows_pod_names_from_the_simulated_node():
    env = dict(os.environ, COLUMNS="80")
    r = subprocess.run([sys.executable, "-m", "gpudiag", "top", "--sim", "cotenant", "--sim-pods", "--speed", "60",
                        "--once", "--json", "--interval", "0.2"], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    procs = {p["pid"]: p for p in json.loads(r.stdout)["processes"]}
    assert (procs[4242]["pod"], procs[4242]["namespace"]) == ("vllm-llama-8b-7d9f6c-x2k4q", "serving")
    assert procs[31337]["pod"] == "finetune-lora-0"
    r = subprocess.run([sys.executable, "-m", "gpudiag", "top", "--sim-pods", "--once"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "--sim" in r.stderr


def test_investigate_from_the_store_names_the_pods(cli, tmp_path):
    """The cotenant scenario's frames, labelled as the agent labels them with --sim-pods, in a real store."""

    from gpudiag import repro as R
    from gpudiag.probes.kube import sim_resolver
    from gpudiag.reference_engine import scenarios

    t0 = 1_700_000_000.0
    res = R.run(scenarios.get("cotenant"), None, 0)
    pods = sim_resolver()
    path = str(tmp_path / "cotenant.db")
    write_window(res.window, path, t0, annotate=pods.annotate)
    p = cli("investigate", "--store", path, "--from", str(t0), "--to", str(t0 + 1800), "--json")
    assert p.returncode == 1, p.stderr
    doc = json.loads(p.stdout)
    cot = next(f for f in doc["findings"] if f["kind"] == "gpu_cotenant")
    assert (cot["pod"], cot["namespace"], cot["container"]) == ("finetune-lora-0", "research", "trainer")
    assert "in pod research/finetune-lora-0" in cot["summary"]
    assert "engine pod serving/vllm-llama-8b-7d9f6c-x2k4q" in cot["summary"]
    mem = {m["pid"]: m for m in doc["memory"]}
    assert mem[31337]["pod"] == "finetune-lora-0" and mem[4242]["namespace"] == "serving"
    text = cli("investigate", "--store", path, "--from", str(t0), "--to", str(t0 + 1800),
               env={**os.environ, "COLUMNS": "120"}).stdout
    assert "pod research/finetune-lora-0" in text


def test_doctor_checks_what_pod_attribution_reads(cli, tmp_path):
    sock = str(tmp_path / "kubelet.sock")
    cfg = tmp_path / "agent.toml"
    cfg.write_text(f'[kubernetes]\npod_resources_socket = "{sock}"\n')
    p = cli("doctor", "--feature", "kubernetes", "--config", str(cfg), "--json")
    checks = {c["name"]: c for c in json.loads(p.stdout)["checks"] if c["feature"] == "kubernetes"}
    assert checks["grpcio"]["status"] == "ok"
    assert checks["kubelet pod-resources"]["status"] == "missing" and "not found" in checks["kubelet pod-resources"][
        "detail"] and "daemonset.yaml" in checks["kubelet pod-resources"]["fix"]
    assert p.returncode == 1
    server = KubeletPodResources(PODS).start(sock)
    try:
        p = cli("doctor", "--feature", "kubernetes", "--config", str(cfg), "--json")
    finally:
        server.stop()
    checks = {c["name"]: c for c in json.loads(p.stdout)["checks"] if c["feature"] == "kubernetes"}
    assert checks["kubelet pod-resources"]["status"] == "ok"
    assert checks["host PID namespace"]["status"] in ("ok", "wrong", "missing")


def test_agent_sim_pods_without_sim_is_one_line_and_exit_2(tmp_path):
    r = subprocess.run([sys.executable, "-m", "gpudiag", "agent", "--sim-pods", "--store", str(tmp_path / "s.db")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--sim-pods applies to --sim only" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "s.db").exists()
