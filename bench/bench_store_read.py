"""Speed of reading a day of a full node out of the store.

A store holding ``--hours`` (24 by default) of a node of 8 GPUs with 16 processes each is
written once with the agent's store API (``Store.append_columns``, a minute a batch, each
flushed) and kept at ``--store``: a GPU row per GPU, a process row per process, an engine row
per GPU and the node's host row every second, and about 80 finished requests a second, each
with its own id (``req-<gpu>-<count>-<8 hex digits>``, as bench_exporter's SyntheticNode
draws them). Before it prints a figure the benchmark checks that the store holds what it
claims: the rows of each kind written, and none dropped (``Store.health()``).

Then the whole span is read ``--runs`` times, each in a fresh process: ``Store.window`` over
every kind (the read), then the first read of the request ids' values, then the first read of
every other column. Prints the median of each.

``--code DIR`` reads with the gpudiag of another checkout (its ``gpudiag/`` and top-level
folders, as the package maps them), in the same runs, alternating: the side-by-side figure
against that code.

    .venv/bin/python bench/bench_store_read.py [--hours 24] [--runs 3] [--store PATH] [--rebuild] [--code DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

GPUS = 8
PROCESSES_PER_GPU = 16
REQUESTS_PER_S = 80
BATCH_S = 60  # a minute a batch: 13.5 k rows, under the store's unencoded-rows mark
GIB = 1 << 30
KINDS = ("gpu", "process", "engine", "request", "node")

CHILD = r"""
import json, resource, sys, time
path, lo, hi = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
t = {}
t0 = time.perf_counter()
from gpudiag.agent.store import Store
t["import_s"] = time.perf_counter() - t0
store = Store.open(path, readonly=True)
t0 = time.perf_counter()
window = store.window(lo, hi)
t["read_s"] = time.perf_counter() - t0
t["rows"] = {kind: len(window.columns(kind)) for kind in window.tables}
t0 = time.perf_counter()
ids = window.columns("request").columns["request_id"]
t["request_ids_s"] = time.perf_counter() - t0
t["distinct_request_ids"] = len(set(ids.tolist()))
t0 = time.perf_counter()
for kind in window.tables:
    table = window.columns(kind)
    for name in list(table.columns):
        table.columns[name]
t["other_columns_s"] = time.perf_counter() - t0
t["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps(t))
"""


def build(path: str, t0: float, span_s: int) -> dict[str, int]:
    """Write the span into a fresh store at ``path``; the rows written of each kind."""
    import numpy as np

    from gpudiag.agent.store import Store
    from gpudiag.catalog import M
    from gpudiag.frames import FrameColumns

    for stale in (path, path + "-wal", path + "-shm"):
        if os.path.exists(stale):
            os.remove(stale)
    written = dict.fromkeys(KINDS, 0)
    node, n_proc = "bench-node", GPUS * PROCESSES_PER_GPU
    store = Store.open(path, retention_s=span_s + 86400.0, max_bytes=64 * GIB)  # keeps every row written
    rng = np.random.default_rng(0)
    white = rng.uniform(2, 4, n_proc) * GIB
    prompt = np.zeros(GPUS, dtype=np.int64)
    evictions = np.zeros(GPUS, dtype=np.int64)
    finished = np.zeros(GPUS, dtype=np.int64)

    def objects(values) -> np.ndarray:
        values = list(values)
        a = np.empty(len(values), dtype=object)
        a[:] = values
        return a

    def chunk(kind: str, columns: dict) -> FrameColumns:
        n = len(columns["t"])
        for a in columns.values():
            a.flags.writeable = False
        written[kind] += n
        return FrameColumns(kind, n, columns)

    started = time.perf_counter()
    for batch in range(0, span_s, BATCH_S):
        secs = np.arange(batch, min(batch + BATCH_S, span_s))
        s = len(secs)
        ts = t0 + secs + rng.random(s) * 0.004
        gpu_t = np.repeat(ts, GPUS)
        gpu_of = np.tile(np.arange(GPUS), s)
        uuid = objects(f"GPU-bench-{g}" for g in gpu_of.tolist())
        util = np.clip(0.7 + rng.normal(0, 0.05, s * GPUS), 0, 1)
        gpu = chunk("gpu", {
            "t": gpu_t, "node": objects([node] * (s * GPUS)), "gpu": gpu_of, "uuid": uuid,
            M.gpu_utilization_ratio: np.round(util, 2), M.gpu_memory_used_bytes: np.full(s * GPUS, 70 * GIB),
            M.gpu_memory_total_bytes: np.full(s * GPUS, 80 * GIB),
            M.gpu_sm_clock_hertz: np.full(s * GPUS, 1.41e9), M.gpu_power_watts: np.round(200 + 150 * util, 1),
            M.gpu_temperature_celsius: np.full(s * GPUS, 62.0)})
        # Processes: one row each a second, memory a slow random walk.
        steps = rng.normal(0, 2e6, (s, n_proc))
        walk = np.clip(white + np.cumsum(steps, axis=0), 1 * GIB, 6 * GIB)
        white = walk[-1]
        pid_of = np.tile(np.arange(n_proc), s)
        proc = chunk("process", {
            "t": np.repeat(ts, n_proc), "node": objects([node] * (s * n_proc)),
            "gpu": pid_of // PROCESSES_PER_GPU, "uuid": objects(f"GPU-bench-{i // PROCESSES_PER_GPU}"
                                                               for i in pid_of.tolist()),
            "pid": 10_000 + pid_of, "process": objects(f"worker-{i}" for i in pid_of.tolist()),
            M.process_torch_allocated_bytes: np.round(walk.ravel()),
            M.process_torch_reserved_bytes: walk.ravel() + 0.5 * GIB,
            M.process_gpu_memory_bytes: walk.ravel() + GIB,
            M.process_cpu_utilization_ratio: np.round(rng.uniform(0.2, 0.4, s * n_proc), 3)})
        prompt_steps = rng.poisson(4000, (s, GPUS)).cumsum(axis=0) + prompt
        prompt = prompt_steps[-1]
        ev = (rng.random((s, GPUS)) < 0.001).cumsum(axis=0) + evictions
        evictions = ev[-1]
        engine = chunk("engine", {
            "t": gpu_t, "node": objects([node] * (s * GPUS)), "gpu": gpu_of,
            "engine": objects(f"engine-{g}" for g in gpu_of.tolist()),
            M.num_requests_running: rng.integers(30, 50, s * GPUS), M.num_requests_waiting: np.zeros(s * GPUS, int),
            M.kv_cache_usage_perc: np.round(rng.uniform(0.5, 0.7, s * GPUS), 4),
            M.num_preemptions_total: ev.ravel(), M.prompt_tokens_total: prompt_steps.ravel(),
            M.engine_kv_capacity_bytes: np.full(s * GPUS, 40 * GIB)})
        # Requests: ~80 a second over the GPUs, each id its own.
        per = rng.binomial(2 * REQUESTS_PER_S // GPUS, 0.5, (s, GPUS))
        req_t = np.repeat(np.repeat(ts, GPUS), per.ravel())
        req_gpu = np.repeat(gpu_of, per.ravel())
        n_req = len(req_t)
        count = np.empty(n_req, dtype=np.int64)
        for g in range(GPUS):
            mine = req_gpu == g
            count[mine] = finished[g] + 1 + np.arange(int(mine.sum()))
            finished[g] += int(mine.sum())
        tail = rng.integers(0, 1 << 32, n_req, dtype=np.uint64).tolist()
        ids = objects(f"req-{g}-{c}-{x:08x}" for g, c, x in zip(req_gpu.tolist(), count.tolist(), tail))
        queue = rng.exponential(0.02, n_req)
        prefill = rng.lognormal(-2.5, 0.6, n_req)
        itl = rng.lognormal(-3.2, 0.3, n_req)
        output = rng.integers(10, 800, n_req)
        request = chunk("request", {
            "t": req_t, "node": objects([node] * n_req), "gpu": req_gpu, "engine": objects(["vllm"] * n_req),
            "request_id": ids, "prompt_tokens": rng.integers(50, 4000, n_req), "output_tokens": output,
            M.time_to_first_token_seconds: queue + prefill, M.inter_token_latency_seconds: itl,
            M.e2e_request_latency_seconds: queue + prefill + itl * (output - 1),
            M.request_queue_time_seconds: queue, M.request_prefill_time_seconds: prefill})
        host = chunk("node", {"t": ts.copy(), "node": objects([node] * s),
                              M.node_cpu_utilization_ratio: np.round(rng.uniform(0.2, 0.4, s), 3)})
        store.append_columns([gpu, proc, engine, request, host])
        store.flush()
        done = min(1.0, (batch + BATCH_S) / span_s)
        print(f"\rwriting the store: {done:4.0%} ({time.perf_counter() - started:.0f} s)", end="", file=sys.stderr,
              flush=True)
    print(file=sys.stderr)
    health = store.health()
    store.close()
    if health["dropped_rows_total"] or health["store_errors_total"] or health["buffered_rows"]:
        raise SystemExit(f"the store did not take every row written: {health}")
    return written


def kept_store(path: str, span_s: int, rebuild: bool) -> tuple[float, dict[str, int]]:
    """(first t, rows written per kind) of the store at ``path``, written first when it is not there (or asked)."""
    about = path + ".json"
    if not rebuild and os.path.exists(path) and os.path.exists(about):
        with open(about) as fh:
            known = json.load(fh)
        if known.get("span_s") == span_s:
            return known["t0"], known["written"]
    t0 = float(int(time.time()) - span_s - 60)
    started = time.perf_counter()
    written = build(path, t0, span_s)
    with open(about, "w") as fh:
        json.dump({"t0": t0, "span_s": span_s, "written": written}, fh)
    print(f"store written in {time.perf_counter() - started:.0f} s: {os.path.getsize(path) / 2**20:.0f} MiB")
    return t0, written


def code_env(code: str | None) -> tuple[dict, str | None]:
    """The environment and working folder that make a child import gpudiag from ``code`` (None: this checkout)."""
    if code is None:
        return dict(os.environ), None
    code = os.path.abspath(code)
    site = tempfile.mkdtemp(prefix="gpudiag-code-")
    pkg = os.path.join(site, "gpudiag")
    os.mkdir(pkg)
    for name in os.listdir(os.path.join(code, "gpudiag")):
        os.symlink(os.path.join(code, "gpudiag", name), os.path.join(pkg, name))
    for name in ("agent", "analyzers", "probes", "reference_engine", "dashboards", "runbooks"):
        if os.path.isdir(os.path.join(code, name)):
            os.symlink(os.path.join(code, name), os.path.join(pkg, name))
    env = dict(os.environ, PYTHONPATH=site)
    return env, site  # run there: the current folder comes first on sys.path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--store", default="/tmp/gpudiag-bench-store-read.db")
    ap.add_argument("--rebuild", action="store_true", help="write the store again even if it exists")
    ap.add_argument("--hours", type=float, default=24.0, help="span written and read (a quick check: 1)")
    ap.add_argument("--code", help="also read with the gpudiag of this checkout, side by side")
    args = ap.parse_args()
    span_s = int(args.hours * 3600)
    t0, written = kept_store(args.store, span_s, args.rebuild)
    lo, hi = str(t0), str(t0 + span_s)
    sides = {"this code": code_env(None)}
    if args.code:
        sides[f"code at {args.code}"] = code_env(args.code)
    runs: dict[str, list[dict]] = {side: [] for side in sides}
    for _ in range(args.runs):
        for side, (env, cwd) in sides.items():
            p = subprocess.run([sys.executable, "-c", CHILD, os.path.abspath(args.store), lo, hi], capture_output=True,
                               text=True, env=env, cwd=cwd)
            if p.returncode:
                print(f"{side}: the read failed:\n{p.stderr}", file=sys.stderr)
                return 1
            got = json.loads(p.stdout.strip().splitlines()[-1])
            if got["rows"] != written or got["distinct_request_ids"] != written["request"]:
                print(f"{side}: the read does not hold what was written: rows {got['rows']} against {written}, "
                      f"{got['distinct_request_ids']} distinct request ids", file=sys.stderr)
                return 1
            runs[side].append(got)
    print(f"{span_s / 3600:g} h, {GPUS} GPUs x {PROCESSES_PER_GPU} processes, {REQUESTS_PER_S} requests/s: "
          + ", ".join(f"{written[k]:,} {k}" for k in KINDS) + f" rows (median of {args.runs})")
    keys = ("read_s", "request_ids_s", "other_columns_s", "import_s")
    for side, got in runs.items():
        med = {k: statistics.median(r[k] for r in got) for k in keys}
        rss = statistics.median(r["peak_rss_bytes"] for r in got) / 2**30
        print(f"  {side:<30} read {med['read_s']:6.2f} s   request ids {med['request_ids_s']:6.2f} s   "
              f"other columns {med['other_columns_s']:6.2f} s   imports {med['import_s']:4.2f} s   "
              f"peak RSS {rss:5.2f} GiB")
    if len(runs) == 2:
        (a, ra), (b, rb) = runs.items()
        for k in ("read_s", "request_ids_s"):
            ratio = statistics.median(r[k] for r in rb) / max(statistics.median(r[k] for r in ra), 1e-9)
            print(f"  {k}: {ratio:.1f}x faster here than with {b.removeprefix('code at ')}")
        whole = [r["read_s"] + r["request_ids_s"] for r in ra], [r["read_s"] + r["request_ids_s"] for r in rb]
        print(f"  read + request ids: {statistics.median(whole[1]) / statistics.median(whole[0]):.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
