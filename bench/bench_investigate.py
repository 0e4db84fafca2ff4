"""Speed of `gpudiag investigate` over a day of a full node from the store.

A store holding 24 h of 1 s samples of 8 GPUs with 16 processes each (all
three colours), one engine per GPU, the node's host row and 80 finished
requests a second is written with the agent's store API (agent/store.py) once
and kept at ``--store``. Then the investigation runs ``--runs`` times, each in
a fresh process: the store read, every analyzer, the document, and the whole
command as a user runs it (``gpudiag investigate --store PATH --from ... --to
... --json``). Prints the median of each. Goal: the whole command <= 5 s.

Before a figure: the store's health shows no dropped rows, every run reads back
the rows of each kind that were written, and the analyzers find what this data
holds (EXPECTED_FINDINGS) and nothing else; otherwise exit 3 with the reason.

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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checks import expect, expect_no_drops, expect_rows  # noqa: E402

GPUS = 8
PROCESSES_PER_GPU = 16
SPAN_S = 86_400
# Written in ten-minute batches, each flushed: the agent's own pace, and bounded memory.
# (One append of ten minutes is encoded whole: the store's waiting-rows cap applies to a stuck writer only.)
BATCH_S = 600
REQUESTS_PER_GPU_S = 10  # 80 finished requests a second on the node
GIB = 1 << 30
# What the analyzers must find on this node: one XID 79 (fallen off the bus) on GPU 3 halfway
# through; the rest is a healthy node (slow random walks, rare evictions, steady latencies).
XID_GPU = 3
EXPECTED_FINDINGS = (("hardware_errors", XID_GPU),)
# The store's layout: a store written by another version of this benchmark is written again.
LAYOUT = 3

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
t["rows_by_kind"] = {k: len(window.columns(k)) for k in ("gpu", "process", "engine", "request", "node")}
t["rows"] = sum(t["rows_by_kind"].values())
t["findings"] = len(findings)
t["finding_kinds"] = sorted({f.kind for f in findings})
t["finding_gpus"] = sorted({(f.kind, f.gpu) for f in findings}, key=str)
t["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
t["per_analyzer_s"] = per
print(json.dumps(t))
"""


def expected_rows(span_s: int) -> dict[str, int]:
    """The rows of each kind that :func:`build` writes."""
    return {"gpu": GPUS * span_s, "process": GPUS * PROCESSES_PER_GPU * span_s, "engine": GPUS * span_s,
            "request": GPUS * REQUESTS_PER_GPU_S * span_s, "node": span_s}


def build(path: str, t0: float, span_s: int) -> None:
    """Write the day into a fresh store at ``path`` with the agent's store API; exit 3 if rows were lost."""
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
    n_req = GPUS * REQUESTS_PER_GPU_S
    prompt_len = rng.integers(50, 4000, n_req)
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
                 M.gpu_power_limit_watts: 400.0, M.gpu_temperature_celsius: 62.0, M.gpu_pcie_replay_total: 0,
                 M.gpu_xid_errors_total: {"79": int(g == XID_GPU and s >= span_s // 2)}} for g in range(GPUS)]))
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
            ttft = np.round(rng.lognormal(-2.5, 0.4, n_req), 6)
            itl = np.round(rng.lognormal(-3.2, 0.2, n_req), 6)
            out = rng.integers(10, 800, n_req)
            frames.append(Frame("request", t + 0.5, [
                {"node": node, "gpu": k % GPUS, "engine": f"engine-{k % GPUS}", "request_id": f"req-{s}-{k}",
                 "prompt_tokens": int(prompt_len[k]), "output_tokens": int(out[k]),
                 M.time_to_first_token_seconds: float(ttft[k]), M.inter_token_latency_seconds: float(itl[k]),
                 M.e2e_request_latency_seconds: float(ttft[k] + itl[k] * (out[k] - 1))} for k in range(n_req)]))
        store.append(frames)
        store.flush()
        done = min(1.0, (batch + BATCH_S) / span_s)
        print(f"\rwriting the store: {done:4.0%} ({time.perf_counter() - started:.0f} s)", end="", file=sys.stderr,
              flush=True)
    health = store.health()
    store.close()
    print(file=sys.stderr)
    expect_no_drops(health)


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
    if args.rebuild or known is None or known.get("span_s") != span_s or known.get("layout") != LAYOUT:
        t0 = float(int(time.time()) - span_s - 60)
        started = time.perf_counter()
        build(args.store, t0, span_s)
        with open(meta, "w") as fh:
            json.dump({"t0": t0, "span_s": span_s, "layout": LAYOUT}, fh)
        print(f"store written in {time.perf_counter() - started:.0f} s: {os.path.getsize(args.store) / 2**20:.0f} MiB "
              f"({GPUS} GPUs x {PROCESSES_PER_GPU} processes, {span_s} s)")
        known = {"t0": t0}
    t0 = known["t0"]
    lo, hi = str(t0), str(t0 + span_s - 0.5)  # the last second's requests finish at +0.5 s
    runs, commands = [], []
    for _ in range(args.runs):
        child = subprocess.run([sys.executable, "-c", CHILD, args.store, lo, hi], capture_output=True, text=True)
        expect(child.returncode == 0, f"the investigation failed: {child.stderr.strip()[-2000:]}")
        run = json.loads(child.stdout.strip().splitlines()[-1])
        expect_rows(run["rows_by_kind"], expected_rows(span_s), f"the window of {args.store}")
        expect(sorted(map(tuple, run["finding_gpus"]), key=str) == sorted(EXPECTED_FINDINGS, key=str),
               f"the analyzers found {run['finding_gpus'] or 'nothing'} (kind, GPU); this node holds "
               f"{list(EXPECTED_FINDINGS)}")
        runs.append(run)
        started = time.perf_counter()
        p = subprocess.run([sys.executable, "-m", "gpudiag", "investigate", "--store", args.store, "--from", lo,
                            "--to", hi, "--json"], capture_output=True, text=True)
        commands.append(time.perf_counter() - started)
        # 2 is bad input; 3 an inconclusive window, analyzed all the same
        expect(p.returncode in (0, 1, 3), f"gpudiag investigate exited {p.returncode}: {p.stderr.strip()[-2000:]}")
        doc = json.loads(p.stdout)
        got = sorted({f["kind"] for f in doc.get("findings", [])})
        expect(got == run["finding_kinds"], f"gpudiag investigate found {got}, the analyzers {run['finding_kinds']}")

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
