"""GPU time in a PyTorch profiler (Kineto) trace, defined as Holistic Trace Analysis defines it.

A Kineto trace records, for one process, the host-side CUDA runtime calls
(``cudaLaunchKernel``, ``cudaMemcpyAsync``, ...) and the GPU activities they
caused (kernels, memcpys, memsets), linked by a ``correlation`` id. From those
this module derives, per CUDA stream and over all streams together:

* the temporal breakdown: idle / compute / non-compute time of the span from
  the first GPU activity to the end of the last;
* the idle breakdown: host wait / kernel wait / other;
* queue length: launched operations that have not started on the GPU yet;
* kernel launch delay: from the end of the launch call to the kernel's start;

and the ``cpu_starved_gpu`` finding when the busiest stream idles mostly
because the host had not launched the next kernel yet.

Times stay in the trace's own clock, integer microseconds (``*_us``), while
intervals are merged, so that sums are exact; every result leaves this module
in seconds.

The definitions follow Holistic Trace Analysis (HTA, facebookresearch,
``breakdown_analysis.py``, ``trace_counters.py``, ``cuda_kernel_analysis.py``):
on the A100 and V100 traces in HTA's test data they give HTA's figures. Where
HTA's code and its own description differ, the description wins; each function
says where.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from gpudiag.catalog import M
from gpudiag.errors import GpudiagError
from gpudiag.findings import Evidence, Finding, Severity, alert_name

# --- kernel categories (HTA's get_kernel_type) ---------------------------------
COMPUTE, MEMORY, COMMUNICATION = 0, 1, 2
CATEGORY_NAMES = {COMPUTE: "compute", MEMORY: "memory", COMMUNICATION: "communication"}

# HTA's default consecutive_kernel_delay: a gap shorter than this between two
# activities on a stream whose launch was already queued is the device's own
# back-to-back launch overhead (kernel wait), not a stall with a cause.
KERNEL_WAIT_THRESHOLD_US = 30

# Runtime and driver calls that put one operation on a stream (HTA's
# get_runtime_launch_events_query, plus the driver's Ex variant that newer
# PyTorch builds use): the increments of the queue and the starts of launch delay.
LAUNCH_CALLS = frozenset({
    "cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
    "cudaMemcpyAsync", "cudaMemsetAsync",
})

PROFILER_STEP = re.compile(r"ProfilerStep\s*#\s*(\d+)")

# --- cpu_starved_gpu thresholds ---------------------------------------------------
# Host wait must be the larger part of the idle time: then feeding the GPU
# faster is the first fix, before any kernel or communication tuning.
HOST_WAIT_DOMINANT_RATIO = 0.5
# The busiest stream must idle at least a fifth of its span: below that the
# GPU is close to saturated and removing all host wait gains little.
STARVED_MIN_IDLE_RATIO = 0.2
CPU_STARVED_KIND = "cpu_starved_gpu"
CPU_STARVED_FIXES = ["preprocess-workers"]


def kernel_category(name: str) -> int:
    """HTA's kernel type, from the activity's name alone.

    ``COMMUNICATION`` when the name contains ``ncclKernel``; ``MEMORY`` when it
    contains ``Memcpy`` or ``Memset``; ``COMPUTE`` for everything else on a GPU
    stream (as in HTA this includes every other device activity, e.g. CUDA
    synchronization records).
    """
    if "ncclKernel" in name:
        return COMMUNICATION
    if "Memcpy" in name or "Memset" in name:
        return MEMORY
    return COMPUTE


@dataclass
class KinetoTrace:
    """The parts of a Kineto trace the analysis needs, as columns (see trace_reader).

    GPU activities: one entry per event on a GPU stream (``args.stream`` set),
    with start/end rounded inward to whole microseconds as HTA does (start up,
    end down, end never before start). Runtime calls: host-side events that
    carry a ``correlation`` id. ``profiler_steps``: (name, start_us) of the
    ``ProfilerStep#N`` annotations.
    """

    gpu_start_us: np.ndarray
    gpu_end_us: np.ndarray
    gpu_stream: np.ndarray
    gpu_correlation: np.ndarray
    gpu_category: np.ndarray
    runtime_correlation: np.ndarray
    runtime_start_us: np.ndarray
    runtime_end_us: np.ndarray
    runtime_is_launch: np.ndarray
    profiler_steps: list[tuple[str, int]] = field(default_factory=list)
    stream_device: dict[int, int] = field(default_factory=dict)
    host_pid: int | None = None
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def gpu_count(self) -> int:
        """Number of GPU activities."""
        return int(self.gpu_start_us.size)


# --- interval arithmetic ----------------------------------------------------------

def merged_intervals(start_us: np.ndarray, end_us: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The union of [start, end) intervals as disjoint, sorted intervals.

    HTA's merge_kernel_intervals: sorted by start, an interval joins the
    previous group unless it starts strictly after every earlier end.
    """
    if start_us.size == 0:
        return start_us[:0], end_us[:0]
    order = np.lexsort((end_us, start_us))
    s, e = start_us[order], end_us[order]
    running_end = np.maximum.accumulate(e)
    new_group = np.empty(s.size, dtype=bool)
    new_group[0] = True
    new_group[1:] = s[1:] > running_end[:-1]
    first = np.flatnonzero(new_group)
    last = np.append(first[1:] - 1, s.size - 1)
    return s[first], running_end[last]


@dataclass
class TemporalBreakdown:
    """Idle / compute / non-compute time of one span (seconds)."""

    span_s: float
    idle_s: float
    compute_s: float
    non_compute_s: float
    busy_s: float

    def ratio(self, part_s: float) -> float:
        """``part_s`` as a fraction of the span (NaN for an empty span)."""
        return part_s / self.span_s if self.span_s > 0 else math.nan


def temporal_breakdown(start_us: np.ndarray, end_us: np.ndarray, category: np.ndarray) -> TemporalBreakdown:
    """HTA's temporal breakdown of a set of GPU activities.

    span = end of the last merged interval - start of the first;
    idle = span - merged busy time (time with no activity at all);
    compute = merged time of COMPUTE activities;
    non-compute = span - compute - idle: time when only memory or
    communication activities ran.
    """
    if start_us.size == 0:
        return TemporalBreakdown(0.0, 0.0, 0.0, 0.0, 0.0)
    ms, me = merged_intervals(start_us, end_us)
    span_us = int(me[-1] - ms[0])
    busy_us = int((me - ms).sum())
    is_compute = category == COMPUTE
    cs, ce = merged_intervals(start_us[is_compute], end_us[is_compute])
    compute_us = int((ce - cs).sum())
    idle_us = span_us - busy_us
    return TemporalBreakdown(
        span_s=span_us * 1e-6,
        idle_s=idle_us * 1e-6,
        compute_s=compute_us * 1e-6,
        non_compute_s=(span_us - compute_us - idle_us) * 1e-6,
        busy_s=busy_us * 1e-6,
    )


@dataclass
class IdleBreakdown:
    """Idle time of one stream split by cause (seconds, and shares of the total)."""

    host_wait_s: float
    kernel_wait_s: float
    other_s: float

    @property
    def total_s(self) -> float:
        """All idle time between the stream's first and last activity."""
        return self.host_wait_s + self.kernel_wait_s + self.other_s

    def _share(self, part: float) -> float | None:
        total = self.total_s
        return part / total if total > 0 else None

    def to_dict(self) -> dict[str, float | None]:
        """``host_wait_ratio``, ``kernel_wait_ratio``, ``other_ratio``: shares of idle time (None without idle)."""
        return {
            "host_wait_ratio": self._share(self.host_wait_s),
            "kernel_wait_ratio": self._share(self.kernel_wait_s),
            "other_ratio": self._share(self.other_s),
        }


def idle_breakdown(start_us: np.ndarray, end_us: np.ndarray, issue_us: np.ndarray) -> IdleBreakdown:
    """HTA's idle time breakdown of one stream.

    ``issue_us`` is, per activity, the start of the host call it is correlated
    with (NaN when the trace has none). Activities are taken in start order;
    each gap between the end of everything before an activity and its start
    is idle time, attributed to:

    * host wait: the host call that issued the activity started after the
      stream had gone idle (the CPU was not enqueuing work fast enough);
    * kernel wait: otherwise, when the gap is shorter than
      KERNEL_WAIT_THRESHOLD_US (back-to-back launch overhead);
    * other: the rest (e.g. waiting on an event from another stream).

    HTA measures a gap from the end of the previous activity in start order;
    here it is measured from the latest end so far, so that overlapping
    activities on one stream never make a gap negative and the three parts
    add up to the stream's idle time of the temporal breakdown.
    """
    if start_us.size < 2:
        return IdleBreakdown(0.0, 0.0, 0.0)
    order = np.lexsort((end_us, start_us))
    s, e, issue = start_us[order], end_us[order], issue_us[order]
    idle_since = np.maximum.accumulate(e)[:-1]
    gap = s[1:] - idle_since
    issue = issue[1:]
    is_gap = gap > 0
    with np.errstate(invalid="ignore"):
        host = is_gap & (issue > idle_since)  # NaN compares False: no host call, no host wait
    kernel = is_gap & ~host & (gap < KERNEL_WAIT_THRESHOLD_US)
    other = is_gap & ~host & ~kernel
    return IdleBreakdown(
        host_wait_s=int(gap[host].sum()) * 1e-6,
        kernel_wait_s=int(gap[kernel].sum()) * 1e-6,
        other_s=int(gap[other].sum()) * 1e-6,
    )


@dataclass
class QueueLengthStats:
    """Distribution of a stream's launch queue length."""

    count: int
    mean: float | None
    std: float | None
    min: float | None
    p25: float | None
    p50: float | None
    p75: float | None
    max: float | None
    empty_time_ratio: float | None

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (keys as the attributes)."""
        return dict(self.__dict__)


def queue_length_stats(launch_us: np.ndarray, begin_us: np.ndarray) -> QueueLengthStats:
    """HTA's queue length of one stream, and how long it sat empty.

    Queue length = operations launched on the stream that have not started
    executing: +1 at the start of each launch call (LAUNCH_CALLS), -1 when its
    activity starts on the GPU; a launch and a start at the same microsecond
    count the launch first. ``count`` .. ``max`` describe the values after
    each change (HTA's ``describe()`` of the step series; std with ddof=1);
    ``empty_time_ratio`` is the time-weighted share of the series' span with
    nothing queued (HTA does not compute it).
    """
    n = int(launch_us.size)
    if n == 0:
        return QueueLengthStats(0, None, None, None, None, None, None, None, None)
    times = np.concatenate([launch_us, begin_us])
    delta = np.concatenate([np.ones(n, dtype=np.int64), -np.ones(n, dtype=np.int64)])
    order = np.lexsort((-delta, times))
    times, length = times[order], np.cumsum(delta[order])
    q = np.percentile(length, [25, 50, 75])
    span = float(times[-1] - times[0])
    held = np.diff(times).astype(np.float64)
    empty = float(held[length[:-1] == 0].sum()) / span if span > 0 else None
    return QueueLengthStats(
        count=int(length.size),
        mean=float(length.mean()),
        std=float(length.std(ddof=1)) if length.size > 1 else None,
        min=float(length.min()),
        p25=float(q[0]),
        p50=float(q[1]),
        p75=float(q[2]),
        max=float(length.max()),
        empty_time_ratio=empty,
    )


@dataclass
class LaunchDelayStats:
    """Distribution of kernel launch delay on one stream (seconds)."""

    count: int
    mean_s: float | None
    p50_s: float | None
    p95_s: float | None
    max_s: float | None

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (keys as the attributes)."""
        return dict(self.__dict__)


def launch_delay_stats(delay_us: np.ndarray) -> LaunchDelayStats:
    """Launch delay = start of the activity on the GPU - end of the host launch call.

    This is the definition HTA's get_cuda_kernel_launch_stats describes ("the
    difference between GPU kernel starting and CPU op ending"); its code adds
    the call's duration instead of subtracting it. Negative when the kernel
    began before the call returned.
    """
    if delay_us.size == 0:
        return LaunchDelayStats(0, None, None, None, None)
    d = delay_us.astype(np.float64) * 1e-6
    p50, p95 = np.percentile(d, [50, 95])
    return LaunchDelayStats(int(d.size), float(d.mean()), float(p50), float(p95), float(d.max()))


# --- the trace as a whole ---------------------------------------------------------

def select_profiled_iterations(trace: KinetoTrace) -> KinetoTrace:
    """HTA's filter of a trace to its complete iterations.

    With two or more distinct ``ProfilerStep#N`` annotations, the last step is
    usually cut short by the end of profiling, so HTA keeps only host calls
    that started before the last step began and the GPU activities they
    issued (matched by correlation id). With fewer steps the trace is kept
    whole. GPU activities without an issuing host call are dropped by the
    filter (HTA keeps them only through an accident of its join).
    """
    names = {name for name, _ in trace.profiler_steps}
    if len(names) < 2:
        return trace
    last_step_start = max(ts for _, ts in trace.profiler_steps)
    keep_rt = trace.runtime_start_us < last_step_start
    kept_corr = np.unique(trace.runtime_correlation[keep_rt])
    keep_gpu = np.isin(trace.gpu_correlation, kept_corr)
    return replace(
        trace,
        gpu_start_us=trace.gpu_start_us[keep_gpu],
        gpu_end_us=trace.gpu_end_us[keep_gpu],
        gpu_stream=trace.gpu_stream[keep_gpu],
        gpu_correlation=trace.gpu_correlation[keep_gpu],
        gpu_category=trace.gpu_category[keep_gpu],
        runtime_correlation=trace.runtime_correlation[keep_rt],
        runtime_start_us=trace.runtime_start_us[keep_rt],
        runtime_end_us=trace.runtime_end_us[keep_rt],
        runtime_is_launch=trace.runtime_is_launch[keep_rt],
    )


def _correlate(trace: KinetoTrace) -> np.ndarray:
    """Per GPU activity, the index of its host call in the runtime columns, or -1."""
    rc = trace.runtime_correlation
    if rc.size == 0:
        return np.full(trace.gpu_count, -1, dtype=np.int64)
    order = np.argsort(rc, kind="stable")
    sorted_corr = rc[order]
    pos = np.searchsorted(sorted_corr, trace.gpu_correlation)
    pos_clipped = np.minimum(pos, sorted_corr.size - 1)
    found = sorted_corr[pos_clipped] == trace.gpu_correlation
    return np.where(found, order[pos_clipped], -1)


@dataclass
class StreamReport:
    """Everything measured on one CUDA stream."""

    stream: int
    device: int | None
    activities: int
    breakdown: TemporalBreakdown
    idle: IdleBreakdown
    queue_length: QueueLengthStats
    launch_delay: LaunchDelayStats

    def to_dict(self) -> dict[str, Any]:
        """The per-stream JSON form of ``gpudiag analyze trace --json``."""
        b = self.breakdown
        return {
            "stream": self.stream,
            "device": self.device,
            "activities": self.activities,
            "span_s": b.span_s,
            "busy_s": b.busy_s,
            "idle_pct": _pct(b.ratio(b.idle_s)),
            "compute_pct": _pct(b.ratio(b.compute_s)),
            "non_compute_pct": _pct(b.ratio(b.non_compute_s)),
            "idle_breakdown": self.idle.to_dict(),
            "idle_breakdown_s": {
                "host_wait_s": self.idle.host_wait_s,
                "kernel_wait_s": self.idle.kernel_wait_s,
                "other_s": self.idle.other_s,
            },
            "queue_length": self.queue_length.to_dict(),
            "launch_delay": self.launch_delay.to_dict(),
        }


@dataclass
class TraceReport:
    """The analysis of one trace: all streams together, each stream, and findings."""

    start_s: float
    end_s: float
    overall: TemporalBreakdown
    streams: list[StreamReport]
    profiler_steps: int
    iterations_filtered: bool
    host_pid: int | None
    findings: list[Finding] = field(default_factory=list)

    @property
    def busiest_stream(self) -> StreamReport:
        """The stream with the most busy (merged activity) time."""
        return max(self.streams, key=lambda s: (s.breakdown.busy_s, -s.stream))

    def to_dict(self) -> dict[str, Any]:
        """The JSON document of ``gpudiag analyze trace --json``."""
        o = self.overall
        return {
            "idle_pct": _pct(o.ratio(o.idle_s)),
            "compute_pct": _pct(o.ratio(o.compute_s)),
            "non_compute_pct": _pct(o.ratio(o.non_compute_s)),
            "span_s": o.span_s,
            "busy_s": o.busy_s,
            "start_s": self.start_s,
            "end_s": self.end_s,
            "busiest_stream": self.busiest_stream.stream,
            "profiler_steps": self.profiler_steps,
            "last_step_excluded": self.iterations_filtered,
            "host_pid": self.host_pid,
            "streams": [s.to_dict() for s in self.streams],
            "findings": [f.to_dict() for f in self.findings],
        }


def _pct(ratio: float) -> float | None:
    return None if math.isnan(ratio) else 100.0 * ratio


def analyze_trace(trace: KinetoTrace) -> TraceReport:
    """Temporal and idle breakdowns, queue lengths, launch delays and findings of a trace.

    The trace is first reduced to its complete iterations
    (select_profiled_iterations). The overall breakdown merges every GPU
    stream, as HTA does per rank; each stream is then measured alone with the
    same definitions. GpudiagError when no GPU activity remains.
    """
    steps = len({name for name, _ in trace.profiler_steps})
    t = select_profiled_iterations(trace)
    filtered = t is not trace
    if t.gpu_count == 0:
        raise GpudiagError(
            "the trace has no GPU activity (kernels, memcpy, memset); record it with "
            "torch.profiler activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]"
        )
    host = _correlate(t)
    has_host = host >= 0
    if t.runtime_correlation.size:
        host_safe = np.where(has_host, host, 0)
        issue_us = np.where(has_host, t.runtime_start_us[host_safe], np.nan).astype(np.float64)
        launched = has_host & t.runtime_is_launch[host_safe]
    else:
        issue_us = np.full(t.gpu_count, np.nan)
        launched = has_host

    streams = []
    for stream in np.unique(t.gpu_stream):
        on = t.gpu_stream == stream
        s, e = t.gpu_start_us[on], t.gpu_end_us[on]
        ql = on & launched
        streams.append(StreamReport(
            stream=int(stream),
            device=t.stream_device.get(int(stream)),
            activities=int(on.sum()),
            breakdown=temporal_breakdown(s, e, t.gpu_category[on]),
            idle=idle_breakdown(s, e, issue_us[on]),
            queue_length=queue_length_stats(t.runtime_start_us[host[ql]], t.gpu_start_us[ql]),
            launch_delay=launch_delay_stats(t.gpu_start_us[ql] - t.runtime_end_us[host[ql]]),
        ))
    report = TraceReport(
        start_s=float(t.gpu_start_us.min()) * 1e-6,
        end_s=float(t.gpu_end_us.max()) * 1e-6,
        overall=temporal_breakdown(t.gpu_start_us, t.gpu_end_us, t.gpu_category),
        streams=streams,
        profiler_steps=steps,
        iterations_filtered=filtered,
        host_pid=t.host_pid,
    )
    finding = cpu_starved_finding(report)
    if finding is not None:
        report.findings.append(finding)
    return report


def cpu_starved_finding(report: TraceReport) -> Finding | None:
    """``cpu_starved_gpu`` when host wait dominates idle time on the busiest stream.

    Fires when the busiest stream idles at least STARVED_MIN_IDLE_RATIO of its
    span and at least HOST_WAIT_DOMINANT_RATIO of that idle time is host wait.
    Evidence: the stream's idle ratio, host-wait share, time with an empty
    launch queue and median launch delay.
    """
    st = report.busiest_stream
    b = st.breakdown
    idle_ratio = b.ratio(b.idle_s)
    host_ratio = st.idle.to_dict()["host_wait_ratio"]
    if math.isnan(idle_ratio) or host_ratio is None:
        return None
    if idle_ratio < STARVED_MIN_IDLE_RATIO or host_ratio < HOST_WAIT_DOMINANT_RATIO:
        return None
    evidence = [
        Evidence(M.trace_stream_idle_ratio, idle_ratio, threshold=STARVED_MIN_IDLE_RATIO, unit="ratio"),
        Evidence(M.trace_stream_host_wait_ratio, host_ratio, threshold=HOST_WAIT_DOMINANT_RATIO, unit="ratio"),
    ]
    if st.queue_length.empty_time_ratio is not None:
        evidence.append(Evidence(M.trace_stream_queue_empty_ratio, st.queue_length.empty_time_ratio, unit="ratio"))
    if st.launch_delay.p50_s is not None:
        evidence.append(Evidence(M.trace_kernel_launch_delay_seconds, st.launch_delay.p50_s, unit="seconds"))
    return Finding(
        kind=CPU_STARVED_KIND,
        severity=Severity.WARNING,
        start_s=report.start_s,
        end_s=report.end_s,
        summary=(
            f"GPU stream {st.stream} is idle {idle_ratio:.1%} of the trace and {host_ratio:.0%} of that "
            "idle time is host wait: the CPU had not launched the next kernel yet"
        ),
        gpu=st.device,
        pid=report.host_pid,
        evidence=evidence,
        runbook=alert_name(CPU_STARVED_KIND),
        fixes=list(CPU_STARVED_FIXES),
        details={"stream": st.stream, "idle_s": b.idle_s, "host_wait_s": st.idle.host_wait_s},
    )
