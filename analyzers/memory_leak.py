"""memory_leak: device memory of a process grows without the load growing, and which layer leaks.

The three colours (DESIGN.md), nested, per GPU and process over the window:
white = allocated (live tensors), grey = reserved (caching allocator),
black = driver-charged memory. Each layer and each gap between layers gets a
least-squares trend (oom_forecast.rising_slope: significant, sustained over
the window and rising in its second half too). The leaking layer is the
innermost one whose rule holds:

- ``allocated``: white rises while the load is flat — tensors are kept
  alive that nothing uses (a tensor leak);
- ``pool``: grey and grey - white rise while white is flat, and grey rises
  above the highest white so far — the caching allocator keeps segments no
  tensor needs (pool bloat, fragmentation). A cache that holds what an
  earlier peak of load needed (a high-water mark kept after the burst) is
  no leak;
- ``driver``: black and black - grey rise while grey is flat — memory allocated
  outside PyTorch and never freed (a missing cudaFree, a library's
  workspaces). Cross-checked with the eBPF probe's outstanding allocations
  of the process (``cuda_api`` rows, cuda_outstanding_allocation_bytes)
  when present: growth there at least CONFIRM_RATIO of the gap's growth
  confirms cudaMalloc without cudaFree.

Without an in-process reporter (no white and grey) black alone is judged:
black rising with flat load is a leak of layer ``unknown``, and the details
say which layers were missing. The load is the engine's running requests on
that GPU; it is flat when its least-squares change over the window is within
LOAD_CHANGE_RATIO of its mean, or when it wanders without a trend (a line in
time explains less than LOAD_TREND_R2 of its variance); with no engine rows
it is not observed, and the details say so. Memory that follows the load
(KV and activations of the running batch) is no leak even when the load is
flat: each series is judged after removing the part a regression on the
load explains (bytes per running request times the load's deviation from
its mean), so only growth at constant load counts. For the engine's own
process the tensor layer is judged without the engine's KV (its
engine_kv_reserved_bytes): KV follows the tokens held, which the running
count does not measure, and it is memory the engine accounts for.

Time to OOM: the device's free memory plus what the outer layers hold free
(for a tensor leak the pool's cached bytes fill first) over the leaking
layer's growth. A finding when the layer grew by at least MIN_LEAK_BYTES
and time to OOM is under LEAK_HORIZON_S, so a leak is reported hours
before it ends in an OOM.
"""

from __future__ import annotations

import numpy as np

from gpudiag.catalog import M
from gpudiag.findings import Evidence, Finding, Severity, alert_name
from gpudiag.frames import Rows, Window
from gpudiag.units import fmt_bytes, fmt_seconds

from .common import engine_kv, engine_kv_of, label_int, linear_trend, per_entity, still_per_entity, subset
from .oom_forecast import TIME_TO_OOM_CRITICAL_S, device_headroom_bytes, rising_slope, time_to_oom_s

KIND = "memory_leak"

ALLOCATED, POOL, DRIVER, UNKNOWN = "allocated", "pool", "driver", "unknown"

# The running batch may drift by a fifth between the start and the end of the
# window without being "more load": continuous batching varies that much.
LOAD_CHANGE_RATIO = 0.2
# A batch of ten-odd requests drifts by a third over fifteen minutes by chance
# alone (Poisson arrivals, log-normal lengths); that wandering is no trend when
# a line in time explains less than half of its variance, and the regression
# on the load below takes its share out of the memory. A load that really
# trends (a ramp) is collinear with time, and memory growth under it stays
# ambiguous: no finding.
LOAD_TREND_R2 = 0.5
# A layer is "flat" when its own slope is not a significant rise, or rises
# less than this share of the leaking gap's growth (a leak in an outer layer
# may drag a little of the inner one with it).
FLAT_SHARE = 0.1
# 256 MiB over the window: less is within the allocator's segment rounding
# and a library's lazy initialisation.
MIN_LEAK_BYTES = 256 * 1024**2
# A day: a leak that needs longer to exhaust the GPU is reported by the next
# windows; one inside a day gets its warning while hours remain.
LEAK_HORIZON_S = 24 * 3600.0
# eBPF outstanding allocations growing at half the driver gap's rate or more:
# the gap is mostly memory that was cudaMalloc'd and never freed.
CONFIRM_RATIO = 0.5
FIX_NAMES = ("no-leak",)
# A streaming finding stays open until a whole window has passed since an analysis last
# confirmed it. Within fifteen minutes a serving batch swings a process's memory by GiB
# (activations, realloc copies) where a leak adds a few hundred MiB, so only some windows
# confirm a leak that goes on all the time (the tensor-leak scenario's, SCENARIOS.md §6: two
# windows in 36); a window that cannot confirm the trend is no sign that it stopped.
HELD_FOR_A_WINDOW = True


def analyze(window: Window) -> list[Finding]:
    """Leaks per GPU process, with the leaking layer and the time left before OOM."""
    proc = window.rows("process")
    if proc.empty or not window.has("process", M.process_gpu_memory_bytes) and \
            not window.has("process", M.process_torch_allocated_bytes):
        return []
    gpu, eng, api = window.rows("gpu"), window.rows("engine"), window.rows("cuda_api")
    findings = []
    loads: dict[tuple, tuple] = {}  # per GPU: its engine's load, judged once for all its processes
    still = still_per_entity(proc, ("node", "gpu", "pid"), _LAYERS)
    for g, (key, p) in enumerate(per_entity(proc, ["node", "gpu", "pid"])):
        if still is not None and still[g]:
            continue  # memory that never moved (told for every process at once)
        t = p["t"].to_numpy(float)
        white, grey, black = (_col(p, c) for c in _LAYERS)
        if still is None and all(v is None or _constant(v) for v in (white, grey, black)):
            continue  # memory that never moved has no trend, with or without the load taken out
        gpu_key = (key.get("node"), key.get("gpu"))
        held = loads.get(gpu_key)
        if held is None:
            engine_rows = subset(eng, key)
            held = loads[gpu_key] = [_engine_load(engine_rows), None, None, engine_kv(engine_rows)]
        if held[1] is not None and held[1].shape == t.shape and np.array_equal(held[1], t):
            load_flat, load, running, fit = held[2]  # the processes of one GPU are sampled together
            load = dict(load)
        else:
            load_flat, load, running = _load_at(held[0], t)
            fit = _regressors(t, running) if running is not None and load_flat else None
            held[1], held[2] = t, (load_flat, load, running, fit)
        outside_kv = _outside_kv(p, label_int(key.get("pid")), t, white, held[3])
        verdict = _leaking_layer(t, white, grey, black, load_flat, running, fit, outside_kv)
        if verdict is None:
            continue
        layer, growth, leaked_col = verdict
        free, capacity = device_headroom_bytes(gpu, proc, key)
        if free is None:
            free = float("nan")
        headroom = free + _free_outside(layer, white, grey, black)
        tto = time_to_oom_s(growth, headroom) if not np.isnan(headroom) else float("nan")
        grown = growth * (t[-1] - t[0])
        if grown < MIN_LEAK_BYTES or (not np.isnan(tto) and tto >= LEAK_HORIZON_S):
            continue
        observed = [name for name, v in (("white", white), ("grey", grey), ("black", black)) if v is not None]
        details = {"layer": layer, "layers_observed": observed, "growth_bytes_per_second": growth,
                   "grown_bytes": grown, "time_to_oom_s": tto, "load": load,
                   "engine_kv_excluded": outside_kv is not None}
        if layer == UNKNOWN:
            details["note"] = ("no in-process reporter: judged with the driver layer (black) alone; white and "
                               "grey are needed to tell a tensor, pool or driver leak apart")
        evidence = [
            Evidence(leaked_col, growth, 0.0, None, "bytes_per_second"),
            Evidence("time_to_oom_seconds", tto, None, LEAK_HORIZON_S, "seconds"),
            Evidence("leaked_bytes", grown, None, MIN_LEAK_BYTES, "bytes"),
        ]
        if load.get("observed"):
            evidence.append(Evidence(M.num_requests_running, load["last"], load["first"], None, ""))
        if layer == DRIVER:
            evidence.append(_ebpf_cross_check(api, key, growth, details))
        findings.append(Finding(
            kind=KIND,
            severity=Severity.CRITICAL if not np.isnan(tto) and tto < TIME_TO_OOM_CRITICAL_S else Severity.WARNING,
            start_s=float(t[0]), end_s=float(t[-1]), node=key.get("node"), gpu=label_int(key.get("gpu")),
            pid=label_int(key.get("pid")),
            summary=(f"{_LAYER_WORDS[layer]} leak in pid {label_int(key.get('pid'))}: {fmt_bytes(grown)} in "
                     f"{fmt_seconds(t[-1] - t[0])} ({fmt_bytes(growth)}/s) with flat load; out of memory in "
                     f"about {fmt_seconds(tto)}"),
            evidence=evidence, runbook=alert_name(KIND), fixes=list(FIX_NAMES), details=details,
        ))
    return findings


_LAYER_WORDS = {ALLOCATED: "tensor (allocated)", POOL: "caching-allocator pool", DRIVER: "driver-layer",
                UNKNOWN: "device-memory"}


_LAYERS = (M.process_torch_allocated_bytes, M.process_torch_reserved_bytes, M.process_gpu_memory_bytes)


def _constant(v: np.ndarray) -> bool:
    finite = v[~np.isnan(v)]
    return not finite.size or finite.min() == finite.max()


def _col(p, column):
    if column not in p or p[column].isna().all():
        return None
    return p[column].to_numpy(float)


def _outside_kv(p, pid, t, white, kv) -> np.ndarray | None:
    """The engine process' allocated bytes less its KV (None for any other process, or KV not inside them).

    KV is the engine's working set: it grows with the tokens held, which the running count
    does not measure (a few long sequences hold as much as many short ones); a leak is
    memory the engine does not account for. Which process is the engine's: :func:`engine_kv_of`.
    """
    if white is None:
        return None
    at = engine_kv_of(p, pid, t, white, kv)
    return None if at is None else white - at


def _engine_load(e) -> tuple[bool, dict, np.ndarray | None, np.ndarray | None]:
    """(flat, load details, sample times, running batch) of one GPU's engine rows.

    (True, not observed, None, None) without engine rows. Flat judges the fitted line over the
    window (its change against the mean, the share of the variance it explains), not the means of
    two thirds: those of a batch of ten-odd requests differ by more than a fifth by chance alone.
    """
    got = _load_series(e)
    if got is None:
        return True, {"observed": False, "note": "engine load not observed: judged as flat"}, None, None
    te, v = got
    third = max(len(v) // 3, 1)
    first, last = float(v[:third].mean()), float(v[-third:].mean())
    slope, _ = linear_trend(te, v)
    change = slope * (te[-1] - te[0]) if te.size > 1 else 0.0
    var = float(v.var())
    r2 = slope * slope * float(te.var()) / var if var > 0 else 0.0
    flat = abs(change) <= LOAD_CHANGE_RATIO * max(float(v.mean()), 1.0) or r2 < LOAD_TREND_R2
    return flat, {"observed": True, "first": first, "last": last, "fitted_change": change,
                  "trend_r2": r2, "flat": flat}, te, v


def _load_series(e) -> tuple[np.ndarray, np.ndarray] | None:
    """(sample times, load) of the first load column an engine row states, rows without it left out."""
    for col in (M.num_requests_running, M.engine_batch_size):
        if col not in e:
            continue
        if isinstance(e, Rows) and e[col].values.dtype.kind in "fiub":
            # Numbers (NaN: missing) in rows kept in time order: the mask applied to the arrays.
            v = e[col].to_numpy(float)
            ok = ~np.isnan(v)
            if not ok.any():
                continue
            te = e["t"].to_numpy(float)
            return (te, v) if ok.all() else (te[ok], v[ok])
        if not e[col].notna().any():
            continue
        e = e[e[col].notna()].sort_values("t")
        return e["t"].to_numpy(float), e[col].to_numpy(float)
    return None


def _load_at(load, t) -> tuple[bool, dict, np.ndarray | None]:
    """(flat, details, running batch interpolated at ``t``) from :func:`_engine_load`."""
    flat, details, te, v = load
    running = np.interp(t, te, v) if te is not None and te.size else None
    return flat, dict(details), running


def _at_constant_load(t, y, running, fit):
    """``y`` less the part that follows the load: y - c * (running - mean), c from y ~ 1 + t + running.

    ``fit``: :func:`_regressors` of (t, running), shared by every series judged on them.
    """
    if y is None or running is None:
        return y
    ok = ~np.isnan(y)
    if ok.all():  # the usual case: the regressors of the GPU's clock, shared by its processes' layers
        r, mean, flat, tc, rc, stt, srr, str_ = fit
        yy = y
    else:
        r, mean, flat, tc, rc, stt, srr, str_ = _regressors(t[ok], running[ok])
        yy = y[ok]
    if r.size < 3 or flat:
        return y
    det = stt * srr - str_ * str_
    if det <= 1e-9 * stt * srr:  # load collinear with time: the least-norm answer of lstsq
        design = np.column_stack([np.ones(r.size), tc, rc])
        coef = np.linalg.lstsq(design, yy, rcond=None)[0][2]
    else:
        coef = (stt * float(rc @ yy) - str_ * float(tc @ yy)) / det
    return y - coef * (running - mean)


def _regressors(t, r):
    """(r, its mean, whether it is constant, t and r centred, their sums of squares and cross
    product): the load fit's 2x2 system."""
    if r.size < 3:
        return r, 0.0, True, None, None, 0.0, 0.0, 0.0
    # With both regressors centred the intercept drops out: a 2x2 system in (time, load).
    mean = r.mean()
    tc, rc = t - t.mean(), r - mean
    return r, mean, bool(np.ptp(r) == 0), tc, rc, float(tc @ tc), float(rc @ rc), float(tc @ rc)


def _leaking_layer(t, white, grey, black, load_flat, running, fit, white_outside_kv=None):
    """(layer, growth bytes/s, growth column) of the innermost leaking layer, or None.

    ``fit``: :func:`_regressors` of (t, running) (None without a load), shared by the processes
    sampled on one clock. ``white_outside_kv``: for the engine's own process, its allocated
    bytes less the engine's KV; the tensor layer is judged on that.
    """
    if not load_flat:
        return None
    white_c, grey_c, black_c = (_at_constant_load(t, y, running, fit) for y in (white, grey, black))
    if white is not None:
        tensors = white_c if white_outside_kv is None else _at_constant_load(t, white_outside_kv, running, fit)
        g = rising_slope(t, tensors)
        if g is not None:
            return ALLOCATED, g, M.process_torch_allocated_growth_bytes_per_second
    if white is not None and grey is not None:
        g = rising_slope(t, grey_c - white_c)
        if g is not None and rising_slope(t, grey_c) is not None and _flat(t, white_c, g) \
                and _above_peak(t, grey, white):
            return POOL, g, M.process_reserved_minus_allocated_bytes
    if grey is not None and black is not None:
        g = rising_slope(t, black_c - grey_c)
        if g is not None and rising_slope(t, black_c) is not None and _flat(t, grey_c, g):
            return DRIVER, g, M.process_driver_minus_reserved_bytes
    if white is None and grey is None and black is not None:
        g = rising_slope(t, black_c)
        if g is not None:
            return UNKNOWN, g, M.process_gpu_memory_growth_bytes_per_second
    return None


def _above_peak(t, grey, white) -> bool:
    """Reserved rises above the highest allocated so far (raw, not at constant load).

    The caching allocator keeps the segments a peak of load needed until the process
    ends; after a burst, reserved stays at that high-water mark while allocated falls
    back, and the load regression, which expects memory to fall with the load, reads
    the retained cache as growth. Growth of a leaking pool outruns every earlier peak.
    """
    return rising_slope(t, grey - np.fmax.accumulate(white)) is not None


def _flat(t, inner, outer_growth) -> bool:
    """The inner layer neither rises nor falls by FLAT_SHARE of the gap's growth (a falling white
    widens the gap to grey by itself: freed memory the allocator caches, not a leak)."""
    slope, _ = linear_trend(t, inner)
    return abs(slope) < FLAT_SHARE * outer_growth


def _free_outside(layer, white, grey, black) -> float:
    """Bytes the layers outside the leaking one hold free at the last sample (they fill before an OOM)."""
    def last(v):
        return float(v[~np.isnan(v)][-1]) if v is not None and (~np.isnan(v)).any() else 0.0
    if layer == ALLOCATED:
        return max(last(grey) - last(white), 0.0)
    return 0.0


def _ebpf_cross_check(api, key, growth, details) -> Evidence:
    """Evidence row from eBPF outstanding allocations of the process; the verdict goes into details."""
    rows = subset(api, key, ("node", "pid"))
    col = M.cuda_outstanding_allocation_bytes
    metric = "cuda_outstanding_allocation_growth_bytes_per_second"
    if rows.empty or col not in rows or rows[col].isna().all():
        details["ebpf"] = "not cross-checked: no eBPF outstanding allocations for this process"
        return Evidence(metric, None, None, None, "bytes_per_second")
    rows = rows[rows[col].notna()].sort_values("t")
    slope, _ = linear_trend(rows["t"].to_numpy(float), rows[col].to_numpy(float))
    confirmed = slope >= CONFIRM_RATIO * growth
    details["ebpf_outstanding_growth_bytes_per_second"] = slope
    details["ebpf"] = ("confirmed: device allocations made with cudaMalloc/cuMemAlloc are not freed"
                       if confirmed else
                       "not confirmed: outstanding cudaMalloc allocations do not grow; the growth is outside "
                       "cudaMalloc (context, library workspaces, virtual memory APIs)")
    return Evidence(metric, slope, None, CONFIRM_RATIO * growth, "bytes_per_second")
