"""Benchmark: Prometheus scrape latency and store bytes per GPU-day for a busy node.

The node: 8 GPUs, 16 processes on each (128), one serving engine per GPU and
~80 finished requests a second, sampled every second. Frames are synthetic but
shaped like the real sources: NVML integers (percent, MiB, MHz, mW, KB/s,
whole degrees), random walks that move every second, cumulative counters,
constant facts, psutil's one-decimal CPU percentages, and a torch caching
allocator on the one instrumented process per GPU.

Prints (medians of several runs):
  * scrape: the time of a full HTTP GET /metrics on 127.0.0.1 (goal < 50 ms);
  * store: bytes per GPU-day at 1 s for the samples (gpu, process, engine, node,
    cuda_api frames) and, separately, bytes per million finished requests
    (goal <= 25 MB per GPU-day), extrapolated from a simulated stretch;
  * the cost of one flush and of reading a 15-minute window into pandas.

Before a figure: every GPU and process is in the scraped page, and the stores drop no row
and read back every row of each kind written; otherwise exit 3 with the reason.

    .venv/bin/python bench/bench_exporter.py [--hours 2] [--runs 20] [--torch-processes 1]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
import urllib.request

from gpudiag.agent.prom_exporter import serve
from gpudiag.agent.store import Store
from gpudiag.catalog import CATALOG, M
from gpudiag.exposition import LatestFrames, encode_text, registry_for
from gpudiag.frames import Frame

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checks import expect, expect_no_drops, expect_store_rows  # noqa: E402

GIB, MIB = 1024**3, 1024**2


class SyntheticNode:
    """Frames of a node of ``gpus`` GPUs with ``processes_per_gpu`` processes each, one tick a second."""

    def __init__(self, gpus: int = 8, processes_per_gpu: int = 16, torch_processes: int = 1,
                 requests_per_s: float = 80.0, node: str = "node-a", t0: float = 1_767_225_600.0, seed: int = 0,
                 engine_interval_s: int = 1):
        self.rng = random.Random(seed)
        self.node, self.t0, self.requests_per_s = node, t0, requests_per_s
        self.engine_interval_s = engine_interval_s
        self.tick = 0
        self.gpus = []
        for g in range(gpus):
            procs = []
            for j in range(processes_per_gpu):
                procs.append({
                    "pid": 200_000 + g * 100 + j,
                    "process": "python3" if j == 0 else f"worker-{j}",
                    "torch": j < torch_processes,
                    "allocated": 40 * GIB + self.rng.randrange(0, GIB, 512),
                    "reserved": 46 * GIB,
                    "driver_extra": 900 * MIB + j * 2 * MIB,
                    "cpu_pct": 30.0, "rss_pages": 2_000_000 + j * 1000,
                    "voluntary": 0, "involuntary": 0,
                    "cuda_calls": {"cudaMalloc": 0, "cudaFree": 0, "cudaMemcpyAsync": 0,
                                   "cudaStreamSynchronize": 0},
                    "cuda_bytes": {"cudaMalloc": 0, "cudaFree": 0, "cudaMemcpyAsync": 0},
                })
            self.gpus.append({
                "index": g, "uuid": f"GPU-{g:08x}-1c2d-4e5f-8a9b-{g * 7919:012x}",
                "util": 65, "mem_util": 40, "used_mib": 70_000, "temp": 55, "mem_temp": 60,
                "procs": procs, "prompt_tokens": 0, "gen_tokens": 0, "finished": 0, "arrived": 0,
                "evictions": 0, "running": 24, "waiting": 2,
            })

    def _walk(self, value, step, lo, hi):
        return min(hi, max(lo, value + self.rng.randint(-step, step)))

    def frames(self) -> list[Frame]:
        """The frames of the next second (t advances by one second, with real sampling jitter)."""
        rng = self.rng
        t = self.t0 + self.tick + rng.random() * 0.004
        self.tick += 1
        gpu_rows, proc_rows, engine_rows, request_rows, api_rows = [], [], [], [], []
        for g in self.gpus:
            g["util"] = self._walk(g["util"], 6, 0, 100)
            g["mem_util"] = self._walk(g["mem_util"], 4, 0, 100)
            if rng.random() < 0.1:
                g["used_mib"] = self._walk(g["used_mib"], 8, 60_000, 80_000)
            if rng.random() < 0.05:
                g["temp"] = self._walk(g["temp"], 1, 30, 90)
                g["mem_temp"] = self._walk(g["mem_temp"], 1, 30, 95)
            capped = g["util"] > 90
            labels = {"node": self.node, "gpu": g["index"], "uuid": g["uuid"]}
            gpu_rows.append({
                **labels,
                "name": "NVIDIA H100 80GB HBM3", "pci_bus_id": f"00000000:{0x18 + g['index']:02X}:00.0",
                "driver_version": "550.54.15", "cuda_driver_version": "12.4", "mig_mode": "disabled",
                "virtualization_mode": "none",
                M.gpu_info: 1,
                M.gpu_utilization_ratio: g["util"] / 100,
                M.gpu_memory_utilization_ratio: g["mem_util"] / 100,
                M.gpu_memory_used_bytes: g["used_mib"] * MIB,
                M.gpu_memory_total_bytes: 81_559 * MIB,
                M.gpu_memory_reserved_bytes: 528 * MIB,
                M.gpu_sm_clock_hertz: (1755 if capped else 1980) * 1e6,
                M.gpu_sm_clock_max_hertz: 1980e6,
                M.gpu_memory_clock_hertz: 2619e6,
                M.gpu_memory_clock_max_hertz: 2619e6,
                M.gpu_power_watts: (120_000 + g["util"] * 5_400 + rng.randrange(-9_000, 9_000)) / 1000,
                M.gpu_power_limit_watts: 700.0,
                M.gpu_temperature_celsius: g["temp"],
                M.gpu_memory_temperature_celsius: g["mem_temp"],
                M.gpu_pcie_tx_bytes_per_second: rng.randrange(50_000, 400_000) * 1024,
                M.gpu_pcie_rx_bytes_per_second: rng.randrange(50_000, 900_000) * 1024,
                M.gpu_pcie_replay_total: 0,
                M.gpu_nvlink_errors_total: {"crc_flit": 0, "crc_data": 0, "replay": 0, "recovery": 0},
                M.gpu_ecc_errors_total: {"volatile": {"corrected": 0, "uncorrected": 0},
                                         "aggregate": {"corrected": 3, "uncorrected": 0}},
                M.gpu_retired_pages_total: {"single_bit_ecc": 0, "double_bit_ecc": 0},
                M.gpu_remapped_rows_total: {"correctable": 0, "uncorrectable": 0},
                M.gpu_clock_throttle_active: {"gpu_idle": 0, "sw_power_cap": int(capped), "hw_slowdown": 0,
                                              "sw_thermal_slowdown": 0, "hw_thermal_slowdown": 0},
                M.gpu_performance_state: 0,
                M.gpu_xid_errors_total: {},
                M.gpu_lost: 0,
            })
            for p in g["procs"]:
                p["cpu_pct"] = min(100.0, max(0.0, p["cpu_pct"] + rng.randint(-30, 30) / 10))
                p["rss_pages"] += rng.randint(-3, 5) if rng.random() < 0.5 else 0
                p["voluntary"] += rng.randint(100, 900)
                p["involuntary"] += rng.randint(0, 40)
                row = {**labels, "pid": p["pid"], "process": p["process"],
                       M.process_cpu_utilization_ratio: round(p["cpu_pct"], 1) / 100,
                       M.process_thread_cpu_max_ratio: round(min(100.0, p["cpu_pct"] * 0.8), 1) / 100,
                       M.process_resident_memory_bytes: p["rss_pages"] * 4096,
                       M.process_context_switches_total: {"voluntary": p["voluntary"],
                                                          "involuntary": p["involuntary"]}}
                if p["torch"]:
                    p["allocated"] += rng.randrange(-64 * MIB, 64 * MIB, 512)
                    if p["allocated"] > p["reserved"] - GIB:
                        p["reserved"] += 2 * GIB
                    inactive = rng.randrange(0, 512 * MIB, 512)
                    driver = p["reserved"] + p["driver_extra"]
                    row.update({
                        M.process_gpu_memory_bytes: driver,
                        M.process_torch_allocated_bytes: p["allocated"],
                        M.process_torch_reserved_bytes: p["reserved"],
                        M.process_torch_active_bytes: p["allocated"] + 20 * MIB,
                        M.process_torch_inactive_split_bytes: inactive,
                        M.process_torch_requested_bytes: p["allocated"] - rng.randrange(0, 4 * MIB, 8),
                        M.process_torch_largest_free_block_bytes: 2 * MIB * rng.randrange(1, 300),
                        M.process_torch_segments: 900 + (p["reserved"] - 46 * GIB) // (2 * GIB),
                        M.process_torch_alloc_retries_total: 0,
                        M.process_torch_ooms_total: 0,
                        M.process_reserved_minus_allocated_bytes: p["reserved"] - p["allocated"],
                        M.process_driver_minus_reserved_bytes: driver - p["reserved"],
                    })
                    for api in p["cuda_calls"]:
                        p["cuda_calls"][api] += rng.randint(0, 40)
                        api_row = {"node": self.node, "pid": p["pid"], "process": p["process"], "api": api,
                                   M.cuda_api_calls_total: p["cuda_calls"][api]}
                        if api in p["cuda_bytes"]:
                            p["cuda_bytes"][api] += rng.randint(0, 40) * 2 * MIB
                            api_row[M.cuda_api_bytes_total] = p["cuda_bytes"][api]
                        api_rows.append(api_row)
                else:
                    row[M.process_gpu_memory_bytes] = p["driver_extra"]
                proc_rows.append(row)
            arrivals = sum(1 for _ in range(int(self.requests_per_s / len(self.gpus) * 2))
                           if rng.random() < 0.5)
            g["arrived"] += arrivals
            g["finished"] += arrivals
            g["running"] = self._walk(g["running"], 2, 0, 64)
            g["waiting"] = self._walk(g["waiting"], 1, 0, 20)
            for _ in range(arrivals):
                prompt, output = rng.randint(50, 4000), rng.randint(10, 800)
                queue = rng.expovariate(50.0)
                ttft = queue + rng.lognormvariate(-2.5, 0.6)
                itl = rng.lognormvariate(-3.2, 0.3)
                g["prompt_tokens"] += prompt
                g["gen_tokens"] += output
                request_rows.append({
                    "node": self.node, "gpu": g["index"], "engine": "vllm",
                    "request_id": f"req-{g['index']}-{g['finished']}-{rng.getrandbits(32):08x}",
                    "prompt_tokens": prompt, "output_tokens": output,
                    M.time_to_first_token_seconds: ttft,
                    M.inter_token_latency_seconds: itl,
                    M.e2e_request_latency_seconds: ttft + itl * (output - 1),
                    M.request_queue_time_seconds: queue,
                    M.request_prefill_time_seconds: ttft - queue,
                })
            if rng.random() < 0.02:
                g["evictions"] += 1
            blocks = 20_000
            used_blocks = min(blocks, g["running"] * 300 + rng.randrange(0, 200))
            engine_rows.append({
                "node": self.node, "gpu": g["index"], "engine": "vllm",
                "model": "llama-3-8b", "fingerprint": "9f2c41d0",
                M.num_requests_running: g["running"],
                M.num_requests_waiting: g["waiting"],
                M.kv_cache_usage_perc: used_blocks / blocks,
                M.num_preemptions_total: g["evictions"],
                M.prompt_tokens_total: g["prompt_tokens"],
                M.generation_tokens_total: g["gen_tokens"],
                M.engine_batch_size: g["running"],
                M.engine_kv_evictions_total: g["evictions"],
                M.engine_kv_alloc_failures_total: 0,
                M.engine_kv_failed_request_bytes: 0,
                M.engine_kv_capacity_bytes: blocks * 2 * MIB,
                M.engine_kv_used_bytes: used_blocks * 2 * MIB,
                M.engine_kv_reserved_bytes: used_blocks * 2 * MIB,
                M.engine_requests_finished_total: g["finished"],
                M.engine_requests_arrived_total: g["arrived"],
                M.engine_requests_rejected_total: 0,
                M.engine_serving_state: {"warming": 0, "serving": 1, "throttling": 0, "draining": 0},
                M.engine_model_info: 1,
            })
        node_row = {"node": self.node,
                    M.node_cpu_utilization_ratio: rng.randint(200, 400) / 1000,
                    M.node_load1: rng.randint(1000, 3000) / 100,
                    M.node_memory_used_bytes: 400 * GIB + rng.randrange(0, GIB, 4096),
                    M.node_memory_total_bytes: 2048 * GIB,
                    M.node_swap_used_bytes: 0}
        frames = [Frame("gpu", t, gpu_rows), Frame("process", t, proc_rows), Frame("node", t, [node_row]),
                  Frame("cuda_api", t, api_rows)]
        if (self.tick - 1) % self.engine_interval_s == 0:
            frames.insert(2, Frame("engine", t, engine_rows))
        if request_rows:
            frames.append(Frame("request", t, request_rows))
        return frames


def bench_scrape(node: SyntheticNode, runs: int) -> dict:
    """Median and worst time of a full GET /metrics over HTTP on 127.0.0.1, and the payload size."""
    latest = LatestFrames(node=node.node)
    for _ in range(3):
        latest.update(node.frames())
    registry = registry_for(latest)
    server = serve(registry, port=0)
    url = f"http://127.0.0.1:{server.port}/metrics"
    times, size, samples = [], 0, 0
    try:
        for i in range(runs + 2):
            latest.update(node.frames())
            t0 = time.perf_counter()
            with urllib.request.urlopen(url, timeout=10) as resp:
                body = resp.read()
            if i >= 2:  # the first scrapes warm up imports and caches
                times.append((time.perf_counter() - t0) * 1000)
            size = len(body)
            samples = sum(1 for line in body.splitlines() if line and not line.startswith(b"#"))
    finally:
        server.close()
    n_procs = sum(len(g["procs"]) for g in node.gpus)
    for column, want in ((M.gpu_utilization_ratio, len(node.gpus)), (M.process_gpu_memory_bytes, n_procs)):
        name = CATALOG[column].name.encode()
        got = sum(1 for line in body.splitlines() if line.startswith(name + b"{"))
        expect(got >= want, f"the scraped page holds {got} {name.decode()} series, the node {want}")
    encode = []
    for _ in range(runs):
        t0 = time.perf_counter()
        encode_text(registry)
        encode.append((time.perf_counter() - t0) * 1000)
    return {"median_ms": statistics.median(times), "max_ms": max(times), "bytes": size, "samples": samples,
            "encode_median_ms": statistics.median(encode)}


def bench_store(node: SyntheticNode, hours: float) -> dict:
    """Simulate ``hours`` of frames through the store; bytes per GPU-day (samples) and per 1M requests."""
    ticks = int(hours * 3600)
    n_gpus = len(node.gpus)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        paths = {"samples": os.path.join(tmp, "samples.db"), "requests": os.path.join(tmp, "requests.db")}
        stores = {k: Store.open(p) for k, p in paths.items()}
        requests = 0
        written = {k: {} for k in paths}
        flush_ms = []
        cpu0 = time.process_time()
        gen_cpu = 0.0
        for _ in range(ticks):
            g0 = time.process_time()
            frames = node.frames()
            gen_cpu += time.process_time() - g0
            req = [f for f in frames if f.kind == "request"]
            requests += sum(len(f.rows) for f in req)
            for f in frames:
                rows = written["requests" if f.kind == "request" else "samples"]
                rows[f.kind] = rows.get(f.kind, 0) + len(f.rows)
            stores["samples"].append([f for f in frames if f.kind != "request"])
            stores["requests"].append(req)
            t0 = time.perf_counter()
            stores["samples"].flush()
            stores["requests"].flush()
            flush_ms.append((time.perf_counter() - t0) * 1000)
        store_cpu = time.process_time() - cpu0 - gen_cpu
        span = stores["samples"].time_range()
        t0 = time.perf_counter()
        reads = []
        for _ in range(5):
            t0 = time.perf_counter()
            w = stores["samples"].window(span[1] - 900, span[1])
            reads.append((time.perf_counter() - t0) * 1000)
        out["window_rows"] = sum(len(df) for df in w.tables.values())
        for s in stores.values():
            expect_no_drops(s.health())
            s.close()
        sizes = {k: os.path.getsize(p) for k, p in paths.items()}
        for k, p in paths.items():
            expect(written[k], f"no {k} frames were made")
            expect_store_rows(p, written[k])
    days = ticks / 86400
    out.update({
        "ticks": ticks,
        "samples_bytes": sizes["samples"],
        "bytes_per_gpu_day": sizes["samples"] / days / n_gpus,
        "requests": requests,
        "bytes_per_million_requests": sizes["requests"] / max(requests, 1) * 1e6,
        "request_bytes_per_gpu_day": sizes["requests"] / days / n_gpus,
        "flush_median_ms": statistics.median(flush_ms),
        "flush_p99_ms": sorted(flush_ms)[int(len(flush_ms) * 0.99)],
        "store_cpu_ratio_of_core": store_cpu / ticks,
        "window_15min_median_ms": statistics.median(reads),
    })
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the benchmarks and print the figures."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hours", type=float, default=2.0, help="stretch of frames simulated for the store figure")
    ap.add_argument("--runs", type=int, default=20, help="scrapes timed")
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--processes-per-gpu", type=int, default=16)
    ap.add_argument("--torch-processes", type=int, default=1,
                    help="processes per GPU with an in-process torch reporter (the rest: NVML + host only)")
    args = ap.parse_args(argv)
    shape = {"gpus": args.gpus, "processes_per_gpu": args.processes_per_gpu, "torch_processes": args.torch_processes}
    print(f"node: {args.gpus} GPUs x {args.processes_per_gpu} processes per GPU "
          f"({args.torch_processes} with torch stats), 1 s samples")
    s = bench_scrape(SyntheticNode(**shape), args.runs)
    print(f"scrape /metrics: median {s['median_ms']:.1f} ms, max {s['max_ms']:.1f} ms over {args.runs} runs "
          f"({s['samples']} samples, {s['bytes'] / 1024:.0f} KiB; collect + encode alone "
          f"{s['encode_median_ms']:.1f} ms)   goal < 50 ms")
    st = bench_store(SyntheticNode(**shape, seed=1), args.hours)
    print(f"store: {st['bytes_per_gpu_day'] / 1e6:.2f} MB per GPU-day for 1 s samples "
          f"(extrapolated from {args.hours:g} h, {st['samples_bytes'] / 1e6:.1f} MB)   goal <= 25 MB")
    print(f"store: finished requests {st['bytes_per_million_requests'] / 1e6:.1f} MB per million "
          f"({st['requests']} simulated; {st['request_bytes_per_gpu_day'] / 1e6:.1f} MB per GPU-day at "
          f"{SyntheticNode().requests_per_s:g} requests/s per node)")
    print(f"store: flush median {st['flush_median_ms']:.2f} ms, p99 {st['flush_p99_ms']:.2f} ms; "
          f"store CPU {st['store_cpu_ratio_of_core'] * 100:.2f} % of a core; "
          f"15-min window read {st['window_15min_median_ms']:.0f} ms ({st['window_rows']} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
