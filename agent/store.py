"""The agent's timeline store: frames and findings in one SQLite file (WAL), crash-safe.

Layout
------
One table per frame kind (``frames_gpu``, ``frames_process``, ... for every
kind in :data:`gpudiag.frames.FRAME_KINDS`). A table row is a *chunk*: the
rows of that kind over a span of time, with ``t_start``/``t_end`` (indexed,
for time-range reads), the ``node`` when the chunk holds one node, the row
count and a compressed columnar block. Inside a block every row keeps its
``t``, its labels (``node``, ``gpu``, ``uuid``, ``pid``, ``process``,
``engine``, ...) and its catalog columns, so a block reads back as exactly
the rows that were appended. A block describes its own columns, so a column
new to the catalog needs no schema migration.

Why chunks rather than one SQLite row per entity per tick: a node of 8 GPUs
with 16 processes each produces about 180 rows and 1,400 values a second.
Measured on the development machine with the frames of
``bench/bench_exporter.py`` (8 GPUs x 16 processes, one of them with torch
allocator stats, 1 s): a wide table per kind (one column per catalog column,
labels interned into an entity id, indexed by time) takes about 250 MB per
GPU-day; a narrow (t, entity, column, value) table about 650 MB; these chunks
about 12 MB (11.6 MB since each column is a zstd frame of its own; 12.3 MB as one
deflate stream). SQLite spends a header byte and 1 to 8 payload bytes on every
value plus per-row and index overhead, while a chunk stores each column once,
grouped by entity, delta- or XOR-coded and zstd-compressed: a constant column costs
almost nothing and a slowly moving one a byte or two per value. Finished
requests (~80 a second on such a node) are the largest kind: their latencies
are kept to the microsecond, which halves their share. A read of a
time range decodes whole columns with numpy into the analyzers' Tables.

Writes: :meth:`Store.append` buffers frames; :meth:`Store.flush` (called by
the agent every second) encodes them into one small *fresh* chunk per kind
and commits them in one transaction. When a ``chunk_s`` interval (default
300 s of frame time) is complete, its fresh chunks are merged into one
*sealed* chunk, in its own transaction. Every change is a committed SQLite
transaction in WAL mode, so a kill -9 loses at most the frames appended
since the last flush and never leaves a half-written chunk; SQLite's WAL
recovery runs on the next open.

Failures: a full disk or a read-only store never raises into the caller.
:meth:`flush` logs the failure once per kind (again after a recovery),
counts it (:meth:`health`, exported as ``agent_store_errors_total``), keeps
the encoded chunks in memory up to ``max_pending_bytes`` (dropping the
oldest, counted) and writes them when the store is writable again.

One writer per store: a sidecar lock file (``PATH.lock``, ``flock``) holds
the writer's pid; a second writer is refused with a message naming it.
Readers open the file read-only (``mode=ro``) and never take the lock; WAL
lets them read while the writer writes, and the writer never waits for them.

Retention: chunks older than ``retention_s`` before the newest frame are
deleted, then the oldest chunks until the database is under ``max_bytes``
(pages are returned to the file system with incremental vacuum).
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import math
import operator
import os
import re
import sqlite3
import struct
import sys
import threading
import time
import zlib
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import numpy as np
import zstandard

from gpudiag.catalog import CATALOG, M
from gpudiag.errors import GpudiagError
from gpudiag.frames import (
    FRAME_KINDS,
    LEAF_BOOLS,
    NAN,
    DictColumn,
    Frame,
    FrameColumns,
    LazyColumns,
    Table,
    Window,
    cut_codes,
    fill_of,
    is_na,
    live_dtype,
    merge_codes,
    sorted_codes,
)
from gpudiag.frames import concat_columns as concat_frames_columns
from gpudiag.frames import factorize as factorize_table_column
from gpudiag.frames import object_array as _objects

log = logging.getLogger("gpudiag.agent.store")

SCHEMA_VERSION = 7
DEFAULT_RETENTION_S = 7 * 86400.0
DEFAULT_MAX_BYTES = 2 * 1024**3
# Sealed chunks of 5 minutes: long enough that the per-entity first value of each
# column (the only value a delta does not shrink) is amortised over 300 samples,
# short enough that a 15-minute analyzer window decodes at most ~5 minutes it
# does not need.
DEFAULT_CHUNK_S = 300.0
# Threads that decode a long read's chunks side by side (zstd, zlib and numpy release the GIL);
# four keep a reader from crowding out the serving process on the node's cores.
READ_THREADS = max(1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1))
# Chunks kept in memory while the store cannot be written: fresh chunks of an 8-GPU,
# 128-process node take ~7 kB a second, so 32 MiB holds over an hour of outage
# within the agent's memory budget.
DEFAULT_MAX_PENDING_BYTES = 32 * 1024**2
# Unflushed frames are encoded early past this many rows, so a caller that stops
# flushing cannot grow the buffer of Python dicts without bound.
MAX_UNENCODED_ROWS = 20_000
# While the writer is busy (a write waiting on the disk or another process' lock), frames wait
# unencoded; past this many rows (minutes of a busy node, tens of MB of dicts) the oldest are
# dropped and counted, so a writer hung for good cannot take the agent's memory with it.
MAX_WAITING_ROWS = 4 * MAX_UNENCODED_ROWS
# Retention is checked from flush() at most this often (wall clock).
RETENTION_CHECK_INTERVAL_S = 60.0
# A store that could not be opened for writing is retried at most this often.
REOPEN_INTERVAL_S = 10.0
# Size retention deletes down to this fraction of max_bytes, so it does not run
# again on the very next flush.
SIZE_RETENTION_TARGET_RATIO = 0.9
# The WAL is truncated back to this size after a checkpoint (it would otherwise
# keep its high-water mark on disk).
WAL_SIZE_LIMIT_BYTES = 8 * 1024**2
# Sealed chunks are built at most this many intervals per flush, so catching up
# after an outage does not stall one flush.
MAX_SEALS_PER_FLUSH = 4

# A block is a magic naming its codec and layout, then its header and columns. Blocks are
# written with zstd, the header and every column a frame of its own, so a reader decompresses
# only the columns it is asked for; zlib blocks (schema 2 and before: one deflate stream of the
# header and every column) are still read. Measured on the 24 h store of
# bench/bench_investigate.py (8 GPUs x 16 processes, 531 MB of shuffled columns): deflate
# level 6 made 208 MB in 23.6 s and inflated in 2.1 s; zstd level 3 makes 81 MB in 1.0 s and
# decompresses in 0.19 s. Its window and entropy coder find what deflate's 32 kB window and
# Huffman codes miss: the near-constant byte planes of slowly moving counters. Higher levels
# save under 2 % more at 3x to 20x the CPU, which the agent's 1 %-of-a-core budget cannot
# spend; fresh chunks live minutes and take the fastest level.
_ZSTD_MAGIC, _ZLIB_MAGIC = b"GDB2", b"GDB1"
_BLOCK_MAGIC = _ZSTD_MAGIC
_LEVEL_FRESH, _LEVEL_SEALED = 1, 3
_ZSTD_COMPRESSORS = threading.local()  # one compression context per thread per level: they are not thread-safe
_ZSTD_DECOMPRESSORS = threading.local()  # and one decompression context per thread
# What reading a damaged block raises: its codec's errors, and a header or a frame that does not
# add up (a wrong size, a missing key, a short length field).
_DAMAGED_BLOCK_ERRORS = (zlib.error, zstandard.ZstdError, ValueError, KeyError, struct.error)


def _compressor(level: int) -> zstandard.ZstdCompressor:
    compressors = _ZSTD_COMPRESSORS.__dict__
    c = compressors.get(level)
    if c is None:
        c = compressors[level] = zstandard.ZstdCompressor(level=level)
    return c


def _compress(data: bytes, level: int) -> bytes:
    return _compressor(level).compress(data)


def _compressed_json(x, level: int) -> bytes:
    """``x`` as a block's header holds it: compact JSON, compressed."""
    return _compress(json.dumps(x, separators=(",", ":")).encode(), level)


def _compress_parts(parts: list[bytes], n: int, level: int, sealed: bool) -> bytes:
    """One zstd frame of a column's parts; in a sealed block, each byte plane of ``n`` rows a zstd block of its own
    where that is smaller.

    A zstd block codes its literals with one Huffman table. Values that do not follow each other (a
    request's token counts and latencies) have a uniform low byte plane and a skewed high one: coded
    with one table for both, they cost about a bit a byte more than each with its own. The frame is a
    plain zstd frame either way.
    """
    whole = _compress(b"".join(parts), level)
    if not sealed or n < 2:
        return whole
    planes = []
    for part in parts:
        if len(part) > n and len(part) % n == 0:  # a shuffled part: its byte planes, n bytes each
            planes += [part[i:i + n] for i in range(0, len(part), n)]
        else:
            planes.append(part)
    if len(planes) < 2:
        return whole
    writer = _compressor(level).compressobj(size=sum(map(len, planes)))
    blocks = [writer.compress(p) + writer.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK) for p in planes]
    split = b"".join(blocks) + writer.flush()
    return split if len(split) < len(whole) else whole


class _ZlibBody:
    """A zlib block's body (schema 2 and before): ``size`` more bytes at a time from the front, then the rest."""

    STEP = 1 << 16  # compressed bytes inflated at a time while the front is read

    def __init__(self, data):
        self.data, self.fed, self.z = memoryview(data), 0, zlib.decompressobj()

    def read(self, size: int) -> bytes:
        pieces = []
        while size > 0 and self.fed < len(self.data) and not self.z.eof:
            piece = self.z.decompress(self.data[self.fed:self.fed + self.STEP])
            self.fed += self.STEP
            pieces.append(piece)
            size -= len(piece)
        return b"".join(pieces)

    def rest(self) -> bytes:
        out = b"" if self.z.eof else self.z.decompress(self.data[self.fed:]) + self.z.flush()
        self.fed = len(self.data)
        if not self.z.eof:
            raise ValueError("truncated frame block")
        return out


def _zstd_frames(block: bytes) -> tuple[dict, list[tuple[int, int]]]:
    """A zstd block's header and (offset, size) of every frame after it: the entity order (if any), then each column."""
    if block[:4] != _ZSTD_MAGIC:
        raise ValueError("not a gpudiag frame block")
    (head_z,) = struct.unpack("<I", block[4:8])
    header = _expand_header(json.loads(_decompress(memoryview(block)[8:8 + head_z])))
    frames = []
    at = 8 + head_z
    for meta in ([header["order"]] if "order" in header else []) + header["columns"]:
        frames.append((at, meta["z"]))
        at += meta["z"]
    if at != len(block):
        raise ValueError("truncated frame block" if at > len(block) else "frame block with trailing bytes")
    return header, frames


def _decompress(frame) -> bytes:
    """One zstd frame (its size is in its header; a truncated or damaged one raises ZstdError)."""
    d = getattr(_ZSTD_DECOMPRESSORS, "d", None)
    if d is None:  # making a context costs ten times what decompressing a column frame does
        d = _ZSTD_DECOMPRESSORS.d = zstandard.ZstdDecompressor()
    try:
        return d.decompress(frame)
    except zstandard.ZstdError:
        _ZSTD_DECOMPRESSORS.d = None  # a damaged frame: the next one gets a fresh context
        raise


def _inflate(block: bytes) -> tuple[dict, bytes]:
    """(header, every column's payload back to back in header order), of a block of either codec."""
    if block[:4] == _ZLIB_MAGIC:
        (head_len,) = struct.unpack("<I", block[4:8])
        body = _ZlibBody(memoryview(block)[8:]).rest()
        return _expand_header(json.loads(body[:head_len])), body[head_len:]
    header, frames = _zstd_frames(block)
    view = memoryview(block)
    return header, b"".join(_decompress(view[at:at + size]) for at, size in frames)


_MAX_DECIMALS = 6  # decimal scales tried for floats (NVML gives mW, percent, MHz)
_EXACT_INT_LIMIT = 2.0**53


def _table(kind: str) -> str:
    return f"frames_{kind}"


# --- the columnar block codec ----------------------------------------------------------
#
# A block is MAGIC | u32 length of the header frame | zstd(header JSON) | zstd(entity order) |
# zstd(column) for each column, every frame's size in the header ("z"); under the older magic,
# MAGIC | u32 header length | zlib(header JSON + entity order + column payloads), still read.
# Rows are stored grouped by entity (stable, so time order holds inside an entity)
# with the permutation that restores the appended order. Column codecs:
#   int    int64: first differences divided by their greatest common divisor
#          (counters, bytes in pages or MiB, pids); differences of both signs (gauges
#          that go up and down) zigzag-mapped ("zz"), so small steps down stay small
#          numbers instead of filling every high byte with 0xff; or, where that compresses
#          smaller (values that do not follow each other: one row per request), the values
#          less their minimum ("ref"), divided by their greatest common divisor
#   dec    float64 within a few ulps of k / 10**scale: the integers k (as int), the
#          ulp residuals and a NaN bitmap (ratios from percent, watts from mW)
#   xor    other float64: IEEE bits XOR the previous value's bits
#   bool   uint8
#   str    dictionary of strings + int32 codes (-1 = None); a long dictionary front-coded
#          in the header ("front": each value as the length it shares with the one before
#          and the rest), or, where that is smaller, stored as fields after the codes
#          ("fields": decimal and hex runs as numbers, see _split_fields)
#   dict   dicts of numbers (the multi-label metrics): each row's key layout as a
#          code into a list of layouts, each leaf a numeric column of its own
#   json   dictionary of JSON texts + int32 codes (anything else)
#   null   no payload, every value None
#   raw    numbers as they are, and objects as one JSON list: fresh chunks only, which must be cheap to write every
#          second and are re-encoded with the codecs above when sealed
# Numeric payloads are byte-shuffled (all first bytes, then all second bytes, ...)
# so that the compressor sees long runs of equal high-order bytes; in a sealed block each
# byte plane may be a zstd block of its own (see _compress_parts). Every codec is lossless.


def _shuffle(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).view(np.uint8).reshape(-1, a.dtype.itemsize).T.tobytes()


def _unshuffle(b: bytes, dtype, n: int) -> np.ndarray:
    item = np.dtype(dtype).itemsize
    planes = np.frombuffer(b, dtype=np.uint8).reshape(item, n)
    if item == 1:
        return planes.view(dtype).reshape(n)
    # One strided pass per byte plane: several times faster than numpy's copy of the transposed view.
    out = np.empty((n, item), dtype=np.uint8)
    for i in range(item):
        out[:, i] = planes[i]
    return out.view(dtype).reshape(n)


def _deltas(a: np.ndarray) -> np.ndarray:
    out = np.empty_like(a)
    if len(a):
        out[0] = a[0]
        np.subtract(a[1:], a[:-1], out=out[1:])  # wraps in int64; cumsum wraps back
    return out


_WIDTHS = (np.int8, np.int16, np.int32)
_UWIDTHS = (np.uint8, np.uint16, np.uint32)


def _narrow(a: np.ndarray) -> np.ndarray:
    """The integers in the narrowest signed type that holds them (fewer bytes for the compressor to chew)."""
    if not len(a):
        return a.astype(np.int8)
    lo, hi = int(a.min()), int(a.max())
    for dtype in _WIDTHS:
        info = np.iinfo(dtype)
        if info.min <= lo and hi <= info.max:
            return a.astype(dtype)
    return a.astype(np.int64, copy=False)


def _narrow_zigzag(d: np.ndarray) -> np.ndarray:
    """Zigzag codes of int64 steps (0, -1, 1, -2, ... -> 0, 1, 2, 3, ...) in the narrowest unsigned type."""
    u = ((d << 1) ^ (d >> 63)).view(np.uint64)  # wraps past 2**63 as decoding expects
    hi = int(u.max()) if len(u) else 0
    return next((u.astype(t) for t in _UWIDTHS if hi <= np.iinfo(t).max), u)


def _encode_ints(a: np.ndarray) -> tuple[dict, list[bytes]]:
    a = a.astype(np.int64, copy=False)
    d = _deltas(a)
    g = int(np.gcd.reduce(d)) if len(d) else 1
    meta: dict[str, Any] = {"codec": "int"}
    if g > 1:
        d = d // g
        meta["gcd"] = g
    if len(d) > 1 and int(d[1:].min()) < 0 < int(d[1:].max()):
        # Two's complement would give a gauge's every step down high bytes of 0xff, the one
        # byte plane the compressor could skip.
        d = _narrow_zigzag(d)
        meta["zz"] = True
    else:
        d = _narrow(d)
    ref = _frame_of_reference(a, d)
    if ref is not None and ref[2] < REFERENCE_GAIN * len(_compress(_shuffle(d), _LEVEL_SEALED)):
        return ref[0], ref[1]
    meta["width"] = d.dtype.itemsize
    return meta, [_shuffle(d)]


def _frame_of_reference(a: np.ndarray, steps: np.ndarray) -> tuple[dict, list[bytes], int] | None:
    """The values less their minimum ("ref"), with its compressed size; None where wider than ``steps``.

    Steps suit counters and slow gauges; values that do not follow each other (a request's
    token counts and latencies, one row per request) take about one bit more per value as
    steps than as themselves, and a sign.
    """
    if len(a) < 2:
        return None
    lo, hi = int(a.min()), int(a.max())
    if hi - lo > np.iinfo(np.int64).max:
        return None
    r = a - lo
    g = int(np.gcd.reduce(r)) or 1
    if g > 1:
        r = r // g
    u = next((r.astype(t) for t in _UWIDTHS if int(r.max()) <= np.iinfo(t).max), r.astype(np.uint64))
    if u.dtype.itemsize > steps.dtype.itemsize:
        return None
    meta: dict[str, Any] = {"codec": "int", "ref": lo, "width": u.dtype.itemsize}
    if g > 1:
        meta["gcd"] = g
    payload = _shuffle(u)
    return meta, [payload], len(_compress(payload, _LEVEL_SEALED))


# A frame of reference replaces steps only when it compresses to 3 % less: close calls keep the
# steps, which most columns (counters, gauges) are better off with anyway.
REFERENCE_GAIN = 0.97


def _decode_ints(meta: dict, part: bytes, n: int) -> np.ndarray:
    if "ref" in meta:
        a = _unshuffle(part, np.dtype(f"<u{meta['width']}"), n).astype(np.int64)
        if "gcd" in meta:
            a *= meta["gcd"]
        a += meta["ref"]
        return a
    # Summed in int64 straight from the narrow deltas; the gcd multiplies the sums, which in
    # int64's wrapping arithmetic equals summing the multiplied deltas.
    if meta.get("zz"):
        u = _unshuffle(part, np.dtype(f"<u{meta['width']}"), n).astype(np.uint64)
        d = ((u >> np.uint64(1)) ^ (np.uint64(0) - (u & np.uint64(1)))).view(np.int64)
    else:
        d = _unshuffle(part, np.dtype(f"<i{meta['width']}"), n)
    a = np.cumsum(d, dtype=np.int64)
    if "gcd" in meta:
        a *= meta["gcd"]
    return a


_MAX_RESIDUAL_ULPS = 4  # k / 10**s computed another way (33.3 / 100) lands a few ulps off


def _decimal_fit(vals: np.ndarray) -> tuple[int, np.ndarray, np.ndarray] | None:
    """Smallest scale s <= 6 with vals within a few ulps of k / 10**s: (s, k, ulp residuals), or None."""
    if not np.isfinite(vals).all() or (np.signbit(vals) & (vals == 0)).any():  # -0.0: integers have no sign
        return None
    for s in range(_MAX_DECIMALS + 1):
        m = 10.0**s
        k = np.round(vals * m)
        if len(k) and np.abs(k).max() >= _EXACT_INT_LIMIT:
            return None
        resid = vals.view(np.int64) - (k / m if s else k).view(np.int64)
        # min/max, not abs: abs(INT64_MIN) (-0.0 against +0.0) overflows to a negative number.
        if not len(resid) or (resid.min() >= -_MAX_RESIDUAL_ULPS and resid.max() <= _MAX_RESIDUAL_ULPS):
            return s, k.astype(np.int64), resid.astype(np.int8)
    return None


# A request's e2e latency is TTFT + TPOT x (output tokens - 1): the catalog's definition of
# TPOT, vLLM's and the reference engine's; its TTFT is queue time + prefill time (vLLM's and
# the reference engine's). Each is stored as what is left after its sum (rounding, a few
# microseconds) instead of as one more random latency: about three bytes a request less each.
# A column may be a part of another's sum (TTFT of e2e): readers resolve them in that order.
SUM_OF_PARTS = {M.e2e_request_latency_seconds: (M.time_to_first_token_seconds, M.inter_token_latency_seconds,
                                                "output_tokens"),
                M.time_to_first_token_seconds: (M.request_queue_time_seconds, M.request_prefill_time_seconds)}


def _sum_of_parts(scale: int, *terms) -> np.ndarray | None:
    """round(first) + round(second) x (tokens - 1) in units of 10**-scale, exactly, for terms (first, second,
    tokens); round(first) + round(second) for terms (first, second). None where it cannot be."""
    if len(terms) not in (2, 3) or not all(isinstance(x, np.ndarray) for x in terms) \
            or terms[0].dtype.kind != "f" or terms[1].dtype.kind != "f" \
            or (len(terms) == 3 and terms[2].dtype.kind not in "iu"):
        return None
    first, second = terms[0], terms[1]
    m = 10.0**scale
    with np.errstate(over="ignore", invalid="ignore"):  # out of range comes out inf or nan, refused below
        a, b = np.round(first * m), np.round(second * m)
        times = b * (terms[2].astype(np.float64) - 1.0) if len(terms) == 3 else b
        total = a + times
    for x in (a, b, times, total):  # integers in float64 are exact below 2**53
        if not np.isfinite(x).all() or (len(x) and np.abs(x).max() >= _EXACT_INT_LIMIT):
            return None
    return total.astype(np.int64)


def _encode_floats(a: np.ndarray, parts_of: dict | None = None) -> tuple[dict, list[bytes]]:
    a = a.astype(np.float64, copy=False)
    n = len(a)
    nan = np.isnan(a)
    fit = _decimal_fit(a[~nan])
    if fit is None:
        bits = a.view(np.uint64)
        x = bits.copy()
        x[1:] ^= bits[:-1]
        return {"codec": "xor"}, [_shuffle(x)]
    scale, k_present, resid_present = fit
    k = np.zeros(n, dtype=np.int64)
    k[~nan] = k_present
    of = None
    if parts_of is not None and not nan.any():
        predicted = _sum_of_parts(scale, *parts_of.values())
        if predicted is not None:
            k -= predicted
            of = list(parts_of)
    meta, parts = _encode_ints(k)
    if of is not None:
        meta["of"] = of
    meta.update(codec="dec", scale=scale, nan=bool(nan.any()), resid=bool(resid_present.any()))
    if meta["resid"]:
        resid = np.zeros(n, dtype=np.int8)
        resid[~nan] = resid_present
        parts.append(resid.tobytes())
    if meta["nan"]:
        parts.append(np.packbits(nan).tobytes())
    return meta, parts


def _decode_floats(meta: dict, parts: list[bytes], n: int, parts_of: tuple | None = None) -> np.ndarray:
    if meta["codec"] == "xor":
        return np.bitwise_xor.accumulate(_unshuffle(parts[0], np.uint64, n)).view(np.float64)
    k = _decode_ints(meta, parts[0], n)
    if "of" in meta:
        predicted = _sum_of_parts(meta["scale"], *parts_of) if parts_of is not None else None
        if predicted is None:
            raise ValueError(f"column {meta.get('name')} is stored against columns that do not add up")
        k += predicted
    a = k.astype(np.float64)
    if meta["scale"]:
        a /= 10.0 ** meta["scale"]
    i = 1
    if meta["resid"]:
        a.view(np.int64)[:] += np.frombuffer(parts[i], dtype=np.int8)
        i += 1
    if meta["nan"]:
        a[np.unpackbits(np.frombuffer(parts[i], dtype=np.uint8), count=n).astype(bool)] = np.nan
    return a


class _DictColumn:
    """A column of dicts of numbers, flattened: a layout code per row and one array per leaf.

    ``layouts`` lists each distinct key layout (a tuple of leaf paths, a path a
    tuple of keys); ``codes[i]`` is row i's layout (-1 for None); ``leaves[path]``
    holds the leaf's value per row (NaN where the row's layout lacks it);
    ``int_paths`` are the leaves whose values were all integers.
    """

    __slots__ = ("codes", "int_paths", "layouts", "leaves")

    def __init__(self, layouts, codes, leaves, int_paths):
        self.layouts: list[tuple[tuple, ...]] = layouts
        self.codes: np.ndarray = codes
        self.leaves: dict[tuple, np.ndarray] = leaves
        self.int_paths: set[tuple] = int_paths

    def __len__(self) -> int:
        return len(self.codes)

    def take(self, index: np.ndarray) -> _DictColumn:
        """Rows at ``index`` (a permutation or a boolean mask)."""
        return _DictColumn(self.layouts, self.codes[index], {p: v[index] for p, v in self.leaves.items()},
                           self.int_paths)

    @classmethod
    def from_values(cls, values: list) -> _DictColumn | None:
        """Flatten dicts of numbers (nested dicts allowed); None when a value does not fit."""
        same = cls._from_one_shape(values)
        if same is not _NOT_ONE_SHAPE:
            return same
        layouts: dict[tuple, int] = {}
        codes = np.empty(len(values), dtype=np.int32)
        leaf_values: dict[tuple, list] = {}
        for i, v in enumerate(values):
            if v is None:
                codes[i] = -1
                continue
            flat: list[tuple[tuple, Any]] = []
            if not isinstance(v, dict) or not _flatten(v, (), flat):
                return None
            layout = tuple(p for p, _ in flat)
            codes[i] = layouts.setdefault(layout, len(layouts))
            for path, x in flat:
                column = leaf_values.get(path)
                if column is None:
                    column = leaf_values[path] = [None] * len(values)
                column[i] = x
        leaves, ints = {}, set()
        for path, column in leaf_values.items():
            present = [x for x in column if x is not None]
            whole = _whole_leaf(present, set(map(type, present)))
            if whole is None:
                return None
            if whole:
                ints.add(path)
            leaves[path] = np.array([np.nan if x is None else float(x) for x in column], dtype=np.float64)
        return cls(list(layouts), codes, leaves, ints)

    @classmethod
    def _from_one_shape(cls, values: list, *, json_exact: bool = False):
        """:meth:`from_values` for the usual column, every dict with the same keys in the same order
        (nested dicts too; a counter by kind, every second): a leaf at a time instead of a row at a
        time, as a seal flattens ~300 x 128 of them. _NOT_ONE_SHAPE for any other column.

        ``json_exact``: only a column whose JSON text reads back as these very values (str keys;
        leaves all int or all float, no NaN, whose sign and payload JSON drops; no bool, numpy or
        other subclass, which JSON writes as something else), so the result is also
        :meth:`from_values` of the decoded JSON.
        """
        dicts = [v for v in values if v is not None]
        if not dicts or set(map(type, dicts)) != {dict}:
            return _NOT_ONE_SHAPE
        n = len(values)
        present = None if len(dicts) == n else np.array([v is not None for v in values], dtype=bool)
        codes = np.zeros(n, dtype=np.int32) if present is None else np.where(present, 0, -1).astype(np.int32)
        if not any(dicts):  # every dict empty: one layout without leaves (a process missing no column)
            return cls([()], codes, {}, set())
        columns: list[tuple[tuple, Any, set]] = []  # (leaf path, its value in every dict, their types)
        if json_exact:
            found = _leaf_columns(dicts, (), columns, _JSON_KEY_TYPES, _json_exact_leaf)
        else:
            found = _leaf_columns(dicts, (), columns, _KEY_TYPES, _number_leaf)
        if not found:
            return _NOT_ONE_SHAPE  # bools, None, strings, other layouts: the general path decides
        leaves, ints = {}, set()
        for path, column, types in columns:
            whole = _whole_leaf(column, types)
            if whole is None:
                return None
            if whole:
                ints.add(path)
            got = np.array(column, dtype=np.float64)
            if json_exact and path not in ints and np.isnan(got).any():
                return _NOT_ONE_SHAPE
            if present is None:
                leaves[path] = got
            else:
                leaves[path] = np.full(n, np.nan)
                leaves[path][present] = got
        return cls([tuple(p for p, _, _ in columns)], codes, leaves, ints)

    @classmethod
    def concat(cls, parts: list[_DictColumn | None], sizes: list[int]) -> _DictColumn | None:
        """Concatenate (None parts are rows without the column); None when a leaf holds ints in one
        part and floats in another (one float array would turn those ints into floats)."""
        layouts: dict[tuple, int] = {}
        codes, all_paths = [], {}
        for part, n in zip(parts, sizes):
            if part is None:
                codes.append(np.full(n, -1, dtype=np.int32))
                continue
            remap = np.array([layouts.setdefault(layout, len(layouts)) for layout in part.layouts] + [-1],
                             dtype=np.int32)
            codes.append(remap[part.codes])
            for p in part.leaves:
                if all_paths.setdefault(p, p in part.int_paths) != (p in part.int_paths):
                    return None
        int_paths = {p for p, whole in all_paths.items() if whole}
        leaves = {p: np.concatenate([part.leaves[p] if part is not None and p in part.leaves else np.full(n, np.nan)
                                     for part, n in zip(parts, sizes)]) for p in all_paths}
        return cls(list(layouts), np.concatenate(codes), leaves, int_paths)

    def to_objects(self) -> np.ndarray:
        """The column as an object array of (nested) dicts and None."""
        out = np.empty(len(self.codes), dtype=object)
        out[:] = None
        for code, layout in enumerate(self.layouts):
            rows = np.nonzero(self.codes == code)[0]
            if not len(rows):
                continue
            columns = []
            for path in layout:
                vals = self.leaves[path][rows]
                if path in self.int_paths:
                    nan = np.isnan(vals)
                    vals = vals.astype(np.int64).tolist() if not nan.any() else [
                        None if missing else int(x) for x, missing in zip(vals.tolist(), nan.tolist())]
                else:
                    vals = vals.tolist()
                columns.append(vals)
            if not any(len(p) > 1 for p in layout):
                keys = [p[0] for p in layout]
                out[rows] = [dict(zip(keys, values)) for values in zip(*columns)] if columns else [
                    {} for _ in range(len(rows))]
                continue
            objs = []
            for values in zip(*columns):
                d: dict = {}
                for path, x in zip(layout, values):
                    node = d
                    for key in path[:-1]:
                        node = node.setdefault(key, {})
                    node[path[-1]] = x
                objs.append(d)
            out[rows] = objs
        return out


_KEY_TYPES = (str, int, float, bool)
_LEAF_NUMBERS = (int, float, np.integer, np.floating)
_NOT_ONE_SHAPE = object()


def _flatten(d: dict, prefix: tuple, out: list) -> bool:
    """Leaf (path, value) pairs of a dict of numbers; False for anything else (or an empty nested dict)."""
    for key, v in d.items():
        if not isinstance(key, _KEY_TYPES):
            return False
        path = prefix + (key,)
        if isinstance(v, dict):
            if not v or not _flatten(v, path, out):
                return False
        elif isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_)):
            out.append((path, v))
        else:  # a bool or None leaf would come back as a number or NaN: such dicts stay JSON
            return False
    return True


def _whole_leaf(values, types: set) -> bool | None:
    """Whether a leaf's (present) ``values`` of ``types`` are ints (True) or floats (False) in a float64 array;
    None when they cannot be one: ints and floats in one leaf (the ints would come back as floats), or an
    int past 2**53 (it would round)."""
    if types == {float}:
        return False
    if types != {int}:  # numpy numbers among them; {int} and {float} are the common leaves, tested at C speed
        kinds = [issubclass(tp, (int, np.integer)) for tp in types]
        if not all(kinds):
            return None if any(kinds) else False
    if values and (max(values) >= _EXACT_INT_LIMIT or min(values) <= -_EXACT_INT_LIMIT):
        return None
    return True


def _number_leaf(types: set) -> bool:
    return all(issubclass(tp, _LEAF_NUMBERS) and not issubclass(tp, LEAF_BOOLS) for tp in types)


def _json_exact_leaf(types: set) -> bool:
    return types == {int} or types == {float}


_JSON_KEY_TYPES = (str,)


def _leaf_columns(dicts, prefix: tuple, out: list, key_types: tuple, leaf_ok: Callable[[set], bool]) -> bool:
    """(path, the leaf's value in every dict, their types) into ``out``, in :func:`_flatten`'s order,
    for non-empty dicts of one layout (nested dicts too) with keys of exactly ``key_types`` and every
    leaf's value types passing ``leaf_ok``; False for any others."""
    keys = tuple(dicts[0])
    if not keys or not all(type(k) in key_types for k in keys) or not all(map(keys.__eq__, map(tuple, dicts))):
        return False
    columns = zip(*map(operator.itemgetter(*keys), dicts)) if len(keys) > 1 else [[d[keys[0]] for d in dicts]]
    for key, column in zip(keys, columns):
        types = set(map(type, column))
        if types == {dict}:
            if not _leaf_columns(column, prefix + (key,), out, key_types, leaf_ok):
                return False
        elif leaf_ok(types):
            out.append((prefix + (key,), column, types))
        else:
            return False
    return True


def _json_text(v) -> str | None:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return None
    return json.dumps(v, separators=(",", ":"), sort_keys=True, default=str)


def _shares_dicts(a: np.ndarray) -> bool:
    """Whether an object column holds dicts, most rows one of a few objects (the tracker's shared
    ``missing_reasons``): then a fresh block writes each object's JSON once, with a code per row."""
    values = a.tolist()
    first = next((v for v in values if v is not None), None)
    return type(first) is dict and len(set(map(id, values))) * 2 <= len(values)


def _encode_column(a, *, sealed: bool, parts_of: dict | None = None) -> tuple[dict, list[bytes]]:
    """(meta, payload parts) of one column; meta["sizes"] lists the parts it owns directly."""
    if not sealed and isinstance(a, np.ndarray) and a.dtype.kind in "biuf":
        return {"codec": "raw", "dtype": a.dtype.str, "sizes": [a.nbytes]}, [a.tobytes()]
    if not sealed and isinstance(a, np.ndarray) and a.dtype == object:
        if _shares_dicts(a):
            codes, texts = _json_codes(a)
            codes = _narrow(codes)
            parts = [_shuffle(codes)]
            return {"codec": "json", "values": texts, "width": codes.dtype.itemsize, "sizes": [len(parts[0])]}, parts
        text = json.dumps(a.tolist(), separators=(",", ":"), default=str).encode()
        return {"codec": "jsonlist", "sizes": [len(text)]}, [text]
    if isinstance(a, _DictColumn):
        meta = {"codec": "dict", "layouts": [[list(p) for p in layout] for layout in a.layouts], "leaves": []}
        codes = _narrow(a.codes)
        meta["width"] = codes.dtype.itemsize
        parts = [_shuffle(codes)]
        meta["sizes"] = [len(parts[0])]
        for path, values in a.leaves.items():
            leaf, leaf_parts = _encode_floats(values)
            leaf.update(path=list(path), ints=path in a.int_paths, sizes=[len(p) for p in leaf_parts])
            meta["leaves"].append(leaf)
            parts += leaf_parts
        return meta, parts
    meta, parts = _encode_plain(a, parts_of)
    meta["sizes"] = [len(p) for p in parts]
    return meta, parts


# A dictionary of at least this many strings is front-coded in the header: per-request ids
# ("req-3-1041-9f2c41d0", "chatcmpl-...") share long prefixes with the one before them,
# which the compressor, seeing each id whole, pays for again in every row.
FRONT_CODE_MIN_VALUES = 64


# Characters of a dictionary's strings (count times the longest) up to which their shared
# prefixes are found by comparing them as one array: 16 MiB of it. Longer, one pair at a time.
FRONT_CODE_ARRAY_MAX_CHARS = 1 << 22


def _front_code(values: list[str]) -> list:
    """[shared prefix length with the previous value, rest of the value, ...] for every value, flat."""
    n = len(values)
    if n > 1:
        # Each string a row of code points, padded with zeros (NUL) to the longest: a prefix ends at
        # the first column where a row differs from the one before, or where the shorter of the two
        # ends. Before that end every column holds the strings' own characters, NUL included.
        lens = np.fromiter(map(len, values), dtype=np.int64, count=n)
        width = int(lens.max())
        if 0 < width and n * width <= FRONT_CODE_ARRAY_MAX_CHARS:
            chars = np.array(values, dtype=f"<U{width}").view(np.uint32).reshape(n, width)
            differ = chars[1:] != chars[:-1]
            first = np.where(differ.any(axis=1), differ.argmax(axis=1), width)
            shared = [0] + np.minimum(first, np.minimum(lens[1:], lens[:-1])).tolist()
            out: list = [0] * (2 * n)
            out[0::2] = shared
            out[1::2] = [v[k:] for v, k in zip(values, shared)]
            return out
    return _front_code_by_pairs(values)


def _front_code_by_pairs(values: list[str]) -> list:
    """:func:`_front_code` by its definition: each value's common prefix with the one before, a pair at a time."""
    out: list = []
    prev = ""
    for v in values:
        n = len(os.path.commonprefix((prev, v)))
        out += (n, v[n:])
        prev = v
    return out


def _front_decode(coded: list) -> list[str]:
    """The values :func:`_front_code` coded."""
    values: list[str] = []
    prev = ""
    for i in range(0, len(coded), 2):
        prev = prev[:coded[i]] + coded[i + 1]
        values.append(prev)
    return values


def _expand_header(header: dict) -> dict:
    """Give every front-coded string column (and text field) its ``values`` back, so that readers see one layout.

    A dictionary stored as fields gets its ``values`` from the column's payload (:func:`_dictionary`).
    """
    for meta in header["columns"]:
        for m in [meta, *meta.get("fields", ())]:
            if "front" in m:
                m["values"] = _front_decode(m.pop("front"))
    return header


# --- string dictionaries as fields -------------------------------------------------------
#
# Request ids are made of runs: "req-3-1041-9f2c41d0", "cmpl-" and a uuid4 as 32 hex digits,
# "chatcmpl-...". Each string splits into runs of ASCII letters and digits and runs of other
# characters; when every string of a dictionary has the same runs, the dictionary is stored
# as fields, run position by run position, each field a column of the dictionary's length:
#   int    decimal runs ("1041", or "007" when every run has the same width: "pad") as an
#          integer column with the int codec, so a counter costs its steps
#   hex    runs of one length of lowercase (or of uppercase) hex digits, two to a byte
#   str    anything else, neighbouring runs joined ("req-", "-"): a dictionary of its own with codes
# A dictionary is stored as fields only where that compresses smaller than front coding it.

_RUNS = re.compile(r"[0-9A-Za-z]+|[^0-9A-Za-z]+")
_ALNUM = re.compile(r"[0-9A-Za-z]")
_DIGITS = re.compile(r"[0-9]*")
_HEX = {False: re.compile(r"[0-9a-f]*"), True: re.compile(r"[0-9A-F]*")}
_MAX_INT_DIGITS = 18  # every run of up to 18 decimal digits is an int64


def _split_fields(values: list[str]) -> tuple[list[dict], list[bytes]] | None:
    """(field metas, one part per field) of strings that all have the same runs; None where they do not,
    or where no field is a number."""
    runs = [_RUNS.findall(v) for v in values]
    width = len(runs[0]) if runs else 0
    if not width or any(len(r) != width for r in runs):
        return None
    columns = list(zip(*runs))
    alnum = [bool(_ALNUM.match(r)) for r in runs[0]]
    if any(bool(_ALNUM.match(r[0])) != alnum[0] for r in runs):  # runs alternate: the first run fixes the shape
        return None
    kinds = [_run_kind(c) if a else None for c, a in zip(columns, alnum)]
    if not any(kinds):
        return None
    fields: list[tuple[dict, bytes]] = []
    text: list[tuple[str, ...]] = []  # text runs not stored yet: they join the next text runs
    for column, kind in zip(columns, kinds):
        if kind is None:
            text.append(column)
            continue
        if text:
            fields.append(_text_field(text))
            text = []
        if kind[0] == "int":
            meta, (part,) = _encode_ints(np.array([int(v) for v in column], dtype=np.int64))
            if kind[1]:
                meta["pad"] = kind[1]
        else:
            length, upper = kind[1], kind[2]
            digits = "".join(column) if length % 2 == 0 else "0".join(column) + "0"  # odd runs: a nibble of padding
            meta = {"codec": "hex", "len": length, "upper": upper}
            part = _shuffle(np.frombuffer(bytes.fromhex(digits), dtype=f"V{(length + 1) // 2}"))
        fields.append((meta, part))
    if text:
        fields.append(_text_field(text))
    return [meta for meta, _ in fields], [part for _, part in fields]


def _text_field(runs: list[tuple[str, ...]]) -> tuple[dict, bytes]:
    """(meta, codes) of neighbouring text run positions joined into one field of their own dictionary."""
    joined = runs[0] if len(runs) == 1 else ["".join(t) for t in zip(*runs)]
    codes, uniques = _factorize(_objects(list(joined)))
    meta, (part,) = _encode_strings(codes, uniques, fields=False)
    return meta, part


def _run_kind(column: tuple[str, ...]) -> tuple | None:
    """("int", pad width or 0), ("hex", length, upper case) or None (text) of one position of letter and digit runs."""
    lengths = set(map(len, column))
    joined = "".join(column)
    if _DIGITS.fullmatch(joined) and max(lengths) <= _MAX_INT_DIGITS:
        if all(v[0] != "0" or v == "0" for v in column):
            return ("int", 0)
        if len(lengths) == 1:
            return ("int", next(iter(lengths)))
    if len(lengths) == 1:
        for upper, pattern in _HEX.items():
            if pattern.fullmatch(joined):
                return ("hex", next(iter(lengths)), upper)
    return None


def _join_fields(fields: list[dict], parts: list, count: int) -> list[str]:
    """The strings :func:`_split_fields` stored as ``fields``, from their parts."""
    if len(parts) != len(fields):
        raise ValueError("a dictionary of fields with parts missing")
    pieces = []
    for meta, part in zip(fields, parts):
        codec = meta["codec"]
        if codec == "str":
            codes = _codes(part, meta["width"], count, len(meta["values"]))
            pieces.append(_label_lookup(meta["values"], None)[codes].tolist())
        elif codec == "int":
            ints = _decode_ints(meta, part, count).tolist()
            pad = meta.get("pad")
            pieces.append([str(v).zfill(pad) for v in ints] if pad else list(map(str, ints)))
        elif codec == "hex":
            length = meta["len"]
            step = 2 * ((length + 1) // 2)
            digits = _unshuffle(part, np.dtype(f"V{step // 2}"), count).tobytes().hex()
            if meta["upper"]:
                digits = digits.upper()
            pieces.append([digits[i:i + length] for i in range(0, count * step, step)])
        else:
            raise ValueError(f"a dictionary field of unknown codec {codec!r}")
    return list(map("".join, zip(*pieces)))


def _dictionary(meta: dict, parts: list) -> list:
    """A str column's dictionary: ``values``, or joined from its fields (the parts after the codes) once."""
    values = meta.get("values")
    if values is None:
        values = meta["values"] = _join_fields(meta["fields"], parts[1:], meta["count"])
    return values


def _encode_strings(codes: np.ndarray, uniques: list[str], *, fields: bool = True) -> tuple[dict, list[bytes]]:
    """(meta, parts) of a str column: codes, and its dictionary in the header, front-coded when long,
    or as fields in the parts after the codes when that is smaller."""
    codes = _narrow(codes)
    meta: dict[str, Any] = {"codec": "str", "width": codes.dtype.itemsize}
    parts = [_shuffle(codes)]
    if len(uniques) < FRONT_CODE_MIN_VALUES:
        meta["values"] = uniques
        return meta, parts
    meta["front"] = _front_code(uniques)
    split = _split_fields(uniques) if fields else None
    if split is not None:
        field_metas, field_parts = split
        header = len(_compressed_json(field_metas, _LEVEL_SEALED))
        as_fields = header + len(_compress(b"".join(field_parts), _LEVEL_SEALED))
        if as_fields < FIELDS_GAIN * len(_compressed_json(meta["front"], _LEVEL_SEALED)):
            del meta["front"]
            meta.update(fields=field_metas, count=len(uniques))
            parts += field_parts
    return meta, parts


# Fields replace front coding wherever they compress smaller: joining them back costs about what
# front decoding does.
FIELDS_GAIN = 1.0


def _encode_plain(a: np.ndarray, parts_of: dict | None = None) -> tuple[dict, list[bytes]]:
    """(meta, parts) of a plain column; a float column with ``parts_of`` may be stored against them."""
    kind = a.dtype.kind
    if kind == "b":
        return {"codec": "bool"}, [a.astype(np.uint8).tobytes()]
    if kind in "iu":
        return _encode_ints(a)
    if kind == "f":
        return _encode_floats(a, parts_of)
    got = _factorize(a)
    codes, uniques = got if got is not None else (None, [None])  # unhashable values (lists, dicts of strings)
    if not uniques:
        return {"codec": "null"}, []
    if all(isinstance(u, str) for u in uniques):
        return _encode_strings(codes, uniques)
    codes, texts = _json_codes(a)
    codes = _narrow(codes)
    return {"codec": "json", "values": texts, "width": codes.dtype.itemsize}, [_shuffle(codes)]


def _freeze(v):
    """A hashable stand-in for a JSON-able value, equal only for values of equal JSON text and type."""
    if isinstance(v, dict):
        return ("d", tuple(sorted((k, _freeze(x)) for k, x in v.items())))
    if isinstance(v, (list, tuple)):
        return ("l", tuple(_freeze(x) for x in v))
    hash(v)
    if type(v) is float:
        return (float, repr(v))  # -0.0 == 0.0, but their texts differ
    return (type(v), v)


def _json_codes(a: np.ndarray) -> tuple[np.ndarray, list[str]]:
    """(codes, JSON texts) of an object column (-1 for None/NaN): one text per distinct value, not per row."""
    lookup: dict = {}
    firsts: list = []
    codes = []
    # Decoding a fresh block makes equal dicts of strings one object (_Shared): the tracker's
    # missing_reasons of a busy node come ~300 x 128 times to a seal, a few objects per block.
    # The same object has the same code; the array keeps it alive, so its id is not reused.
    by_id: dict[int, int] = {}
    for v in a.tolist():
        if v is None or (isinstance(v, float) and v != v):
            codes.append(-1)
            continue
        code = by_id.get(id(v))
        if code is None:
            try:
                key = _freeze(v)
            except TypeError:  # sets, mixed keys: the text itself
                key = ("t", _json_text(v))
            code = lookup.get(key)
            if code is None:
                code = lookup[key] = len(firsts)
                firsts.append(v)
            by_id[id(v)] = code
        codes.append(code)
    texts: dict[str, int] = {}
    remap = np.array([texts.setdefault(_json_text(v), len(texts)) for v in firsts] + [-1], dtype=np.int64)
    return remap[np.asarray(codes, dtype=np.int64)], list(texts)


def _factorize(a: np.ndarray) -> tuple[np.ndarray, list] | None:
    """(codes, uniques in order of appearance), -1 for None/NaN; None when a value is unhashable.

    pandas' hash table when a reader already loaded it; the agent itself never imports pandas
    (42 MB of resident memory) for the few thousand labels of a chunk. Integer and bool
    columns (a seal's gpu and pid labels) are factorized by numpy, and a column of one value
    (a node's name in every row) is told by one comparison, not one hash a row.
    """
    if a.dtype.kind in "iub" and len(a):
        return _factorize_numbers(a)
    if a.dtype == object and len(a) and isinstance(a[0], str):
        try:
            same = a == a[0]
        except Exception:  # noqa: BLE001 - a value whose comparison fails: hashed below
            same = None
        if isinstance(same, np.ndarray) and same.dtype == bool and same.all():
            # Every value equals the first string, so it is the one key a hash table would keep.
            return np.zeros(len(a), dtype=np.int64), [a[0]]
    if "pandas" in sys.modules:
        import pandas as pd

        try:
            codes, uniques = pd.factorize(a, use_na_sentinel=True)
        except TypeError:
            return None
        return codes.astype(np.int64, copy=False), list(uniques)
    lookup: dict = {}
    get = lookup.setdefault
    try:
        codes = [-1 if v is None or v != v else get(v, len(lookup)) for v in a.tolist()]
    except TypeError:
        return None
    return np.asarray(codes, dtype=np.int64).reshape(len(a)), list(lookup)


class _Cursor:
    def __init__(self, body: bytes, pos: int):
        self.body, self.pos = body, pos

    def take(self, size: int) -> bytes:
        part = self.body[self.pos:self.pos + size]
        self.pos += size
        return part


def _codes(part, width: int, n: int, size: int) -> np.ndarray:
    """The codes of a coded column into a list of ``size`` entries (-1: missing); ValueError where one points
    outside it, which only a damaged block holds (a code one past the end would read as missing, and
    further ones as another row's value)."""
    codes = _unshuffle(part, np.dtype(f"<i{width}"), n)
    if len(codes) and (int(codes.min()) < -1 or int(codes.max()) >= size):
        raise ValueError(f"codes outside a list of {size} entries")
    return codes


def _label_lookup(values: list, missing=NAN) -> np.ndarray:
    """Code -> value object array of a coded column; code -1 (the last entry) reads as ``missing``."""
    lookup = np.empty(len(values) + 1, dtype=object)
    lookup[:-1] = values
    lookup[-1] = missing
    return lookup


class _Shared:
    """Equal labels and equal dicts of strings decoded from one fresh block become one object.

    A fresh block's object columns are one JSON list, and JSON gives every row its own
    strings and dicts: a process name per row, the tracker's ``missing_reasons`` (a few
    reasons per process, the same every second), ~300 x 128 rows in a seal of a busy node.
    Only strings and dicts whose values are all strings are shared (equal means equal as
    JSON; with numbers, 1 == True == 1.0 and 0.0 == -0.0 would merge values of other types).
    A sealed block's str and json codecs share their values the same way: decoded values
    are read, never changed.
    """

    def __init__(self):
        self._seen: dict = {}

    def dict(self, d: dict) -> dict:
        if all(type(v) is str for v in d.values()):
            return self._seen.setdefault(tuple(d.items()), d)
        return d

    def values(self, values: list) -> list:
        seen = self._seen
        return [seen.setdefault(v, v) if type(v) is str else v for v in values]


def _decode_column(meta: dict, cur: _Cursor, n: int, labels: dict | None = None, parts_of: tuple | None = None):
    """One column of a block; with ``labels``, a string column's (codes, values) go there (-1: missing)."""
    codec = meta["codec"]
    parts = [cur.take(size) for size in meta["sizes"]]
    if codec == "dict":
        codes = _codes(parts[0], meta["width"], n, len(meta["layouts"])).astype(np.int32)
        leaves, ints = {}, set()
        for leaf in meta["leaves"]:
            path = tuple(leaf["path"])
            leaves[path] = _decode_floats(leaf, [cur.take(size) for size in leaf["sizes"]], n)
            if leaf["ints"]:
                ints.add(path)
        layouts = [tuple(tuple(p) for p in layout) for layout in meta["layouts"]]
        return _DictColumn(layouts, codes, leaves, ints)
    if codec == "raw":
        return np.frombuffer(parts[0], dtype=np.dtype(meta["dtype"])).copy()
    if codec == "jsonlist":
        shared = _Shared()
        return _objects(shared.values(json.loads(parts[0], object_hook=shared.dict)))
    if codec == "bool":
        return np.frombuffer(parts[0], dtype=np.uint8).astype(bool)
    if codec == "int":
        return _decode_ints(meta, parts[0], n)
    if codec in ("dec", "xor"):
        return _decode_floats(meta, parts, n, parts_of)
    out = np.empty(n, dtype=object)
    if codec == "null":
        out[:] = None
        return out
    values = _dictionary(meta, parts) if codec == "str" else [json.loads(v) for v in meta["values"]]
    codes = _codes(parts[0], meta["width"], n, len(values))
    as_labels = labels is not None and codec == "str"
    if as_labels:
        labels[meta["name"]] = (codes, values)
    # A missing label reads as NaN, as a pandas string column holds it.
    return _label_lookup(values, NAN if as_labels else None)[codes]


def _factorize_numbers(a: np.ndarray) -> tuple[np.ndarray, list]:
    """:func:`_factorize` of a non-empty integer or bool column: the same codes and uniques (Python
    values, in order of appearance), from the window's sorted factorization renumbered by first row."""
    codes, uniques = factorize_table_column(a)
    n, k = len(codes), len(uniques)
    first = np.full(k, n, dtype=np.int64)
    np.minimum.at(first, codes, np.arange(n, dtype=np.int64))
    order = np.argsort(first, kind="stable")
    rank = np.empty(k, dtype=np.int64)
    rank[order] = np.arange(k, dtype=np.int64)
    return rank[codes], [uniques[i] for i in order.tolist()]


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


@dataclass
class _Chunk:
    """An encoded chunk not yet committed (written at the next successful flush)."""

    kind: str
    t_start: float
    t_end: float
    node: str | None
    n_rows: int
    block: bytes
    twin: dict | None = None  # encode_fresh's twin, until the chunk is committed (or its flush fails)


# --- schema and migrations ----------------------------------------------------------------


def _create_kind_table(conn: sqlite3.Connection, kind: str) -> None:
    t = _table(kind)
    conn.execute(f"CREATE TABLE IF NOT EXISTS {t} (t_start REAL NOT NULL, t_end REAL NOT NULL, node TEXT,"
                 " n_rows INTEGER NOT NULL, sealed INTEGER NOT NULL, data BLOB NOT NULL)")
    conn.execute(f"CREATE INDEX IF NOT EXISTS {t}_t_end ON {t} (t_end, t_start)")
    conn.execute(f"CREATE INDEX IF NOT EXISTS {t}_fresh ON {t} (t_start) WHERE sealed = 0")


def _migration_1_initial(conn: sqlite3.Connection) -> None:
    for kind in FRAME_KINDS:
        _create_kind_table(conn, kind)
    conn.execute("CREATE TABLE IF NOT EXISTS findings (id TEXT PRIMARY KEY, kind TEXT NOT NULL,"
                 " severity TEXT NOT NULL, start_s REAL NOT NULL, end_s REAL, json TEXT NOT NULL)")
    conn.execute("CREATE INDEX IF NOT EXISTS findings_time ON findings (start_s, end_s)")


def _migration_2_findings_entity(conn: sqlite3.Connection) -> None:
    # Findings are looked up by GPU (the exporter's active findings per GPU, `investigate
    # --gpu`): the entity moves out of the JSON into indexed columns, backfilled.
    conn.execute("ALTER TABLE findings ADD COLUMN node TEXT")
    conn.execute("ALTER TABLE findings ADD COLUMN gpu INTEGER")
    conn.execute("UPDATE findings SET node = json_extract(json, '$.node'), gpu = json_extract(json, '$.gpu')")
    conn.execute("CREATE INDEX IF NOT EXISTS findings_gpu ON findings (gpu, end_s)")


def _migration_3_zstd_chunks(conn: sqlite3.Connection) -> None:
    # Chunks written from now on are zstd blocks (see _ZSTD_MAGIC), which a gpudiag of schema 2
    # cannot read: the version bump makes it refuse the store by name instead. The zlib chunks
    # already stored stay as they are (every reader still decodes them) and age out.
    pass


def _migration_4_zigzag_ints(conn: sqlite3.Connection) -> None:
    # Sealed chunks from now on may hold zigzag integer columns ("zz" in a column's header),
    # which a gpudiag of schema 3 would decode into wrong numbers without noticing: the
    # version bump makes it refuse the store instead. Chunks already stored read as they are.
    pass


def _migration_5_reference_ints(conn: sqlite3.Connection) -> None:
    # Sealed chunks from now on may hold integer columns stored as values less their minimum
    # ("ref") and front-coded string dictionaries ("front"): a gpudiag of schema 4 would read
    # the first as steps, wrong numbers without noticing, so the version bump makes it refuse
    # the store instead. Chunks already stored read as they are.
    pass


def _migration_6_dictionary_fields(conn: sqlite3.Connection) -> None:
    # Sealed chunks from now on may hold string dictionaries stored as fields in the column's
    # payload ("fields"): a gpudiag of schema 5 finds no values in the header and cannot read
    # them, so the version bump makes it refuse the store instead. Chunks already stored read
    # as they are.
    pass


def _migration_7_ttft_of_parts(conn: sqlite3.Connection) -> None:
    # Sealed chunks from now on may store TTFT against queue time + prefill time: a gpudiag of
    # schema 6 knows sums of three terms only and cannot read it, so the version bump makes it
    # refuse the store instead. Chunks already stored read as they are.
    pass


MIGRATIONS: tuple[tuple[int, str, Any], ...] = (
    (1, "initial", _migration_1_initial),
    (2, "findings_entity", _migration_2_findings_entity),
    (3, "zstd_chunks", _migration_3_zstd_chunks),
    (4, "zigzag_ints", _migration_4_zigzag_ints),
    (5, "reference_ints", _migration_5_reference_ints),
    (6, "dictionary_fields", _migration_6_dictionary_fields),
    (7, "ttft_of_parts", _migration_7_ttft_of_parts),
)
assert MIGRATIONS[-1][0] == SCHEMA_VERSION


def _error_kind(exc: BaseException) -> str:
    """The store-errors counter label of a failure: disk_full, read_only, io, busy, corrupt or other."""
    if isinstance(exc, sqlite3.Error):
        code = getattr(exc, "sqlite_errorcode", None)
        primary = code & 0xFF if isinstance(code, int) else None
        text = str(exc).lower()
        if primary == 13 or "disk is full" in text:
            return "disk_full"
        if primary in (8, 3, 23) or "readonly" in text or "read-only" in text:
            return "read_only"
        if primary == 14:  # SQLITE_CANTOPEN: the directory refuses the -wal/-shm files
            return "read_only"
        if primary in (5, 6):
            return "busy"
        if primary in (11, 26):
            return "corrupt"
        if primary == 10:
            return "io"
        return "other"
    if isinstance(exc, OSError):
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return "disk_full"
        if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            return "read_only"
        return "io"
    return "other"


class Store:
    """A gpudiag timeline store (see the module docstring). Create it with :meth:`Store.open`."""

    def __init__(self, path: str, *, readonly: bool, retention_s: float, max_bytes: int, chunk_s: float,
                 max_pending_bytes: int, must_write: bool = False):
        self.path = os.path.abspath(path)
        self.readonly = readonly
        self.must_write = must_write
        # What this writer made that was not there before (directories, the file, its lock):
        # discard() removes them, so a start that failed leaves nothing behind.
        self._created: list[str] = []
        self.retention_s = float(retention_s)
        self.max_bytes = int(max_bytes)
        self.chunk_s = float(chunk_s)
        self.max_pending_bytes = int(max_pending_bytes)
        self._conn: sqlite3.Connection | None = None
        self._lock_fd: int | None = None
        # Two locks: _mutex serializes the writer (the connection, the backlog, seals, retention),
        # which may wait seconds on the disk or on another process' write lock (busy timeout);
        # _buffer guards only what append and upsert_finding hand over, so the threads that hand
        # frames over (the agent's probes, under its ingest lock) never wait for a write.
        self._mutex = threading.RLock()
        self._buffer = threading.Lock()
        self._unencoded: list[FrameColumns] = []
        self._unencoded_rows = 0
        self._backlog: deque[_Chunk] = deque()
        self._backlog_bytes = 0
        # Per kind, the twins (encode_fresh) of the fresh chunks this writer committed, by rowid:
        # (t_end, rows, columns). A seal takes them instead of decoding the chunks it merges.
        self._twins: dict[str, dict[int, tuple[float, int, dict]]] = {}
        self._repeats: dict[str, dict] = {}  # per kind, its last fresh block's columns (encode_fresh)
        self._pending_findings: dict[str, dict] = {}
        self._errors: dict[str, int] = {}
        self._logged: set[str] = set()
        self._last_error: str | None = None
        self._last_error_kind = "other"
        self._schema_version = 0
        self._dropped_rows = 0
        self._last_flush_s: float | None = None
        # The database's used bytes as the last flush's transaction left them (health() reports them
        # every second: read inside a write transaction they cost no transaction of their own);
        # None after anything else wrote, to be read again.
        self._db_bytes: int | None = None
        self._last_retention = 0.0
        self._last_reopen = 0.0
        self._oldest_fresh: dict[str, float | None] = {}
        self._newest: dict[str, float | None] = {}
        self._closed = False

    # -- opening ---------------------------------------------------------------------------
    @classmethod
    def open(cls, path: str, *, readonly: bool = False, retention_s: float = DEFAULT_RETENTION_S,
             max_bytes: int = DEFAULT_MAX_BYTES, chunk_s: float = DEFAULT_CHUNK_S,
             max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES, must_write: bool = False) -> Store:
        """Open (and for writing, create or migrate) the store at ``path``.

        For writing: takes the writer lock (GpudiagError naming the other agent's
        pid when it is held) and applies pending schema migrations. A store that
        cannot be written (read-only file system, permissions, disk full) does not
        raise: the store is returned degraded, counts the failure in
        :meth:`health`, buffers and retries; with ``must_write`` (a writer that is
        starting: a path that cannot be written now is a mistake, not an outage)
        it raises GpudiagError instead and leaves nothing it created behind, unless
        the failure is another process holding SQLite's write lock for a moment.
        For reading (``readonly=True``): a missing, empty, corrupt or foreign file
        raises GpudiagError (one line).
        """
        if retention_s <= 0 or max_bytes <= 0 or chunk_s <= 0:
            raise GpudiagError("store retention_s, max_bytes and chunk_s must be positive")
        store = cls(path, readonly=readonly, retention_s=retention_s, max_bytes=max_bytes, chunk_s=chunk_s,
                    max_pending_bytes=max_pending_bytes, must_write=must_write)
        if readonly:
            store._open_reader()
        else:
            store._open_writer(first=True)
        return store

    def _open_reader(self) -> None:
        path = self.path
        if not os.path.exists(path):
            raise GpudiagError(f"store {path} does not exist (an agent creates it: gpudiag agent --store {path})")
        if os.path.isdir(path):
            raise GpudiagError(f"store {path} is a directory, not a store file")
        if os.path.getsize(path) == 0:
            raise GpudiagError(f"store {path} is empty: not a gpudiag store")
        uri = f"file:{quote(path)}?mode=ro"
        try:
            conn = self._connect(uri)
            try:
                self._check_schema(conn, writable=False)
            except sqlite3.OperationalError as exc:
                if "unable to open" not in str(exc) or os.path.exists(path + "-wal"):
                    raise
                # No -shm can be created next to a store on a read-only medium and no WAL is
                # pending: nothing can change the file while we read it.
                conn.close()
                conn = self._connect(f"file:{quote(path)}?mode=ro&immutable=1")
                self._check_schema(conn, writable=False)
        except sqlite3.DatabaseError as exc:
            raise GpudiagError(f"store {path} is not a readable gpudiag store: {exc}") from None
        self._conn = conn
        self._schema_version = int(self.meta().get("schema_version", 0))

    @staticmethod
    def _connect(target: str) -> sqlite3.Connection:
        conn = sqlite3.connect(target, uri=target.startswith("file:"), isolation_level=None,
                               check_same_thread=False, timeout=5.0)
        return conn

    def _check_schema(self, conn: sqlite3.Connection, *, writable: bool) -> int:
        """The store's schema version (0 for a brand-new file); GpudiagError for a foreign or newer file."""
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if not tables:
            if writable:
                return 0
            raise GpudiagError(f"store {self.path} holds no tables: not a gpudiag store")
        if "meta" not in tables:
            raise GpudiagError(f"{self.path} is an SQLite file but not a gpudiag store (no meta table)")
        row = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
        try:
            version = int(row[0])
        except (TypeError, ValueError):
            raise GpudiagError(f"{self.path} is not a gpudiag store (no schema_version)") from None
        if version > SCHEMA_VERSION:
            raise GpudiagError(f"store {self.path} has schema {version}, newer than this gpudiag reads "
                               f"({SCHEMA_VERSION}); upgrade gpudiag")
        return version

    def _take_lock(self) -> None:
        lock_path = self.path + ".lock"
        try:
            # O_NOFOLLOW: the agent may run as root; a planted link must not redirect the pid write.
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise GpudiagError(f"store lock {lock_path} is a symbolic link; refusing to use it") from None
            if _error_kind(exc) != "read_only" or not os.path.exists(lock_path):
                raise
            # The directory refuses new files; an existing lock file can still be locked read-only.
            fd = os.open(lock_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                pid = os.pread(fd, 32, 0).decode().strip() or "unknown"
            finally:
                os.close(fd)
            raise GpudiagError(f"store {self.path} is in use by another agent (pid {pid})") from None
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError:
            pass  # a read-only lock file still locks; the pid is informational
        self._lock_fd = fd

    def _open_writer(self, *, first: bool) -> bool:
        """Lock, connect, migrate. True when writable; False (counted, logged) when not."""
        self._last_reopen = time.monotonic()
        try:
            directory = os.path.dirname(self.path)
            if not os.path.isdir(directory):
                missing = []
                while directory and not os.path.isdir(directory):
                    missing.append(directory)
                    directory = os.path.dirname(directory)
                os.makedirs(os.path.dirname(self.path), exist_ok=True)
                if first:
                    self._created += reversed(missing)
            if first:
                self._created += [p for p in (self.path + ".lock", self.path) if not os.path.lexists(p)]
            if self._lock_fd is None:
                self._take_lock()
            conn = self._connect(self.path)
            try:
                self._prepare(conn)
            except BaseException:
                conn.close()
                raise
        except GpudiagError:
            raise
        except (sqlite3.DatabaseError, OSError) as exc:
            kind = _error_kind(exc)
            if kind in ("corrupt", "other") and isinstance(exc, sqlite3.DatabaseError):
                self._release_lock()
                raise GpudiagError(f"store {self.path} is not a writable gpudiag store: {exc}") from None
            if first and self.must_write and kind != "busy":
                self.discard()
                raise GpudiagError(f"store {self.path} cannot be written ({kind}: {exc}); give a --store path "
                                   f"this user can create and write") from None
            self._failed(kind, exc, "cannot open the store for writing")
            return False
        self._conn = conn
        self._db_bytes = None
        self._load_spans()
        if not first:
            self._recovered()
        return True

    def _prepare(self, conn: sqlite3.Connection) -> None:
        version = self._check_schema(conn, writable=True)
        self._schema_version = SCHEMA_VERSION
        if version == 0:
            # Only an empty database can change these; incremental auto-vacuum lets size
            # retention hand pages back to the file system.
            conn.execute("PRAGMA auto_vacuum = INCREMENTAL")
        mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            raise sqlite3.OperationalError(f"cannot switch to WAL mode (journal_mode={mode}): read-only store")
        # NORMAL in WAL mode: a committed transaction survives the process being killed;
        # only an OS crash or power loss can lose the last transactions (never corrupt).
        conn.execute("PRAGMA synchronous = NORMAL")
        conn.execute(f"PRAGMA journal_size_limit = {WAL_SIZE_LIMIT_BYTES}")
        self._migrate(conn, version)
        conn.execute("BEGIN IMMEDIATE")
        try:
            for kind in FRAME_KINDS:  # kinds added to FRAME_KINDS later get their table here
                _create_kind_table(conn, kind)
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise

    def _migrate(self, conn: sqlite3.Connection, version: int) -> None:
        for number, name, apply in MIGRATIONS:
            if number <= version:
                continue
            conn.execute("BEGIN IMMEDIATE")
            try:
                if number == 1:
                    conn.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
                    conn.execute("INSERT OR IGNORE INTO meta VALUES ('created_s', ?)", (repr(time.time()),))
                apply(conn)
                row = conn.execute("SELECT value FROM meta WHERE key = 'migrations'").fetchone()
                history = json.loads(row[0]) if row else []
                history.append({"version": number, "name": name, "applied_s": time.time()})
                conn.execute("INSERT OR REPLACE INTO meta VALUES ('migrations', ?)", (json.dumps(history),))
                conn.execute("INSERT OR REPLACE INTO meta VALUES ('schema_version', ?)", (str(number),))
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            if version:
                log.info("store %s migrated to schema %d (%s)", self.path, number, name)

    def _release_lock(self) -> None:
        if self._lock_fd is not None:
            try:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            finally:
                os.close(self._lock_fd)
                self._lock_fd = None

    # -- failures --------------------------------------------------------------------------
    def _count(self, kind: str) -> None:
        self._errors[kind] = self._errors.get(kind, 0) + 1

    def _failed(self, kind: str, exc: BaseException, what: str) -> None:
        self._count(kind)
        self._last_error_kind = kind
        self._last_error = f"{kind}: {exc}"
        if kind not in self._logged:
            self._logged.add(kind)
            log.error("store %s: %s (%s: %s); live metrics go on, frames are buffered in memory "
                      "(up to %d bytes) and written when the store is writable again",
                      self.path, what, kind, exc, self.max_pending_bytes)

    def _recovered(self) -> None:
        if self._logged:
            log.warning("store %s is writable again (after %s)", self.path, ", ".join(sorted(self._logged)))
            self._logged.clear()

    # -- writing ---------------------------------------------------------------------------
    def append(self, frames: Iterable[Frame]) -> None:
        """Buffer frames for the next :meth:`flush` (nothing touches the disk here)."""
        by_kind: dict[str, list[Frame]] = {}
        for fr in frames:
            if fr.rows:
                by_kind.setdefault(fr.kind, []).append(fr)
        self.append_columns([FrameColumns.of(kind, frs) for kind, frs in by_kind.items()])

    def append_columns(self, chunks: Iterable[FrameColumns]) -> None:
        """Buffer rows already made columns (:meth:`FrameColumns.of`) for the next :meth:`flush`.

        The arrays are kept as they are, never changed: the agent's window reads the same ones.
        """
        self._need_writer()
        with self._buffer:
            for c in chunks:
                if c.n:
                    self._unencoded.append(c)
                    self._unencoded_rows += c.n
            over = self._unencoded_rows > MAX_UNENCODED_ROWS
            if self._unencoded_rows > MAX_WAITING_ROWS:
                # The writer has been stuck for minutes (a hung disk): keep the newest rows.
                cut, rows = 0, self._unencoded_rows
                while rows > MAX_WAITING_ROWS and cut < len(self._unencoded) - 1:
                    rows -= self._unencoded[cut].n
                    cut += 1
                del self._unencoded[:cut]
                self._dropped_rows += self._unencoded_rows - rows
                self._unencoded_rows = rows
        # Rows beyond MAX_UNENCODED_ROWS are encoded here (compact in the backlog) unless the
        # writer is busy: then the flush that holds it takes them when it is done.
        if over and self._mutex.acquire(blocking=False):
            try:
                self._encode_unencoded()
            finally:
                self._mutex.release()

    def upsert_finding(self, finding) -> None:
        """Record a finding (a Finding or a dict in its JSON form), replacing one with the same id.

        Written at the next flush; :meth:`findings` of this store sees it at once.
        """
        self._need_writer()
        if hasattr(finding, "to_dict"):
            d = finding.to_dict()
            # to_dict() rounds floats to 6 significant digits for display, which moves a Unix
            # timestamp by up to an hour and a half: the store keeps the span exact.
            d["start_s"], d["end_s"] = finding.start_s, finding.end_s
        else:
            d = dict(finding)
        for key in ("id", "kind", "severity", "start_s"):
            if d.get(key) is None:
                raise ValueError(f"finding without {key!r}: {d!r}")
        with self._buffer:
            self._pending_findings[str(d["id"])] = d

    def _encode_unencoded(self) -> None:
        """Encode the frames handed over so far into the backlog (the caller holds the writer's lock)."""
        with self._buffer:
            chunks, self._unencoded, self._unencoded_rows = self._unencoded, [], 0
        by_kind: dict[str, list[FrameColumns]] = {}
        for c in chunks:
            by_kind.setdefault(c.kind, []).append(c)
        for kind, chunks in by_kind.items():
            # Several chunks of a kind in one flush join as a seal joins fresh blocks.
            n, columns = (chunks[0].n, dict(chunks[0].columns)) if len(chunks) == 1 else \
                _concat_columns([(c.n, dict(c.columns)) for c in chunks])
            ts = columns["t"]
            block, twin = encode_fresh(columns, n, self._repeats.setdefault(kind, {}))
            chunk = _Chunk(kind, float(ts.min()), float(ts.max()), _uniform_node(columns), n, block, twin)
            self._backlog.append(chunk)
            self._backlog_bytes += len(chunk.block)
        while self._backlog_bytes > self.max_pending_bytes and self._backlog:
            dropped = self._backlog.popleft()
            self._backlog_bytes -= len(dropped.block)
            with self._buffer:
                self._dropped_rows += dropped.n_rows

    def flush(self, *, seal: bool = True) -> int:
        """Write everything buffered in one transaction; return the rows written (0 on failure).

        Never raises for a full disk or a read-only store: the failure is logged
        once, counted in :meth:`health`, and the data stays buffered (bounded).
        Also seals complete intervals and, at most once a minute, applies retention;
        ``seal=False`` leaves both to a later flush.
        """
        self._need_writer()
        with self._mutex:
            self._encode_unencoded()
            if not self._backlog and not self._pending_findings:
                return 0
            if self._conn is None:
                if time.monotonic() - self._last_reopen < REOPEN_INTERVAL_S:
                    self._count(self._last_error_kind)  # same failure as the last open attempt
                    return 0
                try:
                    ok = self._open_writer(first=False)
                except GpudiagError as exc:  # another agent took the store meanwhile
                    self._failed("busy", exc, "cannot open the store for writing")
                    return 0
                if not ok:
                    return 0
            started = time.perf_counter()
            conn = self._conn
            chunks = list(self._backlog)
            with self._buffer:
                findings = list(self._pending_findings.values())
            rowids = []
            try:
                conn.execute("BEGIN IMMEDIATE")
                for c in chunks:
                    rowids.append(conn.execute(
                        f"INSERT INTO {_table(c.kind)} (t_start, t_end, node, n_rows, sealed, data)"
                        " VALUES (?, ?, ?, ?, 0, ?)", (c.t_start, c.t_end, c.node, c.n_rows, c.block)).lastrowid)
                for d in findings:
                    conn.execute(
                        "INSERT INTO findings (id, kind, severity, start_s, end_s, json, node, gpu)"
                        " VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (id) DO UPDATE SET kind = excluded.kind,"
                        " severity = excluded.severity, start_s = excluded.start_s, end_s = excluded.end_s,"
                        " json = excluded.json, node = excluded.node, gpu = excluded.gpu",
                        (str(d["id"]), d["kind"], str(d["severity"]), float(d["start_s"]),
                         None if d.get("end_s") is None else float(d["end_s"]),
                         json.dumps(d, default=str), d.get("node"), d.get("gpu")))
                used = self._used_bytes(conn)
                conn.execute("COMMIT")
            except sqlite3.Error as exc:
                self._rollback()
                self._failed(_error_kind(exc), exc, "cannot write frames")
                for c in chunks:  # a backlog that waits out an outage is bounded by its blocks' bytes alone
                    c.twin = None
                return 0
            self._backlog.clear()
            self._backlog_bytes = 0
            self._db_bytes = used
            for c, rowid in zip(chunks, rowids):
                if c.twin is not None:
                    self._twins.setdefault(c.kind, {})[rowid] = (c.t_end, c.n_rows, c.twin)
                    c.twin = None
            for c in chunks:
                old, new = self._oldest_fresh.get(c.kind), self._newest.get(c.kind)
                self._oldest_fresh[c.kind] = c.t_start if old is None else min(old, c.t_start)
                self._newest[c.kind] = c.t_end if new is None else max(new, c.t_end)
            with self._buffer:
                for d in findings:
                    if self._pending_findings.get(str(d["id"])) is d:
                        del self._pending_findings[str(d["id"])]
            self._recovered()
            written = sum(c.n_rows for c in chunks)
            if seal:
                try:
                    self._seal(final=False)
                    if time.monotonic() - self._last_retention >= RETENTION_CHECK_INTERVAL_S:
                        self.enforce_retention()
                except sqlite3.Error as exc:  # the frames above are committed; this only delays tidying
                    self._rollback()
                    self._failed(_error_kind(exc), exc, "cannot seal chunks or apply retention")
            self._last_flush_s = time.perf_counter() - started
            return written

    def _rollback(self) -> None:
        try:
            if self._conn is not None and self._conn.in_transaction:
                self._conn.execute("ROLLBACK")
        except sqlite3.Error:
            pass

    def _load_spans(self) -> None:
        """Read, per kind, the oldest fresh chunk start and the newest frame (kept in memory after)."""
        self._oldest_fresh, self._newest = {}, {}
        for kind in FRAME_KINDS:
            t = _table(kind)
            self._oldest_fresh[kind] = self._conn.execute(
                f"SELECT min(t_start) FROM {t} WHERE sealed = 0").fetchone()[0]
            self._newest[kind] = self._conn.execute(f"SELECT max(t_end) FROM {t}").fetchone()[0]

    def _seal(self, *, final: bool) -> None:
        """Merge fresh chunks of complete intervals into sealed ones (every interval when ``final``)."""
        conn = self._conn
        seals = 0
        for kind in FRAME_KINDS:
            t = _table(kind)
            oldest, newest = self._oldest_fresh.get(kind), self._newest.get(kind)
            if oldest is None or newest is None:
                continue
            if not final and math.floor(oldest / self.chunk_s) >= math.floor(newest / self.chunk_s):
                continue  # the oldest fresh chunk's interval is still open
            boundary = math.inf if final else math.floor(newest / self.chunk_s) * self.chunk_s
            fresh = conn.execute(f"SELECT rowid, t_start FROM {t} WHERE sealed = 0 AND t_end < ?"
                                 " ORDER BY t_start, rowid", (boundary,)).fetchall()
            twins = self._twins.get(kind, {})
            listed = {rowid for rowid, _ in fresh}
            for rowid in [r for r, (t_end, _, _) in twins.items() if t_end < boundary and r not in listed]:
                del twins[rowid]  # its chunk is gone (retention): never to be sealed
            groups: dict[float, list[int]] = {}
            for rowid, t_start in fresh:
                groups.setdefault(math.floor(t_start / self.chunk_s), []).append(rowid)
            for _, members in sorted(groups.items()):
                if seals >= MAX_SEALS_PER_FLUSH and not final:
                    break
                blocks, damaged = self._fresh_columns(t, twins, members)
                n, columns = _concat_columns(blocks) if blocks else (0, {})
                block = encode_block(columns, n, sealed=True) if n else None
                conn.execute("BEGIN IMMEDIATE")
                try:
                    # A damaged chunk stays as it is (a read of its rows says it is damaged), marked
                    # sealed so that no later seal tries it again.
                    conn.executemany(f"UPDATE {t} SET sealed = 1 WHERE rowid = ?", [(rowid,) for rowid in damaged])
                    conn.executemany(f"DELETE FROM {t} WHERE rowid = ?",
                                     [(rowid,) for rowid in members if rowid not in damaged])
                    if block is not None:
                        ts = columns["t"]
                        conn.execute(f"INSERT INTO {t} (t_start, t_end, node, n_rows, sealed, data)"
                                     " VALUES (?, ?, ?, ?, 1, ?)",
                                     (float(ts.min()), float(ts.max()), _uniform_node(columns), n, block))
                    conn.execute("COMMIT")
                except BaseException:
                    self._rollback()
                    raise
                finally:
                    self._db_bytes = None
                seals += 1
            self._oldest_fresh[kind] = conn.execute(f"SELECT min(t_start) FROM {t} WHERE sealed = 0").fetchone()[0]
            if seals >= MAX_SEALS_PER_FLUSH and not final:
                return

    def _fresh_columns(self, table: str, twins: dict, rowids: list[int]) -> tuple[list[tuple[int, dict]], list[int]]:
        """The raw, flattened columns of fresh chunks (their twins where kept, taken, else decoded),
        and the chunks among them too damaged to read.

        A number column every twin left in its block (of one dtype) is read from the blocks straight
        into one joined array, the same object in every chunk's columns (see _concat_columns).
        """
        kept = {r: twins.pop(r) for r in rowids if r in twins}
        joined: dict[str, _Joined] = {}
        if len(kept) == len(rowids):
            refs = [cols for _, _, cols in kept.values()]
            total = sum(n for _, n, _ in kept.values())
            for name, ref in refs[0].items():
                if isinstance(ref, _InBlock) and all(
                        isinstance(c.get(name), _InBlock) and c[name].dtype == ref.dtype for c in refs):
                    joined[name] = _Joined(np.empty(total, dtype=ref.dtype))
        out, damaged, pos = [], [], 0
        for i in range(0, len(rowids), 100):  # SQLite's bound-parameter limit; a hundred blocks at a time
            part = rowids[i:i + 100]
            data = dict(self._conn.execute(f"SELECT rowid, data FROM {table} WHERE rowid IN"
                                           f" ({','.join('?' * len(part))})", part).fetchall())
            for r in part:
                try:
                    if r not in kept:
                        out.append(_flattened(decode_block(data[r], raw=True)))
                        continue
                    _, n, cols = kept.pop(r)
                    numbers = {name: ref.read(data[r]) for name, ref in cols.items() if isinstance(ref, _InBlock)}
                    if any(len(a) != n for a in numbers.values()):
                        raise ValueError("a number column's frame holds the wrong row count")
                except _DAMAGED_BLOCK_ERRORS as exc:
                    log.warning("store %s: fresh chunk %s of %s is damaged (%s: %s); it is kept as it is and"
                                " left out of its interval's sealed chunk", self.path, r, table,
                                type(exc).__name__, exc)
                    self._count("damaged")
                    damaged.append(r)
                    continue
                for name, a in numbers.items():
                    if name in joined:
                        joined[name].array[pos:pos + n] = a
                        cols[name] = joined[name]
                    else:
                        cols[name] = a  # _concat_columns copies it into the joined column
                out.append((n, cols))
                pos += n
        if damaged:
            for j in joined.values():
                j.array = j.array[:pos]
        return out, damaged

    def enforce_retention(self, now_s: float | None = None) -> int:
        """Delete chunks older than ``retention_s`` (before ``now_s``, default the newest frame),
        then the oldest chunks until the database is under ``max_bytes``. Returns chunks deleted."""
        self._need_writer()
        with self._mutex:
            self._last_retention = time.monotonic()
            self._db_bytes = None
            conn = self._conn
            if conn is None:
                return 0
            deleted = 0
            tables = [_table(k) for k in FRAME_KINDS]
            if now_s is None:
                ends = [conn.execute(f"SELECT max(t_end) FROM {t}").fetchone()[0] for t in tables]
                ends = [e for e in ends if e is not None]
                now_s = max(ends) if ends else None
            conn.execute("BEGIN IMMEDIATE")
            try:
                if now_s is not None:
                    cutoff = now_s - self.retention_s
                    for t in tables:
                        deleted += conn.execute(f"DELETE FROM {t} WHERE t_end < ?", (cutoff,)).rowcount
                    conn.execute("DELETE FROM findings WHERE end_s IS NOT NULL AND end_s < ?", (cutoff,))
                if self._used_bytes(conn) > self.max_bytes:
                    deleted += self._delete_oldest(conn, tables, int(self.max_bytes * SIZE_RETENTION_TARGET_RATIO))
                conn.execute("COMMIT")
            except BaseException:
                self._rollback()
                raise
            if deleted:
                conn.executescript("PRAGMA incremental_vacuum;")  # execute() would free one page only
            return deleted

    def _delete_oldest(self, conn: sqlite3.Connection, tables: list[str], target_bytes: int) -> int:
        """Delete the oldest chunks (all kinds, by end time) until the database uses <= target_bytes."""
        deleted = 0
        # What deleting a chunk frees is not its length: the pages its frames fill hold slack
        # and index entries too (more), and pages it shares with chunks that stay are not freed
        # (less). Each pass counts every chunk as its share of all the pages the database uses,
        # an overestimate (that includes the schema's own pages), so a pass deletes no more than
        # it must; then it measures and goes on. Counted at their length, chunks were taken to
        # free too little: a store of small chunks at twice its limit deleted every one of them.
        for _ in range(64):
            used = self._used_bytes(conn)
            need = used - target_bytes
            if need <= 0:
                break
            candidates = sorted((t_end, t, rowid, size) for t in tables for rowid, t_end, size in conn.execute(
                f"SELECT rowid, t_end, length(data) FROM {t}"))
            if not candidates:
                break
            per_byte = max(used / max(sum(c[3] for c in candidates), 1), 1.0)
            freed = 0.0
            victims: dict[str, list[int]] = {}
            for _, t, rowid, size in candidates:
                victims.setdefault(t, []).append(rowid)
                freed += size * per_byte
                if freed >= need:
                    break
            for t, rowids in victims.items():
                conn.executemany(f"DELETE FROM {t} WHERE rowid = ?", [(r,) for r in rowids])
                deleted += len(rowids)
        return deleted

    @staticmethod
    def _used_bytes(conn: sqlite3.Connection) -> int:
        pages = conn.execute("PRAGMA page_count").fetchone()[0]
        free = conn.execute("PRAGMA freelist_count").fetchone()[0]
        size = conn.execute("PRAGMA page_size").fetchone()[0]
        return (pages - free) * size

    def _need_writer(self) -> None:
        if self.readonly:
            raise GpudiagError(f"store {self.path} is open read-only")
        if self._closed:
            raise GpudiagError(f"store {self.path} is closed")

    # -- reading ---------------------------------------------------------------------------
    @contextmanager
    def snapshot(self) -> Iterator[Store]:
        """Hold one read snapshot for several reads (window, findings, time_range agree).

        The writer keeps writing meanwhile (WAL); what it writes becomes visible
        after the block.
        """
        with self._mutex:
            conn = self._reader_conn()
            if conn is None or conn.in_transaction:
                yield self
                return
            self._guard(conn.execute, "BEGIN")
            try:
                yield self
            finally:
                try:
                    if conn.in_transaction:
                        conn.execute("COMMIT")  # ends a read transaction: nothing to lose
                except sqlite3.Error:
                    pass  # a damaged file already raised the read's own GpudiagError

    def _reader_conn(self) -> sqlite3.Connection | None:
        if self._closed:
            raise GpudiagError(f"store {self.path} is closed")
        return self._conn

    def _guard(self, fn, *args):
        """Run a read; a corrupt file becomes one GpudiagError line."""
        try:
            return fn(*args)
        except sqlite3.DatabaseError as exc:
            raise GpudiagError(f"store {self.path} cannot be read: {exc}") from None
        except _DAMAGED_BLOCK_ERRORS as exc:
            raise GpudiagError(f"store {self.path} holds a damaged chunk: {exc}") from None

    def _query(self, sql: str, params=()) -> list[tuple]:
        conn = self._reader_conn()
        if conn is None:
            return []
        return self._guard(lambda: conn.execute(sql, params).fetchall())

    def _kind_tables(self) -> set[str]:
        return {r[0] for r in self._query("SELECT name FROM sqlite_master WHERE type = 'table'")}

    def window(self, start_s: float, end_s: float, kinds: Iterable[str] | None = None, *,
               node: str | None = None) -> Window:
        """Frames with ``start_s <= t <= end_s`` as a Window (one DataFrame per kind, sorted by ``t``).

        The writer's own window also holds chunks still waiting for a writable store.
        """
        wanted = list(FRAME_KINDS if kinds is None else kinds)
        for kind in wanted:
            if kind not in FRAME_KINDS:
                raise GpudiagError(f"unknown frame kind {kind!r}; expected one of {', '.join(FRAME_KINDS)}")
        tables: dict[str, Table] = {}
        nodes: set[str] = set()
        with self.snapshot():
            present = self._kind_tables()
            for kind in wanted:
                blocks: list[bytes] = []
                if _table(kind) in present:
                    sql = f"SELECT t_start, rowid, data FROM {_table(kind)} WHERE t_end >= ? AND t_start <= ?"
                    params: tuple = (start_s, end_s)
                    if node is not None:
                        sql += " AND (node = ? OR node IS NULL)"
                        params += (node,)
                    # Ordered here, not with ORDER BY: SQLite would copy every chunk's blob into
                    # a temporary sort tree, which costs more than reading them.
                    rows = self._query(sql, params)
                    rows.sort(key=operator.itemgetter(0, 1))
                    blocks += [r[2] for r in rows]
                if not self.readonly:
                    blocks += [c.block for c in list(self._backlog)
                               if c.kind == kind and c.t_end >= start_s and c.t_start <= end_s]
                table = self._guard(self._table_of, blocks, start_s, end_s, node, self._guard)
                if table is not None:
                    tables[kind] = table
                    if "node" in table.columns:
                        nodes.update(v for v in table.distinct("node") if isinstance(v, str))
        if node is None and len(nodes) == 1:
            node = nodes.pop()
        return Window.from_columns(tables, start_s=float(start_s), end_s=float(end_s), node=node,
                                   sources=[f"store:{self.path}"])

    @staticmethod
    def _table_of(blocks: list[bytes], start_s: float, end_s: float, node: str | None,
                  guard=_unguarded) -> Table | None:
        """The blocks' rows in [start_s, end_s] (of ``node``) as one Table sorted by ``t``; None when none.

        Columns, not a DataFrame: a day of a node is ten million rows, and the analyzers read
        arrays; the label codes each block was written with are kept, so nothing is factorized
        again (a DataFrame is still built when a caller asks ``window.tables`` for one).
        """
        with _block_mapper(len(blocks)) as mapper:
            return _window_table(blocks, start_s, end_s, node, mapper, guard)

    def findings(self, start_s: float, end_s: float, *, kinds: Iterable[str] | None = None,
                 gpu: int | None = None) -> list[dict]:
        """Findings whose span overlaps [start_s, end_s] (an open end counts as ongoing), by start time."""
        sql = "SELECT json FROM findings WHERE start_s <= ? AND (end_s IS NULL OR end_s >= ?)"
        params: tuple = (end_s, start_s)
        if gpu is not None:
            # Schema 1 (readable without migration) kept the GPU only inside the JSON.
            sql += " AND gpu = ?" if self._schema_version >= 2 else " AND json_extract(json, '$.gpu') = ?"
            params += (int(gpu),)
        rows = self._query(sql, params) if "findings" in self._kind_tables() else []
        by_id = {d["id"]: d for d in (json.loads(r[0]) for r in rows)}
        if not self.readonly:
            with self._buffer:
                pending = list(self._pending_findings.values())
            for d in pending:
                if d["start_s"] <= end_s and (d.get("end_s") is None or d["end_s"] >= start_s) \
                        and (gpu is None or d.get("gpu") == gpu):
                    by_id[d["id"]] = d
        wanted = None if kinds is None else set(kinds)
        out = [d for d in by_id.values() if wanted is None or d["kind"] in wanted]
        return sorted(out, key=lambda d: (d["start_s"], d["id"]))

    def time_range(self) -> tuple[float, float] | None:
        """(first t, last t) over every kind, or None for a store without frames."""
        lo, hi = math.inf, -math.inf
        with self.snapshot():
            present = self._kind_tables()
            for kind in FRAME_KINDS:
                if _table(kind) in present:
                    a, b = self._query(f"SELECT min(t_start), max(t_end) FROM {_table(kind)}")[0]
                    if a is not None:
                        lo, hi = min(lo, a), max(hi, b)
        if not self.readonly:
            for c in list(self._backlog):
                lo, hi = min(lo, c.t_start), max(hi, c.t_end)
        return None if lo == math.inf else (lo, hi)

    def meta(self) -> dict[str, Any]:
        """The meta table: schema_version (int), migrations (list), created_s, and anything else stored."""
        out: dict[str, Any] = {}
        for key, value in self._query("SELECT key, value FROM meta") if self._conn is not None else []:
            out[key] = json.loads(value) if key == "migrations" else value
        if "schema_version" in out:
            out["schema_version"] = int(out["schema_version"])
        return out

    def health(self) -> dict[str, Any]:
        """Writer health for the agent's self-metrics.

        ``store_errors_total`` (by kind: disk_full, read_only, io, busy, corrupt,
        other) feeds ``agent_store_errors_total``; ``last_flush_seconds`` feeds
        ``agent_store_write_seconds``; ``dropped_rows_total`` counts rows lost
        when the in-memory buffer overflowed.
        """
        with self._mutex:
            db_bytes = self._db_bytes if self._conn is not None else None
            if db_bytes is None and self._conn is not None:
                try:
                    db_bytes = self._db_bytes = self._used_bytes(self._conn)
                except sqlite3.Error:
                    pass
            return {
                "path": self.path,
                "writable": (not self.readonly) and self._conn is not None and not self._logged,
                "store_errors_total": dict(self._errors),
                "last_error": self._last_error,
                "dropped_rows_total": self._dropped_rows,
                "buffered_rows": self._unencoded_rows + sum(c.n_rows for c in self._backlog),
                "buffered_bytes": self._backlog_bytes,
                "last_flush_seconds": self._last_flush_s,
                "db_bytes": db_bytes,
            }

    def metric_rows(self) -> list[dict[str, Any]]:
        """:meth:`health` as self-metrics rows for ``LatestFrames.set_agent_rows`` (catalog ``agent_*`` columns)."""
        h = self.health()
        rows: list[dict[str, Any]] = [{"kind": kind, M.agent_store_errors_total: n}
                                      for kind, n in sorted(h["store_errors_total"].items())]
        rows.append({"probe": "store", M.agent_dropped_events_total: h["dropped_rows_total"]})
        if h["last_flush_seconds"] is not None:
            rows.append({M.agent_store_write_seconds: h["last_flush_seconds"]})
        if h["db_bytes"] is not None:
            rows.append({M.agent_store_bytes: h["db_bytes"]})
        return rows

    def close(self) -> None:
        """Flush (writer), seal every interval, release the lock and close. Safe to call twice."""
        if self._closed:
            return
        try:
            if not self.readonly:
                self.flush()
                lost = self.health()["buffered_rows"]
                if lost:
                    log.error("store %s closed with %d rows that could not be written", self.path, lost)
                with self._mutex:
                    if self._conn is not None and not self._backlog:
                        try:
                            self._seal(final=True)
                            self._conn.executescript("PRAGMA incremental_vacuum;")  # execute() would free one page only
                        except sqlite3.Error as exc:
                            self._failed(_error_kind(exc), exc, "cannot seal chunks at close")
        finally:
            with self._mutex:
                self._closed = True
                if self._conn is not None:
                    self._conn.close()
                    self._conn = None
                self._release_lock()

    def discard(self) -> None:
        """Close, then remove what this writer created: the file, its lock and the directories made for it.

        For a writer whose start failed: a store that existed before is closed and kept as it was.
        """
        self.close()
        if self.path in self._created:
            for suffix in ("-wal", "-shm", "-journal"):  # SQLite's own, gone after a clean close but a crash
                with suppress(FileNotFoundError):
                    os.unlink(self.path + suffix)
        for made in reversed(self._created):
            try:
                if os.path.isdir(made) and not os.path.islink(made):
                    os.rmdir(made)  # only when empty: never a file someone else put there
                else:
                    os.unlink(made)
            except OSError:
                pass
        self._created = []

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> bool:
        self.close()
        return False
