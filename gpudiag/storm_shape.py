"""The kv-eviction-storm's shape (SCENARIOS.md §1) measured on ``gpudiag repro`` runs, one seed at a time.

The field report describes a storm that hurts long requests in decode, makes
GPU utilization swing between idle and pegged, and heals itself when the
request mix turns short again. A run reproduces that incident, and not a queue
avalanche or a calm day, when every quantity below is within its bound:

- no avalanche: the median TTFT of the long phase within :data:`TTFT_P50_MAX_RATIO`
  of the calm phase's, and the waiting queue back to its calm level within
  :data:`QUEUE_DRAIN_MAX_S` of the long phase's end;
- decode hurts: TPOT P99 of all requests at least :data:`TPOT_P99_MIN_RATIO` times the
  calm phase's, and of the long sequences (the ``<=8k`` context bucket)
  :data:`LONG_TPOT_P99_MIN_RATIO` times;
- utilization swings: some 1 s sample of the long phase at or below
  :data:`UTIL_DIP_MAX` and some at or above :data:`UTIL_PEG_MIN`;
- the fix holds: with paged KV, TPOT P999 over the whole run within
  :data:`PAGED_TPOT_P999_MAX_RATIO` of that run's calm TPOT P99.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from gpudiag import repro
from gpudiag.catalog import M

# The report: "prefill times stay normal". Requests may queue for room, but the median one
# must not: a median TTFT 3x the calm one is already a queue that every request sits in.
TTFT_P50_MAX_RATIO = 3.0
# "then self-recovers": the queue left by the storm drains within minutes of the mix turning short.
QUEUE_DRAIN_MAX_S = 600.0
# P99 latency 80 ms -> 300-2000 ms; decode time per token ~50 ms -> >400 ms "long-sequence requests
# only". Over all requests the short ones, many more, dilute it: 2x overall, 4x in the long bucket.
TPOT_P99_MIN_RATIO = 2.0
LONG_TPOT_P99_MIN_RATIO = 4.0
LONG_BUCKET = "<=8k"  # prompt + output of 2k-8k tokens: the long phase's requests
# "A100 utilization fell from 65 % to below 20 %, then suddenly pegged, back and forth".
UTIL_DIP_MAX = 0.35
UTIL_PEG_MIN = 0.95
# Fix 1 of the report: P999 ~2 s -> <120 ms under the same load, against an 80 ms P99 before.
PAGED_TPOT_P999_MAX_RATIO = 1.5


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or not b:
        return None
    return float(a) / float(b)


def queue_drain_s(res: repro.RunResult, long_phase: tuple[float, float]) -> float | None:
    """Seconds after the long phase ends until the waiting queue stays at or below its calm level (the
    most it held before the phase) for the rest of the run; 0 when it never rose above it after the
    phase; None when it is still above it when the run ends."""
    eng = res.window.table("engine")
    if eng.empty or M.num_requests_waiting not in eng:
        return None
    t = eng["t"].to_numpy(float)
    waiting = eng[M.num_requests_waiting].to_numpy(float)
    start, end = long_phase
    calm = waiting[t <= start]
    level = float(calm.max()) if calm.size else 0.0
    above = t[(t > end) & (waiting > level)]
    if not above.size:
        return 0.0
    if above[-1] >= t[-1]:
        return None
    return float(above[-1] - end)


def measure(res: repro.RunResult, paged: repro.RunResult | None = None) -> dict[str, Any]:
    """The shape's quantities for one seed: the unfixed run ``res`` and, when given, its paged-kv run."""
    doc = repro.document(res)
    ph = {p["name"]: p for p in doc["phases"]}
    before, during = ph["before"], ph["during"]
    long_phase = (during["start_s"], during["end_s"])
    gpu = res.window.table("gpu")
    sel = (gpu["t"] > long_phase[0]) & (gpu["t"] <= long_phase[1])
    util = gpu[sel][M.gpu_utilization_ratio].to_numpy(float)
    long_bucket = during["by_context"].get(LONG_BUCKET) or {}
    out: dict[str, Any] = {
        "seed": res.seed,
        "requests": doc["totals"]["requests"],
        "unfinished": doc["totals"]["unfinished"],
        "ttft_p50_before_s": before["slo"]["ttft_p50_s"],
        "ttft_p50_during_s": during["slo"]["ttft_p50_s"],
        "ttft_p50_ratio": _ratio(during["slo"]["ttft_p50_s"], before["slo"]["ttft_p50_s"]),
        "queue_max": _max_waiting(res),
        "queue_drain_s": queue_drain_s(res, long_phase),
        "tpot_p99_before_s": before["slo"]["tpot_p99_s"],
        "tpot_p99_ratio": _ratio(during["slo"]["tpot_p99_s"], before["slo"]["tpot_p99_s"]),
        "long_requests": long_bucket.get("requests", 0),
        "long_tpot_p99_ratio": _ratio(long_bucket.get("tpot_p99_s"), before["slo"]["tpot_p99_s"]),
        "util_mean_before": before["gpu_util_mean"],
        "util_mean_during": during["gpu_util_mean"],
        "util_min_during": float(util.min()) if util.size else None,
        "util_max_during": float(util.max()) if util.size else None,
        "host_cpu_max_before": before["host_cpu_max"],
        "host_cpu_max_during": during["host_cpu_max"],
        "evictions_during": during["evictions"],
        "alloc_failures_during": during["alloc_failures"],
        "alloc_retries_max_per_s": _max_retries_per_s(res, long_phase),
    }
    if paged is not None:
        out.update(measure_fixed(paged))
    return out


def measure_fixed(paged: repro.RunResult) -> dict[str, Any]:
    """The fix's quantities of one seed's paged-kv run: its evictions and TPOT P999 against its calm P99."""
    doc = repro.document(paged)
    before = next(p for p in doc["phases"] if p["name"] == "before")
    return {"paged_evictions": doc["totals"]["evictions"], "paged_alloc_failures": doc["totals"]["alloc_failures"],
            "paged_tpot_p999_ratio": _ratio(doc["slo"]["tpot_p999_s"], before["slo"]["tpot_p99_s"])}


def _max_retries_per_s(res: repro.RunResult, long_phase: tuple[float, float]) -> float | None:
    """The most allocation retries (cache flushes after a failed cudaMalloc) of one second of the long phase.

    Each retry synchronizes the device and runs driver calls on the host: the busiest second shows what
    a retry would have to cost for the retries alone to idle the GPU to :data:`UTIL_DIP_MAX`.
    """
    proc = res.window.table("process")
    if proc.empty or M.process_torch_alloc_retries_total not in proc:
        return None
    total = proc.groupby("t")[M.process_torch_alloc_retries_total].sum().sort_index()  # every process, each second
    t = total.index.to_numpy(float)
    per_s = np.diff(total.to_numpy(float))
    sel = (t[1:] > long_phase[0]) & (t[1:] <= long_phase[1])
    return float(per_s[sel].max()) if sel.any() else None


def check_complete(res: repro.RunResult) -> None:
    """Raise ValueError unless every request that arrived in the run is a request row or counted unfinished."""
    eng, req = res.window.table("engine"), res.window.table("request")
    if eng.empty or req.empty:
        raise ValueError(f"seed {res.seed}: the run has no engine or request rows")
    arrived = int(eng[M.engine_requests_arrived_total].iloc[-1])
    unfinished = res.engine.unfinished()
    if len(req) + unfinished != arrived:
        raise ValueError(f"seed {res.seed}: {arrived} requests arrived but {len(req)} rows landed and "
                         f"{unfinished} are unfinished")


def _max_waiting(res: repro.RunResult) -> float | None:
    eng = res.window.table("engine")
    if eng.empty or M.num_requests_waiting not in eng:
        return None
    return float(eng[M.num_requests_waiting].max())


def _le(v: float | None, bound: float) -> bool:
    return v is not None and not math.isnan(v) and v <= bound


def _ge(v: float | None, bound: float) -> bool:
    return v is not None and not math.isnan(v) and v >= bound


def verdicts(row: dict[str, Any]) -> dict[str, bool]:
    """Each criterion of the shape for one seed's :func:`measure`: True where it holds."""
    out = {
        "no_avalanche_ttft": _le(row["ttft_p50_ratio"], TTFT_P50_MAX_RATIO),
        "queue_drains": _le(row["queue_drain_s"], QUEUE_DRAIN_MAX_S),
        "tpot_p99_2x": _ge(row["tpot_p99_ratio"], TPOT_P99_MIN_RATIO),
        "long_tpot_p99_4x": _ge(row["long_tpot_p99_ratio"], LONG_TPOT_P99_MIN_RATIO),
        "util_dips": _le(row["util_min_during"], UTIL_DIP_MAX),
        "util_pegs": _ge(row["util_max_during"], UTIL_PEG_MIN),
    }
    if "paged_tpot_p999_ratio" in row:
        out["paged_removes_it"] = row["paged_evictions"] == 0 \
            and _le(row["paged_tpot_p999_ratio"], PAGED_TPOT_P999_MAX_RATIO)
    return out


def summary(rows: list[dict[str, Any]], key: str) -> dict[str, float | None]:
    """Median, min and max of one quantity over seeds (None where a seed has no value)."""
    vals = np.array([r[key] for r in rows if r.get(key) is not None], dtype=float)
    if not vals.size:
        return {"median": None, "min": None, "max": None, "seeds": 0}
    return {"median": float(np.median(vals)), "min": float(vals.min()), "max": float(vals.max()),
            "seeds": int(vals.size)}
