"""cpu_starved_gpu (from frames): the GPU waits for its host while work is waiting.

The same diagnosis as the Kineto trace analysis (analyzers/kineto.py, same
kind and fixes), from always-on 1 s samples instead of a trace. Per GPU and
each process on it, over the trailing RATE_WINDOW_S:

- low utilization: mean NVML utilization at most LOW_UTILIZATION_RATIO, i.e.
  idle at least 1 - LOW_UTILIZATION_RATIO (Kineto's STARVED_MIN_IDLE_RATIO
  is the floor below which host wait is not worth chasing; here the bar is
  higher because NVML's utilization cannot split idle into host wait and
  kernel wait);
- a host-bound process: its busiest thread at least BUSY_THREAD_RATIO of a
  core (process_thread_cpu_max_ratio: the thread that tokenizes, pads and
  launches), or its threads runnable but not running at least
  RUNQUEUE_WAIT_RATIO of the time (eBPF sched_switch: short of cores), or
  off CPU at least OFFCPU_RATIO of the time (blocked: I/O, locks) with the
  device queue empty;
- real traffic with an empty device queue: with engine rows, requests keep
  arriving (engine_requests_arrived_total, else prompt tokens, rising) while
  the engine's own queue (num_requests_waiting) averages at most
  EMPTY_QUEUE_REQUESTS — requests are held up before the GPU's queue, not
  in it (a full queue with an idle GPU is a scheduling or memory problem,
  not starvation). Without engine rows the load is not observed and the
  details say so.

A finding is an episode of such seconds lasting at least MIN_DURATION_S.
"""

from __future__ import annotations

import numpy as np

from gpudiag.catalog import M
from gpudiag.findings import Evidence, Finding, Severity, alert_name
from gpudiag.frames import Window
from gpudiag.units import fmt_ratio

from .common import at_or_before, episodes, label_int, per_entity, subset, trailing_start, windowed_rate
from .kineto import CPU_STARVED_FIXES, CPU_STARVED_KIND, STARVED_MIN_IDLE_RATIO

KIND = CPU_STARVED_KIND
FIX_NAMES = tuple(CPU_STARVED_FIXES)

RATE_WINDOW_S = 60.0
# Below half busy the GPU waits more than it works; the field report's GPU sat at 10 %.
LOW_UTILIZATION_RATIO = 0.5
assert LOW_UTILIZATION_RATIO <= 1.0 - STARVED_MIN_IDLE_RATIO  # never looser than the trace analysis
# Python's launching thread at 90 % of a core is saturated: it cannot issue work faster.
BUSY_THREAD_RATIO = 0.9
# A quarter of a core's worth of time spent runnable but not running: the host is short of CPUs.
RUNQUEUE_WAIT_RATIO = 0.25
# Off CPU for most of every second while the device queue is empty: the threads block instead of feeding.
OFFCPU_RATIO = 0.9
# Less than one request queued on average: the scheduler finds nothing to add to the batch.
EMPTY_QUEUE_REQUESTS = 0.5
# A ten-percent GPU with real traffic loses most of its throughput (the field report: 4x).
CRITICAL_UTILIZATION_RATIO = 0.15
MIN_DURATION_S = 60.0
MERGE_GAP_S = 120.0


def analyze(window: Window) -> list[Finding]:
    """Episodes of a GPU starved by the host, per GPU and process."""
    gpu, proc = window.rows("gpu"), window.rows("process")
    if gpu.empty or proc.empty or not window.has("gpu", M.gpu_utilization_ratio):
        return []
    eng, api = window.rows("engine"), window.rows("cuda_api")
    findings = []
    for gkey, g in per_entity(gpu, ["node", "gpu"]):
        t = g["t"].to_numpy(float)
        grid = _Grid(t)
        util = _trailing_mean(t, g[M.gpu_utilization_ratio].to_numpy(float), grid.start)
        low = util <= LOW_UTILIZATION_RATIO
        if not low.any():
            continue
        e = subset(eng, gkey)
        work = _work_waiting(e, grid, low)
        # A process' seconds are some of these: an episode of them lies within one of these (its
        # ends are such seconds, and no gap between them is wider), which is at least as long.
        if work is None or not episodes(t, low & work[0] & work[1], MERGE_GAP_S, MIN_DURATION_S):
            continue  # no episode can qualify, whatever the host does: skip the per-process work
        traffic, queue_empty, waiting = work
        load = _load(e, grid, waiting)
        for pkey, p in per_entity(subset(proc, gkey), ["pid"]):
            busy = _on_grid(p, M.process_thread_cpu_max_ratio, grid)
            api_p = subset(api, {"node": gkey.get("node"), "pid": pkey.get("pid")}, ("node", "pid"))
            runq = _rate_on_grid(api_p, M.host_runqueue_wait_seconds_total, t)
            offcpu = _rate_on_grid(api_p, M.host_offcpu_seconds_total, t)
            # x >= a positive bar is nan_to_num(x) >= it: NaN is below, +-inf on the same side either way.
            host = (busy >= BUSY_THREAD_RATIO) | (runq >= RUNQUEUE_WAIT_RATIO) \
                | ((offcpu >= OFFCPU_RATIO) & queue_empty)
            mask = low & host & traffic & queue_empty
            for start, end in episodes(t, mask, MERGE_GAP_S, MIN_DURATION_S):
                findings.append(_finding(gkey, pkey, p, t, start, end, util, busy, runq, offcpu, load))
    return findings


def may_find(window: Window) -> bool:
    """False only when :func:`analyze` is sure to find nothing in ``window``: no GPU sample is low.

    A trailing mean of utilization at most LOW_UTILIZATION_RATIO needs a sample at most
    that (unread samples count as busy, as in analyze), give or take the rounding of the
    running sums the mean is made from, which the bound allows for. A busy node's GPUs
    never get there; the agent's streaming analysis skips the analyzer then.
    """
    gpu = window.rows("gpu")
    if gpu.empty or window.rows("process").empty or not window.has("gpu", M.gpu_utilization_ratio):
        return False
    x = np.nan_to_num(gpu[M.gpu_utilization_ratio].to_numpy(float), nan=1.0)
    rounding = 4 * x.size * np.finfo(float).eps * float(np.abs(x).sum())
    return bool(x.min() <= LOW_UTILIZATION_RATIO + rounding)


def _finding(gkey, pkey, p, t, start, end, util, busy, runq, offcpu, load) -> Finding:
    sel = (t >= start) & (t <= end)
    u = float(np.nanmean(util[sel]))
    b = _mean(busy[sel])
    pid = label_int(pkey.get("pid"))
    thread = _top_thread(p, start, end)
    host = []
    if b is not None and b >= BUSY_THREAD_RATIO:
        host.append(f"thread {thread or '?'} at {fmt_ratio(b)} of a core")
    rq, off = _mean(runq[sel]), _mean(offcpu[sel])
    if rq is not None and rq >= RUNQUEUE_WAIT_RATIO:
        host.append(f"threads runnable but waiting {fmt_ratio(rq)} of the time")
    if off is not None and off >= OFFCPU_RATIO:
        host.append(f"threads off CPU {fmt_ratio(off)} of the time")
    evidence = [
        Evidence(M.gpu_utilization_ratio, u, None, LOW_UTILIZATION_RATIO, "ratio"),
        Evidence(M.process_thread_cpu_max_ratio, b, None, BUSY_THREAD_RATIO, "ratio"),
        Evidence("host_runqueue_wait_ratio", rq, None, RUNQUEUE_WAIT_RATIO, "ratio"),
        Evidence("host_offcpu_ratio", off, None, OFFCPU_RATIO, "ratio"),
    ]
    if load.get("observed"):
        evidence.append(Evidence(M.num_requests_waiting, _mean(load["waiting"][sel]), None, EMPTY_QUEUE_REQUESTS,
                                 ""))
        if load["batch_column"]:
            evidence.append(Evidence(load["batch_column"], _mean(load["batch"][sel]), load["batch_max"], None, ""))
    return Finding(
        kind=KIND, severity=Severity.CRITICAL if u <= CRITICAL_UTILIZATION_RATIO else Severity.WARNING,
        start_s=float(start), end_s=float(end), node=gkey.get("node"), gpu=label_int(gkey.get("gpu")), pid=pid,
        summary=(f"GPU {label_int(gkey.get('gpu'))} {fmt_ratio(u)} busy while pid {pid} is host-bound ("
                 + "; ".join(host) + ") and work is waiting: the GPU is not being fed"),
        evidence=evidence, runbook=alert_name(KIND), fixes=list(FIX_NAMES),
        details={"top_thread": thread, "load": {k: v for k, v in load.items() if not isinstance(v, np.ndarray)}},
    )


class _Grid:
    """A GPU's sample times and, made once, the start of each one's trailing window: series sampled at
    the same times (an engine scraped at every tick) share it."""

    __slots__ = ("t", "_start")

    def __init__(self, t: np.ndarray):
        self.t, self._start = t, None

    def start(self, tt: np.ndarray) -> np.ndarray:
        """``trailing_start(tt, RATE_WINDOW_S)``."""
        if tt is not self.t and not (tt.shape == self.t.shape and np.array_equal(tt, self.t)):
            return trailing_start(tt, RATE_WINDOW_S)
        if self._start is None:
            self._start = trailing_start(self.t, RATE_WINDOW_S)
        return self._start


def _trailing_mean(t, x, start_of=None):
    if not np.isfinite(x).all():
        x = np.nan_to_num(x, nan=1.0)  # an unread sample is never taken for an idle GPU
    c = np.empty(len(x) + 1)
    c[0] = 0.0
    np.cumsum(x, out=c[1:])
    start = trailing_start(t, RATE_WINDOW_S) if start_of is None else start_of(t)
    return (c[1:] - c[start]) / (np.arange(1, len(x) + 1) - start)


def _on_grid(df, column, grid: _Grid) -> np.ndarray:
    """``column`` of ``df`` at the grid's times (trailing mean, nearest earlier sample); NaN where absent."""
    t = grid.t
    if df.empty or column not in df or df[column].isna().all():
        return np.full(len(t), np.nan)
    d = df[df[column].notna()].sort_values("t")
    tt, v = d["t"].to_numpy(float), d[column].to_numpy(float)
    mean = _trailing_mean(tt, v, grid.start)
    i = at_or_before(tt, t)
    out = np.where(i >= 0, mean[np.maximum(i, 0)], np.nan)
    return out


def _rate_on_grid(df, column, t) -> np.ndarray:
    if df.empty or column not in df or df[column].isna().all():
        return np.full(len(t), np.nan)
    d = df[df[column].notna()].sort_values("t")
    tt = d["t"].to_numpy(float)
    rate = windowed_rate(tt, d[column].to_numpy(float), RATE_WINDOW_S)
    i = at_or_before(tt, t)
    return np.where(i >= 0, rate[np.maximum(i, 0)], np.nan)


def _work_waiting(e, grid: _Grid, low: np.ndarray):
    """(traffic per second, device queue empty per second, queue length or None when not observed); all
    True when not observed. None when no ``low`` second has traffic: the queue is not read then."""
    t = grid.t
    ones = np.ones(len(t), dtype=bool)
    if e.empty or M.num_requests_waiting not in e or e[M.num_requests_waiting].isna().all():
        return ones, ones, None
    arrivals = _rate_on_grid(e, M.engine_requests_arrived_total, t)
    if np.isnan(arrivals).all():
        arrivals = _rate_on_grid(e, M.prompt_tokens_total, t)
    traffic = arrivals > 0  # nan_to_num(arrivals) > 0: NaN reads as no traffic
    if not (low & traffic).any():
        return None
    waiting = _on_grid(e, M.num_requests_waiting, grid)
    queue_empty = ~(waiting > EMPTY_QUEUE_REQUESTS)  # nan_to_num(waiting) <= it: NaN reads as an empty queue
    return traffic, queue_empty, waiting


def _load(e, grid: _Grid, waiting) -> dict:
    """The load facts of a finding: whether it was observed, the queue and the batch size per second."""
    if waiting is None:
        return {"observed": False, "note": "engine load not observed: traffic assumed"}
    batch_col = next((c for c in (M.engine_batch_size, M.num_requests_running) if c in e and e[c].notna().any()),
                     None)
    batch = _on_grid(e, batch_col, grid) if batch_col else np.full(len(grid.t), np.nan)
    batch_max = float(np.nanmax(batch)) if np.isfinite(batch).any() else None
    return {"observed": True, "batch_column": batch_col, "batch": batch, "waiting": waiting, "batch_max": batch_max}


def _top_thread(p, start, end):
    if "top_threads" not in p:
        return None
    rows = p[(p["t"] >= start) & (p["t"] <= end)]["top_threads"].dropna()
    for threads in rows.iloc[::-1]:
        if isinstance(threads, list) and threads:
            return threads[0].get("name")
    return None


def _mean(x):
    x = np.asarray(x, dtype=float)
    return float(np.nanmean(x)) if np.isfinite(x).any() else None
