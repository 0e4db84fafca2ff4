"""latency_regression: TTFT, TPOT or end-to-end latency P99 rose over its baseline; how did P50 move?

Definitions (per GPU):
- samples: finished requests (``request`` rows: time_to_first_token_seconds,
  inter_token_latency_seconds, e2e_request_latency_seconds, at their finish
  time); without request rows, the engine rows' histogram summaries as the
  engine probe gives them (each scrape interval's P50 and P99, ``window``),
  an interval standing for its requests;
- baseline: the P50 and P99 of the first BASELINE_SHARE of the window, or
  the ``baseline`` given ({metric column: {"p50": s, "p99": s}});
- a healthy baseline: one whose P99 is within the interactive SLO (SLO_P99_S:
  TTFT_SLO_P99_S, TPOT_SLO_P99_S). A window that starts unhealthy has no
  healthy stretch to compare with: the metric is judged against its SLO
  instead, from the window's start (``details["baseline_source"]`` says
  ``slo``), and the summary says there was no healthy baseline and what the
  first stretch measured. e2e has no SLO of its own (it grows with output
  length): it is judged only beside a healthy TTFT and TPOT baseline;
- after the baseline, consecutive BUCKET_S buckets with at least
  MIN_REQUESTS requests; a bucket regresses when its P99 is at least
  P99_RATIO_THRESHOLD times the baseline P99 (against an SLO: above the SLO)
  and, of request rows, at least MIN_SLOW_REQUESTS of its requests are that
  slow;
- the regression's start: when its first regressed bucket had shown its
  tail, the finish of the MIN_SLOW_REQUESTS-th request that slow in it (of
  interval summaries, the first interval that slow), not the bucket's edge:
  a bucket that regressed in its last minute did not regress at its start,
  and the chain assembler orders causes by these starts. Its end is the
  last regressed bucket's end (never after the window's last sample);
- the P50's behaviour over the regressed buckets: within P50_FLAT_RATIO of
  its baseline means the median request is fine and a few are very slow —
  ``pattern = "stragglers_or_communication"`` (SCENARIOS.md's quick lookup:
  P99 up with P50 normal -> check NVLink error counters, PCIe, clocks,
  temperature); otherwise ``pattern = "broad"`` (everything slower: load,
  throttling, memory pressure).

End-to-end latency is TTFT plus output tokens times TPOT: its P99 rising
while neither TTFT nor TPOT regresses means longer outputs (a change of the
request mix), so e2e counts only alongside one of them.

TTFT is queue time (arrival to first scheduling) plus prefill time (first
scheduling to first token). When TTFT regresses and the request rows carry
both parts, the finding says which of the two grew (``details["ttft_cause"]``:
``queue`` or ``prefill``, the part whose P99 rose more over its own
baseline): requests waiting for room (KV memory, batch slots) is another
fault than a prefill that got slower (longer prompts, recompute, a slower GPU).
Against a given ``baseline`` the parts have none of their own, and the split
is left out unless it holds theirs too (a finding's ``details["baseline"]``
does).

One finding per GPU and episode of regressed buckets (merged within
MERGE_GAP_S), with an evidence row per regressed metric; critical at
CRITICAL_P99_RATIO (of the baseline, or of the SLO).

A window shorter than MIN_SPAN_S holds no bucket after its baseline: nothing
can be judged in it.
"""

from __future__ import annotations

import numpy as np

from gpudiag.catalog import M
from gpudiag.findings import Evidence, Finding, Severity, alert_name
from gpudiag.frames import Window
from gpudiag.units import fmt_seconds

from .common import by_time, episodes, label_int, per_entity, percentile, percentiles, tail_percentile
from .kv_eviction_storm import CRITICAL_TPOT_RATIO

KIND = "latency_regression"

LATENCIES = (M.time_to_first_token_seconds, M.inter_token_latency_seconds, M.e2e_request_latency_seconds)
# TTFT's two parts, read to say which one a TTFT regression came from; they raise no finding alone.
TTFT_PARTS = {"queue": M.request_queue_time_seconds, "prefill": M.request_prefill_time_seconds}
# The first quarter of the window is "before" unless a baseline is given.
BASELINE_SHARE = 0.25
# Five minutes holds enough requests at tens of QPS for a stable P99.
BUCKET_S = 300.0
# The shortest window with one whole bucket after its baseline share.
MIN_SPAN_S = BUCKET_S / (1.0 - BASELINE_SHARE)
# Interactive chat SLOs: what a healthy baseline stays within, and the yardstick when the window
# has no healthy stretch. A first token within 2 s keeps a chat turn responsive (the usual
# interactive TTFT target; beyond it users see a stalled answer)...
TTFT_SLO_P99_S = 2.0
# ...and 100 ms per output token (10 tokens/s) streams faster than people read (4-5 words/s).
TPOT_SLO_P99_S = 0.1
SLO_P99_S = {M.time_to_first_token_seconds: TTFT_SLO_P99_S, M.inter_token_latency_seconds: TPOT_SLO_P99_S}
# Against an SLO the threshold is the SLO itself: beyond it is a breach, not a swing.
SLO_RATIO_THRESHOLD = 1.0
WINDOW, GIVEN, SLO = "window", "given", "slo"  # where a metric's baseline came from
# Fewer requests than this make a P99 one request's latency.
MIN_REQUESTS = 50
# P99 doubled: beyond the swings of a healthy engine under a changing mix.
P99_RATIO_THRESHOLD = 2.0
# A bucket of requests regresses only when at least this many of them are that slow. Under a
# few hundred requests a P99 is the slowest one or two: at 1.3 requests/s two slow requests in a
# 97-request bucket (cut by the window's end) doubled its P99 in a healthy run. One or two slow
# requests are no regression; three are the least that make a tail.
MIN_SLOW_REQUESTS = 3
# P50 within a fifth of its baseline counts as flat.
P50_FLAT_RATIO = 1.2
# Three times the baseline tail is where interactive SLOs break (shared with kv_eviction_storm).
CRITICAL_P99_RATIO = CRITICAL_TPOT_RATIO
MERGE_GAP_S = BUCKET_S
STRAGGLERS = "stragglers_or_communication"
BROAD = "broad"
TTFT_HINTS = {
    "queue": "TTFT grew in the queue: requests waited for room (KV memory or batch slots), not for their "
             "prefill. Look for what held the room: kv_eviction_storm, memory_fragmentation, queue_avalanche.",
    "prefill": "TTFT grew in the prefill itself: longer prompts, recompute prefills after evictions, or a "
               "slower GPU (throttling).",
}
STRAGGLER_HINT = ("P99 up with P50 normal: a few requests are very slow. Check NVLink error counters, PCIe "
                  "replays, clocks and temperature (`gpudiag investigate`, hardware_errors and throttling).")
# A regression is an effect; the fixes belong to the finding that caused it.
FIX_NAMES: tuple[str, ...] = ()
# An open regression's baseline is handed back (held_arguments) only when it covers the first
# part of a full window, less a tenth for the tick or two a fresh window starts late: before the
# window fills, its first part is the first minutes of what is watched (an engine warming up,
# conversations lengthening their prompts), no calm to hold a regression against.
HELD_BASELINE_SHARE = 0.9 * BASELINE_SHARE


def analyze(window: Window, baseline: dict[str, dict[str, float]] | None = None,
            baselines: dict[tuple, dict[str, dict[str, float]]] | None = None) -> list[Finding]:
    """Latency regressions per GPU against the window's first part (or ``baseline``).

    ``baselines``: per (node, gpu), the baseline a regression still open there was found
    against (its ``details["baseline"]``). The agent hands it back while the finding is open:
    a regression that lasts longer than the window's first part would otherwise be measured
    against itself, resolve, and come back against a baseline it had raised.
    """
    samples = _samples(window)
    if not samples:
        return []
    parts = None  # read when a TTFT regression needs them
    findings = []
    for (node, gpu), by_metric in samples.items():
        key = {"node": node, "gpu": gpu}
        given = baseline if baseline is not None else (baselines or {}).get((node, label_int(gpu)))
        start_all = min(float(t.min()) for t, *_ in by_metric.values())
        end_all = max(float(t.max()) for t, *_ in by_metric.values())
        base_end = start_all + BASELINE_SHARE * (end_all - start_all) if given is None else start_all
        regressed: dict[str, list] = {}
        bucket_t = []
        bases: dict[str, dict] = {}
        medians = []  # (baseline, its requests): their P50, read once this GPU regressed
        ordered = None  # the request columns share one t: checked for order once
        series = {}
        for metric, (t, p99, p50, weight) in by_metric.items():
            if t is not ordered:
                t, p99, p50, weight = by_time(t, p99, p50, weight)
                ordered = t
            series[metric] = (t, p99, p50, weight)
            base = (given or {}).get(metric)
            if base is not None:
                base = dict(base, source=GIVEN)
            elif given is None:
                base = _base(t, p99, p50, weight, base_end, medians)
                if base is not None:
                    base["source"] = WINDOW
            if base is None and given is not None and metric in SLO_P99_S:
                base = _slo_base(metric, None)  # no baseline handed back for it: its SLO is the yardstick
            if base is None or not base["p99"] or base["p99"] <= 0:
                continue
            if base["source"] == WINDOW and metric in SLO_P99_S and base["p99"] > SLO_P99_S[metric]:
                base = _slo_base(metric, base["p99"])  # an unhealthy baseline: compare with the SLO
            bases[metric] = base
        if any(b["source"] == SLO for b in bases.values()):
            bases.pop(M.e2e_request_latency_seconds, None)  # e2e holds TTFT: its baseline is no healthier
        for metric, base in bases.items():
            t, p99, p50, weight = series[metric]
            first = start_all if base["source"] == SLO else base_end
            edges = np.arange(first, end_all + BUCKET_S, BUCKET_S)
            limit = (SLO_RATIO_THRESHOLD if base["source"] == SLO else P99_RATIO_THRESHOLD) * base["p99"]
            # t is sorted: each bucket [a, b) is a slice, and its weight a difference of running sums
            # (its length, for requests: one each).
            cuts = np.searchsorted(t, edges, side="left").tolist()
            # Requests, one each: running counts of those that slow, so a span's count is a difference.
            slow = None if p50 is not None else np.concatenate([[0], np.cumsum(p99 >= limit)]).tolist()
            if slow is not None and slow[cuts[-1]] - slow[cuts[0]] < MIN_SLOW_REQUESTS:
                continue  # fewer that slow after the baseline than one bucket needs
            counts = None if weight is None else np.concatenate([[0.0], np.cumsum(weight)])
            for a, b, lo, hi in zip(edges[:-1], edges[1:], cuts[:-1], cuts[1:]):
                if (hi - lo if counts is None else counts[hi] - counts[lo]) < MIN_REQUESTS:
                    continue
                sel = slice(lo, hi)
                if hi > lo and p99[sel].max() < limit:
                    continue  # the bucket's P99 (or median interval P99) is at most its largest value
                if slow is not None and slow[hi] - slow[lo] < MIN_SLOW_REQUESTS:
                    continue  # requests, one each: the tail is one or two of them
                q99, q50 = _quantiles(p99[sel], None if p50 is None else p50[sel])
                if q99 < limit:
                    continue
                # When the bucket showed its tail: the MIN_SLOW_REQUESTS-th request that slow, or the
                # first interval that slow (an interval stands for many requests).
                at = np.flatnonzero(p99[sel] >= limit)
                onset = float(t[lo + at[min(MIN_SLOW_REQUESTS, at.size) - 1 if slow is not None else 0]])
                regressed.setdefault(metric, []).append((a, b, q99, q50, base, onset))
                bucket_t.append(b)
        if not regressed:
            continue
        for base, values in medians:
            base["p50"] = percentile(values, 50)
        marks = np.array(sorted(set(bucket_t)))
        for start, end in episodes(marks, np.ones(len(marks), dtype=bool), MERGE_GAP_S):
            start -= BUCKET_S
            rows = {m: [r for r in rs if r[0] >= start and r[1] <= end] for m, rs in regressed.items()}
            rows = {m: rs for m, rs in rows.items() if rs}
            if set(rows) <= {M.e2e_request_latency_seconds}:
                continue  # e2e = TTFT + outputs x TPOT: alone, it rose with longer outputs, not slower serving
            split = None
            if M.time_to_first_token_seconds in rows:
                parts = _ttft_parts(window) if parts is None else parts
                against_slo = rows[M.time_to_first_token_seconds][0][4]["source"] == SLO
                split = _ttft_split(parts.get(_k(key)), base_end, start, end, given, against_slo)
            # e2e rises with longer outputs alone: the regression starts when TTFT or TPOT showed it.
            onset = min(r[5] for m, rs in rows.items() if m != M.e2e_request_latency_seconds for r in rs)
            findings.append(_finding(key, onset, end, rows, split, bases,
                                     None if given is not None else base_end - start_all))
    return findings


def _slo_base(metric: str, measured_p99: float | None) -> dict:
    """A metric's SLO as its baseline; ``measured_p99``: what the window's unhealthy first stretch measured."""
    return {"p99": SLO_P99_S[metric], "p50": None, "source": SLO, "unhealthy_p99": measured_p99}


def held_arguments(open_findings: list[Finding], window_s: float) -> dict:
    """What :func:`analyze` is given while regressions are open: per (node, gpu), the baseline each
    was found against (a regression longer than the window's first part is not measured against
    itself), when it came from a full ``window_s`` window (HELD_BASELINE_SHARE)."""
    baselines = {(f.node, f.gpu): f.details["baseline"] for f in open_findings if f.details.get("baseline")
                 and (f.details.get("baseline_span_s") is None
                      or f.details["baseline_span_s"] >= HELD_BASELINE_SHARE * window_s)}
    return {"baselines": baselines} if baselines else {}


def _ttft_parts(window: Window) -> dict:
    """{entity key: {part: (t, values)}} of the request rows' queue and prefill times."""
    req = window.rows("request")
    if req.empty or not all(c in req for c in TTFT_PARTS.values()):
        return {}
    return {k: {part: series[c] for part, c in TTFT_PARTS.items() if c in series}
            for k, series in _request_series(req, TTFT_PARTS.values()).items()}


def _request_series(req, columns) -> dict:
    """{entity key: {column: (t, values)}} of the request rows that have a value in the column."""
    out: dict = {}
    for key, r in per_entity(req, ["node", "gpu"]):
        t = r["t"].to_numpy(float)
        for column in columns:
            if column not in r:
                continue
            v = r[column].to_numpy(float)  # missing values (None) read as NaN
            ok = ~np.isnan(v)
            if ok.any():
                # read only from here on: kept as they are when every request has a value
                out.setdefault(_k(key), {})[column] = (t, v) if ok.all() else (t[ok], v[ok])
    return out


def _ttft_split(parts: dict | None, base_end: float, start: float, end: float,
                given: dict | None = None, against_slo: bool = False) -> dict | None:
    """Per part, its P99 over [start, end) and before base_end (or in ``given``, a baseline handed
    back); and which part rose more over its own. ``against_slo``: TTFT had no healthy baseline,
    nor have its parts: no baseline (None), and the cause is the part with the larger P99."""
    if not parts or len(parts) != len(TTFT_PARTS):
        return None
    out: dict = {}
    for part, (t, v) in parts.items():
        now = v[(t >= start) & (t < end)]
        if now.size < MIN_REQUESTS:
            return None
        if against_slo:
            out[part] = (percentile(now, 99), None)
            continue
        held = (given or {}).get(TTFT_PARTS[part])
        base = v[t < base_end]
        if held is None and base.size < MIN_REQUESTS:
            return None
        out[part] = (percentile(now, 99), held["p99"] if held is not None else percentile(base, 99))
    out["cause"] = max(TTFT_PARTS, key=lambda p: out[p][0] - (out[p][1] or 0.0))
    return out


def _finding(key, start, end, rows, split=None, bases=None, base_span_s=None) -> Finding:
    evidence, ratios, words = [], [], []
    flat = None  # whether every median stayed within P50_FLAT_RATIO of its baseline; None: none had one
    details: dict = {"metrics": sorted(rows)}
    # How much time the baseline covers (None: one handed back, see analyze's ``baselines``).
    details["baseline_span_s"] = base_span_s
    # What it was measured against, every latency's and TTFT's parts': handed back while it is open.
    # An SLO is no measured baseline: it is there every time, and not handed back.
    details["baseline"] = {m: {"p50": b.get("p50"), "p99": b["p99"]} for m, b in (bases or {}).items()
                           if b["source"] != SLO}
    details["baseline_source"] = {m: b["source"] for m, b in (bases or {}).items() if m in rows}
    if split is not None and all(split[part][1] is not None for part in TTFT_PARTS):
        details["baseline"].update({column: {"p50": None, "p99": split[part][1]}
                                    for part, column in TTFT_PARTS.items()})
    for metric, rs in rows.items():
        base = rs[0][4]
        worst = max(rs, key=lambda r: r[2])
        p50 = float(np.median([r[3] for r in rs]))
        ratio = worst[2] / base["p99"]
        ratios.append(ratio)
        details[f"{metric}_p99_ratio"] = ratio
        if base["source"] == SLO:
            evidence.append(Evidence(metric.replace("_seconds", "_p99_seconds"), worst[2], None,
                                     SLO_RATIO_THRESHOLD * base["p99"], "seconds"))
            evidence.append(Evidence(metric.replace("_seconds", "_p50_seconds"), p50, None, None, "seconds"))
            before = base.get("unhealthy_p99")
            words.append(f"{_SHORT[metric]} P99 {fmt_seconds(worst[2])}, over its {fmt_seconds(base['p99'])} SLO "
                         + (f"(no healthy baseline: the window's first {fmt_seconds(base_span_s)} already had "
                            f"P99 {fmt_seconds(before)})" if before is not None and base_span_s is not None
                            else "(no baseline to compare with)"))
            details.setdefault("unhealthy_baseline_p99", {})[metric] = before
            continue
        p50_ratio = p50 / base["p50"] if base.get("p50") else float("nan")
        flat = bool(p50_ratio <= P50_FLAT_RATIO) and flat is not False
        evidence.append(Evidence(metric.replace("_seconds", "_p99_seconds"), worst[2], base["p99"],
                                 P99_RATIO_THRESHOLD * base["p99"], "seconds"))
        evidence.append(Evidence(metric.replace("_seconds", "_p50_seconds"), p50, base.get("p50"),
                                 P50_FLAT_RATIO * base["p50"] if base.get("p50") else None, "seconds"))
        words.append(f"{_SHORT[metric]} P99 {fmt_seconds(worst[2])} vs {fmt_seconds(base['p99'])} "
                     f"(P50 {fmt_seconds(p50)} vs {fmt_seconds(base.get('p50'))})")
        details[f"{metric}_p50_ratio"] = p50_ratio
    details["no_healthy_baseline"] = any(b[0][4]["source"] == SLO for b in rows.values())
    # Without a baseline median to compare with, the pattern is not known (None).
    details["pattern"] = None if flat is None else STRAGGLERS if flat else BROAD
    # A tail of TTFT that grew in the queue is requests waiting for room, which no link or clock explains.
    queued_tail = split is not None and split["cause"] == "queue" \
        and set(rows) <= {M.time_to_first_token_seconds, M.e2e_request_latency_seconds}
    if flat and not queued_tail:
        details["hint"] = STRAGGLER_HINT
    split_words = ""
    if split is not None:
        for part, column in TTFT_PARTS.items():
            observed, base = split[part]
            evidence.append(Evidence(column.replace("_seconds", "_p99_seconds"), observed, base, None, "seconds"))
        cause = split["cause"]
        details["ttft_cause"] = cause
        details["ttft_hint"] = TTFT_HINTS[cause]
        q, pf = split["queue"], split["prefill"]
        if q[1] is None:
            split_words = (f"; TTFT is mostly {cause}: queue P99 {fmt_seconds(q[0])}, "
                           f"prefill P99 {fmt_seconds(pf[0])}")
        else:
            split_words = (f"; TTFT grew in the {cause}: queue P99 {fmt_seconds(q[0])} vs {fmt_seconds(q[1])}, "
                           f"prefill P99 {fmt_seconds(pf[0])} vs {fmt_seconds(pf[1])}")
    top = max(ratios)
    tail = "" if flat is None else ": the median slowed too" if not flat \
        else ": P50 flat, a few requests waited" if queued_tail else ": P50 flat, stragglers or communication"
    return Finding(
        kind=KIND, severity=Severity.CRITICAL if top >= CRITICAL_P99_RATIO else Severity.WARNING,
        start_s=float(start), end_s=float(end), node=key.get("node"), gpu=label_int(key.get("gpu")),
        summary="latency regression: " + "; ".join(words) + tail + split_words,
        evidence=evidence, runbook=alert_name(KIND), fixes=list(FIX_NAMES), details=details,
    )


_SHORT = {M.time_to_first_token_seconds: "TTFT", M.inter_token_latency_seconds: "TPOT",
          M.e2e_request_latency_seconds: "e2e"}


def _base(t, p99, p50, weight, base_end, medians: list):
    """The baseline's P99 and P50 before base_end (None: too few requests). Of requests, the P50 is
    only needed once a bucket regressed: it is left for the caller, the baseline and its values
    added to ``medians``."""
    # t is in time order (NaN last, as by_time sorts): the rows before base_end are its first ones
    cut = int(np.searchsorted(t, base_end, side="left")) if base_end == base_end else 0
    if (cut if weight is None else weight[:cut].sum()) < MIN_REQUESTS:
        return None
    if p50 is None:
        values = p99[:cut]
        base = {"p99": tail_percentile(values, 99), "p50": None}
        medians.append((base, values))
        return base
    q99, q50 = _quantiles(p99[:cut], p50[:cut])
    return {"p99": q99, "p50": q50}


def _quantiles(values, interval_p50):
    """(P99, P50) of per-request values; of interval summaries, the median interval's P99 and P50."""
    if interval_p50 is None:
        return tuple(percentiles(values, (99, 50)))
    return percentile(values, 50), percentile(interval_p50, 50)


def _samples(window: Window) -> dict:
    """{entity key: {metric: (t, values-or-interval-p99, interval-p50 or None, weight or None: one each)}}."""
    out: dict = {}
    req = window.rows("request")
    if not req.empty and any(c in req for c in LATENCIES):
        return {k: {m: (t, v, None, None) for m, (t, v) in series.items()}
                for k, series in _request_series(req, LATENCIES).items()}
    eng = window.rows("engine")
    for key, e in per_entity(eng, ["node", "gpu"]):
        t = e["t"].to_numpy(float)
        for metric in LATENCIES:
            if metric not in e:
                continue
            ts, p99, p50, w = [], [], [], []
            for ti, s in zip(t, e[metric].tolist()):
                win = s.get("window") if isinstance(s, dict) else None
                if not win or not win.get("count") or win.get("p99") is None:
                    continue
                ts.append(ti)
                p99.append(win["p99"])
                p50.append(win.get("p50") if win.get("p50") is not None else np.nan)
                w.append(win["count"])
            if ts:
                out.setdefault(_k(key), {})[metric] = (np.array(ts), np.array(p99, float), np.array(p50, float),
                                                       np.array(w, float))
    return out


def _k(key: dict) -> tuple:
    return (key.get("node"), key.get("gpu"))
