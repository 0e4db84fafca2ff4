"""Window: a time range of frames, one Table per kind, as the analyzers take it."""

from __future__ import annotations

from collections.abc import MutableMapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from .rows import Rows
from .table import Table

if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator, Mapping
    from typing import Any

    import pandas as pd

    from .columns import Frame



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
