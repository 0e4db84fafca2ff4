"""TableBuffer: the agent's sliding window of one kind, appended at the back and cut at the front, keeping
each chunk's label codes and each entity's row positions as rows come and go."""

from __future__ import annotations

import itertools
from collections import deque
from typing import TYPE_CHECKING

import numpy as np

from .codes import factorize, held_uniques, merge_codes
from .columns import NAN, DictColumn, _promote, _readonly, fill_of, is_na, live_dtype
from .grouping import _group
from .table import Table

if TYPE_CHECKING:
    from typing import Any



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
