"""Column codecs of the store's blocks: zstd (and the zlib of old blocks), integers (narrowed, zigzag deltas,
frame of reference), floats (decimal scales, XOR), strings (a dictionary, front-coded or as fields, and codes),
dicts of numbers (a float column per leaf) and JSON."""

from __future__ import annotations

import json
import math
import operator
import os
import re
import struct
import sys
import threading
import zlib
from typing import TYPE_CHECKING

import numpy as np
import zstandard

from gpudiag.catalog import M
from gpudiag.frames import LEAF_BOOLS, NAN
from gpudiag.frames import factorize as factorize_table_column
from gpudiag.frames import object_array as _objects

if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any


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
