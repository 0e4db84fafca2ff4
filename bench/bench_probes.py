"""Benchmark: the cost of one sampling tick of a busy node, and of the in-process reporter.

The node: 8 GPUs with 16 processes on each (128 process rows). NVML is the
fake of tests/fake_nvml.py at the pynvml function boundary (there is no GPU
here), so the NVML figure is the probe's own work above the driver; a real
driver adds its call latency. Everything else is real: 16 live processes
(each with 8 threads) that the host probe reads through procfs and that appear
on every GPU; 8 serving engines (one per GPU) scraped over HTTP on 127.0.0.1,
each answering a vLLM-sized metrics page; 16 reporter files; the tracker
joining it all.

The reporter's figure is the CPU time of one publication (read the allocator
statistics, write the JSON report, rename it) with torch.cuda's statistics
calls answered in-process (no CUDA here): at 1 Hz its share of one core is
that time per second.

Before a figure: the last tick holds a row per GPU, engine and process, joined with the torch
and host layers, and the reporter published without error; otherwise exit 3 with the reason.

Prints medians of several runs:

    .venv/bin/python bench/bench_probes.py [--ticks 30] [--reporter-ticks 300]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from checks import expect, expect_rows
from fake_nvml import FakeNvml, Patcher

from gpudiag.agent.tracker import ThreeColourTracker
from gpudiag.catalog import M
from gpudiag.probes.engine_scrape import EngineScrapeProbe
from gpudiag.probes.host import HostProbe
from gpudiag.probes.nvml import NvmlProbe
from gpudiag.probes.torch_probe import TorchProbe
from gpudiag.probes.torch_reporter import Reporter, TorchCudaStats

GPUS, PROCESSES_PER_GPU, THREADS_PER_PROCESS = 8, 16, 8
MIB = 1 << 20

_WORKER = f"""
import threading, time
for _ in range({THREADS_PER_PROCESS} - 1):
    threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()
print("ready", flush=True)
time.sleep(3600)
"""


def vllm_page(engine: int) -> str:
    """A metrics page the size of a vLLM V1 server's: gauges, counters and six histograms."""
    labels = f'engine="{engine}",model_name="meta-llama/Llama-2-7b-hf"'
    lines = []
    for name, value in (("num_requests_running", 24), ("num_requests_waiting", 7), ("kv_cache_usage_perc", 0.87)):
        lines += [f"# TYPE vllm:{name} gauge", f"vllm:{name}{{{labels}}} {value}"]
    for name, value in (("num_preemptions", 11), ("prompt_tokens", 5e6), ("generation_tokens", 2e6),
                        ("prefix_cache_queries", 4e6), ("prefix_cache_hits", 3e6), ("request_success", 9e4)):
        lines += [f"# TYPE vllm:{name}_total counter", f"vllm:{name}_total{{{labels}}} {value}",
                  f"vllm:{name}_created{{{labels}}} 1.7e9"]
    bounds = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
              40.0, 80.0]
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds"):
        lines.append(f"# TYPE vllm:{name} histogram")
        for i, ub in enumerate(bounds):
            lines.append(f'vllm:{name}_bucket{{{labels},le="{ub}"}} {1000 * (i + 1)}')
        lines += [f'vllm:{name}_bucket{{{labels},le="+Inf"}} {1000 * len(bounds)}',
                  f"vllm:{name}_count{{{labels}}} {1000 * len(bounds)}", f"vllm:{name}_sum{{{labels}}} 12345.6"]
    for i in range(40):  # process and python collectors that vLLM's registry also exports
        lines += [f"# TYPE process_extra_{i} gauge", f"process_extra_{i} {i}"]
    return "\n".join(lines) + "\n"


def serve_pages(pages: dict[str, bytes], root: str) -> tuple[subprocess.Popen, int]:
    """An HTTP server in its own process on 127.0.0.1 answering each page at its path; (process, port).

    Its own process, so the figures below are the agent's work, not the server's.
    """
    for path, body in pages.items():
        os.makedirs(os.path.dirname(os.path.join(root, path.lstrip("/"))), exist_ok=True)
        with open(os.path.join(root, path.lstrip("/")), "wb") as fh:
            fh.write(body)
    server = subprocess.Popen([sys.executable, "-u", "-m", "http.server", "--bind", "127.0.0.1", "--directory", root,
                               "0"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    banner = server.stdout.readline()  # "Serving HTTP on 127.0.0.1 port N (http://...) ..."
    port = int(banner.split(" port ")[1].split()[0])
    return server, port


def median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


def bench_tick(ticks: int, scratch: str) -> None:
    workers = [subprocess.Popen([sys.executable, "-c", _WORKER], stdout=subprocess.PIPE, text=True)
               for _ in range(PROCESSES_PER_GPU)]
    patch = Patcher()
    server = None
    try:
        for w in workers:
            w.stdout.readline()
        pids = [w.pid for w in workers]
        fake = FakeNvml.node(GPUS, PROCESSES_PER_GPU, pids=pids * GPUS)
        for g in fake.gpus:  # every process on every GPU
            for j, p in enumerate(g.processes):
                p.pid = pids[j]
        fake.install(patch)
        nvml = NvmlProbe()
        latest: dict[str, list] = {"process": [], "gpu": []}
        host = HostProbe(targets=lambda: latest["process"])
        runtime = os.path.join(scratch, "runtime")
        os.mkdir(runtime, 0o700)
        reporters = []
        for i, pid in enumerate(pids):  # the reporter files the processes would write
            r = Reporter(runtime, 1.0, lambda i=i: [{"device": 0, "uuid": fake.gpus[i % GPUS].uuid,
                                                      M.process_torch_allocated_bytes: 8 << 30,
                                                      M.process_torch_reserved_bytes: 9 << 30}])
            r.pid, r.path = pid, os.path.join(runtime, f"torch-{pid}.json")
            r._base.update(pid=pid, start_ticks=None)
            r.tick()
            reporters.append(r)
        torch_probe = TorchProbe([runtime], gpu_index_by_uuid=lambda: {g["uuid"]: g["gpu"] for g in latest["gpu"]})
        pages = {f"/engine{i}/metrics": vllm_page(i).encode() for i in range(GPUS)}
        server, port = serve_pages(pages, os.path.join(scratch, "pages"))
        engines = [EngineScrapeProbe(f"http://127.0.0.1:{port}/engine{i}/metrics", gpu=i) for i in range(GPUS)]
        tracker = ThreeColourTracker()
        parts: dict[str, list[float]] = {k: [] for k in ("nvml", "host", "torch", "engine x8", "tracker", "total")}
        cpu_total: list[float] = []
        for k in range(ticks + 3):
            now = time.time()
            c0, t0 = time.process_time(), time.perf_counter()
            frames = nvml.sample(now)
            for fr in frames:
                latest[fr.kind] = fr.rows
            t1 = time.perf_counter()
            frames += host.sample(now)
            t2 = time.perf_counter()
            frames += torch_probe.sample(now)
            t3 = time.perf_counter()
            for e in engines:
                frames += e.sample(now)
            t4 = time.perf_counter()
            rows = tracker.update(now, frames).rows
            t5 = time.perf_counter()
            c1 = time.process_time()
            if k >= 3:  # the first ticks fill the host probe's CPU marks and the tracker's history
                for name, dt in (("nvml", t1 - t0), ("host", t2 - t1), ("torch", t3 - t2), ("engine x8", t4 - t3),
                                 ("tracker", t5 - t4), ("total", t5 - t0)):
                    parts[name].append(dt)
                cpu_total.append(c1 - c0)
            time.sleep(0.05)
        # The last tick's frames: a row per GPU, engine and process, the torch layer joined in.
        by_kind: dict[str, int] = {}
        for fr in frames:
            by_kind[fr.kind] = by_kind.get(fr.kind, 0) + len(fr.rows)
        expect_rows(by_kind, {"gpu": GPUS, "engine": GPUS}, "the last tick's frames")
        expect(len(rows) == GPUS * PROCESSES_PER_GPU,
               f"the tracker joined {len(rows)} process rows, the node has {GPUS * PROCESSES_PER_GPU}")
        joined = [r for r in rows if r["gpu"] == 0 and r["pid"] == pids[0]]
        expect(bool(joined) and all(r.get(M.process_torch_reserved_bytes) for r in joined),
               "the torch reporter's layer is missing from the joined process rows")
        with_host = sum(1 for r in rows if r.get(M.process_cpu_utilization_ratio) is not None)
        expect(with_host == len(rows), f"{len(rows) - with_host} process rows lack the host probe's CPU")
        print(f"sampling tick, {GPUS} GPUs x {PROCESSES_PER_GPU} processes ({len(rows)} process rows, "
              f"{len(pids)} host processes x {THREADS_PER_PROCESS} threads, {GPUS} engine endpoints), "
              f"median of {ticks} ticks:")
        for name, samples in parts.items():
            print(f"  {name:<10} {median_ms(samples):8.2f} ms wall")
        print(f"  {'total':<10} {median_ms(cpu_total):8.2f} ms CPU (the agent's process)")
        print(f"  at 1 Hz: {statistics.median(cpu_total) * 100:.1f} % of one core")
        print(f"  NVML calls per tick (fake driver): {sum(fake.calls.values()) // (ticks + 3)}")
    finally:
        patch.undo()
        if server is not None:
            server.kill()
            server.wait()
        for w in workers:
            w.kill()
            w.wait()


class _FakeTorchCuda:
    """torch.cuda's statistics calls answered in-process, for one device in use of eight."""

    def __init__(self):
        self.stats = {"allocated_bytes.all.current": 300 * MIB, "reserved_bytes.all.current": 512 * MIB,
                      "active_bytes.all.current": 310 * MIB, "inactive_split_bytes.all.current": 40 * MIB,
                      "requested_bytes.all.current": 290 * MIB, "segment.all.current": 7,
                      "num_alloc_retries": 2, "num_ooms": 0}
        # torch.cuda.memory_stats returns ~90 keys; the reporter picks eight.
        self.stats.update({f"extra_stat_{i}.all.current": i for i in range(80)})
        self.initialised = True

    def install(self, patch: Patcher) -> None:
        import torch

        patch.setattr(torch.version, "cuda", "12.4")
        patch.setattr(torch.cuda, "device_count", lambda: 8)
        patch.setattr(torch.cuda, "is_initialized", lambda: True)
        patch.setattr(torch.cuda, "current_device", lambda: 0)
        patch.setattr(torch.cuda, "memory_stats",
                      lambda d: dict(self.stats) if d == 0 else {"reserved_bytes.all.current": 0})
        patch.setattr(torch.cuda, "get_device_properties",
                      lambda d: SimpleNamespace(uuid=f"0000000{d}-aaaa-bbbb-cccc-dddddddddddd", name="A100"))


def bench_reporter(ticks: int, scratch: str) -> None:
    patch = Patcher()
    try:
        _FakeTorchCuda().install(patch)
        runtime = os.path.join(scratch, "reporter")
        os.mkdir(runtime, 0o700)
        stats = TorchCudaStats()
        reporter = Reporter(runtime, 1.0, stats, stats.snapshot)
        runs = []
        for _ in range(5):
            c0 = time.thread_time()
            for _ in range(ticks):
                reporter.tick()
            runs.append((time.thread_time() - c0) / ticks)
        per_tick = statistics.median(runs)
        expect(reporter.last_error is None, f"the reporter failed: {reporter.last_error}")
        expect(os.path.exists(reporter.path), f"the reporter wrote no report at {reporter.path}")
        print(f"instrument() reporter: one publication (8 devices, 1 in use) costs {per_tick * 1e6:.0f} µs CPU "
              f"(median of 5 x {ticks}); at 1 Hz that is {per_tick * 100:.3f} % of one core (target < 0.1 %)")
    finally:
        patch.undo()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ticks", type=int, default=30)
    parser.add_argument("--reporter-ticks", type=int, default=300)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gpudiag-bench-probes-") as scratch:
        bench_tick(args.ticks, scratch)
        bench_reporter(args.reporter_ticks, scratch)


if __name__ == "__main__":
    main()
