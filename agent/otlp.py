"""OTLP export: the latest frames as OTLP/HTTP metrics, and findings as OTLP log records.

Metrics are pushed every ``interval_s`` (default 15 s) from the same samples
the Prometheus endpoint serves (:func:`gpudiag.exposition.catalog_samples`),
so both views agree to the last bucket:

* every catalog metric under its catalog name (``gpudiag_gpu_utilization_ratio``;
  vLLM-dialect ones, when exported at all, as ``vllm.<column>``: OpenTelemetry
  instrument names may not contain ``:``), with the catalog's labels as
  attributes less ``node`` (a resource attribute here) and its unit in UCUM
  (``By``, ``s``, ``1``...); gauges and info metrics as Gauge, counters as
  cumulative monotonic Sum, histograms as cumulative explicit-bucket Histogram
  (including the eBPF probe's log2 latency maps, which an SDK instrument could
  not take since they are aggregated in the kernel);
* the GPU metrics OpenTelemetry's hardware semantic conventions define
  (``hw.gpu.utilization``, ``hw.gpu.memory.usage``, ``hw.gpu.memory.limit``,
  ``hw.gpu.memory.utilization``, ``hw.power``; semconv status "development"),
  with ``hw.id`` = the GPU UUID and ``hw.type`` = ``gpu``, in addition to the
  catalog names, so dashboards of either convention work. Note that semconv's
  ``hw.gpu.memory.utilization`` is used / limit, not NVML's memory-controller
  busy time (that stays ``gpudiag_gpu_memory_utilization_ratio`` only).

Resource attributes: ``service.name=gpudiag-agent``, ``service.version``,
``host.name``, ``gpudiag.node`` (plus ``OTEL_RESOURCE_ATTRIBUTES``). The wire
work is the OpenTelemetry SDK's OTLP/HTTP protobuf exporters (retries, TLS,
``OTEL_EXPORTER_OTLP_HEADERS``); a collector that is down costs a logged,
counted failure, never a stalled agent: pushes run on their own thread.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import socket
import threading
import time
from typing import Any
from urllib.parse import urlparse

from opentelemetry._logs import SeverityNumber
from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter
from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
from opentelemetry.sdk._logs import LoggerProvider
from opentelemetry.sdk._logs.export import BatchLogRecordProcessor
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    Gauge,
    Histogram,
    HistogramDataPoint,
    MetricExportResult,
    MetricsData,
    NumberDataPoint,
    ResourceMetrics,
    ScopeMetrics,
    Sum,
)
from opentelemetry.sdk.metrics.export import Metric as OtelMetric
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

import gpudiag
from gpudiag.catalog import CATALOG, COUNTER, HISTOGRAM, M
from gpudiag.catalog import Metric as CatalogMetric
from gpudiag.errors import GpudiagError
from gpudiag.exposition import LatestFrames, ObservedHistogram, catalog_samples

log = logging.getLogger("gpudiag.agent.otlp")

DEFAULT_INTERVAL_S = 15.0
DEFAULT_TIMEOUT_S = 10.0
SERVICE_NAME = "gpudiag-agent"

# Catalog units as UCUM, the unit syntax OTLP asks for.
UCUM = {"bytes": "By", "seconds": "s", "ratio": "1", "hertz": "Hz", "watts": "W", "celsius": "Cel",
        "bytes_per_second": "By/s", "": "1"}

# OpenTelemetry hardware semantic conventions for GPUs (hw.gpu.*, plus hw.power for any
# hardware type): (catalog column, semconv name, instrument, unit, description, fixed attributes).
SEMCONV_GPU = (
    (M.gpu_utilization_ratio, "hw.gpu.utilization", "gauge", "1", "Fraction of time spent in a specific task.",
     {"hw.gpu.task": "general"}),
    (M.gpu_memory_used_bytes, "hw.gpu.memory.usage", "updowncounter", "By", "GPU memory used.", {}),
    (M.gpu_memory_total_bytes, "hw.gpu.memory.limit", "updowncounter", "By", "Size of the GPU memory.", {}),
    (M.gpu_power_watts, "hw.power", "gauge", "W", "Instantaneous power consumed by the component.", {}),
)
SEMCONV_MEMORY_UTILIZATION = "hw.gpu.memory.utilization"  # used / limit, derived from the two above

_SEVERITY = {"critical": (SeverityNumber.ERROR, "ERROR"), "warning": (SeverityNumber.WARN, "WARN"),
             "info": (SeverityNumber.INFO, "INFO")}


def otel_name(metric: CatalogMetric) -> str:
    """The OTLP metric name of a catalog metric (the catalog name; ``vllm:x`` becomes ``vllm.x``)."""
    return metric.name.replace(":", ".")


def signal_urls(endpoint: str) -> tuple[str, str]:
    """The metrics and logs URLs of an OTLP/HTTP endpoint (a base URL, or either signal's own URL)."""
    parsed = urlparse(endpoint)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise GpudiagError(f"--otlp-endpoint {endpoint!r}: expected an http(s) URL such as http://127.0.0.1:4318")
    base = endpoint.rstrip("/")
    for suffix in ("/v1/metrics", "/v1/logs"):
        base = base.removesuffix(suffix)
    return base + "/v1/metrics", base + "/v1/logs"


def _attributes(metric: CatalogMetric, labels: tuple[str, ...]) -> dict[str, str]:
    # node is a resource attribute; an empty label is an absent one, as in Prometheus.
    return {name: value for name, value in zip(metric.labels, labels) if value and name != "node"}


def _histogram_point(value, attributes: dict, start_ns: int, now_ns: int) -> HistogramDataPoint | None:
    """A cumulative explicit-bucket point from cumulative (le, count) pairs; None when malformed."""
    if isinstance(value, ObservedHistogram):
        pairs, total = [(float(le), n) for le, n in value.buckets], value.sum
    else:
        try:
            pairs = sorted((float(le), float(n)) for le, n in value["buckets"])
            total = float(value.get("sum") or 0.0)
        except (TypeError, ValueError, KeyError):
            return None
    if not pairs:
        return None
    bounds = [le for le, _ in pairs if not math.isinf(le)]
    cumulative = [n for _, n in pairs]
    if not math.isinf(pairs[-1][0]):  # the probe left out +Inf: nothing beyond its last bound
        cumulative.append(cumulative[-1])
    counts = [int(cumulative[0])] + [int(b - a) for a, b in itertools.pairwise(cumulative)]
    return HistogramDataPoint(attributes=attributes, start_time_unix_nano=start_ns, time_unix_nano=now_ns,
                              count=int(cumulative[-1]), sum=total, bucket_counts=counts,
                              explicit_bounds=bounds, min=None, max=None)


def build_metrics(latest: LatestFrames, resource: Resource, scope: InstrumentationScope, start_ns: int,
                  now_ns: int | None = None) -> MetricsData:
    """The OTLP metrics of the latest frames (catalog names, then the hw.gpu.* semantic conventions)."""
    now_ns = time.time_ns() if now_ns is None else now_ns
    snap = latest.snapshot()
    metrics: list[OtelMetric] = []
    for column, per_labels in catalog_samples(snap).items():
        metric = CATALOG[column]
        unit = UCUM.get(metric.unit, metric.unit)
        if metric.type == HISTOGRAM:
            points = [p for p in (_histogram_point(v, _attributes(metric, labels), start_ns, now_ns)
                                  for labels, v in per_labels.items()) if p is not None]
            if points:
                metrics.append(OtelMetric(otel_name(metric), metric.help, unit,
                                          Histogram(points, AggregationTemporality.CUMULATIVE)))
            continue
        points = [NumberDataPoint(attributes=_attributes(metric, labels), start_time_unix_nano=start_ns,
                                  time_unix_nano=now_ns, value=float(v)) for labels, v in per_labels.items()]
        data = (Sum(points, AggregationTemporality.CUMULATIVE, is_monotonic=True) if metric.type == COUNTER
                else Gauge(points))
        metrics.append(OtelMetric(otel_name(metric), metric.help, unit, data))
    metrics += _semconv_metrics(snap.rows.get("gpu", []), start_ns, now_ns)
    return MetricsData([ResourceMetrics(resource, [ScopeMetrics(scope, metrics, "")], "")])


def _hw_attributes(row: dict[str, Any]) -> dict[str, str] | None:
    gpu, uuid = row.get("gpu"), row.get("uuid")
    if gpu is None and not uuid:
        return None
    attrs = {"hw.id": str(uuid or f"gpu{gpu}"), "hw.type": "gpu"}
    if gpu is not None:
        attrs["hw.name"] = f"gpu{gpu}"
    if row.get("name"):
        attrs["hw.model"] = str(row["name"])
    if row.get("driver_version"):
        attrs["hw.driver_version"] = str(row["driver_version"])
    return attrs


def _number(v) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and math.isnan(v)):
        return None
    return float(v)


def _semconv_metrics(gpu_rows: list[dict[str, Any]], start_ns: int, now_ns: int) -> list[OtelMetric]:
    points: dict[str, list[NumberDataPoint]] = {}
    for row in gpu_rows:
        attrs = _hw_attributes(row)
        if attrs is None:
            continue
        for column, name, _, _, _, fixed in SEMCONV_GPU:
            value = _number(row.get(column))
            if value is not None:
                points.setdefault(name, []).append(NumberDataPoint({**attrs, **fixed}, start_ns, now_ns, value))
        used, total = _number(row.get(M.gpu_memory_used_bytes)), _number(row.get(M.gpu_memory_total_bytes))
        if used is not None and total:
            points.setdefault(SEMCONV_MEMORY_UTILIZATION, []).append(
                NumberDataPoint(attrs, start_ns, now_ns, used / total))
    out = []
    for _, name, instrument, unit, description, _ in SEMCONV_GPU:
        if name in points:
            data = (Sum(points[name], AggregationTemporality.CUMULATIVE, is_monotonic=False)
                    if instrument == "updowncounter" else Gauge(points[name]))
            out.append(OtelMetric(name, description, unit, data))
    if SEMCONV_MEMORY_UTILIZATION in points:
        out.append(OtelMetric(SEMCONV_MEMORY_UTILIZATION, "Fraction of GPU memory used.", "1",
                              Gauge(points[SEMCONV_MEMORY_UTILIZATION])))
    return out


def _log_attribute(v):
    if isinstance(v, (str, bool, int, float)):
        return v
    if isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v):
        return list(v)
    return json.dumps(v, default=str, sort_keys=True)


class OtlpExporter:
    """Pushes the latest frames as OTLP/HTTP metrics every ``interval_s`` and findings as log records.

    ``start()`` begins the periodic pushes on a background thread;
    :meth:`export_now` pushes once (the agent calls it at shutdown);
    :meth:`emit_finding` queues a finding's log record (sent in batches);
    :meth:`health` counts failures for the agent's self-metrics.
    """

    def __init__(self, endpoint: str, latest: LatestFrames, *, node: str | None = None,
                 interval_s: float = DEFAULT_INTERVAL_S, timeout_s: float = DEFAULT_TIMEOUT_S,
                 headers: dict[str, str] | None = None, resource_attributes: dict[str, Any] | None = None):
        if interval_s <= 0 or timeout_s <= 0:
            raise GpudiagError("otlp interval_s and timeout_s must be positive")
        self.metrics_url, self.logs_url = signal_urls(endpoint)
        self.latest = latest
        self.node = node or latest.node or socket.gethostname()
        self.interval_s = interval_s
        attributes = {"service.name": SERVICE_NAME, "service.version": gpudiag.__version__,
                      "host.name": socket.gethostname(), "gpudiag.node": self.node, **(resource_attributes or {})}
        self.resource = Resource.create(attributes)
        self.scope = InstrumentationScope("gpudiag.agent", gpudiag.__version__)
        self._start_ns = time.time_ns()
        self._metric_exporter = OTLPMetricExporter(endpoint=self.metrics_url, timeout=timeout_s, headers=headers)
        self._log_provider = LoggerProvider(resource=self.resource, shutdown_on_exit=False)
        self._log_provider.add_log_record_processor(BatchLogRecordProcessor(
            OTLPLogExporter(endpoint=self.logs_url, timeout=timeout_s, headers=headers)))
        self._logger = self._log_provider.get_logger("gpudiag.findings", gpudiag.__version__)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._push_lock = threading.Lock()
        self._errors = 0
        self._pushes = 0
        self._failing = False

    def start(self) -> OtlpExporter:
        """Push every ``interval_s`` on a daemon thread until :meth:`shutdown`."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="gpudiag-otlp", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.export_now()

    def export_now(self) -> bool:
        """Push the latest frames once; True when the collector took them (failures are logged, counted)."""
        with self._push_lock:
            try:
                data = build_metrics(self.latest, self.resource, self.scope, self._start_ns)
                ok = self._metric_exporter.export(data) == MetricExportResult.SUCCESS
            except Exception as exc:  # a push must never take the agent down
                log.debug("OTLP metrics push failed", exc_info=exc)
                ok = False
            self._pushes += 1
            if ok:
                if self._failing:
                    log.warning("OTLP metrics push to %s works again", self.metrics_url)
                self._failing = False
                return True
            self._errors += 1
            if not self._failing:
                log.error("OTLP metrics push to %s failed; retrying every %g s", self.metrics_url, self.interval_s)
            self._failing = True
            return False

    def emit_finding(self, finding, state: str = "open") -> None:
        """Queue a finding (a Finding or its dict) as a log record; ``state`` is open, updated or resolved."""
        d = finding.to_dict() if hasattr(finding, "to_dict") else dict(finding)
        start_s = getattr(finding, "start_s", d.get("start_s"))  # to_dict() rounds; the object is exact
        end_s = getattr(finding, "end_s", d.get("end_s"))
        severity, text = _SEVERITY.get(str(d.get("severity")), (SeverityNumber.UNSPECIFIED, str(d.get("severity"))))
        attributes = {"gpudiag.finding.id": d.get("id"), "gpudiag.finding.kind": d.get("kind"),
                      "gpudiag.finding.severity": d.get("severity"), "gpudiag.finding.state": state,
                      "gpudiag.finding.start_s": start_s, "gpudiag.finding.end_s": end_s,
                      "gpudiag.finding.runbook": d.get("runbook"), "gpudiag.finding.fixes": d.get("fixes"),
                      "gpudiag.finding.caused_by": d.get("caused_by"),
                      "gpudiag.finding.evidence": d.get("evidence"), "gpu": d.get("gpu"), "pid": d.get("pid")}
        attributes = {k: _log_attribute(v) for k, v in attributes.items() if v not in (None, "", [])}
        when_s = end_s if state == "resolved" and end_s is not None else start_s
        timestamp = int(when_s * 1e9) if isinstance(when_s, (int, float)) and when_s > 0 else time.time_ns()
        self._logger.emit(timestamp=timestamp, observed_timestamp=time.time_ns(), severity_number=severity,
                          severity_text=text, body=d.get("summary", ""), attributes=attributes,
                          event_name="gpudiag.finding")

    def flush_findings(self, timeout_s: float = DEFAULT_TIMEOUT_S) -> bool:
        """Send queued finding records now; True when they went out."""
        return self._log_provider.force_flush(int(timeout_s * 1000))

    def health(self) -> dict[str, Any]:
        """Pushes tried, pushes failed and whether the last one failed."""
        return {"metrics_url": self.metrics_url, "pushes_total": self._pushes, "push_errors_total": self._errors,
                "failing": self._failing}

    def metric_rows(self) -> list[dict[str, Any]]:
        """:meth:`health` as self-metrics rows for ``LatestFrames.set_agent_rows``."""
        return [{M.agent_otlp_push_errors_total: self._errors}]

    def shutdown(self) -> None:
        """Stop the pushes, push once more and send queued findings. Safe to call twice."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval_s + 1)
        self.export_now()
        self._log_provider.shutdown()
        self._metric_exporter.shutdown()
