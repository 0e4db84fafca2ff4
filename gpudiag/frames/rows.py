"""Rows and Column: the part of the pandas DataFrame and Series interface the analyzers use, read column by
column from a Table's numpy arrays."""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING

import numpy as np

from .columns import NAN, DictColumn, LazyColumns, _isna_array, _readonly, is_na
from .grouping import _even_slice, _group

if TYPE_CHECKING:
    from collections.abc import Iterator
    from typing import Any

    import pandas as pd

    from .grouping import _GroupLayout
    from .table import Table



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
