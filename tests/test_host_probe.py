"""The host probe on real processes: the busy thread is named, first ticks have no made-up CPU figures."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from gpudiag.catalog import M
from gpudiag.probes.host import HostProbe

# A stand-in for a CPU-starved serving process: one thread, named like a
# tokenizer pool's, spins; the main thread sleeps.
_SPINNER = textwrap.dedent("""
    import ctypes, threading, time, sys
    def spin():
        ctypes.CDLL(None).prctl(15, b"tokenizer", 0, 0, 0)  # PR_SET_NAME: the kernel's thread name
        while True:
            pass
    threading.Thread(target=spin, daemon=True).start()
    print("ready", flush=True)
    time.sleep(60)
""")


@pytest.fixture
def spinner():
    proc = subprocess.Popen([sys.executable, "-c", _SPINNER], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    yield proc
    proc.kill()
    proc.wait()


def _rows(frames, kind):
    return [r for f in frames if f.kind == kind for r in f.rows]


def _two_ticks(probe, gap_s=0.6):
    probe.sample(time.monotonic())
    time.sleep(gap_s)
    return probe.sample(time.monotonic())


def test_the_thread_that_starves_the_gpu_is_named(spinner):
    probe = HostProbe(targets=lambda: [{"gpu": 0, "uuid": "GPU-a", "pid": spinner.pid, "process": "python"}])
    (row,) = _rows(_two_ticks(probe), "process")
    busiest = row["top_threads"][0]
    assert busiest["name"] == "tokenizer"
    assert busiest["cpu_ratio"] == row[M.process_thread_cpu_max_ratio]
    assert all(t["cpu_ratio"] <= busiest["cpu_ratio"] for t in row["top_threads"])
    assert busiest["cpu_ratio"] > 0.0
    assert row[M.process_cpu_utilization_ratio] >= busiest["cpu_ratio"] * 0.9
    assert row[M.process_resident_memory_bytes] > 1 << 20
    switches = row[M.process_context_switches_total]
    assert set(switches) == {"voluntary", "involuntary"} and all(isinstance(v, int) for v in switches.values())
    assert (row["gpu"], row["uuid"], row["pid"]) == (0, "GPU-a", spinner.pid)


def test_a_process_seen_for_the_first_time_has_no_cpu_figure_yet(spinner):
    probe = HostProbe(targets=lambda: [{"gpu": 0, "uuid": "GPU-a", "pid": spinner.pid}])
    (row,) = _rows(probe.sample(time.monotonic()), "process")
    assert M.process_cpu_utilization_ratio not in row and "top_threads" not in row
    assert row[M.process_resident_memory_bytes] > 0
    assert row["process"] == "python" or row["process"].startswith("python")


def test_one_process_on_two_gpus_gets_a_row_per_gpu_with_the_same_host_figures(spinner):
    targets = [{"gpu": 0, "uuid": "GPU-a", "pid": spinner.pid}, {"gpu": 1, "uuid": "GPU-b", "pid": spinner.pid}]
    rows = _rows(_two_ticks(HostProbe(targets=lambda: targets)), "process")
    assert [r["gpu"] for r in rows] == [0, 1]
    assert rows[0][M.process_cpu_utilization_ratio] == rows[1][M.process_cpu_utilization_ratio]


def test_processes_that_are_gone_or_not_visible_are_skipped():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    targets = [{"gpu": 0, "pid": dead.pid}, {"gpu": 0, "pid": 4242, "pid_mapped": False}]
    probe = HostProbe(targets=lambda: targets)
    assert _rows(probe.sample(0.0), "process") == []
    assert probe.status()["available"] is True


def test_the_node_row_has_cpu_load_memory_and_swap():
    probe = HostProbe()
    (node,) = _rows(_two_ticks(probe, 0.3), "node")
    assert 0.0 <= node[M.node_cpu_utilization_ratio] <= 1.0
    assert node[M.node_memory_total_bytes] == psutil.virtual_memory().total
    assert 0 < node[M.node_memory_used_bytes] <= node[M.node_memory_total_bytes]
    assert node[M.node_swap_used_bytes] >= 0
    assert node[M.node_load1] == pytest.approx(os.getloadavg()[0], abs=2.0)

