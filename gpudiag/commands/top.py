"""``gpudiag top``: a live view of the node's GPUs, the three colours of each process, and the engines.

Per GPU: utilization, memory, temperature, power against its limit, SM clock
against its maximum and the active throttle reasons. Per process: the three
memory layers drawn nested (white = allocated inside grey = reserved inside
black = what the driver charges) and host CPU with the busiest thread. Per
engine: running and waiting requests, KV-cache usage, preemptions, and TTFT
and inter-token latency P50/P99 over the last ``--latency-window`` seconds.
With ``--agent URL`` (its ``/metrics``) or ``--store PATH`` (its store) the
findings open in the agent are named on one line; without either, top runs
the analyzers itself over the last 15 minutes of its samples, in the
background every 10 s, and names what they detect.

The first frame is drawn at once with what is known (the node, the clock)
while the probes open — the simulated engine generates its whole workload
first, a few seconds — and filled in as samples arrive.

``--once --json`` prints one frame as one JSON document. ``--sim [SCENARIO]``
reads the reference engine's simulated GPU instead of the real one. ``q``
quits the live view.
"""

from __future__ import annotations

import json
import math
import os
import re
import select
import socket
import sys
import threading
import time
from collections import deque
from typing import Annotated, Any

import typer
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text
from typer.core import TyperCommand

from gpudiag.catalog import M
from gpudiag.errors import GpudiagError
from gpudiag.findings import json_ready
from gpudiag.frames import Frame
from gpudiag.probes.base import Probe, ProbeError
from gpudiag.render import figure_column, identity_column, terminal_table
from gpudiag.units import fmt_bytes, fmt_ratio, fmt_seconds

DEFAULT_SCENARIO = "kv-eviction-storm"

# The nested bar's glyphs: distinct shapes, so the layers read without colour too.
WHITE_GLYPH, GREY_GLYPH, BLACK_GLYPH, FREE_GLYPH = "█", "▓", "░", "·"
BAR_WIDTH = 30

# Latency is judged over the last minute, not the last frame: a P99 needs on the order of a
# hundred requests to mean anything, which an engine under load finishes within a minute but
# rarely within one second (during a storm none may finish for tens of seconds); one minute is
# the range dashboards give histogram_quantile(rate(...[1m])), so the figures compare with
# theirs; and a storm still shows within a minute of starting.
DEFAULT_LATENCY_WINDOW = "60s"

# The agent (its store, or its /metrics) is read for open findings at most this often: a
# finding opens over tens of seconds, and each read is a query on a file the agent is writing
# or an HTTP request to a process serving Prometheus too.
FINDINGS_REFRESH_S = 5.0

# An agent that has not answered within this is reported as not answering: the view's tick is
# one second, and the agent's own exporter answers a scrape in milliseconds.
AGENT_TIMEOUT_S = 2.0

# Without an agent, top runs the analyzers itself at most this often: the agent's own pace
# (agent/config.py, analyzers.interval_s is 10-15 s), and a finding takes tens of seconds to open.
LOCAL_ANALYSIS_EVERY_S = 10.0

# The span of samples top keeps for that analysis: the agent's default window (agent/config.py,
# analyzers.window_s), so the longest least spans (oom_forecast's and prefix_cache_thrash's
# 600 s) fit, and top judges what the agent would.
LOCAL_WINDOW_S = 900.0


class _TopCommand(TyperCommand):
    """Lets ``--sim`` stand alone (the default scenario) or take a scenario name."""

    def parse_args(self, ctx, args):
        """Insert the default scenario after a bare ``--sim``."""
        out = []
        for i, arg in enumerate(args):
            out.append(arg)
            if arg == "--sim" and (i + 1 == len(args) or args[i + 1].startswith("-")):
                out.append(DEFAULT_SCENARIO)
        return super().parse_args(ctx, out)


# --- collecting ------------------------------------------------------------------------


def open_probes(sim: str | None, *, speed: float = 1.0, seed: int = 0, engine_urls: list[str] = (),
                runtime_dirs: list[str] | None = None) -> list[Probe]:
    """The probes ``top`` reads: the simulated GPU's, or NVML + host + torch reporters + engine endpoints."""
    from gpudiag.probes.engine_scrape import EngineScrapeProbe

    engines = [EngineScrapeProbe(url) for url in engine_urls]
    if sim is not None:
        try:
            from gpudiag.probes.sim import open_sim_probes
        except ImportError:
            raise GpudiagError("the simulated GPU backend is not available") from None
        return [SimNode(p) for p in open_sim_probes(sim, speed=speed, seed=seed)] + engines
    from gpudiag.probes.host import HostProbe
    from gpudiag.probes.nvml import NvmlProbe
    from gpudiag.probes.torch_probe import TorchProbe

    latest: dict[str, list[dict[str, Any]]] = {"gpu": [], "nvml": [], "torch": []}

    def uuid_index() -> dict[str, int]:
        return {r["uuid"]: r["gpu"] for r in latest["gpu"] if r.get("uuid")}

    def host_targets() -> list[dict[str, Any]]:
        """NVML's processes, plus those only an in-process reporter names (no NVML, or PID not mapped)."""
        targets = list(latest["nvml"])
        known = {(t.get("uuid"), t.get("pid")) for t in targets}
        targets += [{k: r.get(k) for k in ("gpu", "uuid", "pid", "process")} for r in latest["torch"]
                    if (r.get("uuid"), r.get("pid")) not in known]
        return targets

    nvml = _Recording(NvmlProbe(), latest, {"gpu": "gpu", "process": "nvml"})
    torch_probe = _Recording(TorchProbe(runtime_dirs, gpu_index_by_uuid=uuid_index), latest, {"process": "torch"})
    return [nvml, torch_probe, HostProbe(targets=host_targets)] + engines


class _Recording(Probe):
    """A probe whose last rows other probes follow (the host probe reads the processes NVML lists)."""

    def __init__(self, inner: Probe, latest: dict[str, list[dict[str, Any]]], slots: dict[str, str]):
        self.inner, self.latest, self.slots = inner, latest, slots
        self.name, self.interval_s = inner.name, inner.interval_s

    def sample(self, now: float) -> list[Frame]:
        """The inner probe's frames, remembered by kind."""
        frames = self.inner.sample(now)
        for kind, slot in self.slots.items():
            self.latest[slot] = [r for fr in frames if fr.kind == kind for r in fr.rows]
        return frames

    def status(self) -> dict[str, Any]:
        """The inner probe's status."""
        return self.inner.status()

    def close(self) -> None:
        """Close the inner probe."""
        self.inner.close()


class SimNode(Probe):
    """The simulated GPU's probe, completed with what a real node's probes would name.

    NVML names the GPU and the host probe names the busiest thread; the
    simulated engine reports the thread's CPU figure but not its name, and no
    GPU name. Both come from the engine itself (its GPU spec, its one engine
    loop), here, so that ``top`` reads the same with and without ``--sim``.
    """

    def __init__(self, inner: Probe):
        self.inner = inner
        self.name, self.interval_s = inner.name, inner.interval_s
        engine = getattr(inner, "engine", None)
        spec = getattr(getattr(engine, "gpu", None), "spec", None)
        self.gpu_name = spec.name if spec is not None else None  # the header says the GPU is simulated

    def sample(self, now: float) -> list[Frame]:
        """The inner probe's frames, with the GPU's name and the engine's busiest thread filled in."""
        from gpudiag.reference_engine.engine import ENGINE_PID, ENGINE_THREAD

        frames = self.inner.sample(now)
        for fr in frames:
            for row in fr.rows:
                if fr.kind == "gpu" and self.gpu_name and not row.get("name"):
                    row["name"] = self.gpu_name
                elif (fr.kind == "process" and row.get("pid") == ENGINE_PID and not row.get("top_threads")
                      and row.get(M.process_thread_cpu_max_ratio) is not None):
                    row["top_threads"] = [{"tid": ENGINE_PID, "name": ENGINE_THREAD,
                                           "cpu_ratio": row[M.process_thread_cpu_max_ratio]}]
        return frames

    def status(self) -> dict[str, Any]:
        """The inner probe's status."""
        return self.inner.status()

    def close(self) -> None:
        """Close the inner probe."""
        self.inner.close()


def parse_duration(text: str) -> float:
    """Seconds in ``60s``, ``2m``, ``1h`` or a bare number of seconds; GpudiagError otherwise."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(s|m|h)?\s*", text or "")
    if not m or float(m.group(1)) <= 0:
        raise GpudiagError(f"a duration is a positive number with s, m or h (60s, 2m), not {text!r}")
    return float(m.group(1)) * {"s": 1, "m": 60, "h": 3600}[m.group(2) or "s"]


def _quantiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p99": None}
    import numpy as np

    p50, p99 = np.percentile(values, [50, 99])
    return {"p50": float(p50), "p99": float(p99)}


class LatencyWindow:
    """TTFT and inter-token latency P50/P99 per engine over the last ``window_s`` seconds.

    Two sources, whichever an engine offers: finished-request rows (the
    simulated engine's ``request`` frames; each carries its own TTFT and
    inter-token latency), or the engine endpoint's cumulative histograms,
    kept at each scrape and subtracted across the window as ``rate()`` does.
    Time is the engine's own clock: simulated seconds with ``--sim``.
    ``finished`` is how many requests the window holds, so an empty window
    reads as "none finished", not as a missing figure.
    """

    def __init__(self, window_s: float):
        self.window_s = window_s
        self.requests: dict[str, deque[tuple[float, float | None, float | None]]] = {}
        self.histograms: dict[tuple[str, str], deque[tuple[float, list, float]]] = {}
        self.first_seen: dict[str, float] = {}

    def add_requests(self, rows: list[dict[str, Any]], now: float) -> None:
        """Remember finished requests, on the engine's clock (their finish time when simulated)."""
        for r in rows:
            engine = str(r.get("engine"))
            t = r.get("finish_s") if r.get("sim_t") is not None and r.get("finish_s") is not None else now
            itl = r.get(M.inter_token_latency_seconds)
            if (r.get("output_tokens") or 0) < 2:
                itl = None  # one token has no gap after the first
            self.requests.setdefault(engine, deque()).append((t, r.get(M.time_to_first_token_seconds), itl))

    def add_histograms(self, cumulative: dict[tuple[str, str], tuple[list, float, float]], now: float) -> None:
        """Remember one scrape's cumulative histograms (``EngineScrapeProbe.cumulative_histograms``)."""
        for key, (buckets, _total, count) in cumulative.items():
            kept = self.histograms.setdefault(key, deque())
            if kept and count < kept[-1][2]:
                kept.clear()  # the engine restarted: its counts began again
            kept.append((now, buckets, count))

    def summary(self, engine_row: dict[str, Any], now: float) -> dict[str, Any]:
        """``{"window_s", "covered_s", "finished", TTFT column: {p50, p99}, ITL column: {p50, p99}}``."""
        engine = str(engine_row.get("engine"))
        clock = engine_row.get("sim_t") if engine_row.get("sim_t") is not None else now
        # A simulated engine starts at 0 with top, which sees all of its requests.
        self.first_seen.setdefault(engine, 0.0 if engine_row.get("sim_t") is not None else clock)
        start = clock - self.window_s
        covered = min(self.window_s, clock - self.first_seen[engine])
        out: dict[str, Any] = {"window_s": self.window_s, "covered_s": covered}
        done = self.requests.get(engine)
        if done is not None:
            while done and done[0][0] < start:
                done.popleft()
            out["finished"] = len(done)
            out["source"] = "requests"
            out[M.time_to_first_token_seconds] = _quantiles([x[1] for x in done if x[1] is not None])
            out[M.inter_token_latency_seconds] = _quantiles([x[2] for x in done if x[2] is not None])
            return out
        for column in (M.time_to_first_token_seconds, M.inter_token_latency_seconds, M.e2e_request_latency_seconds):
            kept = self.histograms.get((column, engine))
            if not kept:
                continue
            while len(kept) > 1 and kept[1][0] <= now - self.window_s:
                kept.popleft()  # the newest snapshot at or before the window's start stays as its base
            if len(kept) < 2:
                continue
            base, last = kept[0], kept[-1]
            out["covered_s"] = min(self.window_s, last[0] - base[0])
            before = dict(base[1])
            window = [(ub, c - before.get(ub, 0.0)) for ub, c in last[1]]
            count = last[2] - base[2]
            if column == M.e2e_request_latency_seconds or "finished" not in out:
                out["finished"] = count
            if column != M.e2e_request_latency_seconds:
                from gpudiag.probes.engine_scrape import histogram_quantile

                out[column] = {"p50": histogram_quantile(0.5, window), "p99": histogram_quantile(0.99, window)}
            out["source"] = "histogram"
        return out


class OpenFindings:
    """The findings an agent holds open, read from its store (read-only) at most every FINDINGS_REFRESH_S."""

    def __init__(self, store_path: str):
        from gpudiag.agent.store import Store

        self.store = Store.open(store_path, readonly=True)  # GpudiagError (one line) when it is not a store
        self.last_read_s = -math.inf
        self.latest: list[dict[str, Any]] = []

    def read(self, now: float) -> list[dict[str, Any]]:
        """``[{"kind", "severity", "gpu", "summary", "start_s"}]`` of the open findings, most severe first."""
        if now - self.last_read_s >= FINDINGS_REFRESH_S:
            self.last_read_s = now
            docs = [d for d in self.store.findings(0.0, math.inf) if d.get("end_s") is None]
            rank = {"critical": 0, "warning": 1, "info": 2}
            self.latest = sorted(({k: d.get(k) for k in ("kind", "severity", "gpu", "summary", "start_s")}
                                  for d in docs), key=lambda d: (rank.get(d["severity"], 3), d["start_s"] or 0))
        return self.latest

    def close(self) -> None:
        """Close the store."""
        self.store.close()


class Refreshing:
    """``fetch()`` run in a background thread at most every ``every_s``; the view reads its last answer.

    The screen's tick never waits on a slow agent or a long analysis: :meth:`poll`
    starts a new run when one is due and none is going, and returns what the last
    finished run gave (``None`` before the first). ``fetch`` never raises: it
    returns what it could not do as data.
    """

    def __init__(self, fetch, every_s: float, name: str):
        self.fetch, self.every_s, self.name = fetch, every_s, name
        self.latest: Any = None
        self._started_s = -math.inf
        self._thread: threading.Thread | None = None

    def _run(self) -> None:
        self.latest = self.fetch()

    def poll(self, now: float) -> Any:
        """Start a run when one is due and none is going; the last finished run's answer."""
        if (self._thread is None or not self._thread.is_alive()) and now - self._started_s >= self.every_s:
            self._started_s = now
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()
        return self.latest

    def join(self, timeout_s: float | None = None) -> None:
        """Wait for the run under way, if any, to finish."""
        if self._thread is not None:
            self._thread.join(timeout_s)

    def now(self) -> Any:
        """Run once in this thread (``--once``: there is no next frame to wait for) and return the answer."""
        self.join()
        self._run()
        return self.latest


def agent_metrics_url(url: str) -> str:
    """The agent's ``/metrics`` URL from what a user types: ``host:9400``, ``http://host:9400``, or the full URL."""
    from urllib.parse import urlsplit

    if "://" not in url:
        url = "http://" + url
    parts = urlsplit(url)
    if not parts.netloc:
        raise GpudiagError(f"--agent {url!r}: expected the agent's address, e.g. http://127.0.0.1:9400")
    return url if parts.path not in ("", "/") else url.rstrip("/") + "/metrics"


def read_agent_findings(url: str, timeout_s: float = AGENT_TIMEOUT_S) -> dict[str, Any]:
    """The findings open in a running agent, from the ``finding_active`` series of its ``/metrics``.

    ``{"url", "reachable", "error", "findings": [{"kind", "severity", "gpu", "node"}]}``, most
    severe first. An agent that does not answer, or answers with something that is not its
    exposition, is ``reachable: False`` with the reason in ``error``; it never raises.
    """
    import urllib.error
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    from gpudiag.catalog import CATALOG

    out: dict[str, Any] = {"url": url, "reachable": False, "error": None, "findings": []}
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            page = response.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        out["error"] = f"HTTP {exc.code} {exc.reason}"
        return out
    except (urllib.error.URLError, OSError, ValueError) as exc:
        out["error"] = str(getattr(exc, "reason", None) or exc)
        return out
    name = CATALOG[M.finding_active].name
    found = []
    try:
        for family in text_string_to_metric_families(page):
            for sample in family.samples:
                if sample.name == name and sample.value:
                    gpu = sample.labels.get("gpu")
                    found.append({"kind": sample.labels.get("kind"), "severity": sample.labels.get("severity"),
                                  "gpu": int(gpu) if gpu and gpu.isdigit() else (gpu or None),
                                  "node": sample.labels.get("node") or None})
    except (ValueError, TypeError, KeyError, IndexError) as exc:  # the parser's answers to a non-Prometheus page
        out["error"] = f"not a metrics page: {exc}"
        return out
    out["reachable"] = True
    out["findings"] = sorted(found, key=lambda f: (_SEVERITY_RANK.get(f["severity"], 3), f["kind"] or ""))
    return out


_SEVERITY_RANK = {"critical": 0, "warning": 1, "info": 2}


class AgentFindings:
    """The findings open in a running agent (``--agent URL``), read in the background at most every
    FINDINGS_REFRESH_S; an agent that stops answering is said to, and the view goes on."""

    def __init__(self, url: str):
        self.url = agent_metrics_url(url)
        self.reader = Refreshing(lambda: read_agent_findings(self.url), FINDINGS_REFRESH_S, "gpudiag-top-agent")

    def read(self, now: float, *, wait: bool = False) -> dict[str, Any]:
        """``read_agent_findings``'s last answer (``reachable: None`` before the first); ``wait``: read now."""
        doc = self.reader.now() if wait else self.reader.poll(now)
        return doc or {"url": self.url, "reachable": None, "error": None, "findings": []}

    def close(self) -> None:
        """Nothing to release: the reads are single HTTP requests."""


def detect_locally(frames: list[Frame], window_s: float = LOCAL_WINDOW_S) -> dict[str, Any]:
    """Run every analyzer (``analyzers.registry.run_all``) over ``frames``, as the agent does over its window.

    ``{"window_s", "first_s", "last_s", "analyzers", "judged", "findings": [{"kind", "severity",
    "gpu", "start_s", "end_s", "open", "summary"}]}``: ``judged`` is how many analyzers had the
    inputs and the span to judge (``registry.coverage``), so "nothing found" says how much was
    looked at. An analyzer failure is an ``error``, not a traceback on the screen.
    """
    from gpudiag.analyzers.registry import ANALYZERS, coverage, run_all
    from gpudiag.frames import Window

    out: dict[str, Any] = {"window_s": window_s, "first_s": None, "last_s": None, "analyzers": len(ANALYZERS),
                           "judged": 0, "findings": [], "error": None}
    if not frames:
        return out
    try:
        window = Window.from_frames(frames, sources=["top"])
        out["first_s"], out["last_s"] = window.start_s, window.end_s
        out["judged"] = len(coverage(window)["ran"])
        found = run_all(window)
    except Exception as exc:  # noqa: BLE001 - an analyzer bug must not take the live view down
        out["error"] = f"{type(exc).__name__}: {exc}"
        return out
    out["findings"] = sorted(({"kind": f.kind, "severity": f.severity.value, "gpu": f.gpu, "start_s": f.start_s,
                               "end_s": f.end_s, "open": f.open, "summary": f.summary} for f in found),
                             key=lambda f: (not f["open"], _SEVERITY_RANK.get(f["severity"], 3), f["start_s"]))
    return out


class LocalFindings:
    """Findings detected by top itself (no agent): the last LOCAL_WINDOW_S of its samples, analyzed
    in a background thread at most every LOCAL_ANALYSIS_EVERY_S."""

    def __init__(self, window_s: float = LOCAL_WINDOW_S, every_s: float = LOCAL_ANALYSIS_EVERY_S):
        self.window_s = window_s
        self.frames: deque[Frame] = deque()
        self._lock = threading.Lock()
        self.analysis = Refreshing(self._analyze, every_s, "gpudiag-top-analyzers")

    def add(self, frames: list[Frame], now: float) -> None:
        """Keep one tick's frames; forget those older than the window."""
        with self._lock:
            self.frames.extend(frames)
            while self.frames and self.frames[0].t < now - self.window_s:
                self.frames.popleft()

    def _analyze(self) -> dict[str, Any]:
        with self._lock:
            frames = list(self.frames)
        return detect_locally(frames, self.window_s)

    def read(self, now: float, *, wait: bool = False) -> dict[str, Any] | None:
        """The last analysis (``None`` before the first finished); ``wait``: analyze now, in this thread."""
        return self.analysis.now() if wait else self.analysis.poll(now)


class TopModel:
    """One tick of every probe, joined by the three-colour tracker into what ``top`` shows."""

    def __init__(self, probes: list[Probe], *, sim: str | None = None, node: str | None = None,
                 latency_window_s: float = 60.0, findings: OpenFindings | AgentFindings | None = None,
                 local: LocalFindings | None = None):
        self.probes = probes
        self.keys = unique_names(probes)
        self.sim = sim
        self.node = node or socket.gethostname()
        # Imported here, not at the top: numpy and the frame tables take a few hundred ms to import,
        # and the first frame is drawn before any of them is needed.
        from gpudiag.agent.tracker import ThreeColourTracker

        self.tracker = ThreeColourTracker(window_s=120.0)
        self.latency = LatencyWindow(latency_window_s)
        self.findings = findings
        self.local = local
        self.errors: dict[str, str] = {}

    def tick(self, now: float | None = None, *, wait: bool = False) -> dict[str, Any]:
        """Sample every probe once and return the view as plain data (JSON-ready).

        ``wait``: read the agent and analyze the window in this thread before returning (one
        frame, ``--once``); the live view never waits for either.
        """
        now = time.time() if now is None else now
        frames: list[Frame] = []
        self.errors = {}
        for key, probe in zip(self.keys, self.probes):
            try:
                got = probe.sample(now)
            except ProbeError as exc:
                self.errors[key] = str(exc)
                continue
            except Exception as exc:  # noqa: BLE001 - one broken probe must not take the view down
                self.errors[key] = f"internal error: {type(exc).__name__}: {exc}"
                continue
            frames.extend(got)
            histograms = getattr(probe, "cumulative_histograms", None)
            if histograms is not None:
                self.latency.add_histograms(histograms(), now)
        by_kind: dict[str, list[dict[str, Any]]] = {}
        for fr in frames:
            if fr.kind != "process":
                by_kind.setdefault(fr.kind, []).extend(fr.rows)
        statuses = {}
        for key, probe in zip(self.keys, self.probes):
            try:
                statuses[key] = probe.status()
            except Exception as exc:  # noqa: BLE001 - as above, for its status
                statuses[key] = {"available": False, "reason": f"{type(exc).__name__}: {exc}"}
        notes = {}
        nvml = statuses.get("nvml")
        if nvml and not nvml.get("available"):
            notes["black"] = f"NVML unavailable: {nvml.get('reason')}"
        processes = self.tracker.update(now, frames, layer_notes=notes).rows
        self.latency.add_requests(by_kind.get("request", []), now)
        engines = [dict(e, latency_window=self.latency.summary(e, now)) for e in by_kind.get("engine", [])]
        node_rows = by_kind.get("node", [])
        view = {"t": now, "node": self.node, "sim": self.sim,
                "host": node_rows[-1] if node_rows else {},
                "gpus": sorted(by_kind.get("gpu", []), key=lambda r: (r.get("gpu") is None, r.get("gpu"))),
                "processes": processes, "engines": engines,
                "probes": statuses, "errors": dict(self.errors)}
        if isinstance(self.findings, AgentFindings):
            agent = self.findings.read(now, wait=wait)
            view["agent"] = {k: agent[k] for k in ("url", "reachable", "error")}
            view["findings"] = agent["findings"]
        elif self.findings is not None:
            view["findings"] = self.findings.read(now)
        if self.local is not None:
            self.local.add(frames, now)
            view["detected_here"] = self.local.read(now, wait=wait)
        return view

    def close(self) -> None:
        """Close every probe (and the agent's store, when one is read)."""
        if self.findings is not None:
            self.findings.close()
        for probe in self.probes:
            try:
                probe.close()
            except Exception as exc:  # noqa: BLE001 - closing on the way out: say it, go on
                sys.stderr.write(f"gpudiag top: closing {probe.name}: {exc}\n")


def starting_view(sim: str | None, waiting_for: str, node: str | None = None) -> dict[str, Any]:
    """The view drawn before the probes have opened: the node, the clock, and what is awaited."""
    return {"t": time.time(), "node": node or socket.gethostname(), "sim": sim, "host": {}, "gpus": [],
            "processes": [], "engines": [], "probes": {}, "errors": {}, "starting": waiting_for}


def unique_names(probes: list[Probe]) -> list[str]:
    """Probe names, numbered where several share one (two engine endpoints: engine, engine2)."""
    seen: dict[str, int] = {}
    out = []
    for p in probes:
        seen[p.name] = seen.get(p.name, 0) + 1
        out.append(p.name if seen[p.name] == 1 else f"{p.name}{seen[p.name]}")
    return out



# --- drawing ---------------------------------------------------------------------------


def three_colour_bar(white: float | None, grey: float | None, black: float | None, scale: float,
                     width: int = BAR_WIDTH) -> Text:
    """The layers drawn nested: white inside grey inside black, on a scale of ``scale`` bytes.

    A layer that is missing is simply not drawn (the outer ones still are);
    an inner layer larger than its outer one (the sources sample at different
    instants) is clipped to it.
    """
    text = Text()
    if not scale or scale <= 0:
        return text.append(FREE_GLYPH * width, style="dim")

    def cells(v: float | None) -> int:
        return 0 if v is None else max(0, min(width, round(v / scale * width)))

    b = cells(black)
    g = cells(grey) if black is None else min(cells(grey), b)
    w = cells(white) if grey is None and black is None else min(cells(white), g if grey is not None else b)
    g = max(g, w)
    b = max(b, g)
    text.append(WHITE_GLYPH * w, style="bold white")
    text.append(GREY_GLYPH * (g - w), style="grey62")
    text.append(BLACK_GLYPH * (b - g), style="grey35")
    text.append(FREE_GLYPH * (width - b), style="dim")
    return text


def ratio_bar(ratio: float | None, width: int = 10) -> Text:
    """A plain bar for a 0..1 ratio, followed by its percentage."""
    if ratio is None:
        return Text("n/a", style="dim")
    filled = max(0, min(width, round(ratio * width)))
    style = "red" if ratio >= 0.9 else "yellow" if ratio >= 0.7 else "green"
    return Text("█" * filled, style=style) + Text("·" * (width - filled), style="dim") + Text(
        f" {ratio * 100:4.0f}%")


def _fmt(value: Any, fmt: str, scale: float = 1.0) -> str:
    return "n/a" if value is None else format(value * scale, fmt)


def _throttles(row: dict[str, Any]) -> str:
    reasons = row.get(M.gpu_clock_throttle_active)
    if not isinstance(reasons, dict):
        return "n/a"
    active = [name for name, on in reasons.items() if on]
    return ", ".join(active) if active else "none"


def _gpu_table(view: dict[str, Any], width: int) -> Table:
    """Per GPU; under 120 columns the bars give way to figures and clocks/throttling are left out."""
    table = terminal_table("GPUs")
    names = [_gpu_name(g) for g in view["gpus"]]
    identity_column(table, "GPU", [g.get("gpu") for g in view["gpus"]])
    identity_column(table, "name", names)
    wide = width >= 120
    for col in ("util", "memory", "temp", "power") + (("SM clock", "throttle") if wide else ()):
        figure_column(table, col)
    for g, name in zip(view["gpus"], names):
        if g.get(M.gpu_lost):
            cells = [str(g.get("gpu")), name, Text("LOST", style="bold red"),
                     Text(g.get("lost_reason") or "", style="red")]
            table.add_row(*cells, *[""] * (len(table.columns) - len(cells)))
            continue
        used, total = g.get(M.gpu_memory_used_bytes), g.get(M.gpu_memory_total_bytes)
        if wide:
            util = ratio_bar(g.get(M.gpu_utilization_ratio))
            mem = ratio_bar(used / total if used is not None and total else None)
            mem.append(f" {fmt_bytes(used)}/{fmt_bytes(total)}")
        else:
            util = Text(fmt_ratio(g.get(M.gpu_utilization_ratio)).replace(" ", ""))
            mem = Text(_bytes_compact(used, total))
        temp = _fmt(g.get(M.gpu_temperature_celsius), ".0f") + " °C"
        if g.get(M.gpu_memory_temperature_celsius) is not None:
            temp += f" (HBM {g[M.gpu_memory_temperature_celsius]:.0f})"
        power = f"{_fmt(g.get(M.gpu_power_watts), '.0f')}/{_fmt(g.get(M.gpu_power_limit_watts), '.0f')} W"
        clock = (f"{_fmt(g.get(M.gpu_sm_clock_hertz), '.0f', 1e-6)}/"
                 f"{_fmt(g.get(M.gpu_sm_clock_max_hertz), '.0f', 1e-6)} MHz")
        table.add_row(str(g.get("gpu")), name, util, mem, temp, power, *((clock, _throttles(g)) if wide else ()))
    return table


def _gpu_name(g: dict[str, Any]) -> str:
    name = g.get("name") or "unnamed"  # NVML could not name it (the row says why elsewhere)
    return name + " (unreliable: MIG/vGPU)" if g.get("metrics_unreliable") else name


def _process_table(view: dict[str, Any], width: int) -> Table:
    wide = width >= 150  # the long bar and the spelled-out layers
    table = terminal_table(f"Processes   {WHITE_GLYPH} allocated (white)  {GREY_GLYPH} reserved (grey)  "
                           f"{BLACK_GLYPH} driver (black)")
    identity_column(table, "GPU", [p.get("gpu") for p in view["processes"]])
    identity_column(table, "PID", [p.get("pid") for p in view["processes"]])
    identity_column(table, "process", [p.get("process") or "?" for p in view["processes"]])
    table.add_column("memory", no_wrap=True)
    figure_column(table, "white / grey / black" if wide else "white/grey/black")
    figure_column(table, "trend/s")
    figure_column(table, "CPU")
    figure_column(table, "top thread")
    # One scale for every bar: the largest layer on screen, so processes compare at a glance
    # (the GPU table shows each process's share of the device).
    peak = max([v for p in view["processes"] for v in (p.get(M.process_gpu_memory_bytes),
                                                        p.get(M.process_torch_reserved_bytes),
                                                        p.get(M.process_torch_allocated_bytes)) if v] or [0])
    for p in view["processes"]:
        white, grey, black = (p.get(M.process_torch_allocated_bytes), p.get(M.process_torch_reserved_bytes),
                              p.get(M.process_gpu_memory_bytes))
        trend = p.get(M.process_gpu_memory_growth_bytes_per_second)
        if trend is None:
            trend = p.get(M.process_torch_reserved_growth_bytes_per_second)
        cpu = p.get(M.process_cpu_utilization_ratio)
        threads = p.get("top_threads") or []
        top = f"{threads[0]['name']} {threads[0]['cpu_ratio'] * 100:.0f}%" if threads else (
            f"? {p[M.process_thread_cpu_max_ratio] * 100:.0f}%" if p.get(M.process_thread_cpu_max_ratio) is not None
            else "n/a")
        table.add_row(str(p.get("gpu")), str(p.get("pid")), p.get("process") or "?",
                      three_colour_bar(white, grey, black, peak, BAR_WIDTH if wide else 6),
                      f"{fmt_bytes(white)} / {fmt_bytes(grey)} / {fmt_bytes(black)}" if wide
                      else _bytes_compact(white, grey, black),
                      "n/a" if trend is None else fmt_bytes(trend),
                      "n/a" if cpu is None else f"{cpu * 100:.0f}%", top)
    return table


def _bytes_compact(*layers: float | None) -> str:
    """``30.2/31.7/32.2 GiB``: the three layers in the unit of the largest, for narrow terminals."""
    known = [v for v in layers if v is not None]
    if not known:
        return "n/a"
    unit = fmt_bytes(max(known)).split(" ")[1]
    scale = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}.get(unit, 1)
    return "/".join("n/a" if v is None else f"{v / scale:.1f}" for v in layers) + f" {unit}"


def _latency_cell(lat: dict[str, Any], column: str) -> str:
    q = lat.get(column) or {}
    if q.get("p99") is None:
        return "-" if lat.get("finished") == 0 else "n/a"
    return f"{fmt_seconds(q.get('p50'))}/{fmt_seconds(q['p99'])}"


def _window_words(lat: dict[str, Any]) -> str:
    """"the last 60 s", or "the 12 s seen so far" while the window is still filling."""
    window, covered = lat.get("window_s") or 0, lat.get("covered_s")
    if covered is not None and covered < window - 0.5:
        return f"the {covered:.0f} s seen so far"
    return f"the last {window:.0f} s"


def _engine_table(view: dict[str, Any], width: int) -> tuple[Table, Text]:
    table = terminal_table("Engines")
    identity_column(table, "engine", [e.get("engine") for e in view["engines"]])
    for col in ("run", "wait", "KV usage", "preempt", "TTFT p50/p99", "ITL p50/p99"):
        figure_column(table, col)
    notes = Text()
    for e in view["engines"]:
        lat = e.get("latency_window") or {}
        running = e.get(M.num_requests_running)
        table.add_row(str(e.get("engine")), _fmt(running, ".0f"), _fmt(e.get(M.num_requests_waiting), ".0f"),
                      ratio_bar(e.get(M.kv_cache_usage_perc)) if width >= 120
                      else Text(fmt_ratio(e.get(M.kv_cache_usage_perc)).replace(" ", "")),
                      _fmt(e.get(M.num_preemptions_total), ".0f"),
                      _latency_cell(lat, M.time_to_first_token_seconds),
                      _latency_cell(lat, M.inter_token_latency_seconds))
        if lat.get("finished") == 0:
            notes.append(f"{e.get('engine')}: no request finished in {_window_words(lat)}"
                         f" ({_fmt(running, '.0f')} running)\n", style="yellow")
        elif lat.get("finished"):
            notes.append(f"{e.get('engine')}: latency over {lat['finished']:.0f} requests finished in "
                         f"{_window_words(lat)}\n", style="dim")
    return table, notes


def _finding_words(f: dict[str, Any]) -> str:
    gpu = "" if f.get("gpu") is None else f" gpu {f['gpu']}"
    return f"{f['kind']} {f.get('severity') or '?'}{gpu}"


def _finding_style(f: dict[str, Any]) -> str:
    return "bold red" if f.get("severity") == "critical" else "yellow" if f.get("severity") == "warning" else "cyan"


def findings_line(findings: list[dict[str, Any]], agent: dict[str, Any] | None = None) -> Text:
    """"agent: 2 open: kv_eviction_storm critical gpu 0, ...", or what stops the agent being read."""
    if agent is not None and agent.get("reachable") is None:
        return Text(f"agent: reading {agent['url']}", style="dim")
    if agent is not None and not agent.get("reachable"):
        return Text(f"agent: {agent['url']} not answering: {agent.get('error')}", style="red")
    if not findings:
        return Text("agent: no open finding", style="green")
    line = Text(f"agent: {len(findings)} open: ", style="bold")
    for i, f in enumerate(findings):
        if i:
            line.append(", ")
        line.append(_finding_words(f), style=_finding_style(f))
    return line


def _clock(t: float | None) -> str:
    return "?" if t is None else time.strftime("%H:%M:%S", time.localtime(t))


def detected_line(doc: dict[str, Any] | None) -> Text:
    """"detected here: kv_eviction_storm warning gpu 0 since 12:03:04", or what was looked at when nothing was.

    ``doc`` is :func:`detect_locally`'s answer (``None`` while the first analysis runs).
    """
    if doc is None:
        return Text("detected here: analyzing the samples seen so far", style="dim")
    if doc.get("error"):
        return Text(f"detected here: the analysis failed: {doc['error']}", style="red")
    if not doc["findings"]:
        held = 0.0 if doc.get("first_s") is None else doc["last_s"] - doc["first_s"]
        seen = f"{held:.0f} s" if held < 60 else f"{held / 60:.0f} min"
        span = f"the last {doc['window_s'] / 60:.0f} min" if held >= doc["window_s"] - 1 else f"the {seen} seen so far"
        return Text(f"detected here: nothing in {span} ({doc['judged']} of {doc['analyzers']} analyzers "
                    "could judge)", style="green")
    line = Text("detected here: ", style="bold")
    for i, f in enumerate(doc["findings"]):
        if i:
            line.append(", ")
        when = f"since {_clock(f['start_s'])}" if f.get("open") else f"{_clock(f['start_s'])}-{_clock(f['end_s'])}"
        line.append(f"{_finding_words(f)} {when}", style=_finding_style(f) if f.get("open") else "dim")
    return line


def render(view: dict[str, Any], width: int = 200, *, interactive: bool = True) -> Group:
    """The whole screen for one view, for a terminal ``width`` columns wide.

    ``interactive``: the live view, which says how to quit; a single frame
    (``--once``) does not.
    """
    host = view.get("host") or {}
    head = Text(f"gpudiag top  {view['node']}  {time.strftime('%H:%M:%S', time.localtime(view['t']))}",
                style="bold")
    if view.get("sim"):
        head.append(f"  [simulated GPU: {view['sim']}]", style="magenta")
    figures = [("CPU", host.get(M.node_cpu_utilization_ratio), fmt_ratio),
               ("load", host.get(M.node_load1), lambda v: f"{v:.2f}"),
               ("mem", host.get(M.node_memory_used_bytes),
                lambda v: f"{fmt_bytes(v)}/{fmt_bytes(host.get(M.node_memory_total_bytes))}"),
               ("swap", host.get(M.node_swap_used_bytes), fmt_bytes)]
    known = [f"{label} {fmt(v)}" for label, v, fmt in figures if v is not None]  # the sim has CPU only
    if known:
        head.append("   " + "  ".join(known))
    parts: list[Any] = [head]
    if view.get("starting"):
        parts.append(Text(f"starting: {view['starting']}", style="cyan"))
    if "findings" in view:
        parts.append(findings_line(view["findings"], view.get("agent")))
    if "detected_here" in view:
        parts.append(detected_line(view["detected_here"]))
    waiting = "waiting for the first sample" if view.get("starting") or not view.get("probes") else None
    parts.append(_gpu_table(view, width) if view["gpus"] else Text(f"GPUs: {waiting or 'none seen'}",
                                                                 style="dim" if waiting else "yellow"))
    parts.append(_process_table(view, width) if view["processes"]
                 else Text(f"Processes: {waiting or 'no GPU process seen'}", style="dim"))
    if view["engines"]:
        table, latency_notes = _engine_table(view, width)
        parts += [table, latency_notes]
    notes = Text()
    for name, error in view.get("errors", {}).items():
        notes.append(f"{name}: {error}\n", style="red")
    for name, st in view["probes"].items():
        if not st.get("available") and st.get("reason") and name not in view.get("errors", {}):
            notes.append(f"{name}: {st['reason']}\n", style="yellow")
    parts.append(notes)
    if interactive:
        parts.append(Text("q quits", style="dim"))
    return Group(*parts)


# --- the command -----------------------------------------------------------------------


class _Opening:
    """Opens the probes in a thread, so the first frame is drawn while they start (the simulator
    generates its whole workload first: seconds)."""

    def __init__(self, open_model):
        self.model: TopModel | None = None
        self.error: BaseException | None = None
        self._open = open_model
        self.done = threading.Event()
        threading.Thread(target=self._run, name="gpudiag-top-open", daemon=True).start()

    def _run(self) -> None:
        try:
            self.model = self._open()
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread, which raises it
            self.error = exc
        finally:
            self.done.set()


def _run_live(opening: _Opening, first: dict[str, Any], interval_s: float, console: Console) -> TopModel | None:
    """Draw ``first`` at once, then a frame per interval once the probes are open; returns the model to close."""
    fd = sys.stdin.fileno() if sys.stdin and sys.stdin.isatty() else None
    saved = None
    if fd is not None:
        import termios
        import tty

        saved = termios.tcgetattr(fd)
        tty.setcbreak(fd)
    try:
        with Live(render(first, console.width), console=console, screen=True, auto_refresh=False) as live:
            live.refresh()
            next_tick = time.monotonic()
            while True:
                model = opening.model
                if opening.error is not None:
                    raise opening.error
                # While the probes open: wake often to draw the first sample as soon as they are up.
                wait = next_tick - time.monotonic() if model is not None else 0.1
                timeout = max(0.0, wait)
                if fd is not None:
                    ready, _, _ = select.select([fd], [], [], timeout)
                    if ready:
                        key = os.read(fd, 32)
                        if b"q" in key.lower():
                            return opening.model
                        continue
                else:
                    time.sleep(timeout)
                if model is None:
                    if not opening.done.is_set():
                        first["t"] = time.time()
                        live.update(render(first, console.width), refresh=True)
                    continue
                next_tick = max(next_tick + interval_s, time.monotonic())
                live.update(render(model.tick(), console.width), refresh=True)
    except KeyboardInterrupt:
        return opening.model
    finally:
        if saved is not None:
            import termios

            termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def register(app: typer.Typer) -> None:
    """Add the ``top`` command."""

    @app.command("top", cls=_TopCommand)
    def top(
        sim: Annotated[str | None, typer.Option(
            "--sim", metavar="[SCENARIO]",
            help=f"Read the simulated GPU running SCENARIO (default {DEFAULT_SCENARIO}).")] = None,
        once: Annotated[bool, typer.Option("--once", help="Print one frame and exit.")] = False,
        json_out: Annotated[bool, typer.Option("--json", help="With --once: one JSON document on stdout.")] = False,
        interval: Annotated[float, typer.Option("--interval", min=0.1, help="Seconds between frames.")] = 1.0,
        latency_window: Annotated[str, typer.Option(
            "--latency-window", metavar="DURATION",
            help="TTFT and inter-token latency P50/P99 over this last span (60s, 2m): a minute holds enough "
                 "finished requests for a P99 and matches dashboards' [1m] ranges.")] = DEFAULT_LATENCY_WINDOW,
        engine: Annotated[list[str] | None, typer.Option(
            "--engine", metavar="URL", help="A serving engine's /metrics URL (repeatable).")] = None,
        runtime_dir: Annotated[list[str] | None, typer.Option(
            "--runtime-dir", metavar="DIR", help="Where in-process reporters write (repeatable).")] = None,
        store: Annotated[str | None, typer.Option(
            "--store", metavar="PATH", help="An agent's store: name the findings open in it.")] = None,
        agent: Annotated[str | None, typer.Option(
            "--agent", metavar="URL", help="A running agent (http://HOST:9400): name the findings open in it. "
                                          "Without --agent or --store, top runs the analyzers itself.")] = None,
        speed: Annotated[float, typer.Option(
            "--speed", min=0.01, help="With --sim: simulated seconds per second.")] = 1.0,
        seed: Annotated[int, typer.Option("--seed", help="With --sim: the workload's random seed.")] = 0,
    ) -> None:
        """A live view: GPUs, each process's three memory colours and host CPU, engine queue, KV usage, latency."""
        if json_out and not once:
            raise GpudiagError("--json prints one frame: use it with --once")
        window_s = parse_duration(latency_window)
        if agent and store:
            raise GpudiagError("--agent and --store both name an agent's findings: give one")
        findings = AgentFindings(agent) if agent else OpenFindings(store) if store else None

        def open_model() -> TopModel:
            probes = open_probes(sim, speed=speed, seed=seed, engine_urls=engine or [],
                                 runtime_dirs=runtime_dir or None)
            return TopModel(probes, sim=sim, latency_window_s=window_s, findings=findings,
                            local=None if findings is not None else LocalFindings())

        if once:
            model = open_model()
            try:
                model.tick()  # CPU figures and trends are differences: take a baseline first
                time.sleep(min(interval, 1.0))
                view = model.tick(wait=True)
                if json_out:
                    sys.stdout.write(json.dumps(json_ready(view), indent=1) + "\n")
                else:
                    console = Console()
                    console.print(render(view, console.width, interactive=False))
            finally:
                model.close()
            return
        waiting_for = (f"the simulated GPU ({sim}): generating its workload" if sim is not None
                       else "opening NVML, the host and the engines")
        opening = _Opening(open_model)
        model = None
        try:
            model = _run_live(opening, starting_view(sim, waiting_for), interval, Console())
        finally:
            if model is None and findings is not None:
                findings.close()
            if model is None:
                opening.done.wait(timeout=0)  # still opening: the daemon thread ends with the process
            else:
                model.close()
