"""What the files held, and the window built from it.

Every reader turns its lines into samples of exported series (a name and
labels, as Prometheus would store them: dcgm-exporter's ``DCGM_FI_*``,
vLLM's ``vllm:*``, gpudiag's own, or an nvidia-smi query field). The window
is built the way :mod:`gpudiag.promql_source` builds one from range
queries: a step grid over the window (the spacing of the most often sampled
series, widened so that no series holds more than
``promql_source.MAX_POINTS_PER_SERIES`` steps), each series' value at a
step being its last sample within a lookback, and
:func:`gpudiag.promql_source.tables_from_series` mapping names to catalog
columns in SI units. Definitions:

- a sample belongs to the step nearest to it; where several do (a step
  wider than the sampling), the last one counts, as a range query takes it;
- lookback: LOOKBACK_INTERVALS of the series' own median spacing (at least
  one step), at most Prometheus' default of PROMETHEUS_LOOKBACK_S; a series
  with a single sample (one scrape: a cross-section of a fleet) is seen for
  that whole default, so one scrape's series, stamped a few seconds apart,
  meet on one row. Past the lookback a logger that stopped leaves no
  invented values;
- a gap: a stretch of at least GAP_MIN_INTERVALS of a GPU's (or engine's)
  own spacing, and GAP_MIN_S, without a sample of it inside the file's span;
- a window whose step is over COARSE_STEP_RATIO times the finest spacing
  (files days apart, a month of 1 s samples) says so among its gaps.
"""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gpudiag import promql_source
from gpudiag.errors import GpudiagError
from gpudiag.frames import Window

# Series are seen at the steps this many of their own sample intervals after a sample: one
# missed or late sample (nvidia-smi -l 1 drifts by milliseconds a line) leaves no hole.
LOOKBACK_INTERVALS = 2.0
# Prometheus' default --query.lookback-delta: how long a lone sample is seen.
PROMETHEUS_LOOKBACK_S = 300.0
# A stretch without samples is a gap when it lasts this many intervals and at least GAP_MIN_S
# (the Prometheus source's threshold for a target down).
GAP_MIN_INTERVALS = 10.0
GAP_MIN_S = promql_source.GAP_MIN_S
# Gaps listed per file at most; the rest are counted.
MAX_GAPS_PER_FILE = 10
# A window so long that its step is this many times the finest sample spacing says so: minute-long
# episodes (throttling, storms) fall between its steps.
COARSE_STEP_RATIO = 4.0
# The labels a latency histogram's interval summary is kept by (what the Prometheus source sums by).
HISTOGRAM_KEEP_LABELS = ("le", "node", "instance", "gpu", "engine")


@dataclass
class FileRead:
    """What one file (or folder of scrapes) gave: its format, rows, what was skipped and why, its GPUs."""

    path: str
    format: str
    rows: int = 0
    skipped_lines: int = 0
    first_skipped: str | None = None
    first_skipped_line: int | None = None
    gpus: list[dict[str, Any]] = field(default_factory=list)
    columns: list[str | None] | None = None  # nvidia-smi: the query field of each column, None where unnamed
    inferred_columns: bool = False
    unread_columns: list[str] = field(default_factory=list)
    unread_series: list[str] = field(default_factory=list)
    scrapes: int | None = None
    notes: list[str] = field(default_factory=list)
    start_s: float | None = None
    end_s: float | None = None
    findings: list[Any] = field(default_factory=list)  # an oom-log's findings (they join the window's)

    def skip(self, line: int, text: str | None, why: str) -> None:
        """Count one skipped line; the earliest one is quoted."""
        self.skipped_lines += 1
        if self.first_skipped_line is None or line < self.first_skipped_line:
            self.first_skipped_line = line
            quoted = "" if text is None else f": {text[:80]!r}"
            self.first_skipped = f"line {line}: {why}{quoted}"

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (``files`` of ``investigate --json``)."""
        out = {"path": self.path, "format": self.format, "rows": self.rows, "skipped_lines": self.skipped_lines,
               "first_skipped": self.first_skipped, "start_s": self.start_s, "end_s": self.end_s,
               "gpus": self.gpus, "notes": self.notes}
        if self.columns is not None:
            out["columns"] = self.columns
            out["inferred_columns"] = self.inferred_columns
        if self.unread_columns:
            out["unread_columns"] = self.unread_columns
        if self.unread_series:
            out["unread_series"] = self.unread_series
        if self.scrapes is not None:
            out["scrapes"] = self.scrapes
        return out


@dataclass
class _Series:
    labels: dict[str, str]
    source: int  # index of the FileRead it came from
    histogram: str | None = None  # the catalog column of a latency histogram's _bucket series
    t: array = field(default_factory=lambda: array("d"))
    v: array = field(default_factory=lambda: array("d"))


class Recording:
    """Samples of exported series from one or more files, with the facts of their GPUs."""

    def __init__(self):
        self.reads: list[FileRead] = []
        self._series: dict[tuple, _Series] = {}
        # (node, gpu) -> facts the rows carry as labels: name, uuid, pci_bus_id, driver_version
        self.gpu_facts: dict[tuple[str, int], dict[str, str]] = {}
        self.samples = 0  # samples added, every series together

    def series(self, labels: dict[str, str], source: int, histogram: str | None = None) -> _Series:
        """The series of these labels (``__name__`` included), made on first use."""
        key = (source, tuple(sorted(labels.items())))
        s = self._series.get(key)
        if s is None:
            s = self._series[key] = _Series(dict(labels), source, histogram)
        return s

    def add(self, labels: dict[str, str], source: int, t: float, v: float, histogram: str | None = None) -> None:
        """One sample."""
        s = self.series(labels, source, histogram)
        s.t.append(t)
        s.v.append(v)
        self.samples += 1

    def all_series(self) -> list[_Series]:
        """Every series with at least one sample."""
        return [s for s in self._series.values() if len(s.t)]

    def time_range(self) -> tuple[float, float] | None:
        """(first, last) sample time over every series; None when there are none."""
        lo, hi = math.inf, -math.inf
        for s in self.all_series():
            t = np.frombuffer(s.t, dtype=float)
            lo, hi = min(lo, float(t.min())), max(hi, float(t.max()))
        return None if lo == math.inf else (lo, hi)

    def nodes(self) -> list[str]:
        """The node names the series carry."""
        return sorted({s.labels.get("node", "") for s in self.all_series()} - {""})

    def keep_node(self, node: str) -> None:
        """Drop every series of another node."""
        self._series = {k: s for k, s in self._series.items() if s.labels.get("node") == node}


def _sorted(s: _Series) -> tuple[np.ndarray, np.ndarray]:
    t = np.frombuffer(s.t, dtype=float)
    v = np.frombuffer(s.v, dtype=float)
    if t.size > 1 and np.any(np.diff(t) < 0):
        order = np.argsort(t, kind="stable")
        t, v = t[order], v[order]
    return t, v


def _spacing(t: np.ndarray) -> float | None:
    """The median interval between distinct sample times; None with fewer than two."""
    if t.size < 2:
        return None
    d = np.diff(t)
    d = d[d > 0]
    return float(np.median(d)) if d.size else None


def _on_steps(t: np.ndarray, v: np.ndarray, plan: promql_source.Plan, lookback_s: float
              ) -> tuple[np.ndarray, np.ndarray]:
    """(step index, value) where the series has a sample within ``lookback_s`` of the step (its last one)."""
    steps = plan.t() + plan.step_s / 2  # a sample belongs to its nearest step: up to half a step after it
    idx = np.searchsorted(t, steps, side="right") - 1
    ok = idx >= 0
    ok[ok] = steps[ok] - t[idx[ok]] < lookback_s
    k = np.flatnonzero(ok)
    return k, v[idx[k]]


def _increase(k: np.ndarray, v: np.ndarray, n: int, span: int) -> tuple[np.ndarray, np.ndarray]:
    """A cumulative count's increase over the ``span`` steps up to each step (a reset counts from zero)."""
    grid = np.full(n, np.nan)
    grid[k] = v
    before = np.full(n, np.nan)
    if span < n:
        before[span:] = grid[:-span]
    inc = grid - before
    reset = inc < 0
    inc[reset] = grid[reset]
    ok = np.flatnonzero(~np.isnan(inc))
    return ok, inc[ok]


def _gaps(read: FileRead, entities: dict[tuple, list[np.ndarray]], lo: float, hi: float) -> list[str]:
    from gpudiag.investigate import iso

    out = []
    for (node, gpu, engine), times in sorted(entities.items(), key=lambda kv: tuple(map(str, kv[0]))):
        t = np.unique(np.concatenate(times))
        t = t[(t >= lo) & (t <= hi)]
        spacing = _spacing(t)
        if spacing is None:
            continue
        d = np.diff(t)
        for i in np.flatnonzero(d >= max(GAP_MIN_S, GAP_MIN_INTERVALS * spacing)).tolist():
            what = f"engine {engine}" if engine is not None else "GPU" if gpu is None else f"GPU {gpu}"
            out.append(f"{read.path}: no samples of {what} of node {node} from {iso(t[i])} to {iso(t[i + 1])} "
                       f"(the recorder stopped or missed it)")
    if len(out) > MAX_GAPS_PER_FILE:
        out = out[:MAX_GAPS_PER_FILE] + [f"{read.path}: {len(out) - MAX_GAPS_PER_FILE} more stretches without "
                                         f"samples"]
    return out


def build_window(rec: Recording, lo: float, hi: float, more_foreign: tuple[promql_source.Foreign, ...]) -> Window:
    """The window [lo, hi] of the recording: catalog columns in SI units, the GPUs' facts, gaps per file."""
    chosen = []
    for s in rec.all_series():
        t, v = _sorted(s)
        spacing = _spacing(t)
        lookback = PROMETHEUS_LOOKBACK_S if spacing is None else min(PROMETHEUS_LOOKBACK_S,
                                                                     LOOKBACK_INTERVALS * spacing)
        a, b = np.searchsorted(t, lo - lookback, side="left"), np.searchsorted(t, hi, side="right")
        if b > a:
            chosen.append((s, t[a:b], v[a:b], spacing, lookback))
    if not chosen:
        raise GpudiagError("the files hold no sample in this window")
    spacings = [sp for _, _, _, sp, _ in chosen if sp is not None]
    plan = promql_source.plan(lo, hi, scrape_interval_s=min(spacings) if spacings else None)
    gaps = []
    if spacings and plan.step_s > COARSE_STEP_RATIO * min(spacings):
        from gpudiag.units import fmt_seconds

        gaps.append(f"the window spans {fmt_seconds(hi - lo)}: samples {fmt_seconds(min(spacings))} apart are read "
                    f"at one per {fmt_seconds(plan.step_s)} (at most {plan.n_steps:,} steps); select a shorter "
                    f"stretch with --from/--to for every sample")
    plain, hists = [], {}
    entities: dict[int, dict[tuple, list[np.ndarray]]] = {}
    for s, t, v, _, lookback in chosen:
        k, vals = _on_steps(t, v, plan, max(lookback, plan.step_s))
        if k.size == 0:
            continue
        if s.histogram is None:
            plain.append((s.labels, k, vals))
        else:
            keep = {n: s.labels[n] for n in HISTOGRAM_KEEP_LABELS if n in s.labels}
            key = (s.histogram, tuple(sorted(keep.items())))
            grid = hists.setdefault(key, np.full(plan.n_steps, np.nan))
            grid[k] = np.where(np.isnan(grid[k]), vals, grid[k] + vals)  # series differing in other labels add up
        ent = (s.labels.get("node"), s.labels.get("gpu"), s.labels.get("engine"))
        entities.setdefault(s.source, {}).setdefault(ent, []).append(t[t >= lo])
    histograms = []
    for (column, labels), grid in hists.items():
        k = np.flatnonzero(~np.isnan(grid))
        k, inc = _increase(k, grid[k], plan.n_steps, promql_source.HISTOGRAM_RANGE_STEPS)
        histograms.append((column, dict(labels), k, inc))
    tables = promql_source.tables_from_series(plain, plan, more_foreign=more_foreign, histograms=histograms)
    if not tables:
        raise GpudiagError("the files hold no series gpudiag maps to its metrics in this window")
    _put_facts(tables, rec.gpu_facts)
    for i, read in enumerate(rec.reads):
        gaps.extend(_gaps(read, entities.get(i, {}), lo, hi))
    nodes = sorted({str(x) for df in tables.values() if "node" in df for x in df["node"].dropna()})
    sources = [f"file:{r.path}" for r in rec.reads]
    return Window(tables, lo, hi, nodes[0] if len(nodes) == 1 else None, sources, gaps)


def _put_facts(tables: dict, facts: dict[tuple[str, int], dict[str, str]]) -> None:
    """The GPUs' names (and uuid, bus id, driver) as label columns of the gpu rows, as the NVML probe writes them."""
    gpu = tables.get("gpu")
    if gpu is None or not facts or "node" not in gpu or "gpu" not in gpu:
        return
    keys = list(zip(gpu["node"].tolist(), gpu["gpu"].tolist()))
    for label in sorted({k for f in facts.values() for k in f}):
        if label in gpu and gpu[label].notna().all():
            continue
        values = [facts.get((n, g), {}).get(label) for n, g in keys]
        if label in gpu:
            gpu[label] = gpu[label].where(gpu[label].notna(), values)
        else:
            gpu[label] = values
