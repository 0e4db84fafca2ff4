"""Frames and windows: the data that flows from probes to the store and the analyzers.

A probe yields a Frame per tick: one row (a plain dict) per entity — a GPU, a
process on a GPU, a serving engine, a finished request, the node, a (pid, CUDA
API) pair. Row keys are entity labels (``gpu``, ``uuid``, ``pid``,
``process``, ``node``, ``engine``, ``api``, ...) and metric columns from the
catalog (``M.gpu_utilization_ratio``, ...). Counters are cumulative, as in
Prometheus; analyzers take differences.

A Window is a time range of frames, one table per kind, each with a ``t``
column (seconds; simulated seconds on the simulated GPU, Unix time otherwise)
and sorted by it. Analyzers take a Window and return findings.

Two forms of one table:

* ``window.table(kind)``: a pandas DataFrame, for reports and offline tools;
* ``window.rows(kind)``: :class:`Rows`, the same rows read column by column
  from numpy arrays (:class:`Table`). It answers the part of the DataFrame
  interface the analyzers use (``col in rows``, ``rows[col].to_numpy(float)``,
  boolean masks, ``isna``/``notna``/``dropna``, ``iloc``, reductions, small
  ``groupby``) without building a DataFrame per entity, and hands anything
  else to a real DataFrame of the same rows. Entity groups and label codes are
  computed once per table and shared by every analyzer.

A window built by the agent holds only Tables (pandas is imported only if a
DataFrame is asked for), cut from one :class:`TableBuffer` per kind,
appended ten seconds at a time and cut at the front as the window slides,
which keeps each chunk's label codes and each entity's row positions as rows
come and go, so a window costs what its new rows cost. One built from
DataFrames (the store, Prometheus, ``from_rows``) reads them through a Table
made on first use. In a Table, values that are dicts of numbers (per-label
counters such as ``gpu_ecc_errors_total``) are kept as one float array per
leaf (:class:`DictColumn`), so a day of them is not millions of Python dicts.
"""

from __future__ import annotations

import itertools
import operator
import sys
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # pandas is imported where DataFrames are built: probes and the agent only need Frame and Table
    import pandas as pd

FRAME_KINDS = ("gpu", "process", "engine", "request", "node", "cuda_api")


@dataclass
class Frame:
    """One tick of one probe: rows of one entity kind at time ``t``."""

    kind: str
    t: float
    rows: list[dict[str, Any]]

    def __post_init__(self):
        if self.kind not in FRAME_KINDS:
            raise ValueError(f"unknown frame kind {self.kind!r}; expected one of {', '.join(FRAME_KINDS)}")


# --- value kinds ------------------------------------------------------------------------------

# The one NaN object a missing label or object value reads as: keys that hold it compare equal
# by identity (a tuple of two float("nan") objects does not).
NAN = float("nan")
# Per Python type, how a column of it is stored: i(nt), f(loat), b(ool), n(one), s(tr), d(ict), o(bject).
_KIND_OF_TYPE: dict[type, str] = {int: "i", float: "f", bool: "b", type(None): "n", str: "s", dict: "d"}


def _kind_of(tp: type) -> str:
    k = _KIND_OF_TYPE.get(tp)
    if k is None:
        if issubclass(tp, (bool, np.bool_)):
            k = "b"
        elif issubclass(tp, (int, np.integer)):
            k = "i"
        elif issubclass(tp, (float, np.floating)):
            k = "f"
        elif issubclass(tp, str):
            k = "s"
        elif issubclass(tp, dict):
            k = "d"
        else:
            k = "o"
        _KIND_OF_TYPE[tp] = k
    return k


def is_na(v) -> bool:
    return v is None or (isinstance(v, float) and v != v)


# --- frames as columns ------------------------------------------------------------------------

_NUMBER_OR_NONE = frozenset((int, float, type(None)))
LEAF_BOOLS = (bool, np.bool_)


def object_array(values: list) -> np.ndarray:
    """``values`` as a 1-D object array, each value as it is (numpy would nest lists and tuples)."""
    a = np.empty(len(values), dtype=object)
    a[:] = values
    return a


def column_array(values: list) -> np.ndarray:
    """A column as numpy: int64, float64 (None as NaN), bool or object (strings, dicts, mixed)."""
    # The Python types present decide the common columns at C speed: all floats, all ints, all
    # strings, numbers with gaps (a process without the torch columns; numpy reads None as NaN).
    types = set(map(type, values))
    if types == {float} or (len(types) > 1 and type(None) in types and types <= _NUMBER_OR_NONE):
        return np.array(values, dtype=np.float64)  # numbers with gaps: numpy reads None as NaN
    if str in types or dict in types:
        # A string or a dict makes any column objects, as it is (has_other below): strings, a
        # counter by kind per process, the tracker's missing_reasons, strings with gaps. numpy's
        # inference would only walk the dicts to find that out.
        return object_array(values)
    try:
        a = np.array(values)
    except (ValueError, OverflowError, TypeError):
        a = None
    # numpy's own inference is the fast path for the other all-number columns; None with
    # numpy numbers, lists and mixtures fall through to the explicit classification.
    # numpy makes True 1 among ints (1.0 among floats): a bool among numbers is classified below.
    if a is not None and a.ndim == 1 and len(a) == len(values) \
            and (a.dtype.kind == "b" or types.isdisjoint(LEAF_BOOLS)):
        if a.dtype.kind == "i":
            return a.astype(np.int64, copy=False)
        if a.dtype.kind == "f":
            return a.astype(np.float64, copy=False)
        if a.dtype.kind == "b":
            return a
    has_none = has_float = has_int = has_bool = has_other = False
    for v in values:
        if v is None:
            has_none = True
        elif isinstance(v, LEAF_BOOLS):
            has_bool = True
        elif isinstance(v, (int, np.integer)):
            has_int = True
        elif isinstance(v, (float, np.floating)):
            has_float = True
        else:  # strings, dicts (flattened when sealed), lists
            has_other = True
    if has_other or (has_bool and (has_int or has_float or has_none)):
        return object_array(values)
    if has_bool:
        return np.array(values, dtype=bool)
    if has_int and not has_float and not has_none:
        try:
            return np.array(values, dtype=np.int64)
        except OverflowError:  # an integer beyond int64 stays exact as an object
            return object_array(values)
    if not has_int and not has_float:  # all None
        return object_array(values)
    return np.array([np.nan if v is None else v for v in values], dtype=np.float64)


def _transpose(rows: list[dict], keys: tuple) -> dict[str, list]:
    if not keys:
        return {}
    if len(keys) == 1:
        return {keys[0]: [r[keys[0]] for r in rows]}
    return dict(zip(keys, (list(col) for col in zip(*map(operator.itemgetter(*keys), rows)))))


class FrameColumns:
    """The rows of frames of one kind as columns, made once where frames come in.

    The agent hands these to the store, which encodes them, and to its window, which builds
    its Table from them (:meth:`Table.from_columns`): each row is read once, right after its
    probe made it, instead of once by each (on a node of 8 GPUs x 16 processes serving 80
    requests a second, 260 rows a second).

    ``columns`` maps ``t`` (a row's own ``t`` where it has one, else its frame's) and every key
    any row has to a read-only array of :func:`column_array`'s dtypes, in row order. A row
    without a key holds None there, as a row whose value is None does; :meth:`absent` tells
    the two apart (a window holds NaN for a missing key, as pandas fills one).
    """

    __slots__ = ("kind", "n", "columns", "_shape_of", "_shapes", "_absent")

    def __init__(self, kind: str, n: int, columns: dict[str, np.ndarray],
                 shape_of: np.ndarray | None = None, shapes: list[frozenset] | None = None):
        self.kind, self.n, self.columns = kind, n, columns
        self._shape_of, self._shapes = shape_of, shapes
        self._absent: dict[str, np.ndarray | None] = {}

    @classmethod
    def of(cls, kind: str, frames: Iterable[Frame]) -> FrameColumns:
        """The rows of ``frames`` (all of ``kind``) as columns."""
        rows: list[dict] = []
        ts: list[float] = []
        for fr in frames:
            rows.extend(fr.rows)
            ts.extend([fr.t] * len(fr.rows))
        n = len(rows)
        # Rows of one probe usually share their keys: then transpose them in C (itemgetter + zip)
        # instead of looking every value up column by column.
        keyed = list(map(tuple, rows))
        shapes = dict.fromkeys(keyed)
        names: dict[str, None] = {"t": None}
        for keys in shapes:
            names.update(dict.fromkeys(keys))
        shape_of = None
        if len(shapes) == 1:
            (keys,) = shapes
            values = _transpose(rows, keys)
        else:  # rows of several shapes (processes with and without torch columns): None where a row lacks a key
            values = {k: list(map(dict.get, rows, itertools.repeat(k, n))) for k in names
                      if k != "t" or any("t" in keys for keys in shapes)}
            ids = {keys: i for i, keys in enumerate(shapes)}
            shape_of = np.fromiter(map(ids.__getitem__, keyed), dtype=np.int32, count=n)
        if "t" in values:  # a row's own t
            own = values.pop("t")
            ts = [fr_t if v is None else v for fr_t, v in zip(ts, own)]
        columns: dict[str, np.ndarray] = {"t": np.asarray(ts, dtype=np.float64)}
        for name in names:
            if name != "t":
                columns[name] = column_array(values[name])
        for a in columns.values():
            a.flags.writeable = False  # shared by the store and the window: neither may change it
        return cls(kind, n, columns, shape_of, None if shape_of is None else list(map(frozenset, shapes)))

    def absent(self, name: str) -> np.ndarray | None:
        """Which rows lack the key ``name`` (None: every row has it)."""
        if self._shape_of is None:
            return None
        got = self._absent.get(name, False)
        if got is False:
            lacks = np.array([name not in keys for keys in self._shapes])
            got = self._absent[name] = lacks[self._shape_of] if lacks.any() else None
        return got


class DictColumn:
    """A column of dict values (nested dicts of numbers) kept as one float array per leaf path.

    ``layout[i]`` names the row's shape (its leaf paths in insertion order,
    with each leaf's kind), or -1 when the row is not a dict; ``other`` holds
    the non-dict values by row (a row in neither is absent: NaN, as pandas
    fills a missing key). Leaves that
    are not numbers (None, strings, lists) are kept as objects in ``objects``
    and count as NaN in sums. Rows are rebuilt as dicts only when asked
    (:meth:`to_objects`).
    """

    __slots__ = ("n", "layout", "layouts", "leaves", "objects", "other")

    def __init__(self, n: int, layout: np.ndarray, layouts: list[tuple], leaves: dict[tuple, np.ndarray],
                 objects: dict[tuple, dict[int, Any]], other: dict[int, Any]):
        self.n = n
        self.layout = layout
        self.layouts = layouts
        self.leaves = leaves
        self.objects = objects
        self.other = other

    @classmethod
    def from_values(cls, n: int, pieces: list[tuple[np.ndarray | None, Iterable]]) -> DictColumn:
        """Build from (row positions, values) pieces; rows no piece covers are absent (NaN)."""
        layout = np.full(n, -1, dtype=np.int32)
        layout_ids: dict[tuple, int] = {}
        layouts: list[tuple] = []
        leaf_lists: dict[tuple, tuple[list, list]] = {}
        objects: dict[tuple, dict[int, Any]] = {}
        other: dict[int, Any] = {}
        covered = np.zeros(n, dtype=bool)
        flat: dict[tuple, tuple[list[int], list[dict]]] = {}  # rows of dicts with the same keys
        for positions, values in pieces:
            rows = range(n) if positions is None else positions.tolist()
            for i, v in zip(rows, values):
                if type(v) is dict:
                    keys = tuple(v)
                    bucket = flat.get(keys)
                    if bucket is None:
                        bucket = flat[keys] = ([], [])
                    bucket[0].append(i)
                    bucket[1].append(v)
                else:
                    covered[i] = True
                    if isinstance(v, dict):
                        _add_row(i, v, layout, layout_ids, layouts, leaf_lists, objects)
                    else:
                        other[i] = v
        for keys, (idx, dicts) in flat.items():
            covered[idx] = True
            columns = list(zip(*[d.values() for d in dicts])) if keys else []
            kinds = []
            for vals in columns:
                tps = set(map(type, vals))
                kind = _KIND_OF_TYPE.get(tps.pop()) if len(tps) == 1 else None
                if kind not in ("i", "f", "b"):
                    break
                kinds.append(kind)
            if len(kinds) < len(keys) or not keys:
                # Nested, mixed or empty dicts: row by row.
                for i, v in zip(idx, dicts):
                    _add_row(i, v, layout, layout_ids, layouts, leaf_lists, objects)
                continue
            shape = tuple(((k,), kind) for k, kind in zip(keys, kinds))
            lid = layout_ids.get(shape)
            if lid is None:
                lid = layout_ids[shape] = len(layouts)
                layouts.append(shape)
            layout[idx] = lid
            for k, vals in zip(keys, columns):
                lists = leaf_lists.get((k,))
                if lists is None:
                    lists = leaf_lists[(k,)] = ([], [])
                lists[0].extend(idx)
                lists[1].extend(vals)
        leaves = {}
        for path, (idx, vals) in leaf_lists.items():
            arr = np.full(n, np.nan)
            try:
                arr[np.asarray(idx, dtype=np.int64)] = np.asarray(vals, dtype=float)
            except OverflowError:
                arr[np.asarray(idx, dtype=np.int64)] = [float(x) for x in vals]
            leaves[path] = arr
        return cls(n, layout, layouts, leaves, objects, other)

    def take(self, idx: np.ndarray) -> DictColumn:
        """The rows at positions ``idx``."""
        idx = np.asarray(idx, dtype=np.int64)
        pos = {int(j): k for k, j in enumerate(idx.tolist())} if (self.objects or self.other) else {}
        objects = {p: {pos[i]: v for i, v in rows.items() if i in pos} for p, rows in self.objects.items()}
        other = {pos[i]: v for i, v in self.other.items() if i in pos}
        return DictColumn(len(idx), self.layout[idx], self.layouts, {p: a[idx] for p, a in self.leaves.items()},
                          objects, other)

    def slice(self, start: int, stop: int) -> DictColumn:
        """Rows ``start:stop`` (views of the leaf arrays)."""
        objects = {p: {i - start: v for i, v in rows.items() if start <= i < stop} for p, rows in self.objects.items()}
        other = {i - start: v for i, v in self.other.items() if start <= i < stop}
        return DictColumn(stop - start, self.layout[start:stop], self.layouts,
                          {p: a[start:stop] for p, a in self.leaves.items()}, objects, other)

    @classmethod
    def concat(cls, parts: list[DictColumn | None], sizes: list[int]) -> DictColumn:
        """Parts end to end; a None part is ``size`` absent rows."""
        n = sum(sizes)
        layouts: list[tuple] = []
        layout_ids: dict[tuple, int] = {}
        layout = np.full(n, -1, dtype=np.int32)
        leaves: dict[tuple, np.ndarray] = {}
        objects: dict[tuple, dict[int, Any]] = {}
        other: dict[int, Any] = {}
        off = 0
        for part, size in zip(parts, sizes):
            if part is None:
                off += size
                continue
            remap = []
            for lay in part.layouts:
                lid = layout_ids.get(lay)
                if lid is None:
                    lid = layout_ids[lay] = len(layouts)
                    layouts.append(lay)
                remap.append(lid)
            layout[off:off + size] = np.array(remap + [-1], dtype=np.int32)[part.layout]
            for path, arr in part.leaves.items():
                dest = leaves.get(path)
                if dest is None:
                    dest = leaves[path] = np.full(n, np.nan)
                dest[off:off + size] = arr
            for path, rows in part.objects.items():
                objects.setdefault(path, {}).update({off + i: v for i, v in rows.items()})
            other.update({off + i: v for i, v in part.other.items()})
            off += size
        return cls(n, layout, layouts, leaves, objects, other)

    def to_objects(self, idx: np.ndarray | None = None) -> np.ndarray:
        """The rows (at ``idx``, default all) as an object array of dicts and non-dict values."""
        rows = range(self.n) if idx is None else np.asarray(idx, dtype=np.int64).tolist()
        out = np.empty(len(rows), dtype=object)
        for k, i in enumerate(rows):
            lid = self.layout[i]
            if lid < 0:
                out[k] = self.other.get(i, NAN)
                continue
            d: dict = {}
            for path, kind in self.layouts[lid]:
                node = d
                for key in path[:-1]:
                    node = node.setdefault(key, {})
                if kind == "e":
                    value: Any = {}
                elif kind == "o":
                    value = self.objects[path][i]
                else:
                    x = self.leaves[path][i]
                    value = int(x) if kind == "i" else bool(x) if kind == "b" else float(x)
                node[path[-1]] = value
            out[k] = d
        return out

    def reduce(self, select, idx: np.ndarray | None = None, *, other_value=None) -> np.ndarray:
        """Per row, the sum of the numeric leaves ``select(layout)`` names; NaN when none is a number.

        ``select`` maps a row shape (tuple of (path, kind)) to the leaf paths to
        add, or to a float (the row's value itself, e.g. 0.0 for a default).
        ``other_value(v)`` gives the result for non-dict rows (default NaN).
        """
        lay = self.layout if idx is None else self.layout[idx]
        rows = np.arange(self.n) if idx is None else np.asarray(idx, dtype=np.int64)
        out = np.full(len(lay), np.nan)
        for lid, at in layout_groups(lay):
            if lid < 0:
                if other_value is not None:
                    out[at] = [other_value(self.other.get(int(i), NAN)) for i in rows[at].tolist()]
                continue
            chosen = select(self.layouts[lid])
            if isinstance(chosen, float):
                out[at] = chosen
                continue
            every = len(at) == len(lay)  # one shape for all rows: no per-shape selection
            where = (slice(None) if idx is None else rows) if every else rows[at]
            total = np.zeros(len(at))
            seen = np.zeros(len(at), dtype=bool)
            for path in chosen:
                v = self.leaves[path][where]
                ok = ~np.isnan(v)
                total += np.where(ok, v, 0.0)
                seen |= ok
            if every:
                out = np.where(seen, total, np.nan)
            else:
                out[at] = np.where(seen, total, np.nan)
        return out


def forward_fill(v: np.ndarray, *, lead: float | None = None) -> np.ndarray:
    """NaNs take the latest value before them (a sample that missed a series holds its last value);
    those before the first value take ``lead``, or the first value when ``lead`` is None.

    ``v`` itself is returned when nothing is missing, or when every value is and ``lead`` is None.
    """
    ok = ~np.isnan(v)
    if ok.all():
        return v
    if not ok.any():
        return v if lead is None else np.full(v.shape, lead, dtype=float)
    idx = np.where(ok, np.arange(v.size), 0)
    np.maximum.accumulate(idx, out=idx)
    out = v[idx]
    first = int(np.argmax(ok))
    out[:first] = v[first] if lead is None else lead
    return out


def layout_groups(lay: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """(layout id, row positions) per distinct id of ``lay``; one shape for every row is the usual case."""
    if not len(lay):
        return []
    lo, hi = int(lay.min()), int(lay.max())
    if lo == hi:
        return [(lo, np.arange(len(lay)))]
    return [(lid, np.flatnonzero(lay == lid)) for lid in np.unique(lay).tolist()]


def _add_row(i: int, v: dict, layout: np.ndarray, layout_ids: dict, layouts: list, leaf_lists: dict,
             objects: dict) -> None:
    shape: list[tuple] = []
    _flatten(v, (), i, shape, leaf_lists, objects)
    key = tuple(shape)
    lid = layout_ids.get(key)
    if lid is None:
        lid = layout_ids[key] = len(layouts)
        layouts.append(key)
    layout[i] = lid


def _flatten(d: dict, prefix: tuple, i: int, shape: list, leaf_lists: dict, objects: dict) -> None:
    if not d:
        if prefix:
            shape.append((prefix, "e"))
        return
    for k, v in d.items():
        path = prefix + (k,)
        tp = type(v)
        kind = _KIND_OF_TYPE.get(tp) or _kind_of(tp)
        if kind == "d":
            if v:
                _flatten(v, path, i, shape, leaf_lists, objects)
            else:
                shape.append((path, "e"))
            continue
        if kind in ("i", "f", "b"):
            lists = leaf_lists.get(path)
            if lists is None:
                lists = leaf_lists[path] = ([], [])
            lists[0].append(i)
            lists[1].append(v)
            shape.append((path, kind))
            continue
        objects.setdefault(path, {})[i] = v
        leaf_lists.setdefault(path, ([], []))
        shape.append((path, "o"))


# --- one kind as columns ------------------------------------------------------------------------


def _column_from_pieces(n: int, pieces: list[tuple[np.ndarray | None, tuple]], kinds: set[str]):
    """One column from (positions, values) pieces: int64, float64, bool, object or DictColumn, as pandas infers.

    Rows no piece covers are absent: NaN (they turn an int column into float,
    a bool column into object), as pandas fills a missing key.
    """
    covered = sum(len(v) for _, v in pieces)
    if "d" in kinds:
        return DictColumn.from_values(n, pieces)
    dtype = _plain_dtype(kinds, covered < n)
    if dtype is not None:
        try:
            return _scatter(n, pieces, dtype, fill_of(dtype))
        except (OverflowError, TypeError, ValueError):
            pass
    out = np.full(n, NAN, dtype=object)
    strings = kinds <= {"s", "n"}
    for positions, values in pieces:
        vals = np.empty(len(values), dtype=object)
        vals[:] = list(values)
        if strings:  # pandas' string columns hold NaN for None and for absent values alike
            vals[np.equal(vals, None)] = NAN
        if positions is None:
            out[:] = vals
        else:
            out[positions] = vals
    return out


def _column_from_chunks(name: str, chunks: list[FrameColumns], sizes: list[int], n: int):
    """One column of Table.from_columns: what _column_from_pieces makes of the same rows' values.

    A chunk's number array holds its rows' numbers as _column_from_pieces would read them, but for
    numbers with gaps (None), which it holds as floats and NaN: they give a float column either way;
    only in a column that also holds other values (strings, bools) do they stay so among its objects.
    """
    parts: list[tuple[int, np.ndarray, np.ndarray | None, list | None]] = []  # (first row, array, absent, objects)
    kinds: set[str] = set()
    missing = False
    at = 0
    for c, size in zip(chunks, sizes):
        a = c.columns.get(name)
        if a is None:
            missing = True
        else:
            absent = c.absent(name)
            if absent is not None:
                missing = True
            values = None
            if a.dtype.kind in "ifb":
                kinds.add(a.dtype.kind)
            else:  # objects: the kinds of the values of the rows that have the key
                values = a.tolist() if absent is None else list(itertools.compress(a.tolist(), ~absent))
                kinds.update(_KIND_OF_TYPE.get(tp) or _kind_of(tp) for tp in set(map(type, values)))
            parts.append((at, a, absent, values))
        at += size
    if "d" in kinds:
        pieces = []
        for start, a, absent, values in parts:
            rows = np.arange(start, start + len(a)) if absent is None else start + np.flatnonzero(~absent)
            if values is None:  # a number part: its values are read here
                values = a.tolist() if absent is None else list(itertools.compress(a.tolist(), ~absent))
            pieces.append((None if len(rows) == n else rows, values))
        return DictColumn.from_values(n, pieces)
    dtype = _plain_dtype(kinds, missing)
    if dtype is not None:
        try:
            out = np.full(n, fill_of(dtype), dtype=dtype)
            for start, a, _, values in parts:  # objects (all None, huge ints) value by value, as _scatter
                out[start:start + len(a)] = a if values is None else np.array(a.tolist(), dtype=dtype)
            return out
        except (OverflowError, TypeError, ValueError):
            pass
    out = np.full(n, NAN, dtype=object)
    strings = kinds <= {"s", "n"}
    for start, a, absent, _ in parts:
        vals = a.astype(object)
        if strings:  # pandas' string columns hold NaN for None and for absent values alike
            vals[np.equal(vals, None)] = NAN
        elif absent is not None:
            vals[absent] = NAN
        out[start:start + len(a)] = vals
    return out


def _plain_dtype(kinds: set[str], missing: bool) -> np.dtype | None:
    """The numpy dtype of a column of values of ``kinds`` (_KIND_OF_TYPE's letters, no dicts), as pandas
    infers it; None: objects. Rows without the key (``missing``) are NaN: an int column turns float, a
    bool column objects."""
    if kinds <= {"i"} and not missing:
        return np.dtype(np.int64)
    if kinds <= {"i", "f", "n"} and "b" not in kinds:
        return np.dtype(np.float64)
    if kinds <= {"b"} and not missing:
        return np.dtype(np.bool_)
    return None


def _scatter(n: int, pieces, dtype, fill) -> np.ndarray:
    if len(pieces) == 1 and pieces[0][0] is None:
        return np.array(pieces[0][1], dtype=dtype)
    out = np.full(n, fill, dtype=dtype)
    for positions, values in pieces:
        out[positions] = np.array(values, dtype=dtype)
    return out


def concat_columns(parts: list, sizes: list[int]):
    """Columns of one name from consecutive tables (None where a table lacks it), promoted as pandas.concat does."""
    present = [p for p in parts if p is not None]
    if any(isinstance(p, DictColumn) for p in present):
        if all(isinstance(p, DictColumn) for p in present):
            return DictColumn.concat(parts, sizes)
        parts = [p.to_objects() if isinstance(p, DictColumn) else p for p in parts]
        present = [p for p in parts if p is not None]
    dtypes = {p.dtype for p in present}
    missing = len(present) < len(parts)
    if len(dtypes) == 1 and not missing:
        return np.concatenate(parts) if len(parts) > 1 else parts[0]
    kinds = {d.kind for d in dtypes}
    if kinds <= {"i", "u", "f"}:
        dtype, fill = np.float64, np.nan
    else:
        dtype, fill = object, NAN
    out = []
    for p, size in zip(parts, sizes):
        if p is None:
            out.append(np.full(size, fill, dtype=dtype))
        else:
            out.append(p.astype(dtype) if p.dtype != dtype else p)
    return np.concatenate(out)


def _take(col, idx):
    return col.take(idx) if isinstance(col, DictColumn) else col[idx]


def factorize(values: np.ndarray) -> tuple[np.ndarray, list]:
    """(codes, uniques): codes index the sorted uniques, -1 for NaN/None; ints by a dense lookup when they allow."""
    n = len(values)
    if values.dtype.kind in "iub":
        # uint64 stays unsigned: as int64, values from 2**63 up would wrap to negatives.
        v = values.astype(np.uint64 if values.dtype.kind == "u" else np.int64, copy=False)
        if n == 0:
            return np.zeros(0, dtype=np.int64), []
        lo, hi = int(v.min()), int(v.max())
        if hi - lo <= 4 * n + 4096:
            offset = v - v.dtype.type(lo) if lo else v
            seen = np.zeros(hi - lo + 1, dtype=bool)
            seen[offset] = True
            lut = np.cumsum(seen, dtype=np.int64)
            lut -= 1
            uniq = np.flatnonzero(seen).astype(v.dtype) + v.dtype.type(lo)
            uniques = uniq.astype(bool).tolist() if values.dtype.kind == "b" else uniq.tolist()
            return lut[offset], uniques
        uniq, codes = np.unique(v, return_inverse=True)
        return codes.astype(np.int64), uniq.tolist()
    if values.dtype.kind == "f":
        ok = ~np.isnan(values)
        codes = np.full(n, -1, dtype=np.int64)
        if not ok.any():
            return codes, []
        finite = values[ok]
        whole = finite == np.round(finite)
        if whole.all() and np.abs(finite).max() < 2**52:
            sub, uniq = factorize(finite.astype(np.int64))
            codes[ok] = sub
            return codes, [float(u) for u in uniq]
        uniq, sub = np.unique(finite, return_inverse=True)
        codes[ok] = sub
        return codes, uniq.tolist()
    return _factorize_objects(values)


def _factorize_objects(values: np.ndarray) -> tuple[np.ndarray, list]:
    if len(values) > 50_000 and "pandas" in sys.modules:  # already loaded: its hash table is ten times faster
        import pandas as pd

        try:
            codes, uniques = pd.factorize(values, use_na_sentinel=True)
        except TypeError:  # unhashable values (lists): below, by their repr
            pass
        else:
            return sorted_codes(codes.astype(np.int64), list(uniques))
    lookup: dict = {}
    codes = np.empty(len(values), dtype=np.int64)
    na = []
    for i, v in enumerate(values.tolist()):
        if v is None or v != v:
            na.append(i)
            continue
        try:
            codes[i] = lookup.setdefault(v, len(lookup))
        except TypeError:  # unhashable (a list): equal lists share a code
            codes[i] = lookup.setdefault(repr(v), len(lookup))
    uniques = list(lookup)
    codes[na] = -1
    return sorted_codes(codes, uniques)


def sorted_codes(codes: np.ndarray, uniques: list) -> tuple[np.ndarray, list]:
    """Renumber codes so that they index ``uniques`` sorted (as groupby orders keys); unsortable ones keep order."""
    try:
        order = sorted(range(len(uniques)), key=uniques.__getitem__)
    except TypeError:
        return codes, uniques
    rank = np.empty(len(uniques) + 1, dtype=np.int64)
    rank[np.asarray(order, dtype=np.int64)] = np.arange(len(uniques))
    rank[-1] = -1
    return rank[codes], [uniques[i] for i in order]


class LazyColumns(MutableMapping):
    """A Table's columns of which some are made when first read, then kept.

    A window read from the store decodes ``t`` and the labels it is cut and grouped by;
    every other column is decoded the first time a reader asks for it, so the columns no
    analyzer reads (a day of a node holds hundreds of megabytes of them) cost nothing.
    Names iterate in the order given; ``in`` never makes a column.
    """

    def __init__(self, order: list[str], have: dict[str, Any], pending: dict[str, Any], *,
                 any_value=None, values_at=None, kinds: Mapping[str, str] | None = None):
        self._order = list(order)
        # What a pending column will be when made, where known: "dict" (a DictColumn, or objects),
        # "object" (an object array) or "numeric" (a numeric array).
        self._kinds = dict(kinds or {})
        self._have = have
        self._pending = pending  # name: function making the column
        # Answers about a column not made yet, from where it is kept, without making it
        # (None from either: not known that way, make the column).
        self._any_value = any_value  # (name) -> bool | None: whether any row holds a value
        self._values_at = values_at  # (name, positions) -> array | None: the values at some rows

    def __getitem__(self, name: str):
        try:
            return self._have[name]
        except KeyError:
            make = self._pending.pop(name)  # KeyError: no such column
        try:
            col = self._have[name] = make()
        except BaseException:
            self._pending[name] = make  # a failed read (damaged chunk) fails again, and says so again
            raise
        return col

    def __contains__(self, name) -> bool:
        return name in self._have or name in self._pending

    def __iter__(self) -> Iterator[str]:
        return iter([name for name in self._order if name in self])

    def __len__(self) -> int:
        return len(self._have) + len(self._pending)

    def __setitem__(self, name: str, col) -> None:
        self._pending.pop(name, None)
        if name not in self._have:
            self._order.append(name)
        self._have[name] = col

    def __delitem__(self, name: str) -> None:
        if name not in self:
            raise KeyError(name)
        self._pending.pop(name, None)
        self._have.pop(name, None)
        self._order.remove(name)

    def made(self, name: str) -> bool:
        """Whether the column is already made (reading it costs nothing)."""
        return name in self._have

    def kind(self, name: str) -> str | None:
        """"dict", "object" or "numeric" for a column (made or not) where known without making it; else None."""
        col = self._have.get(name)
        if col is not None:
            return "dict" if isinstance(col, DictColumn) else "object" if col.dtype == object else "numeric"
        return self._kinds.get(name) if name in self._pending else None

    def any_value(self, name: str) -> bool | None:
        """Whether a column not made yet holds any value, when its source can tell without making it; else None."""
        if name in self._have or name not in self._pending or self._any_value is None:
            return None
        return self._any_value(name)

    def values_at(self, name: str, positions: np.ndarray):
        """The column's values at ``positions`` (a few rows: a column not made yet stays so where its source allows)."""
        if name in self._pending and self._values_at is not None:
            got = self._values_at(name, positions)
            if got is not None:
                return got
        col = self[name]
        return col.to_objects(positions) if isinstance(col, DictColumn) else col[positions]


class Table:
    """Rows of one kind as columns: numpy arrays (int64, float64, bool, object) or DictColumns, sorted by ``t``.

    Caches what several analyzers ask for: label codes per column, row groups
    per set of key columns, which columns hold a value. A Table made from a
    DataFrame keeps it (``source``) so that anything handed to pandas sees the
    very rows it came from.
    """

    def __init__(self, n: int, columns: dict[str, Any], source: pd.DataFrame | None = None,
                 codes: dict[str, tuple[np.ndarray, list]] | None = None):
        self.n = n
        self.columns = columns
        self.source = source
        self._codes: dict[str, tuple[np.ndarray, list]] = dict(codes or {})  # known label codes, e.g. a chunk's
        # Where codes come from without factorizing this table's values again: the parts it
        # was joined from, the table it was cut from (None: factorize).
        self._code_source = None
        self._group_source = None  # entity groups from a TableBuffer's index (None: sort)
        self._distinct_source = None  # a column's distinct values without its codes (None: from the codes)
        self._distinct: dict[str, tuple] = {}
        # keys -> (column name -> that column in the order of those groups, or None), for columns not made yet
        self._direct_source = None
        self.pool: BufferPool | None = None  # memory for entity-order copies handed on between analyses
        self._groups: dict[tuple, tuple[list, np.ndarray, np.ndarray, np.ndarray]] = {}
        self._has: dict[str, bool] = {}
        self._lookup: dict[str, dict] = {}
        self._lookups: dict[tuple, dict[tuple, int]] = {}
        self._entities: dict[tuple, list[tuple[tuple, Rows]]] = {}
        self._frame = None

    def __len__(self) -> int:
        return self.n

    def set_sources(self, *, codes: Callable[[str], tuple[np.ndarray, list] | None] | None = None,
                    groups: Callable[[tuple], tuple[list[tuple], list[np.ndarray]] | None] | None = None,
                    direct: Callable[[tuple], Callable[[str], np.ndarray | None] | None] | None = None,
                    distinct: Callable[[str], list | None] | None = None) -> Table:
        """Where this table takes what it would otherwise compute from its values; returns the table.

        Whoever made the table may know more than its values tell: the parts it was joined
        from, the chunks it was read from, an index kept as rows came in. Each source is a
        function that answers, or answers None to let the table compute it:

        * ``codes(name)``: (codes, sorted uniques) of an object column, as :meth:`codes` gives them;
        * ``groups(keys)``: what :meth:`groups` returns for ``keys``;
        * ``direct(keys)``: a function making a column not made yet straight in the order of
          those groups (or None), for :meth:`entity_column`;
        * ``distinct(name)``: a column's distinct values without its codes, for :meth:`distinct`.

        A source left out keeps the one the table has.
        """
        if codes is not None:
            self._code_source = codes
        if groups is not None:
            self._group_source = groups
        if direct is not None:
            self._direct_source = direct
        if distinct is not None:
            self._distinct_source = distinct
        return self

    def has_codes(self, name: str) -> bool:
        """Whether column ``name``'s label codes are known already (handed in or made), without making them."""
        return name in self._codes

    # -- building ------------------------------------------------------------------------------
    @classmethod
    def from_frames(cls, frames: Iterable[tuple[float, list[dict[str, Any]]]], skip: tuple = ()) -> Table:
        """The rows of (t, rows) ticks, each row with its tick's ``t``; keys in ``skip`` are left out.

        Rows with the same keys are transposed together (C-level getters), so the
        cost is a few dict and tuple operations per row, not per value.
        """
        groups: dict[tuple, tuple[list[int], list[dict]]] = {}
        ts: list[float] = []
        pos = 0
        for t, rows in frames:
            for r in rows:
                keys = tuple(r)
                g = groups.get(keys)
                if g is None:
                    g = groups[keys] = ([], [])
                g[0].append(pos)
                g[1].append(r)
                pos += 1
            ts.extend([t] * len(rows))
        n = pos
        pieces: dict[str, list] = {}
        kinds: dict[str, set] = {}
        for keys, (positions, rows) in groups.items():
            names = [k for k in keys if k != "t" and k not in skip]
            if not names:
                continue
            where = None if len(positions) == n else np.asarray(positions, dtype=np.int64)
            if len(names) == 1:
                cols = [[r[names[0]] for r in rows]]
            else:
                cols = list(zip(*map(operator.itemgetter(*names), rows)))
            for name, vals in zip(names, cols):
                pieces.setdefault(name, []).append((where, vals))
                ks = kinds.setdefault(name, set())
                ks.update(_KIND_OF_TYPE.get(tp) or _kind_of(tp) for tp in set(map(type, vals)))
        columns: dict[str, Any] = {"t": np.asarray(ts, dtype=np.float64)}
        for name, ps in pieces.items():
            columns[name] = _column_from_pieces(n, ps, kinds[name])
        table = cls(n, columns)
        return table.sorted()

    @classmethod
    def from_columns(cls, chunks: list[FrameColumns], skip: tuple = ()) -> Table:
        """The rows of ``chunks`` (of one kind, in order) as :meth:`from_frames` makes them from the
        frames they came from, but for each row's own ``t``, which counts here; keys in ``skip`` are left out.

        Each column's chunk arrays are joined (numbers as they are, no row read again); only
        object columns are looked at value by value, for their kinds.
        """
        if not chunks:
            return cls(0, {"t": np.zeros(0)})
        sizes = [c.n for c in chunks]
        n = sum(sizes)
        names = dict.fromkeys(k for c in chunks for k in c.columns if k != "t" and k not in skip)
        times = [c.columns["t"] for c in chunks]
        columns: dict[str, Any] = {"t": np.concatenate(times) if len(times) > 1 else times[0].copy()}
        for name in names:
            columns[name] = _column_from_chunks(name, chunks, sizes, n)
        return cls(n, columns).sorted()

    @classmethod
    def from_frame(cls, df: pd.DataFrame) -> Table:
        """The DataFrame's columns as arrays (kept as its source; sorted by ``t`` if it is not)."""
        n = len(df)
        if "t" in df.columns:
            t = df["t"].to_numpy(dtype=float)
            if n > 1 and not (np.diff(t) >= 0).all():
                df = df.iloc[np.argsort(t, kind="stable")]
        columns = {}
        for name in df.columns:
            s = df[name]
            arr = s.to_numpy()
            if arr.dtype.kind not in "iufbO":
                arr = s.to_numpy(dtype=object)
            columns[name] = arr
        return cls(n, columns, source=df)

    @classmethod
    def concat(cls, tables: list[Table]) -> Table:
        """Tables end to end (columns promoted as pandas.concat promotes them); label codes are merged, not redone."""
        tables = [t for t in tables if t.n]
        if len(tables) == 1:
            return tables[0]
        sizes = [t.n for t in tables]
        names = list(dict.fromkeys(name for t in tables for name in t.columns))
        columns = {name: concat_columns([t.columns.get(name) for t in tables], sizes) for name in names}
        out = cls(sum(sizes), columns)

        def from_parts(name):
            arr = columns[name]
            if isinstance(arr, np.ndarray) and arr.dtype == object \
                    and all(isinstance(t.columns.get(name), np.ndarray) and t.columns[name].dtype == object
                            for t in tables):
                return merge_codes([t.codes(name) for t in tables])
            return None

        out.set_sources(codes=from_parts)
        return out.sorted()

    def sorted(self) -> Table:
        """This table, sorted by ``t`` (stable) when it is not already."""
        t = self.columns.get("t")
        if t is None or self.n < 2 or (t[1:] >= t[:-1]).all():
            return self
        return self.take(np.argsort(t, kind="stable"))

    def with_columns(self, names) -> Table:
        """The same rows with only the columns ``names`` it has (codes kept)."""
        columns = {k: self.columns[k] for k in names if k in self.columns}
        out = Table(self.n, columns, codes={k: v for k, v in self._codes.items() if k in columns})
        return out.set_sources(codes=self._code_source)

    def take(self, idx: np.ndarray) -> Table:
        """The rows at positions ``idx`` as a new table."""
        idx = np.asarray(idx, dtype=np.int64)
        out = Table(len(idx), {name: _take(col, idx) for name, col in self.columns.items()},
                    None if self.source is None else self.source.iloc[idx])
        out.set_sources(codes=lambda name: cut_codes(self.codes(name), idx))
        return out

    def slice(self, start: int, stop: int) -> Table:
        """Rows ``start:stop`` (views of the arrays where they allow)."""
        if start == 0 and stop >= self.n:
            return self
        if self.source is not None:
            return self.take(np.arange(start, stop))
        out = Table(stop - start, {name: (col.slice(start, stop) if isinstance(col, DictColumn) else col[start:stop])
                                   for name, col in self.columns.items()})
        out.set_sources(codes=lambda name: cut_codes(self.codes(name), slice(start, stop)))
        return out

    # -- reading -----------------------------------------------------------------------------
    def codes(self, name: str) -> tuple[np.ndarray, list]:
        """(codes, sorted uniques) of a column: equal values share a code, NaN/None is -1."""
        got = self._codes.get(name)
        if got is None:
            col = self.columns[name]
            if self._code_source is not None and isinstance(col, np.ndarray) and col.dtype == object:
                got = self._code_source(name)
            if got is None:
                got = factorize(col.to_objects() if isinstance(col, DictColumn) else col)
            self._codes[name] = got
        return got

    def distinct(self, name: str) -> list:
        """The distinct values of a column (NaN/None aside), each once, in no set order.

        The codes' uniques, but a table kept in a TableBuffer answers from the codes of its
        chunks without making the codes of its rows (115,000 of a node's process rows). Kept
        once made: a window's analyzers ask it once per engine.
        """
        got = self._distinct.get(name)
        if got is None:
            if self._distinct_source is not None:
                got = self._distinct_source(name)
            if got is None:
                # The uniques of codes merged from chunks may hold a value only rows cut from the oldest held.
                got = held_uniques(*self.codes(name))
            got = self._distinct[name] = tuple(got)
        return list(got)

    def code_of(self, name: str, value) -> int | None:
        """The code ``value`` has in column ``name`` (None when no row holds it; NaN matches nothing, as ``==``)."""
        if is_na(value):
            return None
        lookup = self._lookup.get(name)
        if lookup is None:
            uniques = self.codes(name)[1]
            try:
                lookup = {u: i for i, u in enumerate(uniques)}
            except TypeError:
                lookup = {}
            self._lookup[name] = lookup
        try:
            return lookup.get(value)
        except TypeError:
            return None

    def values_at(self, name: str, positions: np.ndarray) -> np.ndarray:
        """Column ``name`` at table rows ``positions`` (dicts rebuilt); a column not made yet stays so where it can."""
        if isinstance(self.columns, LazyColumns):
            return self.columns.values_at(name, positions)
        col = self.columns[name]
        return col.to_objects(positions) if isinstance(col, DictColumn) else col[positions]

    def has_values(self, name: str) -> bool:
        """Whether the column exists and holds at least one non-missing value."""
        got = self._has.get(name)
        if got is None:
            if name in self._codes:  # labels: their codes tell, without making a column of them
                self._has[name] = got = bool((self._codes[name][0] >= 0).any())
                return got
            if isinstance(self.columns, LazyColumns):
                got = self.columns.any_value(name)
                if got is not None:
                    self._has[name] = got
                    return got
            col = self.columns.get(name)
            if col is None:
                got = False
            elif isinstance(col, DictColumn):
                got = bool((col.layout >= 0).any()) or any(not is_na(v) for v in col.other.values())
            else:
                got = bool(np.any(~_isna_array(col)))
            self._has[name] = got
        return got

    def groups(self, keys: tuple[str, ...]) -> tuple[list[tuple], list[np.ndarray]]:
        """(group keys in groupby order, each group's row positions in table order, so by ``t``) for ``keys``.

        Missing labels form their own groups, sorted last per key, as
        ``groupby(..., sort=True, dropna=False)`` does. A table cut from a
        TableBuffer takes them from the buffer's entity index (no sort).
        """
        got = self._groups.get(keys)
        if got is None:
            if self._group_source is not None:
                got = self._group_source(keys)
            if got is None:
                group_keys, order, starts, _ = _group(self, None, keys)
                got = (group_keys, [order[starts[g]:starts[g + 1]] for g in range(len(group_keys))])
            self._groups[keys] = got
        return got

    def entity_rows(self, keys: tuple[str, ...]) -> list[tuple[tuple, Rows]]:
        """(key values, Rows) per group of :meth:`groups`, made once per table."""
        got = self._entities.get(keys)
        if got is None:
            group_keys, parts = self.groups(keys)
            layout = _GroupLayout(parts, self.pool)
            if self._direct_source is not None:
                layout.direct = self._direct_source(keys)
            got = self._entities[keys] = [(key, Rows(self, part, layout=(layout, g)))
                                          for g, (key, part) in enumerate(zip(group_keys, parts))]
        return got

    def entity_column(self, keys: tuple[str, ...], name: str) -> tuple[np.ndarray, np.ndarray] | None:
        """(column ``name`` in the group order of :meth:`entity_rows`, each group's start and end) or None.

        For a reduction over every entity at once (``np.fmax.reduceat(values, starts[:-1])``)
        instead of one per entity; the entities' own reads share the copy. None when the
        table has no such column, no rows, or keeps it other than as a numpy array.
        """
        if name not in self.columns or not self.n:
            return None
        layout = self._group_layout(keys)
        if layout is None:
            return None
        lazy = isinstance(self.columns, LazyColumns) and not self.columns.made(name)
        got = layout.ordered(name, lambda: self.columns[name], lazy)
        return None if got is None else (got, layout.starts)

    def in_entity_order(self, keys: tuple[str, ...], values: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """:meth:`entity_column` for any array with one value per row of this table (a dict column's leaf).

        The copy is made once per array (kept with the groups until :meth:`release`).
        """
        if not self.n or len(values) != self.n:
            return None
        layout = self._group_layout(keys)
        return None if layout is None else (layout._copy_of(values), layout.starts)

    def _group_layout(self, keys: tuple[str, ...]) -> _GroupLayout | None:
        entities = self.entity_rows(keys)
        return entities[0][1]._layout[0] if entities else None

    def lookup(self, keys: tuple[str, ...]) -> dict[tuple, int]:
        """Group number per key tuple of :meth:`groups` (groups with a missing label cannot be looked up)."""
        got = self._lookups.get(keys)
        if got is None:
            got = self._lookups[keys] = {k: g for g, k in enumerate(self.groups(keys)[0])
                                         if not any(is_na(v) for v in k)}
        return got

    def release(self) -> None:
        """Drop what was computed for readers (groups, their gathered rows, codes, sources).

        Those caches point back at the table (each group's rows hold it, the
        sources are closures over it), so a table dropped with them in place
        waits for the cycle collector, and a long window's copies with it.
        """
        for entities in self._entities.values():
            for _, rows in entities:
                rows.release()
        self._groups.clear()
        self._entities.clear()
        self._lookups.clear()
        self._lookup.clear()
        self._distinct.clear()
        self._code_source = self._group_source = self._direct_source = self._distinct_source = None
        self._frame = None

    def frame(self) -> pd.DataFrame:
        """The table as a pandas DataFrame (its source when it came from one)."""
        if self.source is not None:
            return self.source
        if self._frame is None:
            import pandas as pd

            data = {name: (col.to_objects() if isinstance(col, DictColumn) else col)
                    for name, col in self.columns.items()}
            self._frame = pd.DataFrame(data, index=pd.RangeIndex(self.n))
        return self._frame


def cut_codes(got: tuple[np.ndarray, list], where) -> tuple[np.ndarray, list]:
    codes, uniques = got
    return codes[where], uniques


def held_uniques(codes: np.ndarray, uniques: list) -> list:
    """The values of ``uniques`` that ``codes`` hold (-1: none), in their order there.

    Codes cut from longer ones (a chunk that lost rows, a subset) keep the uniques of all the
    rows they were made from.
    """
    return [uniques[k] for k in np.flatnonzero(np.bincount(codes[codes >= 0], minlength=len(uniques))).tolist()]


def merge_codes(parts: list[tuple[np.ndarray, list]]) -> tuple[np.ndarray, list]:
    lookup: dict = {}
    remaps = []
    for _, uniques in parts:
        remaps.append(np.array([lookup.setdefault(u, len(lookup)) for u in uniques] + [-1], dtype=np.int64))
    uniques = list(lookup)
    try:  # renumber the small remaps to the sorted order, so the long codes are written once
        order = sorted(range(len(uniques)), key=uniques.__getitem__)
    except TypeError:
        order = None
    if order is not None:
        rank = np.empty(len(uniques) + 1, dtype=np.int64)
        rank[np.asarray(order, dtype=np.int64)] = np.arange(len(uniques))
        rank[-1] = -1
        remaps = [rank[remap] for remap in remaps]
        uniques = [uniques[i] for i in order]
    codes = np.empty(sum(len(c) for c, _ in parts), dtype=np.int64)
    at = 0
    for (c, _), remap in zip(parts, remaps):
        np.take(remap, c, out=codes[at:at + len(c)])
        at += len(c)
    return codes, uniques


def _isna_array(col: np.ndarray) -> np.ndarray:
    kind = col.dtype.kind
    if kind == "f":
        return np.isnan(col)
    if kind in "iub":
        return np.zeros(len(col), dtype=bool)
    return np.fromiter((v is None or v != v for v in col.tolist()), dtype=bool, count=len(col))


def _dense(codes: np.ndarray) -> tuple[np.ndarray, int]:
    """Renumber non-negative codes 0..k-1 keeping their order; (codes, k)."""
    if not len(codes):
        return codes.astype(np.int64), 0
    top = int(codes.max())
    if top < 8 * len(codes) + 65536:
        seen = np.zeros(top + 1, dtype=bool)
        seen[codes] = True
        lut = np.cumsum(seen) - 1
        return lut[codes], int(lut[-1]) + 1
    uniq, dense = np.unique(codes, return_inverse=True)
    return dense.astype(np.int64), len(uniq)


def _group(table: Table, idx: np.ndarray | None, keys: tuple[str, ...]):
    """Group rows (all, or ``idx``) of ``table`` by ``keys``: (keys, order, starts, group code per row).

    ``order`` holds table positions; groups are numbered in key order (sorted
    values, the missing label last per key).
    """
    levels = []
    combined = None
    for name in keys:
        codes, uniques = table.codes(name)
        if idx is not None:
            codes = codes[idx]
        # The missing label sorts last: code len(uniques). A column without one is used as it is.
        c = np.where(codes < 0, len(uniques), codes) if len(codes) and codes.min() < 0 else codes
        levels.append((c, uniques))
        width = len(uniques) + 1
        if combined is None:
            combined = np.asarray(c, dtype=np.int64)
        else:
            if len(combined) and int(combined.max()) >= (2**62) // width:
                combined, _ = _dense(combined)
            combined = combined * width + c
    n = table.n if idx is None else len(idx)
    if combined is None:
        combined = np.zeros(n, dtype=np.int64)
    dense, n_groups = _dense(combined)
    small = dense.astype(np.uint16) if n_groups < 65536 else dense
    local = np.argsort(small, kind="stable")  # radix sort on 16-bit codes: linear, and keeps t order
    counts = np.bincount(dense, minlength=n_groups)
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    first = local[starts[:-1]]
    columns = [[uniques[j] if j < len(uniques) else NAN for j in c[first].tolist()] for c, uniques in levels]
    group_keys = list(zip(*columns)) if columns else [() for _ in range(n_groups)]
    order = local if idx is None else idx[local]
    return group_keys, order, starts, dense


# --- a sliding table ------------------------------------------------------------------------------


def _promote(a: np.dtype, b: np.dtype) -> np.dtype:
    """The dtype pandas.concat gives two columns of dtypes ``a`` and ``b``."""
    if a == b:
        return a
    if a.kind in "iuf" and b.kind in "iuf":
        return np.dtype(np.float64)
    return np.dtype(object)


def live_dtype(signatures: list) -> np.dtype | None:
    """The dtype of the join of chunks whose column had these dtypes (None: the chunk lacked it)."""
    present = [d for d in signatures if d is not None]
    if not present:
        return None
    dtypes = set(present)
    if len(dtypes) == 1 and len(present) == len(signatures):
        return present[0]
    if all(d.kind in "iuf" for d in dtypes):
        return np.dtype(np.float64)
    return np.dtype(object)


def _readonly(view: np.ndarray) -> np.ndarray:
    """A view that cannot be written through (a window's rows are shared by every later window)."""
    view.flags.writeable = False
    return view


def fill_of(dtype: np.dtype):
    return {"f": np.nan, "O": NAN, "b": False}.get(dtype.kind, 0)


class _Chunk:
    """Where one appended chunk's rows are in a TableBuffer, its newest t, its column dtypes, its label codes."""

    __slots__ = ("start", "stop", "max_t", "dtypes", "codes")

    def __init__(self, start: int, stop: int, max_t: float, dtypes: dict[str, Any]):
        self.start, self.stop, self.max_t, self.dtypes = start, stop, max_t, dtypes
        self.codes: dict[str, tuple[np.ndarray, list]] = {}


class _DictBuffer:
    """A DictColumn with spare capacity (see TableBuffer); every appended row is written, so room is left unset."""

    def __init__(self, cap: int):
        self.layout = np.full(cap, -1, dtype=np.int32)
        self.layouts: list[tuple] = []
        self._ids: dict[tuple, int] = {}
        self.leaves: dict[tuple, np.ndarray] = {}
        self.objects: dict[tuple, dict[int, Any]] = {}
        self.other: dict[int, Any] = {}

    def moved(self, cap: int, start: int, stop: int) -> _DictBuffer:
        """A copy with capacity ``cap`` holding rows ``start:stop`` at the front."""
        out = _DictBuffer(cap)
        live = stop - start
        out.layout[:live] = self.layout[start:stop]
        out.layouts, out._ids = self.layouts, self._ids
        for path, arr in self.leaves.items():
            dest = out.leaves[path] = np.empty(cap)
            dest[:live] = arr[start:stop]
        out.objects = {p: {i - start: v for i, v in rows.items() if start <= i < stop}
                       for p, rows in self.objects.items()}
        out.other = {i - start: v for i, v in self.other.items() if start <= i < stop}
        return out

    def write(self, col, s: int, e: int) -> None:
        """Rows ``s:e`` from a DictColumn, or from plain values (kept as non-dict values), or absent (None)."""
        if not isinstance(col, DictColumn):
            self.layout[s:e] = -1
            for arr in self.leaves.values():
                arr[s:e] = np.nan
            if col is not None:
                for i, v in enumerate(col.tolist()):
                    if not (isinstance(v, float) and v != v):
                        self.other[s + i] = v
            return
        remap = []
        for lay in col.layouts:
            lid = self._ids.get(lay)
            if lid is None:
                lid = self._ids[lay] = len(self.layouts)
                self.layouts.append(lay)
            remap.append(lid)
        self.layout[s:e] = np.array(remap + [-1], dtype=np.int32)[col.layout]
        cap = len(self.layout)
        for path, arr in col.leaves.items():
            dest = self.leaves.get(path)
            if dest is None:
                dest = self.leaves[path] = np.full(cap, np.nan)
            dest[s:e] = arr
        for path, dest in self.leaves.items():
            if path not in col.leaves:
                dest[s:e] = np.nan
        for path, rows in col.objects.items():
            self.objects.setdefault(path, {}).update({s + i: v for i, v in rows.items()})
        self.other.update({s + i: v for i, v in col.other.items()})

    def view(self, a: int, b: int) -> DictColumn:
        """Rows ``a:b`` as a DictColumn (views of the leaf arrays)."""
        objects = {p: {i - a: v for i, v in rows.items() if a <= i < b} for p, rows in self.objects.items()}
        other = {i - a: v for i, v in self.other.items() if a <= i < b} if self.other else {}
        return DictColumn(b - a, _readonly(self.layout[a:b]), self.layouts,
                          {p: _readonly(arr[a:b]) for p, arr in self.leaves.items()}, objects, other)

    def forget_before(self, start: int) -> None:
        """Drop the objects of rows before ``start`` (the arrays are reused when the buffer moves)."""
        if self.other:
            self.other = {i: v for i, v in self.other.items() if i >= start}
        for path, rows in list(self.objects.items()):
            self.objects[path] = {i: v for i, v in rows.items() if i >= start}


_STATES = itertools.count()


class _EntityIndex:
    """Where each entity's rows are in a TableBuffer (for one set of key columns), kept up as rows come and go.

    Per entity a growing array of buffer positions and the first one still
    kept; a window's groups are then one slice per entity, not a sort of every row.
    """

    def __init__(self, keys: tuple[str, ...]):
        self.keys = keys
        self._pos: dict[tuple, list] = {}  # key -> [positions, used, first kept]

    def add(self, key: tuple, positions: np.ndarray) -> None:
        """Positions (ascending, after any already held) of one entity's new rows."""
        entry = self._pos.get(key)
        if entry is None:
            entry = self._pos[key] = [np.empty(max(64, 2 * len(positions)), dtype=np.int64), 0, 0]
        arr, used, _ = entry
        if used + len(positions) > len(arr):
            grown = np.empty(2 * (used + len(positions)), dtype=np.int64)
            grown[:used] = arr[:used]
            arr = entry[0] = grown
        arr[used:used + len(positions)] = positions
        entry[1] = used + len(positions)

    def add_table(self, chunk: Table, offset: int) -> None:
        """The rows of a chunk written at ``offset``."""
        group_keys, order, starts, _ = _group(chunk, None, self.keys)
        for g, key in enumerate(group_keys):
            self.add(key, order[starts[g]:starts[g + 1]] + offset)

    def drop_before(self, start: int) -> None:
        """Forget positions before ``start``."""
        for key in list(self._pos):
            entry = self._pos[key]
            arr, used, lo = entry
            lo += int(np.searchsorted(arr[lo:used], start))
            if lo == used:
                del self._pos[key]
            else:
                entry[2] = lo

    def shift(self, by: int) -> None:
        """The buffer moved its rows ``by`` positions towards the front."""
        for entry in self._pos.values():
            arr, used, lo = entry
            kept = arr[lo:used] - by
            entry[0] = np.empty(max(64, 2 * len(kept)), dtype=np.int64)
            entry[0][:len(kept)] = kept
            entry[1], entry[2] = len(kept), 0

    def window(self, table: Table, a: int) -> tuple[list[tuple], list[np.ndarray]] | None:
        """(keys, positions) per entity of a window starting at buffer position ``a``, in groupby order."""
        entries = []
        for arr, used, lo in self._pos.values():
            part = arr[lo:used] - a
            first = int(part[0])
            key = []
            for name in self.keys:
                col = table.columns.get(name)
                if not isinstance(col, np.ndarray):
                    return None
                v = col[first]
                v = v.item() if isinstance(v, np.generic) else v
                key.append(NAN if is_na(v) else v)
            entries.append((tuple(key), part))
        try:
            entries.sort(key=lambda kp: tuple((1, 0) if is_na(v) else (0, v) for v in kp[0]))
        except TypeError:  # labels of mixed types: the sort by codes decides
            return None
        return [k for k, _ in entries], [p for _, p in entries]


class TableBuffer:
    """One kind's rows over a sliding time range: chunks appended at the end, old rows dropped at the front.

    Columns live in arrays with spare capacity, so appending writes only the new
    rows and :meth:`table` hands out views: nothing already kept is copied again
    (the arrays move, once, when the spare room is used up). The Table it gives
    is what joining the kept chunks with :meth:`Table.concat` gives: the same
    column types (a column widened by chunks that have left is narrowed back)
    and label codes merged from the per-chunk ones. Chunks must come in ``t``
    order; one that does not is sorted in, at the cost of one copy.
    """

    def __init__(self, capacity: int = 0):
        self._cap = 0
        self._start = 0
        self._stop = 0
        self._cols: dict[str, Any] = {}
        self._chunks: deque[_Chunk] = deque()
        self._reserve = capacity  # rows to make room for at the first append (a known window size)
        self._indexes: dict[tuple, _EntityIndex] = {}
        self._version = next(_STATES)  # new at every append, drop and move: a table of an older state sorts itself

    def __len__(self) -> int:
        return self._stop - self._start

    @property
    def capacity(self) -> int:
        """Rows the arrays hold room for."""
        return self._cap

    def append(self, chunk: Table) -> None:
        """Add a chunk's rows after the kept ones."""
        if not chunk.n:
            return
        t_new = chunk.columns["t"]
        if self._stop > self._start and t_new[0] < self._cols["t"][self._stop - 1]:
            joined = Table.concat([self.table(), chunk])
            self.__init__()
            self.append(joined)
            return
        if self._stop + chunk.n > self._cap:
            # A quarter of spare room: the kept rows move once per that many new rows, and memory stays
            # within 1.25x of the window.
            self._move(max(1024, self._reserve, int(1.25 * (len(self) + chunk.n)) + chunk.n))
            self._reserve = 0
        s, e = self._stop, self._stop + chunk.n
        for name in dict.fromkeys([*self._cols, *chunk.columns]):
            self._write(name, chunk.columns.get(name), s, e)
        self._stop = e
        dtypes = {name: ("dict" if isinstance(col, DictColumn) else col.dtype) for name, col in chunk.columns.items()}
        record = _Chunk(s, e, float(t_new[-1]), dtypes)
        record.codes = {name: got for name, got in chunk._codes.items()
                        if isinstance(chunk.columns.get(name), np.ndarray) and chunk.columns[name].dtype == object}
        self._chunks.append(record)
        for keys, index in list(self._indexes.items()):
            if all(isinstance(chunk.columns.get(k), np.ndarray) for k in keys if k in self._cols):
                index.add_table(chunk.with_columns(keys), s)
            else:
                del self._indexes[keys]
        self._version = next(_STATES)

    def drop_until(self, t: float) -> None:
        """Forget the rows with ``t`` at or before ``t``."""
        if self._stop == self._start:
            return
        times = self._cols["t"][self._start:self._stop]
        self._start += int(np.searchsorted(times, t, side="right"))
        self._version = next(_STATES)
        for index in self._indexes.values():
            index.drop_before(self._start)
        while self._chunks and self._chunks[0].stop <= self._start:
            self._chunks.popleft()
        if self._start == self._stop:
            self.__init__()
        else:
            for buf in self._cols.values():
                if isinstance(buf, _DictBuffer):
                    buf.forget_before(self._start)

    def _move(self, cap: int) -> None:
        """New arrays of ``cap`` rows with the kept rows at the front."""
        start, stop = self._start, self._stop
        live = stop - start
        # One column at a time, each old array let go as its new one takes its place: holding
        # them all (a list of the items) until the end doubled the buffer's memory for a moment.
        for name in list(self._cols):
            buf = self._cols[name]
            if isinstance(buf, _DictBuffer):
                self._cols[name] = buf.moved(cap, start, stop)
            else:
                new = np.empty(cap, dtype=buf.dtype)
                new[:live] = buf[start:stop]
                self._cols[name] = new
        for index in self._indexes.values():
            index.shift(start)
        self._version = next(_STATES)
        for c in self._chunks:
            cut = max(start - c.start, 0)  # rows of a chunk already dropped: its codes lose them too
            if cut:
                c.codes = {name: (codes[cut:], uniques) for name, (codes, uniques) in c.codes.items()}
            c.start, c.stop = c.start + cut - start, c.stop - start
        self._cap, self._start, self._stop = cap, 0, live

    def _write(self, name: str, col, s: int, e: int) -> None:
        buf = self._cols.get(name)
        if buf is None:  # a new column: the rows before are absent
            if isinstance(col, DictColumn):
                buf = _DictBuffer(self._cap)
            else:
                dtype = col.dtype if col.dtype.kind in "fO" else (np.dtype(np.float64) if col.dtype.kind in "iu"
                                                                 else np.dtype(object))
                if self._stop == self._start:
                    dtype = col.dtype  # nothing before it: its own type
                buf = np.full(self._cap, fill_of(dtype), dtype=dtype)
            self._cols[name] = buf
        if isinstance(buf, _DictBuffer):
            buf.write(col, s, e)
            return
        if isinstance(col, DictColumn):  # dict values arrive in a plain column: keep both kinds as one
            dbuf = _DictBuffer(self._cap)
            dbuf.write(buf[self._start:self._stop], self._start, self._stop)
            dbuf.write(col, s, e)
            self._cols[name] = dbuf
            return
        if col is None:
            if buf.dtype.kind not in "fO":
                buf = self._cols[name] = buf.astype(np.float64 if buf.dtype.kind in "iu" else object)
            buf[s:e] = fill_of(buf.dtype)
            return
        target = _promote(buf.dtype, col.dtype)
        if target != buf.dtype:
            buf = self._cols[name] = buf.astype(target)
        buf[s:e] = col

    def table(self) -> Table:
        """The kept rows as a Table of views (codes merged from the chunks' on first use)."""
        a, b = self._start, self._stop
        chunks = list(self._chunks)
        columns: dict[str, Any] = {}
        for name, buf in self._cols.items():
            sigs = [c.dtypes.get(name) for c in chunks]
            if all(sig is None for sig in sigs):
                continue
            if isinstance(buf, _DictBuffer):
                columns[name] = buf.view(a, b)
                continue
            view = _readonly(buf[a:b])
            want = live_dtype(sigs)
            if want is not None and want != view.dtype:
                view = view.astype(want)
            columns[name] = view
        out = Table(b - a, columns)
        cols = self._cols

        def chunk_codes(name):
            """Each chunk's (codes, uniques) of the kept rows of an object column (None: not one)."""
            col = columns[name]
            if not (isinstance(col, np.ndarray) and col.dtype == object) or cols.get(name) is None:
                return None
            full = cols[name]
            parts = []
            for c in chunks:
                got = c.codes.get(name)
                if got is None:
                    got = c.codes[name] = factorize(full[c.start:c.stop])
                lo = max(a - c.start, 0)
                parts.append(got if lo == 0 else (got[0][lo:], got[1]))
            return parts

        def from_chunks(name):
            parts = chunk_codes(name)
            return None if parts is None else merge_codes(parts)

        def distinct(name):
            parts = chunk_codes(name)
            if parts is None:
                return None
            seen: dict = {}
            for i, (codes, uniques) in enumerate(parts):
                if i == 0:
                    # Only the oldest chunk loses rows (cut at the window's start, or when the buffer
                    # moved) while its uniques stay as factorized: the values its rows still hold.
                    uniques = held_uniques(codes, uniques)
                seen.update(dict.fromkeys(uniques))
            return list(seen)

        out.set_sources(codes=from_chunks, distinct=distinct)
        version = self._version

        def from_index(keys):
            if self._version != version or any(not isinstance(columns.get(k), np.ndarray) for k in keys
                                               if k in columns):
                return None
            index = self._indexes.get(keys)
            if index is None:  # first asked for: sort this window once, then keep it up
                group_keys, order, starts, _ = _group(out, None, keys)
                index = self._indexes[keys] = _EntityIndex(keys)
                for g, key in enumerate(group_keys):
                    index.add(key, order[starts[g]:starts[g + 1]] + a)
            return index.window(out, a)

        return out.set_sources(groups=from_index)


# --- DataFrame-like views ------------------------------------------------------------------------


def _even_step(idx: np.ndarray) -> int:
    """The step between positions ``idx`` when they are evenly spaced (an entity sampled every tick), else 0."""
    n = len(idx)
    if n < 2:
        return 0
    step = int(idx[1] - idx[0])
    if step > 0 and int(idx[-1]) == int(idx[0]) + step * (n - 1) and (np.diff(idx) == step).all():
        return step
    return 0


def _even_slice(idx: np.ndarray, step: int | None = None) -> slice | bool:
    """``idx`` as a slice when it is long and evenly spaced, else False (``step``: its :func:`_even_step`)."""
    if len(idx) > 1024:  # a slice reads such an entity twice as fast as an index array
        step = _even_step(idx) if step is None else step
        if step:
            return slice(int(idx[0]), int(idx[-1]) + 1, step)
    return False


class BufferPool:
    """Memory for one analysis' entity-order copies (:class:`_GroupLayout`), handed on to the next.

    A streaming analysis reads a window of the same entities and seconds every few seconds, so it
    makes the same copies as the one before: on the benchmark's node (8 GPUs x 16 processes,
    15 minutes) about 8 MB in some thirty arrays. Made afresh, every page of them is a page fault
    the kernel zero-fills, half of an analysis' faults. A buffer is handed out again only once
    nothing made from it is alive: a bytearray refuses to change size while any array or view
    holds its memory, so a trial resize is the test (whatever the interpreter's reference counts).
    What one analysis did not take is let go at the next :meth:`settle`, so the pool holds at
    most one analysis' copies.
    """

    SLACK = 1 / 16  # room for a window's rows to grow between analyses (it fills 10 s of 900 at a time)

    def __init__(self):
        self._kept: list[bytearray] = []  # taken by the last analysis
        self._taken: list[bytearray] = []  # by this one

    def array(self, n: int, dtype) -> np.ndarray:
        """A writable array of ``n`` values of ``dtype`` (contents undefined), from a free kept buffer if one fits."""
        dtype = np.dtype(dtype)
        need = n * dtype.itemsize
        if dtype.hasobject or not need:
            return np.empty(n, dtype=dtype)
        best = None
        for i, buf in enumerate(self._kept):
            if need <= len(buf) <= need + 2 * self.SLACK * need + 4096 \
                    and (best is None or len(buf) < len(self._kept[best])) and _unexported(buf):
                best = i
        buf = bytearray(need + int(self.SLACK * need)) if best is None else self._kept.pop(best)
        self._taken.append(buf)
        return np.frombuffer(buf, dtype=dtype, count=n)

    def settle(self) -> None:
        """An analysis is over: what it took is kept for the next, what it left is let go."""
        self._kept, self._taken = self._taken, []

    @property
    def nbytes(self) -> int:
        """Bytes the pool holds."""
        return sum(map(len, self._kept)) + sum(map(len, self._taken))


def _unexported(buf: bytearray) -> bool:
    """Whether no array or memoryview holds ``buf``'s memory (it can change size; left as it was)."""
    if not buf:
        return True
    try:
        last = buf.pop()
    except BufferError:
        return False
    buf.append(last)
    return True


class _GroupLayout:
    """A table's rows in entity-major order, column by column, for the entity groups that read them all.

    A window holds each entity's rows interleaved with every other entity's
    (one row per entity per tick), so copying one entity's column reads a
    cache line for every value it keeps. Once a good share of the groups has
    read a column (``SHARE``), the whole column is copied into group order in
    cache-sized blocks of time, every group's piece of a block together, which
    reads each line once; each group then reads its own slice of that copy.
    """

    SHARE = 8  # one group in eight: below that, the groups asking copy their own rows
    BLOCK_ROWS = 1 << 18  # table rows per block: 2 MiB of float64, within a core's cache
    # Values per transposed block of a matrix: 64 KiB of float64, within a core's L2, where a
    # transpose (which reads rows and writes columns) runs about twice as fast as from L3.
    TRANSPOSE_VALUES = 1 << 13

    def __init__(self, parts: list[np.ndarray], pool: BufferPool | None = None):
        self.parts = parts
        self.pool = pool
        sizes = np.fromiter((len(p) for p in parts), dtype=np.int64, count=len(parts))
        self.starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.threshold = max(2, len(parts) // self.SHARE)
        self.asks: dict[int, int] = {}
        self.copies: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # id(column): (column, its copy)
        self.steps: list[slice | bool] | None = None  # and the rest of the plan, made on the first copy
        # A column in group order made straight from where it is kept (a store window's chunks,
        # stored grouped by entity), without the table's own column; None: copy from that.
        self.direct: Callable[[str], np.ndarray | None] | None = None
        self.made: dict[str, np.ndarray | None] = {}

    def _direct_whole(self, name: str) -> np.ndarray | None:
        """The column ``name`` in group order made from its source, once; None: not so."""
        if self.direct is None:
            return None
        got = self.made.get(name, False)
        if got is False:
            got = self.direct(name)
            self.made[name] = got = None if got is None else _readonly(got)
        return got

    def _copy_of(self, col: np.ndarray) -> np.ndarray:
        """``col`` in group order, copied once."""
        got = self.copies.get(id(col))
        if got is None:
            got = self.copies[id(col)] = (col, self._copy(col))
        return got[1]

    def gathered_directly(self, name: str, g: int) -> np.ndarray | None:
        """Group ``g``'s rows of the table's column ``name``, made in group order from its source; None: not so."""
        got = self._direct_whole(name)
        return None if got is None else got[self.starts[g]:self.starts[g + 1]]

    def ordered(self, name: str, col: Callable[[], Any], direct_first: bool) -> np.ndarray | None:
        """The whole column ``name`` in group order (group ``g`` at ``starts[g]:starts[g+1]``), read-only.

        Made from where it is kept when ``direct_first`` (a column not made yet), else
        copied from ``col()``, once; the groups' own reads then slice the same copy.
        None for a column that is not a numpy array.
        """
        got = self._direct_whole(name) if direct_first else None
        if got is not None:
            return got
        c = col()
        return self._copy_of(c) if isinstance(c, np.ndarray) else None

    def gathered(self, col: np.ndarray, g: int) -> np.ndarray | None:
        """Group ``g``'s rows of ``col`` as a read-only slice of the column in group order; None: copy them."""
        key = id(col)
        if key not in self.copies:
            asks = self.asks[key] = self.asks.get(key, 0) + 1
            if asks < self.threshold:
                return None
        return self._copy_of(col)[self.starts[g]:self.starts[g + 1]]

    def _copy(self, col: np.ndarray) -> np.ndarray:
        if self.steps is None:
            self._plan()
        n = int(self.starts[-1])
        out = np.empty(n, dtype=col.dtype) if self.pool is None else self.pool.array(n, col.dtype)
        starts = self.starts
        for first, base, stride, n, picks in self.matrices:
            # Groups sampled once every ``stride`` rows: columns of the (n x stride) matrix those rows
            # make, transposed a block of rows at a time; a last row the column ends within is picked.
            dest = out[first:first + len(picks) * n].reshape(len(picks), n)
            full = min(n, (len(col) - base) // stride)
            # Every column of the matrix, in order, is one group's: transposed as it is.
            every = len(picks) == stride and bool((picks == np.arange(stride)).all())
            rows = max(1, self.TRANSPOSE_VALUES // stride)
            for a in range(0, full, rows):
                e = min(a + rows, full)
                block = col[base + a * stride:base + e * stride].reshape(e - a, stride)
                dest[:, a:e] = (block if every else block[:, picks]).T
            for a in range(full, n):
                dest[:, a] = col[base + a * stride + picks]
        for g in self.whole:
            np.take(col, self.parts[g], out=out[starts[g]:starts[g + 1]])
        for j in range(self.blocks):  # block j of every group together: rows j*BLOCK_ROWS onwards
            for at, first, step, n, k in self.strided:
                a = j * k
                if a < n:
                    e = min(a + k, n)
                    out[at + a:at + e] = col[first + a * step:first + (e - 1) * step + 1:step]
            for at, part, cuts in self.scattered:
                a, e = int(cuts[j]), int(cuts[j + 1])
                if e > a:
                    np.take(col, part[a:e], out=out[at + a:at + e])
        return _readonly(out)

    def _plan(self) -> None:
        """How each group is copied: evenly spaced ones as slices, long uneven ones cut at the block
        edges (their rows of one block read together), short ones at once."""
        even = [_even_step(p) for p in self.parts]
        self.matrices, in_matrix = self._matrices(even)
        self.steps = [_even_slice(p, step) for p, step in zip(self.parts, even)]
        rows = max((int(p[-1]) + 1 for p in self.parts if len(p)), default=0)
        pieces = {g: max(self.BLOCK_ROWS // step.step, 1) for g, step in enumerate(self.steps)
                  if step is not False and g not in in_matrix}
        # Blocks enough for the table's rows and for every slice's pieces (k per block, the last may start later).
        self.blocks = max([-(-rows // self.BLOCK_ROWS), 1] + [-(-len(self.parts[g]) // k) for g, k in pieces.items()])
        edges = np.arange(self.blocks + 1, dtype=np.int64) * self.BLOCK_ROWS
        self.whole, self.strided, self.scattered = [], [], []
        for g, (part, step) in enumerate(zip(self.parts, self.steps)):
            at = int(self.starts[g])
            if g in in_matrix:
                continue
            if step is not False:
                self.strided.append((at, step.start, step.step, len(part), pieces[g]))
            elif len(part) > 4096:
                self.scattered.append((at, part, np.searchsorted(part, edges, side="left")))
            else:
                self.whole.append(g)

    def _matrices(self, even: list[int]) -> tuple[list[tuple], set[int]]:
        """Runs of consecutive groups read as one matrix: each group evenly spaced (``even``: the steps of
        :func:`_even_step`) with the same step and length, all starting within one step of the first
        (one entity per row of every tick)."""
        spacing = [(step, len(part)) if step else None for part, step in zip(self.parts, even)]
        runs: list[tuple] = []
        taken: set[int] = set()
        g, count = 0, len(self.parts)
        while g < count:
            if spacing[g] is None:
                g += 1
                continue
            stride, _ = spacing[g]
            e = g + 1
            while e < count and e - g < stride and spacing[e] == spacing[g]:
                e += 1
            firsts = np.array([int(self.parts[j][0]) for j in range(g, e)], dtype=np.int64)
            base = int(firsts.min())
            if e - g > 1 and int(firsts.max()) - base < stride:
                runs.append((int(self.starts[g]), base, stride, spacing[g][1], firsts - base))
                taken.update(range(g, e))
            g = e
        return runs, taken


class Rows:
    """Some rows of a Table (all, or ``idx`` in table order), read like a pandas DataFrame.

    Column access, masks, ``iloc``, ``dropna``, ``drop_duplicates`` and single-key
    ``groupby`` reductions are answered from the arrays; any other DataFrame
    attribute is taken from :meth:`frame` (a real DataFrame of these rows, built
    on first use), so code written for pandas keeps working, only slower.
    """

    __slots__ = ("_table", "_idx", "_names", "_frame", "_cols", "_step", "_parent", "_local", "_layout")

    def __init__(self, table: Table, idx: np.ndarray | None = None, names: tuple[str, ...] | None = None,
                 parent: Rows | None = None, local: np.ndarray | None = None,
                 layout: tuple[_GroupLayout, int] | None = None):
        self._table = table
        self._idx = idx
        self._names = names
        self._frame = None
        self._cols: dict[str, Column] = {}
        self._step: slice | bool | None = None  # idx as a slice when evenly spaced (one entity per tick)
        # Rows selected from other rows: columns already read there are cut from those, not the table.
        self._parent, self._local = parent, local
        self._layout = layout  # (the table's entity groups, this group's number) for whole-table groups

    def release(self) -> None:
        """Drop the columns gathered for these rows and their place in the table's entity groups."""
        self._cols.clear()
        self._layout = None

    def _parent_column(self, name: str) -> Column | None:
        parent = self._parent
        if parent is None:
            return None
        col = parent._cols.get(name)
        return col if col is not None and (col._values is not None or col._na is not None) else None

    def _gather(self, col: np.ndarray) -> np.ndarray:
        """``col`` (a column of the table) at these rows: a strided copy when they are evenly spaced."""
        idx = self._idx
        if idx is None:
            return col
        if self._layout is not None:
            layout, g = self._layout
            got = layout.gathered(col, g)
            if got is not None:
                return got
        if self._step is None:
            self._step = _even_slice(idx)
        if self._step is not False:
            return col[self._step].copy()
        return col[idx]

    # -- shape -------------------------------------------------------------------------------
    @property
    def table(self) -> Table:
        """The whole Table these rows belong to."""
        return self._table

    @property
    def positions(self) -> np.ndarray | None:
        """Row positions in the table (None: every row)."""
        return self._idx

    def __len__(self) -> int:
        return self._table.n if self._idx is None else len(self._idx)

    @property
    def empty(self) -> bool:
        """True without rows (or without columns), as DataFrame.empty."""
        return len(self) == 0 or not self._column_names()

    @property
    def shape(self) -> tuple[int, int]:
        """(rows, columns)."""
        return len(self), len(self._column_names())

    @property
    def columns(self) -> list[str]:
        """Column names, in table order."""
        return list(self._column_names())

    def _column_names(self):
        return self._names if self._names is not None else tuple(self._table.columns)

    def __contains__(self, name) -> bool:
        if self._names is not None:
            return name in self._names
        return name in self._table.columns

    def __iter__(self) -> Iterator[str]:
        return iter(self._column_names())

    def __bool__(self):
        raise ValueError("The truth value of rows is ambiguous; use .empty")

    # -- selection ---------------------------------------------------------------------------
    def __getitem__(self, key):
        if isinstance(key, str):
            col = self._cols.get(key)
            if col is None:
                if key not in self:
                    raise KeyError(key)
                col = self._cols[key] = Column(self, key)
            return col
        if isinstance(key, list) and all(isinstance(k, str) for k in key):
            for k in key:
                if k not in self:
                    raise KeyError(k)
            return Rows(self._table, self._idx, tuple(key))
        if isinstance(key, slice):
            return self.iloc[key]
        mask = np.asarray(key)
        if mask.dtype == bool and mask.shape == (len(self),):
            if mask.all():  # the same rows: keep their gathered columns
                return self
            return self._select(np.flatnonzero(mask))
        return self.frame()[key]

    def _select(self, positions: np.ndarray) -> Rows:
        """Rows at ``positions`` (0-based within these rows, ascending)."""
        idx = positions if self._idx is None else self._idx[positions]
        return Rows(self._table, idx, self._names, parent=self, local=positions)

    @property
    def iloc(self) -> _RowsIloc:
        """Positional selection: slices and integer arrays give Rows; anything else a DataFrame's answer."""
        return _RowsIloc(self)

    def sort_values(self, by, *args, **kwargs):
        """Already sorted by ``t``: the rows themselves; any other sort goes to pandas."""
        if (by == "t" or by == ["t"]) and not args and kwargs.get("ascending", True) is True \
                and set(kwargs) <= {"ascending", "kind"}:
            return self
        return self.frame().sort_values(by, *args, **kwargs)

    def dropna(self, *, subset=None, how: str = "any") -> Rows:
        """Rows without missing values (in ``subset`` columns, default all)."""
        names = list(self._column_names()) if subset is None else ([subset] if isinstance(subset, str)
                                                                     else list(subset))
        if not names:
            return self
        na = np.stack([self[name].isna().to_numpy() for name in names])
        keep = ~na.any(axis=0) if how == "any" else ~na.all(axis=0)
        if keep.all():
            return self
        return self._select(np.flatnonzero(keep))

    def drop_duplicates(self, subset=None, keep: str = "first") -> Rows:
        """The first row of each distinct combination of values (in ``subset`` columns, default all), in order."""
        if keep != "first":
            return self.frame().drop_duplicates(subset=subset, keep=keep)
        names = tuple(self._column_names()) if subset is None else ((subset,) if isinstance(subset, str)
                                                                      else tuple(subset))
        if self._idx is None:  # the whole table: any cached grouping by the same columns will do
            same = next((k for k in self._table._groups if set(k) == set(names)), names)
            parts = self._table.groups(same)[1]
            firsts = np.array([p[0] for p in parts], dtype=np.int64)
        else:
            _, order, starts, _ = _group(self._table, self._idx, names)
            firsts = order[starts[:-1]]
        firsts.sort()
        if self._idx is not None:  # back to positions within these rows
            firsts = np.searchsorted(self._idx, firsts)
        return self._select(firsts)

    def groupby(self, by, *args, **kwargs):
        """Single-column groupby with sum/max/min/mean/count on a column from the arrays; else pandas."""
        if isinstance(by, str) and not args and not kwargs:
            return _RowsGroupBy(self, by)
        return self.frame().groupby(by, *args, **kwargs)

    def groups(self, keys: tuple[str, ...]) -> Iterator[tuple[tuple, Rows]]:
        """(key values, rows) per distinct combination of ``keys`` in groupby order (sorted, missing last).

        Each group's rows stay in table order, i.e. by ``t``; computed once per
        table for the whole table and shared by every caller.
        """
        if self._idx is None and self._names is None:
            # Whole-table groups are kept: every analyzer walking the same entities reads the
            # same Rows, whose columns are gathered once.
            yield from self._table.entity_rows(keys)
            return
        if self._idx is None:
            for key, part in zip(*self._table.groups(keys)):
                yield key, Rows(self._table, part, self._names)
            return
        group_keys, order, starts, _ = _group(self._table, self._idx, keys)
        for g, key in enumerate(group_keys):
            yield key, Rows(self._table, order[starts[g]:starts[g + 1]], self._names)

    def entity_column(self, keys: tuple[str, ...], name: str) -> tuple[np.ndarray, np.ndarray] | None:
        """:meth:`Table.entity_column` for the groups of :meth:`groups`; None for rows not the whole table."""
        if self._idx is not None or self._names is not None:
            return None
        return self._table.entity_column(keys, name)

    def matching(self, key: dict[str, Any]) -> Rows:
        """The rows whose columns equal ``key``'s values (``df[df[c] == v]`` for each; NaN matches nothing)."""
        names = tuple(key)
        if self._idx is None and self._names is None and names:
            lookup = self._table.lookup(names)
            try:
                g = lookup.get(tuple(key[c] for c in names))
            except TypeError:
                g = None
            if g is None:
                return Rows(self._table, np.zeros(0, dtype=np.int64))
            return self._table.entity_rows(names)[g][1]
        rows = self
        for c in names:
            rows = rows[rows[c] == key[c]]
        return rows

    # -- pandas for the rest ---------------------------------------------------------------------
    def frame(self) -> pd.DataFrame:
        """These rows as a real pandas DataFrame (index: positions in the table, as a sliced DataFrame keeps)."""
        if self._frame is None:
            table = self._table
            if table.source is not None or (self._idx is None and self._names is None):
                df = table.frame()
                if self._idx is not None:
                    df = df.iloc[self._idx]
                if self._names is not None:
                    df = df[list(self._names)]
            else:  # only these rows and columns: a window's DataFrame is never built for one entity
                import pandas as pd

                idx = self._idx
                data = {}
                for name in self._column_names():
                    col = table.columns[name]
                    if isinstance(col, DictColumn):
                        data[name] = col.to_objects(idx)
                    else:
                        data[name] = col if idx is None else col[idx]
                index = pd.RangeIndex(table.n) if idx is None else pd.Index(idx)
                df = pd.DataFrame(data, index=index)
            self._frame = df
        return self._frame

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.frame(), name)

    def __setitem__(self, key, value):
        raise TypeError("window rows are read-only; take .frame().copy() to change them")

    def __repr__(self) -> str:
        return f"<Rows {len(self)} x {len(self._column_names())}>"


class _RowsIloc:
    __slots__ = ("_rows",)

    def __init__(self, rows: Rows):
        self._rows = rows

    def __getitem__(self, key):
        rows = self._rows
        if isinstance(key, slice):
            return rows._select(np.arange(len(rows))[key]) if key.step is None or key.step > 0 \
                else rows.frame().iloc[key]
        arr = np.asarray(key) if isinstance(key, (list, np.ndarray)) else None
        if arr is not None and arr.dtype.kind in "iu" and arr.ndim == 1:
            pos = np.where(arr < 0, arr + len(rows), arr)
            if (np.diff(pos) > 0).all():
                return rows._select(pos)
        return rows.frame().iloc[key]


class _RowsGroupBy:
    __slots__ = ("_rows", "_by")

    def __init__(self, rows: Rows, by: str):
        self._rows, self._by = rows, by

    def __getitem__(self, name: str):
        if not isinstance(name, str):
            return self._rows.frame().groupby(self._by)[name]
        return _ColumnGroupBy(self._rows, self._by, name)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self._rows.frame().groupby(self._by), name)


class _ColumnGroupBy:
    """``rows.groupby(by)[name]``: reductions per group as a pandas Series indexed by the sorted keys."""

    __slots__ = ("_rows", "_by", "_name")

    def __init__(self, rows: Rows, by: str, name: str):
        self._rows, self._by, self._name = rows, by, name

    def _reduce(self, how: str):
        import pandas as pd

        rows = self._rows
        values = rows[self._name].to_numpy()
        if values.dtype.kind not in "iufb":
            return getattr(rows.frame().groupby(self._by)[self._name], how)()
        keys, order, starts, _ = _group(rows._table, rows._idx, (self._by,))
        if rows._idx is not None:
            order = np.searchsorted(rows._idx, order)
        # groupby drops missing keys (dropna=True by default): they sort last.
        n_groups = len(keys)
        if n_groups and is_na(keys[-1][0]):
            n_groups -= 1
        v = values.astype(float)[order][:starts[n_groups]]
        at = starts[:n_groups]
        if not n_groups:
            out = np.zeros(0)
        elif how in ("sum", "count", "mean"):
            ok = ~np.isnan(v)
            total = np.add.reduceat(np.where(ok, v, 0.0), at)
            count = np.add.reduceat(ok.astype(np.int64), at)
            with np.errstate(all="ignore"):
                out = {"sum": total, "count": count, "mean": np.where(count > 0, total / count, np.nan)}[how]
        else:
            out = (np.fmax if how == "max" else np.fmin).reduceat(v, at)
        if how == "count" or (values.dtype.kind in "iu" and how in ("sum", "max", "min")):
            out = out.astype(np.int64)
        index = pd.Index([k[0] for k in keys[:n_groups]], name=self._by)
        return pd.Series(out, index=index, name=self._name)

    def sum(self):
        """Per-group sum (missing values skipped; 0 for a group without any)."""
        return self._reduce("sum")

    def max(self):
        """Per-group maximum (NaN for a group without values)."""
        return self._reduce("max")

    def min(self):
        """Per-group minimum (NaN for a group without values)."""
        return self._reduce("min")

    def mean(self):
        """Per-group mean (NaN for a group without values)."""
        return self._reduce("mean")

    def count(self):
        """Per-group count of non-missing values."""
        return self._reduce("count")

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self._rows.frame().groupby(self._by)[self._name], name)


def _binary(op):
    def method(self, other):
        if isinstance(other, Column):
            other = other.to_numpy()
        elif isinstance(other, (list, tuple)):
            other = np.asarray(other)
        elif not (np.isscalar(other) or other is None or isinstance(other, np.ndarray)):
            return NotImplemented
        with np.errstate(all="ignore"):
            try:
                out = op(self.to_numpy(), other)
            except TypeError:
                out = None
        if not isinstance(out, np.ndarray) or out.shape != (len(self),):
            return self._derived(np.asarray(op(self.series(), other)))
        return self._derived(out)
    return method


class Column:
    """One column of some Rows, read like a pandas Series: values from the arrays, the rest from pandas.

    Reductions skip missing values as pandas does; ``isna``/``notna`` and
    comparisons give boolean Columns (usable as masks of the same rows).
    """

    __slots__ = ("_rows", "name", "_values", "_positions", "_codes", "_na", "_make", "_pos_rows", "_as")

    def __init__(self, rows: Rows | None, name: str | None, values: np.ndarray | None = None,
                 positions: np.ndarray | None = None, codes: tuple[np.ndarray, list] | None = None):
        self._rows = rows
        self.name = name
        self._values = values
        self._positions = positions
        self._codes = codes
        self._na = None
        self._make = None  # makes the values of a derived column that is mostly read through its codes
        self._pos_rows = rows  # whose positions these values have (made into an array only for pandas)
        self._as = None  # (dtype, the values converted to it): int columns read as float by several analyzers

    def _derived(self, values: np.ndarray, positions: np.ndarray | None = None,
                 codes: tuple[np.ndarray, list] | None = None) -> Column:
        out = Column(None, self.name, values, positions if positions is not None else self._positions, codes)
        if out._positions is None:
            out._pos_rows = self._pos_rows
        return out

    def _pos(self) -> np.ndarray:
        """Row positions in the table (the index a pandas Series of these rows would carry)."""
        if self._positions is None:
            rows = self._pos_rows
            idx = rows._idx
            self._positions = np.arange(rows._table.n) if idx is None else idx
        return self._positions

    def _raw(self):
        col = self._rows._table.columns[self.name]
        return col

    @property
    def values(self) -> np.ndarray:
        """The values as a numpy array (dicts rebuilt for a dict column)."""
        if self._values is None and self._make is not None:
            self._values = self._make()
        if self._values is None and self._rows._layout is not None and self._rows._idx is not None:
            columns = self._rows._table.columns
            if isinstance(columns, LazyColumns) and not columns.made(self.name):
                layout, g = self._rows._layout
                self._values = layout.gathered_directly(self.name, g)
        if self._values is None:
            col = self._raw()
            idx = self._rows._idx
            if isinstance(col, DictColumn):
                self._values = col.to_objects(idx)
            elif idx is None:
                self._values = col
            else:
                # Shared by every reader of these rows: read-only, as pandas' own to_numpy() views are.
                above = self._rows._parent_column(self.name)
                if above is not None and above._values is not None:  # a short gather from a copy at hand
                    self._values = _readonly(above._values[self._rows._local])
                else:
                    self._values = _readonly(self._rows._gather(col))
        return self._values

    def dict_column(self) -> tuple[DictColumn, np.ndarray | None] | None:
        """(DictColumn, row positions or None) when this column's values are kept per leaf, else None."""
        if self._rows is None:
            return None
        columns = self._rows._table.columns
        if isinstance(columns, LazyColumns) and columns.kind(self.name) in ("object", "numeric"):
            return None  # and the column is not made to learn that
        col = columns[self.name]
        return (col, self._rows._idx) if isinstance(col, DictColumn) else None

    def codes(self) -> tuple[np.ndarray, list] | None:
        """(codes, uniques) of these values (from the table's label codes; -1 for missing), or None."""
        if self._codes is not None:
            return self._codes
        if self._rows is None:
            return None
        rows = self._rows
        parent = rows._parent
        above = parent._cols.get(self.name) if parent is not None else None
        if above is not None and above._codes is not None:
            codes, uniques = above._codes
            self._codes = (codes[rows._local], uniques)
        else:
            codes, uniques = rows._table.codes(self.name)
            self._codes = ((codes if rows._idx is None else rows._gather(codes)), uniques)
        return self._codes

    def _object_codes(self) -> tuple[np.ndarray, list] | None:
        """Codes when the values are an object column whose codes are at hand (labels), else None."""
        if self._codes is not None:
            return self._codes
        if self._rows is None or not self._raw_is_object():
            return None
        return self.codes()

    def to_numpy(self, dtype=None, copy: bool = False, na_value=None) -> np.ndarray:
        """The values as an array (``dtype=float``: NaN for missing)."""
        v = self.values
        if dtype is not None and not copy and not v.flags.writeable and np.dtype(dtype) != v.dtype:
            # Shared values, shared conversion: read-only like the values themselves.
            want = np.dtype(dtype)
            if self._as is None or self._as[0] != want:
                self._as = (want, _readonly(v.astype(want)))
            v = self._as[1]
        elif dtype is not None:
            v = v.astype(dtype, copy=copy)
        elif copy:
            v = v.copy()
        if na_value is not None:
            v = np.where(_isna_array(v), na_value, v)
        return v

    def __array__(self, dtype=None, copy=None):
        v = self.values
        return v if dtype is None else v.astype(dtype)

    def tolist(self) -> list:
        """The values as Python objects."""
        return self.values.tolist()

    to_list = tolist

    def __len__(self) -> int:
        if self._values is not None:
            return len(self._values)
        if self._rows is None:
            return len(self._codes[0]) if self._codes is not None else len(self.values)
        return len(self._rows)

    def __iter__(self):
        return iter(self.tolist())

    @property
    def empty(self) -> bool:
        """True without values."""
        return len(self) == 0

    @property
    def dtype(self):
        """The numpy dtype of the values."""
        return self.values.dtype

    # -- missing values -------------------------------------------------------------------------
    def _missing(self) -> np.ndarray:
        """Per value, missing (NaN or None); computed once per column."""
        if self._na is not None:
            return self._na
        above = self._rows._parent_column(self.name) if self._rows is not None else None
        if above is not None and above._na is not None:
            self._na = _readonly(above._na[self._rows._local])
            return self._na
        dc = self.dict_column()
        if dc is not None:
            col, idx = dc
            lay = col.layout if idx is None else col.layout[idx]
            na = lay < 0
            if na.any():
                rows = np.arange(col.n) if idx is None else idx
                at = np.flatnonzero(na)
                na[at] = [is_na(col.other.get(int(i), NAN)) for i in rows[at].tolist()]
        else:
            got = self._object_codes()
            na = got[0] < 0 if got is not None else _isna_array(self.values)
        na.flags.writeable = False
        self._na = na
        return na

    def isna(self) -> Column:
        """Missing (NaN or None) per value."""
        return self._derived(self._missing())

    isnull = isna

    def notna(self) -> Column:
        """Not missing, per value."""
        return self._derived(~self._missing())

    notnull = notna

    def dropna(self) -> Column:
        """The values that are not missing."""
        keep = np.flatnonzero(~self._missing())
        return self._derived(self.values[keep], self._pos()[keep])

    def fillna(self, value) -> Column:
        """Missing values replaced by ``value``."""
        v = self.values
        na = _isna_array(v)
        if not na.any():
            return self._derived(v)
        numeric = isinstance(value, (int, float, np.number)) and not isinstance(value, bool)
        out = v.copy() if v.dtype.kind == "f" and numeric else v.astype(object)
        out[na] = value
        return self._derived(out)

    # -- reductions (missing values skipped, as pandas does) -----------------------------------------
    def _numeric(self) -> np.ndarray | None:
        v = self.values
        if v.dtype.kind in "iub":
            return v
        if v.dtype.kind == "f":
            return v[~np.isnan(v)]
        return None

    def _reduce(self, how: str):
        v = self._numeric()
        if v is None:
            return getattr(self.series(), how)()
        if how == "sum":
            return v.sum() if v.size else (v.dtype.type(0) if v.dtype.kind in "iu" else 0.0)
        if not v.size:
            return np.float64(np.nan)
        return getattr(v, how)()

    def max(self):
        """Largest value (NaN when none)."""
        return self._reduce("max")

    def min(self):
        """Smallest value (NaN when none)."""
        return self._reduce("min")

    def sum(self):
        """Sum of the values (0 when none)."""
        return self._reduce("sum")

    def mean(self):
        """Mean of the values (NaN when none)."""
        return self._reduce("mean")

    def any(self) -> bool:
        """True when any value is true (missing values skipped)."""
        v = self.values
        if v.dtype.kind == "b":
            return bool(v.any())
        return bool(self.series().any())

    def all(self) -> bool:
        """True when every value is true (missing values skipped)."""
        v = self.values
        if v.dtype.kind == "b":
            return bool(v.all())
        return bool(self.series().all())

    # -- element-wise ---------------------------------------------------------------------------------
    def astype(self, dtype) -> Column:
        """The values converted (``str``: each value's str(), as pandas does for object columns)."""
        if dtype is str:
            got = self._object_codes()
            if got is None:
                return self._derived(np.array([str(v) for v in self.values.tolist()], dtype=object))
            codes, uniques = got
            strs = [str(u) for u in uniques]
            na = np.flatnonzero(codes < 0)
            if na.size:  # None and NaN share the missing code but not their str()
                out = np.array(strs + [""], dtype=object)[codes]
                out[na] = [str(v) for v in self.values[na].tolist()]
                return self._derived(out)
            derived = self._derived(None, codes=(codes, strs))
            derived._make = lambda: np.array(strs + [""], dtype=object)[codes]
            return derived
        return self._derived(self.values.astype(dtype))

    def isin(self, values) -> Column:
        """Per value, whether it is one of ``values``."""
        pool = set(values)
        got = self._object_codes()
        try:
            if got is not None:
                codes, uniques = got
                lut = np.array([u in pool for u in uniques] + [False], dtype=bool)
                out = lut[codes]
                na = np.flatnonzero(codes < 0)
                if na.size:
                    out[na] = [v in pool for v in self.values[na].tolist()]
                return self._derived(out)
            return self._derived(np.fromiter((v in pool for v in self.values.tolist()), dtype=bool,
                                             count=len(self)))
        except TypeError:
            return self._derived(self.series().isin(values).to_numpy())

    def __eq__(self, other):
        if self._rows is not None and (isinstance(other, str) or np.isscalar(other)) and self._raw_is_object():
            codes, _ = self.codes()
            c = self._rows._table.code_of(self.name, other)
            return self._derived(codes == c if c is not None else np.zeros(len(codes), dtype=bool))
        return _binary(operator.eq)(self, other)

    def __ne__(self, other):
        eq = self.__eq__(other)
        if eq is NotImplemented:
            return eq
        return self._derived(~eq.values)

    def _raw_is_object(self) -> bool:
        if self._rows is None:
            return False
        columns = self._rows._table.columns
        if isinstance(columns, LazyColumns) and columns.kind(self.name) in ("object", "numeric"):
            return columns.kind(self.name) == "object"
        col = self._raw()
        return isinstance(col, np.ndarray) and col.dtype == object

    __lt__ = _binary(operator.lt)
    __le__ = _binary(operator.le)
    __gt__ = _binary(operator.gt)
    __ge__ = _binary(operator.ge)
    __add__ = _binary(operator.add)
    __sub__ = _binary(operator.sub)
    __mul__ = _binary(operator.mul)
    __truediv__ = _binary(operator.truediv)
    __floordiv__ = _binary(operator.floordiv)
    __mod__ = _binary(operator.mod)
    __pow__ = _binary(operator.pow)
    __and__ = _binary(operator.and_)
    __or__ = _binary(operator.or_)
    __xor__ = _binary(operator.xor)
    __radd__ = _binary(lambda a, b: b + a)
    __rsub__ = _binary(lambda a, b: b - a)
    __rmul__ = _binary(lambda a, b: b * a)
    __rtruediv__ = _binary(lambda a, b: b / a)
    __rand__ = _binary(lambda a, b: b & a)
    __ror__ = _binary(lambda a, b: b | a)
    __hash__ = None

    def __invert__(self) -> Column:
        return self._derived(~self.values)

    def __neg__(self) -> Column:
        return self._derived(-self.values)

    def __abs__(self) -> Column:
        return self._derived(np.abs(self.values))

    # -- positions ----------------------------------------------------------------------------------
    @property
    def iloc(self) -> _ColumnIloc:
        """Positional access: an int gives a value, a slice or int array a Column."""
        return _ColumnIloc(self)

    def series(self) -> pd.Series:
        """These values as a pandas Series (index: the rows' positions in the table)."""
        import pandas as pd

        rows = self._rows
        if rows is not None and self._values is None and rows._table.source is not None:
            s = rows._table.source[self.name]
            return s if rows._idx is None else s.iloc[rows._idx]
        return pd.Series(self.values, index=pd.Index(self._pos()), name=self.name)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.series(), name)

    def __repr__(self) -> str:
        return f"<Column {self.name!r} {len(self)} values>"


class _ColumnIloc:
    __slots__ = ("_col",)

    def __init__(self, col: Column):
        self._col = col

    def __getitem__(self, key):
        col = self._col
        if isinstance(key, (int, np.integer)):
            v = col.values[key]
            return v
        if isinstance(key, slice):
            return col._derived(col.values[key], col._pos()[key])
        return col.series().iloc[key]


# --- windows -----------------------------------------------------------------------------------------


class _Tables(MutableMapping):
    """``window.tables``: kind -> DataFrame, kept as Tables until a DataFrame is asked for."""

    def __init__(self, items: Mapping[str, Any] | None = None):
        self._items: dict[str, Any] = dict(items or {})

    def __getitem__(self, kind: str) -> pd.DataFrame:
        v = self._items[kind]
        return v.frame() if isinstance(v, Table) else v

    def __setitem__(self, kind: str, value) -> None:
        self._items[kind] = value

    def __delitem__(self, kind: str) -> None:
        del self._items[kind]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def stored(self, kind: str):
        """What the window holds for ``kind``: a Table, a DataFrame or None."""
        return self._items.get(kind)

    def __repr__(self) -> str:
        return f"<tables {', '.join(f'{k}: {len(v)} rows' for k, v in self._items.items())}>"


_EMPTY = Table(0, {"t": np.zeros(0)})


@dataclass
class Window:
    """Frames of one time range, one table per kind, plus what is known about gaps.

    ``tables`` maps kind to a pandas DataFrame (or holds the kind's Table until a
    DataFrame is asked for); ``rows(kind)`` reads the same rows from arrays.
    """

    tables: MutableMapping[str, Any]
    start_s: float
    end_s: float
    node: str | None = None
    sources: list[str] = field(default_factory=list)
    gaps: list[str] = field(default_factory=list)  # what could not be observed, and why

    def __post_init__(self):
        if not isinstance(self.tables, _Tables):
            self.tables = _Tables(self.tables)
        self._rows_of: dict[str, tuple[Any, Table]] = {}

    def table(self, kind: str) -> pd.DataFrame:
        """The DataFrame of one kind, sorted by ``t``; an empty one (with ``t``) when absent."""
        df = self.tables.get(kind)
        if df is None:
            import pandas as pd

            return pd.DataFrame({"t": pd.Series(dtype=float)})
        return df

    def columns(self, kind: str) -> Table:
        """The Table of one kind (made from its DataFrame on first use); an empty one when absent."""
        held = self.tables.stored(kind)
        if held is None:
            return _EMPTY
        if isinstance(held, Table):
            return held
        cached = self._rows_of.get(kind)
        if cached is None or cached[0] is not held:
            cached = self._rows_of[kind] = (held, Table.from_frame(held))
        return cached[1]

    def release(self) -> None:
        """Drop every table's reader caches (see :meth:`Table.release`): the window is not read again."""
        for kind in list(self.tables):
            held = self.tables.stored(kind)
            if isinstance(held, Table):
                held.release()
        for _, table in self._rows_of.values():
            table.release()
        self._rows_of.clear()

    def rows(self, kind: str) -> Rows:
        """The rows of one kind read from arrays (see :class:`Rows`); empty (with ``t``) when absent."""
        return Rows(self.columns(kind))

    def has(self, kind: str, column: str | None = None) -> bool:
        """True when the window holds rows of ``kind`` (with a non-null ``column``, if given)."""
        held = self.tables.stored(kind)
        if held is None or len(held) == 0:
            return False
        if column is None:
            return bool(len(self.columns(kind).columns))
        return self.columns(kind).has_values(column)

    @classmethod
    def from_columns(cls, tables: Mapping[str, Table], *, start_s: float, end_s: float, node: str | None = None,
                     sources: list[str] | None = None, gaps: list[str] | None = None) -> Window:
        """A window over Tables (no DataFrame is built unless asked for)."""
        return cls(_Tables({k: v for k, v in tables.items() if v.n}), start_s, end_s, node,
                   list(sources or []), list(gaps or []))

    @classmethod
    def from_frames(cls, frames: Iterable[Frame], *, node: str | None = None,
                    sources: list[str] | None = None, gaps: list[str] | None = None) -> Window:
        """Build a window from frames (rows of the same kind are concatenated)."""
        rows: dict[str, list[dict[str, Any]]] = {}
        start, end = float("inf"), float("-inf")
        for fr in frames:
            start, end = min(start, fr.t), max(end, fr.t)
            bucket = rows.setdefault(fr.kind, [])
            for r in fr.rows:
                bucket.append({"t": fr.t, **r})
        return cls.from_rows(rows, start_s=start if start != float("inf") else 0.0,
                             end_s=end if end != float("-inf") else 0.0,
                             node=node, sources=sources, gaps=gaps)

    @classmethod
    def from_rows(cls, rows: dict[str, list[dict[str, Any]]], *, start_s: float, end_s: float,
                  node: str | None = None, sources: list[str] | None = None,
                  gaps: list[str] | None = None) -> Window:
        """Build a window from row lists per kind (each row carries its own ``t``)."""
        import pandas as pd

        tables = {}
        for kind, rs in rows.items():
            if rs:
                tables[kind] = pd.DataFrame.from_records(rs).sort_values("t", kind="stable").reset_index(drop=True)
        return cls(tables, start_s, end_s, node, list(sources or []), list(gaps or []))
