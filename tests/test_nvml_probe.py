"""The NVML probe: every field in SI units, missing fields asked once, lost GPUs, no driver, PID namespaces.

NVML itself needs an NVIDIA driver, absent here, so these tests put the fake
of tests/fake_nvml.py at the pynvml function boundary; the last test reads a
real device where there is one. The PID-namespace tests use real namespaces
(unshare), so they need root.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time

import psutil
import pynvml
import pytest

from gpudiag.catalog import M
from gpudiag.probes.base import ProbeError, in_host_pid_namespace
from gpudiag.probes.nvml import NvmlProbe, PidNamespaceMap

sys.path.insert(0, os.path.dirname(__file__))
from fake_nvml import GIB, FakeGpu, FakeNvml, FakeProcess

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def _rows(frames, kind):
    return [r for f in frames if f.kind == kind for r in f.rows]


@pytest.fixture
def node(monkeypatch):
    """Eight A100s; GPU 0 runs this test process and PID 1."""
    fake = FakeNvml.node(8, 0)
    fake.gpus[0].processes = [FakeProcess(os.getpid(), 3 * GIB), FakeProcess(1, GIB)]
    return fake.install(monkeypatch)


def test_every_gpu_field_is_read_in_si_units(node):
    node.gpus[3].throttle_bits = pynvml.nvmlClocksEventReasonSwPowerCap | pynvml.nvmlClocksEventReasonHwThermalSlowdown
    probe = NvmlProbe()
    gpus = _rows(probe.sample(10.0), "gpu")
    assert [g["gpu"] for g in gpus] == list(range(8))
    g = gpus[3]
    assert g["uuid"] == node.gpus[3].uuid and g["name"] == "NVIDIA A100-SXM4-80GB"
    assert g["pci_bus_id"] == "00000000:0A:00.0"
    assert g["driver_version"] == "550.54.15" and g["cuda_driver_version"] == "12.4"
    assert g[M.gpu_utilization_ratio] == pytest.approx(0.65)
    assert g[M.gpu_memory_utilization_ratio] == pytest.approx(0.40)
    assert g[M.gpu_memory_used_bytes] == 20 * GIB and g[M.gpu_memory_total_bytes] == 80 * GIB
    assert g[M.gpu_memory_reserved_bytes] == 512 << 20
    assert g[M.gpu_sm_clock_hertz] == 1410e6 and g[M.gpu_sm_clock_max_hertz] == 1410e6
    assert g[M.gpu_memory_clock_hertz] == 1593e6 and g[M.gpu_memory_clock_max_hertz] == 1593e6
    assert g[M.gpu_power_watts] == pytest.approx(250.0) and g[M.gpu_power_limit_watts] == pytest.approx(400.0)
    assert g[M.gpu_temperature_celsius] == 61 and g[M.gpu_memory_temperature_celsius] == 70
    assert g[M.gpu_pcie_tx_bytes_per_second] == 1000 * 1024 and g[M.gpu_pcie_rx_bytes_per_second] == 2000 * 1024
    assert g[M.gpu_pcie_replay_total] == 0
    assert g[M.gpu_nvlink_errors_total]["dl_crc_flit"] == 12  # one per active link, summed over 12 links
    assert g[M.gpu_ecc_errors_total] == {"volatile": {"corrected": 3, "uncorrected": 0},
                                         "aggregate": {"corrected": 10, "uncorrected": 0}}
    assert g[M.gpu_remapped_rows_total] == {"correctable": 0, "uncorrectable": 0}
    active = {k for k, v in g[M.gpu_clock_throttle_active].items() if v}
    assert active == {"sw_power_cap", "hw_thermal_slowdown"}
    assert g[M.gpu_performance_state] == 0
    assert g[M.gpu_lost] == 0 and g["mig_mode"] == "disabled" and g["virtualization_mode"] == "none"
    assert "metrics_unreliable" not in g
    assert not node.unmodelled_calls, f"calls the fake does not model: {node.unmodelled_calls}"


def test_processes_carry_the_black_layer_and_their_names(node):
    procs = _rows(NvmlProbe().sample(1.0), "process")
    mine = [p for p in procs if p["pid"] == os.getpid()]
    assert len(mine) == 1
    assert mine[0][M.process_gpu_memory_bytes] == 3 * GIB
    assert mine[0]["gpu"] == 0 and mine[0]["uuid"] == node.gpus[0].uuid
    assert mine[0]["process"] == psutil.Process().name()[:15]
    assert mine[0]["pid_mapped"] is True and mine[0]["host_pid"] == os.getpid()
    assert {p["pid"] for p in procs} == {os.getpid(), 1}


def test_a_field_not_supported_is_missing_once_and_never_asked_again(node):
    probe = NvmlProbe()
    for t in range(4):
        gpus = _rows(probe.sample(float(t)), "gpu")
    # the fake's A100s have no fan reading: absent from the row, never 0
    assert all(M.gpu_fan_speed_ratio not in g for g in gpus)
    assert node.calls["nvmlDeviceGetFanSpeed"] == 8, "NotSupported must not be retried every tick"
    missing = probe.status()["missing_fields"]
    assert missing["gpu5"][M.gpu_fan_speed_ratio] == "not supported by this GPU or driver"
    # retired pages are NotSupported on this generation (rows are remapped instead)
    assert M.gpu_retired_pages_total in missing["gpu0"]


def test_no_permission_is_reported_for_that_gpu_only(node):
    node.fail(1, "nvmlDeviceGetRemappedRows", pynvml.NVML_ERROR_NO_PERMISSION)
    probe = NvmlProbe()
    probe.sample(0.0)
    gpus = _rows(probe.sample(1.0), "gpu")
    assert M.gpu_remapped_rows_total not in gpus[1]
    assert gpus[0][M.gpu_remapped_rows_total] == {"correctable": 0, "uncorrectable": 0}
    assert "no permission" in probe.status()["missing_fields"]["gpu1"][M.gpu_remapped_rows_total]
    assert node.calls["nvmlDeviceGetRemappedRows"] == 8 + 7


def test_a_gpu_lost_mid_run_is_marked_and_the_others_go_on(node):
    node.gpus[2].processes = [FakeProcess(os.getpid(), GIB)]
    probe = NvmlProbe()
    probe.sample(0.0)
    node.lose(2)
    frames = probe.sample(1.0)
    gpus = _rows(frames, "gpu")
    assert gpus[2][M.gpu_lost] == 1 and "GPU is lost" in gpus[2]["lost_reason"]
    assert M.gpu_utilization_ratio not in gpus[2]
    assert all(g[M.gpu_lost] == 0 and g[M.gpu_utilization_ratio] == pytest.approx(0.65)
               for i, g in enumerate(gpus) if i != 2)
    assert all(p["gpu"] != 2 for p in _rows(frames, "process"))
    calls_on_lost = node.gpu_calls[2]
    gpus = _rows(probe.sample(2.0), "gpu")
    assert gpus[2][M.gpu_lost] == 1
    assert node.gpu_calls[2] == calls_on_lost, "a lost GPU must not be queried again"
    assert probe.status()["gpus"][2]["lost"] is True and probe.status()["available"] is True


def test_a_gpu_lost_before_start_is_listed_as_lost(monkeypatch):
    fake = FakeNvml.node(2, 0)
    fake.lose(1)
    fake.install(monkeypatch)
    gpus = _rows(NvmlProbe().sample(0.0), "gpu")
    assert gpus[0][M.gpu_lost] == 0 and gpus[1][M.gpu_lost] == 1


@pytest.mark.parametrize("code, words", [
    (pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, "libnvidia-ml.so.1"),
    (pynvml.NVML_ERROR_DRIVER_NOT_LOADED, "driver is not loaded"),
])
def test_without_nvml_the_probe_says_why_and_yields_nothing(monkeypatch, code, words):
    fake = FakeNvml.node(2, 0, init_error=code).install(monkeypatch)
    clock = [0.0]
    probe = NvmlProbe(clock=lambda: clock[0], reinit_interval_s=30.0)
    assert probe.sample(0.0) == []
    status = probe.status()
    assert status["available"] is False and words in status["reason"]
    clock[0] = 10.0
    probe.sample(1.0)
    assert fake.calls["nvmlInit"] == 1, "initialisation is retried only every reinit_interval_s"
    fake.init_error = None  # the driver got loaded
    clock[0] = 31.0
    assert len(_rows(probe.sample(2.0), "gpu")) == 2
    assert probe.status()["available"] is True


def test_a_node_without_gpus_says_so(monkeypatch):
    FakeNvml([]).install(monkeypatch)
    probe = NvmlProbe()
    assert probe.sample(0.0) == []
    assert probe.status()["reason"] == "NVML reports no GPU on this machine"


def test_nvml_stopping_altogether_is_a_probe_error(node):
    probe = NvmlProbe()
    probe.sample(0.0)
    node.initialised = False  # every call now answers Uninitialized, as after a driver unload
    with pytest.raises(ProbeError):
        probe.sample(1.0)
    assert probe.status()["available"] is False


def test_process_memory_not_available_is_absent_not_zero(node):
    node.gpus[0].processes = [FakeProcess(os.getpid(), None)]
    (row,) = _rows(NvmlProbe().sample(0.0), "process")
    assert M.process_gpu_memory_bytes not in row


def test_mig_and_vgpu_flag_the_metrics_as_unreliable(monkeypatch):
    fake = FakeNvml.node(2, 0)
    fake.gpus[0].mig_mode = 1
    fake.gpus[0].processes = [FakeProcess(os.getpid(), GIB)]
    fake.gpus[1].virtualization_mode = 2
    fake.install(monkeypatch)
    probe = NvmlProbe()
    frames = probe.sample(0.0)
    gpus = _rows(frames, "gpu")
    assert "MIG" in gpus[0]["metrics_unreliable"] and gpus[0]["mig_mode"] == "enabled"
    assert "vgpu" in gpus[1]["metrics_unreliable"]
    assert "MIG" in _rows(frames, "process")[0]["metrics_unreliable"]
    assert probe.status()["gpus"][1]["virtualization_mode"] == "vgpu"


def test_xid_events_are_counted_without_blocking_the_sampler(node):
    probe = NvmlProbe()
    assert probe.status()["xid_events"] == "on"
    probe.sample(0.0)
    node.xid(1, 79)
    node.xid(1, 79)
    node.xid(4, 48)
    gpus = _rows(probe.sample(1.0), "gpu")
    assert gpus[1][M.gpu_xid_errors_total] == {"79": 2}
    assert gpus[4][M.gpu_xid_errors_total] == {"48": 1}
    assert gpus[0][M.gpu_xid_errors_total] == {}
    node.xid(1, 79)
    assert _rows(probe.sample(2.0), "gpu")[1][M.gpu_xid_errors_total] == {"79": 3}  # cumulative counter
    assert node.blocking_waits == [], "the event wait must use a timeout of 0"


def test_xid_registration_refused_leaves_the_field_missing(monkeypatch):
    fake = FakeNvml.node(2, 0)
    fake.fail(0, "nvmlDeviceRegisterEvents", pynvml.NVML_ERROR_NOT_SUPPORTED)
    fake.install(monkeypatch)
    probe = NvmlProbe()
    gpus = _rows(probe.sample(0.0), "gpu")
    assert M.gpu_xid_errors_total not in gpus[0] and gpus[1][M.gpu_xid_errors_total] == {}
    assert M.gpu_xid_errors_total in probe.status()["missing_fields"]["gpu0"]


def test_a_driver_that_cannot_wait_for_events_turns_xid_off_once(node):
    node.fail(None, "nvmlEventSetWait_v2", pynvml.NVML_ERROR_NOT_SUPPORTED)
    probe = NvmlProbe()
    for t in range(3):
        gpus = _rows(probe.sample(float(t)), "gpu")
    assert node.calls["nvmlEventSetWait_v2"] == 1
    assert probe.status()["xid_events"].startswith("unavailable")
    assert all(M.gpu_xid_errors_total not in g for g in gpus)


def test_a_driver_before_510_has_no_reserved_memory(monkeypatch):
    fake = FakeNvml.node(1, 0)
    fake.gpus[0].memory_reserved = None
    fake.install(monkeypatch)
    (g,) = _rows(NvmlProbe().sample(0.0), "gpu")
    assert M.gpu_memory_reserved_bytes not in g
    assert g[M.gpu_memory_used_bytes] == 20 * GIB and g[M.gpu_memory_total_bytes] == 80 * GIB


def test_a_gpu_without_nvlink_reports_the_counters_missing(monkeypatch):
    fake = FakeNvml([FakeGpu(uuid="GPU-pcie-only", nvlinks_active=())])
    fake.install(monkeypatch)
    probe = NvmlProbe()
    (g,) = _rows(probe.sample(0.0), "gpu")
    assert M.gpu_nvlink_errors_total not in g
    assert M.gpu_nvlink_errors_total in probe.status()["missing_fields"]["gpu0"]


# --- PID namespaces (real ones) -----------------------------------------------------------

needs_unshare = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                                   reason="creating PID namespaces needs root and util-linux unshare")


def test_in_the_host_namespace_nvml_pids_are_ours():
    if not in_host_pid_namespace():
        pytest.skip("this test process does not run in the host PID namespace")
    mapper = PidNamespaceMap()
    assert mapper.mode == "host"
    assert mapper.to_local(os.getpid()) == (os.getpid(), None)
    assert mapper.to_local(2 ** 22 + 12345) == (None, None)  # no such process


def _wait_for_child(parent: psutil.Process, name: str, timeout_s: float = 10.0) -> psutil.Process:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for child in parent.children(recursive=True):
            try:
                if child.name() == name:
                    return child
            except psutil.NoSuchProcess:
                pass
        time.sleep(0.05)
    raise AssertionError(f"no {name} child appeared")


@needs_unshare
def test_a_containerised_process_is_found_with_its_inner_pid():
    if not in_host_pid_namespace():
        pytest.skip("this test process does not run in the host PID namespace")
    outer = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", "--mount-proc", "sleep", "30"])
    try:
        sleeper = _wait_for_child(psutil.Process(outer.pid), "sleep")
        local, inner = PidNamespaceMap().to_local(sleeper.pid)
        assert local == sleeper.pid and inner == 1  # the first process of its namespace
    finally:
        outer.kill()
        outer.wait()


_INNER = textwrap.dedent("""
    import json, os, subprocess, sys
    sys.path.insert(0, {tests!r})
    from fake_nvml import FakeNvml, FakeProcess, Patcher
    from gpudiag.probes.base import in_host_pid_namespace
    from gpudiag.probes.nvml import NvmlProbe, PidNamespaceMap
    child = subprocess.Popen(["sleep", "30"])
    print(json.dumps({{"child": child.pid}}), flush=True)
    host_pid = int(sys.stdin.readline())
    mapper = PidNamespaceMap()
    patch = Patcher()
    fake = FakeNvml.node(1, 0)
    fake.gpus[0].processes = [FakeProcess(host_pid, 1 << 30)]
    fake.install(patch)
    rows = [r for f in NvmlProbe().sample(0.0) if f.kind == "process" for r in f.rows]
    print(json.dumps({{"host_ns": in_host_pid_namespace(), "mode": mapper.mode, "status": mapper.status(),
                       "mapped": mapper.to_local(host_pid), "rows": rows}}), flush=True)
    child.kill()
""")


def _run_in_namespace(tmp_path, shell: str, env_extra: dict[str, str]) -> tuple[dict, dict, int]:
    script = tmp_path / "inner.py"
    script.write_text(_INNER.format(tests=HERE))
    env = dict(os.environ, PYTHONPATH=REPO, **env_extra)
    cmd = ["unshare", "--mount", "--pid", "--fork", "--kill-child", "--propagation", "private", "sh", "-c",
           shell.format(py=sys.executable, script=script, hostproc=tmp_path / "hostproc")]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        first = json.loads(proc.stdout.readline())
        sleeper = _wait_for_child(psutil.Process(proc.pid), "sleep")
        proc.stdin.write(f"{sleeper.pid}\n")
        proc.stdin.flush()
        second = json.loads(proc.stdout.readline())
        return first, second, sleeper.pid
    finally:
        proc.kill()
        proc.wait()


@needs_unshare
def test_an_agent_in_its_own_namespace_maps_host_pids_through_the_host_proc(tmp_path):
    (tmp_path / "hostproc").mkdir()
    first, second, host_pid = _run_in_namespace(
        tmp_path, "mount --bind /proc {hostproc} && mount -t proc proc /proc && exec {py} {script}",
        {"GPUDIAG_HOST_PROC": str(tmp_path / "hostproc")})
    assert second["host_ns"] is False and second["mode"] == "host-proc"
    assert host_pid != first["child"]
    assert second["mapped"][0] == first["child"]
    (row,) = second["rows"]
    assert row["pid"] == first["child"] and row["host_pid"] == host_pid and row["pid_mapped"] is True


@needs_unshare
def test_an_agent_that_cannot_see_host_pids_says_what_to_change(tmp_path):
    _, second, host_pid = _run_in_namespace(
        tmp_path, "mount -t proc proc /proc && exec {py} {script}",
        {"GPUDIAG_HOST_PROC": str(tmp_path / "no-such-dir")})
    assert second["mode"] == "unmappable"
    assert "hostPID: true" in second["status"]["reason"]
    assert second["mapped"] == [None, None]
    (row,) = second["rows"]
    assert row["pid_mapped"] is False and row["pid"] == host_pid


# --- a real device ----------------------------------------------------------------------


@pytest.mark.gpu
def test_a_real_gpu_is_read():
    probe = NvmlProbe()
    try:
        frames = probe.sample(time.time())
        status = probe.status()
    finally:
        probe.close()
    assert status["available"], status["reason"]
    gpus = _rows(frames, "gpu")
    assert gpus and all(g["uuid"].startswith(("GPU-", "MIG-")) for g in gpus)
    for g in gpus:
        assert g[M.gpu_memory_total_bytes] > 0
        assert 0.0 <= g[M.gpu_utilization_ratio] <= 1.0
        assert g[M.gpu_sm_clock_max_hertz] > 1e8
        assert g["driver_version"]
    assert status["driver_version"] and status["cuda_driver_version"]
