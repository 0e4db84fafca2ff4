"""Table: rows of one kind as columns, sorted by ``t``, with the label codes, entity groups and distinct
values its readers ask for computed once."""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING

import numpy as np

from .codes import cut_codes, factorize, held_uniques, merge_codes
from .columns import (
    _KIND_OF_TYPE,
    DictColumn,
    LazyColumns,
    _column_from_chunks,
    _column_from_pieces,
    _isna_array,
    _kind_of,
    _take,
    concat_columns,
    is_na,
)
from .grouping import _group, _GroupLayout

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable
    from typing import Any

    import pandas as pd

    from .columns import FrameColumns
    from .grouping import BufferPool



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


# Imported last: these modules import this one.
from .rows import Rows  # noqa: E402
