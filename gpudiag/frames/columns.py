"""Frames and the columns a table is made of: Frame, FrameColumns, DictColumn, LazyColumns and how a list of
values becomes a numpy column (dtypes, promotion, fills)."""

from __future__ import annotations

import itertools
import operator
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator, Mapping
    from typing import Any


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


def _isna_array(col: np.ndarray) -> np.ndarray:
    kind = col.dtype.kind
    if kind == "f":
        return np.isnan(col)
    if kind in "iub":
        return np.zeros(len(col), dtype=bool)
    return np.fromiter((v is None or v != v for v in col.tolist()), dtype=bool, count=len(col))


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
