"""The in-process reporter and its discovery by the agent.

With the CPU build of torch installed here, ``instrument()`` takes its no-op
path for real. The reporting path needs CUDA, which this machine has no
driver for, so those tests replace the few ``torch.cuda`` functions the
reporter calls (the CUDA boundary) and run everything else for real: the
thread, the files, the rename, the agent's discovery and checks.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from types import SimpleNamespace

import pytest
import torch

from gpudiag.catalog import M
from gpudiag.probes import torch_reporter
from gpudiag.probes.base import proc_start_ticks
from gpudiag.probes.torch_probe import TorchProbe, default_runtime_dirs
from gpudiag.probes.torch_reporter import instrument, report_path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIB = 1 << 20


@pytest.fixture(autouse=True)
def _stop_reporter():
    yield
    torch_reporter.stop()


@pytest.fixture
def runtime_dir(tmp_path):
    d = tmp_path / "rt"
    d.mkdir(mode=0o700)
    return str(d)


def _wait(predicate, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError("condition not reached")


def _read(path):
    try:
        with open(path) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


class FakeCuda:
    """The torch.cuda functions the reporter calls, for two devices of which the process uses one."""

    def __init__(self, monkeypatch, initialised=True):
        self.stats = {0: {"allocated_bytes.all.current": 300 * MIB, "reserved_bytes.all.current": 512 * MIB,
                          "active_bytes.all.current": 310 * MIB, "inactive_split_bytes.all.current": 40 * MIB,
                          "requested_bytes.all.current": 290 * MIB, "segment.all.current": 7,
                          "num_alloc_retries": 2, "num_ooms": 0},
                      1: {"reserved_bytes.all.current": 0}}
        self.initialised = initialised
        self.init_calls = 0
        self.raise_on_stats: Exception | None = None
        monkeypatch.setattr(torch.version, "cuda", "12.4")
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: self.initialised)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "memory_stats", self._memory_stats)
        monkeypatch.setattr(torch.cuda, "get_device_properties",
                            lambda d: SimpleNamespace(uuid=f"0000000{d}-aaaa-bbbb-cccc-dddddddddddd",
                                                      name="NVIDIA A100-SXM4-80GB"))
        monkeypatch.setattr(torch.cuda.memory, "_snapshot", lambda: {"segments": [{"total_size": 512 * MIB}],
                                                                     "device_traces": []})
        monkeypatch.setattr(torch.cuda, "init", self._init)
        monkeypatch.setattr(torch.cuda, "_lazy_init", self._init)

    def _init(self):
        self.init_calls += 1

    def _memory_stats(self, device):
        if self.raise_on_stats is not None:
            raise self.raise_on_stats
        return dict(self.stats[device])


# --- the reporter --------------------------------------------------------------------


def test_without_cuda_instrument_is_a_no_op_with_one_log_line(runtime_dir, caplog):
    assert torch.version.cuda is None, "this test is about the CPU build of torch"
    with caplog.at_level(logging.INFO, logger="gpudiag.instrument"):
        assert instrument(runtime_dir=runtime_dir) is None
    lines = [r for r in caplog.records if r.name == "gpudiag.instrument"]
    assert len(lines) == 1 and "without CUDA" in lines[0].getMessage()
    assert os.listdir(runtime_dir) == []
    assert not any(t.name == "gpudiag-reporter" for t in __import__("threading").enumerate())


def test_gpudiag_instrument_forwards_to_the_reporter(runtime_dir):
    import gpudiag

    assert gpudiag.instrument(runtime_dir=runtime_dir) is None  # CPU torch: the no-op path


def test_the_reporter_publishes_the_allocator_figures_to_a_file(monkeypatch, runtime_dir):
    cuda = FakeCuda(monkeypatch)
    reporter = instrument(runtime_dir=runtime_dir, interval_s=0.05)
    assert reporter is not None and reporter._thread.daemon
    path = report_path(runtime_dir, os.getpid())
    report = _wait(lambda: _read(path))
    assert report["pid"] == os.getpid() and report["start_ticks"] == proc_start_ticks(os.getpid())
    (device,) = report["devices"]  # device 1 holds nothing: not listed
    assert device["device"] == 0 and device["gpu"] == 0
    assert device["uuid"] == "GPU-00000000-aaaa-bbbb-cccc-dddddddddddd"
    assert device[M.process_torch_allocated_bytes] == 300 * MIB
    assert device[M.process_torch_reserved_bytes] == 512 * MIB
    assert device[M.process_torch_inactive_split_bytes] == 40 * MIB
    assert device[M.process_torch_alloc_retries_total] == 2 and device[M.process_torch_ooms_total] == 0
    cuda.stats[0]["allocated_bytes.all.current"] = 400 * MIB
    _wait(lambda: (_read(path) or {}).get("devices", [{}])[0].get(M.process_torch_allocated_bytes) == 400 * MIB)
    assert [n for n in os.listdir(runtime_dir) if n.endswith(".tmp")] == []  # renamed into place
    assert instrument(runtime_dir=runtime_dir) is reporter  # once per process
    torch_reporter.stop()
    assert not os.path.exists(path), "a clean stop removes the report"
    assert cuda.init_calls == 0


def test_a_forked_child_leaves_its_parents_report_alone(monkeypatch, runtime_dir):
    FakeCuda(monkeypatch)
    instrument(runtime_dir=runtime_dir, interval_s=0.05)
    path = report_path(runtime_dir, os.getpid())
    _wait(lambda: _read(path))
    child = os.fork()
    if child == 0:  # as a data-loader worker exits: through the normal interpreter exit
        torch_reporter.stop()
        os._exit(0 if torch_reporter._active is None else 1)
    _, status = os.waitpid(child, 0)
    assert os.WEXITSTATUS(status) == 0
    assert os.path.exists(path), "the child removed its parent's report"


def test_cuda_not_yet_initialised_is_never_initialised_by_the_reporter(monkeypatch, runtime_dir):
    cuda = FakeCuda(monkeypatch, initialised=False)
    instrument(runtime_dir=runtime_dir, interval_s=0.05)
    report = _wait(lambda: _read(report_path(runtime_dir, os.getpid())))
    assert report["devices"] == []
    time.sleep(0.15)
    assert cuda.init_calls == 0, "the reporter must not initialise CUDA (it would poison fork)"
    cuda.initialised = True
    _wait(lambda: (_read(report_path(runtime_dir, os.getpid())) or {}).get("devices"))


def test_visible_devices_are_translated_to_nvml_indices(monkeypatch, runtime_dir):
    FakeCuda(monkeypatch)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    instrument(runtime_dir=runtime_dir, interval_s=0.05)
    report = _wait(lambda: _read(report_path(runtime_dir, os.getpid())))
    assert report["devices"][0]["gpu"] == 3


def test_a_failing_allocator_query_never_reaches_the_host_process(monkeypatch, runtime_dir):
    cuda = FakeCuda(monkeypatch)
    cuda.raise_on_stats = RuntimeError("CUDA error: an illegal memory access was encountered")
    reporter = instrument(runtime_dir=runtime_dir, interval_s=0.05)
    report = _wait(lambda: _read(report_path(runtime_dir, os.getpid())))
    assert "illegal memory access" in report["error"] and report["devices"] == []
    time.sleep(0.15)
    assert reporter._thread.is_alive()


def test_a_snapshot_is_written_on_request(monkeypatch, runtime_dir):
    FakeCuda(monkeypatch)
    instrument(runtime_dir=runtime_dir, interval_s=0.05)
    path = report_path(runtime_dir, os.getpid())
    _wait(lambda: _read(path))
    probe = TorchProbe([runtime_dir])
    probe.sample(0.0)
    request = probe.request_snapshot(os.getpid())
    assert os.path.exists(request) or _read(path)
    snap = _wait(lambda: (_read(path) or {}).get("snapshot"))
    assert "error" not in snap, snap
    assert os.path.dirname(snap["path"]) == runtime_dir and os.path.getsize(snap["path"]) == snap["bytes"]
    with open(snap["path"], "rb") as fh:
        assert fh.read(1) == b"\x80"  # a pickle, as torch writes snapshots
    assert not os.path.exists(request)
    assert oct(os.stat(snap["path"]).st_mode & 0o777) == "0o600"


@pytest.mark.parametrize("plant", ["symlink", "world-writable", "foreign-owner"])
def test_a_planted_runtime_directory_is_refused(monkeypatch, tmp_path, plant, caplog):
    FakeCuda(monkeypatch)
    target = tmp_path / "rt"
    if plant == "symlink":
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir(mode=0o700)
        target.symlink_to(elsewhere)
    elif plant == "world-writable":
        target.mkdir()
        target.chmod(0o777)
    else:
        if os.geteuid() != 0:
            pytest.skip("chown to another user needs root")
        target.mkdir(mode=0o700)
        os.chown(target, 65534, 65534)
    with caplog.at_level(logging.WARNING, logger="gpudiag.instrument"):
        assert instrument(runtime_dir=str(target), interval_s=0.05) is None
    assert "refusing" in caplog.text
    real = os.path.realpath(target)
    assert not any(n.startswith("torch-") for n in os.listdir(real))


def test_a_source_other_than_torch_can_publish_the_same_report(runtime_dir):
    stats = [{"device": 0, "gpu": 0, "uuid": "GPU-sim-0", M.process_torch_allocated_bytes: 1 * MIB,
              M.process_torch_reserved_bytes: 2 * MIB}]
    reporter = instrument(runtime_dir=runtime_dir, interval_s=0.05, stats_source=lambda: stats)
    assert reporter is not None
    report = _wait(lambda: _read(report_path(runtime_dir, os.getpid())))
    assert report["devices"] == stats


# --- the agent side ------------------------------------------------------------------


def _report(pid, **overrides):
    body = {"schema": 1, "pid": pid, "uid": os.geteuid(), "start_ticks": proc_start_ticks(pid), "process": "train",
            "interval_s": 1.0, "t": time.time(),
            "devices": [{"device": 0, "uuid": "GPU-x", M.process_torch_allocated_bytes: 10 * MIB,
                         M.process_torch_reserved_bytes: 16 * MIB}], "snapshot": None, "error": None}
    body.update(overrides)
    return body


def _write(runtime_dir, pid, body):
    path = report_path(runtime_dir, pid)
    with open(path, "w") as fh:
        fh.write(body if isinstance(body, str) else json.dumps(body))
    return path


def test_the_agent_finds_a_live_reporter_and_yields_white_and_grey(runtime_dir):
    stats = [{"device": 0, "uuid": "GPU-x", M.process_torch_allocated_bytes: 10 * MIB,
              M.process_torch_reserved_bytes: 16 * MIB, "bogus_column": 5}]
    instrument(runtime_dir=runtime_dir, interval_s=0.05, stats_source=lambda: stats)
    _wait(lambda: _read(report_path(runtime_dir, os.getpid())))
    probe = TorchProbe([runtime_dir], gpu_index_by_uuid=lambda: {"GPU-x": 6})
    (frame,) = probe.sample(1.0)
    (row,) = frame.rows
    assert (row["gpu"], row["uuid"], row["pid"]) == (6, "GPU-x", os.getpid())
    assert row[M.process_torch_allocated_bytes] == 10 * MIB and row[M.process_torch_reserved_bytes] == 16 * MIB
    assert "bogus_column" not in row
    assert probe.status()["available"] and probe.status()["reporters"][0]["pid"] == os.getpid()


def test_the_configured_runtime_directory_is_searched_whatever_its_name(monkeypatch):
    # /tmp/gpudiag-* directories found by globbing are taken only when per-uid (another user could
    # plant the rest); the one GPUDIAG_RUNTIME_DIR names is the reporter's, and the probe reads it.
    configured = tempfile.mkdtemp(prefix="gpudiag-node-", dir="/tmp")
    try:
        monkeypatch.setenv(torch_reporter.RUNTIME_DIR_ENV, configured)
        instrument(interval_s=0.05, stats_source=lambda: [{"device": 0, "uuid": "GPU-x",
                                                            M.process_torch_allocated_bytes: MIB}])
        _wait(lambda: _read(report_path(configured, os.getpid())))
        assert configured in default_runtime_dirs()
        (frame,) = TorchProbe().sample(1.0)
        assert [row["pid"] for row in frame.rows] == [os.getpid()]
    finally:
        torch_reporter.stop()
        shutil.rmtree(configured, ignore_errors=True)


def test_reports_of_dead_or_reused_pids_are_ignored(runtime_dir):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    _write(runtime_dir, gone.pid, _report(gone.pid, start_ticks=123))
    _write(runtime_dir, os.getpid(), _report(os.getpid(), start_ticks=proc_start_ticks(os.getpid()) - 1))
    probe = TorchProbe([runtime_dir])
    assert probe.sample(0.0)[0].rows == []
    ignored = probe.status()["ignored"]
    assert all("is gone" in why for why in ignored.values()) and len(ignored) == 2


def test_a_report_that_stopped_updating_gives_reasons_not_figures(runtime_dir):
    _write(runtime_dir, os.getpid(), _report(os.getpid(), t=time.time() - 120))
    (row,) = TorchProbe([runtime_dir]).sample(0.0)[0].rows
    assert M.process_torch_allocated_bytes not in row
    assert "has not written for" in row["white_missing_reason"]


@pytest.mark.parametrize("hostile", ["symlink", "not-json", "pid-mismatch", "too-large", "foreign-owner"])
def test_hostile_report_files_are_ignored(runtime_dir, tmp_path, hostile):
    pid = os.getpid()
    path = report_path(runtime_dir, pid)
    if hostile == "symlink":
        real = tmp_path / "elsewhere.json"
        real.write_text(json.dumps(_report(pid)))
        os.symlink(real, path)
    elif hostile == "not-json":
        _write(runtime_dir, pid, "\x80\x04 not json")
    elif hostile == "pid-mismatch":
        _write(runtime_dir, pid, _report(1))
    elif hostile == "too-large":
        _write(runtime_dir, pid, _report(pid, padding="x" * (2 << 20)))
    else:
        if os.geteuid() != 0:
            pytest.skip("chown to another user needs root")
        _write(runtime_dir, pid, _report(pid))
        os.chown(path, 65534, 65534)  # another user claiming this (root's) process
    probe = TorchProbe([runtime_dir])
    assert probe.sample(0.0)[0].rows == []
    assert path in probe.status()["ignored"]


def test_a_snapshot_request_for_an_unknown_pid_is_a_user_error(runtime_dir):
    from gpudiag.errors import GpudiagError

    probe = TorchProbe([runtime_dir])
    probe.sample(0.0)
    with pytest.raises(GpudiagError, match="instrument"):
        probe.request_snapshot(999999)


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="creating a PID namespace needs root and util-linux unshare")
def test_a_reporter_inside_a_container_is_joined_to_its_host_pid(runtime_dir):
    code = textwrap.dedent(f"""
        import os, time
        from gpudiag.probes.torch_reporter import instrument
        r = instrument(runtime_dir={runtime_dir!r}, interval_s=0.05,
                       stats_source=lambda: [{{"device": 0, "uuid": "GPU-c", "{M.process_torch_reserved_bytes}": 1}}])
        print(os.getpid(), flush=True)
        time.sleep(30)
    """)
    proc = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", "--mount-proc", sys.executable, "-c", code],
                            stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=REPO))
    try:
        inner_pid = int(proc.stdout.readline())
        assert inner_pid == 1
        _wait(lambda: _read(report_path(runtime_dir, inner_pid)))
        probe = TorchProbe([runtime_dir])
        (row,) = probe.sample(0.0)[0].rows
        import psutil

        host_pids = {p.pid for p in psutil.Process(proc.pid).children(recursive=True)}
        assert row["pid"] in host_pids and row["pid"] != inner_pid
        assert probe.status()["reporters"][0]["reported_pid"] == 1
    finally:
        proc.kill()
        proc.wait()
