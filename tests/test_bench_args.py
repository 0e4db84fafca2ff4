"""The node benchmarks refuse a load they cannot make, in one line, before they start anything; node_e2e runs
end to end on the CPU."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from gpudiag.catalog import CATALOG, M

BENCH = Path(__file__).resolve().parent.parent / "bench" / "bench_agent.py"
NODE_E2E = Path(__file__).resolve().parent.parent / "bench" / "node_e2e.py"
BENCH_EBPF = Path(__file__).resolve().parent.parent / "bench" / "bench_ebpf.py"


def _bench_ebpf():
    """bench/bench_ebpf.py as a module (bench/ is not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_ebpf", BENCH_EBPF)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("args", [["--engine-interval-s", "0"], ["--requests-per-s", "-1"]])
def test_the_agent_benchmark_refuses_a_load_it_cannot_make(args):
    got = subprocess.run([sys.executable, str(BENCH), "--minutes", "0.01", *args],
                         capture_output=True, text=True, timeout=120)
    assert got.returncode == 2
    assert "Traceback" not in got.stderr
    assert "--engine-interval-s must be at least 1" in got.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("args,message", [(["--load-s", "0"], "--load-s must be at least 1"),
                                          (["--clients", "0"], "--clients must be at least 1")])
def test_the_node_benchmark_refuses_a_load_it_cannot_make(args, message):
    got = subprocess.run([sys.executable, str(NODE_E2E), *args], capture_output=True, text=True, timeout=120)
    assert got.returncode == 2 and "Traceback" not in got.stderr
    assert message in got.stderr.strip().splitlines()[-1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_node_benchmark_serves_on_the_cpu_and_the_agent_exports_the_engines_memory(tmp_path):
    out = tmp_path / "node.json"
    got = subprocess.run([sys.executable, str(NODE_E2E), "--device", "cpu", "--load-s", "4", "--clients", "2",
                          "--max-tokens", "8", "--engine-port", str(_free_port()), "--agent-port", str(_free_port()),
                          "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert got.returncode == 0, got.stdout + got.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["requests_ok"] > 0 and res["request_errors"] == 0
    # The engine's allocator figures reach the agent through the runtime directory it was given.
    assert res["series"][CATALOG[M.process_torch_allocated_bytes].name]
    assert res["series"][CATALOG[M.engine_batch_size].name]
    assert res["agent_rc"] == 0 and res["engine_rc"] == 0 and res["engine_log_tracebacks"] == 0
    assert res["investigate_rc"] in (0, 3) and res["top_rc"] == 0  # nothing of warning level; 3: inconclusive


@pytest.mark.parametrize("busy,message", [("engine", "the engine did not come up"),
                                          ("agent", "the agent did not come up")])
def test_the_node_benchmark_says_in_one_line_which_part_did_not_come_up(busy, message):
    # The port of one part is taken: that part exits, and the benchmark says so and stops the other.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        ports = {"engine": port, "agent": str(_free_port())} if busy == "engine" \
            else {"engine": str(_free_port()), "agent": port}
        got = subprocess.run([sys.executable, str(NODE_E2E), "--device", "cpu", "--engine-port", ports["engine"],
                              "--agent-port", ports["agent"]], capture_output=True, text=True, timeout=600)
    assert got.returncode == 1
    assert got.stderr.strip().splitlines()[-1] == f"node_e2e: {message}"
    assert "Traceback" not in got.stderr  # each part refused its port in one line too


def test_the_agent_benchmarks_peak_rss_counts_a_moment_its_samples_miss():
    import importlib.util

    import numpy as np

    spec = importlib.util.spec_from_file_location("bench_agent_for_test", BENCH)
    bench = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(BENCH.parent))
    try:
        spec.loader.exec_module(bench)
    finally:
        sys.path.remove(str(BENCH.parent))
    assert bench.reset_peak_rss(), "this kernel lets a process reset its VmHWM (/proc/self/clear_refs)"
    before = bench.rss_bytes()
    burst = np.ones(64 * 1024**2 // 8)  # 64 MiB, touched, then freed: between any two samples
    del burst
    peak = bench.peak_rss_bytes()
    assert peak is not None and peak - before >= 60 * 1024**2
    assert bench.rss_bytes() < peak - 48 * 1024**2  # gone again: a sample now would not see it


def test_the_ebpf_benchmark_names_each_figure_that_fell_short_and_in_which_run():
    bench = _bench_ebpf()
    full = {"api": "cuLaunchKernel", "counted": 100_000, "untimed": 0, "drops": {}}
    runs = [full, {**full, "counted": 99_812, "drops": {"inflight": 188}}, {**full, "untimed": 100_000}]
    assert bench.shortfalls([full, full], 100_000) == []
    assert bench.shortfalls(runs, 100_000) == [
        "cuLaunchKernel: counted 99,812 of 100,000 in run 2",
        "cuLaunchKernel: 188 not recorded by the kernel (inflight) in run 2",
        "cuLaunchKernel: 100,000 of 100,000 counted at their return only (entry program not run: no latency) in run 3",
    ]


@pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc is not installed (scripts/system-deps.d/10-ebpf.sh)")
def test_the_ebpf_benchmark_stops_when_the_call_loop_does_not_run_what_it_was_asked(tmp_path):
    bench = _bench_ebpf()
    lib, loop = bench.build(tmp_path)
    got = bench.run_loop(loop, lib, "launch", 1000)
    assert got["api"] == "cuLaunchKernel" and got["ns_per_call"] > 0
    for api, calls in (("lunch", 1000), ("memcpy", 0)):
        with pytest.raises(bench.LoopMismatch, match="the call loop did not start"):
            bench.run_loop(loop, lib, api, calls)
    res = subprocess.run([sys.executable, str(BENCH_EBPF), "--calls", "0"], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 2 and "--calls and --runs must be at least 1" in res.stderr


ALLOC_GPU = Path(__file__).resolve().parent.parent / "bench" / "alloc_gpu.py"


def test_the_allocator_benchmark_checks_its_arithmetic_and_refuses_a_changed_allocator():
    got = subprocess.run([sys.executable, str(ALLOC_GPU), "--cpu-selftest"], capture_output=True, text=True,
                         timeout=120)
    assert got.returncode == 0 and "self-test passed" in got.stdout, got.stdout + got.stderr
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    got = subprocess.run([sys.executable, str(ALLOC_GPU)], capture_output=True, text=True, timeout=120, env=env)
    assert got.returncode == 2 and "Traceback" not in got.stderr
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True changes the allocator" in got.stderr.strip()


def test_the_allocator_benchmark_says_it_needs_a_gpu():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is here: the benchmark would measure it, which is bench/alloc_gpu.py's job")
    got = subprocess.run([sys.executable, str(ALLOC_GPU)], capture_output=True, text=True, timeout=120)
    assert got.returncode == 0 and "needs a CUDA GPU" in got.stdout, got.stdout + got.stderr
