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
_TORCH_SIDE = {WHITE, GREY}
_TORCH_MARKERS = (M.process_torch_allocated_bytes, M.process_torch_reserved_bytes, "white_missing_reason",
                  "torch_device")
_REASON_KEYS = tuple((layer, f"{layer}_missing_reason") for layer in LAYER_COLUMNS)
# The per-row reasons are a handful of fixed strings: made once, not per row and tick.
_GAP_MISSING = {(column, outer_missing, inner_missing):
                f"{' and '.join(la for la, miss in ((outer, outer_missing), (inner, inner_missing)) if miss)}"
                " layer missing"
                for column, (outer, inner) in GAP_COLUMNS.items()
                for outer_missing in (False, True) for inner_missing in (False, True)}
# Distinct sets of reasons kept for sharing (a node has a few; sample counts add a few more).
MAX_INTERNED_REASONS = 1024
_SLOPE_MISSING = {layer: f"{layer} layer missing" for layer in SLOPE_COLUMNS}
# Output key order per input key tuple: labels first, then the rest without the per-layer reasons.
_ROW_ORDER: dict[tuple, tuple] = {}


def _row_order(keys: tuple) -> tuple:
    labels = tuple(k for k in _LABELS if k in keys)
    order = labels + tuple(k for k in keys if k not in labels and not k.endswith("_missing_reason"))
    if len(_ROW_ORDER) > 1024:  # key sets come from probes: bound the memo
        _ROW_ORDER.clear()
    _ROW_ORDER[keys] = order
    return order


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
        if self.t0 is None:
            self.t0, self.y0 = t, y
        dt, dy = t - self.t0, y - self.y0
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
        ts, ys, head, end = self.ts, self.ys, self.head, len(self.ts)
        while head < end and ts[head] < cutoff:
            dt, dy = ts[head], ys[head]
            self.n -= 1
            self.st -= dt
            self.sy -= dy
            self.stt -= dt * dt
            self.sty -= dt * dy
            self.removed += 1
            head += 1
        self.head = head
        if head == end:
            self.__init__()
        elif self.removed >= _REBASE_AFTER:
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
        if self.n < 2:
            return None
        sxx = self.stt - self.st * self.st / self.n
        if sxx <= 1e-12 * max(1.0, self.stt):
            return None
        return (self.sty - self.st * self.sy / self.n) / sxx


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
    def _keyed(rows: list[dict[str, Any]]) -> list[tuple[tuple[str, Any], dict[str, Any]]]:
        """Fill in gpu from uuid (and back) from the rows that carry both, then key each row."""
        uuid_of: dict[Any, str] = {}
        gpu_of: dict[str, Any] = {}
        for r in rows:
            if r.get("uuid") and r.get("gpu") is not None:
                uuid_of.setdefault(r["gpu"], r["uuid"])
                gpu_of.setdefault(r["uuid"], r["gpu"])
        out = []
        for r in rows:
            if r.get("pid") is None:
                continue
            uuid, gpu = r.get("uuid"), r.get("gpu")
            if not uuid and gpu is not None:
                uuid = uuid_of.get(gpu)
            if gpu is None and uuid:
                gpu = gpu_of.get(uuid)
            device = uuid if uuid else f"gpu{gpu}"
            out.append(((device, int(r["pid"])), dict(r, uuid=uuid, gpu=gpu)))
        return out

    def update(self, now: float, frames: Iterable[Frame], layer_notes: dict[str, str] | None = None) -> Frame:
        """Join this tick's process frames; returns a "process" frame with layers, gaps, slopes and reasons.

        ``layer_notes`` (``{"white"|"grey"|"black": reason}``) replaces the
        default reason for a layer missing everywhere this tick (e.g. the NVML
        probe's own "NVML library not found").
        """
        rows = [r for fr in frames if fr.kind == "process" for r in fr.rows]
        joined: dict[tuple[str, Any], dict[str, Any]] = {}
        sources: dict[tuple[str, Any], dict[str, Any]] = {}
        for key, row in self._keyed(rows):
            merged = joined.get(key)
            if merged is None:
                src = sources[key] = {"black_row": False, "torch_row": False, "reasons": {}}
            else:
                src = sources[key]
            if M.process_gpu_memory_bytes in row or "host_pid" in row:
                src["black_row"] = True
            if not src["torch_row"] and any(c in row for c in _TORCH_MARKERS):
                src["torch_row"] = True
            for layer, reason_key in _REASON_KEYS:
                reason = row.get(reason_key)
                if reason:
                    src["reasons"].setdefault(layer, reason)
            if merged is None:
                joined[key] = row  # the first row of an entity is taken whole (rows from _keyed are copies)
                continue
            for k, v in row.items():
                if k in ("process",) and merged.get(k):
                    continue  # the first name seen (NVML/procfs) wins over a reporter's
                if v is None and k in merged:
                    continue
                merged[k] = v
        notes = layer_notes or {}
        out = []
        for key, merged in sorted(joined.items(), key=lambda kv: (str(kv[1].get("gpu")), kv[0][1])):
            out.append(self._derive(now, key, merged, sources[key], notes))
        self._forget(now)
        self._latest = out
        return Frame("process", now, out)

    def _derive(self, now, key, merged, src, notes) -> dict[str, Any]:
        keys = tuple(merged)
        order = _ROW_ORDER.get(keys)
        if order is None:
            order = _row_order(keys)
        if order == keys:  # labels first, no reasons: the joined row (a private copy) is the output row
            row = merged
        else:
            row = dict(zip(order, operator.itemgetter(*order)(merged))) if len(order) > 1 else \
                {k: merged[k] for k in order}
        reasons: dict[str, str] = {}
        values: dict[str, float | None] = {}
        for layer, column in LAYER_COLUMNS.items():
            value = merged.get(column)
            values[layer] = value
            row[column] = value
            if value is None:
                reasons[column] = src["reasons"].get(layer) or self._default_reason(layer, src, notes)
        for column, (outer, inner) in GAP_COLUMNS.items():
            vo, vi = values[outer], values[inner]
            if vo is not None and vi is not None:
                row[column] = vo - vi
            else:
                row[column] = None
                reasons[column] = _GAP_MISSING[column, vo is None, vi is None]
        history = self._history.get(key)
        if history is None:
            history = self._history[key] = _History()
        history.last_seen = now
        cutoff = now - self.window_s
        for layer, column in SLOPE_COLUMNS.items():
            trend = history.trends[layer]
            value = values[layer]
            if value is not None:
                trend.add(now, float(value))
            trend.drop_before(cutoff)
            slope = None
            if value is None:
                reasons[column] = _SLOPE_MISSING[layer]
            elif trend.n < self.min_samples:
                reasons[column] = f"{trend.n} of {self.min_samples} samples needed for a trend"
            elif trend.span_s < self.min_span_s:
                reasons[column] = f"samples span less than {self.min_span_s:g} s"
            else:
                slope = trend.slope()
                if slope is None:
                    reasons[column] = "all samples at one instant"
            row[column] = slope
        row["missing_reasons"] = self._interned(reasons)
        return row

    def _interned(self, reasons: dict[str, str]) -> dict[str, str]:
        """One shared (read-only) dict per distinct set of reasons.

        A process's reasons are the same second after second, and the same for every process
        without a reporter: shared, the store writes each distinct set once per chunk instead of
        once per row (~600 bytes of JSON x 128 processes a second on a busy node).
        """
        key = tuple(reasons.items())
        got = self._reasons.get(key)
        if got is None:
            if len(self._reasons) >= MAX_INTERNED_REASONS:
                self._reasons.clear()  # reasons that count samples change; never let them pile up
            got = self._reasons[key] = reasons
        return got

    @staticmethod
    def _default_reason(layer: str, src: dict[str, Any], notes: dict[str, str]) -> str:
        if layer in _TORCH_SIDE:
            if src["torch_row"]:
                return "the in-process reporter does not give this figure"
            return notes.get(layer) or NO_REPORTER
        if src["black_row"]:
            return NVML_NO_VALUE
        return notes.get(layer) or NVML_NOT_LISTED

    def _forget(self, now: float) -> None:
        for key in [k for k, h in self._history.items() if now - h.last_seen > self.forget_after_s]:
            del self._history[key]

    @property
    def latest(self) -> list[dict[str, Any]]:
        """The rows of the last ``update``."""
        return list(self._latest)
