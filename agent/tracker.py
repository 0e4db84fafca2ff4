"""The three-colour tracker: white, grey and black memory per (GPU, process), their gaps and trends.

Layers (DESIGN.md, "The three colours"), nested:

* white = ``process_torch_allocated_bytes`` (live tensors; in-process reporter),
* grey  = ``process_torch_reserved_bytes`` (caching allocator; in-process reporter),
* black = ``process_gpu_memory_bytes`` (what the driver charges; NVML).

Each tick the tracker joins the process rows of every probe on (GPU, pid) —
the GPU by UUID where a row has one, since torch's device index and NVML's
differ under ``CUDA_VISIBLE_DEVICES`` — and derives:

* the gaps ``process_reserved_minus_allocated_bytes`` (grey - white: the
  allocator's cache and fragmentation) and
  ``process_driver_minus_reserved_bytes`` (black - grey: context, libraries,
  raw cudaMalloc outside PyTorch);
* each layer's slope in bytes per second: the least-squares line through the
  layer's samples of the last ``window_s`` seconds.

A layer that was not observed is None in the row, never 0, and
``missing_reasons[column]`` says why (no reporter in that process, NVML not
listing it, too few samples for a trend). A gap or slope that depends on a
missing layer is None with its own reason.
"""

from __future__ import annotations

import operator
from array import array
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from gpudiag.catalog import M
from gpudiag.frames import Frame

WHITE, GREY, BLACK = "white", "grey", "black"

LAYER_COLUMNS = {
    WHITE: M.process_torch_allocated_bytes,
    GREY: M.process_torch_reserved_bytes,
    BLACK: M.process_gpu_memory_bytes,
}
SLOPE_COLUMNS = {
    WHITE: M.process_torch_allocated_growth_bytes_per_second,
    GREY: M.process_torch_reserved_growth_bytes_per_second,
    BLACK: M.process_gpu_memory_growth_bytes_per_second,
}
GAP_COLUMNS = {
    M.process_reserved_minus_allocated_bytes: (GREY, WHITE),
    M.process_driver_minus_reserved_bytes: (BLACK, GREY),
}

NO_REPORTER = ("no in-process reporter for this process: call gpudiag.instrument() in it "
               "(or run an engine that reports its allocator)")
NVML_NOT_LISTED = ("NVML does not list this process on this GPU (NVML unavailable, or its host PID "
                   "could not be mapped into this PID namespace)")
NVML_NO_VALUE = ("NVML lists the process but gives no per-process memory (not available under MIG "
                 "without privileges, or on WDDM)")

_LABELS = ("node", "gpu", "uuid", "pid", "process")
_TORCH_MARKERS = (M.process_torch_allocated_bytes, M.process_torch_reserved_bytes, "white_missing_reason",
                  "torch_device")
_REASON_KEYS = tuple((f"{layer}_missing_reason", layer) for layer in LAYER_COLUMNS)
# The per-row reasons are a handful of fixed strings: made once, not per row and tick.
_GAP_MISSING = {(column, outer_missing, inner_missing):
                f"{' and '.join(la for la, miss in ((outer, outer_missing), (inner, inner_missing)) if miss)}"
                " layer missing"
                for column, (outer, inner) in GAP_COLUMNS.items()
                for outer_missing in (False, True) for inner_missing in (False, True)}
# Distinct sets of reasons kept for sharing (a node has a few; sample counts add a few more).
MAX_INTERNED_REASONS = 1024
_SLOPE_MISSING = {layer: f"{layer} layer missing" for layer in SLOPE_COLUMNS}
# Per joined-row key tuple: the output key order (labels first, no per-layer reasons), how to copy the
# row into it (None: it already is in that order), which default reasons its layers get (2 * torch_row
# + black_row) and whether it carries reasons of its own.
_ROW_PLANS: dict[tuple, tuple] = {}
_WHITE_COLUMN, _GREY_COLUMN, _BLACK_COLUMN = LAYER_COLUMNS.values()
_SLOPE_KEYS = tuple((SLOPE_COLUMNS[layer], (SLOPE_COLUMNS[layer], _SLOPE_MISSING[layer])) for layer in LAYER_COLUMNS)
_GAP_KEYS = tuple((column, list(LAYER_COLUMNS).index(outer), list(LAYER_COLUMNS).index(inner))
                  for column, (outer, inner) in GAP_COLUMNS.items())
_REPORTER_LACKS = "the in-process reporter does not give this figure"


def _row_plan(keys: tuple) -> tuple:
    labels = tuple(k for k in _LABELS if k in keys)
    order = labels + tuple(k for k in keys if k not in labels and not k.endswith("_missing_reason"))
    if order == keys:
        copy = None
    elif len(order) > 1:
        copy = operator.itemgetter(*order)
    else:  # an itemgetter of one key gives the value, not a tuple
        copy = lambda row: tuple(row[k] for k in order)  # noqa: E731
    black_row = M.process_gpu_memory_bytes in keys or "host_pid" in keys
    torch_row = any(c in keys for c in _TORCH_MARKERS)
    own_reasons = any(reason_key in keys for reason_key, _ in _REASON_KEYS)
    if len(_ROW_PLANS) > 1024:  # key sets come from probes: bound the memo
        _ROW_PLANS.clear()
    plan = _ROW_PLANS[keys] = (order, copy, 2 * torch_row + black_row, own_reasons)
    return plan


def _head_reasons(shape: tuple, given: tuple, defaults: tuple) -> tuple:
    """(column, reason) pairs for the missing layers, then for the gaps that depend on them.

    ``shape`` is (plan's default-reason index, white missing, grey missing, black missing);
    ``given`` the row's own reason per layer, ``defaults`` the reasons used where it gives none.
    """
    layers_missing = shape[1:]
    pairs = [(column, reason or default)
             for column, miss, reason, default in zip(LAYER_COLUMNS.values(), layers_missing, given, defaults)
             if miss]
    for column, outer, inner in _GAP_KEYS:
        outer_missing, inner_missing = layers_missing[outer], layers_missing[inner]
        if outer_missing or inner_missing:
            pairs.append((column, _GAP_MISSING[column, outer_missing, inner_missing]))
    return tuple(pairs)


def least_squares_slope(points: Iterable[tuple[float, float]]) -> float | None:
    """Slope of the least-squares line through (t, y) points; None for fewer than two distinct t."""
    pts = list(points)
    n = len(pts)
    if n < 2:
        return None
    t_mean = sum(t for t, _ in pts) / n
    y_mean = sum(y for _, y in pts) / n
    sxx = sum((t - t_mean) ** 2 for t, _ in pts)
    if sxx == 0:
        return None
    return sum((t - t_mean) * (y - y_mean) for t, y in pts) / sxx


# Removals between two recomputations of a trend's sums from its points.
_REBASE_AFTER = 4096


class _Trend:
    """One layer's samples in the window with running least-squares sums (O(1) per tick).

    Times and values are kept relative to the first sample, so the sums stay
    small next to float precision even for 80 GB values over days. The samples
    sit in two float arrays (16 bytes each, not a tuple of two floats' ~100):
    a node's 128 processes keep five minutes of them.
    """

    def __init__(self):
        self.ts = array("d")
        self.ys = array("d")
        self.head = 0  # samples before it have left the window; cut away in bulk
        self.t0: float | None = None
        self.y0 = 0.0
        self.n = 0
        self.removed = 0
        self.st = self.sy = self.stt = self.sty = 0.0

    def add(self, t: float, y: float) -> None:
        t0 = self.t0
        if t0 is None:
            self.t0 = t0 = t
            self.y0 = y
        dt, dy = t - t0, y - self.y0
        self.ts.append(dt)
        self.ys.append(dy)
        self.n += 1
        self.st += dt
        self.sy += dy
        self.stt += dt * dt
        self.sty += dt * dy

    def drop_before(self, t: float) -> None:
        if self.t0 is None:
            return
        cutoff = t - self.t0
        ts, head, end = self.ts, self.head, len(self.ts)
        if not ts[head] < cutoff and self.removed < _REBASE_AFTER:
            return  # nothing leaves (the common case before the window fills): nothing to cut either
        ys, n, removed = self.ys, self.n, self.removed
        st, sy, stt, sty = self.st, self.sy, self.stt, self.sty
        while head < end and ts[head] < cutoff:
            dt, dy = ts[head], ys[head]
            n -= 1
            st -= dt
            sy -= dy
            stt -= dt * dt
            sty -= dt * dy
            removed += 1
            head += 1
        self.n = n
        self.removed = removed
        self.head = head
        self.st = st
        self.sy = sy
        self.stt = stt
        self.sty = sty
        if head == end:
            self.__init__()
        elif removed >= _REBASE_AFTER:
            self._rebase()
        elif head >= 1024 and 2 * head >= end:
            del ts[:head]
            del ys[:head]
            self.head = 0

    def _rebase(self) -> None:
        """Recompute the sums from the points, relative to the oldest one (bounds rounding drift)."""
        h, t0, y0 = self.head, self.t0, self.y0
        points = [(dt + t0, dy + y0) for dt, dy in zip(self.ts[h:], self.ys[h:])]
        self.__init__()
        for t, y in points:
            self.add(t, y)

    @property
    def span_s(self) -> float:
        return self.ts[-1] - self.ts[self.head] if len(self.ts) > self.head else 0.0

    def slope(self) -> float | None:
        n = self.n
        if n < 2:
            return None
        st, stt = self.st, self.stt
        sxx = stt - st * st / n
        if sxx <= 1e-12 * (stt if stt > 1.0 else 1.0):  # max(1.0, stt), NaN included
            return None
        return (self.sty - st * self.sy / n) / sxx


@dataclass
class _History:
    trends: dict[str, _Trend] = field(default_factory=lambda: {layer: _Trend() for layer in LAYER_COLUMNS})
    last_seen: float = 0.0


class ThreeColourTracker:
    """Joins the three layers per (GPU, pid) each tick and follows each layer's trend."""

    def __init__(self, window_s: float = 300.0, min_samples: int = 3, min_span_s: float = 0.0,
                 forget_after_s: float | None = None):
        self.window_s = window_s
        self.min_samples = min_samples
        self.min_span_s = min_span_s
        self.forget_after_s = window_s if forget_after_s is None else forget_after_s
        self._history: dict[tuple[str, Any], _History] = {}
        self._latest: list[dict[str, Any]] = []
        self._reasons: dict[tuple, dict[str, str]] = {}

    @staticmethod
    def _joined(rows: list[dict[str, Any]]) -> tuple[dict[tuple[str, Any], dict[str, Any]], dict[tuple, dict]]:
        """Key each row by (GPU, pid) and merge the rows of one entity; also the reasons of merged entities.

        The gpu is filled in from the uuid (and back) from the rows that carry both. An entity's
        first row is taken whole (a copy); later ones fill in what it lacks. A merged entity's
        per-layer reasons are the first given by any of its rows (not the merged row's, which the
        later rows overwrite); a lone row's are its own.
        """
        uuid_of: dict[Any, str] = {}
        gpu_of: dict[str, Any] = {}
        for r in rows:
            uuid, gpu = r.get("uuid"), r.get("gpu")
            if uuid and gpu is not None:
                uuid_of.setdefault(gpu, uuid)
                gpu_of.setdefault(uuid, gpu)
        joined: dict[tuple[str, Any], dict[str, Any]] = {}
        told: dict[tuple, dict] = {}
        for r in rows:
            pid = r.get("pid")
            if pid is None:
                continue
            uuid, gpu = r.get("uuid"), r.get("gpu")
            if not uuid and gpu is not None:
                uuid = uuid_of.get(gpu)
            if gpu is None and uuid:
                gpu = gpu_of.get(uuid)
            key = (uuid if uuid else f"gpu{gpu}", int(pid))
            row = dict(r, uuid=uuid, gpu=gpu)
            merged = joined.get(key)
            if merged is None:
                joined[key] = row
                continue
            reasons = told.get(key)
            if reasons is None:  # merged is still the entity's first row
                reasons = told[key] = {layer: merged[rk] for rk, layer in _REASON_KEYS if merged.get(rk)}
            for rk, layer in _REASON_KEYS:
                reason = row.get(rk)
                if reason:
                    reasons.setdefault(layer, reason)
            for k, v in row.items():
                if k == "process" and merged.get(k):
                    continue  # the first name seen (NVML/procfs) wins over a reporter's
                if v is None and k in merged:
                    continue
                merged[k] = v
        return joined, told

    def update(self, now: float, frames: Iterable[Frame], layer_notes: dict[str, str] | None = None) -> Frame:
        """Join this tick's process frames; returns a "process" frame with layers, gaps, slopes and reasons.

        ``layer_notes`` (``{"white"|"grey"|"black": reason}``) replaces the
        default reason for a layer missing everywhere this tick (e.g. the NVML
        probe's own "NVML library not found").
        """
        rows = [r for fr in frames if fr.kind == "process" for r in fr.rows]
        joined, told = self._joined(rows)
        notes = layer_notes or {}
        # Default reasons of (white, grey, black) per row plan's 2 * torch_row + black_row.
        no_torch = (notes.get(WHITE) or NO_REPORTER, notes.get(GREY) or NO_REPORTER)
        no_black, with_black = notes.get(BLACK) or NVML_NOT_LISTED, NVML_NO_VALUE
        defaults = (no_torch + (no_black,), no_torch + (with_black,),
                    (_REPORTER_LACKS, _REPORTER_LACKS, no_black), (_REPORTER_LACKS, _REPORTER_LACKS, with_black))
        heads: dict[tuple, tuple] = {}  # the layers' and gaps' reasons of rows that give none of their own
        derive, cutoff = self._derive, now - self.window_s
        out = [derive(now, key, merged, told.get(key), defaults, heads, cutoff)
               for key, merged in sorted(joined.items(), key=lambda kv: (str(kv[1]["gpu"]), kv[0][1]))]
        self._forget(now, len(joined))
        self._latest = out
        return Frame("process", now, out)

    def _derive(self, now, key, merged, told, defaults, heads, cutoff) -> dict[str, Any]:
        keys = tuple(merged)
        plan = _ROW_PLANS.get(keys)
        if plan is None:
            plan = _row_plan(keys)
        order, copy, kind, own_reasons = plan
        # In order already (labels first, no reasons): the joined row (a private copy) is the output row.
        row = merged if copy is None else dict(zip(order, copy(merged)))
        values = (merged.get(_WHITE_COLUMN), merged.get(_GREY_COLUMN), merged.get(_BLACK_COLUMN))
        white, grey, black = values
        shape = (kind, white is None, grey is None, black is None)
        if told is None and not own_reasons:
            head = heads.get(shape)
            if head is None:
                head = heads[shape] = _head_reasons(shape, (None, None, None), defaults[kind])
        else:
            given = tuple(told.get(layer) for layer in LAYER_COLUMNS) if told is not None else \
                tuple(merged.get(reason_key) for reason_key, _ in _REASON_KEYS)
            head = _head_reasons(shape, given, defaults[kind])
        if white is None:
            row[_WHITE_COLUMN] = None
        if grey is None:
            row[_GREY_COLUMN] = None
        if black is None:
            row[_BLACK_COLUMN] = None
        for column, outer, inner in _GAP_KEYS:
            vo, vi = values[outer], values[inner]
            row[column] = None if vo is None or vi is None else vo - vi
        history = self._history.get(key)
        if history is None:
            history = self._history[key] = _History()
        history.last_seen = now
        min_samples, min_span_s = self.min_samples, self.min_span_s
        tail = []  # the slopes' reasons
        for (column, missing_pair), trend, value in zip(_SLOPE_KEYS, history.trends.values(), values):
            if value is None:
                if trend.t0 is not None:
                    trend.drop_before(cutoff)
                row[column] = None
                tail.append(missing_pair)
                continue
            trend.add(now, float(value))
            trend.drop_before(cutoff)
            slope = None
            if trend.n < min_samples:
                tail.append((column, f"{trend.n} of {min_samples} samples needed for a trend"))
            elif trend.span_s < min_span_s:
                tail.append((column, f"samples span less than {min_span_s:g} s"))
            else:
                slope = trend.slope()
                if slope is None:
                    tail.append((column, "all samples at one instant"))
            row[column] = slope
        row["missing_reasons"] = self._interned(head + tuple(tail))
        return row

    def _interned(self, reasons: tuple[tuple[str, str], ...]) -> dict[str, str]:
        """One shared (read-only) dict per distinct set of (column, reason) pairs.

        A process's reasons are the same second after second, and the same for every process
        without a reporter: shared, the store writes each distinct set once per chunk instead of
        once per row (~600 bytes of JSON x 128 processes a second on a busy node).
        """
        got = self._reasons.get(reasons)
        if got is None:
            if len(self._reasons) >= MAX_INTERNED_REASONS:
                self._reasons.clear()  # reasons that count samples change; never let them pile up
            got = self._reasons[reasons] = dict(reasons)
        return got

    def _forget(self, now: float, seen: int) -> None:
        if seen == len(self._history) and self.forget_after_s >= 0:
            return  # every entity was seen at now: none is older than forget_after_s
        for key in [k for k, h in self._history.items() if now - h.last_seen > self.forget_after_s]:
            del self._history[key]

    @property
    def latest(self) -> list[dict[str, Any]]:
        """The rows of the last ``update``."""
        return list(self._latest)
