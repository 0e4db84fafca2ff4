"""Overhead of the CUDA API eBPF probes: nanoseconds added per hooked call.

A C loop (tests/ebpf/call_loop.c) calls one function of the shim libcuda
(tests/ebpf/cuda_driver_shim.c) flat out, with the probe off and on:

- off: no uprobe;
- ours: gpudiag's probe as ``gpudiag probe cuda`` runs it (uprobe + uretprobe, per-thread
  call map, per-(pid, API) stats with a log2 histogram; user space polling every 20 ms
  and reading all maps every second);
- ours + events: the same with ``--events`` (a ring-buffer record and a user stack per call);
- entry only: a bare uprobe that increments one counter, the floor of any uprobe design.

For each it prints the median over several runs of ns per call (loop wall time / calls),
the probe's own user-space CPU while the loop ran, the call rate reached, and whether every
call was counted with its latency; when not, which figure fell short in which run (calls
counted, calls seen only at their return, kernel-side drops by reason). The loop reports the
function it called and how many times; a loop that did not do what it was asked stops the
benchmark (exit 1) rather than measure something else. Needs root and bcc; run as root:

    .venv/bin/python bench/bench_ebpf.py [--calls N] [--runs R]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gpudiag.probes import ebpf_readiness
from gpudiag.probes.cuda_ebpf import CudaApiProbe
from gpudiag.probes.cuda_libs import library_from_path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ROOT / "tests" / "ebpf"

# Published per-hit costs (bpftime's benchmarks, kernels 6.2-6.11), for comparison.
REFERENCE_NS = {
    "kernel uprobe": (2500, 3200),
    "kernel uretprobe": (3000, 4000),
    "userspace uprobe (bpftime)": (200, 200),
    "polled ring-buffer submit": (1400, 1400),
}

# The call loop's API argument -> the shim function it calls.
SYMBOLS = {"memcpy": "cuMemcpyHtoDAsync_v2", "launch": "cuLaunchKernel"}


class LoopMismatch(Exception):
    """The call loop did not run what the benchmark asked for: its figures would measure something else."""


ENTRY_ONLY = r"""
BPF_ARRAY(hits, u64, 1);
int on_entry(struct pt_regs *ctx) { int z = 0; u64 *v = hits.lookup(&z); if (v) __sync_fetch_and_add(v, 1); return 0; }
"""


def build(out: Path) -> tuple[str, str]:
    """The shim and the loop, compiled with gcc."""
    lib, loop = out / "libcuda.so.1", out / "call_loop"
    subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "-o", str(lib), str(SOURCES / "cuda_driver_shim.c")], check=True)
    subprocess.run(["gcc", "-O2", "-o", str(loop), str(SOURCES / "call_loop.c"), "-ldl"], check=True)
    return str(lib), str(loop)


def cpu_s() -> float:
    """User + system CPU seconds of this process (all its threads)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _loop_report(p: subprocess.Popen, api: str, calls: int) -> dict:
    """The loop's closing line, checked against what it was asked to do (LoopMismatch when it differs)."""
    line = p.stdout.readline()
    code = p.wait()
    parts = line.split()
    got = dict(zip(parts[::2], parts[1::2]))
    if code != 0 or got.get("api") != SYMBOLS[api] or got.get("calls") != str(calls) or "wall_ns" not in got:
        raise LoopMismatch(f"asked the call loop for {calls:,} calls of {SYMBOLS[api]}; it exited {code} "
                           f"reporting {line.strip()!r}")
    return got


def run_loop(loop: str, lib: str, api: str, calls: int, probe: CudaApiProbe | None = None) -> dict:
    """One loop run; while it runs, serve the probe as the CLI does and measure our CPU."""
    p = subprocess.Popen([loop, lib, api, str(calls), "wait"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True)
    first = p.stdout.readline().strip()
    if first != "ready":
        p.kill()
        raise LoopMismatch(f"the call loop did not start ({loop} {lib} {api}): it said {first!r}, exit {p.wait()}")
    if probe is not None:
        probe.add_process(p.pid)
        drops_before = probe.drops()
    cpu0, t0, next_read = cpu_s(), time.monotonic(), time.monotonic() + 1.0
    p.stdin.write("go\n")
    p.stdin.flush()
    while p.poll() is None:
        if probe is not None:
            probe.poll()
            if probe.events_enabled:
                probe.events()
            if time.monotonic() >= next_read:
                probe.snapshot()
                next_read += 1.0
        time.sleep(0.02)
    wall = time.monotonic() - t0
    probe_cpu = cpu_s() - cpu0
    loop_ns = int(_loop_report(p, api, calls)["wall_ns"])
    out = {"api": SYMBOLS[api], "ns_per_call": loop_ns / calls, "rate_per_s": calls / (loop_ns / 1e9),
           "probe_cpu_ratio": probe_cpu / wall, "counted": None}
    if probe is not None:
        snap = probe.snapshot()
        entry = next(x for x in snap["processes"] if x["pid"] == p.pid)
        rec = entry["apis"].get(SYMBOLS[api], {})
        out["counted"] = rec.get("calls", 0)
        out["untimed"] = rec.get("untimed_calls", 0)
        drops = probe.drops()
        out["drops"] = {k: drops[k] - drops_before[k] for k in drops
                        if k not in ("events", "events_not_kept") and drops[k] != drops_before[k]}
    return out


def median_of(runs: list[dict], key: str) -> float:
    """The median of one figure over runs."""
    return statistics.median(r[key] for r in runs)


def shortfalls(runs: list[dict], calls: int) -> list[str]:
    """Each figure of each run that fell short of every call counted with its latency, as a line."""
    out = []
    for i, r in enumerate(runs, 1):
        if r["counted"] != calls:
            out.append(f"{r['api']}: counted {r['counted']:,} of {calls:,} in run {i}")
        if r.get("untimed"):
            out.append(f"{r['api']}: {r['untimed']:,} of {calls:,} counted at their return only (entry "
                       f"program not run: no latency) in run {i}")
        for reason, n in sorted(r.get("drops", {}).items()):
            out.append(f"{r['api']}: {n:,} not recorded by the kernel ({reason}) in run {i}")
    return out


def report(label: str, runs: list[dict], calls: int, baseline_ns: float | None) -> None:
    """One line per configuration, then one per figure that fell short."""
    ns = median_of(runs, "ns_per_call")
    added = "" if baseline_ns is None else f"  added {ns - baseline_ns:8.0f} ns/call"
    counted, short = "", []
    if runs[0]["counted"] is not None:
        short = shortfalls(runs, calls)
        counted = f"  all {calls:,} counted in every run: {'NO' if short else 'yes'}"
    print(f"{label:34s} {ns:9.0f} ns/call{added}  rate {median_of(runs, 'rate_per_s'):10.0f}/s"
          f"  probe CPU {median_of(runs, 'probe_cpu_ratio') * 100:5.1f} %{counted}")
    for line in short:
        print(f"{'':34s} {line}")


def entry_only_runs(bcc, loop: str, lib: str, calls: int, runs: int) -> list[dict]:
    """A bare entry uprobe with one counter: the cheapest possible hook."""
    source = ebpf_readiness.kernel_source_tree()
    if source and "BCC_KERNEL_SOURCE" not in os.environ:
        os.environ["BCC_KERNEL_SOURCE"] = source[0]
    b = bcc.BPF(text=ENTRY_ONLY.encode(), cflags=["-w"])
    b.attach_uprobe(name=lib.encode(), sym=b"cuMemcpyHtoDAsync_v2", fn_name=b"on_entry")
    try:
        out = []
        for _ in range(runs):
            before = b[b"hits"][0].value
            r = run_loop(loop, lib, "memcpy", calls)
            r["counted"] = b[b"hits"][0].value - before
            out.append(r)
        return out
    finally:
        b.cleanup()


def main() -> int:
    """Check the machine, then measure (exit 2 when it cannot run, 1 when the loop did not do as asked)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=100_000, help="calls per run")
    ap.add_argument("--runs", type=int, default=5, help="runs per configuration (median reported)")
    args = ap.parse_args()
    if args.calls < 1 or args.runs < 1:
        print("bench_ebpf: --calls and --runs must be at least 1", file=sys.stderr)
        return 2
    blockers = ebpf_readiness.blocking(ebpf_readiness.ebpf_checks())
    if blockers:
        print("cannot run: " + ebpf_readiness.explain(blockers[0]), file=sys.stderr)
        return 2
    if shutil.which("gcc") is None:
        print("cannot run: gcc is not installed", file=sys.stderr)
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="gpudiag-bench-"))
    try:
        return _measure(tmp, args)
    except LoopMismatch as exc:
        print(f"bench_ebpf: {exc}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _measure(tmp: Path, args) -> int:
    """Build the loop and the shim, run every configuration and print the figures."""
    lib, loop = build(tmp)
    print(f"kernel {os.uname().release}, {os.cpu_count()} CPUs, {args.calls} calls per run, "
          f"median of {args.runs} runs")
    off = {api: [run_loop(loop, lib, api, args.calls) for _ in range(args.runs)] for api in ("memcpy", "launch")}
    base = {api: median_of(r, "ns_per_call") for api, r in off.items()}
    report("off, cuMemcpyHtoDAsync_v2", off["memcpy"], args.calls, None)
    report("off, cuLaunchKernel", off["launch"], args.calls, None)

    with CudaApiProbe([], system_libraries=False) as probe:
        probe.attach_library(library_from_path(lib))
        ours = {api: [run_loop(loop, lib, api, args.calls, probe) for _ in range(args.runs)]
                for api in ("memcpy", "launch")}
    report("ours, cuMemcpyHtoDAsync_v2", ours["memcpy"], args.calls, base["memcpy"])
    report("ours, cuLaunchKernel", ours["launch"], args.calls, base["launch"])

    with CudaApiProbe([], system_libraries=False, events=True) as probe:
        probe.attach_library(library_from_path(lib))
        with_events = [run_loop(loop, lib, "memcpy", args.calls, probe) for _ in range(args.runs)]
        event_drops = probe.drops()["events"]
    report("ours + events, cuMemcpyHtoDAsync_v2", with_events, args.calls, base["memcpy"])
    print(f"{'':34s} events dropped (ring full, counted): {event_drops}")

    bcc = ebpf_readiness.import_bcc()
    entry = entry_only_runs(bcc, loop, lib, args.calls, args.runs)
    report("entry-only counter uprobe", entry, args.calls, base["memcpy"])

    print("\npublished per-hit references (ns):")
    for name, (lo, hi) in REFERENCE_NS.items():
        print(f"  {name:30s} {lo}-{hi}" if lo != hi else f"  {name:30s} ~{lo}")
    ours_added = median_of(ours["memcpy"], "ns_per_call") - base["memcpy"]
    entry_added = median_of(entry, "ns_per_call") - base["memcpy"]
    print(f"\nours adds {ours_added:.0f} ns per hooked call (entry + return trap and aggregation) against "
          f"{REFERENCE_NS['kernel uprobe'][0] + REFERENCE_NS['kernel uretprobe'][0]}-"
          f"{REFERENCE_NS['kernel uprobe'][1] + REFERENCE_NS['kernel uretprobe'][1]} ns published for a kernel "
          f"uprobe + uretprobe pair; an entry-only uprobe adds {entry_added:.0f} ns here, so the return trap "
          f"and the maps cost {ours_added - entry_added:.0f} ns.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
