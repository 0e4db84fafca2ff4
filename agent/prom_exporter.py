"""Prometheus export: a custom collector over the agent's latest frames, and its HTTP server.

The agent hands every tick's frames to a :class:`LatestFrames`; a scrape turns
the newest rows into metric families whose names, help, types and labels all
come from :mod:`gpudiag.catalog` (``FramesCollector`` spells no metric name).
Probes never know about Prometheus; the collector never knows about probes.

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
then reports their colons, which are vLLM's naming, not ours.

The server binds 127.0.0.1 by default and refuses any other address unless
called with ``allow_non_loopback=True`` (the agent's config key
``exporter.allow_non_loopback``); TLS takes a PEM certificate and key; basic
auth takes a user and a salted SHA-256 of the password (:func:`hash_password`),
never the password itself.
"""

from __future__ import annotations

import base64
import binascii
import gzip
import hashlib
import hmac
import ipaddress
import logging
import math
import operator
import os
import selectors
import socket
import socketserver
import ssl
import sys
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder
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
from gpudiag.errors import GpudiagError
from gpudiag.frames import Frame

log = logging.getLogger("gpudiag.agent.prom_exporter")

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 9400
# Request latency buckets (seconds), log-spaced from 1 ms to 60 s: the field reports
# range from ~50 ms per token and 80 ms P99 when healthy to a 2 s P999 tail during an
# eviction storm, and time to first token can reach tens of seconds behind a queue.
LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
                     1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 30.0, 60.0)
# A slow or stuck client must not hold a server thread (or, with TLS, a handshake) forever.
CLIENT_TIMEOUT_S = 10.0

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
                  "gpu": f.get("gpu")}
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


_TEXT_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
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

_HASH_SCHEME = "sha256"


def hash_password(password: str, salt: bytes | None = None) -> str:
    """The config form of a scrape password: ``sha256$<salt hex>$<hex of sha256(salt + password)>``.

    A scrape credential is machine-generated and long, so one salted SHA-256 is
    enough (and keeps each scrape cheap); the salt stops equal passwords from
    showing as equal hashes.
    """
    salt = os.urandom(16) if salt is None else salt
    digest = hashlib.sha256(salt + password.encode()).hexdigest()
    return f"{_HASH_SCHEME}${salt.hex()}${digest}"


@dataclass(frozen=True)
class BasicAuth:
    """HTTP basic auth for /metrics: a user and :func:`hash_password`'s form of the password."""

    user: str
    password_hash: str

    def __post_init__(self):
        parts = self.password_hash.split("$")
        if len(parts) != 3 or parts[0] != _HASH_SCHEME:
            raise GpudiagError("exporter basic_auth password must be given as sha256$<salt hex>$<digest hex> "
                               "(make it with gpudiag.agent.prom_exporter.hash_password), not in plain text")
        try:
            bytes.fromhex(parts[1])
            if len(bytes.fromhex(parts[2])) != 32:
                raise ValueError
        except ValueError:
            raise GpudiagError("exporter basic_auth password hash is not sha256$<salt hex>$<64 hex digits>") from None
        if not self.user or ":" in self.user:
            raise GpudiagError("exporter basic_auth user must be non-empty and contain no ':'")

    def check(self, authorization: str | None) -> bool:
        """True when an Authorization header carries this user and password (constant-time compare)."""
        if not authorization or not authorization.startswith("Basic "):
            return False
        try:
            user, _, password = base64.b64decode(authorization[6:], validate=True).decode("utf-8").partition(":")
        except (binascii.Error, UnicodeDecodeError):
            return False
        _, salt_hex, digest_hex = self.password_hash.split("$")
        given = hashlib.sha256(bytes.fromhex(salt_hex) + password.encode()).digest()
        # Both comparisons always run, so the time does not tell a wrong user from a wrong password.
        user_ok = hmac.compare_digest(user.encode(), self.user.encode())
        password_ok = hmac.compare_digest(given, bytes.fromhex(digest_hex))
        return user_ok and password_ok


# --- the HTTP server ---------------------------------------------------------------------------


def parse_listen(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:9400`` for IPv6, ``:9400`` for the default host) as (host, port)."""
    host, sep, port = text.rpartition(":")
    if not sep:
        raise GpudiagError(f"--listen {text!r}: expected HOST:PORT, e.g. 127.0.0.1:{DEFAULT_PORT}")
    host = host.strip("[]") or DEFAULT_HOST
    try:
        number = int(port)
        if not 0 <= number <= 65535:
            raise ValueError
    except ValueError:
        raise GpudiagError(f"--listen {text!r}: port must be a number 0..65535") from None
    return host, number


def is_loopback(host: str) -> bool:
    """True when every address ``host`` resolves to is a loopback address."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


class _Handler(BaseHTTPRequestHandler):
    server: _MetricsHTTPServer
    timeout = CLIENT_TIMEOUT_S
    server_version = "gpudiag-agent"
    sys_version = ""

    def do_GET(self):
        srv = self.server
        if srv.auth is not None and not srv.auth.check(self.headers.get("Authorization")):
            self._send(401, b"unauthorized\n", "text/plain; charset=utf-8",
                       {"WWW-Authenticate": 'Basic realm="gpudiag", charset="UTF-8"'})
            return
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            accept = self.headers.get("Accept", "")
            if "openmetrics" in accept and "text/plain" not in accept and "*/*" not in accept:
                encoder, content_type = choose_encoder(accept)  # a client that takes nothing else
            else:
                # Every Prometheus accepts the text format; it is served whenever the client
                # takes it, because it is the one encoded without per-sample validation.
                encoder, content_type = encode_text, _TEXT_CONTENT_TYPE
            try:
                body = encoder(srv.registry)
            except Exception as exc:  # noqa: BLE001 - a collector bug: the scraper gets a 500, the log one line
                log.error("collecting /metrics failed: %s: %s", type(exc).__name__, exc)
                self._send(500, b"collecting the metrics failed; the agent's log says why\n",
                           "text/plain; charset=utf-8")
                return
            extra = {}
            if "gzip" in self.headers.get("Accept-Encoding", ""):
                body = gzip.compress(body, compresslevel=1)  # level 1: a third of the bytes, for ~1 ms
                extra["Content-Encoding"] = "gzip"
            self._send(200, body, content_type, extra)
        elif path == "/healthz":
            self._send(200, b"ok\n", "text/plain; charset=utf-8")
        elif path == "/":
            self._send(200, b'<html><body><a href="/metrics">gpudiag agent metrics</a></body></html>\n',
                       "text/html; charset=utf-8")
        else:
            self._send(404, b"not found\n", "text/plain; charset=utf-8")

    def _send(self, code: int, body: bytes, content_type: str, headers: dict[str, str] | None = None) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format, *args):
        log.debug("%s %s", self.address_string(), format % args)


class _MetricsHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    # socketserver listens with a backlog of 5: several scrapers at once (Prometheus replicas,
    # a federation, curl loops) overflow it and the kernel drops or resets their connections.
    request_queue_size = 128

    def __init__(self, address, family, registry, auth, tls: ssl.SSLContext | None):
        self.address_family = family
        self.registry, self.auth, self.tls = registry, auth, tls
        super().__init__(address, _Handler)

    def server_bind(self):
        # HTTPServer.server_bind resolves the host's FQDN, a DNS query that can hang for
        # seconds on a node with broken resolvers; the name is never used here.
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = self.server_address[:2]

    def finish_request(self, request, client_address):
        if self.tls is None:
            return super().finish_request(request, client_address)
        # The handshake happens here, in the request's own thread, so a client that
        # connects and says nothing cannot stall the accept loop.
        request.settimeout(CLIENT_TIMEOUT_S)
        try:
            conn = self.tls.wrap_socket(request, server_side=True)
        except (ssl.SSLError, OSError) as exc:
            log.debug("TLS handshake with %s failed: %s", client_address, exc)
            return None
        try:
            return super().finish_request(conn, client_address)
        finally:
            conn.close()

    def handle_error(self, request, client_address):
        # Called from socketserver's own except block: the exception is the current one.
        log_request_failure(log, client_address, sys.exc_info()[1])


def log_request_failure(logger: logging.Logger, client_address, exc: BaseException | None) -> None:
    """A request an HTTP server here could not answer, in its log: a client that hung up early
    (a scraper past its timeout resets the connection) at debug level, for it is routine;
    anything else, a bug, as one error line (socketserver's default prints a traceback)."""
    host = client_address[0]  # (host, port): these servers listen on TCP
    if isinstance(exc, (ConnectionError, TimeoutError)):
        logger.debug("client %s went away: %r", host, exc)
    else:
        logger.error("request from %s failed: %s: %s", host, type(exc).__name__, exc)


class MetricsServer:
    """A running /metrics endpoint: ``.host``, ``.port``, ``.url`` and ``.close()``.

    The accept loop sleeps until a client connects or :meth:`close` wakes it: an idle
    endpoint costs no CPU (socketserver's ``serve_forever`` wakes every poll interval,
    0.07 % of a core at 5 wake-ups a second).
    """

    def __init__(self, httpd: _MetricsHTTPServer, scheme: str):
        self._httpd = httpd
        self.host, self.port = httpd.server_address[:2]
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.url = f"{scheme}://{host}:{self.port}/metrics"
        self._wake_r, self._wake_w = socket.socketpair()
        self._thread = threading.Thread(target=self._serve, name="gpudiag-metrics", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        with selectors.DefaultSelector() as sel:
            sel.register(self._httpd, selectors.EVENT_READ)
            sel.register(self._wake_r, selectors.EVENT_READ)
            while True:
                for key, _ in sel.select():
                    if key.fileobj is self._wake_r:
                        return
                    # accept, then hand the connection to its own thread (ThreadingMixIn)
                    self._httpd._handle_request_noblock()

    def close(self) -> None:
        """Stop serving and release the port. Safe to call twice."""
        if self._thread.is_alive():
            try:
                self._wake_w.send(b"x")
            except OSError:
                pass
            self._thread.join(timeout=5)
        self._httpd.server_close()
        self._wake_r.close()
        self._wake_w.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> bool:
        self.close()
        return False


def _tls_context(cert: str, key: str) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise GpudiagError(f"cannot load the exporter's TLS certificate {cert} and key {key}: {exc}") from None
    return ctx


def serve(registry: CollectorRegistry, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, *,
          tls_cert: str | None = None, tls_key: str | None = None,
          basic_auth: BasicAuth | tuple[str, str] | None = None,
          allow_non_loopback: bool = False) -> MetricsServer:
    """Serve ``registry`` on http(s)://host:port/metrics in a background thread.

    Binds 127.0.0.1 by default. Any address that is not loopback (``0.0.0.0``,
    a LAN address, a name that resolves off the host) is refused with a
    GpudiagError unless ``allow_non_loopback`` is set; then give ``tls_cert`` and
    ``tls_key`` (PEM files) and ``basic_auth`` (user, :func:`hash_password` form)
    too. ``port=0`` picks a free port (see ``.port``).
    """
    if not allow_non_loopback and not is_loopback(host):
        raise GpudiagError(f"refusing to expose metrics on {host}:{port}: not a loopback address. Set "
                           "exporter.allow_non_loopback = true in the agent config to listen beyond this host "
                           "(and give tls_cert/tls_key and basic_auth)")
    if (tls_cert is None) != (tls_key is None):
        raise GpudiagError("exporter TLS needs both tls_cert and tls_key")
    tls = _tls_context(tls_cert, tls_key) if tls_cert else None
    auth = BasicAuth(*basic_auth) if isinstance(basic_auth, tuple) else basic_auth
    if not is_loopback(host) and (tls is None or auth is None):
        log.warning("metrics on %s:%d without %s: anyone on the network can read them", host, port,
                    " and ".join(x for x, missing in (("TLS", tls is None), ("basic auth", auth is None))
                                 if missing))
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, _, _, _, address = infos[0]
        httpd = _MetricsHTTPServer(address[:2], family, registry, auth, tls)
    except OSError as exc:
        raise GpudiagError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return MetricsServer(httpd, "https" if tls else "http")
