"""Throughput and peak memory of `gpudiag analyze trace` (parsing + analysis), printed.

    .venv/bin/python bench/bench_kineto.py [--runs 5] [--synthetic-mb 200] [--json-load-baseline]

Before a figure: every run read the trace whole (the synthesized trace's GPU events all counted;
any at all in the V100 trace); otherwise exit 3 with the reason.

Each run is a fresh interpreter, so its peak RSS (ru_maxrss) belongs to that
run alone; "base" is the same interpreter after imports, before reading.
MB/s counts uncompressed trace bytes (10^6 bytes per MB). Figures are medians
over the runs.

1. HTA's V100 ResNet trace (../shared/data/kineto/v100_resnet_rank0.json.gz).
2. A synthesized trace of about --synthetic-mb MB (uncompressed .json, written
   to a temporary directory and deleted afterwards) with the V100 trace's mix
   of host operators, runtime calls, kernels and flow events: peak RSS should
   stay near the base, far below the file size.
   --json-load-baseline also measures json.load of that file, for contrast.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from checks import expect  # noqa: E402

V100 = REPO / ".." / "shared" / "data" / "kineto" / "v100_resnet_rank0.json.gz"

_CHILD = r"""
import json, resource, sys, time
from gpudiag.analyzers.trace_reader import read_kineto_trace
from gpudiag.analyzers.kineto import analyze_trace
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.perf_counter()
if sys.argv[2] == "json.load":
    with open(sys.argv[1]) as fh:
        n = len(json.load(fh)["traceEvents"])
    size = None
else:
    trace = read_kineto_trace(sys.argv[1])
    report = analyze_trace(trace)
    n = trace.gpu_count
    size = trace.metadata["uncompressed_bytes"]
wall = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"wall_s": wall, "base_kib": base, "peak_kib": peak, "bytes": size, "gpu_events": n}))
"""


def _run_child(path: Path, mode: str = "gpudiag") -> dict:
    p = subprocess.run([sys.executable, "-c", _CHILD, str(path), mode], capture_output=True, text=True, cwd=REPO)
    expect(p.returncode == 0, f"reading {path} failed: {p.stderr.strip()[-2000:]}")
    return json.loads(p.stdout)


def _measure(label: str, path: Path, runs: int, mode: str = "gpudiag", size: int | None = None,
             gpu_events: int | None = None) -> None:
    results = [_run_child(path, mode) for _ in range(runs)]
    for r in results:  # the trace was read whole: every GPU event it holds (any at all, when not known)
        got = r["gpu_events"]
        expect(got == gpu_events if gpu_events is not None else got > 0,
               f"{path.name}: {got:,} GPU events read, the trace holds {gpu_events if gpu_events else 'some'}")
    size = size or results[0]["bytes"]
    wall = statistics.median(r["wall_s"] for r in results)
    peak = statistics.median(r["peak_kib"] for r in results) / 1024
    base = statistics.median(r["base_kib"] for r in results) / 1024
    print(f"{label:<44} {size / 1e6:8.1f} MB  {size / 1e6 / wall:7.1f} MB/s  {wall:7.2f} s  "
          f"peak RSS {peak:7.1f} MiB (base {base:.1f} MiB, +{peak - base:.1f})  [median of {runs}]")


def synthesize_trace(path: Path, target_bytes: int, seed: int = 0) -> tuple[int, int]:
    """Write a Kineto-shaped trace of about ``target_bytes``; return its size in bytes and its GPU events."""
    rng = random.Random(seed)
    kernel_names = [
        "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>(int, float*)",
        "volta_sgemm_128x64_nn", "void cudnn::bn_fw_tr_1C11_kernel_NCHW<float, float, int, 512, true, 1>",
        "Memcpy DtoD (Device -> Device)", "Memset (Device)",
    ]
    written = 0
    ts = 1_712_195_495_000_000.0
    corr = 1
    gpu_events = 0
    with open(path, "w") as fh:
        head = '{"schemaVersion": 1, "deviceProperties": [{"id": 0, "name": "synthetic"}], "traceEvents": [\n'
        fh.write(head)
        written += len(head)
        first = True
        while written < target_bytes:
            lines = []
            for _ in range(200):
                op_ts = ts
                lines.append(json.dumps({"ph": "X", "cat": "cpu_op", "name": "aten::add", "pid": 1, "tid": 1,
                                         "ts": op_ts, "dur": 30.5, "args": {"External id": corr,
                                         "Record function id": 0, "Sequence number": corr,
                                         "Input Dims": [[64, 256, 56, 56], [64, 256, 56, 56], []],
                                         "Input type": ["float", "float", "Scalar"]}}))
                name = rng.choice(kernel_names)
                api = "cudaMemcpyAsync" if "Memcpy" in name else (
                    "cudaMemsetAsync" if "Memset" in name else "cudaLaunchKernel")
                lines.append(json.dumps({"ph": "X", "cat": "cuda_runtime", "name": api, "pid": 1, "tid": 1,
                                         "ts": op_ts + 5.25, "dur": 8.5,
                                         "args": {"External id": corr, "cbid": 211, "correlation": corr}}))
                lines.append(json.dumps({"ph": "s", "id": corr, "pid": 1, "tid": 1, "ts": op_ts + 5.25,
                                         "cat": "ac2g", "name": "ac2g"}))
                cat = "gpu_memcpy" if "Memcpy" in name else ("gpu_memset" if "Memset" in name else "kernel")
                lines.append(json.dumps({"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": 7,
                                         "ts": op_ts + 20.0, "dur": rng.uniform(2, 60),
                                         "args": {"External id": corr, "queued": 0, "device": 0, "context": 1,
                                                  "stream": 7, "correlation": corr, "registers per thread": 32,
                                                  "grid": [rng.randint(1, 4096), 1, 1], "block": [256, 1, 1]}}))
                lines.append(json.dumps({"ph": "f", "id": corr, "pid": 0, "tid": 7, "ts": op_ts + 20.0,
                                         "cat": "ac2g", "name": "ac2g", "bp": "e"}))
                ts += 40.0
                corr += 1
                gpu_events += 1
            text = ("" if first else ",\n") + ",\n".join(lines)
            first = False
            fh.write(text)
            written += len(text)
        tail = '\n], "traceName": "synthetic"}\n'
        fh.write(tail)
        written += len(tail)
    return os.path.getsize(path), gpu_events


def main() -> None:
    """Print the benchmark figures."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5, help="runs per measurement (median is printed)")
    ap.add_argument("--synthetic-mb", type=float, default=200.0, help="size of the synthesized trace, MB")
    ap.add_argument("--synthetic-runs", type=int, default=3, help="runs on the synthesized trace")
    ap.add_argument("--json-load-baseline", action="store_true", help="also time json.load of the synthetic file")
    args = ap.parse_args()

    if V100.exists():
        _measure("V100 ResNet trace (HTA test data), .json.gz", V100, args.runs)
    else:
        print(f"skipped: {V100.resolve()} is not present")

    with tempfile.TemporaryDirectory(prefix="gpudiag-bench-") as tmp:
        for mb in sorted({max(args.synthetic_mb / 4, 1.0), args.synthetic_mb}):
            path = Path(tmp) / f"synthetic_{mb:.0f}mb.json"
            size, gpu_events = synthesize_trace(path, int(mb * 1e6))
            _measure(f"synthesized trace, {mb:.0f} MB .json", path, args.synthetic_runs, gpu_events=gpu_events)
            if args.json_load_baseline and mb == args.synthetic_mb:
                # json.load counts every trace event: five per GPU event, and nothing else
                _measure("  for contrast: json.load of the same file", path, 1, mode="json.load", size=size,
                         gpu_events=5 * gpu_events)
            path.unlink()


if __name__ == "__main__":
    main()
