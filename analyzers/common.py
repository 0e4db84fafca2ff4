"""Shared helpers for analyzers: rates from counters, episodes from masks, percentiles."""

from __future__ import annotations

import numpy as np
import pandas as pd


def per_entity(df: pd.DataFrame, keys: list[str]):
    """Yield (key dict, sub-frame sorted by t) for each entity present in ``df``."""
    if df.empty:
        return
    present = [k for k in keys if k in df.columns]
    if not present:
        yield {}, df.sort_values("t")
        return
    for key, sub in df.groupby(present, sort=True, dropna=False):
        key = key if isinstance(key, tuple) else (key,)
        yield dict(zip(present, key)), sub.sort_values("t")


def windowed_rate(t: np.ndarray, counter: np.ndarray, window_s: float) -> np.ndarray:
    """Increase of a cumulative counter per second over the trailing ``window_s``.

    Counter resets (a restart) are treated as a new start, as Prometheus' rate() does.
    """
    inc = np.diff(counter, prepend=counter[:1])
    inc = np.where(inc < 0, counter, inc)
    csum = np.cumsum(inc)
    start = np.searchsorted(t, t - window_s, side="left")
    span = np.maximum(t - t[start], 1.0)
    return (csum - csum[start]) / span


def rolling_std(t: np.ndarray, x: np.ndarray, window_s: float) -> np.ndarray:
    """Standard deviation of ``x`` over the trailing ``window_s`` (population std)."""
    start = np.searchsorted(t, t - window_s, side="left")
    c1 = np.concatenate([[0.0], np.cumsum(x)])
    c2 = np.concatenate([[0.0], np.cumsum(x * x)])
    idx = np.arange(len(x)) + 1
    n = idx - start
    mean = (c1[idx] - c1[start]) / n
    var = np.maximum((c2[idx] - c2[start]) / n - mean * mean, 0.0)
    return np.sqrt(var)


def episodes(t: np.ndarray, mask: np.ndarray, merge_gap_s: float, min_duration_s: float = 0.0):
    """Spans [start, end] where ``mask`` holds, merging gaps up to ``merge_gap_s``."""
    out: list[list[float]] = []
    for ti in t[mask]:
        if out and ti - out[-1][1] <= merge_gap_s:
            out[-1][1] = ti
        else:
            out.append([ti, ti])
    return [(a, b) for a, b in out if b - a >= min_duration_s]


def percentile(values, q: float) -> float:
    """Percentile (0..100) of a sequence; NaN when empty."""
    arr = np.asarray(values, dtype=float)
    arr = arr[~np.isnan(arr)]
    if arr.size == 0:
        return float("nan")
    return float(np.percentile(arr, q))


def in_span(df: pd.DataFrame, start: float, end: float, col: str = "t") -> pd.DataFrame:
    """Rows with start <= df[col] <= end."""
    return df[(df[col] >= start) & (df[col] <= end)]


def linear_trend(t: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Least-squares slope of ``y`` over ``t`` and its t-statistic (slope / standard error).

    NaN samples are left out. The t-statistic is inf for a perfect line and
    0 when fewer than three samples or a single instant make a trend
    meaningless; (0.0, 0.0) then.
    """
    ok = ~(np.isnan(t) | np.isnan(y))
    t, y = t[ok], y[ok]
    n = t.size
    if n < 3:
        return 0.0, 0.0
    tc = t - t.mean()
    sxx = float(np.dot(tc, tc))
    if sxx <= 0:
        return 0.0, 0.0
    yc = y - y.mean()
    slope = float(np.dot(tc, yc)) / sxx
    resid = yc - slope * tc
    var = float(np.dot(resid, resid)) / (n - 2)
    if var <= 0:
        return slope, (float(np.copysign(np.inf, slope)) if slope else 0.0)
    return slope, slope / np.sqrt(var / sxx)


def labelled_total(values) -> np.ndarray:
    """Sum of a labelled metric's nested dict per row (``{"volatile": {"corrected": 1}}`` -> 1.0).

    Rows without the metric (None, NaN) are NaN, so an unobserved counter is
    never mistaken for a zero.
    """
    return np.array([_nested_sum(v) for v in values], dtype=float)


def _nested_sum(v) -> float:
    if isinstance(v, dict):
        parts = [_nested_sum(x) for x in v.values()]
        parts = [p for p in parts if not np.isnan(p)]
        return float(sum(parts)) if parts else float("nan")
    if v is None or isinstance(v, (str, bytes)):
        return float("nan")
    try:
        return float(v)
    except (TypeError, ValueError):
        return float("nan")


def counter_increase(values: np.ndarray) -> float:
    """Total increase of a cumulative counter over a series (NaN samples skipped; a reset restarts it)."""
    v = values[~np.isnan(values)]
    if v.size < 2:
        return 0.0
    inc = np.diff(v)
    return float(np.where(inc < 0, v[1:], inc).sum())


def subset(df: pd.DataFrame, key: dict, cols=("node", "gpu")) -> pd.DataFrame:
    """Rows of ``df`` matching ``key`` on the label columns both carry (a label absent on either side matches)."""
    if df.empty:
        return df
    for col in cols:
        if col in df and key.get(col) is not None and not _isnan(key.get(col)):
            df = df[df[col] == key[col]]
    return df


def _isnan(v) -> bool:
    return isinstance(v, float) and np.isnan(v)


def label_int(v):
    """An entity label (gpu, pid) as int, None when absent or NaN."""
    return None if v is None or _isnan(v) else int(v)
