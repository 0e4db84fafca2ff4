"""Benchmark: the whole agent at steady state on a busy node (8 GPUs x 16 processes, 1 s).

The agent runs in this process with one synthetic probe producing the frames
of bench_exporter's SyntheticNode (NVML-shaped GPU rows, 128 processes, one
torch-instrumented process per GPU, engines, ~80 finished requests a second,
CUDA-API rows) every wall second, through the real path: tracker join,
LatestFrames, store (flushed every second), the 15-minute in-memory window
(pre-filled the way the agent fills it, ten seconds at a time, requests
included, so its memory is at steady state from the start) with the streaming
analyzers every 10 s, and /metrics scraped over HTTP every 15 s as Prometheus
would.

Prints:
  * the machine's speed: CPU time of a fixed piece of work (the same in every version), back
    to back and after a second of idling, as the agent's once-a-second threads run; compare
    runs made at different times by it before comparing the agent's figures;
  * agent CPU as % of one core (process CPU time per wall second), with and
    without the synthetic probe's own cost of making frames (which a real
    NVML probe replaces with its own), and without the benchmark's own threads
    too (its sampler and the HTTP client that scrapes), goal <= 1 %; and per thread;
  * RSS at the start and the end of the run, its maximum and its growth per
    hour (least-squares slope over the samples, and end minus start), goal
    <= 150 MB and no growth; the window, store buffers and tracker history are
    bounded, so growth means a leak. ``--trace-rss`` prints the RSS every
    five minutes. The samples fall between analyses; the peak the kernel
    records (VmHWM, reset after the warm-up) counts the moments inside them too;
  * store bytes per GPU-day (from the file's growth; short runs are rounded up
    by the not-yet-sealed fresh chunks), goal <= 25 MB;
  * scrape latency (median and max), streaming analysis wall and CPU time
    (median and max), flush duration;
  * where an analysis' CPU goes, measured after the run on the agent's own
    window, ten new seconds at a time: building the window Table, the first
    reading of its columns (entity groups gathered from the row-major buffer,
    paid by whichever analyzer reads a column first) and the analyzers' own
    work (the same analysis again on the same window, columns already read).

CPU time is the process's (``os.times``) and each thread's (``psutil``); wall
times on a shared machine include time spent waiting for a core, CPU times do
not. Run it pinned to one core: ``taskset -c 1``.

Before a figure: the store dropped no row, holds every row the probe handed over (of each
kind; the tracker-joined process rows within a few ticks), and streaming analyses ran;
otherwise exit 3 with the reason.

The default load is the reference engine's under ``--sim``: engine rows every second and a
row per finished request. A node serving with vLLM gives the agent less: the engine scrape
runs every 5 s and a Prometheus page has no per-request rows. That load is
``--requests-per-s 0 --engine-interval-s 5``. A run should cover a seal (5 minutes): shorter
ones show the flush's work without the seal it saves.

    .venv/bin/python bench/bench_agent.py [--minutes 3] [--gpus 8] [--processes-per-gpu 16] [--trace-rss]
        [--requests-per-s 80] [--engine-interval-s 1]
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import statistics
import sys
import tempfile
import threading
import time
import urllib.request

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_exporter import SyntheticNode  # noqa: E402
from checks import expect, expect_no_drops, expect_rows, store_rows  # noqa: E402

from gpudiag.agent.config import AgentConfig  # noqa: E402
from gpudiag.agent.daemon import Agent  # noqa: E402
from gpudiag.frames import Frame  # noqa: E402
from gpudiag.probes.base import Probe  # noqa: E402

SCRAPE_INTERVAL_S = 15.0
STOP_MARGIN_S = 5.0  # the rows of the last seconds before the stop are not checked (see main)
TRACKER_SLACK_TICKS = 3  # joined process rows may be this many ticks more or fewer than handed (see main)
SAMPLE_EVERY_S = 5.0
HARNESS_THREADS = ("MainThread", "bench-scraper")


class SyntheticNodeProbe(Probe):
    """SyntheticNode's next second of frames, stamped with the wall clock; times its own work."""

    name = "synthetic"

    def __init__(self, node: SyntheticNode):
        self.node = node
        self.busy_s = 0.0
        self.ticks: list[tuple[float, dict[str, int]]] = []  # (time, rows by kind) handed to the agent

    def sample(self, now: float) -> list[Frame]:
        """One second of the node's frames at ``now``."""
        t0 = time.thread_time()
        frames = [Frame(f.kind, now, f.rows) for f in self.node.frames()]
        self.busy_s += time.thread_time() - t0
        rows: dict[str, int] = {}  # counted outside the probe's own time
        for f in frames:
            rows[f.kind] = rows.get(f.kind, 0) + len(f.rows)
        self.ticks.append((now, rows))
        return frames


def rss_bytes() -> int:
    """This process's resident memory."""
    import psutil

    return psutil.Process().memory_info().rss


def reset_peak_rss() -> bool:
    """Start the kernel's resident-memory high-water mark (VmHWM) over from now; False where it cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int | None:
    """The kernel's resident-memory high-water mark (VmHWM): every moment counted, not only the samples."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def cpu_seconds() -> float:
    """This process's CPU time so far (user + system, every thread)."""
    t = os.times()
    return t.user + t.system


def thread_cpu() -> dict[str, float]:
    """CPU seconds so far per live thread, by thread name."""
    import psutil

    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, float] = {}
    for t in psutil.Process().threads():
        name = names.get(t.id, "other")
        out[name] = out.get(name, 0.0) + t.user_time + t.system_time
    return out


def slope_per_hour(samples: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, bytes) samples, in bytes per hour."""
    if len(samples) < 2:
        return 0.0
    ts = [t for t, _ in samples]
    ys = [y for _, y in samples]
    tm, ym = statistics.fmean(ts), statistics.fmean(ys)
    sxx = sum((t - tm) ** 2 for t in ts)
    return sum((t - tm) * (y - ym) for t, y in zip(ts, ys)) / sxx * 3600 if sxx else 0.0


def prefill(agent: Agent, gpus: int, processes_per_gpu: int, window_s: float, interval_s: float,
            **load) -> None:
    """Fill the window as if the agent had run that long (back-dated seconds), converting as it would."""
    filler = SyntheticNode(gpus=gpus, processes_per_gpu=processes_per_gpu, seed=2, **load)
    now = time.time()
    for i in range(int(window_s)):
        agent.window.add([Frame(f.kind, now - window_s + i, f.rows) for f in filler.frames()])
        if (i + 1) % int(interval_s) == 0:
            agent.window.window(agent.node)


def reference_work(rows: list[dict[str, float]]) -> float:
    """CPU seconds of a fixed piece of work shaped like the agent's (row dicts into numpy columns).

    The same in every version of the agent, so runs on different days can be compared: this VM's
    speed moves by a fifth within an hour.
    """
    t = time.thread_time()
    for _ in range(2):
        cols = {k: np.array([r[k] for r in rows]) for k in rows[0]}
        sum(float(c.sum()) for c in cols.values())
    return time.thread_time() - t


def machine_speed(samples: int = 7, idle_s: float = 1.0) -> tuple[float, float]:
    """Median CPU seconds of :func:`reference_work` back to back, and after ``idle_s`` of sleep each time.

    The agent's threads wake once a second (the tracker, the flusher) or every 10 s (the
    analyzer), so they run nearer the second speed: on a VM whose core idles between the
    agent's ticks, the same work takes more CPU time than it does in a loop.
    """
    # Rows that live on between the runs, as the agent's own state does between its ticks.
    rows = [{f"k{j}": float(i * j) for j in range(20)} for i in range(128 * 8)]
    reference_work(rows)
    hot = statistics.median(reference_work(rows) for _ in range(samples))
    cold = []
    for _ in range(samples):
        time.sleep(idle_s)
        cold.append(reference_work(rows))
    return hot, statistics.median(cold)


def analysis_split(agent: Agent, node: SyntheticNode, runs: int = 7) -> tuple[float, float, float]:
    """Median CPU seconds of (window build, first read of its columns, analyzers' own work) per analysis."""
    from gpudiag.analyzers.registry import run_streaming

    build, first, again = [], [], []
    now = time.time()
    for k in range(runs):
        for i in range(10):
            agent.window.add([Frame(f.kind, now + 10 * k + i, f.rows) for f in node.frames()])
        gc.collect()
        t0 = time.thread_time()
        win = agent.window.window(agent.node)
        t1 = time.thread_time()
        run_streaming(win)
        t2 = time.thread_time()
        run_streaming(win)
        t3 = time.thread_time()
        win.release()
        build.append(t1 - t0)
        first.append((t2 - t1) - (t3 - t2))
        again.append(t3 - t2)
    return statistics.median(build), statistics.median(first), statistics.median(again)


def main(argv: list[str] | None = None) -> int:
    """Run the agent for ``--minutes`` and print the figures."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=3.0, help="measured run (after a 30 s warm-up)")
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--processes-per-gpu", type=int, default=16)
    ap.add_argument("--requests-per-s", type=float, default=80.0,
                    help="finished requests a second, a row each (0: an engine scraped over Prometheus)")
    ap.add_argument("--engine-interval-s", type=int, default=1, help="seconds between engine rows (scrape: 5)")
    ap.add_argument("--trace-rss", action="store_true", help="print the RSS every five minutes")
    args = ap.parse_args(argv)
    if args.engine_interval_s < 1 or args.requests_per_s < 0:
        ap.error("--engine-interval-s must be at least 1 and --requests-per-s at least 0")
    logging.basicConfig(level=logging.ERROR, stream=sys.stderr)

    speed = machine_speed()
    with tempfile.TemporaryDirectory() as tmp:
        load = {"requests_per_s": args.requests_per_s, "engine_interval_s": args.engine_interval_s}
        node = SyntheticNode(gpus=args.gpus, processes_per_gpu=args.processes_per_gpu, **load)
        probe = SyntheticNodeProbe(node)
        cfg = AgentConfig().with_overrides({"store.path": os.path.join(tmp, "timeline.db"),
                                            "exporter.listen": "127.0.0.1:0"})
        agent = Agent(cfg, probes=[("synthetic", probe, 1.0)], node=node.node)
        window_s = cfg.get("analyzers.window_s")
        prefill(agent, args.gpus, args.processes_per_gpu, window_s, cfg.get("analyzers.interval_s"), **load)
        gc.collect()
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

        th = threading.Thread(target=scraper, name="bench-scraper", daemon=True)
        th.start()
        time.sleep(30)  # warm-up: imports, first analyses, first sealed chunk
        hwm_reset = reset_peak_rss()
        rss0, cpu0, wall0, busy0 = rss_bytes(), cpu_seconds(), time.monotonic(), probe.busy_s
        threads0 = thread_cpu()
        size0 = agent.store.health()["db_bytes"] or 0
        analyses0 = agent.analyses
        analysis_s, analysis_cpu_s, flush_s, rss_trace = [], [], [], []
        last_analysis = agent.analyses
        end = wall0 + args.minutes * 60
        next_trace = wall0 + 300
        while time.monotonic() < end:
            time.sleep(SAMPLE_EVERY_S)
            if agent.analyses != last_analysis and agent.analysis_seconds is not None:
                last_analysis = agent.analyses
                analysis_s.append(agent.analysis_seconds)
                analysis_cpu_s.append(agent.analysis_cpu_seconds)
            h = agent.store.health()
            if h["last_flush_seconds"] is not None:
                flush_s.append(h["last_flush_seconds"])
            rss_trace.append((time.monotonic() - wall0, rss_bytes()))
            if args.trace_rss and time.monotonic() >= next_trace:
                next_trace += 300
                print(f"  {(time.monotonic() - wall0) / 60:5.1f} min: RSS {rss_trace[-1][1] / 1e6:.0f} MB", flush=True)
        wall = time.monotonic() - wall0
        cpu = cpu_seconds() - cpu0
        threads1 = thread_cpu()
        busy = probe.busy_s - busy0
        rss1 = rss_bytes()
        peak = peak_rss_bytes() if hwm_reset else None
        size1 = agent.store.health()["db_bytes"] or 0
        analyses = agent.analyses - analyses0
        stop.set()
        agent.stop()
        expect_no_drops(agent.store.health())
        # Every row the probe handed over is in the store, up to a few seconds before the stop. Process
        # rows go through the tracker, which joins each probe's newest rows once a second on its own
        # beat and stamps them with the join's time: a tick more or less of them within the margin.
        expect(len(probe.ticks) > STOP_MARGIN_S, f"the probe ran {len(probe.ticks)} ticks")
        cutoff = probe.ticks[-1][0] - STOP_MARGIN_S
        handed: dict[str, int] = {}
        for t, rows in probe.ticks:
            for kind, n in rows.items():
                handed[kind] = handed.get(kind, 0) + (n if t <= cutoff else 0)
        per_tick = probe.ticks[-1][1].get("process", 0)
        want = {k: (n - TRACKER_SLACK_TICKS * per_tick, n + TRACKER_SLACK_TICKS * per_tick) if k == "process" else n
                for k, n in handed.items()}
        expect_rows(store_rows(cfg.store_path(), handed, end_s=cutoff), want, "the agent's store")
        expect(analyses > 0, "no streaming analysis ran during the measured run")
        split = analysis_split(agent, node)

    gpus = args.gpus
    rss_max = max(r for _, r in rss_trace)
    print(f"node: {gpus} GPUs x {args.processes_per_gpu} processes, 1 s samples; measured {wall / 60:.1f} min "
          f"after a 30 s warm-up, window {window_s:g} s pre-filled")
    print(f"machine: a fixed reference work takes {speed[0] * 1000:.2f} ms of CPU back to back, "
          f"{speed[1] * 1000:.2f} ms after 1 s idle (x{speed[1] / speed[0]:.2f}; medians of 7)")
    per_thread = sorted(((name, v - threads0.get(name, 0.0)) for name, v in threads1.items()), key=lambda kv: -kv[1])
    # This process also runs the benchmark itself: the sampler in the main thread (RSS, store
    # health every 5 s) and the scraper's HTTP client reading /metrics. Neither is the agent's
    # work; the agent's side of a scrape runs in its own handler threads and stays counted.
    harness = sum(v for name, v in per_thread if name in HARNESS_THREADS)
    print(f"agent CPU: {100 * cpu / wall:.2f} % of one core in all; {100 * (cpu - busy) / wall:.2f} % without "
          f"the synthetic probe making frames ({100 * busy / wall:.2f} %); {100 * (cpu - busy - harness) / wall:.2f} %"
          f" without the benchmark's sampler and scrape client as well ({100 * harness / wall:.3f} %)   goal <= 1 %")
    print("  by thread: " + ", ".join(f"{name} {100 * v / wall:.2f} %" for name, v in per_thread if v > 0.0005 * wall)
          + " (the rest: short-lived HTTP handler threads)")
    print(f"agent RSS: {rss0 / 1e6:.0f} MB at start, {rss1 / 1e6:.0f} MB at end, max {rss_max / 1e6:.0f} MB; "
          f"growth {slope_per_hour(rss_trace) / 1e6:+.1f} MB/h (fit), {(rss1 - rss0) / 1e6:+.1f} MB in "
          f"{wall / 60:.1f} min   goal <= 150 MB, no growth")
    if peak is not None:
        # The samples above fall between analyses, after each has handed its memory back; the
        # high-water mark also counts the moments inside an analysis (its temporary arrays).
        print(f"  peak RSS over the measured run (kernel high-water mark, analyses included): {peak / 1e6:.0f} MB")
    print(f"store: {(size1 - size0) / (wall / 86400) / gpus / 1e6:.1f} MB per GPU-day from the file's growth "
          f"({(size1 - size0) / 1e6:.1f} MB in {wall / 60:.1f} min, fresh chunks not yet sealed count in full)"
          f"   goal <= 25 MB")
    if scrapes:
        print(f"scrape /metrics (in the running agent): median {statistics.median(scrapes):.1f} ms, "
              f"max {max(scrapes):.1f} ms over {len(scrapes)} scrapes   goal < 50 ms")
    if analysis_s:
        print(f"streaming analysis over the {window_s:g} s window: {analyses} runs, wall median "
              f"{statistics.median(analysis_s) * 1000:.0f} ms (max {max(analysis_s) * 1000:.0f}), CPU median "
              f"{statistics.median(analysis_cpu_s) * 1000:.0f} ms (max {max(analysis_cpu_s) * 1000:.0f}) per run")
    print(f"  an analysis' CPU: window build {split[0] * 1000:.1f} ms, first read of its columns "
          f"{split[1] * 1000:.1f} ms, analyzers' own work {split[2] * 1000:.1f} ms (medians of 7 after the run)")
    if flush_s:
        print(f"store flush: median {statistics.median(flush_s) * 1000:.1f} ms, max {max(flush_s) * 1000:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
