"""oom_forecast: the memory a process holds grows towards the GPU's capacity; when will it run out?

Definitions (per GPU and process, over the window's 1 s samples):
- the watermark is what the process holds and cannot give back, not what its
  tensors use: with an in-process reporter, allocated plus inactive-split
  bytes (free blocks stuck in segments that also hold live blocks, torch's
  "inactive, non-releasable" memory). Reserved near the limit means OOM even
  at 60 % allocated (SCENARIOS.md §3) when the free reserved memory is such
  holes; the rest of the cache (whole-free segments, free pages of expandable
  segments) is released by the allocator's retry before it fails, so it is
  headroom, not held. Without the inactive-split column the reserved bytes
  (grey), without a reporter the driver-charged bytes (black). torch's
  statistics count the whole-free segments of a live CUDA graph's private
  pool as releasable although no retry frees them: memory_leak's pool layer
  (grey minus white rising) is what catches that growth;
- growth: the least-squares slope of that layer over the window, trusted
  only when it is positive, its t-statistic is at least TREND_T_STAT, the
  samples span at least MIN_TREND_SPAN_S, and it goes on through the window:
  the middle and the last third each rise significantly at SUSTAINED_SHARE
  of that rate or more, and the last third at SUSTAINED_SHARE of the first
  third's rate or more (a warm-up that filled the pool and then stopped, or
  slowed as the pool reached the working set, is no trend);
- headroom: device capacity minus device memory in use at the last sample
  (NVML used; else capacity minus every process's black layer), plus the
  releasable cache (reserved minus the watermark) at that sample;
- time to OOM = headroom / growth;
- the serving engine's own process (see common.engine_kv_of), when its rows
  state the KV it holds and the capacity of its KV pool: the pool stops at
  that capacity and the engine evicts (kv_eviction_storm) instead of running
  the device out. When the device's headroom holds what the pool may still
  take, the KV is taken out of the held memory and that room out of the
  headroom, so only what grows outside the pool is forecast; a pool larger
  than the device's headroom is forecast as it is.

A finding when time to OOM is below TIME_TO_OOM_WARNING_S; critical below
TIME_TO_OOM_CRITICAL_S. The chain assembler puts a leak or fragmentation
finding on the same GPU in front of it.
"""

from __future__ import annotations

import numpy as np

from gpudiag.catalog import M
from gpudiag.findings import Evidence, Finding, Severity, alert_name
from gpudiag.frames import Window
from gpudiag.units import fmt_bytes, fmt_seconds

from .common import EngineKV, engine_kv, engine_kv_of, label_int, linear_trend, per_entity, still_per_entity, subset

KIND = "oom_forecast"

# Autocorrelated 1 s samples overstate a slope's confidence; five standard
# errors keeps allocator steps and load swings from reading as a trend.
TREND_T_STAT = 5.0
# The later thirds must keep rising at half the window's rate at least, and
# the last third at half the first third's: a step (warm-up, one burst that
# grew the pool) followed by a plateau has a positive slope over the window
# but no trend, and a pool filling up to its working set rises ever more
# slowly (its high-water mark grows by rarer and rarer peaks), where a leak
# keeps its pace. Halves were not enough: a window that ends a few minutes
# after the fill stopped still has its second half rising (seen on the
# contiguous-KV engine's first 15 minutes).
SUSTAINED_SHARE = 0.5
# Ten minutes: shorter, one burst of long requests looks like a trend.
MIN_TREND_SPAN_S = 600.0
# Four hours ahead leaves an on-call shift time to drain and restart the
# instance at a quiet moment (the field report's detector warned 2 h ahead).
TIME_TO_OOM_WARNING_S = 4 * 3600.0
# Half an hour: only enough time left to move traffic away.
TIME_TO_OOM_CRITICAL_S = 1800.0
FIX_NAMES = ("expandable-segments", "paged-kv")
# Held open for a whole window after its last confirmation, as memory_leak's findings and
# for the same reason: the rise it forecasts from is a trend that one window of a busy
# process may fail to confirm although it goes on.
HELD_FOR_A_WINDOW = True
NON_RELEASABLE = "non-releasable"  # the watermark's layer: allocated plus inactive split


def analyze(window: Window) -> list[Finding]:
    """A forecast per GPU process whose held memory grows towards the device's capacity."""
    proc = window.rows("process")
    gpu = window.rows("gpu")
    if proc.empty or not window.has("gpu", M.gpu_memory_total_bytes):
        return []
    reported = window.has("process", M.process_torch_reserved_bytes)
    driver = window.has("process", M.process_gpu_memory_bytes)
    if not (reported or driver):
        return []
    with_split = reported and window.has("process", M.process_torch_allocated_bytes) \
        and window.has("process", M.process_torch_inactive_split_bytes)
    findings = []
    eng = window.rows("engine") if window.has("engine", M.engine_kv_reserved_bytes) else None
    kvs: dict[tuple, EngineKV | None] = {}  # per GPU, read when one of its processes grows
    # Every series a process's held memory is taken from; when all of them hold one value, it has no trend.
    steady = still_per_entity(proc, ("node", "gpu", "pid"), _HELD_COLUMNS, whole_numbers=True)
    for g, (key, p) in enumerate(per_entity(proc, ["node", "gpu", "pid"])):
        if steady is not None and steady[g]:
            continue  # flat memory: rising_slope would find slope 0 (told for every process at once)
        t = p["t"].to_numpy(float)
        # Each process by its own view: the allocator's where its reporter runs, else the driver's
        # (a process without one shares the GPU with those that have it).
        layer_col, held = None, None
        if reported:
            layer_col, held = M.process_torch_reserved_bytes, p[M.process_torch_reserved_bytes].to_numpy(float)
            if np.isnan(held).all():
                layer_col = None
        if layer_col is None:
            if not driver:
                continue
            layer_col, held = M.process_gpu_memory_bytes, p[M.process_gpu_memory_bytes].to_numpy(float)
        split = with_split and layer_col == M.process_torch_reserved_bytes
        releasable = 0.0
        if split:
            reserved = held
            held = p[M.process_torch_allocated_bytes].to_numpy(float) + \
                p[M.process_torch_inactive_split_bytes].to_numpy(float)
            ok = ~np.isnan(held)
            releasable = max(float(reserved[ok][-1] - held[ok][-1]), 0.0) if ok.any() else 0.0
        if np.isnan(held).all():
            continue
        slope = rising_slope(t, held)
        if slope is None:
            continue
        headroom, capacity = device_headroom_bytes(gpu, proc, key)
        if headroom is None:
            continue
        headroom += releasable
        kv_room = None
        if eng is not None:
            gpu_key = (key.get("node"), key.get("gpu"))
            if gpu_key not in kvs:
                kvs[gpu_key] = engine_kv(subset(eng, key))
            kv = kvs[gpu_key]
            at = engine_kv_of(p, label_int(key.get("pid")), t, held, kv)
            room = max(kv.capacity - float(at[-1]), 0.0) if at is not None and kv.capacity is not None else None
            if room is not None and room <= headroom:
                # The engine's own KV pool: it stops at its capacity and evicts before the device runs out.
                # What else grows is judged, with the room the pool may still take out of the headroom.
                kv_room = room
                held = held - at
                slope = rising_slope(t, held)
                if slope is None:
                    continue
                headroom -= kv_room
        tto = time_to_oom_s(slope, headroom)
        if tto >= TIME_TO_OOM_WARNING_S:
            continue
        layer = NON_RELEASABLE if split else "reserved" if layer_col == M.process_torch_reserved_bytes else "driver"
        last = float(held[~np.isnan(held)][-1])
        findings.append(Finding(
            kind=KIND,
            severity=Severity.CRITICAL if tto < TIME_TO_OOM_CRITICAL_S else Severity.WARNING,
            start_s=float(t[0]), end_s=float(t[-1]), node=key.get("node"), gpu=label_int(key.get("gpu")),
            pid=label_int(key.get("pid")),
            summary=(f"{layer} memory of pid {label_int(key.get('pid'))}"
                     f"{' outside its KV pool' if kv_room is not None else ''} grows {fmt_bytes(slope)}/s with "
                     f"{fmt_bytes(headroom)} left on the GPU"
                     f"{f' (with {fmt_bytes(releasable)} of releasable cache)' if releasable else ''}: "
                     f"out of memory in about {fmt_seconds(tto)}"),
            evidence=[
                Evidence("time_to_oom_seconds", tto, None, TIME_TO_OOM_WARNING_S, "seconds"),
                Evidence("non_releasable_growth_bytes_per_second" if split else _growth_column(layer_col), slope,
                         0.0, None, "bytes_per_second"),
                Evidence("non_releasable_bytes" if split else layer_col, last, None, capacity, "bytes"),
                Evidence("gpu_memory_free_bytes", headroom - releasable, None, None, "bytes"),
                Evidence("releasable_cache_bytes", releasable, None, None, "bytes"),
            ],
            runbook=alert_name(KIND), fixes=list(FIX_NAMES),
            details={"time_to_oom_s": tto, "oom_at_s": float(t[-1]) + tto, "layer": layer,
                     "growth_bytes_per_second": slope, "headroom_bytes": headroom, "releasable_bytes": releasable,
                     "engine_kv_excluded": kv_room is not None, "engine_kv_room_bytes": kv_room},
        ))
    return findings


_HELD_COLUMNS = (M.process_torch_reserved_bytes, M.process_torch_allocated_bytes,
                 M.process_torch_inactive_split_bytes, M.process_gpu_memory_bytes)


def rising_slope(t: np.ndarray, y: np.ndarray) -> float | None:
    """The slope of ``y`` when it is a significant, sustained rise (see the module docstring), else None."""
    ok = ~np.isnan(y)
    if not ok.all():
        t, y = t[ok], y[ok]
    if t.size < 3 or t[-1] - t[0] < MIN_TREND_SPAN_S:
        return None
    slope, tstat = linear_trend(t, y)
    if slope <= 0 or tstat < TREND_T_STAT:
        return None
    # Thirds of the span: the samples are in time order, so each third is a slice.
    a, b = np.searchsorted(t, t[0] + (t[-1] - t[0]) * np.array([1 / 3, 2 / 3]), side="left").tolist()
    # Each third's trend only when the ones before it held: a rise that fails on one needs no more.
    for sel in (slice(a, b), slice(b, None)):
        third_slope, third_t = linear_trend(t[sel], y[sel])
        if third_slope < SUSTAINED_SHARE * slope or third_t < TREND_T_STAT:
            return None
    if third_slope < SUSTAINED_SHARE * linear_trend(t[:a], y[:a])[0]:
        return None
    return slope


def time_to_oom_s(growth_bytes_per_second: float, headroom_bytes: float) -> float:
    """Seconds until ``headroom_bytes`` are used up at a constant growth (inf when not growing)."""
    if growth_bytes_per_second <= 0:
        return float("inf")
    return max(headroom_bytes, 0.0) / growth_bytes_per_second


def device_headroom_bytes(gpu, proc, key) -> tuple[float | None, float | None]:
    """(free device bytes at the last sample, capacity) of the GPU of ``key``; (None, None) when unknown."""
    g = subset(gpu, key)
    if g.empty or M.gpu_memory_total_bytes not in g:
        return None, None
    g = g.sort_values("t")
    total = g[M.gpu_memory_total_bytes].dropna()
    if total.empty:
        return None, None
    capacity = float(total.iloc[-1])
    if M.gpu_memory_used_bytes in g and g[M.gpu_memory_used_bytes].notna().any():
        used = float(g[M.gpu_memory_used_bytes].dropna().iloc[-1])
        return capacity - used, capacity
    others = subset(proc, key)
    if M.process_gpu_memory_bytes not in others or others[M.process_gpu_memory_bytes].isna().all():
        return None, capacity
    last_t = others["t"].max()
    used = float(others[others["t"] == last_t][M.process_gpu_memory_bytes].fillna(0).sum())
    return capacity - used, capacity


def _growth_column(layer_col: str) -> str:
    return {M.process_torch_reserved_bytes: M.process_torch_reserved_growth_bytes_per_second,
            M.process_torch_allocated_bytes: M.process_torch_allocated_growth_bytes_per_second,
            }.get(layer_col, M.process_gpu_memory_growth_bytes_per_second)
