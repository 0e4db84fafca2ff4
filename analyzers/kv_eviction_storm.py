"""kv_eviction_storm: the engine keeps evicting KV and recomputing it, and its service pays.

Definitions (per GPU, over 1 s engine samples and finished requests):
- eviction rate: increase of the eviction counter (gpudiag's
  engine_kv_evictions_total, or vLLM's num_preemptions_total) per second
  over the trailing RATE_WINDOW_S; its mean over an episode is the episode's
  evictions over its length;
- recomputed-token share: tokens prefilled again after an eviction divided
  by all prefilled tokens, over the episode (gpudiag's engine counts them;
  vLLM does not);
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
- KV usage: vLLM's kv_cache_usage_perc (blocks in use over the pool); its
  median over the episode tells a pool pinned full from one that filled for
  a moment;
- waiting queue: num_requests_waiting at the episode's start, at most, and
  its median once the storm has held for RATE_WINDOW_S past its first
  eviction;
- generation throughput: increase of generation_tokens_total per second
  over the trailing RATE_WINDOW_S. Before the storm: over the minute that
  ends at its first eviction (the same engine and demand, no eviction in
  it). In the storm: its median over the samples RATE_WINDOW_S or more past
  the first eviction (whole minutes of storm), to the end.

A storm is an episode of eviction rate >= EVICTION_RATE_THRESHOLD lasting at
least MIN_DURATION_S whose harm shows in at least one of:
- decode latency: TPOT P99 at least TPOT_P99_RATIO_THRESHOLD x its baseline;
- recomputation: a recomputed-token share of at least RECOMPUTE_SHARE_THRESHOLD;
- preemption as the steady state of a full pool: a mean eviction rate of at
  least STORM_RATE_THRESHOLD with a median KV usage of at least KV_FULL_RATIO.
  Each eviction throws a running request's KV away and computes it again:
  sustained, that is wasted work and requests sent back to the queue, which
  is what a fleet that scrapes vLLM's counters alone (no latency histograms)
  can see. The finding names what it could not judge (``details["missing"]``).
A storm is a warning. It is critical when TPOT P99 reached CRITICAL_TPOT_RATIO
x its baseline, or when generation throughput in the storm fell to
CRITICAL_THROUGHPUT_RATIO of its best before it while requests waited: the
same demand, queued, served at half the rate or less.

The cause is classified, and the fixes follow it:
- demand over capacity: the engine pages its KV (:func:`engine_pages_kv`:
  vLLM, SGLang and TensorRT-LLM keep KV in fixed-size blocks of one pool, so
  no allocation fails with room free), or tokens fill at least
  DEMAND_FILL_RATIO of the KV capacity (engine_kv_used_bytes over
  engine_kv_capacity_bytes): the pool ran out of room, not into holes.
  Fixes shrink demand or grow the pool: prefix caching first when it is off
  (no prefix-cache lookups), then fewer sequences or tokens per step, more
  KV memory, KV offload (unless the KV connector is seen answering lookups:
  external_prefix_cache_queries_total), prefix caching again when it is on
  with a hit ratio under LOW_PREFIX_HIT_RATIO, a shorter context. Never
  paged KV: the pool is paged already, or full of tokens;
- fragmentation: tokens fill less than DEMAND_FILL_RATIO while the engine
  evicts: the room went to holes and slack; the chain assembler links the
  storm to the fragmentation finding that precedes it on the same GPU;
- unknown, when neither shows: the fragmentation fixes, as before.

Evictions that make no storm (a few in half an hour, each at a pool that
filled for a moment) are the engine at its capacity edge: no finding. Its
alert fires on a finding of this kind at any severity, info included, and an
engine at its edge is no one's page; the runbook says how to move the edge.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gpudiag.catalog import CATALOG, M
from gpudiag.findings import Evidence, Finding, Severity, alert_name
from gpudiag.frames import Rows, Table, Window

from .common import (
    by_time,
    constant_per_entity,
    counter_increase,
    episodes,
    held_counter,
    label_int,
    per_entity,
    rolling_std,
    tail_percentile,
    windowed_rate,
)

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
# A pool at its limit: vLLM preempts only when no block is free, and between two scrapes finished
# requests free a few, so a full pool reads 0.97-1.0 (the B200 storms of the real vLLM runs: median
# 0.996-0.997). Nineteen twentieths leaves room for that, and is far above a pool with room to spare.
KV_FULL_RATIO = 0.95
# Without latency or recompute figures the evictions themselves are the harm, so they must be the
# steady state and not an edge: ten a minute over the whole episode, three times the detection rate.
# The real vLLM storms preempt 30-75 a minute (Llama-70B, 256 and 512 concurrent sequences); an
# engine at its capacity edge preempts a few times in half an hour (DeepSeek-R1 at 256 concurrent:
# 11 in six minutes, 19 in 22).
STORM_RATE_THRESHOLD = 10.0 / 60.0
# Harm beyond a full pool: with requests waiting, the engine turns out half the tokens a second it
# did before the storm. The demand is the same and queued, so every waiting request waits twice as
# long; that is an outage for the tail of the queue, not a slowdown.
CRITICAL_THROUGHPUT_RATIO = 0.5
# Under a fifth of looked-up prompt tokens found: the prefix cache saves little KV or prefill,
# and prompts that share more (or routing that keeps a conversation on one replica) would.
LOW_PREFIX_HIT_RATIO = 0.2
# Tokens filled nine tenths of the KV capacity: the pool ran out of room for tokens, not
# into holes (a fragmented pool fails with far less stored).
DEMAND_FILL_RATIO = 0.9

CAUSE_DEMAND = "demand_over_capacity"
CAUSE_FRAGMENTATION = "fragmentation"
CAUSE_UNKNOWN = "unknown"
# A pool that fragments: names `gpudiag repro --fix` runs on the reference engine.
FIXES = ["paged-kv", "chunked-kv", "priority-eviction", "memory-aware-batching"]
# Demand over capacity. "prefix-caching" is a repro fix (prefix-sharing); the others are the serving
# engine's knobs, which the runbook explains: fewer sequences or tokens per step, more KV memory
# (a larger share of the GPU, tensor parallelism, more replicas), KV offload, a shorter context.
PREFIX_FIX = "prefix-caching"
CAPACITY_FIXES = ["max-num-seqs", "max-num-batched-tokens", "gpu-memory-utilization", "tensor-parallel-size",
                  "replicas"]
OFFLOAD_FIX = "kv-offload"
CONTEXT_FIX = "max-model-len"
# gpudiag's own KV-manager series. An engine that exports them (the reference engine) states its pool
# in bytes and may run any KV manager, contiguous regions included; one that exports vLLM's usage
# ratio without them is vLLM, or an engine speaking its dialect (SGLang, TensorRT-LLM): paged.
KV_MANAGER_COLUMNS = (M.engine_kv_capacity_bytes, M.engine_kv_used_bytes, M.engine_kv_reserved_bytes,
                      M.engine_kv_alloc_failures_total, M.engine_kv_evictions_total)


def analyze(window: Window) -> list[Finding]:
    """Eviction storms per GPU (engine), with their evidence, cause and fixes."""
    eng = window.rows("engine")
    if eng.empty:
        return []
    evict_col = _evict_col(window)
    if evict_col is None:
        return []
    gpu_df = window.rows("gpu")
    req = window.rows("request")
    findings = []
    for key, e in per_entity(eng, ["node", "gpu"]):
        t = e["t"].to_numpy(float)
        ev = held_counter(e, evict_col)
        if counter_increase(ev) <= 0:
            continue
        rate = windowed_rate(t, ev, RATE_WINDOW_S)
        spans = episodes(t, rate >= EVICTION_RATE_THRESHOLD, MERGE_GAP_S, MIN_DURATION_S)
        if not spans:
            continue
        view = _EngineView(key, e, t, ev, rate, evict_col)
        tpots = _tpot_series(_request_tpot(req, key, e))
        base_tpot = _tpot_outside(tpots, spans)
        for detected, end in spans:
            found = _storm(view, detected, float(end), tpots, base_tpot, gpu_df)
            if found is not None:
                findings.append(found)
    return findings


def may_find(window: Window) -> bool:
    """False only when :func:`analyze` is sure to find nothing in ``window``: no engine's eviction counter moved.

    A counter that holds one value per GPU (missing samples aside) has no increase, so no
    eviction rate above zero; the agent's streaming analysis skips the analyzer then.
    """
    if window.rows("engine").empty:
        return False
    evict_col = _evict_col(window)
    if evict_col is None:
        return False
    return not constant_per_entity(window, "engine", ("node", "gpu"), evict_col)


def engine_pages_kv(rows) -> bool | None:
    """True when engine rows are those of an engine that pages its KV; None when they do not say.

    An engine reporting vLLM's KV usage ratio and none of gpudiag's KV-manager series
    (:data:`KV_MANAGER_COLUMNS`) is vLLM or speaks its dialect (SGLang, TensorRT-LLM): all keep KV
    in fixed-size blocks of one pool. The reference engine states its pool in bytes instead and
    runs any KV manager; its rows say nothing here (its fill ratio tells demand from holes).
    """
    if not _observed(rows, M.kv_cache_usage_perc):
        return None
    if any(_observed(rows, c) for c in KV_MANAGER_COLUMNS):
        return None
    return True


@dataclass
class _EngineView:
    """One engine's rows and what the analysis reads from them more than once."""

    key: dict
    e: object
    t: np.ndarray
    ev: np.ndarray
    rate: np.ndarray
    evict_col: str

    def __post_init__(self):
        self.kv = self.gauge(M.kv_cache_usage_perc)
        self.waiting = self.gauge(M.num_requests_waiting)
        self.paged = engine_pages_kv(self.e)
        self._gen: np.ndarray | None = None

    def gauge(self, col) -> np.ndarray | None:
        """A gauge column as floats (NaN where a sample lacks it); None when the engine never reported it."""
        return self.e[col].to_numpy(float) if _observed(self.e, col) else None

    def generation_rate(self) -> np.ndarray | None:
        """Generated tokens per second over the trailing RATE_WINDOW_S; None without the counter."""
        if self._gen is None and _observed(self.e, M.generation_tokens_total):
            self._gen = windowed_rate(self.t, held_counter(self.e, M.generation_tokens_total), RATE_WINDOW_S)
        return self._gen

    @property
    def what(self) -> str:
        """What the counter counts: vLLM calls an eviction of a running request a preemption."""
        return "preemptions" if self.evict_col == M.num_preemptions_total else "evictions"


def _storm(v: _EngineView, detected: float, end: float, tpots, base_tpot, gpu_df) -> Finding | None:
    """The finding for one episode, or None when no harm shows (see the module docstring)."""
    t = v.t
    # Rates look back RATE_WINDOW_S: the storm began up to a window before it was detected. Its
    # figures count from there; its start is its first eviction in that look-back (a cause
    # found in the chain must start no later than this, so the start must not be early).
    start = max(float(t[0]), detected - RATE_WINDOW_S)
    sel = (t >= start) & (t <= end)
    rose = np.flatnonzero((t >= start) & (t <= detected) & (np.diff(v.ev, prepend=v.ev[:1]) > 0))
    onset = float(t[rose[0]]) if rose.size else start
    n_ev = float(v.ev[sel].max() - v.ev[sel].min())
    mean_rate = n_ev / max(end - start, 1.0)
    share = _recompute_share(v.e, sel)
    tpot = _tpot_in(tpots, start, end)
    ratio = tpot / base_tpot if base_tpot and base_tpot > 0 and not np.isnan(tpot) else float("nan")
    kv_median = _nan_stat(np.nanmedian, v.kv, sel)
    latency_harm = not np.isnan(ratio) and ratio >= TPOT_P99_RATIO_THRESHOLD
    recompute_harm = share is not None and share >= RECOMPUTE_SHARE_THRESHOLD
    full_pool = kv_median is not None and kv_median >= KV_FULL_RATIO and mean_rate >= STORM_RATE_THRESHOLD
    if not (latency_harm or recompute_harm or full_pool):
        return None
    moved = np.flatnonzero(sel & (np.diff(v.ev, prepend=v.ev[:1]) > 0))
    first = int(moved[0]) if moved.size else int(np.flatnonzero(sel)[0])  # the storm's first eviction
    later = sel & (t >= t[first] + RATE_WINDOW_S)  # whole rate windows of storm
    if not later.any():
        later = sel & (t >= t[first])
    waiting_start = _first(v.waiting, sel)
    waiting_max = _nan_stat(np.nanmax, v.waiting, sel)
    waiting_later = _nan_stat(np.nanmedian, v.waiting, later)
    gen_before, gen_during = _throughput(v, first, later)
    gen_ratio = gen_during / gen_before if gen_before and gen_during is not None else None
    collapse = (gen_ratio is not None and gen_ratio <= CRITICAL_THROUGHPUT_RATIO
                and waiting_later is not None and waiting_later >= 1)
    critical = (not np.isnan(ratio) and ratio >= CRITICAL_TPOT_RATIO) or collapse
    osc_in, osc_base = _osc_in(*_oscillation(_subset(gpu_df, v.key)), start, end)
    fill = _fill(v.e, sel)
    cause = _cause(v.paged, fill)
    prefix, hit = _prefix_caching(v.e)
    offload = _offload(v.e)
    minutes = (end - start) / 60.0
    missing = _missing(v, tpots, base_tpot, share, gpu_df, cause, offload)
    parts = [f"KV eviction storm for {minutes:.0f} min: {n_ev:.0f} {v.what} ({mean_rate * 60:.1f}/min)"]
    if kv_median is not None:
        parts.append(f" with the KV cache {kv_median:.1%} full (median)")
    if waiting_max is not None:
        parts.append(f", up to {waiting_max:.0f} requests waiting ({waiting_start or 0:.0f} at its start)")
    if gen_during is not None and gen_before:
        parts.append(f"; generation {gen_during:,.0f} tokens/s against {gen_before:,.0f} before it")
    if share is not None:
        parts.append(f"; {share:.0%} of prefill recomputed")
    if tpots is None:
        parts.append("; decode latency not judged (no latency histograms)")
    else:
        parts.append(f"; TPOT P99 {_ms(tpot)} vs {_ms(base_tpot)} baseline")
    parts.append(_cause_text(cause, v.paged, fill))
    return Finding(
        kind=KIND, severity=Severity.CRITICAL if critical else Severity.WARNING, start_s=onset, end_s=end,
        node=v.key.get("node"), gpu=label_int(v.key.get("gpu")), summary="".join(parts),
        evidence=[
            Evidence("kv_evictions_per_second", float(v.rate[sel].max()), 0.0, EVICTION_RATE_THRESHOLD, ""),
            Evidence("kv_evictions_per_second_mean", mean_rate, None, STORM_RATE_THRESHOLD, ""),
            Evidence("recomputed_token_share", share, 0.0, RECOMPUTE_SHARE_THRESHOLD, "ratio"),
            Evidence("tpot_p99_seconds", tpot, base_tpot, (base_tpot or 0) * TPOT_P99_RATIO_THRESHOLD
                     if base_tpot else None, "seconds"),
            Evidence("gpu_utilization_oscillation_ratio", osc_in, osc_base, None, "ratio"),
            Evidence(M.kv_cache_usage_perc, _nan_stat(np.nanmax, v.kv, sel), None, None, "ratio"),
            Evidence("kv_cache_usage_median_ratio", kv_median, None, KV_FULL_RATIO, "ratio"),
            Evidence(M.num_requests_waiting, waiting_max, waiting_start, None, ""),
            Evidence("generation_tokens_per_second", gen_during, gen_before,
                     gen_before * CRITICAL_THROUGHPUT_RATIO if gen_before else None, "tokens_per_second"),
        ],
        runbook=alert_name(KIND), fixes=_fixes(cause, prefix, hit, offload),
        details={"evictions": n_ev, "evictions_per_second": mean_rate, "tpot_p99_ratio": ratio,
                 "kv_token_fill_ratio": fill, "kv_usage_median_ratio": kv_median,
                 "requests_waiting_median": waiting_later, "generation_throughput_ratio": gen_ratio,
                 "cause": cause, "kv_paged": v.paged, "kv_offload": offload, "prefix_caching": prefix,
                 "prefix_cache_hit_ratio": hit, "missing": missing},
    )


def _evict_col(window: Window) -> str | None:
    if window.has("engine", M.engine_kv_evictions_total):
        return M.engine_kv_evictions_total
    return M.num_preemptions_total if window.has("engine", M.num_preemptions_total) else None


def _observed(rows, col) -> bool:
    """Whether the rows hold a value of ``col`` (a column other engines' rows carry may be empty here)."""
    if col not in rows:
        return False
    try:
        return bool(np.isfinite(rows[col].to_numpy(float)).any())
    except (TypeError, ValueError):
        return False


def _nan_stat(fn, values: np.ndarray | None, sel) -> float | None:
    if values is None:
        return None
    v = values[sel]
    return float(fn(v)) if np.isfinite(v).any() else None


def _first(values: np.ndarray | None, sel) -> float | None:
    if values is None:
        return None
    v = values[sel]
    ok = np.flatnonzero(np.isfinite(v))
    return float(v[ok[0]]) if ok.size else None


def _throughput(v: _EngineView, first: int, later) -> tuple[float | None, float | None]:
    """(generation rate over the minute up to the storm's first eviction, its median in the storm);
    None where not seen."""
    gen = v.generation_rate()
    if gen is None:
        return None, None
    before = float(gen[first]) if np.isfinite(gen[first]) and gen[first] > 0 else None
    during = float(np.median(gen[later])) if later.any() else None
    return before, during


def _cause(paged: bool | None, fill: float | None) -> str:
    if paged or (fill is not None and fill >= DEMAND_FILL_RATIO):
        return CAUSE_DEMAND
    return CAUSE_FRAGMENTATION if fill is not None else CAUSE_UNKNOWN


def _cause_text(cause: str, paged: bool | None, fill: float | None) -> str:
    if cause == CAUSE_DEMAND:
        how = "the engine pages its KV" if paged else f"tokens fill {fill:.0%} of it"
        return f"; demand exceeded the KV capacity ({how}: not fragmentation)"
    if cause == CAUSE_FRAGMENTATION:
        return f"; tokens fill only {fill:.0%} of the KV capacity: room lost to fragmentation"
    return ""


def _prefix_caching(e) -> tuple[str, float | None]:
    """("on" | "off", hit ratio over the window): on when the engine looked prompts up in its prefix cache."""
    queries = counter_increase(held_counter(e, M.prefix_cache_queries_total))
    if queries <= 0:
        return "off", None
    return "on", counter_increase(held_counter(e, M.prefix_cache_hits_total)) / queries


def _offload(e) -> str:
    """"on" when the KV connector answered lookups (offloaded KV), "off" when it was asked none,
    "unknown" when the engine does not report it."""
    if not _observed(e, M.external_prefix_cache_queries_total):
        return "unknown"
    return "on" if counter_increase(held_counter(e, M.external_prefix_cache_queries_total)) > 0 else "off"


def _fixes(cause: str, prefix: str, hit: float | None, offload: str) -> list[str]:
    if cause != CAUSE_DEMAND:
        return list(FIXES)
    out = [PREFIX_FIX] if prefix == "off" else []
    out += CAPACITY_FIXES
    if offload != "on":
        out.append(OFFLOAD_FIX)
    if prefix == "on" and hit is not None and hit < LOW_PREFIX_HIT_RATIO:
        out.append(PREFIX_FIX)
    return out + [CONTEXT_FIX]


def _missing(v: _EngineView, tpots, base_tpot, share, gpu_df, cause: str, offload: str) -> list[str]:
    """What the finding could not judge, and why: evidence that was not in the window."""
    name = {c: CATALOG[c].name for c in (M.inter_token_latency_seconds, M.kv_cache_usage_perc,
                                         M.generation_tokens_total, M.num_requests_waiting,
                                         M.external_prefix_cache_queries_total, M.engine_kv_used_bytes)}
    out = []
    if tpots is None:
        out.append(f"decode latency: no latency histograms ({name[M.inter_token_latency_seconds]}) or finished "
                   f"requests in the window; decode latency not judged")
    elif not base_tpot:
        out.append("decode latency baseline: no TPOT outside the storm; its rise not judged")
    if share is None:
        out.append("recomputed tokens: the engine does not count them; the share of prefill redone not judged")
    if gpu_df.empty or M.gpu_utilization_ratio not in gpu_df:
        out.append("GPU utilization: no GPU rows; its oscillation not judged")
    for col, what in ((M.kv_cache_usage_perc, "a full pool not judged"),
                      (M.num_requests_waiting, "the queue not judged"),
                      (M.generation_tokens_total, "throughput not judged")):
        if not _observed(v.e, col):
            out.append(f"{name[col]}: not reported; {what}")
    if cause == CAUSE_UNKNOWN:
        out.append(f"KV token fill: not a paged engine and no {name[M.engine_kv_used_bytes]}; demand and "
                   f"fragmentation not told apart")
    if cause == CAUSE_DEMAND and offload == "unknown":
        out.append(f"KV offload: no {name[M.external_prefix_cache_queries_total]}; whether it is on is not known")
    return out


def _fill(e, sel):
    """Largest share of the KV capacity holding tokens in the episode; None when not observed."""
    if M.engine_kv_used_bytes not in e or M.engine_kv_capacity_bytes not in e:
        return None
    used = e[M.engine_kv_used_bytes].to_numpy(float)[sel]
    cap = e[M.engine_kv_capacity_bytes].to_numpy(float)[sel]
    ok = (cap > 0) & np.isfinite(used)
    return float((used[ok] / cap[ok]).max()) if ok.any() else None


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


def _request_tpot(req, key, e):
    """The rows TPOT is read from: the GPU's finished requests, else the engine's interval histograms."""
    reqs = _subset(req, key)
    return reqs if _tpot_col(reqs) is not None else _interval_tpot(e)


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


def _tpot_col(reqs):
    return M.inter_token_latency_seconds if M.inter_token_latency_seconds in reqs else None


def _tpot_series(reqs) -> tuple[np.ndarray, np.ndarray] | None:
    """(t, TPOT) of the requests (or intervals) sorted by time; None without any TPOT."""
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


def _recompute_share(e, sel) -> float | None:
    """Recomputed over prefilled tokens in the episode; None when the engine does not count recomputation."""
    if M.engine_recomputed_tokens_total not in e or M.prompt_tokens_total not in e:
        return None
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
