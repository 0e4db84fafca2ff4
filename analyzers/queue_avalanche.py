"""queue_avalanche: overload went into the queue instead of being refused, and clients and probes paid.

Definitions (per GPU, over 1 s engine samples; gpudiag's counters, which the
reference engine's front end exports and a gateway or supervisor can feed):
- timeout rate: increase of engine_requests_timed_out_total (clients that gave
  up before the last token) per second over the trailing RATE_WINDOW_S;
- restarts: increases of engine_restarts_total (a failed liveness probe
  restarts the instance and drops everything in flight);
- shed share: 429s (engine_requests_rejected_total) over 429s plus timeouts
  in the episode: how much of the overload admission control refused at the
  door rather than queueing it until clients gave up;
- goodput: requests finished over requests that reached the instance
  (engine_requests_finished_total / engine_requests_arrived_total) in the
  episode, against the same ratio outside any episode;
- queue: the largest num_requests_waiting in the episode, and the P99 of
  request_queue_time_seconds of requests that finished in it (evidence).

An avalanche is an episode, at least MIN_DURATION_S long (episodes closer
than MERGE_GAP_S merged), in which the timeout rate is at least
TIMEOUT_RATE_THRESHOLD or the instance restarted, while admission control
shed less than MAX_SHED_SHARE of it. Critical when the instance restarted or
goodput fell under CRITICAL_GOODPUT_RATIO.
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
    windowed_rate,
)

KIND = "queue_avalanche"

RATE_WINDOW_S = 60.0
# Three abandoned requests a minute, sustained: a slow client now and then times out on
# any service; this many means requests wait past their clients' patience.
TIMEOUT_RATE_THRESHOLD = 3.0 / 60.0
# An avalanche builds over a minute or more; a burst that drains in seconds is not one.
MIN_DURATION_S = 60.0
# Restart cycles of a few minutes (warm-up, retries landing, the next failed probe) are one episode.
MERGE_GAP_S = 300.0
# When admission control refuses most of the excess (429s outnumber timeouts), it is doing
# its job: the instance is throttling, not avalanching.
MAX_SHED_SHARE = 0.5
# Fewer than half the requests that reached the instance finished: the work it did went
# to requests that were abandoned or dropped.
CRITICAL_GOODPUT_RATIO = 0.5
FIXES = ["bounded-queue"]


def analyze(window: Window) -> list[Finding]:
    """Queue avalanches per GPU (engine), with their evidence."""
    eng = window.rows("engine")
    if eng.empty or not (window.has("engine", M.engine_requests_timed_out_total)
                         or window.has("engine", M.engine_restarts_total)):
        return []
    req = window.rows("request")
    findings = []
    for key, e in per_entity(eng, ["node", "gpu"]):
        t = e["t"].to_numpy(float)
        timeouts = held_counter(e, M.engine_requests_timed_out_total)
        restarts = held_counter(e, M.engine_restarts_total)
        rate = windowed_rate(t, timeouts, RATE_WINDOW_S)
        restarted = windowed_rate(t, restarts, RATE_WINDOW_S) > 0
        spans = episodes(t, (rate >= TIMEOUT_RATE_THRESHOLD) | restarted, MERGE_GAP_S, MIN_DURATION_S)
        if not spans:
            continue
        reqs = subset(req, key)
        # Rates look back RATE_WINDOW_S: an episode began up to a window before it was detected.
        spans = [(max(float(t[0]), a - RATE_WINDOW_S), float(b)) for a, b in spans]
        base_goodput = _goodput_outside(e, t, spans)
        for start, end in spans:
            sel = (t >= start) & (t <= end)
            n_timeouts = counter_increase(timeouts[sel])
            n_restarts = counter_increase(restarts[sel])
            n_rejected = counter_increase(held_counter(e, M.engine_requests_rejected_total)[sel])
            shed = n_rejected / (n_rejected + n_timeouts) if n_rejected + n_timeouts > 0 else 0.0
            if shed >= MAX_SHED_SHARE:
                continue
            goodput = _goodput(e, sel)
            waiting = held_counter(e, M.num_requests_waiting)[sel]
            max_waiting = float(np.nanmax(waiting)) if np.isfinite(waiting).any() else float("nan")
            queue_p99 = _queue_p99(reqs, start, end)
            critical = n_restarts > 0 or (not np.isnan(goodput) and goodput < CRITICAL_GOODPUT_RATIO)
            minutes = (end - start) / 60.0
            findings.append(Finding(
                kind=KIND, severity=Severity.CRITICAL if critical else Severity.WARNING,
                start_s=start, end_s=float(end), node=key.get("node"), gpu=label_int(key.get("gpu")),
                summary=(f"queue avalanche for {minutes:.0f} min: {n_timeouts:.0f} client timeouts, "
                         f"{n_restarts:.0f} restarts, {n_rejected:.0f} refused (429); up to {max_waiting:.0f} "
                         f"queued, queue wait P99 {_s(queue_p99)}; {_pct(goodput)} of requests finished "
                         f"vs {_pct(base_goodput)} outside it"),
                evidence=[
                    Evidence("requests_timed_out_per_second", float(rate[sel].max()), 0.0, TIMEOUT_RATE_THRESHOLD,
                             ""),
                    Evidence(M.engine_restarts_total, n_restarts, 0.0, None, ""),
                    Evidence("shed_share_ratio", shed, None, MAX_SHED_SHARE, "ratio"),
                    Evidence("goodput_ratio", goodput, base_goodput, CRITICAL_GOODPUT_RATIO, "ratio"),
                    Evidence(M.num_requests_waiting, max_waiting, None, None, ""),
                    Evidence("request_queue_time_p99_seconds", queue_p99, None, None, "seconds"),
                ],
                runbook=alert_name(KIND), fixes=list(FIXES),
                details={"timeouts": n_timeouts, "restarts": n_restarts, "rejected": n_rejected},
            ))
    return findings


def _goodput(e, sel) -> float:
    arrived = counter_increase(held_counter(e, M.engine_requests_arrived_total)[sel])
    finished = counter_increase(held_counter(e, M.engine_requests_finished_total)[sel])
    return finished / arrived if arrived > 0 else float("nan")


def _goodput_outside(e, t, spans) -> float:
    """Goodput of the samples outside every episode: the whole window's increases less the episodes'."""
    arrived = held_counter(e, M.engine_requests_arrived_total)
    finished = held_counter(e, M.engine_requests_finished_total)
    a, f = counter_increase(arrived), counter_increase(finished)
    for start, end in spans:
        sel = (t >= start) & (t <= end)
        a -= counter_increase(arrived[sel])
        f -= counter_increase(finished[sel])
    return f / a if a > 0 else float("nan")


def _queue_p99(reqs, start, end) -> float:
    if reqs.empty or M.request_queue_time_seconds not in reqs:
        return float("nan")
    r = reqs[(reqs["t"] >= start) & (reqs["t"] <= end)]
    return percentile(r[M.request_queue_time_seconds], 99)


def _s(v) -> str:
    return "n/a" if v is None or np.isnan(v) else f"{v:.1f} s"


def _pct(v) -> str:
    return "n/a" if v is None or np.isnan(v) else f"{v:.0%}"
