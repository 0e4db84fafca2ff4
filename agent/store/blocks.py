"""A block: the rows of one kind over a span as columns, each coded by :mod:`.codecs`, stored grouped by
entity; encoded sealed (five minutes, smallest) or fresh (a flush, fastest), decoded whole or joined."""

from __future__ import annotations

import math
import struct
from typing import TYPE_CHECKING

import numpy as np

from gpudiag.catalog import CATALOG
from gpudiag.frames import DictColumn, Table, sorted_codes

from .codecs import (
    _BLOCK_MAGIC,
    _LEVEL_FRESH,
    _LEVEL_SEALED,
    SUM_OF_PARTS,
    _compress,
    _compress_parts,
    _compressed_json,
    _Cursor,
    _decode_column,
    _decode_ints,
    _decompress,
    _DictColumn,
    _encode_column,
    _encode_ints,
    _factorize,
    _inflate,
    _shares_dicts,
)

if TYPE_CHECKING:
    from typing import Any



def _entity_order(columns: dict, n: int) -> np.ndarray | None:
    """Permutation grouping rows by entity (the non-catalog columns), or None when it would not help."""
    labels = [c for c in columns if c != "t" and c not in CATALOG and isinstance(columns[c], np.ndarray)]
    if not labels or n < 3:
        return None
    key = np.zeros(n, dtype=np.int64)
    groups = 1
    for c in labels:
        got = _factorize(columns[c])
        if got is None:  # unhashable values: not an entity label
            continue
        codes, uniques = got
        if len(uniques) == n:  # a label of its own in every row (a request's id): one row per entity
            return None
        radix = len(uniques) + 1  # a missing label is an entity value of its own
        key = key * radix + codes + 1
        groups *= radix
        if groups > 2**40:  # keep the mixed-radix key inside int64
            uniques, key = np.unique(key, return_inverse=True)
            groups = len(uniques)
    distinct = len(np.unique(key))
    if distinct <= 1 or distinct == n:  # one entity, or one row per entity (finished requests)
        return None
    return np.argsort(key, kind="stable")


# Per-request latencies are kept to the microsecond: far finer than any latency anyone reads
# (milliseconds), and a random float64 costs eight bytes where a microsecond count costs two or
# three. At ~80 finished requests a second they are most of a node's store.
LATENCY_RESOLUTION_DECIMALS = 6


def _at_resolution(name: str, a):
    metric = CATALOG.get(name)
    if metric is not None and metric.entity == "request" and metric.unit == "seconds" \
            and isinstance(a, np.ndarray) and a.dtype.kind == "f":
        return np.round(a, LATENCY_RESOLUTION_DECIMALS)
    return a


def encode_block(columns: dict, n: int, *, sealed: bool = True, twin: dict | None = None,
                 repeats: dict | None = None) -> bytes:
    """Encode ``n`` rows given as columns (numpy arrays, or flattened dict columns) into one block.

    ``sealed=False`` writes a fresh block: cheap codecs, the fastest compression level, rows in
    their appended order. Per-request latencies are rounded to the microsecond. ``twin`` (fresh
    blocks only) is filled with what decoding the block gives back (see :func:`encode_fresh`).
    ``repeats`` (fresh blocks only): the columns of the kind's last fresh block, by name, kept up
    to date here; a column equal to its entry reuses that encoding (see :func:`encode_fresh`).
    """
    if sealed and (twin is not None or repeats is not None):
        raise ValueError("twin and repeats are for fresh blocks (sealed=False) only")
    columns = {k: _at_resolution(k, v) for k, v in columns.items()}
    if sealed:
        columns = {k: _flat_dicts(v) for k, v in columns.items()}
    order = _entity_order(columns, n) if sealed else None
    level = _LEVEL_SEALED if sealed else _LEVEL_FRESH
    header: dict[str, Any] = {"n": n, "columns": []}
    frames: list[bytes] = []
    if order is not None:
        meta, parts = _encode_ints(order)
        frames.append(_compress_parts(parts, n, level, sealed))
        header["order"] = meta | {"sizes": [len(p) for p in parts], "z": len(frames[-1])}
    body = sum(map(len, frames))
    for name, a in columns.items():
        if order is not None:
            a = a.take(order) if isinstance(a, _DictColumn) else a[order]
        if repeats is not None and isinstance(a, np.ndarray) and a.dtype.kind in "biuf":
            # A number column: raw bytes, compared as bytes with the kind's last block's (NaN and -0.0 too).
            raw = a.tobytes()
            entry = repeats.get(name)
            if entry is not None and entry[0] == "raw" and entry[1] == a.dtype.str and entry[2] == raw:
                meta, frame = entry[3], entry[4]
            else:
                meta = {"codec": "raw", "dtype": a.dtype.str, "sizes": [len(raw)], "name": name}
                frame = _compress(raw, level)
                meta["z"] = len(frame)
                repeats[name] = ("raw", a.dtype.str, raw, meta, frame)
            frames.append(frame)
            if twin is not None:
                twin[name] = _InBlock(body, len(frame), a.dtype)
            body += len(frame)
            header["columns"].append(meta)
            continue
        strings = repeats is not None and isinstance(a, np.ndarray) and a.dtype == object
        if strings:
            values = a.tolist()
            repeated = _repeated(repeats.get(name), values, a)
            if repeated is not None:
                meta, frame, kept = repeated
                frames.append(frame)
                if twin is not None:
                    twin[name] = a if kept is None else kept
                body += len(frame)
                header["columns"].append(meta)
                continue
        parts_of = None
        if sealed and name in SUM_OF_PARTS and all(p in columns for p in SUM_OF_PARTS[name]):
            parts_of = {p: columns[p] if order is None else columns[p][order] for p in SUM_OF_PARTS[name]}
        meta, parts = _encode_column(a, sealed=sealed, parts_of=parts_of)
        frames.append(_compress_parts(parts, n, level, sealed))
        if twin is not None and not sealed:
            twin[name] = _InBlock(body, len(frames[-1]), a.dtype) if meta["codec"] == "raw" \
                else _twin_of(a, meta, parts)
        if strings:
            if meta["codec"] == "jsonlist" and set(map(type, values)) <= _STR_OR_NONE:
                repeats[name] = ("strings", values, meta, frames[-1])
            elif twin is not None and len(values) <= REPEAT_BY_TEXT_MAX_ROWS and (text := _text_of(values)):
                repeats[name] = ("text", text, meta, frames[-1], twin[name], _shares_dicts(a))
            else:
                repeats.pop(name, None)
        body += len(frames[-1])
        meta["name"] = name
        meta["z"] = len(frames[-1])
        header["columns"].append(meta)
    head = _compressed_json(header, level)
    if twin is not None:
        for ref in twin.values():
            if isinstance(ref, _InBlock):
                ref.at += 8 + len(head)
    return _BLOCK_MAGIC + struct.pack("<I", len(head)) + head + b"".join(frames)


class _InBlock:
    """A fresh block's number column, in a twin: where its frame lies in the block (read back at the seal).

    Numbers come back from a raw frame as they went in, so the twin need not hold them: a busy
    node's fresh numbers are most of an interval's twins (~10 MB), held for five minutes in
    thousands of small arrays that leave the heap's pages pinned after the seal frees them. The
    seal decompresses each frame straight into its joined column instead (a few µs a frame).
    """

    __slots__ = ("at", "z", "dtype")

    def __init__(self, at: int, z: int, dtype: np.dtype):
        self.at, self.z, self.dtype = at, z, dtype

    def read(self, block: bytes) -> np.ndarray:
        """The column, from the block it was written to (read-only: a view of the frame's bytes)."""
        return np.frombuffer(_decompress(memoryview(block)[self.at:self.at + self.z]), dtype=self.dtype)


def encode_fresh(columns: dict, n: int, repeats: dict | None = None) -> tuple[bytes, dict]:
    """A fresh block of ``n`` rows and its twin: the columns decoding it (raw, dicts flattened) gives back.

    A seal merges an interval's fresh blocks; with the twins kept from the flush that wrote
    them it decodes none of them. Strings come back as they went in; anything else
    (dicts, lists, mixed) is read back from the very JSON text the block holds, so the twin
    equals the decoded block value for value and a seal from either is the same block. A
    number column stays in the block: the twin holds where (an :class:`_InBlock`).

    ``repeats`` is a kind's memory of its last block's columns. A node's names, uuids, labels,
    limits and error counters are the same second after second (on a busy node half the columns
    of a second, three in four of a GPU's); a column equal to the one before (numbers byte for
    byte, strings compared in C, other small columns by their repr: a fraction of the cost of
    writing and compressing them) takes that column's frame, header entry and twin as they are,
    so the block is byte for byte what encoding it anew makes.
    """
    twin: dict = {}
    return encode_block(columns, n, sealed=False, twin=twin, repeats=repeats), twin


def _repeated(entry: tuple | None, values: list, a: np.ndarray) -> tuple[dict, bytes, Any] | None:
    """(header entry, frame, twin) of an object column that encodes as ``entry``'s did; None: encode it.

    The twin is None where it is the array itself (strings). An entry of strings and None holds
    the values: equal values are strings (or str subclasses, which JSON writes alike) and None at
    the same places, so their JSON text is the entry's. An entry of other values (a GPU's
    per-label counters, which rarely move) holds their repr, taken when they were encoded (a dict
    may change in place after): equal reprs are values of equal types and JSON text, and with
    the same dicts shared between rows or not (:func:`_shares_dicts`) the same encoding.
    """
    if entry is None or entry[0] == "raw":
        return None
    if entry[0] == "strings":
        try:
            same = entry[1] == values
        except Exception:  # noqa: BLE001 - a value whose comparison fails is simply not a repeat
            same = False
        return (entry[2], entry[3], None) if same else None
    same = len(values) <= REPEAT_BY_TEXT_MAX_ROWS and entry[5] == _shares_dicts(a) and entry[1] == _text_of(values)
    return (entry[2], entry[3], entry[4]) if same else None


def _text_of(values: list) -> str | None:
    """The repr that _repeated compares; None where a value's repr fails (such a column never repeats)."""
    try:
        return repr(values)
    except Exception:  # noqa: BLE001 - a probe's odd value: encoded anew every time
        return None


_STR_OR_NONE = frozenset((str, type(None)))
# An object column of other values than strings repeats when its repr does (_repeated): a GPU's
# counters by label, a row a GPU. Larger columns (a process's counters, which move every second)
# would pay the repr for nothing.
REPEAT_BY_TEXT_MAX_ROWS = 64


def _twin_of(a, meta: dict, parts: list[bytes]):
    """What decoding a fresh column of ``meta`` and ``parts`` gives back (raw, flattened): ``a`` itself
    where that is the same (strings, dicts of numbers that JSON gives back unchanged, flattened), else
    the decoder's reading of the parts. (Raw number columns stay in the block: :class:`_InBlock`.)"""
    if meta["codec"] == "jsonlist":
        values = a.tolist()
        if set(map(type, values)) <= _STR_OR_NONE:
            return a
        flat = _DictColumn._from_one_shape(values, json_exact=True)
        if isinstance(flat, _DictColumn):
            return flat
        a = _decode_column(meta, _Cursor(b"".join(parts), 0), len(a))
    elif meta["codec"] == "json":
        a = _decode_column(meta, _Cursor(b"".join(parts), 0), len(a))
    return _flat_dicts(a)


def decode_block(block: bytes, *, raw: bool = False) -> tuple[int, dict]:
    """Decode a block into (row count, {column: array}) in the order the rows were appended.

    Dict columns come back as object arrays of dicts, or flattened when ``raw``
    (for merging blocks without building the dicts).
    """
    n, columns, _ = _decode(block, raw=raw, labels=None)
    return n, columns


def decode_table(block: bytes) -> Table:
    """Decode a block into a :class:`Table`: dict columns per leaf, string labels with their codes."""
    labels: dict = {}
    n, columns, labels = _decode(block, raw=True, labels=labels)
    cols = {name: (_frames_dict_column(a, n) if isinstance(a, _DictColumn) else a) for name, a in columns.items()}
    codes = {name: sorted_codes(c.astype(np.int64), list(values)) for name, (c, values) in labels.items()}
    return Table(n, cols, codes=codes)


def _frames_dict_column(a: _DictColumn, n: int) -> DictColumn:
    """The store's flattened dict column as the analyzers' DictColumn (same leaf arrays, no dicts built)."""
    layouts = [tuple((path, "i" if path in a.int_paths else "f") for path in layout) for layout in a.layouts]
    return DictColumn(n, a.codes.astype(np.int32, copy=False), layouts, dict(a.leaves), {}, {})


def _decode(block: bytes, *, raw: bool, labels: dict | None) -> tuple[int, dict, dict | None]:
    header, payload = _inflate(block)
    n = header["n"]
    cur = _Cursor(payload, 0)
    inverse = None
    if "order" in header:
        order = _decode_ints(header["order"], cur.take(header["order"]["sizes"][0]), n)
        inverse = np.empty(n, dtype=np.int64)
        inverse[order] = np.arange(n)
    columns: dict = {}
    deferred = {}  # columns stored against others: decoded once those are, in stored order
    for meta in header["columns"]:
        if "of" in meta:
            deferred[meta["name"]] = (meta, _Cursor(b"".join(cur.take(size) for size in meta["sizes"]), 0))
            columns[meta["name"]] = None  # keeps the header's column order
            continue
        a = _decode_column(meta, cur, n, labels)
        if inverse is not None:
            a = a.take(inverse) if isinstance(a, _DictColumn) else a[inverse]
            if labels is not None and meta["name"] in labels:
                codes, values = labels[meta["name"]]
                labels[meta["name"]] = (codes[inverse], values)
        if isinstance(a, _DictColumn) and not raw:
            a = a.to_objects()
        columns[meta["name"]] = a
    while deferred:
        # a column stored against another stored against others (e2e of TTFT of queue and prefill)
        # waits for it; one whose parts never come is decoded against what there is, and refused
        ready = [k for k, (meta, _) in deferred.items() if not any(p in deferred for p in meta["of"])] \
            or list(deferred)
        for name in ready:
            meta, part = deferred.pop(name)
            parts_of = tuple(columns.get(p) for p in meta["of"])
            if inverse is not None:
                parts_of = tuple(None if p is None else p[order] for p in parts_of)
            a = _decode_column(meta, part, n, parts_of=parts_of)
            columns[name] = a if inverse is None else a[inverse]
    return n, columns, labels


def _flattened(block: tuple[int, dict]) -> tuple[int, dict]:
    """A decoded fresh block with its dict columns flattened: a seal joins ~300 of them, and as
    Python dicts a busy node's per-process counters would all be alive at once (tens of MB)."""
    n, columns = block
    return n, {name: _flat_dicts(a) for name, a in columns.items()}


def _flat_dicts(a):
    """An object column of dicts of numbers as a flattened dict column; anything else unchanged."""
    if isinstance(a, np.ndarray) and a.dtype == object:
        for v in a.tolist():
            if v is not None:
                if isinstance(v, dict):
                    flat = _DictColumn.from_values(a.tolist())
                    return a if flat is None else flat
                break
    return a


class _Joined:
    """A column already joined across every block given to _concat_columns, in each block's columns."""

    __slots__ = ("array",)

    def __init__(self, array: np.ndarray):
        self.array = array


def _concat_columns(blocks: list[tuple[int, dict]]) -> tuple[int, dict]:
    """Concatenate decoded (raw) blocks, filling columns a block lacks with NaN/None.

    Takes each column out of the blocks as it is joined, so the parts of a column are freed
    once joined and the blocks and the result are never held in full together.
    """
    names: dict[str, None] = {}
    for _, cols in blocks:
        for k in cols:
            names.setdefault(k, None)
    sizes = [n for n, _ in blocks]
    total = sum(sizes)
    out: dict = {}
    for name in names:
        parts = [cols.pop(name, None) for _, cols in blocks]
        if isinstance(parts[0], _Joined):  # joined already, in every block (_fresh_columns)
            out[name] = parts[0].array
            continue
        present = [p for p in parts if p is not None]
        joined = _DictColumn.concat(parts, sizes) if all(isinstance(p, _DictColumn) for p in present) else None
        if joined is not None:
            out[name] = joined
            continue
        parts = [p.to_objects() if isinstance(p, _DictColumn) else p for p in parts]
        if any(p is not None and p.dtype.kind in "iuf" for p in parts):
            # A block where a number column was all None holds it as objects: as missing numbers
            # it joins the others as one block with those rows would have held it (NaN).
            parts = [None if p is not None and p.dtype == object and not any(v is not None for v in p.tolist())
                     else p for p in parts]
            present = [p for p in parts if p is not None]
        kinds = {p.dtype.kind for p in parts if p is not None}
        if len(present) == len(parts) and len(kinds) == 1:
            out[name] = np.concatenate(parts)
        elif kinds <= {"i", "u", "f"}:
            out[name] = np.concatenate([p.astype(np.float64) if p is not None else np.full(n, np.nan)
                                        for p, n in zip(parts, sizes)])
        else:
            merged = np.empty(total, dtype=object)
            pos = 0
            for p, n in zip(parts, sizes):
                if p is None:
                    merged[pos:pos + n] = None
                elif p.dtype.kind == "f":
                    merged[pos:pos + n] = [None if math.isnan(v) else v for v in p.tolist()]
                else:
                    merged[pos:pos + n] = p.tolist()
                pos += n
            out[name] = merged
    return total, out


def _uniform_node(columns: dict) -> str | None:
    nodes = columns.get("node")
    if not isinstance(nodes, np.ndarray) or nodes.dtype != object or not len(nodes):
        return None
    first = nodes[0]
    if isinstance(first, str) and (nodes == first).all():
        return first
    return None
