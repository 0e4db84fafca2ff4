"""The eBPF CUDA API probes, with real eBPF against real processes.

Without a driver the real libcudart fails every call with 35 (cudaErrorInsufficientDriver)
but the uprobes still see each call with its arguments and return code. Driver-API
probes run against a shim libcuda built here with gcc (tests/ebpf/cuda_driver_shim.c),
called by a C program whose script of calls is known (tests/ebpf/driver_workload.c).

Tests that load BPF programs need root and bcc and skip with the reason otherwise; CI
runs them as root after scripts/system-deps.d/10-ebpf.sh.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
from ebpf_support import EBPF_SKIP, needs_ebpf

from gpudiag.catalog import CATALOG, M
from gpudiag.errors import GpudiagError
from gpudiag.probes import cuda_libs, ebpf_readiness
from gpudiag.probes.cuda_ebpf import (
    CUDA_APIS,
    CudaApiProbe,
    percentile_from_log2,
    prometheus_histogram,
    render_program,
)

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ROOT / "tests" / "ebpf"
CUDART = "/usr/local/cuda/lib64/libcudart.so.13"
MiB, KiB = 1 << 20, 1 << 10
WAIT_S = 20  # generous bound on waiting for a process line; never a timing assertion

# The script of tests/ebpf/driver_workload.c: API -> (calls, errors by code, bytes).
DRIVER_EXPECTED = {
    "cuModuleGetFunction": (2, {}, 0),
    "cuMemAlloc_v2": (14, {"2": 1}, 55 * MiB + (2 << 30) + 3 * 64 * KiB),
    "cuMemFree_v2": (11, {"1": 1}, 55 * MiB),
    "cuMemAllocAsync": (1, {}, 4096),
    "cuMemFreeAsync": (1, {}, 4096),
    "cuMemcpyHtoDAsync_v2": (5, {}, 5 * 1000),
    "cuMemcpyDtoHAsync_v2": (3, {}, 3 * 2000),
    "cuMemcpyDtoDAsync_v2": (2, {}, 2 * 3000),
    "cuLaunchKernel": (11, {"1": 1}, 0),
    "cuLaunchKernelEx": (2, {}, 0),
    "cuStreamSynchronize": (5, {}, 0),  # the _ptsz call, which calls the plain one inside, counts once
    "cuCtxSynchronize": (1, {}, 0),
}
DRIVER_LAUNCHES = {
    ("gemm_kernel", (128, 8, 1), (256, 1, 1), 0, 7),
    ("flash_attn_bwd", (1, 1, 1), (128, 1, 1), 4096, 3),
    ("gemm_kernel", (1, 1, 1), (2048, 1, 1), 0, 1),
    ("gemm_kernel", (64, 1, 1), (128, 1, 1), 0, 2),
}
LEAKED = (3 * 64 * KiB, 3)  # bytes, allocations: leak_scratch_buffer() never frees them

# Calls the real libcudart through ctypes and prints [[api, return code], ...].
CUDART_WORKLOAD = r"""
import ctypes, json, sys
lib = ctypes.CDLL(sys.argv[1])
class dim3(ctypes.Structure):
    _fields_ = [("x", ctypes.c_uint), ("y", ctypes.c_uint), ("z", ctypes.c_uint)]
vp, sz = ctypes.c_void_p, ctypes.c_size_t
lib.cudaLaunchKernel.argtypes = [vp, dim3, dim3, ctypes.POINTER(vp), sz, vp]
lib.cudaMemcpy.argtypes = [vp, vp, sz, ctypes.c_int]
lib.cudaMemcpyAsync.argtypes = [vp, vp, sz, ctypes.c_int, vp]
lib.cudaMalloc.argtypes = [ctypes.POINTER(vp), sz]
lib.cudaMallocAsync.argtypes = [ctypes.POINTER(vp), sz, vp]
lib.cudaMallocManaged.argtypes = [ctypes.POINTER(vp), sz, ctypes.c_uint]
lib.cudaFree.argtypes = [vp]
lib.cudaFreeAsync.argtypes = [vp, vp]
lib.cudaStreamSynchronize.argtypes = [vp]
lib.cudaGraphLaunch.argtypes = [vp, vp]
buf, out = ctypes.create_string_buffer(4096), vp()
calls = []
def call(name, *args):
    calls.append((name, getattr(lib, name)(*args)))
print("ready", flush=True)
sys.stdin.readline()
for n in (1 << 20, 2 << 20, 3 << 20):
    call("cudaMalloc", ctypes.byref(out), n)
call("cudaMallocManaged", ctypes.byref(out), 4096, 1)
for _ in range(2):
    call("cudaMallocAsync", ctypes.byref(out), 8192, None)
call("cudaFree", vp(0x7f0000000000))
call("cudaFreeAsync", vp(0x7f0000000000), None)
for _ in range(4):
    call("cudaMemcpy", buf, buf, 256, 1)          # cudaMemcpyHostToDevice
for _ in range(2):
    call("cudaMemcpyAsync", buf, buf, 512, 2, None)  # cudaMemcpyDeviceToHost
stub = ctypes.cast(lib.cudaFree, vp)
call("cudaLaunchKernel", stub, dim3(1, 1, 1), dim3(32, 1, 1), None, 1024, None)
call("cudaLaunchKernel", stub, dim3(64, 2, 3), dim3(128, 2, 1), None, 0, None)
call("cudaStreamSynchronize", None)
call("cudaDeviceSynchronize")
call("cudaGraphLaunch", None, None)
print(json.dumps(calls), flush=True)
sys.stdin.readline()
"""


needs_cudart = pytest.mark.skipif(not os.path.exists(CUDART), reason=f"{CUDART} (CUDA 13 toolkit) is not installed")


@pytest.fixture(scope="module")
def built():
    """The shim, the workload and the call loop, built with gcc in a directory anyone may read."""
    if shutil.which("gcc") is None:
        pytest.skip("gcc is not installed (scripts/system-deps.d/10-ebpf.sh installs it)")
    out = Path(tempfile.mkdtemp(prefix="gpudiag-ebpf-"))
    out.chmod(0o755)
    cmds = [
        ["gcc", "-shared", "-fPIC", "-O2", "-fno-omit-frame-pointer", "-o", out / "libcuda.so.1",
         SOURCES / "cuda_driver_shim.c"],
        ["gcc", "-O0", "-g", "-fno-omit-frame-pointer", "-o", out / "driver_workload",
         SOURCES / "driver_workload.c", "-ldl"],
        ["gcc", "-O2", "-o", out / "call_loop", SOURCES / "call_loop.c", "-ldl"],
    ]
    for cmd in cmds:
        subprocess.run(list(map(str, cmd)), check=True, capture_output=True)
    yield out
    shutil.rmtree(out, ignore_errors=True)


def fresh_shim(built: Path) -> str:
    """A new copy of the shim: a distinct file (inode), so no earlier attach covers it."""
    d = Path(tempfile.mkdtemp(dir=built))
    d.chmod(0o755)
    shutil.copy(built / "libcuda.so.1", d / "libcuda.so.1")
    return str(d / "libcuda.so.1")


class Proc:
    """A child process driven line by line over stdin/stdout."""

    def __init__(self, argv: list[str]):
        self.p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.pid = self.p.pid

    def expect(self, prefix: str) -> str:
        line = self.p.stdout.readline()
        assert line.startswith(prefix), f"expected {prefix!r} from pid {self.pid}, got {line!r}"
        return line

    def send(self, line: str = "go") -> None:
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()

    def finish(self) -> int:
        try:
            self.p.stdin.close()
        except BrokenPipeError:
            pass
        return self.p.wait(timeout=WAIT_S)


def workload(built: Path, lib: str, *options: str) -> Proc:
    """The driver workload on ``lib``; reads its "pid" line."""
    proc = Proc([str(built / "driver_workload"), lib, *options])
    proc.expect("pid")
    return proc


def process_entry(snap: dict, pid: int) -> dict:
    """The snapshot's record of one process."""
    for p in snap["processes"]:
        if p["pid"] == pid:
            return p
    raise AssertionError(f"pid {pid} not in the snapshot: {[p['pid'] for p in snap['processes']]}")


def assert_driver_script(entry: dict, *, launches: bool = True) -> None:
    """Every count of the driver workload's script, exactly."""
    expected = {k: v for k, v in DRIVER_EXPECTED.items() if launches or "Launch" not in k}
    got = {api: (r["calls"], r["errors"], r["bytes"]) for api, r in entry["apis"].items()}
    assert got == expected
    if launches:
        shapes = {(x["function"], tuple(x["grid"]), tuple(x["block"]), x["shared_mem_bytes"], x["count"])
                  for x in entry["launches"]}
        assert shapes == DRIVER_LAUNCHES
    kinds = {api: r.get("kinds") for api, r in entry["apis"].items() if "Memcpy" in api}
    assert kinds == {"cuMemcpyHtoDAsync_v2": {"HtoD": {"calls": 5, "bytes": 5000}},
                     "cuMemcpyDtoHAsync_v2": {"DtoH": {"calls": 3, "bytes": 6000}},
                     "cuMemcpyDtoDAsync_v2": {"DtoD": {"calls": 2, "bytes": 6000}}}


def assert_leak_found(entry: dict) -> None:
    """The three allocations of leak_scratch_buffer(), and only they, are outstanding, by stack."""
    assert [(o["bytes"], o["count"]) for o in entry["outstanding"]] == [LEAKED]
    stack = entry["outstanding"][0]["stack"]
    assert stack[0].startswith("leak_scratch_buffer+"), stack
    assert any(f.startswith("run_workload+") for f in stack) and any(f.startswith("main+") for f in stack)
    assert entry["outstanding_bytes"] == LEAKED[0]


@pytest.fixture(scope="module")
def probe():
    """One probe for the module (compiling costs seconds); each test probes its own processes."""
    if EBPF_SKIP:
        pytest.skip(EBPF_SKIP)
    p = CudaApiProbe([]).start()
    yield p
    p.close()


# ---- the real CUDA runtime ---------------------------------------------------------------


@needs_ebpf
@needs_cudart
def test_real_libcudart_calls_are_counted_with_their_sizes_and_return_codes(probe):
    proc = Proc([sys.executable, "-c", CUDART_WORKLOAD, CUDART])
    proc.expect("ready")
    probe.add_process(proc.pid)
    proc.send()
    truth = json.loads(proc.p.stdout.readline())
    snap = probe.snapshot()
    proc.finish()
    entry = process_entry(snap, proc.pid)

    expected_calls, expected_errors = {}, {}
    for api, code in truth:
        expected_calls[api] = expected_calls.get(api, 0) + 1
        if code:
            errs = expected_errors.setdefault(api, {})
            errs[str(code)] = errs.get(str(code), 0) + 1
    assert {code for _, code in truth} == {35}  # no driver here: cudaErrorInsufficientDriver
    assert {a: r["calls"] for a, r in entry["apis"].items()} == expected_calls
    assert {a: r["errors"] for a, r in entry["apis"].items()} == expected_errors
    bytes_by_api = {a: r["bytes"] for a, r in entry["apis"].items() if r["bytes"]}
    assert bytes_by_api == {"cudaMalloc": 6 * MiB, "cudaMallocManaged": 4096, "cudaMallocAsync": 2 * 8192,
                            "cudaMemcpy": 4 * 256, "cudaMemcpyAsync": 2 * 512}
    assert entry["apis"]["cudaMalloc"]["failed_bytes"] == 6 * MiB
    assert entry["apis"]["cudaMemcpy"]["kinds"] == {"HtoD": {"calls": 4, "bytes": 1024}}
    assert entry["apis"]["cudaMemcpyAsync"]["kinds"] == {"DtoH": {"calls": 2, "bytes": 1024}}
    # dim3 by value in registers and the shared-memory size on the stack, read right
    shapes = {(tuple(x["grid"]), tuple(x["block"]), x["shared_mem_bytes"], x["count"]) for x in entry["launches"]}
    assert shapes == {((1, 1, 1), (32, 1, 1), 1024, 1), ((64, 2, 3), (128, 2, 1), 0, 1)}
    assert {x["function"] for x in entry["launches"]} == {"cudaFree"}  # the "kernel" address passed
    assert [(d["api"], d["count"]) for d in entry["degenerate_launches"]] == [("cudaLaunchKernel", 1)]
    assert entry["outstanding"] == []  # failed allocations hold nothing
    lat = entry["apis"]["cudaMalloc"]["latency_ns"]
    assert sum(b["count"] for b in lat["buckets"]) == 3 and 0 < lat["p50"] <= lat["p95"] <= lat["p99"]
    runtime = [a for a in snap["probes_attached"] if a["kind"] == "runtime"]
    assert runtime and set(runtime[0]["apis"]) == {a.name for a in CUDA_APIS if a.library == "runtime"}


# ---- the driver API through the shim -------------------------------------------------------


@needs_ebpf
def test_driver_calls_are_counted_exactly_and_the_leak_is_reported_by_stack(probe, built):
    lib = fresh_shim(built)
    proc = workload(built, lib, "--wait-before-calls", "--hold")
    proc.expect("loaded")
    probe.add_process(proc.pid)
    proc.send()
    proc.expect("done")
    snap = probe.snapshot()
    proc.send()
    assert proc.finish() == 0
    entry = process_entry(snap, proc.pid)
    assert entry["comm"] == "driver_workload" and lib in entry["libraries"]
    assert_driver_script(entry)
    assert_leak_found(entry)
    assert entry["outstanding"][0]["apis"] == ["cuMemAlloc_v2"]
    assert entry["kernel_launches"] == 7 + 3 + 1 + 2
    # the _ptsz call that wraps the plain one is measured as the outer call: it sleeps 5 ms
    slow = sum(b["count"] for b in entry["apis"]["cuStreamSynchronize"]["latency_ns"]["buckets"] if b["le_ns"] > 5e6)
    assert slow >= 1


@needs_ebpf
def test_a_grid_1_1_1_launch_is_found_with_a_sampled_stack(probe, built):
    lib = fresh_shim(built)
    proc = workload(built, lib, "--wait-before-calls", "--hold")
    proc.expect("loaded")
    probe.add_process(proc.pid)
    proc.send()
    proc.expect("done")
    snap = probe.snapshot()
    proc.send()
    proc.finish()
    entry = process_entry(snap, proc.pid)
    degenerate = {(d["function"], d["api"]): d for d in entry["degenerate_launches"]}
    assert set(degenerate) == {("flash_attn_bwd", "cuLaunchKernel"), ("gemm_kernel", "cuLaunchKernel")}
    attn = degenerate[("flash_attn_bwd", "cuLaunchKernel")]
    assert attn["count"] == 3
    assert attn["stack"][0].startswith("run_workload+") and attn["stack"][1].startswith("main+")
    grids = {h["function"]: h["blocks"] for h in entry["launch_grid_histogram"]}
    # gemm: 7 launches of 1024 blocks, 2 of 64, 1 of 1; log2 buckets [le/2, le)
    assert grids["gemm_kernel"] == [{"le": 2, "count": 1}, {"le": 128, "count": 2}, {"le": 2048, "count": 7}]
    assert grids["flash_attn_bwd"] == [{"le": 2, "count": 3}]


@needs_ebpf
def test_one_file_mapped_by_two_processes_is_attached_once_and_counted_once(probe, built):
    lib = fresh_shim(built)
    procs = [workload(built, lib, "--wait-before-calls", "--hold") for _ in range(2)]
    for p in procs:
        p.expect("loaded")
        probe.add_process(p.pid)
    identity = cuda_libs.library_from_path(lib).identity
    assert probe.attached[identity].uprobes == 2 * 13  # entry + return for 12 symbols and one _ptsz variant
    for p in procs:
        p.send()
        p.expect("done")
    snap = probe.snapshot()
    for p in procs:
        p.send()
        p.finish()
        assert_driver_script(process_entry(snap, p.pid))
    assert sum(1 for a in snap["probes_attached"] if a["path"] == lib) == 1


@needs_ebpf
def test_a_process_that_loads_cuda_late_is_attached_when_it_opens_the_library(probe, built):
    lib = fresh_shim(built)
    proc = workload(built, lib, "--wait-before-load", "--wait-before-calls", "--hold")
    probe.add_process(proc.pid)
    identity = cuda_libs.library_from_path(lib).identity
    assert identity not in probe.attached
    proc.send()  # now it dlopens the library
    proc.expect("loaded")
    deadline = time.monotonic() + WAIT_S
    while identity not in probe.attached and time.monotonic() < deadline:
        probe.poll()
        time.sleep(0.02)
    assert identity in probe.attached
    assert probe.attached[identity].library.origin.startswith(("opened by pid", "mapped by pid"))
    proc.send()
    proc.expect("done")
    snap = probe.snapshot()
    proc.send()
    proc.finish()
    assert_driver_script(process_entry(snap, proc.pid))


@needs_ebpf
def test_a_process_that_exits_while_probed_keeps_its_counts_and_its_leak_stack(probe, built):
    lib = fresh_shim(built)
    proc = workload(built, lib, "--wait-before-calls")
    proc.expect("loaded")
    probe.add_process(proc.pid)
    proc.send()
    proc.expect("done")
    assert proc.finish() == 0  # gone before the probe reads anything
    probe.poll()
    snap = probe.snapshot()
    entry = process_entry(snap, proc.pid)
    assert entry["alive"] is False
    assert_driver_script(entry)
    assert_leak_found(entry)  # symbols resolved from what was read while it ran


@needs_ebpf
def test_frames_carry_catalog_columns_per_process_and_api(probe, built):
    lib = fresh_shim(built)
    proc = workload(built, lib, "--wait-before-calls")
    proc.expect("loaded")
    probe.add_process(proc.pid)
    proc.send()
    proc.finish()
    frames = probe.frames(t=123.0)
    cuda_rows = [r for f in frames if f.kind == "cuda_api" for r in f.rows if r["pid"] == proc.pid]
    for row in cuda_rows:
        metrics = set(row) - {"node", "pid", "process", "api", "code"}
        assert metrics and metrics <= set(CATALOG), metrics - set(CATALOG)
    calls = {r["api"]: r[M.cuda_api_calls_total] for r in cuda_rows if M.cuda_api_calls_total in r}
    assert calls == {api: v[0] for api, v in DRIVER_EXPECTED.items()}
    errors = {(r["api"], r["code"]): r[M.cuda_api_errors_total] for r in cuda_rows if "code" in r}
    assert errors == {("cuMemAlloc_v2", 2): 1, ("cuMemFree_v2", 1): 1, ("cuLaunchKernel", 1): 1}
    hist = next(r for r in cuda_rows if r.get("api") == "cuMemAlloc_v2")[M.cuda_api_latency_seconds]
    assert hist["count"] == 14 and hist["buckets"][-1] == (float("inf"), 14)
    (per_process,) = [r for r in cuda_rows if "api" not in r]
    assert per_process[M.cuda_outstanding_allocation_bytes] == LEAKED[0]
    assert per_process[M.cuda_kernel_launches_total] == 13
    assert per_process[M.cuda_degenerate_launches_total] == 4
    assert any(f.kind == "node" and M.host_oom_kills_total in f.rows[0] for f in frames)


@needs_ebpf
def test_off_cpu_time_of_a_sleeping_thread_is_counted(probe):
    proc = Proc([sys.executable, "-c",
                 ("import sys, time\nprint('ready', flush=True)\nsys.stdin.readline()\n"
                  "time.sleep(0.3)\nprint('slept', flush=True)\nsys.stdin.readline()\n")])
    proc.expect("ready")
    probe.add_process(proc.pid)
    proc.send()
    proc.expect("slept")
    entry = process_entry(probe.snapshot(), proc.pid)
    proc.finish()
    # at least the 0.3 s it slept (a lower bound that the kernel guarantees, not a speed)
    assert entry["offcpu"]["offcpu_s"] >= 0.3
    assert entry["offcpu"]["threads"][0]["tid"] == proc.pid


def _memory_cgroup(name: str, limit_bytes: int) -> Path | None:
    """A memory-limited cgroup (v2 or v1) below this process's own; None when there is none."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        hid, controllers, path = line.split(":", 2)
        if hid == "0" and os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
            base, limit_file = Path("/sys/fs/cgroup") / path.lstrip("/"), "memory.max"
        elif "memory" in controllers.split(","):
            base, limit_file = Path("/sys/fs/cgroup/memory") / path.lstrip("/"), "memory.limit_in_bytes"
        else:
            continue
        cg = base / name
        try:
            cg.mkdir()
            (cg / limit_file).write_text(str(limit_bytes))
            if (cg / "memory.swap.max").exists():
                (cg / "memory.swap.max").write_text("0")
            if (cg / "memory.memsw.limit_in_bytes").exists():
                (cg / "memory.memsw.limit_in_bytes").write_text(str(limit_bytes))
            return cg
        except OSError:
            if cg.exists():
                cg.rmdir()
    return None


@needs_ebpf
def test_an_oom_kill_of_a_probed_process_is_reported(probe):
    cg = _memory_cgroup(f"gpudiag-oom-{os.getpid()}", 64 * MiB)
    if cg is None:
        pytest.skip("no memory cgroup can be created here to provoke an OOM kill")
    try:
        proc = Proc([sys.executable, "-c",
                     ("import sys\nprint('ready', flush=True)\nsys.stdin.readline()\n"
                      "hog = bytearray(512 << 20)\nprint('survived', flush=True)\n")])
        proc.expect("ready")
        probe.add_process(proc.pid)
        (cg / "cgroup.procs").write_text(str(proc.pid))
        proc.send()
        assert proc.finish() == -9  # SIGKILL from the OOM killer
        snap = probe.snapshot()
        kills = [k for k in snap["oom_kills"] if k["pid"] == proc.pid]
        assert len(kills) == 1 and kills[0]["comm"].startswith("python")
        assert process_entry(snap, proc.pid)["oom_killed"] is True
    finally:
        for _ in range(50):
            try:
                cg.rmdir()
                break
            except OSError:
                time.sleep(0.1)


# ---- a second probe: every process, no launch probes, a tiny event ring ------------------


def _perf_event_fds() -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[perf_event]"
        except OSError:
            pass
    return n


@needs_ebpf
def test_probing_every_process_without_launch_probes_and_with_a_lossy_event_ring(built):
    lib = fresh_shim(built)
    perf_fds_before = _perf_event_fds()
    proc = workload(built, lib, "--wait-before-calls", "--hold")
    proc.expect("loaded")
    loop = Proc([str(built / "call_loop"), lib, "memcpy", "5000", "wait"])
    loop.expect("ready")
    probe = CudaApiProbe(None, launches=False, events=True, event_ring_pages=1, system_libraries=False,
                         host_tracepoints=False).start()
    try:
        # found by scanning /proc: both processes map the file, attached once, launches left out
        attached = [a for a in probe.snapshot()["probes_attached"] if a["path"] == lib]
        assert len(attached) == 1 and not any("Launch" in api for api in attached[0]["apis"])
        assert "cuLaunchKernel" not in probe.snapshot()["apis_probed"]
        proc.send()
        proc.expect("done")
        probe.poll()
        probe.events()  # drain, then let the ring overflow
        drops_before = probe.drops()["events"]
        loop.send()
        assert loop.finish() == 0
        snap = probe.snapshot()
        assert_driver_script(process_entry(snap, proc.pid), launches=False)
        loop_calls = process_entry(snap, loop.pid)["apis"]["cuMemcpyHtoDAsync_v2"]["calls"]
        assert loop_calls == 5000  # the maps never lose a call
        probe.poll()
        received = sum(1 for e in probe.events() if e["pid"] == loop.pid)
        dropped = probe.drops()["events"] - drops_before
        assert dropped > 0 and received + dropped == 5000  # every event delivered or counted as dropped
        assert snap["dropped_events"] >= dropped
        proc.send()
        proc.finish()
    finally:
        probe.close(wait=True)
    assert _perf_event_fds() == perf_fds_before  # detached cleanly


# ---- the command line ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def probed_command(built):
    """`gpudiag probe cuda --json -- sh -c ...` under sudo's variables: the shell starts the
    workload, which loads the shim late; one run, several tests."""
    if EBPF_SKIP:
        pytest.skip(EBPF_SKIP)
    lib = fresh_shim(built)
    script = 'id -u; "$0" "$1" --late-ms 300 >/dev/null; exit 3'
    env = {**os.environ, "SUDO_UID": "65534", "SUDO_GID": "65534"}
    env.pop("SUDO_USER", None)
    argv = [sys.executable, "-m", "gpudiag", "probe", "cuda", "--json", "--", "sh", "-c", script,
            str(built / "driver_workload"), lib]
    res = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=300, env=env)
    return res, lib


@pytest.mark.ebpf
def test_probe_cuda_json_follows_a_command_from_its_first_cuda_call(probed_command):
    res, lib = probed_command
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)  # stdout holds the document only: the command's output went to stderr
    assert doc["command"]["exit_code"] == 3 and doc["command"]["argv"][0] == "sh"
    (entry,) = [p for p in doc["processes"] if p["apis"]]
    assert entry["pid"] != doc["command"]["pid"] and entry["comm"] == "driver_workload"  # the shell's child
    assert_driver_script(entry)  # loaded 0.3 s after start, yet no call missed
    assert_leak_found(entry)
    assert lib in entry["libraries"]


@pytest.mark.ebpf
def test_probe_cuda_json_has_the_documented_schema(probed_command):
    doc = json.loads(probed_command[0].stdout)
    assert {"processes", "dropped_events", "kernel", "probes_attached"} <= set(doc)
    assert doc["kernel"] == os.uname().release and doc["dropped_events"] == 0
    entry = next(p for p in doc["processes"] if p["apis"])
    assert {"pid", "comm", "libraries", "apis", "outstanding", "launches"} <= set(entry)
    for rec in entry["apis"].values():
        assert {"calls", "errors", "bytes", "latency_ns"} <= set(rec)
        assert {"p50", "p95", "p99", "buckets"} <= set(rec["latency_ns"])
    assert {"bytes", "count", "stack"} <= set(entry["outstanding"][0])
    assert {"function", "grid", "block", "count"} <= set(entry["launches"][0])
    assert all({"path", "apis"} <= set(a) for a in doc["probes_attached"])
    assert doc["launch_probes"] is True and "cuLaunchKernel" in doc["apis_probed"]


@pytest.mark.ebpf
def test_a_command_under_sudo_runs_as_the_invoking_user(probed_command):
    res, _ = probed_command
    assert res.stderr.splitlines()[0] == "65534"  # `id -u` of the command, not 0


@needs_ebpf
def test_sigterm_ends_a_run_with_the_summary_and_stops_the_command():
    p = subprocess.Popen([sys.executable, "-m", "gpudiag", "probe", "cuda", "--json", "--", "sleep", "600"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # the probe is attached once it has started the command
            kids = psutil.Process(p.pid).children()
            if kids and kids[0].name() == "sleep":
                break
            time.sleep(0.1)
        p.terminate()
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, err
    doc = json.loads(out)
    assert doc["interrupted"] is True
    assert doc["command"]["exit_code"] == -15  # SIGTERM passed on


@needs_ebpf
@pytest.mark.parametrize("json_out", [False, True], ids=["summary", "json"])
def test_a_command_that_cannot_run_is_one_line_and_exit_2_without_a_summary(tmp_path, json_out):
    not_executable = tmp_path / "script"
    not_executable.write_text("#!/bin/sh\n")
    for command, why in (("/nonexistent/cmd", "No such file or directory"), (str(not_executable), "Permission denied")):
        res = subprocess.run([sys.executable, "-m", "gpudiag", "probe", "cuda", *(["--json"] if json_out else []),
                              "--", command], check=False, capture_output=True, text=True, timeout=120)
        assert res.returncode == 2 and res.stdout == "", (res.stdout, res.stderr)
        assert res.stderr.splitlines() == [f"gpudiag: error: cannot run {command}: {why}"]


@needs_ebpf
def test_a_window_in_which_the_agents_ebpf_probe_ran_does_not_blame_root_or_bcc_for_its_gap(tmp_path):
    store = tmp_path / "s.db"
    agent = subprocess.Popen([sys.executable, "-m", "gpudiag", "agent", "--store", str(store),
                              "--listen", "127.0.0.1:0"], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        for line in agent.stderr:  # the probe's first tick compiles and attaches: it ran
            if "probe ebpf: first tick" in line or time.monotonic() > deadline:
                break
        time.sleep(3)  # a few more ticks reach the store
    finally:
        agent.terminate()
        agent.communicate(timeout=60)
    res = subprocess.run([sys.executable, "-m", "gpudiag", "investigate", "--store", str(store), "--json"],
                         check=False, capture_output=True, text=True, timeout=120)
    assert res.returncode in (0, 1, 3), res.stderr  # 3: inconclusive (a short window)
    reasons = [g["reason"] for g in json.loads(res.stdout)["gaps"] if g["check"] == "CUDA API (eBPF)"]
    assert all(r.startswith("the eBPF probe ran but saw no CUDA runtime or driver call") for r in reasons), reasons


def _without_bpf_privileges(argv: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``argv`` without the privileges BPF needs. As root: still uid 0, with every capability
    dropped, so the checkout stays readable wherever it lives (a clone under /root, or a home
    directory of mode 0700, is closed to any other user); otherwise as we are."""
    prefix = []
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("setpriv (util-linux) is needed to drop root's capabilities")
        prefix = ["setpriv", "--inh-caps=-all", "--bounding-set=-all", "--"]
    res = subprocess.run(prefix + argv, check=False, capture_output=True, text=True, timeout=120, env=env)
    if prefix and res.stderr.startswith("setpriv:"):
        pytest.skip(f"cannot drop root's capabilities here: {res.stderr.strip()}")
    return res


def test_without_bpf_privileges_probe_cuda_says_what_is_missing_in_one_line_and_exits_2():
    res = _without_bpf_privileges([sys.executable, "-m", "gpudiag", "probe", "cuda", "--duration", "1"])
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr and res.stdout == ""
    (line,) = res.stderr.splitlines()
    assert line.startswith("gpudiag: error: cannot attach the CUDA eBPF probes: privileges:")
    assert "fix: run as root" in line


def test_without_bcc_probe_cuda_names_the_package_and_exits_2():
    env = {**os.environ, ebpf_readiness.BCC_PATH_ENV: "/nonexistent"}
    res = subprocess.run([sys.executable, "-m", "gpudiag", "probe", "cuda", "--duration", "1"],
                         check=False, capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    (line,) = res.stderr.splitlines()
    expected = "bcc: bcc's Python module is not installed" if os.geteuid() == 0 else "privileges:"
    assert expected in line and "fix:" in line


def test_bad_arguments_are_one_line_and_exit_2(tmp_path):
    not_elf = tmp_path / "libcuda.so.1"
    not_elf.write_text("not a library")
    for args, message in ((["--pid", "1", "--", "true"], "either --pid or a COMMAND"),
                          (["--lib", str(not_elf)], "not an ELF shared library"),
                          (["--lib", str(tmp_path / "absent.so")], "No such file")):
        res = subprocess.run([sys.executable, "-m", "gpudiag", "probe", "cuda", *args],
                             check=False, capture_output=True, text=True, timeout=60)
        assert res.returncode == 2 and message in res.stderr and "Traceback" not in res.stderr


# ---- readiness ---------------------------------------------------------------------------------


def test_readiness_checks_name_each_requirement_with_a_status_and_a_fix():
    checks = ebpf_readiness.ebpf_checks()
    assert [c["name"] for c in checks][:4] == ["privileges", "bcc", "kernel headers", "uprobes"]
    for c in checks:
        assert c["status"] in ("ok", "missing", "wrong") and c["detail"]
        assert c["status"] == "ok" or c["fix"]


def test_a_header_tree_other_users_can_write_is_refused(tmp_path, monkeypatch):
    tree = tmp_path / "headers"
    (tree / "include").mkdir(parents=True)
    tree.chmod(0o777)  # anyone could plant headers that root would compile
    monkeypatch.setenv("BCC_KERNEL_SOURCE", str(tree))
    check = ebpf_readiness.check_kernel_headers()
    assert check["status"] == "wrong" and "writable by other users" in check["detail"]
    if os.geteuid() == 0 and ebpf_readiness.check_bcc()["status"] == "ok":
        res = subprocess.run([sys.executable, "-m", "gpudiag", "probe", "cuda", "--duration", "1"],
                             check=False, capture_output=True, text=True, timeout=60)
        assert res.returncode == 2 and "kernel headers" in res.stderr and "writable" in res.stderr
    tree.chmod(0o755)
    assert ebpf_readiness.check_kernel_headers()["status"] == "ok"


def test_the_deps_script_refuses_a_symlinked_cache(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("the deps script runs as root only")
    scripts = tmp_path / "checkout" / "scripts" / "system-deps.d"
    scripts.mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "system-deps.d" / "10-ebpf.sh", scripts)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "checkout" / ".cache").symlink_to(elsewhere)
    res = subprocess.run(["bash", str(scripts / "10-ebpf.sh")], check=False, capture_output=True, text=True, timeout=60)
    assert res.returncode == 1 and "symbolic link" in res.stderr
    assert list(elsewhere.iterdir()) == []


# ---- library discovery, with real processes -----------------------------------------------


LOADER = ("import ctypes, sys\nfor p in sys.argv[1:]: ctypes.CDLL(p)\n"
          "print('loaded', flush=True)\nsys.stdin.readline()\n")


@needs_cudart
def test_a_wheel_copy_and_the_system_runtime_are_two_libraries_of_one_process(tmp_path):
    wheel = tmp_path / "site-packages" / "nvidia" / "cuda_runtime" / "lib"
    wheel.mkdir(parents=True)
    shutil.copy(CUDART, wheel / "libcudart.so.13")
    proc = Proc([sys.executable, "-c", LOADER, str(wheel / "libcudart.so.13"), CUDART])
    proc.expect("loaded")
    try:
        libs = cuda_libs.libraries_in_process(proc.pid)
    finally:
        proc.finish()
    by_name = {lib.name: lib for lib in libs}
    assert set(by_name) == {str(wheel / "libcudart.so.13"), os.path.realpath(CUDART)}
    copy = by_name[str(wheel / "libcudart.so.13")]
    st = os.stat(wheel / "libcudart.so.13")
    assert copy.kind == "runtime" and copy.identity == (st.st_ino, st.st_size, st.st_mtime_ns)
    assert copy.path.startswith(f"/proc/{proc.pid}/")


@needs_cudart
def test_a_library_deleted_after_loading_is_reached_through_the_mapping(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("/proc/PID/map_files needs CAP_SYS_ADMIN")
    copy = tmp_path / "libcudart.so.13"
    shutil.copy(CUDART, copy)
    proc = Proc([sys.executable, "-c", LOADER, str(copy)])
    proc.expect("loaded")
    try:
        copy.unlink()  # an upgrade replaced it on disk; the process still runs the old file
        (lib,) = cuda_libs.libraries_in_process(proc.pid)
        assert "/map_files/" in lib.path and lib.name == str(copy)
        with open(lib.path, "rb") as fh:
            assert fh.read(4) == b"\x7fELF"
    finally:
        proc.finish()


@needs_cudart
def test_system_discovery_finds_the_toolkit_runtime_once_despite_its_symlinks():
    libs = cuda_libs.system_libraries()
    st = os.stat(CUDART)
    same = [lib for lib in libs if lib.identity == (st.st_ino, st.st_size, st.st_mtime_ns)]
    assert len(same) == 1 and same[0].kind == "runtime"
    assert all("/stubs/" not in lib.name for lib in libs)


def test_library_names_are_classified():
    cases = {"libcudart.so": "runtime", "libcudart.so.13": "runtime", "libcudart.so.12.4.127": "runtime",
             "libcudart-d0da41ae.so.11.0": "runtime", "/usr/lib/libcuda.so.1": "driver",
             "libcuda.so.575.57.08": "driver", "libcudart_static.a": None, "libcudadevrt.a": None,
             "libcudnn.so.9": None, "libcupti.so.13": None}
    assert {name: cuda_libs.library_kind(name) for name in cases} == cases


def test_maps_lines_with_spaces_deleted_files_and_anonymous_regions_are_parsed():
    text = ("7f00-7f10 r-xp 00001000 fd:01 1234  /opt/my libs/libcudart.so.12\n"
            "7f10-7f20 r--p 00000000 08:11 99 /usr/lib/libcuda.so.1 (deleted)\n"
            "7f20-7f30 rw-p 00000000 00:00 0 \n"
            "7ffc-7ffd rw-p 00000000 00:00 0   [stack]\n")
    first, second = cuda_libs.parse_maps(text)
    assert (first.path, first.inode, first.offset, first.dev) == ("/opt/my libs/libcudart.so.12", 1234, 0x1000,
                                                                  os.makedev(0xfd, 0x01))
    assert (second.path, second.deleted, second.start) == ("/usr/lib/libcuda.so.1", True, 0x7f10)


def test_distinct_keeps_one_library_per_file_with_every_pid():
    a = cuda_libs.CudaLibrary("/proc/1/root/x", "x", "runtime", 7, 100, 5, 1, "mapped by pid 1", (1,))
    b = cuda_libs.CudaLibrary("/proc/2/root/y", "y", "runtime", 7, 100, 5, 2, "mapped by pid 2", (2,))
    c = cuda_libs.CudaLibrary("/z", "z", "driver", 8, 100, 5, 1, "--lib")
    (ab, c2) = cuda_libs.distinct([a, b, c])
    assert ab.name == "x" and ab.pids == (1, 2) and c2 == c


def test_a_missing_or_foreign_lib_path_is_a_user_error(tmp_path):
    with pytest.raises(GpudiagError, match="No such file"):
        cuda_libs.library_from_path(str(tmp_path / "nope.so"))
    (tmp_path / "x.so").write_bytes(b"MZ not elf")
    with pytest.raises(GpudiagError, match="not an ELF"):
        cuda_libs.library_from_path(str(tmp_path / "x.so"))


# ---- pure parts ---------------------------------------------------------------------------------


def test_percentiles_interpolate_inside_log2_buckets():
    buckets = [0] * 40
    buckets[11] = 90  # [1024, 2048) ns
    buckets[21] = 10  # [1 Mi, 2 Mi) ns
    assert percentile_from_log2(buckets, 0.5) == pytest.approx(1024 + 1024 * 50 / 90)
    assert 2 ** 20 <= percentile_from_log2(buckets, 0.99) < 2 ** 21
    assert percentile_from_log2([0] * 40, 0.5) is None
    hist = prometheus_histogram(buckets, sum_ns=5_000_000)
    assert hist["count"] == 100 and hist["sum"] == pytest.approx(0.005)
    assert dict(hist["buckets"])[2 ** 11 / 1e9] == 90 and hist["buckets"][-1] == (float("inf"), 100)


def test_the_program_has_one_handler_pair_per_attached_api_and_launches_are_a_switch():
    everything = render_program()
    without = render_program(tuple(a for a in CUDA_APIS if not a.is_launch))
    for i, api in enumerate(CUDA_APIS):
        assert f"int enter_{i}(" in everything and f"int leave_{i}(" in everything
        assert (f"int enter_{i}(" in without) is not api.is_launch
    assert "#define EVENTS 0" in everything and "#define EVENTS 1" in render_program(events=True)


def test_importing_the_probe_needs_neither_bcc_nor_root():
    code = ("import sys; from gpudiag.probes import cuda_ebpf, cuda_libs, ebpf_readiness; "
            "assert 'bcc' not in sys.modules; print('ok')")
    res = _without_bpf_privileges([sys.executable, "-c", code])
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr

