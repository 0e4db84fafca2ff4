"""Speed of `gpudiag investigate` over a day of a full node from the store.

A store holding 24 h of 1 s samples of 8 GPUs with 16 processes each (all
three colours), one engine per GPU and the node's host row is written with
the agent's store API (agent/store.py) once and kept at ``--store``. Then the
investigation runs ``--runs`` times, each in a fresh process: the store read,
every analyzer, the document, and the whole command as a user runs it
(``gpudiag investigate --store PATH --from ... --to ... --json``).
Prints the median of each. Goal: the whole command <= 5 s.

    .venv/bin/python bench/bench_investigate.py [--runs 3] [--store PATH] [--rebuild] [--profile]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

GPUS = 8
PROCESSES_PER_GPU = 16
SPAN_S = 86_400
# Written in ten-minute batches, each flushed: the agent's own pace, and bounded memory.
BATCH_S = 600
GIB = 1 << 30

CHILD = r"""
import json, resource, sys, time
t = {}
t0 = time.perf_counter()
from gpudiag import investigate as I
from gpudiag.analyzers import chain
from gpudiag.analyzers.registry import ANALYZERS
t["import_s"] = time.perf_counter() - t0
path, lo, hi = sys.argv[1], sys.argv[2], sys.argv[3]
t0 = time.perf_counter()
window = I.load_store_window(path, since=None, start=lo, end=hi, node=None, gpu=None)
t["read_s"] = time.perf_counter() - t0
findings = []
per = {}
for kind, analyze in ANALYZERS.items():
    a = time.perf_counter()
    findings.extend(analyze(window))
    per[kind] = time.perf_counter() - a
findings = chain.assemble(findings)
t["analyzers_s"] = sum(per.values())
t0 = time.perf_counter()
doc = I.document(window, findings)
json.dumps(doc)
t["document_s"] = time.perf_counter() - t0
t["rows"] = sum(len(df) for df in window.tables.values())
t["findings"] = len(findings)
t["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
t["per_analyzer_s"] = per
print(json.dumps(t))
"""


def build(path: str, t0: float, span_s: int) -> None:
    """Write the day into a fresh store at ``path`` with the agent's store API."""
    import numpy as np

    from gpudiag.agent.store import Store
    from gpudiag.catalog import M
    from gpudiag.frames import Frame

    if os.path.exists(path):
        os.remove(path)
    rng = np.random.default_rng(0)
    store = Store.open(path, retention_s=30 * 86400.0, max_bytes=64 * GIB)
    node = "bench-node"
    n_proc = GPUS * PROCESSES_PER_GPU
    # Slow random walks: memory and load move, as on a serving node, and compress as they would.
    white = rng.uniform(2, 4, n_proc) * GIB
    evictions = np.zeros(GPUS)
    prompt = np.zeros(GPUS)
    started = time.perf_counter()
    for batch in range(0, span_s, BATCH_S):
        frames = []
        for s in range(batch, min(batch + BATCH_S, span_s)):
            t = t0 + s
            white = np.clip(white + rng.normal(0, 2e6, n_proc), 1 * GIB, 6 * GIB)
            util = np.clip(0.7 + rng.normal(0, 0.05, GPUS), 0, 1)
            prompt += rng.poisson(4000, GPUS)
            evictions += rng.random(GPUS) < 0.001
            frames.append(Frame("gpu", t, [
                {"node": node, "gpu": g, "uuid": f"GPU-bench-{g}", M.gpu_utilization_ratio: float(util[g]),
                 M.gpu_memory_used_bytes: 70 * GIB, M.gpu_memory_total_bytes: 80 * GIB,
                 M.gpu_sm_clock_hertz: 1.41e9, M.gpu_sm_clock_max_hertz: 1.41e9, M.gpu_power_watts: 300.0,
                 M.gpu_power_limit_watts: 400.0, M.gpu_temperature_celsius: 62.0} for g in range(GPUS)]))
            rows = []
            for i in range(n_proc):
                w = float(white[i])
                rows.append({"node": node, "gpu": i // PROCESSES_PER_GPU, "uuid": f"GPU-bench-{i // PROCESSES_PER_GPU}",
                             "pid": 10_000 + i, "process": f"worker-{i}", M.process_torch_allocated_bytes: w,
                             M.process_torch_reserved_bytes: w + 0.5 * GIB, M.process_gpu_memory_bytes: w + GIB,
                             M.process_torch_largest_free_block_bytes: 0.25 * GIB,
                             M.process_torch_alloc_retries_total: 0, M.process_torch_ooms_total: 0,
                             M.process_cpu_utilization_ratio: 0.3})
            frames.append(Frame("process", t, rows))
            frames.append(Frame("engine", t, [
                {"node": node, "gpu": g, "engine": f"engine-{g}", M.num_requests_running: 40,
                 M.num_requests_waiting: 0, M.kv_cache_usage_perc: 0.6, M.num_preemptions_total: int(evictions[g]),
                 M.engine_kv_evictions_total: int(evictions[g]), M.prompt_tokens_total: int(prompt[g]),
                 M.engine_recomputed_tokens_total: 0, M.engine_kv_alloc_failures_total: 0,
                 M.engine_kv_capacity_bytes: 40 * GIB, M.engine_kv_capacity_nominal_bytes: 40 * GIB,
                 M.engine_batch_size: 40} for g in range(GPUS)]))
            frames.append(Frame("node", t, [{"node": node, M.node_cpu_utilization_ratio: 0.2}]))
        store.append(frames)
        store.flush()
        done = min(1.0, (batch + BATCH_S) / span_s)
        print(f"\rwriting the store: {done:4.0%} ({time.perf_counter() - started:.0f} s)", end="", file=sys.stderr,
              flush=True)
    store.close()
    print(file=sys.stderr)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--store", default="/tmp/gpudiag-bench-investigate.db")
    ap.add_argument("--rebuild", action="store_true", help="write the store again even if it exists")
    ap.add_argument("--hours", type=float, default=SPAN_S / 3600, help="window length (a quick check: 1)")
    ap.add_argument("--profile", action="store_true", help="also print a cProfile of one in-process run")
    args = ap.parse_args()
    span_s = int(args.hours * 3600)
    meta = args.store + ".json"
    known = json.load(open(meta)) if os.path.exists(meta) and os.path.exists(args.store) else None
    if args.rebuild or known is None or known.get("span_s") != span_s:
        t0 = float(int(time.time()) - span_s - 60)
        started = time.perf_counter()
        build(args.store, t0, span_s)
        with open(meta, "w") as fh:
            json.dump({"t0": t0, "span_s": span_s}, fh)
        print(f"store written in {time.perf_counter() - started:.0f} s: {os.path.getsize(args.store) / 2**20:.0f} MiB "
              f"({GPUS} GPUs x {PROCESSES_PER_GPU} processes, {span_s} s)")
        known = {"t0": t0}
    t0 = known["t0"]
    lo, hi = str(t0), str(t0 + span_s - 1)
    runs, commands = [], []
    for _ in range(args.runs):
        out = subprocess.run([sys.executable, "-c", CHILD, args.store, lo, hi], capture_output=True, text=True,
                             check=True).stdout
        runs.append(json.loads(out.strip().splitlines()[-1]))
        started = time.perf_counter()
        p = subprocess.run([sys.executable, "-m", "gpudiag", "investigate", "--store", args.store, "--from", lo,
                            "--to", hi, "--json"], capture_output=True, text=True)
        commands.append(time.perf_counter() - started)
        if p.returncode not in (0, 1, 3):  # 2 is bad input; 3 an inconclusive window, analyzed all the same
            print(p.stderr, file=sys.stderr)
            return 1

    def med(key):
        return statistics.median(r[key] for r in runs)

    print(f"{span_s / 3600:g} h, {GPUS} GPUs x {PROCESSES_PER_GPU} processes: {runs[0]['rows']:,} rows, "
          f"{runs[0]['findings']} findings (median of {args.runs})")
    print(f"  read the store    {med('read_s'):7.2f} s")
    print(f"  analyzers         {med('analyzers_s'):7.2f} s")
    for kind in runs[0]["per_analyzer_s"]:
        print(f"    {kind:<26} {statistics.median(r['per_analyzer_s'][kind] for r in runs):6.2f} s")
    print(f"  document          {med('document_s'):7.2f} s")
    print(f"  imports           {med('import_s'):7.2f} s")
    print(f"  peak RSS          {med('peak_rss_bytes') / 2**30:7.2f} GiB")
    print(f"whole command (gpudiag investigate --json): {statistics.median(commands):.2f} s  (goal <= 5 s)")
    if args.profile:
        import cProfile
        import pstats

        code = CHILD.replace("sys.argv[1], sys.argv[2], sys.argv[3]", repr((args.store, lo, hi)))
        prof = cProfile.Profile()
        prof.runctx(code, {"__name__": "__bench__"}, {})
        pstats.Stats(prof).sort_stats("cumulative").print_stats(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
