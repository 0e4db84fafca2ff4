"""Device time in a PyTorch profiler (Kineto) trace, defined as Holistic Trace Analysis defines it.

A Kineto trace records, for one process, the host-side runtime calls
(``cudaLaunchKernel``, ``hipLaunchKernel``, MTIA's ``runFunction``, ...) and
the device activities they caused (kernels, memcpys, memsets, synchronization
records), linked by a ``correlation`` id. From those this module derives, per
stream and over all streams of the device together:

* the temporal breakdown: idle / compute / non-compute time of the span from
  the first device activity to the end of the last;
* the idle breakdown of a stream: host wait / kernel wait / other;
* queue length: launched operations that have not started on the device yet;
* kernel launch delay: from the start of the launch call to the start of the
  activity, for activities launched onto an idle stream;

and the ``cpu_starved_gpu`` finding, judged on the device (all streams
merged), not on one stream.

Definitions that decide the figures:

* device activity: an event of a device category (DEVICE_CATEGORIES: CUDA and
  ROCm kernels, memcpys, memsets and sync records, MTIA's CCP events) on a
  stream. A host event that carries a ``stream`` argument (a Triton launcher
  op, a ROCm runtime call) is not device work; stream ids -1 and 4294967295
  (-1 as unsigned) mean "no stream" and are not streams.
* categories (kernel_category, HTA's kernel types): NCCL kernels, old
  (``ncclKernel_*``) and current (``ncclDevKernel_*``, NCCL >= 2.19) names,
  are communication; memcpy, memset and MTIA DMA records are memory; sync
  records ("Stream Sync", "Stream Wait Event", "Context Sync", "Event Sync")
  are sync; everything else is compute. Non-compute is everything busy that
  is not compute.
* sync records are the stream waiting, not working: they count in the
  device's temporal breakdown as non-compute (as in HTA), and are left out of
  every per-stream measure (HTA leaves them out of the idle breakdown).

Times stay in the trace's own clock, integer microseconds (``*_us``), while
intervals are merged, so that sums are exact; every result leaves this module
in seconds.

The definitions follow HTA (facebookresearch/HolisticTraceAnalysis,
``breakdown_analysis.py``, ``trace_counters.py``, ``critical_path_analysis.py``,
``utils.py``); on HTA's test traces they give HTA 0.6.1's figures within
0.1 percentage point. Where HTA's code and its own description differ, each
function says which one is followed.
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
from gpudiag.units import fmt_seconds

# --- what is device work --------------------------------------------------------------

# Event categories of device activities (compared in lower case: Kineto wrote
# "Kernel", "Memcpy", "Memset" before it wrote "kernel", "gpu_memcpy", ...).
# ROCm traces use the CUDA names. "gpu_user_annotation" is not here: it is a
# label spanning kernels, not work of its own.
MTIA_DEVICE_CATEGORY = "mtia_ccp_events"
DEVICE_CATEGORIES = frozenset({
    "kernel", "gpu_memcpy", "gpu_memset", "cuda_sync", "memcpy", "memset", MTIA_DEVICE_CATEGORY,
})
# Stream ids that mean "no stream" (CUPTI's sentinel, signed and unsigned):
# Context Sync and Event Sync records carry them.
NO_STREAM_IDS = frozenset({-1, 0xFFFFFFFF})

# --- kernel categories (HTA's get_kernel_type) ---------------------------------
COMPUTE, MEMORY, COMMUNICATION, SYNC, OTHER = 0, 1, 2, 3, 4
CATEGORY_NAMES = {COMPUTE: "compute", MEMORY: "memory", COMMUNICATION: "communication", SYNC: "sync",
                  OTHER: "other"}
SYNC_RECORD_NAMES = frozenset({"Stream Sync", "Stream Wait Event", "Context Sync", "Event Sync"})
# NCCL's kernels: ncclKernel_AllReduce_RING_LL_Sum_float, and since NCCL 2.19 ncclDevKernel_AllReduce_...
_NCCL_KERNEL = re.compile(r"(?:void )?nccl\w*Kernel")
# HTA counts MTIA's pe_exe records (per-processing-element execution slices,
# recorded without a launch correlation) as busy but not compute; its figures
# on its MTIA test trace (4.34 / 86.17 / 9.49) come out only this way.
MTIA_NON_COMPUTE_RECORDS = frozenset({"pe_exe"})

# HTA's default consecutive_kernel_delay: a gap shorter than this between two
# activities on a stream whose launch was already queued is the device's own
# back-to-back launch overhead (kernel wait), not a stall with a cause.
KERNEL_WAIT_THRESHOLD_US = 30

# Runtime and driver calls that put one operation on a stream: the increments
# of the queue and the starts of launch delay. CUDA as in HTA's
# get_runtime_launch_events_query plus the driver's Ex variant; ROCm's HIP
# equivalents; MTIA's job submission (HTA's MTIA launch) and its async copies.
LAUNCH_CALLS = frozenset({
    "cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
    "cudaMemcpyAsync", "cudaMemsetAsync",
    "hipLaunchKernel", "hipExtLaunchKernel", "hipModuleLaunchKernel", "hipExtModuleLaunchKernel",
    "hipMemcpyAsync", "hipMemsetAsync", "hipMemcpyWithStream",
    "runFunction - job_prep_and_submit_for_execution",
    "enqueueCommand memcpyHtoDAsync", "enqueueCommand memcpyDtoHAsync",
})

PROFILER_STEP = re.compile(r"ProfilerStep\s*#\s*(\d+)")

# --- what the host side says about the workload -----------------------------------------
# Autograd's backward functions (ConvolutionBackward0, ...) and backward kernels.
_BACKWARD = re.compile(r"backward", re.IGNORECASE)
# torch.optim's annotations (Optimizer.step#AdamW.step) and the fused optimizer ops.
_OPTIMIZER = re.compile(r"Optimizer\.(?:step|zero_grad)|_fused_(?:adamw?|sgd)_")
# A DataLoader loading in the training process itself (num_workers=0).
_SINGLE_PROCESS_LOADER = "_SingleProcessDataLoaderIter"
# Calls that block the host until the device catches up (.item(), .cpu(), explicit syncs; MTIA's
# synchronizeStream).
HOST_SYNC_CALLS = frozenset({
    "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
    "hipStreamSynchronize", "hipDeviceSynchronize", "hipEventSynchronize",
    "synchronizeStream",
})

# --- cpu_starved_gpu thresholds ---------------------------------------------------
CPU_STARVED_KIND = "cpu_starved_gpu"
# The device (all streams merged) must idle at least a fifth of the span:
# below that it is close to saturated, and removing every host wait would
# gain at most 1.25x, less than the kernel or batch-size work that a busy
# device calls for.
STARVED_MIN_IDLE_RATIO = 0.2
# Host wait must be the larger part of the compute stream's idle time: then
# feeding the device faster is the first fix, before kernel or communication
# tuning (the rest is kernel wait, or waiting on another stream's event).
HOST_WAIT_DOMINANT_RATIO = 0.5
# Fewer host-wait gaps than this is a handful of kernels (a micro-benchmark,
# a warm-up), not a loop the host cannot keep up with.
MIN_HOST_WAIT_GAPS = 20
# (The verdict must also hold without the compute stream's longest host-wait
# gap: see cpu_starved_finding.)
# Blocking syncs count as evidence for "fewer host syncs" from this many on,
# and at least one per profiled step: a trace ends with one
# cudaDeviceSynchronize of the profiler's own.
MIN_HOST_SYNCS = 2
# The fix names of the frames analyzer (analyzers/cpu_starved_gpu.py), which
# shares the kind: `gpudiag repro --fix` names. Trace findings name their
# fixes in words, fitted to the workload (FIXES_BY_WORKLOAD).
CPU_STARVED_FIXES = ["preprocess-workers"]
FIX_DATALOADER = "DataLoader num_workers > 0"
FIX_PINNED = "pin_memory=True with non_blocking copies"
FIX_SYNCS = "fewer host syncs (.item(), .cpu())"
FIX_GRAPHS = "CUDA graphs (torch.compile mode='reduce-overhead')"
FIX_PREPROCESS = "preprocessing in worker processes"
FIXES_BY_WORKLOAD = {
    "training": (FIX_DATALOADER, FIX_PINNED, FIX_SYNCS, FIX_GRAPHS),
    "inference": (FIX_PREPROCESS, FIX_PINNED, FIX_SYNCS, FIX_GRAPHS),
    # Neither loader fits a workload we could not recognise; these two fit any loop.
    "unknown": (FIX_SYNCS, FIX_GRAPHS),
}


def kernel_category(name: str, cat: str = "") -> int:
    """HTA's kernel type of one device activity, from its name (and event category).

    ``SYNC`` for synchronization records (category ``cuda_sync`` or one of
    SYNC_RECORD_NAMES); ``COMMUNICATION`` for NCCL kernels, ``ncclKernel_*``
    and ``ncclDevKernel_*``; ``MEMORY`` when the name contains ``Memcpy`` or
    ``Memset`` or starts with ``dma`` (MTIA's DMA requests); ``OTHER`` for
    MTIA_NON_COMPUTE_RECORDS; ``COMPUTE`` for everything else.
    """
    if cat.lower() == "cuda_sync" or name in SYNC_RECORD_NAMES:
        return SYNC
    if _NCCL_KERNEL.match(name):
        return COMMUNICATION
    if "Memcpy" in name or "Memset" in name or name.startswith("dma"):
        return MEMORY
    if name in MTIA_NON_COMPUTE_RECORDS and cat.lower() == MTIA_DEVICE_CATEGORY:
        return OTHER
    return COMPUTE


def name_signal(name: str) -> str | None:
    """What one operator or kernel name says about the workload: a WorkloadSignals counter name, or None."""
    if _BACKWARD.search(name):
        return "backward"
    if _OPTIMIZER.search(name):
        return "optimizer"
    if _SINGLE_PROCESS_LOADER in name:
        return "single_process_loader"
    return None


@dataclass
class WorkloadSignals:
    """Counts of what the trace says about the loop that produced it (filled by trace_reader).

    ``host_ops``: host operators, annotations and Python functions;
    ``backward``, ``optimizer``, ``single_process_loader``: names that
    name_signal recognises (host ops and kernels alike); ``pageable_copies``:
    host-to-device copies from pageable memory; ``host_syncs``: HOST_SYNC_CALLS.
    """

    host_ops: int = 0
    backward: int = 0
    optimizer: int = 0
    single_process_loader: int = 0
    pageable_copies: int = 0
    host_syncs: int = 0


@dataclass
class KinetoTrace:
    """The parts of a Kineto trace the analysis needs, as columns (see trace_reader).

    Device activities: one entry per event of a device category on a stream,
    with start/end rounded inward to whole microseconds as HTA does (start up,
    end down, end never before start). Runtime calls: host-side events that
    carry a ``correlation`` id. ``profiler_steps``: (name, start_us) of the
    ``ProfilerStep#N`` annotations. ``skipped``: device activities left out,
    by reason, and ``skipped_example`` one offending value.
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
    device_kind: str = "GPU"
    workload: WorkloadSignals = field(default_factory=WorkloadSignals)
    skipped: dict[str, int] = field(default_factory=dict)
    skipped_example: Any = None

    @property
    def gpu_count(self) -> int:
        """Number of device activities."""
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


def _merged_us(start_us: np.ndarray, end_us: np.ndarray) -> int:
    s, e = merged_intervals(start_us, end_us)
    return int((e - s).sum())


@dataclass
class TemporalBreakdown:
    """Idle / compute / non-compute time of one span (seconds)."""

    span_s: float
    idle_s: float
    compute_s: float
    non_compute_s: float
    busy_s: float
    communication_s: float = 0.0

    def ratio(self, part_s: float) -> float:
        """``part_s`` as a fraction of the span (NaN for an empty span)."""
        return part_s / self.span_s if self.span_s > 0 else math.nan


def temporal_breakdown(start_us: np.ndarray, end_us: np.ndarray, category: np.ndarray) -> TemporalBreakdown:
    """HTA's temporal breakdown of a set of device activities.

    span = end of the last merged interval - start of the first;
    idle = span - merged busy time (time with no activity at all);
    compute = merged time of COMPUTE activities;
    non-compute = span - compute - idle: time when only memory,
    communication, sync or other activities ran.
    ``communication_s`` (merged time of COMMUNICATION activities) tells a
    collective stream from a compute stream.
    """
    if start_us.size == 0:
        return TemporalBreakdown(0.0, 0.0, 0.0, 0.0, 0.0)
    ms, me = merged_intervals(start_us, end_us)
    span_us = int(me[-1] - ms[0])
    busy_us = int((me - ms).sum())
    is_compute = category == COMPUTE
    compute_us = _merged_us(start_us[is_compute], end_us[is_compute])
    is_comm = category == COMMUNICATION
    idle_us = span_us - busy_us
    return TemporalBreakdown(
        span_s=span_us * 1e-6,
        idle_s=idle_us * 1e-6,
        compute_s=compute_us * 1e-6,
        non_compute_s=(span_us - compute_us - idle_us) * 1e-6,
        busy_s=busy_us * 1e-6,
        communication_s=_merged_us(start_us[is_comm], end_us[is_comm]) * 1e-6,
    )


@dataclass
class IdleBreakdown:
    """Idle time of one stream split by cause (seconds, and shares of the total).

    ``host_wait_gaps`` counts the gaps attributed to host wait and
    ``largest_host_wait_s`` is the longest of them: how much of the host wait
    one slow call could explain.
    """

    host_wait_s: float
    kernel_wait_s: float
    other_s: float
    host_wait_gaps: int = 0
    largest_host_wait_s: float = 0.0

    @property
    def total_s(self) -> float:
        """All idle time between the stream's first and last activity."""
        return self.host_wait_s + self.kernel_wait_s + self.other_s

    def _share(self, part: float) -> float | None:
        total = self.total_s
        return part / total if total > 0 else None

    @property
    def host_wait_ratio(self) -> float | None:
        """Host wait as a share of idle time (None without idle time)."""
        return self._share(self.host_wait_s)

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
    add up to the stream's idle time of the temporal breakdown. Sync records
    are not activities here (the caller leaves them out, as HTA does).
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
    host_gaps = gap[host]
    return IdleBreakdown(
        host_wait_s=int(host_gaps.sum()) * 1e-6,
        kernel_wait_s=int(gap[kernel].sum()) * 1e-6,
        other_s=int(gap[other].sum()) * 1e-6,
        host_wait_gaps=int(host_gaps.size),
        largest_host_wait_s=int(host_gaps.max()) * 1e-6 if host_gaps.size else 0.0,
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
    """Distribution of kernel launch delay on one stream (seconds), and what was left out.

    ``queued``: activities launched while earlier work on the stream was still
    queued or running (their wait is queueing, not launch delay).
    ``clock_skew``: activities that started before their launch call did,
    which one clock cannot show: the host's and the device's clocks disagree.
    """

    count: int
    mean_s: float | None
    p50_s: float | None
    p95_s: float | None
    max_s: float | None
    queued: int = 0
    clock_skew: int = 0

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (keys as the attributes)."""
        return dict(self.__dict__)


def kernel_launch_delays(start_us: np.ndarray, end_us: np.ndarray, launch_us: np.ndarray,
                         launched: np.ndarray) -> tuple[np.ndarray, int, int]:
    """HTA's kernel launch delay of each activity launched onto an idle stream.

    ``launch_us`` is, per activity, the start of its launch call (LAUNCH_CALLS),
    meaningful where ``launched``. As HTA's critical path defines its kernel
    launch delay edge, the delay runs from the start of the launch call to
    the start of the activity, and only for an activity whose launch began
    after everything before it on the stream (in start order) had ended:
    nothing was queued ahead of it. Measured from the end of the launch call
    (HTA's get_cuda_kernel_launch_stats), a kernel that starts while its
    call is still returning (the first launch of a module loads it; the
    driver returns after submitting) would get a negative delay; measured
    for a queued activity, the delay would be the time spent behind others.

    Returns (delays in µs, all >= 0; the number of queued activities; the
    number left out for clock skew).
    """
    if start_us.size == 0:
        return start_us[:0], 0, 0
    order = np.lexsort((end_us, start_us))
    s, e, launch, has = start_us[order], end_us[order], launch_us[order], launched[order]
    free_at = np.empty_like(e)
    free_at[0] = np.iinfo(np.int64).min
    free_at[1:] = np.maximum.accumulate(e)[:-1]
    onto_idle = has & (launch > free_at)
    skewed = onto_idle & (s < launch)
    ok = onto_idle & ~skewed
    return s[ok] - launch[ok], int((has & ~onto_idle).sum()), int(skewed.sum())


def launch_delay_stats(delay_us: np.ndarray, queued: int = 0, clock_skew: int = 0) -> LaunchDelayStats:
    """Count, mean, P50, P95 and max of launch delays (kernel_launch_delays), in seconds."""
    if delay_us.size == 0:
        return LaunchDelayStats(0, None, None, None, None, queued, clock_skew)
    d = delay_us.astype(np.float64) * 1e-6
    p50, p95 = np.percentile(d, [50, 95])
    return LaunchDelayStats(int(d.size), float(d.mean()), float(p50), float(p95), float(d.max()), queued, clock_skew)


# --- the workload behind the trace --------------------------------------------------------

@dataclass
class Workload:
    """What kind of loop the trace recorded, and why we think so."""

    kind: str  # "training", "inference" or "unknown"
    reasons: list[str]


def recognise_workload(trace: KinetoTrace) -> Workload:
    """Training, inference or unknown, from the trace's host operators and kernels.

    Training: backward operators or kernels (autograd's ``...Backward0``
    functions, ``*backward*`` kernels) or optimizer steps
    (``Optimizer.step#...``, fused optimizer ops); ``ProfilerStep#`` marks
    iterations of either kind and only adds to the reasons. Inference: host
    operators, none of them backward or optimizer. Unknown: no host
    operators at all (a trace of kernels and runtime calls only).
    """
    w = trace.workload
    steps = len({name for name, _ in trace.profiler_steps})
    reasons = []
    if w.backward:
        reasons.append(f"{w.backward} backward operators or kernels")
    if w.optimizer:
        reasons.append(f"{w.optimizer} optimizer steps")
    if reasons:
        if steps:
            reasons.append(f"ProfilerStep# marks {steps} iterations")
        return Workload("training", reasons)
    if w.host_ops:
        return Workload("inference", [f"{w.host_ops} host operators, none of them backward or optimizer"])
    return Workload("unknown", ["the trace holds no host operators to tell training from inference"])


def fixes_for(workload: Workload, trace: KinetoTrace) -> tuple[list[str], dict[str, str]]:
    """The fixes for a starved device that fit the workload, those the trace gives evidence for first.

    Training gets DataLoader workers, pinned memory, fewer host syncs and
    CUDA graphs; inference gets preprocessing workers, pinned memory, fewer
    host syncs and CUDA graphs; an unrecognised workload only the last two,
    which fit any loop. Evidence: a single-process DataLoader, pageable
    host-to-device copies, at least MIN_HOST_SYNCS blocking syncs and one per
    profiled step. Returns (fixes, {fix: the evidence in the trace}).
    """
    w = trace.workload
    evidence = {}
    if w.single_process_loader:
        evidence[FIX_DATALOADER] = (f"{w.single_process_loader} batches loaded by _SingleProcessDataLoaderIter "
                                    "(num_workers=0): loading runs on the training thread")
    if w.pageable_copies:
        evidence[FIX_PINNED] = f"{w.pageable_copies} host-to-device copies from pageable memory"
    if w.host_syncs >= max(MIN_HOST_SYNCS, len({name for name, _ in trace.profiler_steps})):
        evidence[FIX_SYNCS] = f"{w.host_syncs} blocking synchronize calls (.item(), .cpu(), explicit syncs)"
    fixes = list(FIXES_BY_WORKLOAD[workload.kind])
    fixes.sort(key=lambda f: f not in evidence)  # stable: evidenced first, the order above otherwise
    return fixes, {f: evidence[f] for f in fixes if f in evidence}


# --- the trace as a whole ---------------------------------------------------------

def select_profiled_iterations(trace: KinetoTrace) -> KinetoTrace:
    """HTA's filter of a trace to its complete iterations.

    With two or more distinct ``ProfilerStep#N`` annotations, the last step is
    usually cut short by the end of profiling, so HTA keeps only host calls
    that started before the last step began and the device activities they
    issued (matched by correlation id). With fewer steps the trace is kept
    whole. Device activities without an issuing host call are dropped by the
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
    """Per device activity, the index of its host call in the runtime columns, or -1.

    A correlation id can name several host events (MTIA's synchronizeStream
    and the synchronize it calls); a launch call among them is the one
    that issued the activity, so launches are matched first.
    """
    rc = trace.runtime_correlation
    if rc.size == 0:
        return np.full(trace.gpu_count, -1, dtype=np.int64)
    order = np.lexsort((~trace.runtime_is_launch, rc))
    sorted_corr = rc[order]
    pos = np.searchsorted(sorted_corr, trace.gpu_correlation)
    pos_clipped = np.minimum(pos, sorted_corr.size - 1)
    found = sorted_corr[pos_clipped] == trace.gpu_correlation
    return np.where(found, order[pos_clipped], -1)


@dataclass
class StreamReport:
    """Everything measured on one stream (its sync records left out)."""

    stream: int
    device: int | None
    activities: int
    breakdown: TemporalBreakdown
    idle: IdleBreakdown
    queue_length: QueueLengthStats
    launch_delay: LaunchDelayStats

    @property
    def is_communication(self) -> bool:
        """True when communication kernels (NCCL) fill most of the stream's busy time."""
        b = self.breakdown
        return b.communication_s > 0.5 * b.busy_s

    def to_dict(self) -> dict[str, Any]:
        """The per-stream JSON form of ``gpudiag analyze trace --json``."""
        b = self.breakdown
        return {
            "stream": self.stream,
            "device": self.device,
            "activities": self.activities,
            "role": "communication" if self.is_communication else ("compute" if b.compute_s > 0 else "memory"),
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
            "host_wait_gaps": self.idle.host_wait_gaps,
            "largest_host_wait_s": self.idle.largest_host_wait_s,
            "queue_length": self.queue_length.to_dict(),
            "launch_delay": self.launch_delay.to_dict(),
        }


@dataclass
class TraceReport:
    """The analysis of one trace: the device (all streams together), each stream, and findings."""

    start_s: float
    end_s: float
    overall: TemporalBreakdown
    streams: list[StreamReport]
    profiler_steps: int
    iterations_filtered: bool
    host_pid: int | None
    device_kind: str = "GPU"
    workload: Workload = field(default_factory=lambda: Workload("unknown", []))
    skipped: dict[str, int] = field(default_factory=dict)
    skipped_example: Any = None
    findings: list[Finding] = field(default_factory=list)

    @property
    def busiest_stream(self) -> StreamReport | None:
        """The compute stream: the most compute time among streams that are not communication streams.

        A stream that mostly runs NCCL kernels waits on its peers by design
        and is never the busiest stream; None when no stream ran compute.
        """
        candidates = [s for s in self.streams if s.breakdown.compute_s > 0 and not s.is_communication]
        if not candidates:
            return None
        return max(candidates, key=lambda s: (s.breakdown.compute_s, s.breakdown.busy_s, -s.stream))

    def to_dict(self) -> dict[str, Any]:
        """The JSON document of ``gpudiag analyze trace --json``."""
        o = self.overall
        busiest = self.busiest_stream
        return {
            "device_kind": self.device_kind,
            "idle_pct": _pct(o.ratio(o.idle_s)),
            "compute_pct": _pct(o.ratio(o.compute_s)),
            "non_compute_pct": _pct(o.ratio(o.non_compute_s)),
            "span_s": o.span_s,
            "busy_s": o.busy_s,
            "start_s": self.start_s,
            "end_s": self.end_s,
            "busiest_stream": None if busiest is None else busiest.stream,
            "profiler_steps": self.profiler_steps,
            "last_step_excluded": self.iterations_filtered,
            "host_pid": self.host_pid,
            "workload": {"kind": self.workload.kind, "reasons": list(self.workload.reasons)},
            "skipped_activities": dict(self.skipped),
            "skipped_example": self.skipped_example,
            "streams": [s.to_dict() for s in self.streams],
            "findings": [f.to_dict() for f in self.findings],
        }


def _pct(ratio: float) -> float | None:
    return None if math.isnan(ratio) else 100.0 * ratio


_SKIP_REASONS = {
    "malformed_stream": "with an args.stream that is not an integer stream id",
    "missing_stream": "without an args.stream",
}


def _skipped_parts(skipped: dict[str, int]) -> str:
    return "; ".join(f"{n} {_SKIP_REASONS.get(k, k)}" for k, n in sorted(skipped.items()))


def skipped_text(skipped: dict[str, int], example: Any) -> str | None:
    """One line saying which device activities were skipped and why (None when none were)."""
    if not skipped:
        return None
    return f"skipped device activities: {_skipped_parts(skipped)} (e.g. args.stream = {example!r})"


def _no_activity_error(trace: KinetoTrace) -> GpudiagError:
    if trace.skipped:
        total = sum(trace.skipped.values())
        return GpudiagError(
            f"the trace has no usable GPU activity: {total} device activities were skipped "
            f"({_skipped_parts(trace.skipped)}; e.g. args.stream = {trace.skipped_example!r}); "
            "a stream must be an integer id"
        )
    return GpudiagError(
        "the trace has no GPU activity (kernels, memcpy, memset); record it with "
        "torch.profiler activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]"
    )


def analyze_trace(trace: KinetoTrace) -> TraceReport:
    """Temporal and idle breakdowns, queue lengths, launch delays and findings of a trace.

    The trace is first reduced to its complete iterations
    (select_profiled_iterations). The overall breakdown merges every stream of
    the device, sync records included (as non-compute), as HTA does per rank;
    each stream is then measured alone with the same definitions, without its
    sync records. GpudiagError when no device activity remains, naming the
    activities that were skipped for a malformed stream, if any.
    """
    steps = len({name for name, _ in trace.profiler_steps})
    t = select_profiled_iterations(trace)
    filtered = t is not trace
    if t.gpu_count == 0:
        raise _no_activity_error(trace)
    host = _correlate(t)
    has_host = host >= 0
    if t.runtime_correlation.size:
        host_safe = np.where(has_host, host, 0)
        issue_us = np.where(has_host, t.runtime_start_us[host_safe], np.nan).astype(np.float64)
        launched = has_host & t.runtime_is_launch[host_safe]
        launch_us = np.where(launched, t.runtime_start_us[host_safe], 0)
    else:
        issue_us = np.full(t.gpu_count, np.nan)
        launched = has_host
        launch_us = np.zeros(t.gpu_count, dtype=np.int64)

    work = t.gpu_category != SYNC
    streams = []
    for stream in np.unique(t.gpu_stream[work]):
        on = work & (t.gpu_stream == stream)
        s, e = t.gpu_start_us[on], t.gpu_end_us[on]
        ql = on & launched
        delays, queued, skewed = kernel_launch_delays(s, e, launch_us[on], launched[on])
        streams.append(StreamReport(
            stream=int(stream),
            device=t.stream_device.get(int(stream)),
            activities=int(on.sum()),
            breakdown=temporal_breakdown(s, e, t.gpu_category[on]),
            idle=idle_breakdown(s, e, issue_us[on]),
            queue_length=queue_length_stats(launch_us[ql], t.gpu_start_us[ql]),
            launch_delay=launch_delay_stats(delays, queued, skewed),
        ))
    report = TraceReport(
        start_s=float(t.gpu_start_us.min()) * 1e-6,
        end_s=float(t.gpu_end_us.max()) * 1e-6,
        overall=temporal_breakdown(t.gpu_start_us, t.gpu_end_us, t.gpu_category),
        streams=streams,
        profiler_steps=steps,
        iterations_filtered=filtered,
        host_pid=t.host_pid,
        device_kind=t.device_kind,
        workload=recognise_workload(t),
        skipped=dict(t.skipped),
        skipped_example=t.skipped_example,
    )
    finding = cpu_starved_finding(report, t)
    if finding is not None:
        report.findings.append(finding)
    return report


def cpu_starved_finding(report: TraceReport, trace: KinetoTrace | None = None) -> Finding | None:
    """``cpu_starved_gpu``, judged on the device: idle, and idle because the host was late.

    A warning needs all of:

    * the device (all streams merged) idle at least STARVED_MIN_IDLE_RATIO of
      the span: other streams filling a stream's gaps keep the device busy;
    * host wait at least HOST_WAIT_DOMINANT_RATIO of the compute stream's idle
      time (TraceReport.busiest_stream: never a communication stream);
    * enough of it to judge a loop: at least MIN_HOST_WAIT_GAPS host-wait gaps,
      and both figures above still over their thresholds without the longest
      gap (counted as device idle time, so the device figure left is a lower
      bound).

    With host wait dominant but the device mostly busy, or too few or too
    lopsided gaps, the finding is ``info`` with the figures and says what is
    missing; with host wait not dominant there is no finding. The fixes fit
    the workload (recognise_workload, fixes_for); ``trace`` supplies the
    workload evidence and may be omitted (no evidence then).
    """
    st = report.busiest_stream
    if st is None:
        return None
    o, b = report.overall, st.breakdown
    device_idle = o.ratio(o.idle_s)
    stream_idle = b.ratio(b.idle_s)
    host_ratio = st.idle.host_wait_ratio
    if math.isnan(device_idle) or host_ratio is None or host_ratio < HOST_WAIT_DOMINANT_RATIO:
        return None
    device = "MTIA device" if report.device_kind == "MTIA" else "GPU"
    named = device if st.device is None else f"{device} {st.device}"
    evidence = [
        Evidence(M.trace_device_idle_ratio, device_idle, threshold=STARVED_MIN_IDLE_RATIO, unit="ratio"),
        Evidence(M.trace_stream_host_wait_ratio, host_ratio, threshold=HOST_WAIT_DOMINANT_RATIO, unit="ratio"),
        Evidence(M.trace_stream_idle_ratio, stream_idle, unit="ratio"),
    ]
    if st.queue_length.empty_time_ratio is not None:
        evidence.append(Evidence(M.trace_stream_queue_empty_ratio, st.queue_length.empty_time_ratio, unit="ratio"))
    if st.launch_delay.p50_s is not None:
        evidence.append(Evidence(M.trace_kernel_launch_delay_seconds, st.launch_delay.p50_s, unit="seconds"))
    details: dict[str, Any] = {
        "stream": st.stream,
        "device_kind": report.device_kind,
        "device_idle_s": o.idle_s,
        "stream_idle_s": b.idle_s,
        "host_wait_s": st.idle.host_wait_s,
        "host_wait_gaps": st.idle.host_wait_gaps,
        "largest_host_wait_s": st.idle.largest_host_wait_s,
    }
    gaps = st.idle.host_wait_gaps
    figures = (f"compute stream {st.stream} waits on the host for {host_ratio:.0%} of its idle time "
               f"({fmt_seconds(st.idle.host_wait_s)} in {gaps} gap{'s' if gaps != 1 else ''})")

    def finding(severity: Severity, summary: str, fixes: list[str], **more: Any) -> Finding:
        return Finding(
            kind=CPU_STARVED_KIND, severity=severity, start_s=report.start_s, end_s=report.end_s,
            summary=summary, gpu=st.device, pid=report.host_pid, evidence=evidence,
            runbook=alert_name(CPU_STARVED_KIND), fixes=fixes, details={**details, **more},
        )

    if device_idle < STARVED_MIN_IDLE_RATIO:
        if stream_idle < STARVED_MIN_IDLE_RATIO:
            return None  # the compute stream itself is nearly always busy: nothing to report
        return finding(
            Severity.INFO,
            f"{named} busy {1 - device_idle:.1%} of the trace: {figures}, but the other streams fill "
            "the gaps; the device is not starved",
            [], verdict="device busy")
    # One slow host call (the first launch loading a module, a cudaMalloc, a checkpoint write, a pause) is
    # not a host that is late on every step: the figures must hold without the longest host-wait gap,
    # counted as device idle time (so the device figure left is a lower bound).
    longest = st.idle.largest_host_wait_s
    idle_without = max(o.idle_s - longest, 0.0) / (o.span_s - longest) if o.span_s > longest else 0.0
    host_without = ((st.idle.host_wait_s - longest) / (st.idle.total_s - longest)
                    if st.idle.total_s > longest else 0.0)
    if gaps < MIN_HOST_WAIT_GAPS:
        why = f"only {gaps} host-wait gap{'s' if gaps != 1 else ''} (fewer than {MIN_HOST_WAIT_GAPS})"
    elif idle_without < STARVED_MIN_IDLE_RATIO or host_without < HOST_WAIT_DOMINANT_RATIO:
        why = (f"without its longest gap ({fmt_seconds(longest)}, one slow host call) the device is idle "
               f"{idle_without:.0%} and host wait is {host_without:.0%} of the stream's idle time")
    else:
        why = None
    if why is not None:
        return finding(
            Severity.INFO,
            f"{named} idle {device_idle:.1%} of the trace and {figures}; {why}: too little to call the "
            "host the bottleneck of a loop",
            [], verdict="too little evidence",
            missing=("a trace of several steady-state iterations (torch.profiler schedule with wait and "
                     "warmup steps), so that one slow call or a warm-up does not decide the verdict"))
    workload = report.workload
    if trace is not None:
        fixes, fix_evidence = fixes_for(workload, trace)
    else:
        fixes, fix_evidence = list(FIXES_BY_WORKLOAD[workload.kind]), {}
    return finding(
        Severity.WARNING,
        f"{named} idle {device_idle:.1%} of the trace (all streams) and {figures}: the host had not "
        f"launched the next operation yet ({workload.kind} workload)",
        fixes, verdict="host-bound",
        workload=workload.kind, workload_reasons=list(workload.reasons), fix_evidence=fix_evidence,
        not_seen=("what the host did in the gaps (Python, data loading or a blocking call): the host-side "
                  "events of the same trace around the gaps show it"))
