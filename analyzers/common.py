"""Shared helpers for analyzers: rates from counters, episodes from masks, percentiles.

Tables come as pandas DataFrames or as :class:`~gpudiag.frames.Rows` (the
window's columnar rows, ``window.rows(kind)``); every helper takes both and
gives the same answer. On Rows, entity groups and label matches come from the
table's shared codes instead of a groupby or a comparison per call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from gpudiag.catalog import M
from gpudiag.findings import Finding
from gpudiag.frames import Column, DictColumn, LazyColumns, Rows, forward_fill, held_uniques, layout_groups

if TYPE_CHECKING:
    import pandas as pd


def per_entity(df: pd.DataFrame | Rows, keys: list[str]):
    """Yield (key dict, sub-frame sorted by t) for each entity present in ``df``."""
    if df.empty:
        return
    if isinstance(df, Rows):
        present = [k for k in keys if k in df]
        if not present:
            yield {}, df
            return
        for key, sub in df.groups(tuple(present)):
            yield dict(zip(present, key)), sub
        return
    present = [k for k in keys if k in df.columns]
    if not present:
        yield {}, df.sort_values("t")
        return
    for key, sub in df.groupby(present, sort=True, dropna=False):
        key = key if isinstance(key, tuple) else (key,)
        yield dict(zip(present, key)), sub.sort_values("t")


def trailing_start(t: np.ndarray, window_s: float) -> np.ndarray:
    """Per sample of sorted ``t``, the index of the first sample within the trailing ``window_s``.

    ``searchsorted(t, t - window_s, side="left")``. A long series sampled at a
    steady rate (every agent series) is answered from its mean spacing; only
    the samples that guess misses (gaps, jitter) are searched.
    """
    x = t - window_s
    n = len(t)
    if n < 4096 or not t[-1] > t[0]:
        return np.searchsorted(t, x, side="left")
    dt = (t[-1] - t[0]) / (n - 1)
    guess = np.clip(np.ceil((x - t[0]) / dt), 0, n).astype(np.int64)
    on, before = np.minimum(guess, n - 1), np.maximum(guess - 1, 0)
    wrong = ((t[on] < x) & (guess < n)) | ((t[before] >= x) & (guess > 0))
    guess[wrong] = np.searchsorted(t, x[wrong], side="left")
    return guess


def by_time(t: np.ndarray, *columns):
    """``t`` and ``columns`` (arrays or None) in time order: as they are when already sorted (rows
    of one entity are), else through one stable sort. Sorted rows let a span be cut as a slice."""
    if t.size < 2 or (t[1:] >= t[:-1]).all():
        return (t, *columns)
    order = np.argsort(t, kind="stable")
    return (t[order], *(None if c is None else c[order] for c in columns))


def at_or_before(tt: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Per time of ``t``, the index of the last sample of sorted ``tt`` at or before it (-1: none).

    Series sampled on the same clock (a GPU and its engine, one tick of the agent) map one to one.
    """
    if tt is t or (tt.shape == t.shape and np.array_equal(tt, t)):
        return np.arange(len(t))
    return np.searchsorted(tt, t, side="right") - 1


def windowed_increase(t: np.ndarray, counter: np.ndarray, window_s: float) -> np.ndarray:
    """Increase of a cumulative counter over the trailing ``window_s`` at each sample.

    Counter resets (a restart) are treated as a new start, as Prometheus' increase() does.
    """
    return _increase(counter, trailing_start(t, window_s))


def _increase(counter: np.ndarray, start: np.ndarray) -> np.ndarray:
    inc = np.diff(counter, prepend=counter[:1])
    csum = np.cumsum(np.where(inc < 0, counter, inc))
    return csum - csum[start]


def windowed_rate(t: np.ndarray, counter: np.ndarray, window_s: float) -> np.ndarray:
    """Increase of a cumulative counter per second over the trailing ``window_s`` (resets restart it)."""
    start = trailing_start(t, window_s)
    return _increase(counter, start) / np.maximum(t - t[start], 1.0)


def held_counter(rows, column: str) -> np.ndarray:
    """A counter column as floats; a sample without it (a scrape that missed it) holds the last value,
    and an absent column reads as zeros."""
    if column not in rows:
        return np.zeros(len(rows))
    return forward_fill(rows[column].to_numpy(float), lead=0.0)  # None reads as NaN


def rolling_std(t: np.ndarray, x: np.ndarray, window_s: float) -> np.ndarray:
    """Standard deviation of ``x`` over the trailing ``window_s`` (population std)."""
    start = trailing_start(t, window_s)
    c1 = np.concatenate([[0.0], np.cumsum(x)])
    c2 = np.concatenate([[0.0], np.cumsum(x * x)])
    idx = np.arange(len(x)) + 1
    n = idx - start
    mean = (c1[idx] - c1[start]) / n
    var = np.maximum((c2[idx] - c2[start]) / n - mean * mean, 0.0)
    return np.sqrt(var)


def episodes(t: np.ndarray, mask: np.ndarray, merge_gap_s: float, min_duration_s: float = 0.0):
    """Spans [start, end] where ``mask`` holds, merging gaps up to ``merge_gap_s``."""
    ts = t[mask]
    if not ts.size:
        return []
    breaks = np.flatnonzero(np.diff(ts) > merge_gap_s)
    starts = ts[np.concatenate([[0], breaks + 1])].tolist()
    ends = ts[np.concatenate([breaks, [ts.size - 1]])].tolist()
    return [(a, b) for a, b in zip(starts, ends) if b - a >= min_duration_s]


def percentile(values, q: float) -> float:
    """Percentile (0..100) of a sequence; NaN when empty.

    The same number as ``np.percentile(values, q)`` (linear method), computed
    from one partition: numpy's general path costs ten times more than the
    partition itself on the few thousand values of a latency bucket.
    """
    return percentiles(values, (q,))[0]


def percentiles(values, qs) -> list[float]:
    """:func:`percentile` of each of ``qs``, from one partition of the values."""
    arr = np.asarray(values, dtype=float)
    arr = arr[~np.isnan(arr)]
    n = arr.size
    if n == 0:
        return [float("nan")] * len(qs)
    if not all(isinstance(q, (int, float)) and 0 <= q <= 100 for q in qs):
        return [float(np.percentile(arr, q)) for q in qs]
    picks, kth = [], {0, n - 1}
    for q in qs:
        virtual = (n - 1) * (q / 100)  # numpy's virtual index for the linear method, same operations in order
        lo = float(np.floor(virtual))
        if virtual >= n - 1:
            i = j = n - 1
            lo = -1.0
        elif virtual < 0:
            i = j = 0
            lo = 0.0
        else:
            i = int(lo)
            j = i + 1
        picks.append((virtual, lo, i, j))
        kth.update((i, j))
    arr.partition(sorted(kth))
    out = []
    for virtual, lo, i, j in picks:
        out.append(_between(float(arr[i]), float(arr[j]), virtual - lo))
    return out


def _between(a: float, b: float, gamma: float) -> float:
    """numpy's linear interpolation at ``gamma`` from ``a`` to ``b`` (its operations, in its order)."""
    diff = b - a
    return b - diff * (1 - gamma) if gamma >= 0.5 else a + diff * gamma


# Below this many values a partition of them all is as cheap as finding the few above a bound.
TAIL_MIN_VALUES = 512


def tail_percentile(values, q: float) -> float:
    """:func:`percentile` of a high ``q`` (the same number), from the values above a bound.

    A high percentile depends on the few largest values alone. A bound guessed from a strided
    sample is checked to leave at least those above it, and only they are partitioned: a
    partition of every request's TPOT or latency costs several times more. A bound that leaves
    too few (or NaN among the values) falls back to :func:`percentile`.
    """
    arr = np.asarray(values, dtype=float)
    n = arr.size
    if n < TAIL_MIN_VALUES or not 50 < q < 100 or np.isnan(np.maximum.reduce(arr)):
        return percentile(arr, q)  # NaN (the greatest value is NaN): values percentile leaves out
    virtual = (n - 1) * (q / 100)  # percentiles' virtual index and interpolation, same operations
    lo = float(np.floor(virtual))
    i = int(lo)  # < n - 1, as q < 100: interpolates between the i-th and (i + 1)-th smallest
    need = n - i  # values at or above the i-th smallest
    sample = arr[::n // 128]
    m = sample.size
    r = min(m, 2 * need * m // n + 3)  # twice the sample's expected share of them, and some
    bound = float(np.partition(sample, m - r)[m - r])
    # A positive bound: -0.0 and 0.0 compare equal, and only a partition of all would pick between them.
    top = arr[arr >= bound] if bound > 0 else arr[:0]
    if top.size < need:
        return percentile(arr, q)
    at = i - (n - top.size)  # top holds the top.size largest values: the i-th smallest is its at-th
    top.partition([at, at + 1])
    return _between(float(top[at]), float(top[at + 1]), virtual - lo)


def in_span(df: pd.DataFrame | Rows, start: float, end: float, col: str = "t"):
    """Rows with start <= df[col] <= end."""
    return df[(df[col] >= start) & (df[col] <= end)]


def linear_trend(t: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Least-squares slope of ``y`` over ``t`` and its t-statistic (slope / standard error).

    NaN samples are left out. The t-statistic is inf for a perfect line and
    0 when fewer than three samples or a single instant make a trend
    meaningless; (0.0, 0.0) then.
    """
    bad = np.isnan(t) | np.isnan(y)
    if bad.any():
        t, y = t[~bad], y[~bad]
    n = t.size
    if n < 3:
        return 0.0, 0.0
    tc = t - _mean(t)
    sxx = float(np.dot(tc, tc))
    if sxx <= 0:
        return 0.0, 0.0
    yc = y - _mean(y)
    slope = float(np.dot(tc, yc)) / sxx
    resid = yc - slope * tc
    var = float(np.dot(resid, resid)) / (n - 2)
    if var <= 0:
        return slope, (float(np.copysign(np.inf, slope)) if slope else 0.0)
    return slope, slope / np.sqrt(var / sxx)


def _mean(x: np.ndarray):
    """``x.mean()`` (the same sum over the same count) without its wrapper, for the many small trends."""
    return np.add.reduce(x) / x.size if x.dtype == np.float64 else x.mean()


def labelled_total(values) -> np.ndarray:
    """Sum of a labelled metric's nested dict per row (``{"volatile": {"corrected": 1}}`` -> 1.0).

    Rows without the metric (None, NaN) are NaN, so an unobserved counter is
    never mistaken for a zero.
    """
    dc = values.dict_column() if isinstance(values, Column) else None
    if dc is not None:
        col, idx = dc
        return col.reduce(_numeric_leaves, idx, other_value=_nested_sum)
    return np.array([_nested_sum(v) for v in values], dtype=float)


def dict_keys(values) -> list[str]:
    """The top-level keys (as str, sorted) of the dict values of a labelled metric's rows."""
    dc = values.dict_column() if isinstance(values, Column) else None
    if dc is not None:
        col, idx = dc
        lay = col.layout if idx is None else col.layout[idx]
        return sorted({str(path[0]) for lid, _ in layout_groups(lay) if lid >= 0
                       for path, _ in col.layouts[lid]})
    return sorted({str(k) for v in values if isinstance(v, dict) for k in v})


def dict_total(values, *path, default: float = float("nan")) -> np.ndarray:
    """Per row, the total (as :func:`labelled_total`) of the value at ``path`` in its dict.

    A key is looked up as given, then as int for a string of digits (NVML's XID
    codes come either way); a path that is absent gives ``default``; a row
    that is not a dict, or a path through a non-dict value, gives NaN.
    """
    dc = values.dict_column() if isinstance(values, Column) else None
    if dc is not None:
        col, idx = dc
        return col.reduce(lambda layout: _select_path(layout, path, float(default)), idx,
                          other_value=lambda v: np.nan)
    return np.array([_walk_total(v, path, float(default)) if isinstance(v, dict) else np.nan for v in values],
                    dtype=float)


def dict_flag(values, key) -> np.ndarray:
    """Per row, whether its dict holds a true value under ``key`` (``isinstance(v, dict) and bool(v.get(key))``)."""
    dc = values.dict_column() if isinstance(values, Column) else None
    if dc is None:
        return np.array([isinstance(v, dict) and bool(v.get(key)) for v in values], dtype=bool)
    col, idx = dc
    lay = col.layout if idx is None else col.layout[idx]
    rows = np.arange(col.n) if idx is None else np.asarray(idx)
    out = np.zeros(len(lay), dtype=bool)
    for lid, at in layout_groups(lay):
        if lid < 0:
            continue
        leaf = [(p, kind) for p, kind in col.layouts[lid] if p[0] == key]
        if not leaf:
            continue
        (p, kind), deeper = leaf[0], len(leaf) > 1 or len(leaf[0][0]) > 1
        if deeper:
            out[at] = True  # a non-empty dict under the key
        elif kind in ("i", "f", "b"):
            out[at] = col.leaves[p][rows[at]] != 0  # NaN is true, as bool(nan)
        elif kind == "o":
            out[at] = [bool(col.objects[p][int(i)]) for i in rows[at].tolist()]
    return out


def _numeric_leaves(layout) -> list:
    return [p for p, kind in layout if kind in ("i", "f", "b")]


def _select_path(layout, path: tuple, default: float):
    """The numeric leaves under ``path`` in a row shape, or the row's value itself (default, NaN) as a float."""
    prefix: tuple = ()
    for key in path:
        under = [p for p, _ in layout if len(p) > len(prefix) and p[:len(prefix)] == prefix]
        if any(p == prefix for p, _ in layout) and prefix:
            return float("nan")  # the path goes through a value that is not a dict
        children = {p[len(prefix)] for p in under}
        if key in children:
            prefix = prefix + (key,)
        elif isinstance(key, str) and key.isdigit() and int(key) in children:
            prefix = prefix + (int(key),)
        else:
            return default
    return [p for p, kind in layout if kind in ("i", "f", "b") and p[:len(prefix)] == prefix]


def _walk_total(v: dict, path: tuple, default: float) -> float:
    node = v
    for key in path:
        if not isinstance(node, dict):
            return float("nan")
        if key in node:
            node = node[key]
        elif isinstance(key, str) and key.isdigit() and int(key) in node:
            node = node[int(key)]
        else:
            return default
    return _nested_sum(node)


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


def subset(df: pd.DataFrame | Rows, key: dict, cols=("node", "gpu")):
    """Rows of ``df`` matching ``key`` on the label columns both carry (a label absent on either side matches)."""
    if df.empty:
        return df
    if isinstance(df, Rows):
        want = {col: key[col] for col in cols
                if col in df and key.get(col) is not None and not _isnan(key.get(col))}
        return df.matching(want) if want else df
    for col in cols:
        if col in df and key.get(col) is not None and not _isnan(key.get(col)):
            df = df[df[col] == key[col]]
    return df


def still_per_entity(rows, keys: tuple[str, ...], columns: tuple[str, ...], *,
                     whole_numbers: bool = False) -> np.ndarray | None:
    """Per entity of ``per_entity(rows, keys)``, True when each of ``columns`` holds one value throughout
    (missing values aside; an absent or empty column counts).

    One reduction over the whole table instead of a copy and a min/max per entity: most
    processes of a node hold the same memory minute after minute. With ``whole_numbers``,
    the value must also be a whole number small enough that sums of it over the entity's
    samples are exact: such a series, or a sum of two, has an exact mean equal to its
    value, so a least-squares trend of it is exactly flat (:func:`linear_trend` gives slope
    0). None when not answerable so (rows that are not the whole table, a column kept other
    than as numbers, none of the columns there).
    """
    present = tuple(k for k in keys if k in rows)
    if not isinstance(rows, Rows) or not present:
        return None
    still = None
    for name in columns:
        got = rows.entity_column(present, name)
        if got is None:
            if name in rows:
                return None
            continue  # absent: never moves
        values, starts = got
        if values.dtype.kind not in "fiub":
            return None
        lo, hi = _entity_min_max(values, starts[:-1])
        flat = lo == hi
        if whole_numbers:
            with np.errstate(invalid="ignore"):
                # Twice the room: two such columns may be added before the trend is taken.
                flat &= (lo == np.round(lo)) & (2 * np.abs(lo) * np.diff(starts) < 2.0**53)
        ok = flat | np.isnan(lo)
        still = ok if still is None else still & ok
    return still


def only_zeros(window, kind: str, column: str) -> bool:
    """Whether every row of ``kind`` holds 0 or nothing in ``column`` (an absent column holds nothing).

    For the analyzers' ``may_find`` tests: False whenever it cannot tell (values that are not numbers).
    """
    if not window.has(kind, column):
        return True
    try:
        v = window.rows(kind)[column].to_numpy(float)
    except (TypeError, ValueError):
        return False
    return not bool(np.any(v[~np.isnan(v)]))


def constant_per_entity(window, kind: str, keys: tuple[str, ...], column: str) -> bool:
    """Whether ``column`` of ``kind`` holds one value per entity (missing values aside) over the window.

    A counter that never changes within an entity has no increase and no rate; the
    analyzers' ``may_find`` tests use it. A column of dicts (a counter by label) holds one
    value when every row of an entity has the same keys and each number under them holds
    one value. False whenever it cannot tell.
    """
    if not window.has(kind, column):
        return True
    table = window.columns(kind)
    present = tuple(k for k in keys if k in table.columns)  # as per_entity groups
    lazy = isinstance(table.columns, LazyColumns) and not table.columns.made(column)
    try:
        col = None if lazy else table.columns[column]  # a column not made yet is read from its source
        if not isinstance(col, DictColumn):
            if not present:
                return _one_value(window.rows(kind)[column].to_numpy(float), _ONE_ENTITY)
            got = table.entity_column(present, column)
            return got is not None and _one_value(got[0], got[1][:-1])
        if col.objects or col.other:
            return False  # values that are not dicts of numbers: not told here
        for values in (col.layout, *col.leaves.values()):
            if _one_value(values, _ONE_ENTITY):
                continue  # one value in every row: in every entity's too, without grouping them
            got = table.in_entity_order(present, values) if present else None
            if got is None or not _one_value(got[0], got[1][:-1]):
                return False
    except (TypeError, ValueError):
        return False
    return True


_ONE_ENTITY = np.zeros(1, dtype=np.int64)


def _entity_min_max(values: np.ndarray, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each entity's least and greatest value (NaN aside; NaN for an entity of NaN alone); ``starts``: where
    each entity's rows begin in ``values``, as floats.

    Reduced in the values' own type and then made floats: converting to float keeps order, so
    this is the min and max of the values as floats, without a float copy of a whole column.
    """
    v = values if isinstance(values, np.ndarray) and values.dtype.kind in "fiub" else np.asarray(values, dtype=float)
    at = np.asarray(starts, dtype=np.int64)
    lo, hi = np.fmin.reduceat(v, at), np.fmax.reduceat(v, at)
    return lo.astype(float, copy=False), hi.astype(float, copy=False)


def _one_value(values: np.ndarray, starts: np.ndarray) -> bool:
    """Whether every entity of ``values`` (rows from ``starts``) holds one value, missing values aside."""
    if not len(values):
        return True
    lo, hi = _entity_min_max(values, starts)
    return not bool(np.any(hi > lo))  # an entity with nothing but NaN gives NaN, which is no change


def _isnan(v) -> bool:
    return isinstance(v, float) and np.isnan(v)


def label_int(v):
    """An entity label (gpu, pid) as int, None when absent or NaN."""
    return None if v is None or _isnan(v) else int(v)


# --- the serving engine's own process and its KV -------------------------------------------------


@dataclass(frozen=True)
class EngineKV:
    """What one GPU's engine rows say of the engine's KV: who the engine is, and its KV over time."""

    names: frozenset  # the engine names its rows carry
    pids: frozenset  # the pids its rows state (NVML names a vLLM server "python3": the pid is what identifies it)
    t: np.ndarray
    reserved: np.ndarray  # engine_kv_reserved_bytes: KV allocated to requests
    capacity: float | None  # engine_kv_capacity_bytes at the last sample stating it; None when none does


# Rows up to which a label column's distinct values are read from its values: an entity's or a
# GPU's rows of a window (900 a quarter of an hour). The codes of a longer one come from the whole
# table's codes, made once and shared by every reader, but made first by merging the codes of
# every second's rows (a node's 115,000 process rows), which one entity's read does not repay.
SHORT_LABEL_ROWS = 4096


def label_values(col) -> set[str]:
    """The distinct values of a label column, as strings."""
    if len(col) <= SHORT_LABEL_ROWS:
        values = col.values if isinstance(col, Column) else np.asarray(col, dtype=object)
        try:
            return {str(v) for v in dict.fromkeys(values.tolist()) if not (v is None or v != v)}
        except (TypeError, ValueError):  # an unhashable or oddly comparing label: as the codes tell it
            pass
    got = col.codes() if hasattr(col, "codes") and callable(col.codes) else None
    if got is not None:
        return {str(u) for u in held_uniques(*got)}
    return set(col.dropna().astype(str))


def engine_identity(e) -> tuple[frozenset, frozenset]:
    """(engine names, pids) one GPU's engine rows carry: who the engine is, as they say it.

    A pid is what identifies the engine's process (NVML names a vLLM server "python3");
    without one, the process named as the engine is its.
    """
    names = frozenset(label_values(e["engine"])) if "engine" in e else frozenset()
    pids = frozenset(label_int(v) for v in dict.fromkeys(e["pid"].dropna().tolist())) if "pid" in e \
        else frozenset()
    return names, pids


def engine_kv(e) -> EngineKV | None:
    """:class:`EngineKV` of one GPU's engine rows; None without the KV they hold or a name or pid."""
    if e.empty or M.engine_kv_reserved_bytes not in e or ("engine" not in e and "pid" not in e):
        return None
    e = e[e[M.engine_kv_reserved_bytes].notna()]
    if e.empty:
        return None
    names, pids = engine_identity(e)
    capacity = None
    if M.engine_kv_capacity_bytes in e:
        stated = e[M.engine_kv_capacity_bytes].dropna()
        if not stated.empty:
            capacity = float(stated.iloc[-1])
    return EngineKV(names, pids, e["t"].to_numpy(float), e[M.engine_kv_reserved_bytes].to_numpy(float), capacity)


def engine_kv_of(p, pid, t: np.ndarray, allocated: np.ndarray, kv: EngineKV | None) -> np.ndarray | None:
    """The engine's KV bytes at ``t`` when process ``p`` (pid ``pid``, samples ``t``) is the engine's own,
    else None.

    The engine's process is a pid its rows state, else (they state none) the process
    named as the engine (:func:`engine_identity`). Its KV must fit in ``allocated`` (the process' allocated bytes,
    or any layer that holds them) at every sample, else it is not there.
    """
    if kv is None:
        return None
    if kv.pids:
        if pid not in kv.pids:
            return None
    elif "process" not in p or not label_values(p["process"]) & kv.names:
        return None
    at = np.interp(t, kv.t, kv.reserved)
    if np.nanmin(allocated - at) < 0:
        return None
    return at


# --- the window's clock: where its data begins and ends, and how often it is sampled ---------------

# Frame kinds sampled on a clock, a row per entity per tick: their spacing is the window's sample
# step. Request rows come when requests finish and eBPF rows when calls happen, on no clock. The
# process rows tick with the GPU's (NVML lists them together) and are many more: read only when
# no other clocked kind is there.
CLOCKED_KINDS = ("gpu", "engine", "node")
# A window of one tick (or none) has no spacing to read: the agent's default sampling interval.
DEFAULT_STEP_S = 1.0


@dataclass(frozen=True)
class KindSpan:
    """The rows of one frame kind in a window: how many, and the first and last sample time."""

    rows: int
    first_s: float
    last_s: float

    @property
    def seconds(self) -> float:
        """The time the rows span (0 for a single sample)."""
        return self.last_s - self.first_s


@dataclass(frozen=True)
class WindowClock:
    """A window as its samples tell it: the first and last sample time, the sampling step, each kind's span.

    ``step_s`` is the coarsest sampling interval among the clocked kinds (the median spacing of
    each kind's sample times): an analyzer reading a series sampled that often sees a change up
    to one step after it happened, so two findings' starts are only ordered beyond one step.
    """

    first_s: float
    last_s: float
    step_s: float
    kinds: dict[str, KindSpan] = field(default_factory=dict)


def window_clock(window) -> WindowClock:
    """The :class:`WindowClock` of ``window``; an empty window's is its ``start_s`` and ``end_s``, DEFAULT_STEP_S."""
    first, last = math.inf, -math.inf
    steps: list[float] = []
    kinds: dict[str, KindSpan] = {}
    for kind in window.tables:
        n = window.columns(kind).n
        if not n:
            continue
        t = window.rows(kind)["t"].to_numpy(float)
        lo, hi = float(t[0]), float(t[-1])  # a Table is sorted by t
        if math.isnan(lo) or math.isnan(hi):
            if np.isnan(t).all():
                continue
            lo, hi = float(np.nanmin(t)), float(np.nanmax(t))
        kinds[kind] = KindSpan(n, lo, hi)
        first, last = min(first, lo), max(last, hi)
        if kind in CLOCKED_KINDS:
            steps.append(sample_step_s(t))
    if not steps and "process" in kinds:
        steps.append(sample_step_s(window.rows("process")["t"].to_numpy(float)))
    steps = [s for s in steps if s > 0]
    if first > last:
        return WindowClock(float(window.start_s), float(window.end_s), DEFAULT_STEP_S, kinds)
    start = float(window.start_s)
    if math.isfinite(start) and first < start <= last:
        first = start  # rows before the window's start (a window cut from a wider table) are not its own
    return WindowClock(first, last, max(steps) if steps else DEFAULT_STEP_S, kinds)


def sample_step_s(t: np.ndarray) -> float:
    """The median spacing of the distinct times of sorted ``t`` (0.0 when fewer than two)."""
    gaps = np.diff(t)
    gaps = gaps[gaps > 0]
    return float(np.median(gaps)) if gaps.size else 0.0


def clamp_to_window(findings: list[Finding], clock: WindowClock) -> list[Finding]:
    """Keep every finding's span within the window's samples and flag those still going at its end.

    An analyzer may report a span wider than its data: a bucket that runs past the last sample,
    a start moved back by a rate's look-back beyond the first. A finding never starts before the
    first sample nor ends after the last; one that ends within a step of the last sample is
    ``open`` (the data ended, not the problem). The findings are changed in place and returned.
    """
    lo, hi = clock.first_s, clock.last_s
    for f in findings:
        start = min(max(f.start_s, lo), hi)
        end = min(max(f.end_s, start), hi)
        f.start_s, f.end_s = float(start), float(end)
        f.open = bool(end >= hi - clock.step_s)
    return findings
