"""prefix_cache_thrash: the prefix cache evicts KV that requests come back for, and they recompute it.

Definitions (per GPU, over 1 s engine samples):
- refetch share: prompt tokens prefilled again because the prefix cache had
  held their KV and evicted it (gpudiag's
  engine_prefix_cache_recomputed_tokens_total) over prompt tokens looked up
  in the cache (vLLM's prefix_cache_queries_total), over the trailing
  RATE_WINDOW_S. Unlike the hit ratio it does not fall when traffic is
  simply new (one-off prompts miss without anything being wrong): it counts
  only what the cache had and threw away too early;
- hit ratio: prefix_cache_hits_total over prefix_cache_queries_total in the
  episode and outside it (evidence; the golden-signal alert watches it);
- cache evictions: increase of engine_prefix_cache_evictions_total per second
  in the episode (evidence);
- what requests pay: TTFT P99 and TPOT jitter (P99 minus P50 of per-request
  time per output token) of requests that finished in the episode, against
  requests that finished outside it (evidence: a recompute is a long prefill
  that stalls every decode in the batch).

Thrash is an episode of refetch share >= REFETCH_SHARE_THRESHOLD lasting at
least MIN_DURATION_S (episodes within MERGE_GAP_S merged). Critical at
CRITICAL_REFETCH_SHARE. Preemptions of running requests are a different
failure (kv_eviction_storm); this one evicts only blocks nobody was using, so
the fix is which of them goes first, or a larger cache.
"""

from __future__ import annotations

import numpy as np

from gpudiag.catalog import M
from gpudiag.findings import Evidence, Finding, Severity, alert_name
from gpudiag.frames import Window

from .common import (
    counter_increase,
    episodes,
    held_counter,
    label_int,
    per_entity,
    percentile,
    subset,
    windowed_increase,
)

KIND = "prefix_cache_thrash"

# Turns of a conversation come back tens of seconds apart: two minutes hold enough of them
# for a stable share, and one long recompute does not make an episode.
RATE_WINDOW_S = 120.0
# A fifth of the tokens looked up had been cached and were thrown out before they were
# needed: the replacement policy keeps the wrong blocks (a healthy cache refetches a few
# percent, the prompts of users who came back after hours).
REFETCH_SHARE_THRESHOLD = 0.2
# Half of the looked-up tokens recomputed: the cache costs memory and saves little.
CRITICAL_REFETCH_SHARE = 0.5
# Sustained for ten minutes, as long as the hit-ratio golden signal waits: a burst of long
# generations fills the pool and churns the cache for a few minutes; thrash persists.
MIN_DURATION_S = 600.0
MERGE_GAP_S = 300.0
FIXES = ["lfu-decay"]


def analyze(window: Window) -> list[Finding]:
    """Prefix-cache thrash per GPU (engine), with its evidence."""
    eng = window.rows("engine")
    if eng.empty or not (window.has("engine", M.engine_prefix_cache_recomputed_tokens_total)
                         and window.has("engine", M.prefix_cache_queries_total)):
        return []
    req = window.rows("request")
    findings = []
    for key, e in per_entity(eng, ["node", "gpu"]):
        t = e["t"].to_numpy(float)
        queries = held_counter(e, M.prefix_cache_queries_total)
        refetched = held_counter(e, M.engine_prefix_cache_recomputed_tokens_total)
        share = _trailing_ratio(t, refetched, queries, RATE_WINDOW_S)
        spans = episodes(t, share >= REFETCH_SHARE_THRESHOLD, MERGE_GAP_S, MIN_DURATION_S)
        if not spans:
            continue
        spans = [(max(float(t[0]), a - RATE_WINDOW_S), float(b)) for a, b in spans]
        reqs = subset(req, key)
        hits = held_counter(e, M.prefix_cache_hits_total)
        evictions = held_counter(e, M.engine_prefix_cache_evictions_total)
        base_hit = _ratio_outside(t, hits, queries, spans)
        for start, end in spans:
            sel = (t >= start) & (t <= end)
            n_q = counter_increase(queries[sel])
            ep_share = counter_increase(refetched[sel]) / n_q if n_q > 0 else 0.0
            hit = counter_increase(hits[sel]) / n_q if n_q > 0 else float("nan")
            evict_rate = counter_increase(evictions[sel]) / max(end - start, 1.0)
            ttft, ttft_base = _p(reqs, M.time_to_first_token_seconds, start, end, 99)
            jitter, jitter_base = _jitter(reqs, start, end)
            minutes = (end - start) / 60.0
            findings.append(Finding(
                kind=KIND,
                severity=Severity.CRITICAL if ep_share >= CRITICAL_REFETCH_SHARE else Severity.WARNING,
                start_s=start, end_s=end, node=key.get("node"), gpu=label_int(key.get("gpu")),
                summary=(f"prefix cache thrashing for {minutes:.0f} min: {ep_share:.0%} of looked-up prompt tokens "
                         f"were recomputed after their cached KV was evicted ({evict_rate:.0f} blocks/s evicted); "
                         f"hit ratio {_pct(hit)} vs {_pct(base_hit)} outside; TPOT jitter (P99 - P50) "
                         f"{_ms(jitter)} vs {_ms(jitter_base)}"),
                evidence=[
                    Evidence("prefix_cache_refetch_share_ratio", float(np.nanmax(share[sel])), None,
                             REFETCH_SHARE_THRESHOLD, "ratio"),
                    Evidence("prefix_cache_hit_ratio", hit, base_hit, None, "ratio"),
                    Evidence("prefix_cache_evictions_per_second", evict_rate, None, None, ""),
                    Evidence("ttft_p99_seconds", ttft, ttft_base, None, "seconds"),
                    Evidence("tpot_jitter_seconds", jitter, jitter_base, None, "seconds"),
                ],
                runbook=alert_name(KIND), fixes=list(FIXES),
                details={"refetch_share": ep_share, "hit_ratio": hit},
            ))
    return findings


def _trailing_ratio(t, num, den, window_s):
    d = windowed_increase(t, den, window_s)
    n = windowed_increase(t, num, window_s)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(d > 0, n / np.where(d > 0, d, 1.0), 0.0)


def _ratio_outside(t, num, den, spans) -> float:
    n, d = counter_increase(num), counter_increase(den)
    for a, b in spans:
        sel = (t >= a) & (t <= b)
        n -= counter_increase(num[sel])
        d -= counter_increase(den[sel])
    return n / d if d > 0 else float("nan")


def _split(reqs, col, start, end):
    if reqs.empty or col not in reqs:
        return np.array([]), np.array([])
    tt = reqs["t"].to_numpy(float)
    v = reqs[col].to_numpy(float)
    inside = (tt >= start) & (tt <= end)
    return v[inside], v[~inside]


def _p(reqs, col, start, end, q):
    inside, outside = _split(reqs, col, start, end)
    base = percentile(outside, q)
    return percentile(inside, q), (None if np.isnan(base) else base)


def _jitter(reqs, start, end):
    inside, outside = _split(reqs, M.inter_token_latency_seconds, start, end)

    def j(v):
        return percentile(v, 99) - percentile(v, 50)

    base = j(outside)
    return j(inside), (None if np.isnan(base) else base)


def _pct(v) -> str:
    return "n/a" if v is None or np.isnan(v) else f"{v:.0%}"


def _ms(v) -> str:
    return "n/a" if v is None or np.isnan(v) else f"{v * 1e3:.0f} ms"
