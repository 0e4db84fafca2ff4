"""memory_fragmentation: the caching allocator holds free memory it cannot hand out.

Definitions (per GPU and process, per 1 s sample):
- free reserved = reserved - allocated (grey minus white);
- external fragmentation = 1 - largest free block / free reserved: 0 when
  all free reserved memory is one block, towards 1 when it is scattered in
  holes (PyTorch's memory_summary shows the same through its segment map);
- a failure with free memory: an allocation of S bytes failed (engine KV
  allocation failure, allocator OOM or retry) while free reserved >= S but
  the largest free block < S: no hole fits although enough is free.

A finding covers the seconds with such failures (merged when closer than
MERGE_GAP_S) while external fragmentation is at least the threshold. Its
summary and evidence tell one moment of it: the failure that missed by the
most (failed size minus the largest hole).

Without a failed allocation there is no finding, and without the failed
request's size (engine_kv_failed_request_bytes) a failure cannot be told from
a lack of memory: allocator OOMs alone make none. An engine that pages its KV
(vLLM, and those speaking its dialect) reports no such size: its KV is
fixed-size blocks of one pool allocated at start, nothing waits for a
contiguous hole, and its evictions are demand over capacity
(kv_eviction_storm says so).
"""

from __future__ import annotations

import numpy as np

from gpudiag.catalog import M
from gpudiag.findings import Evidence, Finding, Severity, alert_name
from gpudiag.frames import Window

from .common import episodes, only_zeros, per_entity

KIND = "memory_fragmentation"

# Half of the free reserved memory unusable for the largest request is where
# PyTorch's own guidance (max_split_size_mb, expandable_segments) starts to
# matter; below it a retry usually finds room.
FRAGMENTATION_RATIO_THRESHOLD = 0.5
# Failures closer than this belong to one episode: a fragmented pool does not
# heal in a couple of minutes unless the load changes.
MERGE_GAP_S = 300.0
# Ten failures with free memory in one episode is an incident, not a blip.
CRITICAL_FAILURES = 10
FIXES = ["paged-kv", "chunked-kv"]


def analyze(window: Window) -> list[Finding]:
    """Episodes of allocation failures caused by fragmentation, per GPU and process."""
    proc = window.rows("process")
    if proc.empty or not window.has("process", M.process_torch_reserved_bytes):
        return []
    eng = window.rows("engine")
    engine_series: dict = {}  # per (node, gpu): the engine's failure series, shared by its processes
    findings: list[Finding] = []
    for key, p in per_entity(proc, ["node", "gpu", "pid"]):
        if M.process_torch_largest_free_block_bytes not in p:
            continue
        t = p["t"].to_numpy(float)
        failed_bytes, failures = _failures(p, eng, key, t, engine_series)
        if not (failures > 0).any():
            continue  # nothing failed: no finding, and no need to read the memory columns
        reserved = p[M.process_torch_reserved_bytes].to_numpy(float)
        if np.isnan(reserved).all():
            continue
        allocated = p[M.process_torch_allocated_bytes].to_numpy(float)
        largest = p[M.process_torch_largest_free_block_bytes].to_numpy(float)
        free = np.maximum(reserved - allocated, 0.0)
        frag = np.where(free > 0, 1.0 - largest / np.maximum(free, 1.0), 0.0)
        with_free = (failures > 0) & (failed_bytes > largest) & (free >= failed_bytes)
        mask = with_free & (frag >= FRAGMENTATION_RATIO_THRESHOLD)
        for start, end in episodes(t, mask, MERGE_GAP_S):
            sel = (t >= start) & (t <= end)
            n_fail = int(failures[sel & with_free].sum())
            # The moment the summary and every evidence row tell: the failure that missed by the most,
            # among those of the episode (with free memory, fragmented past the threshold).
            i_worst = int(np.argmax(np.where(sel & mask, failed_bytes - largest, -np.inf)))
            retries = _delta(p, M.process_torch_alloc_retries_total, sel)
            findings.append(Finding(
                kind=KIND,
                severity=Severity.CRITICAL if n_fail >= CRITICAL_FAILURES else Severity.WARNING,
                start_s=float(start), end_s=float(end), node=key.get("node"), gpu=_int(key.get("gpu")),
                pid=_int(key.get("pid")),
                summary=(f"{n_fail} allocation failures with free memory: a {_gib(failed_bytes[i_worst])} request "
                         f"found at most a {_gib(largest[i_worst])} hole while {_gib(free[i_worst])} was free "
                         f"in reserved segments (external fragmentation {frag[i_worst]:.0%})"),
                evidence=[
                    Evidence(M.process_torch_external_fragmentation_ratio, float(frag[i_worst]), None,
                             FRAGMENTATION_RATIO_THRESHOLD, "ratio"),
                    Evidence(M.engine_kv_failed_request_bytes, float(failed_bytes[i_worst]), None,
                             float(largest[i_worst]), "bytes"),
                    Evidence(M.process_torch_largest_free_block_bytes, float(largest[i_worst]), None, None, "bytes"),
                    Evidence(M.process_reserved_minus_allocated_bytes, float(free[i_worst]), None, None, "bytes"),
                    Evidence(M.engine_kv_alloc_failures_total, float(n_fail), 0.0, 0.0, ""),
                    Evidence(M.process_torch_alloc_retries_total, float(retries), 0.0, None, ""),
                ],
                runbook=alert_name(KIND), fixes=list(FIXES),
                details={"failures_with_free_memory": n_fail},
            ))
    return findings


def may_find(window: Window) -> bool:
    """False only when :func:`analyze` is sure to find nothing in ``window``: no allocation failure shows in it.

    A failure is a sample whose failure counter (the engine's, else the allocator's OOMs)
    is above the sample before it (the first counts from 0), so counters that hold 0 or
    nothing throughout rule every finding out. The agent's streaming analysis skips the
    analyzer then; a healthy node's counters stay at 0.
    """
    if window.rows("process").empty or not window.has("process", M.process_torch_reserved_bytes) \
            or not window.has("process", M.process_torch_largest_free_block_bytes):
        return False
    eng = window.rows("engine")
    if M.engine_kv_failed_request_bytes in eng and M.engine_kv_alloc_failures_total not in eng:
        return True  # analyze reads the engine's failures as it finds them
    return not (only_zeros(window, "engine", M.engine_kv_alloc_failures_total)
                and only_zeros(window, "process", M.process_torch_ooms_total))


def _failures(p, eng, key, t, engine_series: dict):
    """Per-sample failed request size and failure count, from the engine (or the allocator's OOMs)."""
    failed = np.zeros(len(t))
    count = np.zeros(len(t))
    series = _engine_failures(eng, key, engine_series)
    if series is not None:
        et, fb, fc = series
        if len(et) == len(t) and np.array_equal(et, t):  # sampled on the same ticks (one source, or a store's day)
            return fb.copy(), np.maximum(fc, 0)
        idx = np.searchsorted(et, t)
        ok = (idx < len(et)) & (et[np.minimum(idx, len(et) - 1)] == t)
        failed[ok] = fb[idx[ok]]
        count[ok] = np.maximum(fc[idx[ok]], 0)
        return failed, count
    if M.process_torch_ooms_total in p:
        count = np.maximum(np.diff(p[M.process_torch_ooms_total].to_numpy(float), prepend=0.0), 0)
    return failed, count


def _engine_failures(eng, key, cache: dict):
    """(t, failed request bytes, failures per sample) of the engine on the process's GPU, sorted by t; None without one.

    Computed once per (node, gpu) and kept in ``cache``: every process on a GPU reads the same engine rows.
    """
    where = (key.get("node"), key.get("gpu"))
    if where in cache:
        return cache[where]
    got = None
    if not eng.empty and M.engine_kv_failed_request_bytes in eng:
        e = eng
        for col in ("node", "gpu"):
            if col in e and key.get(col) is not None:
                e = e[e[col] == key[col]]
        if not e.empty:
            e = e.sort_values("t")
            got = (e["t"].to_numpy(float), e[M.engine_kv_failed_request_bytes].to_numpy(float),
                   np.diff(e[M.engine_kv_alloc_failures_total].to_numpy(float), prepend=0.0))
    cache[where] = got
    return got


def _delta(df, col, sel) -> float:
    if col not in df:
        return 0.0
    v = df[col].to_numpy(float)[sel]
    return float(v.max() - v.min()) if v.size else 0.0


def _int(v):
    return None if v is None or (isinstance(v, float) and np.isnan(v)) else int(v)


def _gib(n: float) -> str:
    return f"{n / 1024**3:.2f} GiB"
