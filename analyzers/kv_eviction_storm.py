"""kv_eviction_storm: the engine keeps evicting KV and recomputing it, and decode latency pays.

Definitions (per GPU, over 1 s engine samples and finished requests):
- eviction rate: increase of the eviction counter (gpudiag's
  engine_kv_evictions_total, or vLLM's num_preemptions_total) per second
  over the trailing RATE_WINDOW_S;
- recomputed-token share: tokens prefilled again after an eviction divided
  by all prefilled tokens, over the episode;
- utilization oscillation: the standard deviation of the 1 s GPU
  utilization samples over the trailing RATE_WINDOW_S (a steady engine
  keeps it within a few points; a storm alternates stalls and recompute
  bursts), compared with its median over the rest of the window;
- TPOT P99: the 99th percentile of per-request time per output token
  ((e2e - TTFT) / (output tokens - 1)) of requests that finished during the
  episode, against the same percentile of requests that finished outside
  any episode (the run's own baseline). On vLLM's metrics alone (no request
  rows) each scrape interval stands for its requests: the P99 of the
  interval's inter_token_latency_seconds histogram (the engine probe's
  ``window`` summary) takes the place of a request's TPOT;
- KV usage: vLLM's kv_cache_usage_perc, highest in the episode (evidence).

A storm is an episode of eviction rate >= EVICTION_RATE_THRESHOLD lasting at
least MIN_DURATION_S, with decode latency (TPOT P99) or recompute share
above their thresholds. The chain assembler links it to the fragmentation
finding that precedes it on the same GPU. When tokens filled at least
DEMAND_FILL_RATIO of the KV capacity (engine_kv_used_bytes over
engine_kv_capacity_bytes) and the engine reports no prefix-cache lookups,
the pool ran out of room rather than into holes, and the suggested fixes
start with prefix caching.
"""

from __future__ import annotations

import numpy as np

from gpudiag.catalog import M
from gpudiag.findings import Evidence, Finding, Severity, alert_name
from gpudiag.frames import Rows, Table, Window

from .common import by_time, constant_per_entity, episodes, per_entity, rolling_std, tail_percentile, windowed_rate

KIND = "kv_eviction_storm"

RATE_WINDOW_S = 60.0
# Three evictions a minute, sustained: an occasional preemption under a burst
# is normal continuous batching; this many means the KV pool is thrashing.
EVICTION_RATE_THRESHOLD = 3.0 / 60.0
# A storm lasts minutes; a single burst of preemptions resolves in seconds.
MIN_DURATION_S = 60.0
# Episodes closer than this are one storm (it flickers as the mix changes).
MERGE_GAP_S = 300.0
# Decode latency must visibly suffer: TPOT P99 half again over its baseline...
TPOT_P99_RATIO_THRESHOLD = 1.5
# ...or a twentieth of prefill work must be recomputation.
RECOMPUTE_SHARE_THRESHOLD = 0.05
# Three times the baseline TPOT P99 is where SLOs of interactive serving break.
CRITICAL_TPOT_RATIO = 3.0
FIXES = ["paged-kv", "chunked-kv", "priority-eviction", "memory-aware-batching"]
# Tokens filled nine tenths of the KV capacity: the pool ran out of room for tokens, not
# into holes (a fragmented pool fails with far less stored). Demand itself must shrink:
# prefix caching, where the engine does not share prompt prefixes yet.
DEMAND_FILL_RATIO = 0.9
DEMAND_FIXES = ["prefix-caching"]


def analyze(window: Window) -> list[Finding]:
    """Eviction storms per GPU (engine), with their evidence."""
    eng = window.rows("engine")
    if eng.empty:
        return []
    evict_col = M.engine_kv_evictions_total if window.has("engine", M.engine_kv_evictions_total) \
        else M.num_preemptions_total
    if not window.has("engine", evict_col):
        return []
    gpu_df = window.rows("gpu")
    req = window.rows("request")
    findings = []
    for key, e in per_entity(eng, ["node", "gpu"]):
        t = e["t"].to_numpy(float)
        ev = e[evict_col].to_numpy(float)
        rate = windowed_rate(t, ev, RATE_WINDOW_S)
        spans = episodes(t, rate >= EVICTION_RATE_THRESHOLD, MERGE_GAP_S, MIN_DURATION_S)
        if not spans:
            continue
        reqs = _subset(req, key)
        if _tpot_col(reqs) is None:
            reqs = _interval_tpot(e)
        tpots = _tpot_series(reqs)
        base_tpot = _tpot_outside(tpots, spans)
        osc_t = osc = None  # evidence only: read once a span of this GPU makes a finding
        for start, end in spans:
            # Rates look back RATE_WINDOW_S: the storm began up to a window before it was detected.
            start = max(float(t[0]), start - RATE_WINDOW_S)
            sel = (t >= start) & (t <= end)
            n_ev = float(ev[sel].max() - ev[sel].min()) if sel.any() else 0.0
            share = _recompute_share(e, sel)
            tpot = _tpot_in(tpots, start, end)
            ratio = tpot / base_tpot if base_tpot and base_tpot > 0 and not np.isnan(tpot) else float("nan")
            if not ((not np.isnan(ratio) and ratio >= TPOT_P99_RATIO_THRESHOLD) or share >= RECOMPUTE_SHARE_THRESHOLD):
                continue
            if osc is None:
                osc_t, osc = _oscillation(_subset(gpu_df, key))
            osc_in, osc_base = _osc_in(osc_t, osc, start, end)
            severity = Severity.CRITICAL if (not np.isnan(ratio) and ratio >= CRITICAL_TPOT_RATIO) else Severity.WARNING
            minutes = (end - start) / 60.0
            findings.append(Finding(
                kind=KIND, severity=severity, start_s=start, end_s=float(end), node=key.get("node"),
                gpu=None if key.get("gpu") is None else int(key["gpu"]),
                summary=(f"KV eviction storm for {minutes:.0f} min: {n_ev:.0f} evictions "
                         f"({n_ev / max(minutes, 1e-9):.1f}/min), {share:.0%} of prefill recomputed, "
                         f"TPOT P99 {_ms(tpot)} vs {_ms(base_tpot)} baseline"),
                evidence=[
                    Evidence("kv_evictions_per_second", float(rate[sel].max()), 0.0, EVICTION_RATE_THRESHOLD, ""),
                    Evidence("recomputed_token_share", share, 0.0, RECOMPUTE_SHARE_THRESHOLD, "ratio"),
                    Evidence("tpot_p99_seconds", tpot, base_tpot, (base_tpot or 0) * TPOT_P99_RATIO_THRESHOLD
                             if base_tpot else None, "seconds"),
                    Evidence("gpu_utilization_oscillation_ratio", osc_in, osc_base, None, "ratio"),
                    Evidence(M.kv_cache_usage_perc, _max(e, M.kv_cache_usage_perc, sel), None, None, "ratio"),
                ],
                runbook=alert_name(KIND), fixes=_fixes(e, sel),
                details={"evictions": n_ev, "tpot_p99_ratio": ratio, "kv_token_fill_ratio": _fill(e, sel)},
            ))
    return findings


def may_find(window: Window) -> bool:
    """False only when :func:`analyze` is sure to find nothing in ``window``: no engine's eviction counter moved.

    A counter that holds one value per GPU (missing samples aside) has no increase, so no
    eviction rate above zero; the agent's streaming analysis skips the analyzer then.
    """
    if window.rows("engine").empty:
        return False
    evict_col = M.engine_kv_evictions_total if window.has("engine", M.engine_kv_evictions_total) \
        else M.num_preemptions_total
    if not window.has("engine", evict_col):
        return False
    return not constant_per_entity(window, "engine", ("node", "gpu"), evict_col)


def _fill(e, sel):
    """Largest share of the KV capacity holding tokens in the episode; None when not observed."""
    if M.engine_kv_used_bytes not in e or M.engine_kv_capacity_bytes not in e:
        return None
    used = e[M.engine_kv_used_bytes].to_numpy(float)[sel]
    cap = e[M.engine_kv_capacity_bytes].to_numpy(float)[sel]
    ok = (cap > 0) & np.isfinite(used)
    return float((used[ok] / cap[ok]).max()) if ok.any() else None


def _fixes(e, sel) -> list[str]:
    fill = _fill(e, sel)
    shares_prefixes = M.prefix_cache_queries_total in e and bool(
        np.nanmax(e[M.prefix_cache_queries_total].to_numpy(float), initial=0.0) > 0)
    if fill is not None and fill >= DEMAND_FILL_RATIO and not shares_prefixes:
        return DEMAND_FIXES + FIXES
    return list(FIXES)


def _subset(df, key):
    if df.empty:
        return df
    want = {col: key[col] for col in ("node", "gpu") if col in df and key.get(col) is not None}
    if isinstance(df, Rows):
        # The same rows as the masks below, from the entity groups the window keeps (a request
        # table of a busy node is ~70,000 rows, compared twice per GPU otherwise).
        return df.matching(want) if want else df
    for col, value in want.items():
        df = df[df[col] == value]
    return df


def _interval_tpot(e):
    """Rows (t, TPOT) from the engine rows' per-interval TPOT histogram P99 (vLLM's metrics)."""
    if M.inter_token_latency_seconds not in e:
        return e.iloc[:0]
    t, v = [], []
    for ti, s in zip(e["t"].tolist(), e[M.inter_token_latency_seconds].tolist()):
        win = s.get("window") if isinstance(s, dict) else None
        if win and win.get("count") and win.get("p99") is not None:
            t.append(ti)
            v.append(win["p99"])
    return Rows(Table(len(t), {"t": np.array(t, float), M.inter_token_latency_seconds: np.array(v, float)}))


def _max(e, col, sel):
    if col not in e:
        return None
    v = e[col].to_numpy(float)[sel]
    return float(np.nanmax(v)) if np.isfinite(v).any() else None


def _tpot_col(reqs):
    return M.inter_token_latency_seconds if M.inter_token_latency_seconds in reqs else None


def _tpot_series(reqs) -> tuple[np.ndarray, np.ndarray] | None:
    """(t, TPOT) of the requests (or intervals) sorted by time; None without a TPOT column."""
    col = _tpot_col(reqs)
    if col is None or reqs.empty:
        return None
    return by_time(reqs["t"].to_numpy(float), reqs[col].to_numpy(float))


def _tpot_in(series, start, end) -> float:
    """TPOT P99 of the requests that finished in [start, end]."""
    if series is None:
        return float("nan")
    t, v = series
    return tail_percentile(v[np.searchsorted(t, start, side="left"):np.searchsorted(t, end, side="right")], 99)


def _tpot_outside(series, spans) -> float | None:
    """TPOT P99 of the requests away from every span (and the rate window before it): the baseline."""
    if series is None:
        return None
    t, v = series
    inside = np.zeros(len(t), dtype=bool)
    for a, b in spans:
        inside[np.searchsorted(t, a - RATE_WINDOW_S, side="left"):
               np.searchsorted(t, b + MERGE_GAP_S, side="right")] = True
    got = tail_percentile(v[~inside], 99)
    return None if np.isnan(got) else got


def _recompute_share(e, sel) -> float:
    if M.engine_recomputed_tokens_total not in e or M.prompt_tokens_total not in e:
        return 0.0
    rc = e[M.engine_recomputed_tokens_total].to_numpy(float)[sel]
    pt = e[M.prompt_tokens_total].to_numpy(float)[sel]
    d_pt = pt.max() - pt.min() if pt.size else 0.0
    return float((rc.max() - rc.min()) / d_pt) if d_pt > 0 else 0.0


def _oscillation(gpus):
    if gpus.empty or M.gpu_utilization_ratio not in gpus:
        return np.array([]), np.array([])
    g = gpus.sort_values("t")
    t = g["t"].to_numpy(float)
    return t, rolling_std(t, g[M.gpu_utilization_ratio].to_numpy(float), RATE_WINDOW_S)


def _osc_in(t, osc, start, end):
    if t.size == 0:
        return None, None
    sel = (t >= start) & (t <= end)
    inside = float(np.percentile(osc[sel], 90)) if sel.any() else None
    base = float(np.median(osc[~sel])) if (~sel).any() else None
    return inside, base


def _ms(v) -> str:
    return "n/a" if v is None or np.isnan(v) else f"{v * 1e3:.0f} ms"
