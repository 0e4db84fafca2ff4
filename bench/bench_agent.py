"""Benchmark: the whole agent at steady state on a busy node (8 GPUs x 16 processes, 1 s).

The agent runs in this process with one synthetic probe producing the frames
of bench_exporter's SyntheticNode (NVML-shaped GPU rows, 128 processes, one
torch-instrumented process per GPU, engines, ~80 finished requests a second,
CUDA-API rows) every wall second, through the real path: tracker join,
LatestFrames, store (flushed every second), the 15-minute in-memory window
(pre-filled, so its memory is at steady state from the start) with the
streaming analyzers every 10 s, and /metrics scraped over HTTP every 15 s
as Prometheus would.

Prints:
  * agent CPU as % of one core (process CPU time per wall second), with and
    without the synthetic probe's own cost of making frames (which a real
    NVML probe replaces with its own), goal <= 1 %;
  * RSS at the start and the end of the run and its growth per hour, goal
    <= 150 MB and no growth; the window, store buffers and tracker history are
    bounded, so growth means a leak;
  * store bytes per GPU-day (from the file's growth; short runs are rounded up
    by the not-yet-sealed fresh chunks), goal <= 25 MB;
  * scrape latency (median and max), streaming analysis duration, flush duration.

    .venv/bin/python bench/bench_agent.py [--minutes 3] [--gpus 8] [--processes-per-gpu 16]
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import threading
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_exporter import SyntheticNode  # noqa: E402

from gpudiag.agent.config import AgentConfig  # noqa: E402
from gpudiag.agent.daemon import Agent  # noqa: E402
from gpudiag.frames import Frame  # noqa: E402
from gpudiag.probes.base import Probe  # noqa: E402

SCRAPE_INTERVAL_S = 15.0


class SyntheticNodeProbe(Probe):
    """SyntheticNode's next second of frames, stamped with the wall clock; times its own work."""

    name = "synthetic"

    def __init__(self, node: SyntheticNode):
        self.node = node
        self.busy_s = 0.0

    def sample(self, now: float) -> list[Frame]:
        """One second of the node's frames at ``now``."""
        t0 = time.thread_time()
        frames = [Frame(f.kind, now, f.rows) for f in self.node.frames()]
        self.busy_s += time.thread_time() - t0
        return frames


def rss_bytes() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


def main(argv: list[str] | None = None) -> int:
    """Run the agent for ``--minutes`` and print the figures."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=3.0, help="measured run (after a 30 s warm-up)")
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--processes-per-gpu", type=int, default=16)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)

    with tempfile.TemporaryDirectory() as tmp:
        node = SyntheticNode(gpus=args.gpus, processes_per_gpu=args.processes_per_gpu)
        probe = SyntheticNodeProbe(node)
        cfg = AgentConfig().with_overrides({"store.path": os.path.join(tmp, "timeline.db"),
                                            "exporter.listen": "127.0.0.1:0"})
        agent = Agent(cfg, probes=[("synthetic", probe, 1.0)], node=node.node)
        # Fill the 15-minute window as if the agent had run that long (back-dated seconds).
        window_s = cfg.get("analyzers.window_s")
        filler = SyntheticNode(gpus=args.gpus, processes_per_gpu=args.processes_per_gpu, seed=2)
        now = time.time()
        for i in range(int(window_s)):
            agent.window.add([Frame(f.kind, now - window_s + i, f.rows) for f in filler.frames()
                              if f.kind != "request"])
        agent.window.window()  # convert once, as the analyzer would have by now
        del filler
        agent.start()
        url = agent.server.url
        scrapes: list[float] = []
        stop = threading.Event()

        def scraper():
            while not stop.wait(SCRAPE_INTERVAL_S):
                t0 = time.perf_counter()
                with urllib.request.urlopen(url, timeout=10) as resp:
                    resp.read()
                scrapes.append((time.perf_counter() - t0) * 1000)

        th = threading.Thread(target=scraper, daemon=True)
        th.start()
        time.sleep(30)  # warm-up: imports, first analyses, first sealed chunk
        rss0, cpu0, wall0, busy0 = rss_bytes(), cpu_seconds(), time.monotonic(), probe.busy_s
        size0 = agent.store.health()["db_bytes"] or 0
        analyses0 = agent.analyses
        analysis_s, flush_s, rss_trace = [], [], []
        end = wall0 + args.minutes * 60
        while time.monotonic() < end:
            time.sleep(5)
            if agent.analysis_seconds is not None:
                analysis_s.append(agent.analysis_seconds)
            h = agent.store.health()
            if h["last_flush_seconds"] is not None:
                flush_s.append(h["last_flush_seconds"])
            rss_trace.append(rss_bytes())
        wall = time.monotonic() - wall0
        cpu = cpu_seconds() - cpu0
        busy = probe.busy_s - busy0
        rss1 = rss_bytes()
        size1 = agent.store.health()["db_bytes"] or 0
        analyses = agent.analyses - analyses0
        stop.set()
        agent.stop()

    gpus = args.gpus
    print(f"node: {gpus} GPUs x {args.processes_per_gpu} processes, 1 s samples; measured {wall / 60:.1f} min "
          f"after a 30 s warm-up, window {window_s:g} s pre-filled")
    print(f"agent CPU: {100 * cpu / wall:.2f} % of one core in all; {100 * (cpu - busy) / wall:.2f} % without "
          f"the synthetic probe making frames ({100 * busy / wall:.2f} %)   goal <= 1 %")
    print(f"agent RSS: {rss0 / 1e6:.0f} MB at start, {rss1 / 1e6:.0f} MB at end, max {max(rss_trace) / 1e6:.0f} MB; "
          f"growth {(rss1 - rss0) / 1e6 / (wall / 3600):+.1f} MB/h   goal <= 150 MB, no growth")
    print(f"store: {(size1 - size0) / (wall / 86400) / gpus / 1e6:.1f} MB per GPU-day from the file's growth "
          f"({(size1 - size0) / 1e6:.1f} MB in {wall / 60:.1f} min, fresh chunks not yet sealed count in full)"
          f"   goal <= 25 MB")
    if scrapes:
        print(f"scrape /metrics (in the running agent): median {statistics.median(scrapes):.1f} ms, "
              f"max {max(scrapes):.1f} ms over {len(scrapes)} scrapes   goal < 50 ms")
    if analysis_s:
        print(f"streaming analysis: {analyses} runs, median {statistics.median(analysis_s) * 1000:.0f} ms, "
              f"max {max(analysis_s) * 1000:.0f} ms per run over the {window_s:g} s window")
    if flush_s:
        print(f"store flush: median {statistics.median(flush_s) * 1000:.1f} ms, max {max(flush_s) * 1000:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
