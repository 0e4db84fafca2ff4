"""Benchmark: every analyzer over a day of 1 s frames of a busy node (8 GPUs x 16 processes), on one core.

The window is what the agent's own window would hold: one simulated hour of
bench_exporter's SyntheticNode (NVML-shaped GPU rows, 128 processes with one
torch-instrumented process per GPU, engines, node and CUDA-API rows) joined
by the three-colour tracker and converted to columns as the agent converts
them (ten-second chunks), repeated to ``--hours`` with its times shifted and
its counters carried on (each entity's counters keep rising across the seams,
as on a node that ran the whole day), in a TableBuffer, one chunk per hour.
Finished requests (~80 a second, 6.9 M rows a day) are samples of another
kind: left out by default, added with ``--requests``.

Each run analyzes a fresh Table of the window (label codes merged from the
chunks' and entity groups computed anew, as for every streaming analysis).
Before a figure: the window holds each kind's rows (hours x entities), and every run finds
the same findings: the power-cap throttling the synthetic node holds, and nothing else; otherwise
exit 3.
Prints the wall and CPU time (``time.process_time``) of ``run_all``, median of
``--runs``, each analyzer's share in the median run, and the peak RSS. Goal:
<= 2 s wall on one core for 24 h. Run it pinned: ``taskset -c 1``.

    .venv/bin/python bench/bench_analyzers.py [--hours 24] [--runs 3] [--requests]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_exporter import SyntheticNode  # noqa: E402
from checks import expect, expect_findings, expect_rows  # noqa: E402

from gpudiag.agent.tracker import ThreeColourTracker  # noqa: E402
from gpudiag.analyzers import chain  # noqa: E402
from gpudiag.analyzers.registry import ANALYZERS  # noqa: E402
from gpudiag.catalog import CATALOG, COUNTER  # noqa: E402
from gpudiag.frames import DictColumn, Table, TableBuffer, Window  # noqa: E402

HOUR_S = 3600
CHUNK_S = 10
# Label columns that name an entity: a counter rises per entity.
ENTITY_LABELS = ("node", "gpu", "uuid", "pid", "engine", "api", "function")
# The synthetic node's GPUs hit their power cap now and then (bench_exporter's ``capped``): that
# is the one problem its data holds.
EXPECTED_FINDINGS = ("throttling",)


def rss_mb() -> float:
    """This process's resident memory now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6


def simulated_hour(gpus: int, processes_per_gpu: int, requests: bool) -> dict[str, Table]:
    """One hour of the node's frames per kind, tracker-joined and converted in the agent's 10 s chunks."""
    node = SyntheticNode(gpus=gpus, processes_per_gpu=processes_per_gpu,
                         requests_per_s=80.0 if requests else 0.0)
    tracker = ThreeColourTracker()
    pending: dict[str, list] = {}
    chunks: dict[str, list[Table]] = {}
    for tick in range(HOUR_S):
        frames = node.frames()
        joined = tracker.update(frames[0].t, [f for f in frames if f.kind == "process"])
        for fr in [f for f in frames if f.kind != "process"] + [joined]:
            pending.setdefault(fr.kind, []).append((fr.t, fr.rows))
        if (tick + 1) % CHUNK_S == 0:
            for kind, ticks in pending.items():
                chunks.setdefault(kind, []).append(Table.from_frames(ticks, skip=("missing_reasons",)))
            pending = {}
    return {kind: Table.concat(parts) for kind, parts in chunks.items()}


def _entity_step(table: Table, values: np.ndarray) -> np.ndarray:
    """Per row, how far its entity's counter moves in one hour (last - first + one mean step)."""
    keys = tuple(k for k in ENTITY_LABELS if k in table.columns)
    step = np.zeros(len(values))
    for rows in table.groups(keys)[1]:
        v = values[rows]
        v = v[~np.isnan(v)]
        if v.size > 1:
            step[rows] = v[-1] - v[0] + (v[-1] - v[0]) / (v.size - 1)
    return step


def shifted_hour(hour: Table, k: int, steps: dict) -> Table:
    """Hour ``k`` of the day: the simulated hour with times and counters moved on by ``k`` hours."""
    columns = {}
    for name, col in hour.columns.items():
        if name == "t":
            columns[name] = col + k * HOUR_S
        elif name in steps and isinstance(col, DictColumn):
            leaves = {path: arr + k * steps[name][path] for path, arr in col.leaves.items()}
            columns[name] = DictColumn(col.n, col.layout, col.layouts, leaves, col.objects, col.other)
        elif name in steps:
            columns[name] = col + k * steps[name]
        else:
            columns[name] = col
    # Labels are the hour's own arrays: their codes too (the agent's chunks keep theirs).
    codes = {name: hour.codes(name) for name, col in hour.columns.items()
             if isinstance(col, np.ndarray) and col.dtype == object and name in ENTITY_LABELS + ("process",)}
    return Table(hour.n, columns, codes=codes)


def day_window(hours: int, gpus: int, processes_per_gpu: int, requests: bool) -> dict[str, TableBuffer]:
    """TableBuffers holding ``hours`` of the node's frames, one chunk per hour."""
    template = simulated_hour(gpus, processes_per_gpu, requests)
    buffers = {}
    for kind, hour in template.items():
        steps: dict = {}
        for name, col in hour.columns.items():
            metric = CATALOG.get(name)
            if metric is None or metric.type != COUNTER:
                continue
            if isinstance(col, DictColumn):
                steps[name] = {path: _entity_step(hour, arr) for path, arr in col.leaves.items()}
            elif col.dtype.kind in "iuf":
                step = _entity_step(hour, col.astype(float))
                steps[name] = np.rint(step).astype(col.dtype) if col.dtype.kind in "iu" else step
        buf = buffers[kind] = TableBuffer(capacity=hour.n * hours)
        for k in range(hours):
            buf.append(shifted_hour(hour, k, steps))
    return buffers


def analyze(buffers: dict[str, TableBuffer]) -> tuple[float, float, dict[str, float], int, set[str]]:
    """(wall s, CPU s, CPU s per analyzer, findings, their kinds) of one analysis of a fresh window."""
    tables = {kind: buf.table() for kind, buf in buffers.items()}
    t_all = tables["gpu"].columns["t"]
    win = Window.from_columns(tables, start_s=float(t_all[0]), end_s=float(t_all[-1]), node="node-a",
                              sources=["bench"])
    per: dict[str, float] = {}
    findings = []
    wall0, cpu0 = time.perf_counter(), time.process_time()
    for kind, fn in ANALYZERS.items():
        c0 = time.process_time()
        findings.extend(fn(win))
        per[kind] = time.process_time() - c0
    findings = chain.assemble(findings)
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    win.release()  # as the agent does after each analysis: the next run starts without this one's copies
    return wall, cpu, per, len(findings), {f.kind for f in findings}


def main(argv: list[str] | None = None) -> int:
    """Build the day's window, analyze it ``--runs`` times and print the figures."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hours", type=int, default=24)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--processes-per-gpu", type=int, default=16)
    ap.add_argument("--requests", action="store_true", help="add ~80 finished requests a second")
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    buffers = day_window(args.hours, args.gpus, args.processes_per_gpu, args.requests)
    rows = {kind: len(buf) for kind, buf in buffers.items()}
    print(f"window: {args.hours} h of 1 s frames, {args.gpus} GPUs x {args.processes_per_gpu} processes"
          f"{', with requests' if args.requests else ''}: "
          + ", ".join(f"{kind} {n / 1e6:.2f} M rows" for kind, n in rows.items())
          + f" (built in {time.perf_counter() - t0:.0f} s; RSS {rss_mb():.0f} MB)")
    hour_s = HOUR_S * args.hours
    want = {"gpu": args.gpus * hour_s, "process": args.gpus * args.processes_per_gpu * hour_s,
            "engine": args.gpus * hour_s, "node": hour_s}
    expect_rows(rows, want, "the window")
    expect((rows.get("request", 0) > 0) == args.requests,
           f"{rows.get('request', 0):,} request rows in the window ({'with' if args.requests else 'without'} "
           f"--requests)")
    first = analyze(buffers)  # the chunks' label codes, computed once as the agent's chunks keep them
    expect_findings(first[4], EXPECTED_FINDINGS, set(ANALYZERS) - set(EXPECTED_FINDINGS), "run_all")
    runs = [analyze(buffers) for _ in range(args.runs)]
    expect(all(r[4] == first[4] for r in runs), "runs over the same window found different findings")
    walls = [r[0] for r in runs]
    cpus = [r[1] for r in runs]
    median_run = sorted(runs, key=lambda r: r[1])[len(runs) // 2]
    print(f"run_all: wall median {statistics.median(walls):.2f} s (min {min(walls):.2f}, max {max(walls):.2f}), "
          f"CPU median {statistics.median(cpus):.2f} s over {args.runs} runs; {median_run[3]} findings "
          f"({', '.join(sorted(median_run[4])) or 'none'})   "
          f"goal <= 2 s wall")
    per = sorted(median_run[2].items(), key=lambda kv: -kv[1])
    print("  CPU by analyzer (median run): " + ", ".join(f"{k} {v:.2f} s" for k, v in per if v >= 0.005))
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
