"""``gpudiag repro``: run a scenario on the simulated GPU, diagnose it, and compare a fix.

The run's frames go through the same analyzers as live data. The document
(see docs/repro.md for the schema) holds the SLOs overall and per phase, the
totals, and the findings; with a fix, the fixed run's document carries the
unfixed run under ``baseline_run``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import pandas as pd

from gpudiag.analyzers.common import counter_increase
from gpudiag.analyzers.registry import run_all
from gpudiag.catalog import CONTEXT_BUCKETS, M, request_context_bucket
from gpudiag.findings import Finding, deep_clean
from gpudiag.frames import Window
from gpudiag.reference_engine.scenarios import Scenario
from gpudiag.reference_engine.sim.engine import SimEngine


@dataclass
class RunResult:
    """One scenario run: its window of frames, findings and the engine's final state."""

    scenario: Scenario
    fix: str | None
    seed: int
    window: Window
    findings: list[Finding]
    engine: SimEngine


def run(scenario: Scenario, fix: str | None, seed: int, *, overrides: Callable | None = None,
        progress: Callable[[float], None] | None = None) -> RunResult:
    """Run the scenario (with ``fix``) to its end on the simulated GPU and analyze it."""
    cfg, workload = scenario.build(fix)
    if overrides is not None:
        overrides(cfg, workload)
    engine = SimEngine(cfg, workload, seed=seed)
    rows: dict[str, list[dict[str, Any]]] = {}
    for fr in engine.frames(progress=progress):
        bucket = rows.setdefault(fr.kind, [])
        for r in fr.rows:
            r["t"] = fr.t
            bucket.append(r)
    window = Window.from_rows(rows, start_s=0.0, end_s=workload.duration_s, node=engine.node,
                              sources=["sim"])
    return RunResult(scenario, fix, seed, window, run_all(window), engine)


def slo(requests: pd.DataFrame) -> dict[str, float | None]:
    """TTFT, TPOT, e2e, queue and prefill time percentiles of a set of finished requests (seconds)."""
    def p(col, q):
        if requests.empty or col not in requests:
            return None
        v = requests[col].to_numpy(float)
        return float(np.percentile(v, q)) if v.size else None

    return {
        "ttft_p50_s": p(M.time_to_first_token_seconds, 50),
        "ttft_p99_s": p(M.time_to_first_token_seconds, 99),
        "tpot_p50_s": p(M.inter_token_latency_seconds, 50),
        "tpot_p99_s": p(M.inter_token_latency_seconds, 99),
        "tpot_p999_s": p(M.inter_token_latency_seconds, 99.9),
        "e2e_p99_s": p(M.e2e_request_latency_seconds, 99),
        # TTFT = queue time + prefill time: which of the two grew says whether requests waited
        # for room (memory, batch slots) or their prefill itself got slower.
        "queue_p99_s": p(M.request_queue_time_seconds, 99),
        "prefill_p99_s": p(M.request_prefill_time_seconds, 99),
    }


# A context bucket's percentiles are reported when at least this many of a phase's requests
# fell in it: with fewer, a P99 is the value of one or two requests.
MIN_BUCKET_REQUESTS = 100


def by_context(requests: pd.DataFrame) -> dict[str, dict[str, Any]]:
    """Per ``context_bucket`` (prompt + output tokens) with requests: their count and latency percentiles.

    The field's storm is in the decode of long sequences only; over all requests the short
    ones, many more, hide it. Percentiles are None in a bucket of fewer than MIN_BUCKET_REQUESTS.
    """
    keys = [c for c in ("context_bucket", "prompt_tokens", "output_tokens") if c in requests]
    if requests.empty or not keys:
        return {}
    rows = requests[keys].to_dict("records")
    buckets = np.array([request_context_bucket(r) or "" for r in rows], dtype=object)
    out = {}
    for b in CONTEXT_BUCKETS:
        sel = buckets == b
        n = int(sel.sum())
        if not n:
            continue
        got = slo(requests[sel]) if n >= MIN_BUCKET_REQUESTS else {}
        out[b] = {"requests": n, **{k: got.get(k) for k in ("ttft_p50_s", "tpot_p50_s", "tpot_p99_s")}}
    return out


# A phase after the first has recovered once the TTFT and TPOT P99 of the requests arriving in
# every five minutes (a window sliding a minute at a time) stay within half again of a typical
# calm window's (the median over the first phase's windows). Five minutes hold thousands of
# requests at the field's load, whose P99 (the thirtieth slowest of 3000) moves little; a single
# minute's P99 (the sixth slowest of 600) passed half again of the median in calm minutes. The
# paged-kv check uses the same margin.
RECOVERY_RATIO = 1.5
RECOVERY_WINDOW_S = 300.0
RECOVERY_STEP_S = 60.0
_RECOVERY_COLUMNS = (M.time_to_first_token_seconds, M.inter_token_latency_seconds)


def window_p99s(requests: pd.DataFrame, start: float, end: float) -> list[tuple[float, list[float]]]:
    """(window start, [TTFT P99, TPOT P99]) of the RECOVERY_WINDOW_S windows inside [start, end), one
    each RECOVERY_STEP_S, of MIN_BUCKET_REQUESTS arrivals or more (requests by arrival time); [] without
    the columns."""
    if requests.empty or any(c not in requests for c in _RECOVERY_COLUMNS):
        return []
    arrival = requests["arrival_s"].to_numpy(float)
    values = [requests[c].to_numpy(float) for c in _RECOVERY_COLUMNS]
    out = []
    for a in np.arange(start, max(end - RECOVERY_WINDOW_S, start) + 1e-9, RECOVERY_STEP_S):
        sel = (arrival >= a) & (arrival < min(a + RECOVERY_WINDOW_S, end))
        if np.count_nonzero(sel) >= MIN_BUCKET_REQUESTS:
            out.append((float(a), [float(np.percentile(v[sel], 99)) for v in values]))
    return out


def recovered_after_s(windows: list[tuple[float, list[float]]], start: float, end: float,
                      calm: list[tuple[float, list[float]]]) -> float | None:
    """Seconds from ``start`` after which every window of the phase (:func:`window_p99s`) holds its TTFT
    and TPOT P99 within RECOVERY_RATIO of the median ``calm`` window's; 0 when it never left them.

    None when it does not get back within the phase, or nothing can be judged (no calm window,
    no window of the phase).
    """
    if not calm or not windows:
        return None
    limits = [RECOVERY_RATIO * float(np.median([w[1][i] for w in calm])) for i in range(len(_RECOVERY_COLUMNS))]
    bad = [a for a, p99 in windows if any(v > lim for v, lim in zip(p99, limits))]
    if not bad:
        return 0.0
    if bad[-1] == windows[-1][0]:
        return None
    return float(bad[-1] + RECOVERY_STEP_S - start)


def _delta(df: pd.DataFrame, col: str) -> int:
    if df.empty or col not in df:
        return 0
    return int(counter_increase(df[col].to_numpy(float)))


def phases_run(res: RunResult) -> tuple[list[tuple[str, float, float]], list[tuple[str, float, float]]]:
    """The scenario's phases as this run covered them: (run, not reached).

    A run shortened with --duration ends inside a phase (which is cut at the run's end) or before
    one starts: a phase that never ran has no figures to show.
    """
    end_s = res.window.end_s
    ran = [(name, start, min(end, end_s)) for name, start, end in res.scenario.phases if start < end_s]
    missed = [(name, start, end) for name, start, end in res.scenario.phases if start >= end_s]
    return ran, missed


def phase_stats(res: RunResult) -> list[dict[str, Any]]:
    """Per phase the run reached: SLOs of requests that arrived in it, GPU utilization, evictions,
    failures, memory, CPU."""
    w = res.window
    gpu, eng, proc, req = w.table("gpu"), w.table("engine"), w.table("process"), w.table("request")
    out: list[dict[str, Any]] = []
    prev_eng = None
    calm: list[tuple[float, list[float]]] | None = None  # the first phase's windows, what later ones recover to
    for name, start, end in phases_run(res)[0]:
        g = gpu[(gpu["t"] > start) & (gpu["t"] <= end)]
        e = eng[(eng["t"] > start) & (eng["t"] <= end)]
        pr = proc[(proc["t"] > start) & (proc["t"] <= end)]
        r = req[(req["arrival_s"] >= start) & (req["arrival_s"] < end)] if not req.empty else req
        # Counters: the increase within the phase includes the step from the last sample before it.
        e_span = pd.concat([prev_eng, e]) if prev_eng is not None else e
        util = g[M.gpu_utilization_ratio].to_numpy(float) if not g.empty else np.array([])
        reserved = pr[M.process_torch_reserved_bytes].to_numpy(float) if not pr.empty else np.array([])
        tt = pr["t"].to_numpy(float) if not pr.empty else np.array([])
        slope = float(np.polyfit(tt, reserved, 1)[0]) if reserved.size > 2 else 0.0
        cpu = pr[M.process_cpu_utilization_ratio].to_numpy(float) if not pr.empty else np.array([])
        arrived = _delta(e_span, M.engine_requests_arrived_total)
        windows = window_p99s(r, start, end)
        out.append({
            "name": name, "start_s": start, "end_s": end,
            "slo": slo(r),
            "by_context": by_context(r),
            "qps": arrived / (end - start) if end > start else 0.0,
            "gpu_util_mean": float(util.mean()) if util.size else None,
            "gpu_util_min": float(util.min()) if util.size else None,
            "gpu_util_max": float(util.max()) if util.size else None,
            "gpu_util_p5": float(np.percentile(util, 5)) if util.size else None,
            "gpu_util_p95": float(np.percentile(util, 95)) if util.size else None,
            "evictions": _delta(e_span, M.engine_kv_evictions_total),
            "alloc_failures": _delta(e_span, M.engine_kv_alloc_failures_total),
            "reserved_mean_bytes": float(reserved.mean()) if reserved.size else None,
            "reserved_slope_bytes_per_s": slope,
            "host_cpu_mean": float(cpu.mean()) if cpu.size else None,
            "host_cpu_max": float(cpu.max()) if cpu.size else None,
            "requests": int(len(r)),
            "recovered_after_s": recovered_after_s(windows, start, end, calm) if calm is not None else None,
        })
        if not e.empty:
            prev_eng = e.iloc[[-1]]
        if calm is None:
            calm = windows
    return out


def document(res: RunResult) -> dict[str, Any]:
    """The JSON document of one run (schema in docs/repro.md)."""
    w = res.window
    eng, proc, req = w.table("engine"), w.table("process"), w.table("request")
    last_e = eng.iloc[-1] if not eng.empty else {}
    last_p = proc.iloc[-1] if not proc.empty else {}

    def last(row, col):
        try:
            return int(row[col])
        except (KeyError, TypeError, ValueError):
            return 0

    doc = {
        "scenario": res.scenario.name,
        "fix": res.fix,
        "seed": res.seed,
        "duration_s": w.end_s,
        "slo": slo(req),
        "phases": phase_stats(res),
        "phases_not_reached": [{"name": name, "start_s": start, "end_s": end}
                               for name, start, end in phases_run(res)[1]],
        "totals": {
            "requests": int(len(req)),
            "unfinished": res.engine.unfinished(),
            "evictions": last(last_e, M.engine_kv_evictions_total),
            "recomputed_tokens": last(last_e, M.engine_recomputed_tokens_total),
            "alloc_failures": last(last_e, M.engine_kv_alloc_failures_total),
            "num_alloc_retries": last(last_p, M.process_torch_alloc_retries_total),
            "num_ooms": last(last_p, M.process_torch_ooms_total),
            # The serving front end and the prefix cache (0 where the scenario has none).
            "rejected_429": last(last_e, M.engine_requests_rejected_total),
            "timed_out": last(last_e, M.engine_requests_timed_out_total),
            "restarts": last(last_e, M.engine_restarts_total),
            "prefix_cache_queried_tokens": last(last_e, M.prefix_cache_queries_total),
            "prefix_cache_hit_tokens": last(last_e, M.prefix_cache_hits_total),
        },
        "findings": [f.to_dict() for f in res.findings],
    }
    return deep_clean(doc)

