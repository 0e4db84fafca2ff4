"""MIG through the NVML probe: MIG device handles, GPU and compute instance IDs on series and findings.

NVML needs a driver, absent here: the fake of tests/fake_nvml.py answers the
MIG calls at the pynvml boundary with the driver's own failure modes (empty
slots NOT_FOUND, instance IDs of a physical GPU NOT_SUPPORTED, a GPU without
MIG NOT_SUPPORTED for its MIG mode, no permission for a MIG device's memory).
"""

from __future__ import annotations

import os
import sys

import pynvml
import pytest

from gpudiag.catalog import CATALOG, M
from gpudiag.findings import Finding, Severity
from gpudiag.probes.nvml import NvmlProbe

sys.path.insert(0, os.path.dirname(__file__))
from fake_nvml import GIB, FakeMigDevice, FakeNvml, FakeProcess  # noqa: E402

MIG_A = "MIG-1a2b3c4d-0000-5111-8222-333344445555"
MIG_B = "MIG-2b3c4d5e-0000-5111-8222-333344445555"
MIG_CALLS = ("nvmlDeviceGetMaxMigDeviceCount", "nvmlDeviceGetMigDeviceHandleByIndex",
             "nvmlDeviceGetGpuInstanceId", "nvmlDeviceGetComputeInstanceId")


def _rows(frames, kind):
    return [r for f in frames if f.kind == kind for r in f.rows]


@pytest.fixture
def mig_node(monkeypatch):
    """GPU 0 in MIG mode: a 3g.40gb instance (GI 1, CI 0) and a 1g.10gb one (GI 9, CI 0), slot 1 empty;
    GPU 1 MIG-capable with MIG off; GPU 2 without MIG."""
    fake = FakeNvml.node(3, 0)
    g0 = fake.gpus[0]
    g0.mig_mode = 1
    g0.mig_devices = [FakeMigDevice(MIG_A, 1, 0, memory_total=40 * GIB, memory_used=31 * GIB), None,
                      FakeMigDevice(MIG_B, 9, 0, memory_total=10 * GIB, memory_used=2 * GIB)]
    g0.processes = [FakeProcess(5001, 30 * GIB, gpu_instance=1, compute_instance=0),
                    FakeProcess(5002, None, gpu_instance=9, compute_instance=0)]  # MIG without permission
    fake.gpus[1].processes = [FakeProcess(6001, 4 * GIB)]
    fake.gpus[2].max_mig_devices = 0
    fake.fail(2, "nvmlDeviceGetMigMode", pynvml.NVML_ERROR_NOT_SUPPORTED)
    return fake.install(monkeypatch)


def test_mig_devices_give_per_instance_memory_and_process_instances(mig_node):
    frames = NvmlProbe().sample(1.0)
    gpus = {g["gpu"]: g for g in _rows(frames, "gpu")}
    g0 = gpus[0]
    assert g0["mig_mode"] == "enabled"
    assert g0[M.gpu_mig_memory_used_bytes] == {"1": {"0": 31 * GIB}, "9": {"0": 2 * GIB}}
    assert g0[M.gpu_mig_memory_total_bytes] == {"1": {"0": 40 * GIB}, "9": {"0": 10 * GIB}}
    assert [d["uuid"] for d in g0["mig_devices"]] == [MIG_A, MIG_B]
    procs = {p["pid"]: p for p in _rows(frames, "process")}
    assert (procs[5001]["gpu_instance"], procs[5001]["compute_instance"], procs[5001]["mig_uuid"]) == (1, 0, MIG_A)
    assert procs[5001][M.process_gpu_memory_bytes] == 30 * GIB
    assert procs[5002]["mig_uuid"] == MIG_B and M.process_gpu_memory_bytes not in procs[5002]
    # MIG off, and no MIG at all: no instance fields, and no MIG device call on either GPU.
    assert "gpu_instance" not in procs[6001] and M.gpu_mig_memory_used_bytes not in gpus[1]
    assert gpus[1]["mig_mode"] == "disabled" and gpus[2]["mig_mode"] is None
    assert mig_node.calls["nvmlDeviceGetMaxMigDeviceCount"] == 1  # GPU 0 only
    assert not mig_node.unmodelled_calls, mig_node.unmodelled_calls


def test_mig_labels_on_process_and_gpu_series(mig_node):
    from gpudiag.exposition import LatestFrames, catalog_samples

    latest = LatestFrames(node="n1")
    latest.update(NvmlProbe(node="n1").sample(1.0))
    samples = catalog_samples(latest.snapshot())
    labels = CATALOG[M.process_gpu_memory_bytes].labels
    by_pid = {dict(zip(labels, k))["pid"]: dict(zip(labels, k)) for k in samples[M.process_gpu_memory_bytes]}
    assert (by_pid["5001"]["gpu_instance"], by_pid["5001"]["compute_instance"]) == ("1", "0")
    assert by_pid["6001"]["gpu_instance"] == ""
    mig = {tuple(dict(zip(CATALOG[M.gpu_mig_memory_used_bytes].labels, k))[c]
                 for c in ("gpu", "gpu_instance", "compute_instance")): v
           for k, v in samples[M.gpu_mig_memory_used_bytes].items()}
    assert mig == {("0", "1", "0"): 31 * GIB, ("0", "9", "0"): 2 * GIB}


def test_no_permission_for_a_mig_devices_memory_is_a_missing_field_not_a_missing_device(mig_node):
    mig_node.fail(0, "nvmlDeviceGetMemoryInfo", pynvml.NVML_ERROR_NO_PERMISSION)
    probe = NvmlProbe()
    g0 = _rows(probe.sample(1.0), "gpu")[0]
    assert [d["uuid"] for d in g0["mig_devices"]] == [MIG_A, MIG_B]
    assert M.gpu_mig_memory_used_bytes not in g0
    assert "no permission" in probe.status()["missing_fields"]["gpu0"][M.gpu_mig_memory_used_bytes]


def test_a_driver_without_mig_device_calls_leaves_the_gpu_row_whole(mig_node):
    mig_node.fail(0, "nvmlDeviceGetMaxMigDeviceCount", pynvml.NVML_ERROR_NOT_SUPPORTED)
    probe = NvmlProbe()
    for t in (1.0, 2.0):  # asked once, then remembered as missing
        g0 = _rows(probe.sample(t), "gpu")[0]
        assert "mig_devices" not in g0 and g0[M.gpu_memory_used_bytes] == 20 * GIB
    assert mig_node.calls["nvmlDeviceGetMaxMigDeviceCount"] == 1
    assert "not supported" in probe.status()["missing_fields"]["gpu0"]["mig_devices"]


def test_a_mig_device_destroyed_between_count_and_handle_is_skipped(mig_node):
    mig_node.gpus[0].mig_devices[2] = None  # the 1g instance is gone: its slot answers NOT_FOUND
    frames = NvmlProbe().sample(1.0)
    g0 = _rows(frames, "gpu")[0]
    assert [d["uuid"] for d in g0["mig_devices"]] == [MIG_A]
    procs = {p["pid"]: p for p in _rows(frames, "process")}
    assert procs[5002]["gpu_instance"] == 9 and "mig_uuid" not in procs[5002]


def test_instance_ids_of_a_physical_gpu_are_not_supported(mig_node):
    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(2)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetGpuInstanceId(h)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlDeviceGetMigDeviceHandleByIndex(pynvml.nvmlDeviceGetHandleByIndex(0), 7)


def test_findings_and_pods_follow_the_mig_instance(mig_node, tmp_path):
    """A finding about a process in a MIG instance carries the instance; its pod comes from the MIG UUID."""
    from kubelet_support import KubeletPodResources

    from gpudiag.analyzers.pod_labels import attribute
    from gpudiag.frames import Window
    from gpudiag.probes.kube import PodResolver

    sock = str(tmp_path / "kubelet.sock")
    server = KubeletPodResources([("llm-small", "serving", [("vllm", "nvidia.com/mig-1g.10gb", [MIG_B])]),
                                  ("trainer", "research", [("train", "nvidia.com/mig-3g.40gb", [MIG_A])])]).start(sock)
    try:
        resolver = PodResolver(proc_root=str(tmp_path / "noproc"), pod_resources_socket=sock,
                               container_logs_dir=None, pod_logs_dir=None)
        frames = resolver.annotate(NvmlProbe(node="n1").sample(1.0))
    finally:
        server.stop()
    procs = {p["pid"]: p for p in _rows(frames, "process")}
    assert (procs[5002]["pod"], procs[5002]["namespace"]) == ("llm-small", "serving")
    assert procs[5001]["pod"] == "trainer"
    rows = [dict(r, t=float(t)) for t in (1, 2) for r in procs.values()]
    window = Window.from_rows({"process": rows}, start_s=1.0, end_s=2.0, node="n1")
    f = Finding("memory_leak", Severity.WARNING, 1.0, 2.0, "grows", gpu=0, node="n1", pid=5002)
    attribute(window, [f])
    d = f.to_dict()
    assert (d["gpu_instance"], d["compute_instance"], d["pod"], d["namespace"]) == (9, 0, "llm-small", "serving")
