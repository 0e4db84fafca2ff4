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
