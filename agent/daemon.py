"""The per-node agent: probes on their own schedules, the tracker, the store, exporters, streaming findings.

Threads, each with one job, so that a slow or failing part never stalls another:

* one **probe slot** per probe, sampling at that probe's own interval (NVML,
  host, torch, tracker 1 s; eBPF map read 1 s; engine scrape 5 s). A probe
  that raises is counted in ``agent_probe_errors_total{probe,kind}`` and
  sampled again at its next tick; a probe slower than its interval is counted
  as ``kind="overrun"`` and simply ticks less often;
* the **tracker** joins the process rows of every probe (NVML's black layer,
  the in-process reporters' white and grey) per (GPU, pid) once a second;
* the **flusher** writes the store every second and refreshes the self-metrics
  (tick duration per probe, probe errors, dropped events, store write latency
  and size, agent CPU and RSS);
* the **analyzer** runs every analyzer every ``analyzers.interval_s`` of frame
  time over a sliding window (default 15 minutes) kept in memory, and turns
  what they return into open and resolved findings (:class:`FindingLog`).

Every tick's frames go to :class:`~gpudiag.exposition.LatestFrames`
(the Prometheus endpoint and OTLP read it), to the store and to the window.

In ``--sim`` mode the probe is the reference engine on the simulated GPU,
paced at ``speed`` times real time. Its frames are drained every tick, all of
them, and stamped on a simulated time base (the agent's start time plus the
simulated second), so the store and the analyzers see 1 s samples at any
speed.
"""

from __future__ import annotations

import gc
import logging
import os
import socket
import threading
import time
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import psutil

from gpudiag.agent.config import AgentConfig
from gpudiag.agent.prom_exporter import parse_listen, serve
from gpudiag.agent.store import Store
from gpudiag.agent.tracker import ThreeColourTracker
from gpudiag.catalog import M
from gpudiag.errors import GpudiagError
from gpudiag.exposition import LatestFrames, registry_for
from gpudiag.findings import Evidence, Finding, Severity
from gpudiag.frames import BufferPool, Frame, FrameColumns, Table, TableBuffer, Window
from gpudiag.probes.base import Probe, ProbeError

log = logging.getLogger("gpudiag.agent")

# A finding the analyzers still report but whose evidence ended this long before the
# window's newest frame is over: the analyzers merge episodes up to 300 s apart
# (kv_eviction_storm, memory_fragmentation MERGE_GAP_S), so a recurrence within that
# gap would have extended it.
RESOLVE_AFTER_S = 300.0
# Two sightings of one kind on one entity this close are the same finding: the start an
# analyzer reports moves as the window slides over it.
SAME_FINDING_SLACK_S = 300.0
# The state of a stored finding that was still open when the agent stopped: its end is the
# agent's last sample (what it saw of it), and the next agent on the store takes it up again.
OPEN_AT_STOP = "open_at_stop"
# The analyzer thread sleeps until frames bring the next analysis due (SlidingWindow.wait_for); it
# also wakes this often to see a reloaded analyzers.interval_s. Polling instead (every 50 ms) cost
# a quarter of a percent of a core in wake-ups alone.
ANALYSIS_WAKE_S = 1.0
# With --sim the engine may run at most this far (simulated seconds) ahead of the last
# analysis: at high speeds analysis is the bottleneck, and a finding seen minutes of
# simulated time late would misplace it. A minute is the shortest episode the analyzers
# report (kv_eviction_storm MIN_DURATION_S).
SIM_LEAD_S = 60.0
FLUSH_INTERVAL_S = 1.0
# The tracker's join and the flush follow the probes' ticks (Pulse): each runs at the first tick
# from EARLIEST to LATEST of its interval after its last run, or at LATEST without one. A quarter
# either side: a probe on the same interval is always inside, so the work locks on right behind
# it whatever its phase, and work that no probe paces still runs at least every 5/4 of its
# interval. Probes that tick faster than the work pull it a little early: it runs at the first
# tick after 3/4 of its interval.
PULSE_EARLIEST = 0.75
PULSE_LATEST = 1.25
# An analysis and a seal each hold 13-15 MB of temporary arrays for a moment (8 GPUs x 16
# processes); at once they would add up, on top of everything else the agent holds. So a flush
# leaves its seal to the next second while an analysis runs, and an analysis waits for a running
# flush (its seal: ~0.35 s) at most this long, so that a write stuck on the disk never holds
# the findings up for longer.
HEAVY_WAIT_S = 2.0
# After deferring its seal this many times in a row (analyses back to back under a fast --sim),
# a flush waits for the running analysis to end (at most HEAVY_WAIT_S) and seals: fresh chunks
# left unsealed hold their twins in memory.
MAX_SEALS_DEFERRED = 5
# Keys the in-memory window leaves out of its rows: the probe's state (not the timeline), and
# columns no streaming analyzer reads (tests check that no analyzer names them and that every
# scenario's findings stay the same without them). The window holds
# 15 minutes of every row: on a node of 8 GPUs x 16 processes serving 80 requests a second
# these are about a third of it (a unique request id string per request). The store and the
# exporter keep them.
_NOT_IN_WINDOW = (
    "missing_reasons",
    "request_id", "prompt_tokens", "output_tokens",
    M.process_cpu_utilization_ratio, M.process_resident_memory_bytes, M.process_context_switches_total,
    M.process_torch_active_bytes, M.process_torch_requested_bytes, M.process_torch_segments,
    # A GPU's inventory (its labels, what it is and where) and the figures no analyzer weighs.
    "uuid", "pci_bus_id", "driver_version", "cuda_driver_version", "mig_mode", "virtualization_mode",
    M.gpu_info, M.gpu_memory_utilization_ratio, M.gpu_memory_reserved_bytes, M.gpu_memory_clock_hertz,
    M.gpu_memory_clock_max_hertz, M.gpu_memory_temperature_celsius, M.gpu_pcie_tx_bytes_per_second,
    M.gpu_pcie_rx_bytes_per_second, M.gpu_performance_state,
    # An engine's model and state labels, the node's own load, the CUDA API counts. (Generated
    # tokens stay: kv_eviction_storm weighs the throughput a storm costs.)
    "model", "fingerprint", M.engine_serving_state, M.engine_model_info,
    M.node_cpu_utilization_ratio, M.node_load1, M.node_memory_used_bytes, M.node_memory_total_bytes,
    M.node_swap_used_bytes, M.cuda_api_calls_total, M.cuda_api_bytes_total,
)


# --- probe slots --------------------------------------------------------------------------


class Pulse:
    """The moments frames come in, for the agent's once-an-interval work to run right behind them.

    The tracker's join follows the probes' ticks and the flush follows the join, so a node's
    second of work runs in one burst instead of three wake-ups at unrelated moments. A core that
    idles between bursts runs the work that wakes it slower (cold caches, a vCPU being
    rescheduled): on the benchmark's VM a fixed piece of work takes 1.4 times as long after a
    second of idling as back to back, and about 1.0-1.4 times right behind another piece
    (bench_agent.py prints the first ratio as ``machine:``).
    """

    def __init__(self):
        self._cond = threading.Condition()
        self._beats = 0

    def beat(self) -> None:
        """Frames came in (or the work a follower follows is done): wake the followers that wait."""
        with self._cond:
            self._beats += 1
            self._cond.notify_all()

    def every(self, interval_s: float, stop: threading.Event) -> Iterator[None]:
        """Yield once per ``interval_s``: at the first beat from PULSE_EARLIEST to PULSE_LATEST of it
        after the last yield, or at PULSE_LATEST without one. Ends when ``stop`` is set and the
        follower wakes (:meth:`beat` after setting it wakes a waiting one at once)."""
        last = time.monotonic()
        while True:
            # Beats before the earliest moment do not count: a probe ticking at another phase
            # would otherwise pull the work off the beat of its own interval.
            if stop.wait(max(0.0, last + PULSE_EARLIEST * interval_s - time.monotonic())):
                return
            with self._cond:
                seen = self._beats
                self._cond.wait_for(lambda seen=seen: self._beats != seen or stop.is_set(),
                                    timeout=max(0.0, last + PULSE_LATEST * interval_s - time.monotonic()))
            if stop.is_set():
                return
            last = time.monotonic()
            yield


class ProbeSlot:
    """One probe sampled on its own thread at its own interval; counts errors, overruns and tick time."""

    def __init__(self, key: str, probe: Probe, interval_s: float, sink, *, timeline: bool = False):
        self.key = key
        self.probe = probe
        self.interval_s = float(interval_s)
        self.timeline = timeline  # frames carry their own (simulated) time; see Agent._ingest
        self._sink = sink
        self.errors: dict[str, int] = {}
        self.last_tick_s: float | None = None
        self.last_error: str | None = None
        self.available = True
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"gpudiag-probe-{key}", daemon=True)

    def start(self) -> None:
        """Begin sampling."""
        self._thread.start()

    def _count(self, kind: str, message: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1
        if message != self.last_error:  # one log line per change of failure, not per tick
            log.warning("probe %s: %s", self.key, message)
        self.last_error = message

    def tick(self) -> None:
        """Sample once and hand the frames on; never raises."""
        started = time.perf_counter()
        try:
            frames = self.probe.sample(time.time())
        except ProbeError as exc:
            self._count("probe_error", str(exc))
            frames = None
        except Exception as exc:  # noqa: BLE001 - a probe bug must not take the agent down
            self._count("exception", f"{type(exc).__name__}: {exc}")
            frames = None
        self.last_tick_s = time.perf_counter() - started
        if frames is None:
            return
        if self.last_error is not None:
            log.info("probe %s works again", self.key)
            self.last_error = None
        try:
            self._sink(self, frames)
        except Exception as exc:  # noqa: BLE001 - malformed frames are that probe's fault
            self._count("bad_frames", f"{type(exc).__name__}: {exc}")

    def _run(self) -> None:
        next_at = time.monotonic()
        first = True
        while not self._stop.is_set():
            self.tick()
            next_at += self.interval_s
            now = time.monotonic()
            if now > next_at:  # behind: skip the missed ticks
                # The first tick carries the probe's setup (the eBPF probe compiles and attaches
                # its programs, seconds): only a later slow tick means it cannot keep its interval.
                if first:
                    log.info("probe %s: first tick (setup) took %.3f s", self.key, self.last_tick_s)
                elif self.last_tick_s > self.interval_s:  # the probe itself is too slow: say so
                    self.errors["overrun"] = self.errors.get("overrun", 0) + 1
                    if self.errors["overrun"] == 1:
                        log.warning("probe %s: a tick took %.3f s, longer than its %g s interval; it ticks "
                                    "less often (counted as kind=\"overrun\")", self.key, self.last_tick_s,
                                    self.interval_s)
                next_at = now
            first = False
            self._stop.wait(max(0.0, next_at - now))

    def stop(self, timeout_s: float = 1.0) -> None:
        """Stop sampling (waits up to ``timeout_s`` for a tick in progress) and close the probe."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        try:
            self.probe.close()
        except Exception as exc:  # noqa: BLE001 - closing on the way out: say it, go on
            log.warning("closing probe %s: %s", self.key, exc)

    def dropped(self) -> int:
        """Events the probe dropped (full buffers), when it counts them."""
        fn = getattr(self.probe, "dropped_events", None)
        try:
            return int(fn()) if fn is not None else 0
        except Exception:  # noqa: BLE001 - a count, not worth failing for
            return 0

    def metric_rows(self) -> list[dict[str, Any]]:
        """Self-metrics rows of this slot."""
        rows: list[dict[str, Any]] = [{"probe": self.key, M.agent_probe_available: 1 if self.available else 0,
                                       M.agent_dropped_events_total: self.dropped()}]
        if self.last_tick_s is not None:
            rows.append({"probe": self.key, M.agent_tick_seconds: self.last_tick_s})
        rows += [{"probe": self.key, "kind": kind, M.agent_probe_errors_total: n}
                 for kind, n in sorted(self.errors.items())]
        return rows


class SimTimeline(Probe):
    """The simulated engine's every frame since the last tick, stamped ``t0 + simulated second``."""

    name = "sim"

    def __init__(self, scenario: str, *, speed: float, seed: int, t0: float | None = None,
                 hold_after_s: float | None = None):
        from gpudiag.probes.sim import SimProbe

        # ``hold_after_s``: simulated seconds the engine may run before the first hold_after.
        self.sim = SimProbe(scenario, speed=speed, seed=seed, timeline=True, hold_after_s=hold_after_s)
        self.t0 = time.time() if t0 is None else t0
        # Drained four times per wall second at most speeds, so findings follow the
        # simulated clock closely without a wake-up per simulated second.
        self.interval_s = 0.25

    def sample(self, now: float) -> list[Frame]:
        """Frames produced since the previous call, on the simulated time base."""
        return [Frame(f.kind, self.t0 + f.t, f.rows) for f in self.sim.drain()]

    def hold_after(self, t: float) -> None:
        """Let the simulated engine run up to frame time ``t`` (see SimProbe.hold_after)."""
        self.sim.hold_after(t - self.t0)

    def dropped_events(self) -> int:
        """Simulated frames dropped because nobody drained them."""
        return self.sim.dropped_frames

    def status(self) -> dict[str, Any]:
        """The simulated engine's status."""
        return self.sim.status()

    def close(self) -> None:
        """Stop the simulated engine."""
        self.sim.close()


class EbpfProbe(Probe):
    """The CUDA API eBPF probes (always-on, low-rate calls only) read once a tick; started on first use."""

    name = "ebpf"

    def __init__(self, node: str | None = None):
        self.node = node
        self._inner = None

    def sample(self, now: float) -> list[Frame]:
        """Attach on the first call (compiling takes seconds, on this slot's thread), then read the maps."""
        if self._inner is None:
            from gpudiag.probes.cuda_ebpf import CudaApiProbe

            # Launch APIs fire millions of times a second under load; an always-on agent
            # probes only allocations, frees, copies, syncs and errors (DESIGN.md).
            self._inner = CudaApiProbe(None, launches=False, node=self.node).start()
        self._inner.poll()
        return self._inner.frames(now)

    def dropped_events(self) -> int:
        """Events the kernel could not record."""
        return sum(self._inner.drops().values()) if self._inner is not None else 0

    def close(self) -> None:
        """Detach (in the background)."""
        if self._inner is not None:
            self._inner.close()
            self._inner = None


def ebpf_unavailable_reason() -> str | None:
    """Why the eBPF probes cannot run here (first blocking check), or None when they can."""
    try:
        from gpudiag.probes import cuda_ebpf  # noqa: F401
        from gpudiag.probes.ebpf_readiness import blocking, ebpf_checks, explain
    except Exception as exc:  # noqa: BLE001 - a missing or broken module is a reason, not a crash
        return f"eBPF probe modules not importable: {type(exc).__name__}: {exc}"
    try:
        blockers = blocking(ebpf_checks())
    except Exception as exc:  # noqa: BLE001
        return f"eBPF readiness check failed: {type(exc).__name__}: {exc}"
    return explain(blockers[0]) if blockers else None


# --- memory ------------------------------------------------------------------------------------

# glibc mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8
# An always-on agent frees window-sized arrays every analysis. glibc raises its mmap threshold
# to the size of each large block freed, so later ones come from the heap, whose freed pages it
# keeps; fixed thresholds send every array over 128 KiB to mmap (back to the system on free), and
# two arenas instead of one per thread keep the probe threads' small frees from pinning pages.
_MALLOC_SETTINGS = ((_M_MMAP_THRESHOLD, 128 * 1024), (_M_TRIM_THRESHOLD, 128 * 1024), (_M_ARENA_MAX, 2))
# After an analysis the young generations are collected, its cycles still among them (it runs a
# young collection about once, so its objects rarely get older than that). A full collection
# also walks every object kept since the start, the window's object arrays value by value: about
# 3 ms of CPU after the agent's idle seconds, a thirtieth of its 1 % budget at one every 10 s. One in
# this many analyses (a minute at the default interval) also takes the cycles that did get old.
FULL_COLLECTION_EVERY = 6


def _libc():
    """glibc, when this process runs on it (None elsewhere: musl, macOS)."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


class MemoryKeeper:
    """Keeps the agent's resident memory at what it holds: fixed malloc thresholds, a trim after each analysis."""

    def __init__(self):
        self._libc = _libc()
        self._releases = 0
        if self._libc is not None:
            for param, value in _MALLOC_SETTINGS:
                self._libc.mallopt(param, value)

    def release(self) -> None:
        """Collect the analysis' reference cycles, then hand the heap's free pages back (once per analysis).

        An analysis' rows and columns point at each other, so without a
        collection they wait for the oldest generation's, with the buffer arrays
        their views keep, for minutes. Collected here: the young generations
        every time, all of them every :data:`FULL_COLLECTION_EVERY` analyses.
        """
        if not self._releases:
            # What the agent made to start (modules, catalog, probes, the first analysis' imports)
            # lives as long as it does: set aside, never scanned again, so each collection scans
            # only what came since (a full one over everything takes tens of ms here).
            gc.collect()
            gc.freeze()
        else:
            gc.collect(2 if self._releases % FULL_COLLECTION_EVERY == 0 else 1)
        self._releases += 1
        if self._libc is not None:
            self._libc.malloc_trim(0)


class ResidentMemory:
    """The process' resident set size, for the self-metrics every second.

    Read from /proc/self/statm through one descriptor kept open: psutil opens and parses the
    file on each call, which after the agent's idle second costs about 0.2 ms, four times
    what reading it again costs. psutil where the file cannot be read.
    """

    def __init__(self):
        self._proc = psutil.Process()
        self._page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
        try:
            self._fd: int | None = os.open("/proc/self/statm", os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            self._fd = None

    def bytes(self) -> int:
        """Resident bytes now."""
        fd = self._fd
        if fd is not None:
            try:
                return int(os.pread(fd, 128, 0).split()[1]) * self._page  # size, resident, ... in pages
            except (OSError, ValueError, IndexError):
                pass
        return self._proc.memory_info().rss

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


# --- the in-memory window -------------------------------------------------------------------


class SlidingWindow:
    """The last ``window_s`` seconds of frames, per kind, as columns that slide (built once, never copied again).

    :meth:`add` keeps each tick's rows as the columns the store takes too
    (:class:`~gpudiag.frames.FrameColumns`); :meth:`window` joins the columns added
    since the last call into one :class:`~gpudiag.frames.Table`
    chunk per kind (numpy arrays, no pandas), appends it to that kind's
    :class:`~gpudiag.frames.TableBuffer` and drops the rows that left the window,
    so every analysis converts only new rows and copies none of the kept ones;
    label codes computed for a chunk are reused by every later window.
    """

    def __init__(self, window_s: float):
        self.window_s = float(window_s)
        self._lock = threading.Lock()
        self._pending: dict[str, list[FrameColumns]] = {}
        self._buffers: dict[str, TableBuffer] = {}
        self.newest_t: float | None = None
        self._due: tuple[float, float] | None = None  # (since, interval) a waiter waits for; None: any frame
        self._arrived = threading.Event()
        self._pool = BufferPool()  # the analyses' entity-order copies, one analysis' worth handed on

    def add(self, frames: Iterable[Frame], columns: Iterable[FrameColumns] | None = None) -> None:
        """Take frames, with their rows as columns when the caller made them already (``columns``:
        :meth:`FrameColumns.of` of the frames' rows, by kind; the arrays are kept, never changed)."""
        frames = list(frames)
        if columns is None:
            columns = [FrameColumns.of(fr.kind, [fr]) for fr in frames if fr.rows]
        with self._lock:
            for c in columns:
                if c.n:
                    self._pending.setdefault(c.kind, []).append(c)
            for fr in frames:
                if self.newest_t is None or fr.t > self.newest_t:
                    self.newest_t = fr.t
            if self.newest_t is not None and self._is_due(self.newest_t):
                self._arrived.set()

    def _is_due(self, newest: float) -> bool:
        # The very test the analysis loop makes, so a wake-up is never one it would ignore.
        return self._due is None or newest - self._due[0] >= self._due[1]

    def wait_for(self, since: float | None, interval_s: float, timeout_s: float) -> float | None:
        """Block until the newest frame is ``interval_s`` past ``since`` (any frame when ``since`` is None),
        :meth:`wake` or ``timeout_s``; returns the newest frame time (None before the first frame)."""
        with self._lock:
            self._due = None if since is None else (since, interval_s)
            if self.newest_t is not None and self._is_due(self.newest_t):
                return self.newest_t
            self._arrived.clear()
        self._arrived.wait(timeout_s)
        return self.newest_t

    def wake(self) -> None:
        """Let a :meth:`wait_for` in progress return now (the agent stops)."""
        self._arrived.set()

    def window(self, node: str | None = None) -> Window:
        """The frames of ``(newest - window_s, newest]`` as a Window."""
        with self._lock:
            pending, self._pending = self._pending, {}
            end = self.newest_t
        if end is None:
            return Window({}, 0.0, 0.0, node)
        start = end - self.window_s
        self._pool.settle()  # a new window: the last one's analysis is over
        for kind, chunks in pending.items():
            self._buffers.setdefault(kind, TableBuffer()).append(Table.from_columns(chunks, skip=_NOT_IN_WINDOW))
        tables = {}
        for kind, buf in self._buffers.items():
            buf.drop_until(start)
            if len(buf):
                tables[kind] = buf.table()
                tables[kind].pool = self._pool
        return Window.from_columns(tables, start_s=start, end_s=end, node=node, sources=["agent"])


# --- findings over time -----------------------------------------------------------------------


@dataclass
class _Open:
    id: str
    key: tuple
    start_s: float
    end_s: float
    finding: Finding
    opened_at_s: float
    resolved_at_s: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    confirmed_at_s: float | None = None  # the end of the last window whose analysis reported it (not over)
    escalated_from: Severity | None = None  # the severity the latest analysis raised it from, if it did

    def document(self) -> dict[str, Any]:
        d = self.finding.to_dict()
        # open: as the state says; the last analysis' own flag (still going at its window's end) is
        # what kept it open, and a resolved finding is over whatever its last sighting said.
        d.update(id=self.id, start_s=self.start_s, end_s=self.end_s if self.resolved_at_s is not None else None,
                 open=self.resolved_at_s is None, state="resolved" if self.resolved_at_s is not None else "open",
                 opened_at_s=self.opened_at_s, resolved_at_s=self.resolved_at_s, last_evidence_s=self.end_s)
        return d


class FindingLog:
    """Turns each analysis' findings into opened, updated and resolved findings with stable ids.

    An analyzer re-run over a sliding window reports the same episode with a start
    that moves (its trailing windows are cut by the window's start); two sightings of
    one kind on one (node, GPU, pid) within SAME_FINDING_SLACK_S are one finding, which
    keeps the id and the earliest start of its first sighting. A finding is resolved
    when the latest analysis no longer reports it (for a kind held for a window, once a
    whole window has passed since an analysis last reported it), or reports it with
    evidence that ended RESOLVE_AFTER_S before the window's end; its end is the last
    evidence.
    """

    def __init__(self):
        self.open: dict[str, _Open] = {}
        self._resolved: dict[str, _Open] = {}  # remembered while sightings of them may still come

    @staticmethod
    def _key(f: Finding) -> tuple:
        return (f.kind, f.node, f.gpu, f.pid)

    def restore(self, documents: Iterable[dict[str, Any]]) -> None:
        """Take the findings a previous run left open (from the store), so they can be resolved."""
        for d in documents:
            if d.get("end_s") is not None and d.get("state") != OPEN_AT_STOP:
                continue
            # Everything the document holds comes back: the finding is written again when it resolves, and
            # that document replaces this one in the store (evidence, details and pod included).
            f = Finding(kind=d["kind"], severity=Severity(str(d["severity"])), start_s=float(d["start_s"]),
                        end_s=float(d.get("last_evidence_s") or d["start_s"]), summary=d.get("summary", ""),
                        gpu=d.get("gpu"), node=d.get("node"), pid=d.get("pid"), runbook=d.get("runbook", ""),
                        fixes=list(d.get("fixes") or []), caused_by=list(d.get("caused_by") or []),
                        evidence=[Evidence.from_dict(e) for e in d.get("evidence") or [] if isinstance(e, dict)],
                        details=dict(d.get("details") or {}),
                        **{k: d.get(k) for k in ("pod", "namespace", "container", "gpu_instance", "compute_instance")})
            self.open[d["id"]] = _Open(d["id"], self._key(f), f.start_s, f.end_s, f,
                                       float(d.get("opened_at_s") or f.start_s))

    def _match(self, f: Finding, pool: dict[str, _Open]) -> _Open | None:
        key = self._key(f)
        for rec in pool.values():
            if rec.key == key and f.start_s <= rec.end_s + SAME_FINDING_SLACK_S \
                    and f.end_s >= rec.start_s - SAME_FINDING_SLACK_S:
                return rec
        return None

    def reconcile(self, findings: list[Finding], window_end_s: float, window_start_s: float,
                  held: Collection[str] = ()) -> tuple[list[_Open], list[_Open], list[_Open]]:
        """(opened, updated, resolved) after one analysis of ``(window_start_s, window_end_s]``.

        An open finding of a kind in ``held`` (analyzers.registry.HELD_FOR_A_WINDOW) that this
        analysis does not report stays open while its last confirmation is inside the window: it
        is resolved once a whole window has passed without one.
        """
        opened, updated, resolved = [], [], []
        seen: set[str] = set()
        for rec in self.open.values():
            rec.escalated_from = None
        for f in findings:
            over = f.end_s < window_end_s - RESOLVE_AFTER_S
            rec = self._match(f, self.open)
            if rec is None:
                old = self._match(f, self._resolved)
                if old is not None:
                    if f.end_s <= old.end_s + SAME_FINDING_SLACK_S:
                        continue  # the same, already resolved episode seen again as the window slides
                    rec = old  # it came back: reopen under its id
                    del self._resolved[old.id]
                    rec.resolved_at_s = None
                    self.open[rec.id] = rec
                    opened.append(rec)
            if rec is None:
                rec = _Open(f.id, self._key(f), f.start_s, f.end_s, f, window_end_s)
                self.open[rec.id] = rec
                opened.append(rec)
            elif rec not in opened:
                changed = (f.severity != rec.finding.severity or f.summary != rec.finding.summary
                           or f.end_s != rec.end_s)
                if changed:
                    updated.append(rec)
                if f.severity.rank > rec.finding.severity.rank:
                    rec.escalated_from = rec.finding.severity
            rec.start_s = min(rec.start_s, f.start_s)
            rec.end_s = max(rec.end_s, f.end_s)
            rec.finding = f
            if not over:
                seen.add(rec.id)
                rec.confirmed_at_s = window_end_s
        for rid in [r for r in self.open if r not in seen]:
            rec = self.open[rid]
            if rec.key[0] in held and rec.confirmed_at_s is not None and rec.confirmed_at_s > window_start_s:
                continue  # confirmed within this window: a window that cannot confirm a trend does not end it
            del self.open[rid]
            rec.resolved_at_s = window_end_s
            self._resolved[rid] = rec
            resolved.append(rec)
            if rec in updated:
                updated.remove(rec)
        for rid in [r for r, rec in self._resolved.items() if rec.end_s < window_start_s]:
            del self._resolved[rid]
        return opened, updated, resolved

    def active(self) -> list[dict[str, Any]]:
        """The open findings as documents (for the exporter's gpudiag_finding_active)."""
        return [rec.document() for rec in self.open.values()]

    def at_stop(self, last_sample_s: float | None) -> list[dict[str, Any]]:
        """The open findings as documents for a stopping agent: each ends at ``last_sample_s`` (the newest
        sample; its last evidence when there was none) in state OPEN_AT_STOP, which :meth:`restore` takes
        up again."""
        out = []
        for rec in self.open.values():
            d = rec.document()
            d.update(end_s=rec.end_s if last_sample_s is None else max(rec.end_s, last_sample_s), state=OPEN_AT_STOP)
            out.append(d)
        return out


# --- the agent ----------------------------------------------------------------------------------


class Agent:
    """The per-node agent. ``Agent(config, ...).start()``, then ``stop()``; ``reload(config)`` on SIGHUP.

    ``probes`` replaces the probes the agent would open itself (tests, benchmarks);
    ``sim`` runs the reference engine's scenario on the simulated GPU instead of the
    node's probes. The store is opened first, so a second agent on the same store is
    refused before it binds a port or starts a probe.
    """

    def __init__(self, config: AgentConfig, *, sim: str | None = None, speed: float = 1.0, seed: int = 0,
                 probes: list[tuple[str, Probe, float]] | None = None, node: str | None = None,
                 serve_metrics: bool = True, sim_pods: bool = False,
                 dialect: str | dict[str, str] | None = None):
        self.config = config
        self.sim, self.speed, self.seed = sim, speed, seed
        self.sim_pods = sim_pods  # the simulated processes run in Kubernetes pods (gpudiag.probes.kube.sim_pods)
        self.node = node or config.get("agent.node") or ("sim-node" if sim else socket.gethostname())
        self._given_probes = probes
        self._serve_metrics = serve_metrics
        if sim is not None:
            from gpudiag.reference_engine import scenarios
            from gpudiag.reference_engine.sim.engine import check_seed

            scenarios.get(sim)  # an unknown name is refused before the store is opened or created
            check_seed(seed)
        # A path that cannot be written at start is a mistake to report, not an outage to ride out.
        self.store = Store.open(config.store_path(), retention_s=config.get("store.retention_s"),
                                max_bytes=config.get("store.max_bytes"), must_write=True)
        self.latest = LatestFrames(self.node, export_engine_dialect=sim is not None or dialect is not None)
        if dialect is None:
            self.registry = registry_for(self.latest)
        else:  # the engine's series in another engine's names (reference_engine.serving.dialect_metrics)
            from gpudiag.reference_engine.serving.dialect_metrics import speaking_registry

            self.registry = speaking_registry(self.latest, dialect)
        self.tracker = ThreeColourTracker()
        self.window = SlidingWindow(config.get("analyzers.window_s"))
        self.findings = FindingLog()
        self.findings.restore(self.store.findings(0.0, float("inf")))
        self.slots: list[ProbeSlot] = []
        self.unavailable: dict[str, str] = {}
        self.server = None
        self.otlp = None
        self._ingest_lock = threading.Lock()
        self._process_rows: dict[str, tuple[float, list[dict[str, Any]]]] = {}
        self._stop = threading.Event()
        self._frames_in = Pulse()  # a probe handed frames over: the tracker follows it
        self._joined = Pulse()  # the tracker's pass is done: the flusher follows it
        self._threads: list[threading.Thread] = []
        self._rss = ResidentMemory()
        self._cpu_mark = (time.monotonic(), self._cpu_seconds())
        self._cpu_ratio: float | None = None
        self.analysis_seconds: float | None = None
        self.analysis_cpu_seconds: float | None = None  # the analyzer thread's CPU time of the last analysis
        self.analyses = 0
        self.opened_by_kind: dict[str, int] = {}
        self._sim_probe: SimTimeline | None = None
        self._memory = MemoryKeeper()
        self._heavy = threading.Lock()  # held by an analysis, and by a flush that may seal
        self._seals_deferred = 0

    # -- wiring ------------------------------------------------------------------------------
    def _open_probes(self) -> list[ProbeSlot]:
        cfg = self.config
        if self._given_probes is not None:
            return [ProbeSlot(key, p, interval, self._ingest) for key, p, interval in self._given_probes]
        slots = []
        engine_urls = cfg.get("probes.engine_urls")
        if self.sim is not None:
            # Held from its first step: the analyses must follow it from the start.
            self._sim_probe = SimTimeline(self.sim, speed=self.speed, seed=self.seed,
                                          hold_after_s=cfg.get("analyzers.interval_s") + SIM_LEAD_S)
            sim_probe: Probe = self._sim_probe
            if self.sim_pods:
                from gpudiag.probes.kube import PodLabelled, sim_resolver

                sim_probe = PodLabelled(self._sim_probe, sim_resolver())
            slots.append(ProbeSlot("sim", sim_probe, self._sim_probe.interval_s, self._ingest, timeline=True))
            from gpudiag.probes.engine_scrape import EngineScrapeProbe

            for i, url in enumerate(engine_urls):
                slots.append(ProbeSlot(f"engine{i + 1 if i else ''}", EngineScrapeProbe(url, node=self.node),
                                       cfg.get("probes.engine_interval_s"), self._ingest))
            self.unavailable["ebpf"] = "not used with --sim (no real CUDA processes)"
            return slots
        from gpudiag.probes.node import open_probes, unique_names

        probes = open_probes(None, engine_urls=engine_urls, kubernetes=cfg.get("kubernetes.mode"),
                             pod_resources_socket=cfg.get("kubernetes.pod_resources_socket"),
                             kubeconfig=cfg.get("kubernetes.kubeconfig") or None, node=self.node)
        intervals = {"nvml": cfg.get("probes.nvml_interval_s"), "host": cfg.get("probes.host_interval_s"),
                     "torch": cfg.get("probes.torch_interval_s")}
        for key, p in zip(unique_names(probes), probes):
            interval = intervals.get(p.name, cfg.get("probes.engine_interval_s") if p.name == "engine" else 1.0)
            slots.append(ProbeSlot(key, p, interval, self._ingest))
        mode = cfg.get("probes.ebpf")
        reason = "disabled in the config (probes.ebpf = \"off\")" if mode == "off" else ebpf_unavailable_reason()
        if reason is None:
            slots.append(ProbeSlot("ebpf", EbpfProbe(self.node), cfg.get("probes.ebpf_interval_s"), self._ingest))
        else:
            if mode == "on":
                log.error("probes.ebpf = \"on\" but the eBPF probes cannot run: %s", reason)
            self.unavailable["ebpf"] = reason
        return slots

    def _start_metrics_server(self, cfg: AgentConfig) -> None:
        host, port = parse_listen(cfg.get("exporter.listen"))
        auth = None
        if cfg.get("exporter.basic_auth_user"):
            auth = (cfg.get("exporter.basic_auth_user"), cfg.get("exporter.basic_auth_password_hash"))
        self.server = serve(self.registry, host, port, tls_cert=cfg.get("exporter.tls_cert") or None,
                            tls_key=cfg.get("exporter.tls_key") or None, basic_auth=auth,
                            allow_non_loopback=cfg.get("exporter.allow_non_loopback"))
        log.info("metrics on %s", self.server.url)

    def _start_otlp(self, cfg: AgentConfig) -> None:
        endpoint = cfg.get("otlp.endpoint")
        if endpoint:
            from gpudiag.agent.otlp import OtlpExporter

            self.otlp = OtlpExporter(endpoint, self.latest, node=self.node,
                                     interval_s=cfg.get("otlp.interval_s")).start()
            log.info("OTLP push to %s every %g s", endpoint, cfg.get("otlp.interval_s"))

    def start(self) -> Agent:
        """Open the probes and exporters and start every thread."""
        try:
            if self._serve_metrics:
                self._start_metrics_server(self.config)
            self._start_otlp(self.config)
            self.slots = self._open_probes()
        except BaseException:
            self.stop()
            self.store.discard()  # a store this start created goes with it; one that existed stays
            raise
        for name, reason in self.unavailable.items():
            log.info("probe %s unavailable: %s", name, reason)
        for slot in self.slots:
            slot.start()
        log.info("agent on node %s: probes %s; store %s; analyzers every %g s over %g s", self.node,
                 ", ".join(f"{s.key} ({s.interval_s:g} s)" for s in self.slots) or "none", self.store.path,
                 self.config.get("analyzers.interval_s"), self.config.get("analyzers.window_s"))
        for name, target in (("tracker", self._tracker_loop), ("flusher", self._flush_loop),
                             ("analyzer", self._analysis_loop)):
            th = threading.Thread(target=target, name=f"gpudiag-{name}", daemon=True)
            th.start()
            self._threads.append(th)
        return self

    # -- the data path -------------------------------------------------------------------------
    def _ingest(self, slot: ProbeSlot, frames: list[Frame]) -> None:
        """One probe tick's frames: process rows wait for the tracker's join, the rest go out now."""
        if not frames:
            return
        out: list[Frame] = []
        for fr in frames:
            if fr.kind != "process":
                out.append(fr)
            elif slot.timeline:
                # Frames on their own time base are joined at their own second, with the
                # other probes' newest process rows.
                others = [Frame("process", t, rows) for key, (t, rows) in self._process_rows.items()
                          if key != slot.key]
                out.append(self.tracker.update(fr.t, [fr] + others))
            else:
                self._process_rows[slot.key] = (fr.t, fr.rows)
        self._publish(out)
        self._frames_in.beat()

    def _publish(self, frames: list[Frame]) -> None:
        if not frames:
            return
        newest: dict[str, Frame] = {}
        requests = []
        for fr in frames:
            if fr.kind == "request":
                requests.append(fr)
            elif fr.kind not in newest or fr.t >= newest[fr.kind].t:
                newest[fr.kind] = fr
        # Rows become columns once, here, right after their probe made them: the store encodes
        # these arrays and the window builds its tables from them.
        columns = [FrameColumns.of(fr.kind, [fr]) for fr in frames if fr.rows]
        with self._ingest_lock:
            # LatestFrames joins several frames of one kind: it gets the newest of each.
            self.latest.update(list(newest.values()) + requests)
            self.store.append_columns(columns)
            self.window.add(frames, columns)

    def _tracker_joins(self) -> bool:
        """Whether the tracker thread joins process rows (with --sim the timeline's are joined as they come)."""
        return not (any(s.timeline for s in self.slots)
                    and not any(not s.timeline for s in self.slots if s.key != "ebpf"))

    def _tracker_loop(self) -> None:
        if not self._tracker_joins():
            return
        interval = self.config.get("probes.tracker_interval_s")
        for _ in self._frames_in.every(interval, self._stop):
            stale_before = time.time() - 3 * max(s.interval_s for s in self.slots) if self.slots else 0
            frames = [Frame("process", t, rows) for t, rows in list(self._process_rows.values()) if t >= stale_before]
            if frames:
                try:
                    joined = self.tracker.update(time.time(), frames)
                    self._publish([joined])
                except Exception as exc:  # noqa: BLE001 - the join must not stop; say why it failed
                    log.warning("tracker join failed: %s: %s", type(exc).__name__, exc)
            self._joined.beat()

    @staticmethod
    def _cpu_seconds() -> float:
        # times(2), every thread of the process: a system call, where psutil parses /proc/PID/stat
        # (a tenth of a millisecond every second, a fiftieth of the agent's budget).
        t = os.times()
        return t.user + t.system

    def self_metric_rows(self) -> list[dict[str, Any]]:
        """The agent's own metrics as rows for LatestFrames.set_agent_rows."""
        now, cpu = time.monotonic(), self._cpu_seconds()
        t0, c0 = self._cpu_mark
        if now - t0 >= 0.5:
            self._cpu_ratio = (cpu - c0) / (now - t0)
            self._cpu_mark = (now, cpu)
        rows: list[dict[str, Any]] = []
        for slot in self.slots:
            rows += slot.metric_rows()
        rows += [{"probe": name, M.agent_probe_available: 0} for name in self.unavailable]
        rows += self.store.metric_rows()
        if self.otlp is not None:
            rows += self.otlp.metric_rows()
        if self._cpu_ratio is not None:
            rows.append({M.agent_cpu_utilization_ratio: self._cpu_ratio})
        rows.append({M.agent_resident_memory_bytes: self._rss.bytes()})
        if self.analysis_seconds is not None:
            rows.append({M.agent_analysis_seconds: self.analysis_seconds})
        rows += [{"kind": k, M.agent_findings_opened_total: n} for k, n in sorted(self.opened_by_kind.items())]
        if self._sim_probe is not None:
            rows.append({M.agent_sim_seconds: self._sim_probe.sim.sim_time_s})
        return rows

    def _flush_loop(self) -> None:
        # Behind the tracker's join when it runs (its process frame goes out in the same flush),
        # else behind the probes. A store write stuck on the disk holds only this thread.
        pulse = self._joined if self._tracker_joins() else self._frames_in
        for _ in pulse.every(FLUSH_INTERVAL_S, self._stop):
            self.flush()

    def flush(self) -> None:
        """Write the store and refresh the self-metrics (every second; once more at stop)."""
        seal = self._heavy.acquire(blocking=False)
        if not seal and self._seals_deferred >= MAX_SEALS_DEFERRED:
            seal = self._heavy.acquire(timeout=HEAVY_WAIT_S)
        self._seals_deferred = 0 if seal else self._seals_deferred + 1
        try:
            self.store.flush(seal=seal)
        except Exception as exc:  # noqa: BLE001 - the store logs its own failures; this is a bug guard
            log.error("store flush failed: %s: %s", type(exc).__name__, exc)
        finally:
            if seal:
                self._heavy.release()
        try:
            self.latest.set_agent_rows(self.self_metric_rows())
        except Exception as exc:  # noqa: BLE001
            log.warning("self-metrics failed: %s: %s", type(exc).__name__, exc)

    # -- streaming analysis --------------------------------------------------------------------
    def _analysis_loop(self) -> None:
        last_t: float | None = None
        sim = self._sim_probe
        while not self._stop.is_set():
            interval = self.config.get("analyzers.interval_s")
            if sim is not None and last_t is not None:
                # The engine runs to SIM_LEAD_S past the frame that makes the next analysis due,
                # counted from the last analysis or the first frame seen (this thread may start
                # after the engine reached its first hold), with the interval as now configured.
                sim.hold_after(last_t + interval + SIM_LEAD_S)
            newest = self.window.wait_for(last_t, interval, ANALYSIS_WAKE_S)
            if newest is None or self._stop.is_set():
                continue
            if last_t is None:
                last_t = newest
            if newest - last_t < interval:
                continue
            last_t = newest
            try:
                self.analyze_once()
            except Exception as exc:  # noqa: BLE001 - an analyzer bug: log it, analyze again next time
                log.error("streaming analysis failed: %s: %s", type(exc).__name__, exc)

    def analyze_once(self) -> list[Finding]:
        """Run every analyzer over the in-memory window once; log, store and export what changed."""
        heavy = self._heavy.acquire(timeout=HEAVY_WAIT_S)
        try:
            return self._analyze()
        finally:
            if heavy:
                self._heavy.release()

    def _analyze(self) -> list[Finding]:
        from gpudiag.analyzers.registry import HELD_FOR_A_WINDOW, held_arguments, run_streaming

        started, started_cpu = time.perf_counter(), time.thread_time()
        win = self.window.window(self.node)
        open_now = list(self.findings.open.values())
        findings = run_streaming(win, {rec.key[0] for rec in open_now},
                                 held_arguments((rec.finding for rec in open_now), self.window.window_s)) \
            if win.tables else []
        opened, updated, resolved = self.findings.reconcile(findings, win.end_s, win.start_s, HELD_FOR_A_WINDOW)
        self.analysis_seconds = time.perf_counter() - started
        self.analyses += 1
        for rec in opened:
            f = rec.finding
            self.opened_by_kind[f.kind] = self.opened_by_kind.get(f.kind, 0) + 1
            log.warning("finding opened: %s %s%s: %s", f.kind, f.severity.value,
                        "" if f.gpu is None else f" gpu {f.gpu}", f.summary)
        for rec in updated:
            if rec.escalated_from is not None:
                f = rec.finding
                log.warning("finding escalated: %s %s -> %s%s: %s", f.kind, rec.escalated_from.value,
                            f.severity.value, "" if f.gpu is None else f" gpu {f.gpu}", f.summary)
        for rec in resolved:
            log.info("finding resolved: %s after %.0f s of evidence", rec.id, rec.end_s - rec.start_s)
        for rec, state in [(r, "open") for r in opened] + [(r, "updated") for r in updated] \
                + [(r, "resolved") for r in resolved]:
            doc = rec.document()
            self.store.upsert_finding(doc)
            if self.otlp is not None:
                self.otlp.emit_finding(doc, state)
        self.latest.set_findings(self.findings.active())
        win.release()  # its caches point back at it: free its copies now
        del win
        self._memory.release()
        self.analysis_cpu_seconds = time.thread_time() - started_cpu
        return findings

    # -- lifecycle -------------------------------------------------------------------------------
    def reload(self, new: AgentConfig) -> list[str]:
        """Apply a new (validated) configuration; returns the keys that changed.

        Probe intervals, analyzer interval and window, store retention and size, the
        exporter (listen address, TLS, auth) and OTLP apply at once; ``store.path``
        and the probe set (``probes.engine_urls``, ``probes.ebpf``) need a restart,
        which the log says.
        """
        changed = self.config.diff(new)
        if not changed:
            return []
        old, self.config = self.config, new
        needs_restart = [k for k in changed if k in ("store.path", "probes.engine_urls", "probes.ebpf",
                                                     "agent.node")]
        for slot in self.slots:
            key = {"nvml": "probes.nvml_interval_s", "host": "probes.host_interval_s",
                   "torch": "probes.torch_interval_s", "ebpf": "probes.ebpf_interval_s"}.get(slot.key)
            if slot.key.startswith("engine"):
                key = "probes.engine_interval_s"
            if key is not None:
                slot.interval_s = new.get(key)
        self.window.window_s = new.get("analyzers.window_s")
        self.store.retention_s = float(new.get("store.retention_s"))
        self.store.max_bytes = int(new.get("store.max_bytes"))
        if any(k.startswith("exporter.") for k in changed) and self._serve_metrics:
            if self.server is not None:
                self.server.close()
                self.server = None
            try:
                self._start_metrics_server(new)
            except GpudiagError as exc:
                log.error("new exporter settings failed (%s); serving with the previous ones again", exc)
                self._start_metrics_server(old)
        if any(k.startswith("otlp.") for k in changed):
            if self.otlp is not None:
                self.otlp.shutdown()
                self.otlp = None
            self._start_otlp(new)
        log.info("config reloaded: changed %s", ", ".join(changed))
        if needs_restart:
            log.warning("config keys %s take effect at the next start", ", ".join(needs_restart))
        return changed

    def stop(self, timeout_s: float = 3.0) -> None:
        """Stop probes and threads, flush the store and close everything, within about ``timeout_s``.

        Once: a start that failed has stopped what it had started, and its caller's stop finds
        nothing left to do."""
        if self._stop.is_set():
            return
        deadline = time.monotonic() + timeout_s
        self._stop.set()
        self.window.wake()
        self._frames_in.beat()
        self._joined.beat()
        for slot in self.slots:
            slot.stop(timeout_s=max(0.05, min(0.5, deadline - time.monotonic())))
        for th in self._threads:
            th.join(max(0.05, min(1.0, deadline - time.monotonic())))
        # Findings still open end where the agent's view ends: a stored end of None would say they
        # go on, past the data, for as long as the store is read.
        for doc in self.findings.at_stop(self.window.newest_t):
            self.store.upsert_finding(doc)
        if self.otlp is not None:
            # A collector that is down could hold the final push for its whole timeout.
            done = threading.Thread(target=self.otlp.shutdown, name="gpudiag-otlp-shutdown", daemon=True)
            done.start()
            done.join(max(0.1, deadline - time.monotonic() - 0.5))
        if self.server is not None:
            self.server.close()
        self.store.close()
        self._rss.close()
        log.info("agent stopped; store %s closed", self.store.path)

