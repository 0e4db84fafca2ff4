"""Prometheus text exposition of frames: the latest rows as metric families named by the catalog.

The agent hands every tick's frames to a :class:`LatestFrames`; a scrape turns
the newest rows into metric families whose names, help, types and labels all
come from :mod:`gpudiag.catalog` (``FramesCollector`` spells no metric name).
Probes never know about Prometheus; the collector never knows about probes.
The agent's exporter (:mod:`gpudiag.agent.prom_exporter`) and the reference
engine's server both serve what this module encodes.
Row conventions the collector reads (see ``gpudiag.probes.base``):

* labels are row keys (``node``, ``gpu``, ``uuid``, ``pid``, ``process``,
  ``engine``, ``api``, ``code``, the info labels of ``gpu_info``...); a label
  the row lacks is exported empty (Prometheus' "no such label");
* a metric with labels beyond its entity's is a dict keyed by the first extra
  label's value, nested once per further label (``{"volatile": {"corrected": 0}}``);
* a histogram is either a dict ``{"buckets": [(le, cumulative count), ...],
  "sum": s, "count": n}`` (the eBPF probe's latency maps), or, in ``request``
  rows, one observation per finished request, accumulated here into
  cumulative buckets (:data:`LATENCY_BUCKETS_S`; counted in batches, see
  :data:`MAX_WAITING_REQUESTS`); a request row's TTFT, inter-token and
  e2e latency are observed twice, once in the engine's vLLM-dialect histogram and once in
  gpudiag's by ``context_bucket`` (``catalog.BY_CONTEXT``; the bucket of its
  ``prompt_tokens + output_tokens``), which is exported whatever the dialect setting;
* a value that is absent, None or NaN is no sample: "not measured" is not 0.

vLLM-dialect metrics (``vllm:*``) are the serving engine's own: Prometheus
scrapes them from the engine, and a second copy from the agent would double
every ``sum()``. They are exported only when ``LatestFrames(export_engine_dialect=True)``
(the agent's ``--sim`` mode, where the engine lives inside the agent); promtool
"""
from __future__ import annotations

import logging
import math
import operator
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

from gpudiag.catalog import (
    BY_CONTEXT,
    CATALOG,
    CONTEXT_BUCKET_EDGES_TOKENS,
    CONTEXT_BUCKETS,
    COUNTER,
    GAUGE,
    HISTOGRAM,
    INFO,
    M,
    request_context_bucket,
    token_count,
)
from gpudiag.catalog import Metric as CatalogMetric
from gpudiag.frames import Frame

LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
                     1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 30.0, 60.0)

_FAMILY = {GAUGE: GaugeMetricFamily, COUNTER: CounterMetricFamily, INFO: GaugeMetricFamily}
_LE_LABELS = tuple(floatToGoString(le) for le in LATENCY_BUCKETS_S)
_EDGES = np.asarray(LATENCY_BUCKETS_S, dtype=np.float64)
# Request rows wait in LatestFrames and are counted together, this many at a time or when a
# reader needs the histograms (a scrape, an OTLP push): Python reads each row's values and
# labels once per label set, numpy does the buckets, counts and sums. Counted one at a time on
# arrival, 80 finished requests a second cost 0.78 ms of CPU a second, a tenth of the agent's
# budget; in batches of 512, 0.30 ms (4096 cost the same but put ~4 ms of counting into each
# 15 s scrape; 256, 0.34 ms).
MAX_WAITING_REQUESTS = 512
_CONTEXT_EDGES = np.asarray(CONTEXT_BUCKET_EDGES_TOKENS, dtype=np.float64)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not (isinstance(v, float) and math.isnan(v))


def _number(v) -> float:
    """An observation's value; NaN for what is no observation (None, text, an integer past any float)."""
    if isinstance(v, (int, float)):
        try:
            return float(v)
        except OverflowError:
            return math.nan
    return math.nan


_PLAIN_NUMBERS = frozenset((int, float))


def _numbers(values: list, one=_number) -> np.ndarray:
    """``one`` (:func:`_number`, :func:`_token_count`) of each value, as float64.

    Plain ints and floats, the usual case, convert in one step (the same for either).
    """
    if set(map(type, values)) <= _PLAIN_NUMBERS:
        try:
            return np.array(values, dtype=np.float64)
        except OverflowError:  # an int past any float: value by value below
            pass
    return np.fromiter(map(one, values), dtype=np.float64, count=len(values))


def _token_count(v) -> float:
    """catalog.token_count, NaN for None."""
    got = token_count(v)
    return math.nan if got is None else got


def _context_buckets(rows: list[dict[str, Any]], keys: tuple[str, ...]) -> list[str | None]:
    """catalog.request_context_bucket of each row of one shape (from the token counts in one step)."""
    if "context_bucket" in keys or "prompt_tokens" not in keys or "output_tokens" not in keys:
        return [request_context_bucket(row) for row in rows]
    tokens = _numbers(list(map(operator.itemgetter("prompt_tokens"), rows)), _token_count) \
        + _numbers(list(map(operator.itemgetter("output_tokens"), rows)), _token_count)
    # The first bucket whose edge is at least the count, past the last edge the last; unknown
    # (NaN, negative) none. The same as catalog.context_bucket (a test holds them together).
    codes = np.searchsorted(_CONTEXT_EDGES, tokens, side="left")
    names = CONTEXT_BUCKETS + (None,)
    codes[~(tokens >= 0)] = len(names) - 1
    return [names[c] for c in codes.tolist()]


def _label_value(v) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return ""
    if isinstance(v, float) and v.is_integer():
        return str(int(v))  # a gpu index that went through a float column stays "3", not "3.0"
    return str(v)


# Request rows come in a handful of shapes (one per engine and probe): which of their keys are
# histograms is worked out once per shape instead of a catalog lookup per key per row.
_MAX_PLANS = 256


def _histogram_plan(keys: tuple[str, ...]) -> list[tuple[str, CatalogMetric, CatalogMetric | None]]:
    """(key, histogram metric, its by-context metric when the row lacks that) for each histogram key."""
    plan = []
    for key in keys:
        metric = CATALOG.get(key)
        if metric is None or metric.type != HISTOGRAM:
            continue
        by_context = BY_CONTEXT.get(key)
        plan.append((key, metric, CATALOG[by_context] if by_context is not None and by_context not in keys
                     else None))
    return plan


class _Histogram:
    """Cumulative buckets, sum and count of observations (one label set of one metric)."""

    __slots__ = ("count", "counts", "sum")

    def __init__(self):
        self.counts = np.zeros(len(LATENCY_BUCKETS_S) + 1, dtype=np.int64)  # the last: above every edge
        self.sum = 0.0
        self.count = 0

    def observe(self, values: np.ndarray) -> None:
        """Count observations (finite or infinite numbers): each in the first bucket whose edge is >= it."""
        self.counts += np.bincount(np.searchsorted(_EDGES, values, side="left"), minlength=len(self.counts))
        self.sum += sum(values.tolist())  # in order, as they came (inf and -inf make NaN, as Prometheus' would)
        self.count += len(values)

    def buckets(self) -> list[tuple[str, float]]:
        running = np.cumsum(self.counts[:-1]).tolist()
        return [(le, float(n)) for le, n in zip(_LE_LABELS, running)] + [("+Inf", float(self.count))]


@dataclass
class Snapshot:
    """What one scrape sees: the newest rows per kind, the agent's rows, findings and histograms."""

    node: str | None
    rows: dict[str, list[dict[str, Any]]]
    agent_rows: list[dict[str, Any]]
    findings: list[dict[str, Any]]
    histograms: dict[str, dict[tuple[str, ...], tuple[list[tuple[str, float]], float]]]
    export_engine_dialect: bool


class LatestFrames:
    """The newest frames of every kind, the agent's own metrics and the active findings (thread-safe).

    The agent calls :meth:`update` after each tick, :meth:`set_agent_rows` with its
    self-metrics rows (``{"probe": "nvml", M.agent_tick_seconds: 0.004}``...) and
    :meth:`set_findings` with the open findings. Exporters read :meth:`snapshot`.
    """

    def __init__(self, node: str | None = None, *, export_engine_dialect: bool = False):
        self.node = node
        self.export_engine_dialect = export_engine_dialect
        self._lock = threading.Lock()
        self._rows: dict[str, list[dict[str, Any]]] = {}
        self._agent_rows: list[dict[str, Any]] = []
        self._findings: list[dict[str, Any]] = []
        self._histograms: dict[str, dict[tuple[str, ...], _Histogram]] = {}
        self._plans: dict[tuple[str, ...], list] = {}  # a request row's keys -> its histogram columns
        self._waiting: list[dict[str, Any]] = []  # request rows not counted yet (see MAX_WAITING_REQUESTS)

    def update(self, frames: Iterable[Frame]) -> None:
        """Take one tick's frames: rows of a kind replace that kind's previous rows.

        Several frames of one kind in one call are joined (two probes may each give
        part of a kind). ``request`` rows are observations for the latency histograms.
        """
        by_kind: dict[str, list[dict[str, Any]]] = {}
        for fr in frames:
            by_kind.setdefault(fr.kind, []).extend(fr.rows)
        requests = by_kind.pop("request", [])
        with self._lock:
            self._rows.update(by_kind)
            if requests:
                self._waiting.extend(row for row in requests if isinstance(row, dict))
                if len(self._waiting) >= MAX_WAITING_REQUESTS:
                    self._count_waiting()

    def _count_waiting(self) -> None:
        """Count the waiting request rows into the histograms (the caller holds the lock)."""
        rows, self._waiting = self._waiting, []
        by_shape: dict[tuple[str, ...], list[dict[str, Any]]] = {}
        for row in rows:
            by_shape.setdefault(tuple(row), []).append(row)
        for keys, group in by_shape.items():
            plan = self._plans.get(keys)
            if plan is None:
                if len(self._plans) >= _MAX_PLANS:  # rows of ever new shapes: start over rather than grow
                    self._plans.clear()
                plan = self._plans[keys] = _histogram_plan(keys)
            if plan:
                self._count_shape(keys, group, plan)

    def _count_shape(self, keys: tuple[str, ...], rows: list[dict[str, Any]], plan: list) -> None:
        """Observe one shape's rows: each histogram key's numbers, by the label set of their row."""
        buckets = None
        if any(by_context is not None for _, _, by_context in plan):
            buckets = _context_buckets(rows, keys)
        positions: dict[tuple, dict[tuple[str, ...], np.ndarray]] = {}  # (names, by context): label set -> rows

        def by_labels(names: tuple[str, ...], by_context: bool) -> dict[tuple[str, ...], np.ndarray]:
            got = positions.get((names, by_context))
            if got is None:
                got = positions[(names, by_context)] = self._group_by_labels(
                    keys, rows, names, buckets if by_context else None)
            return got

        for key, metric, by_context in plan:
            values = _numbers(list(map(operator.itemgetter(key), rows)))
            ok = ~np.isnan(values)
            if not ok.any():
                continue
            self._observe(metric, by_labels(metric.labels, False), values, ok)
            if by_context is not None:
                self._observe(by_context, by_labels(by_context.labels, True), values, ok)

    def _observe(self, metric: CatalogMetric, groups: dict[tuple[str, ...], np.ndarray], values: np.ndarray,
                 ok: np.ndarray) -> None:
        per_metric = self._histograms.setdefault(metric.column, {})
        for labels, at in groups.items():
            at = at[ok[at]]
            if not len(at):
                continue
            hist = per_metric.get(labels)
            if hist is None:
                hist = per_metric[labels] = _Histogram()
            hist.observe(values[at])

    def _group_by_labels(self, keys: tuple[str, ...], rows: list[dict[str, Any]], names: tuple[str, ...],
                         buckets: list[str | None] | None) -> dict[tuple[str, ...], np.ndarray]:
        """Row positions by their label values for ``names`` (``context_bucket`` from ``buckets``
        when given: rows without a bucket are left out)."""
        present = tuple(n for n in names if n in keys)  # a shape's rows all have the same keys
        got = operator.itemgetter(*present) if len(present) > 1 else \
            (lambda row, n=present[0]: (row[n],)) if present else (lambda row: ())
        raws = list(map(got, rows)) if buckets is None else \
            [r + (b,) for r, b in zip(map(got, rows), buckets)]
        by_raw: dict[tuple, list[int]] = {}
        try:
            for i, raw in enumerate(raws):
                by_raw.setdefault(raw, []).append(i)
        except TypeError:  # an unhashable label value (a list): every row worked out alone
            pairs = [(raw, [i]) for i, raw in enumerate(raws)]
        else:
            pairs = list(by_raw.items())
        out: dict[tuple[str, ...], list[int]] = {}
        for raw, at in pairs:
            lab = self._label_values(dict(zip(present, raw)), names, buckets is not None,
                                     raw[-1] if buckets is not None else None)
            if lab is not None:
                out.setdefault(lab, []).extend(at)  # two raw values may read the same (gpu 0 and 0.0)
        return {lab: np.sort(np.asarray(at, dtype=np.int64)) for lab, at in out.items()}

    def _label_values(self, row: dict[str, Any], names: tuple[str, ...], by_context: bool,
                      bucket: str | None) -> tuple[str, ...] | None:
        if by_context and bucket is None:
            return None  # no context bucket: in the engine's histogram only
        return tuple(_label_value(bucket if by_context and name == "context_bucket" else self._label(row, name))
                     for name in names)

    def _label(self, row: dict[str, Any], name: str):
        value = row.get(name)
        if value is None and name == "node":
            return self.node
        return value

    def set_agent_rows(self, rows: Iterable[dict[str, Any]]) -> None:
        """Replace the agent's self-metrics rows (catalog ``agent_*`` columns and their labels)."""
        with self._lock:
            self._agent_rows = list(rows)

    def set_findings(self, findings: Iterable[Any]) -> None:
        """Replace the active findings (Finding objects or their dicts)."""
        out = []
        for f in findings:
            d = f.to_dict() if hasattr(f, "to_dict") else dict(f)
            out.append(d)
        with self._lock:
            self._findings = out

    def snapshot(self) -> Snapshot:
        """A consistent copy of what a scrape exports."""
        with self._lock:
            if self._waiting:
                self._count_waiting()
            histograms = {col: {labels: (h.buckets(), h.sum) for labels, h in per.items()}
                          for col, per in self._histograms.items()}
            return Snapshot(self.node, dict(self._rows), list(self._agent_rows), list(self._findings),
                            histograms, self.export_engine_dialect)


def _leaves(value, depth: int, prefix: tuple = ()) -> Iterator[tuple[tuple, Any]]:
    """(extra label values, number) pairs of a value nested ``depth`` dicts deep."""
    if depth == 0:
        yield prefix, value
        return
    if isinstance(value, dict):
        for key, sub in value.items():
            yield from _leaves(sub, depth - 1, prefix + (key,))


def _dict_depth(value) -> int:
    depth = 0
    while isinstance(value, dict) and value:
        value = next(iter(value.values()))
        depth += 1
    return depth


class _Families:
    """Samples per catalog metric, keyed by label values (a repeated label set keeps the last)."""

    def __init__(self):
        self.samples: dict[str, dict[tuple[str, ...], Any]] = {}

    def add(self, metric: CatalogMetric, labels: tuple[str, ...], value) -> None:
        per = self.samples.get(metric.column)
        if per is None:
            per = self.samples[metric.column] = {}
        per[labels] = value


def _add_row(families: _Families, row: dict[str, Any], node: str | None, dialect: bool,
             skip_histograms: bool) -> None:
    label_sets: dict[tuple[str, ...], tuple[str, ...]] = {}  # label values by label names, for this row

    def values_of(names: tuple[str, ...]) -> tuple[str, ...]:
        got = label_sets.get(names)
        if got is None:
            got = label_sets[names] = tuple(
                _label_value(row.get(name) if name != "node" else (row.get("node") or node)) for name in names)
        return got

    for key, value in row.items():
        metric = CATALOG.get(key)
        if metric is None or value is None:
            continue
        if metric.dialect == "vllm" and not dialect:
            continue
        if metric.type == HISTOGRAM:
            if not skip_histograms and isinstance(value, dict) and "buckets" in value:
                families.add(metric, values_of(metric.labels), value)
            continue
        if not isinstance(value, dict):
            if _is_number(value):
                families.add(metric, values_of(metric.labels), value)
            continue
        depth = _dict_depth(value)
        if depth == 0 or depth > len(metric.labels):
            continue
        head = values_of(metric.labels[:-depth])
        for extra, leaf in _leaves(value, depth):
            if _is_number(leaf):
                families.add(metric, head + tuple(_label_value(x) for x in extra), leaf)


class FramesCollector:
    """A prometheus_client collector over a :class:`LatestFrames` (register it in a CollectorRegistry)."""

    def __init__(self, latest: LatestFrames):
        self.latest = latest

    def describe(self) -> list:
        """Nothing up front: the families depend on what the probes saw (so registering never scrapes)."""
        return []

    def collect(self) -> Iterator[Metric]:
        """The metric families of the newest frames, in catalog order."""
        samples = catalog_samples(self.latest.snapshot())
        for column, per_labels in samples.items():
            metric = CATALOG[column]
            if metric.type == HISTOGRAM:
                fam = HistogramMetricFamily(metric.name, metric.help, labels=metric.labels)
                for labels, value in per_labels.items():
                    got = _histogram(value)
                    if got is not None:
                        fam.add_metric(labels, *got)
                yield fam
            else:
                # An info metric is a gauge of 1 whose labels are the facts (what the text
                # format makes of OpenMetrics' info type anyway).
                fam = _FAMILY[metric.type](metric.name, metric.help, labels=metric.labels)
                for labels, value in per_labels.items():
                    fam.add_metric(labels, float(value))
                yield fam


@dataclass(frozen=True)
class ObservedHistogram:
    """A histogram accumulated from observations: cumulative buckets as (``le`` text, count) and the sum."""

    buckets: list[tuple[str, float]]
    sum: float


def catalog_samples(snap: Snapshot) -> dict[str, dict[tuple[str, ...], Any]]:
    """Samples of one snapshot: {catalog column: {label values (catalog order): value}}, in catalog order.

    A value is a number; for histograms either a probe's ``{"buckets", "sum",
    "count"}`` dict or an accumulated ``ObservedHistogram``. Exporters (Prometheus, OTLP)
    format these; none of them decides names or labels.
    """
    families = _Families()
    for rows in snap.rows.values():
        for row in rows:
            _add_row(families, row, snap.node, snap.export_engine_dialect, skip_histograms=False)
    for row in snap.agent_rows:
        _add_row(families, row, snap.node, snap.export_engine_dialect, skip_histograms=True)
    active = CATALOG[M.finding_active]
    for f in snap.findings:
        values = {"node": f.get("node") or snap.node, "kind": f.get("kind"), "severity": f.get("severity"),
                  "gpu": f.get("gpu"), "pod": f.get("pod"), "namespace": f.get("namespace")}
        families.add(active, tuple(_label_value(values.get(name)) for name in active.labels), 1)
    out: dict[str, dict[tuple[str, ...], Any]] = {}
    for column, metric in CATALOG.items():
        if metric.dialect == "vllm" and not snap.export_engine_dialect:
            continue
        per = dict(families.samples.get(column, {}))
        for labels, (buckets, total) in snap.histograms.get(column, {}).items():
            per[labels] = ObservedHistogram(buckets, total)
        if per:
            out[column] = per
    return out


def _histogram(value) -> tuple[list[tuple[str, float]], float] | None:
    """(exposition buckets, sum) of a histogram sample (accumulated or a probe's); None when malformed."""
    if isinstance(value, ObservedHistogram):
        return value.buckets, value.sum
    buckets = _given_buckets(value)
    return None if buckets is None else (buckets, float(value.get("sum") or 0.0))


def _given_buckets(value: dict) -> list[tuple[str, float]] | None:
    """A probe's precomputed histogram as exposition buckets; None when malformed."""
    try:
        pairs = sorted((float(le), float(n)) for le, n in value["buckets"])
    except (TypeError, ValueError, KeyError):
        return None
    out = [(floatToGoString(le), n) for le, n in pairs]
    if not out or out[-1][0] != "+Inf":
        out.append(("+Inf", float(value.get("count", out[-1][1] if out else 0.0))))
    return out


TEXT_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_TEXT_TYPES = {"counter": "counter", "gauge": "gauge", "histogram": "histogram", "info": "gauge",
               "stateset": "gauge", "gaugehistogram": "histogram", "summary": "summary", "unknown": "untyped"}


def _escape_label(v: str) -> str:
    if "\\" in v or '"' in v or "\n" in v:
        return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return v


def _label_text(pairs) -> str:
    """Label (name, value) pairs as the text format writes them inside the braces."""
    return ",".join(f'{k}="{_escape_label(v)}"' for k, v in pairs)


def _head(name: str, doc: str, typ: str) -> str:
    """A family's HELP and TYPE lines."""
    doc = doc.replace("\\", "\\\\").replace("\n", "\\n")
    return f"# HELP {name} {doc}\n# TYPE {name} {_TEXT_TYPES.get(typ, 'untyped')}\n"


def encode_text(registry) -> bytes:
    """The registry in the Prometheus text format 0.0.4.

    prometheus_client's own encoder re-validates and re-escapes every label name
    of every sample (about 12 us a sample, 27 ms for an 8-GPU node of 128
    processes); names here come from the catalog and are valid by construction,
    so only label values are escaped, and only when they need it. OpenMetrics-only
    samples (``_created``) are left out: the families here carry none.
    """
    if type(registry) is FramesRegistry:
        return samples_text(catalog_samples(registry.frames.latest.snapshot()))
    own_text = getattr(registry, "text_exposition", None)
    if own_text is not None:  # a registry that writes its page itself (an engine dialect's names)
        return own_text()
    out: list[str] = []
    label_text: dict[tuple, str] = {}  # rows share label sets across their metrics: format each once
    for family in registry.collect():
        name = family.name + {"counter": "_total", "info": "_info"}.get(family.type, "")
        out.append(_head(name, family.documentation, family.type))
        created = family.name + "_created"
        for sample in family.samples:
            if sample.name == created:
                continue
            if sample.labels:
                key = tuple(sample.labels.items())
                labels = label_text.get(key)
                if labels is None:
                    labels = label_text[key] = _label_text(key)
                line = f"{sample.name}{{{labels}}} {floatToGoString(sample.value)}"
            else:
                line = f"{sample.name} {floatToGoString(sample.value)}"
            if sample.timestamp is not None:
                line += f" {int(float(sample.timestamp) * 1000)}"
            out.append(line + "\n")
    return "".join(out).encode("utf-8")


class FramesRegistry(CollectorRegistry):
    """A registry holding only a :class:`FramesCollector`: :func:`encode_text` writes it straight from the samples."""

    def __init__(self, latest: LatestFrames):
        super().__init__(auto_describe=False)
        self.frames = FramesCollector(latest)
        self.register(self.frames)


def registry_for(latest: LatestFrames) -> FramesRegistry:
    """A fresh registry holding only the frames collector (no process or platform collectors)."""
    return FramesRegistry(latest)


def samples_text(samples: dict[str, dict[tuple[str, ...], Any]]) -> bytes:
    """:func:`catalog_samples` in the Prometheus text format 0.0.4: what :func:`encode_text` makes of
    :meth:`FramesCollector.collect`'s families, written without them.

    A family object makes a label dict and a sample tuple for every value (a busy node has ~3300)
    that the encoder then takes apart again: a third of a scrape. The names, types and label
    sets here follow prometheus_client's families exactly (a counter is exposed as ``<name>_total``
    with the suffix taken off the family name first; a histogram's ``_count`` and ``_sum`` are left
    out when its first bucket is negative); the tests compare the two texts.
    """
    out: list[str] = []
    label_text: dict[tuple, str] = {}
    for column, per_labels in samples.items():
        metric = CATALOG[column]
        names = metric.labels
        if metric.type == COUNTER:
            name = (metric.name[:-6] if metric.name.endswith("_total") else metric.name) + "_total"
        else:
            name = metric.name
        out.append(_head(name, metric.help, metric.type))
        for labels, value in per_labels.items():
            key = (names, labels)
            text = label_text.get(key)
            if text is None:
                text = label_text[key] = _label_text(zip(names, labels))
            if metric.type != HISTOGRAM:
                v = floatToGoString(float(value))
                out.append(f"{name}{{{text}}} {v}\n" if text else f"{name} {v}\n")
                continue
            got = _histogram(value)
            if got is None:
                continue
            buckets, total = got
            sep = "," if text else ""
            for le, n in buckets:
                out.append(f'{name}_bucket{{{text}{sep}le="{_escape_label(le)}"}} {floatToGoString(n)}\n')
            if float(buckets[0][0]) >= 0:
                count = floatToGoString(buckets[-1][1])
                out.append(f"{name}_count{{{text}}} {count}\n" if text else f"{name}_count {count}\n")
                out.append(f"{name}_sum{{{text}}} {floatToGoString(total)}\n" if text
                           else f"{name}_sum {floatToGoString(total)}\n")
    return "".join(out).encode("utf-8")


# --- basic auth ------------------------------------------------------------------------------


def log_request_failure(logger: logging.Logger, client_address, exc: BaseException | None) -> None:
    """A request an HTTP server here could not answer, in its log: a client that hung up early
    (a scraper past its timeout resets the connection) at debug level, for it is routine;
    anything else, a bug, as one error line (socketserver's default prints a traceback)."""
    host = client_address[0]  # (host, port): these servers listen on TCP
    if isinstance(exc, (ConnectionError, TimeoutError)):
        logger.debug("client %s went away: %r", host, exc)
    else:
        logger.error("request from %s failed: %s: %s", host, type(exc).__name__, exc)
