"""The window reader: the rows of many blocks in a time range (of a node) straight into one Table sorted by
``t``, decoding only ``t`` and the label codes at once and every other column when first read, with entity
groups from the blocks' stored order."""

from __future__ import annotations

import json
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import numpy as np

from gpudiag.frames import (
    NAN,
    DictColumn,
    LazyColumns,
    Table,
    cut_codes,
    fill_of,
    is_na,
    live_dtype,
    merge_codes,
    sorted_codes,
)
from gpudiag.frames import concat_columns as concat_frames_columns
from gpudiag.frames import factorize as factorize_table_column

from .blocks import _frames_dict_column
from .codecs import (
    _ZLIB_MAGIC,
    _codes,
    _Cursor,
    _decode_column,
    _decode_ints,
    _decompress,
    _DictColumn,
    _dictionary,
    _expand_header,
    _label_lookup,
    _ZlibBody,
    _zstd_frames,
)

# Threads that decode a long read's chunks side by side (zstd, zlib and numpy release the GIL);
# four keep a reader from crowding out the serving process on the node's cores.
READ_THREADS = max(1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1))


# --- reading a window: blocks decoded straight into the window's columns -----------------
#
# A window read joins many blocks (a day of a node is a few hundred per kind). Decoding each
# block into a Table of its own and concatenating them copies every value twice more (into
# the appended order, then end to end) and builds every label's Python object per block.
# Instead, a first pass inflates each block and finds the rows the window keeps; the column
# types follow from the block headers, so every output column is allocated once at its final
# size and a second pass decodes each block's columns into its slice of them. The result is
# the Table that decoding each block (decode_table), cutting it to the window and
# Table.concat would give: the same columns, dtypes, values, order and label codes.

_OBJECT = np.dtype(object)
_OBJECT_CODECS = frozenset({"str", "json", "null", "jsonlist"})
_NUMERIC_CODECS = {"int": np.dtype(np.int64), "dec": np.dtype(np.float64), "xor": np.dtype(np.float64),
                   "bool": np.dtype(bool)}


def _column_bytes(meta: dict) -> int:
    """Payload bytes of one column of a block (a dict column's leaves follow its own parts)."""
    return sum(meta["sizes"]) + sum(sum(leaf["sizes"]) for leaf in meta.get("leaves", ()))


def _part_dtype(meta: dict) -> np.dtype | None:
    """The dtype a block's column decodes to (object for labels and JSON); None for a dict column."""
    codec = meta["codec"]
    if codec == "dict":
        return None
    if codec == "raw":
        return np.dtype(meta["dtype"])
    if codec in _OBJECT_CODECS:
        return _OBJECT
    return _NUMERIC_CODECS[codec]


class _WindowBlock:
    """One block of a window read: its header, the rows the window keeps, and its columns on demand.

    A zstd block holds every column in a frame of its own: choosing the rows decompresses
    the entity order, ``t`` (and ``node``), and each other column is decompressed when it is
    written, so a column nobody reads is never decompressed. A zlib block is one stream; it is
    inflated in two steps, the columns the rows are chosen by (they lead it) first and the rest
    just before the block's columns are written, so the read never holds every block's payload
    at once. ``cut`` holds the kept rows as positions in the appended order (None: every row)
    and ``src`` the same rows as positions in the stored, entity-grouped order (None: every
    row, stored as appended).
    """

    __slots__ = ("block", "body", "cut", "frames", "head", "inverse", "k", "metas", "n", "offsets", "order", "rest",
                 "sizes", "src", "t")

    def __init__(self, block: bytes):
        self.block, self.body, self.frames = block, None, None
        self.head, self.rest = b"", b""
        if block[:4] == _ZLIB_MAGIC:
            self.body = _ZlibBody(memoryview(block)[8:])
            (head_len,) = struct.unpack("<I", block[4:8])
            self._inflate_to(head_len)
            header = _expand_header(json.loads(self.head[:head_len]))
        else:
            header, frames = _zstd_frames(block)
            head_len = 0
        self.n = n = header["n"]
        order = header.get("order")
        pos = head_len + (order["sizes"][0] if order is not None else 0)
        self.metas: dict[str, dict] = {}
        self.offsets: dict[str, int] = {}
        self.sizes: dict[str, int] = {}
        for meta in header["columns"]:
            self.metas[meta["name"]] = meta
            self.offsets[meta["name"]] = pos
            self.sizes[meta["name"]] = _column_bytes(meta)
            pos += self.sizes[meta["name"]]
        if self.body is None:
            columns = frames[1:] if order is not None else frames
            self.frames = {name: frame for name, frame in zip(self.metas, columns)}
        self.inverse = self.order = None
        if order is not None:
            if self.body is None:
                at, size = frames[0]
                data = _decompress(memoryview(block)[at:at + size])
            else:
                self._inflate_to(head_len + order["sizes"][0])
                data = memoryview(self.head)[head_len:head_len + order["sizes"][0]]
            order = _decode_ints(order, data, n)
            self.inverse = np.empty(n, dtype=np.int64)
            self.inverse[order] = np.arange(n)
            self.order = order
        self.k, self.cut, self.src, self.t = n, None, self.inverse, None

    def _inflate_to(self, size: int) -> None:
        """Inflate at least the first ``size`` bytes of a zlib block's payload into ``head``."""
        if size > len(self.head):
            self.head += self.body.read(size - len(self.head))

    def finish(self) -> None:
        """Inflate the rest of a zlib block's payload (a truncated one raises ValueError, as decode_block does)."""
        if self.body is not None:
            self.rest = self.body.rest()
            self.body = None

    def _bytes_of(self, name: str):
        """The payload bytes of one column: its own frame, or wherever the two steps put them."""
        if self.frames is not None:
            at, size = self.frames[name]
            data = _decompress(memoryview(self.block)[at:at + size])
            if len(data) != self.sizes[name]:
                raise ValueError(f"column {name} of a frame block holds {len(data)} bytes, not {self.sizes[name]}")
            return data
        at, size, cut = self.offsets[name], self.sizes[name], len(self.head)
        if at + size <= cut:
            return memoryview(self.head)[at:at + size]
        if at >= cut:
            return memoryview(self.rest)[at - cut:at - cut + size]
        return self.head[at:] + self.rest[:at + size - cut]

    def stored(self, name: str, _resolving: tuple = ()):
        """A column in stored order: an array, a flattened dict column, or (codes, values) of a string column."""
        if name == "t" and self.t is not None:
            return self.t
        meta = self.metas[name]
        data = self._bytes_of(name)
        if meta["codec"] == "str":
            cur = _Cursor(data, 0)
            parts = [cur.take(size) for size in meta["sizes"]]
            values = _dictionary(meta, parts)
            return _codes(parts[0], meta["width"], self.n, len(values)), values
        parts_of = None
        if "of" in meta:
            if name in _resolving:
                raise ValueError(f"column {name} is stored against itself")
            parts_of = tuple(self.stored(p, _resolving + (name,)) if p in self.metas else None for p in meta["of"])
        return _decode_column(meta, _Cursor(bytes(data) if meta["codec"] == "jsonlist" else data, 0), self.n,
                              parts_of=parts_of)

    def values(self, name: str) -> list:
        """A str column's dictionary (one stored as fields is read from the column's payload)."""
        meta = self.metas[name]
        if "values" not in meta:
            if self.body is not None:
                self._inflate_to(self.offsets[name] + self.sizes[name])
            self.stored(name)
        return meta["values"]

    def full_column(self, name: str):
        """A column of every row in appended order, as :func:`decode_table` gives it."""
        a = self.stored(name)
        if isinstance(a, tuple):
            a = _label_lookup(a[1])[a[0]]
        if self.inverse is not None:
            a = a.take(self.inverse) if isinstance(a, _DictColumn) else a[self.inverse]
        return _frames_dict_column(a, self.n) if isinstance(a, _DictColumn) else a

    def kept_column(self, name: str):
        """The kept rows of a column, as :func:`decode_table` and a cut to the window give them."""
        a = self.full_column(name)
        if self.cut is None:
            return a
        return a.take(self.cut) if isinstance(a, DictColumn) else a[self.cut]

    def entity_order(self) -> np.ndarray | None:
        """The kept rows (as positions among them) in stored order, which groups them by entity; None when unordered.

        Within one entity the rows keep their appended order: the stored order is a stable sort.
        A block stored as appended (one entity, or one row per entity) has no order.
        """
        if self.order is None:
            return None
        # Kept with the window as long as it lives: 32-bit positions (a block holds far fewer rows).
        if self.cut is None:
            return self.order.astype(np.int32)
        return np.argsort(self.src, kind="stable").astype(np.int32)

    def select(self, start_s: float, end_s: float, node: str | None) -> int:
        """Keep the rows with ``start_s <= t <= end_s`` (of ``node``); the number kept."""
        chosen_by = ["t"] + (["node"] if node is not None and "node" in self.metas else [])
        if self.body is not None:
            self._inflate_to(max(self.offsets[c] + self.sizes[c] for c in chosen_by))
        t = self.stored("t")
        if isinstance(t, np.ndarray) and t.dtype != object:
            self.t = t  # decoded once: the second pass writes it from here
        t = self.full_column("t")
        keep = (t >= start_s) & (t <= end_s)
        if node is not None and "node" in self.metas:
            keep &= self._of_node(node)
        self.k = int(keep.sum())
        if self.k < self.n:
            self.cut = np.flatnonzero(keep)
            self.src = self.cut if self.inverse is None else self.inverse[self.cut]
        return self.k

    def _of_node(self, node: str) -> np.ndarray:
        """Which rows (appended order) carry the label ``node``, matched as Table.code_of matches it."""
        if self.metas["node"]["codec"] != "str":
            table = Table(self.n, {"node": self.full_column("node")})
            code = table.code_of("node", node)
            return table.codes("node")[0] == (-2 if code is None else code)
        codes, values = self.stored("node")
        try:
            code = None if is_na(node) else {v: i for i, v in enumerate(values)}.get(node)
        except TypeError:
            code = None
        if code is None:
            return np.zeros(self.n, dtype=bool)
        if self.inverse is not None:
            codes = codes[self.inverse]
        return codes == code


# A string column whose blocks' dictionaries hold more entries than this share of its rows
# holds a value of its own in most rows (request ids): it is read as plain values, decoded
# when first read, not as labels. Labels would build one sorted dictionary of every value
# of the window (6.9 M request ids in a day of a node serving 80 requests a second), and
# their codes group nothing.
DISTINCT_PER_ROW_SHARE = 0.5
# Fewer rows than this are read as labels whatever their values: a short window of a few entities
# (each process name distinct in a one-second block) keeps its label codes.
DISTINCT_PER_ROW_MIN_ROWS = 1024


def _dictionary_size(meta: dict) -> int:
    """Entries in a str column's dictionary, read from its header (a dictionary stored as fields holds its count)."""
    return meta["count"] if "count" in meta else len(meta.get("values", ()))


def _distinct_per_row(metas: list[dict], blocks: list[_WindowBlock]) -> bool:
    """Whether a string column holds mostly values of their own (see DISTINCT_PER_ROW_SHARE)."""
    rows = sum(b.n for b in blocks)
    return rows >= DISTINCT_PER_ROW_MIN_ROWS and sum(map(_dictionary_size, metas)) > DISTINCT_PER_ROW_SHARE * rows


class _ColumnOut:
    """One output column of a window read and how each block's part of it is written.

    ``mode`` is ``labels`` (a string column in every block: codes merged once, then the
    labels looked up once; not a column of mostly distinct values, see DISTINCT_PER_ROW_SHARE),
    ``array`` (numbers or objects, promoted as Table.concat promotes them) or ``parts``
    (dict columns: each block's part is built as decode_table builds it and the parts are
    joined by Table.concat's own rule).
    """

    def __init__(self, name: str, blocks: list[_WindowBlock], total: int):
        self.name = name
        metas = [b.metas.get(name) for b in blocks]
        dtypes = [None if m is None else _part_dtype(m) for m in metas]
        present = [d for m, d in zip(metas, dtypes) if m is not None]
        missing = len(present) < len(metas)
        self.part_codes: list | None = None
        self.numeric = False
        if any(m is not None and m["codec"] == "dict" for m in metas):
            self.mode = "parts"
            self.parts: list = [None] * len(blocks)
            return
        if not missing and all(m["codec"] == "str" for m in metas) and not _distinct_per_row(metas, blocks):
            self.mode = "labels"
            dictionaries = [b.values(name) for b in blocks]
            self.uniques = sorted(set().union(*dictionaries))
            index = {u: i for i, u in enumerate(self.uniques)}
            # 32-bit codes: a label column of a day of a node is 11 M codes, and every byte of them is a
            # fresh page the read waits for.
            self.maps = [np.array([index[v] for v in values] + [-1], dtype=np.int32) for values in dictionaries]
            self.codes = np.empty(total, dtype=np.int32)
            return
        self.mode = "array"
        dtype = live_dtype(dtypes)  # Table.concat's promotion: float64 for mixed numbers, else object
        self.out = np.empty(total, dtype=dtype)
        # Numbers in every block: such a column can be read a block at a time (entity runs, a few rows).
        self.numeric = not missing and dtype.kind in "iufb"
        if missing:
            at = 0
            for b, m in zip(blocks, metas):
                if m is None:
                    self.out[at:at + b.k] = fill_of(dtype)
                at += b.k
        if dtype == _OBJECT and not missing and all(d == _OBJECT for d in present):
            self.part_codes = [None] * len(blocks)  # each block's label codes, merged when asked

    @property
    def kind(self) -> str:
        """What the column is when made: "dict", "object" or "numeric" (see LazyColumns.kind)."""
        if self.mode == "parts":
            return "dict"
        return "numeric" if self.mode == "array" and self.out.dtype != _OBJECT else "object"

    def write(self, i: int, block: _WindowBlock, at: int) -> None:
        """Write block ``i``'s kept rows at ``at``."""
        if self.mode == "parts":
            self.parts[i] = block.kept_column(self.name)
            return
        a = block.stored(self.name)
        src, k = block.src, block.k
        if self.mode == "labels":
            codes = a[0] if src is None else a[0][src]
            np.take(self.maps[i], codes, out=self.codes[at:at + k], mode="wrap")  # wrap: -1 is the last entry
            return
        dst = self.out[at:at + k]
        if isinstance(a, tuple):
            codes, values = a
            codes = codes.copy() if src is None else codes[src]  # not a view that holds the block's payload
            dst[...] = _label_lookup(values)[codes]
            if self.part_codes is not None:
                self.part_codes[i] = lambda: sorted_codes(codes.astype(np.int64), list(values))
            return
        if src is None:
            dst[...] = a
        elif a.dtype == dst.dtype and a.dtype != _OBJECT:
            np.take(a, src, out=dst, mode="clip")  # "raise" would buffer the output: src is in range
        else:
            dst[...] = a[src]
        if self.part_codes is not None:
            if block.cut is None:
                self.part_codes[i] = lambda: factorize_table_column(dst)
            else:
                full, cut = (a if block.inverse is None else a[block.inverse]), block.cut
                self.part_codes[i] = lambda: cut_codes(factorize_table_column(full), cut)

    def column(self, sizes: list[int]):
        """The finished column."""
        if self.mode == "parts":
            return concat_frames_columns(self.parts, sizes)
        if self.mode == "labels":
            return _label_lookup(self.uniques)[self.codes]
        return self.out

    def label_codes(self):
        """Thunk of the column's label codes as Table.concat merges them (None: factorized when asked)."""
        if self.part_codes is None:
            return None
        parts = self.part_codes
        return lambda: merge_codes([f() for f in parts])


class _EntityRuns:
    """Entity groups of a window read from the blocks' stored order, without sorting the window.

    Every block stores its rows grouped by entity (all its label columns), each entity's
    rows in time order, and the blocks follow each other in time. So a group of any label
    columns is, block after block, the runs of stored rows that share those labels:
    :meth:`Table.groups` gets the row positions of each group from those runs in one pass,
    where a sort of the whole window by the labels' codes would cost a factorize and an
    argsort of every row. Groups are ordered as :meth:`gpudiag.frames.Table.groups` orders them
    (sorted values, the missing label last); None (sort instead) for a dict column or
    labels that do not sort.
    """

    # A block stored as appended is read as runs of equal labels too; past this many runs (rows of
    # many entities interleaved, as finished requests are) sorting the window is cheaper.
    MAX_UNORDERED_RUNS = 4096

    def __init__(self, table: Table, starts: list[int], orders: list[np.ndarray | None],
                 kept: list[_WindowBlock] | None = None, outs: dict[str, _ColumnOut] | None = None):
        self.table, self.starts, self.orders = table, starts, orders
        # The blocks of a lazy read: a numeric label column not made yet is read from each block in
        # stored order (what the runs are found in) instead of being made in time order first.
        self.kept, self.outs = kept, outs
        # keys -> per group, its runs (block, first, end) in the block's kept rows in stored order;
        # None when a group's rows had to be sorted (its runs are not its rows in order).
        self.runs: dict[tuple, list[list[tuple[int, int, int]]] | None] = {}

    def _stored(self, name: str, i: int) -> np.ndarray:
        """Block ``i``'s kept rows of a numeric column in stored order (the order its entity runs are in)."""
        return _kept_stored(self.kept[i], name).astype(self.outs[name].out.dtype, copy=False)  # as when made

    def _pending_kind(self, name: str) -> str | None:
        """"int" or "float" for a numeric column of every block that is not made yet; else None."""
        columns = self.table.columns
        if self.kept is None or not isinstance(columns, LazyColumns) or columns.made(name) or name not in columns:
            return None
        out = self.outs.get(name)
        if out is None or not out.numeric:
            return None
        return "float" if out.out.dtype.kind == "f" else "int"

    def _levels(self, keys):
        levels = []
        for name in keys:
            if self.table.has_codes(name):  # a label column: its codes, without making its values
                codes, uniques = self.table.codes(name)
                levels.append(("codes", codes, uniques))
                continue
            pending = self._pending_kind(name)
            if pending is not None:
                levels.append((pending, name, None))  # read per block, see _stored
                continue
            col = self.table.columns.get(name)
            if not isinstance(col, np.ndarray):
                return None
            if col.dtype == object:
                codes, uniques = self.table.codes(name)
                levels.append(("codes", codes, uniques))
            elif col.dtype.kind in "iub":
                levels.append(("int", col, None))
            elif col.dtype.kind == "f":
                levels.append(("float", col, None))
            else:
                return None
        return levels

    @staticmethod
    def _repeats(levels, last, at: int, k: int, order: np.ndarray, stored: dict) -> bool:
        """Whether a block's rows hold the labels of the block before, row for row, in the same stored order."""
        prev_at, prev_k, prev_order, prev_stored = last[0], last[1], last[2], last[5]
        if k != prev_k or not np.array_equal(order, prev_order):
            return False
        for kind, a, _ in levels:
            if isinstance(a, str):
                same = np.array_equal(stored[a], prev_stored[a], equal_nan=kind == "float")
            else:
                same = np.array_equal(a[at:at + k], a[prev_at:prev_at + k], equal_nan=kind == "float")
            if not same:
                return False
        return True

    def __call__(self, keys: tuple[str, ...]):
        levels = self._levels(keys)
        if levels is None:
            return None
        pieces: dict[tuple, list[np.ndarray]] = {}
        spans: dict[tuple, list[tuple[int, int, int]]] = {}
        ranks: dict[tuple, tuple] = {}
        last = None  # (at, k, order, bounds, idents) of the block before
        for i, order in enumerate(self.orders):
            at, k = self.starts[i], self.starts[i + 1] - self.starts[i]
            if not k:
                continue
            unordered = order is None
            if unordered:
                order = np.arange(k)
            stored = {a: self._stored(a, i) for _, a, _ in levels if isinstance(a, str)}
            if last is not None and self._repeats(levels, last, at, k, order, stored):
                # A steady node: the same entities in the same stored order as the block before,
                # so the same runs, shifted. Comparing the labels in place costs a fraction of
                # gathering them into stored order and finding the runs again.
                bounds, idents = last[3], last[4]
                positions = order.astype(np.int64) + at
                for r, ident in enumerate(idents):
                    pieces[ident].append(positions[bounds[r]:bounds[r + 1]])
                    spans[ident].append((i, int(bounds[r]), int(bounds[r + 1])))
                last = (at, k, order, bounds, idents, stored)
                continue
            values = [stored[a] if isinstance(a, str) else a[at:at + k][order] for _, a, _ in levels]
            change = np.zeros(max(k - 1, 0), dtype=bool)
            for (kind, _, _), v in zip(levels, values):
                differs = v[1:] != v[:-1]
                if kind == "float":
                    differs &= ~(np.isnan(v[1:]) & np.isnan(v[:-1]))
                change |= differs
            bounds = np.concatenate([[0], np.flatnonzero(change) + 1, [k]])
            if unordered and len(bounds) - 1 > self.MAX_UNORDERED_RUNS:
                return None
            firsts = [v[bounds[:-1]].tolist() for v in values]
            positions = order.astype(np.int64) + at  # window rows, run after run
            idents = []
            for r, raw in enumerate(zip(*firsts)):
                key = []
                rank = []
                for (kind, _, uniques), x in zip(levels, raw):
                    if kind == "codes":
                        key.append(uniques[x] if x >= 0 else NAN)
                        rank.append(x if x >= 0 else len(uniques))
                    elif kind == "float" and x != x:
                        key.append(NAN)
                        rank.append((1, 0.0))
                    else:
                        key.append(x)
                        rank.append((0, x))
                ident = tuple(rank)
                got = pieces.get(ident)
                if got is None:
                    got = pieces[ident] = []
                    spans[ident] = []
                    ranks[ident] = tuple(key)
                got.append(positions[bounds[r]:bounds[r + 1]])
                spans[ident].append((i, int(bounds[r]), int(bounds[r + 1])))
                idents.append(ident)
            last = (at, k, order, bounds, idents, stored)
        try:
            idents = sorted(pieces)
        except TypeError:
            return None
        parts = []
        runs: list[list[tuple[int, int, int]]] | None = []
        for ident in idents:
            got = pieces[ident]
            rows = got[0] if len(got) == 1 else np.concatenate(got)
            if len(rows) > 1 and not (rows[1:] > rows[:-1]).all():
                rows = np.sort(rows)  # runs of two entities with the same labels, or a block's rows out of time order
                runs = None
            parts.append(rows)
            if runs is not None:
                runs.append(spans[ident])
        self.runs[keys] = runs
        return [ranks[ident] for ident in idents], parts


def _unguarded(fn, *args):
    return fn(*args)


@contextmanager
def _block_mapper(n: int):
    """``map`` over ``n`` blocks: on up to READ_THREADS threads when there are enough of them.

    Decompressing and decoding release the GIL: a day of a node reads in a fraction of the time.
    """
    if n >= 2 * READ_THREADS > 2:
        with ThreadPoolExecutor(READ_THREADS, thread_name_prefix="gpudiag-store-read") as pool:
            yield pool.map
    else:
        yield map


def _window_table(blocks: list[bytes], start_s: float, end_s: float, node: str | None, mapper=map,
                  guard=_unguarded) -> Table | None:
    """The blocks' rows in [start_s, end_s] (of ``node``) as one Table sorted by ``t``; None when none.

    ``mapper`` runs a function over a list (``map``, or a thread pool's map: decompressing
    and decoding release the GIL). When every block is a zstd block, only ``t`` and the label
    codes are decoded here; every other column (and a label column's values) is decoded when
    first read (:class:`LazyColumns`), through ``guard`` (which turns a damaged chunk into
    one error line).
    """
    def selected(data: bytes) -> _WindowBlock | None:
        block = _WindowBlock(data)
        if block.select(start_s, end_s, node):
            return block
        block.finish()  # a damaged block fails the read whether or not the window keeps its rows
        return None

    kept = [b for b in mapper(selected, blocks) if b is not None]
    if not kept:
        return None
    sizes = [b.k for b in kept]
    starts = np.concatenate([[0], np.cumsum(sizes)]).tolist()
    total = starts[-1]
    outs = {name: _ColumnOut(name, kept, total) for name in dict.fromkeys(n for b in kept for n in b.metas)}
    lazy = all(b.frames is not None for b in kept)
    now = {name for name, out in outs.items() if not lazy or name == "t" or out.mode == "labels"}

    entity_orders: list[np.ndarray | None] = [None] * len(kept)

    def fill(i: int) -> None:
        block = kept[i]
        block.finish()
        for name in block.metas:
            if name in now:
                outs[name].write(i, block, starts[i])
        entity_orders[i] = block.entity_order()
        block.body = block.head = block.rest = block.t = block.order = None
        if not lazy:
            block.block = None

    for _ in mapper(fill, range(len(kept))):
        pass
    have = {name: out.column(sizes) for name, out in outs.items() if name in now and out.mode != "labels"}
    pending = {name: _lazy_column(outs[name], kept, starts, sizes, guard) for name in outs if name not in have}
    peek = _Peek(outs, kept, starts, guard)
    columns = LazyColumns(list(outs), have, pending, any_value=peek.any_value, values_at=peek.values_at,
                          kinds={name: out.kind for name, out in outs.items()})
    codes = {name: (out.codes, out.uniques) for name, out in outs.items() if out.mode == "labels"}
    later = {name: got for name, out in outs.items() if (got := out.label_codes()) is not None}
    table = Table(total, columns, codes=codes)
    if later:
        # A column's part codes are known once its blocks are decoded: make the column first.
        table.set_sources(codes=lambda name: (table.columns[name], later[name]())[1] if name in later else None)
    ordered = table.sorted()
    if ordered is table:
        runs = _EntityRuns(table, starts, entity_orders, kept if lazy else None, outs)
        table.set_sources(groups=runs)
        if lazy:
            table.set_sources(direct=lambda keys: _grouped_maker(outs, kept, runs.runs.get(keys), guard))
    return ordered


def _kept_stored(b: _WindowBlock, name: str) -> np.ndarray:
    """A block's kept rows of a column, in stored order (the order its entity runs are in)."""
    a = b.stored(name)
    return a if b.cut is None else a[np.sort(b.src)]


def _grouped_maker(outs: dict[str, _ColumnOut], kept: list[_WindowBlock], runs, guard):
    """A function making a not yet decoded column in the order of one set of entity groups, or None.

    A block stores its rows grouped by entity, so each group's rows of a block are one run of
    its stored column: the column in group order is those runs copied end to end, group after
    group, straight from each block's decoded column (no column in time order, no gather of
    every row). Numeric columns of every block only (the others are made in time order first).
    """
    if runs is None:
        return None
    at = 0
    per_block: list[list[tuple[int, int, int]]] = [[] for _ in kept]
    for spans in runs:  # where each run lands: groups end to end, a group's runs in block order
        for i, s, e in spans:
            per_block[i].append((s, e, at))
            at += e - s
    total = at
    # A steady node: every block holds every group once, as runs of one length in group order.
    # Then the column in group order is a (groups x rows per group) matrix whose block i is
    # block i's stored column reshaped: one copy per block instead of one per run.
    groups = len(runs)
    uniform: list[tuple[int, int, int]] | None = []  # (block, first column of the matrix, run length)
    col = 0
    for i, spans in enumerate(per_block):
        if not spans:
            continue
        length = spans[0][1] - spans[0][0]
        if len(spans) != groups or any(s != g * length or e - s != length for g, (s, e, _) in enumerate(spans)):
            uniform = None
            break
        uniform.append((i, col, length))
        col += length
    if uniform is not None and groups * col != total:
        uniform = None

    def make(name: str) -> np.ndarray | None:
        out = outs.get(name)
        if out is None or not out.numeric:
            return None
        res = np.empty(total, dtype=out.out.dtype)
        if uniform is not None:
            matrix = res.reshape(groups, total // groups if groups else 0)
            for i, first, length in uniform:
                matrix[:, first:first + length] = _kept_stored(kept[i], name).reshape(groups, length)
            return res
        for b, spans in zip(kept, per_block):
            if not spans:
                continue
            a = _kept_stored(b, name)
            for s, e, to in spans:
                res[to:to + e - s] = a[s:e]
        return res

    return lambda name: guard(make, name)


class _Peek:
    """Answers about a window's columns not decoded yet, from a few of its blocks.

    ``any_value``: a block header tells for integer and boolean columns and for decimal
    floats without NaN; other columns are decoded a block at a time until a value is found.
    ``values_at``: the values at a few rows, decoding only the blocks that hold them (labels
    from their codes). Either answers None where only the whole column can (dicts, objects).
    """

    def __init__(self, outs: dict[str, _ColumnOut], kept: list[_WindowBlock], starts: list[int], guard):
        self.outs, self.kept, self.guard = outs, kept, guard
        self.starts = np.asarray(starts, dtype=np.int64)
        self.cache: dict[tuple[str, int], np.ndarray] = {}  # (name, block): its kept rows in appended order

    def _kept_rows(self, name: str, i: int) -> np.ndarray | None:
        got = self.cache.get((name, i))
        if got is None:
            b = self.kept[i]
            a = b.stored(name)
            if not isinstance(a, np.ndarray) or a.dtype == _OBJECT:
                return None
            got = a if b.src is None else a[b.src]
            if len(self.cache) >= 64:  # a few blocks per column: the last ones, which most reads ask for
                self.cache.pop(next(iter(self.cache)))
            self.cache[(name, i)] = got
        return got

    def any_value(self, name: str) -> bool | None:
        out = self.outs.get(name)
        if out is None or out.mode != "array" or out.out.dtype == _OBJECT:
            return None
        return self.guard(self._any_value, name)

    def _any_value(self, name: str) -> bool | None:
        for i, b in enumerate(self.kept):
            meta = b.metas.get(name)
            if meta is None or not b.k or meta["codec"] == "null":
                continue
            if meta["codec"] in ("int", "bool") or (meta["codec"] == "dec" and not meta.get("nan")):
                return True
            rows = self._kept_rows(name, i)
            if rows is None:
                return None
            if rows.dtype.kind != "f" or not np.isnan(rows).all():
                return True
        return False

    def values_at(self, name: str, positions: np.ndarray):
        out = self.outs.get(name)
        if out is None:
            return None
        positions = np.asarray(positions, dtype=np.int64)
        if out.mode == "labels":
            return _label_lookup(out.uniques)[out.codes[positions]]
        if not out.numeric:
            return None
        return self.guard(self._values_at, name, positions, out.out.dtype)

    def _values_at(self, name: str, positions: np.ndarray, dtype) -> np.ndarray | None:
        res = np.empty(len(positions), dtype=dtype)
        blocks = np.searchsorted(self.starts, positions, side="right") - 1
        for i in np.unique(blocks).tolist():
            rows = self._kept_rows(name, i)
            if rows is None:
                return None
            here = blocks == i
            res[here] = rows[positions[here] - self.starts[i]]
        return res


def _lazy_column(out: _ColumnOut, kept: list[_WindowBlock], starts: list[int], sizes: list[int], guard):
    """The function that decodes one column of a window read when it is first asked for."""
    def make():
        if out.mode != "labels":  # a label column's codes are written already: only its values remain
            def write(i: int) -> None:
                if out.name in kept[i].metas:
                    out.write(i, kept[i], starts[i])

            with _block_mapper(len(kept)) as mapper:
                for _ in mapper(write, range(len(kept))):
                    pass
        return out.column(sizes)

    return lambda: guard(make)
