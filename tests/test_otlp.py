"""OTLP push: a real OTLP/HTTP receiver gets the node's metrics and findings, decoded from protobuf."""

from __future__ import annotations

import gzip
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import (
    ExportLogsServiceRequest,
    ExportLogsServiceResponse,
)
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.metrics.v1.metrics_pb2 import AggregationTemporality

from gpudiag.agent.otlp import OtlpExporter, signal_urls
from gpudiag.catalog import CATALOG, M
from gpudiag.errors import GpudiagError
from gpudiag.exposition import LatestFrames
from gpudiag.findings import Evidence, Finding, Severity
from gpudiag.frames import Frame

GIB = 1024**3
T = 1_767_225_600.0


class Receiver:
    """An OTLP/HTTP collector stand-in: decodes every POST with opentelemetry-proto and keeps it."""

    def __init__(self):
        self.metrics: list[ExportMetricsServiceRequest] = []
        self.logs: list[ExportLogsServiceRequest] = []
        self.content_types: set[str] = set()
        self.got = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                receiver.content_types.add(self.headers["Content-Type"])
                if self.path == "/v1/metrics":
                    request, reply = ExportMetricsServiceRequest.FromString(body), ExportMetricsServiceResponse()
                    target = receiver.metrics
                elif self.path == "/v1/logs":
                    request, reply = ExportLogsServiceRequest.FromString(body), ExportLogsServiceResponse()
                    target = receiver.logs
                else:
                    self.send_response(404)
                    self.end_headers()
                    return
                payload = reply.SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)
                with receiver.got:
                    target.append(request)
                    receiver.got.notify_all()

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.close()


def node_frames() -> list[Frame]:
    gpus, procs, engines, apis = [], [], [], []
    for g in range(2):
        labels = {"node": "node-a", "gpu": g, "uuid": f"GPU-{g}0000000-aaaa"}
        gpus.append({**labels, "name": "NVIDIA H100 80GB HBM3", "driver_version": "550.54.15", M.gpu_info: 1,
                     M.gpu_utilization_ratio: 0.6 + g / 10, M.gpu_memory_used_bytes: 60 * GIB,
                     M.gpu_memory_total_bytes: 80 * GIB, M.gpu_power_watts: 500.0 + g,
                     M.gpu_memory_utilization_ratio: 0.4,
                     M.gpu_ecc_errors_total: {"volatile": {"corrected": 2, "uncorrected": 0}}})
        procs.append({**labels, "pid": 4000 + g, "process": "python3", M.process_gpu_memory_bytes: 50 * GIB})
        engines.append({"node": "node-a", "gpu": g, "engine": "vllm", M.engine_kv_evictions_total: 17 + g,
                        M.num_requests_running: 24})
    apis.append({"node": "node-a", "pid": 4000, "process": "python3", "api": "cudaMalloc",
                 M.cuda_api_latency_seconds: {"buckets": [(1e-06, 100.0), (4e-06, 400.0), (float("inf"), 420.0)],
                                              "sum": 0.0012, "count": 420}})
    requests = [{"node": "node-a", "gpu": 0, "engine": "vllm", M.time_to_first_token_seconds: v}
                for v in (0.004, 0.09, 2.5)]
    return [Frame("gpu", T, gpus), Frame("process", T, procs), Frame("engine", T, engines),
            Frame("cuda_api", T, apis), Frame("request", T, requests)]


def attrs(kvs) -> dict:
    out = {}
    for kv in kvs:
        v = kv.value
        kind = v.WhichOneof("value")
        out[kv.key] = [x.string_value for x in v.array_value.values] if kind == "array_value" else getattr(v, kind)
    return out


def by_name(request: ExportMetricsServiceRequest) -> dict:
    (rm,) = request.resource_metrics
    (sm,) = rm.scope_metrics
    return {m.name: m for m in sm.metrics}


def points(metric) -> list:
    return list(getattr(metric, metric.WhichOneof("data")).data_points)


def test_metrics_arrive_with_catalog_names_values_units_and_resource_attributes(receiver):
    latest = LatestFrames(node="node-a")
    latest.update(node_frames())
    exporter = OtlpExporter(receiver.url, latest, timeout_s=5)
    try:
        assert exporter.export_now()
    finally:
        exporter.shutdown()
    assert receiver.content_types == {"application/x-protobuf"}
    first = receiver.metrics[0]
    resource = attrs(first.resource_metrics[0].resource.attributes)
    assert resource["service.name"] == "gpudiag-agent"
    assert resource["host.name"] == socket.gethostname()
    assert resource["gpudiag.node"] == "node-a"
    assert first.resource_metrics[0].scope_metrics[0].scope.name == "gpudiag.agent"
    metrics = by_name(first)

    util = metrics[CATALOG[M.gpu_utilization_ratio].name]
    assert util.unit == "1" and util.description == CATALOG[M.gpu_utilization_ratio].help
    assert {attrs(p.attributes)["gpu"]: p.as_double for p in util.gauge.data_points} == {"0": 0.6, "1": 0.7}
    assert all("node" not in attrs(p.attributes) for p in util.gauge.data_points)  # a resource attribute
    assert metrics[CATALOG[M.gpu_memory_used_bytes].name].unit == "By"

    evictions = metrics[CATALOG[M.engine_kv_evictions_total].name]
    assert evictions.sum.is_monotonic
    assert evictions.sum.aggregation_temporality == AggregationTemporality.AGGREGATION_TEMPORALITY_CUMULATIVE
    assert sorted(p.as_double for p in evictions.sum.data_points) == [17.0, 18.0]

    ecc = points(metrics[CATALOG[M.gpu_ecc_errors_total].name])
    assert {(a["gpu"], a["scope"], a["kind"]): p.as_double for p in ecc for a in [attrs(p.attributes)]}[
        ("0", "volatile", "corrected")] == 2

    (latency,) = metrics[CATALOG[M.cuda_api_latency_seconds].name].histogram.data_points
    assert list(latency.explicit_bounds) == [1e-06, 4e-06]
    assert list(latency.bucket_counts) == [100, 300, 20] and latency.count == 420
    assert latency.sum == pytest.approx(0.0012)
    assert attrs(latency.attributes) == {"pid": "4000", "process": "python3", "api": "cudaMalloc"}

    # vLLM's own metrics are the engine's to export (see prom_exporter), here as there.
    assert not any(name.startswith("vllm") for name in metrics)


def test_gpu_metrics_also_follow_the_opentelemetry_hardware_semantic_conventions(receiver):
    latest = LatestFrames(node="node-a")
    latest.update(node_frames())
    exporter = OtlpExporter(receiver.url, latest, timeout_s=5)
    try:
        assert exporter.export_now()
    finally:
        exporter.shutdown()
    metrics = by_name(receiver.metrics[0])
    util = metrics["hw.gpu.utilization"]
    assert util.unit == "1"
    (gpu1,) = [p for p in util.gauge.data_points if attrs(p.attributes)["hw.id"] == "GPU-10000000-aaaa"]
    assert gpu1.as_double == 0.7
    assert attrs(gpu1.attributes) == {"hw.id": "GPU-10000000-aaaa", "hw.type": "gpu", "hw.name": "gpu1",
                                      "hw.gpu.task": "general", "hw.model": "NVIDIA H100 80GB HBM3",
                                      "hw.driver_version": "550.54.15"}
    usage, limit = metrics["hw.gpu.memory.usage"], metrics["hw.gpu.memory.limit"]
    assert usage.unit == limit.unit == "By"
    assert not usage.sum.is_monotonic and usage.sum.data_points[0].as_double == 60 * GIB
    assert limit.sum.data_points[0].as_double == 80 * GIB
    # semconv's memory utilization is used / limit, not NVML's memory-controller busy time (0.4).
    assert [p.as_double for p in metrics["hw.gpu.memory.utilization"].gauge.data_points] == [0.75, 0.75]
    power = metrics["hw.power"]
    assert power.unit == "W" and sorted(p.as_double for p in power.gauge.data_points) == [500.0, 501.0]


def test_in_engine_dialect_mode_request_latencies_arrive_as_histograms(receiver):
    latest = LatestFrames(node="node-a", export_engine_dialect=True)
    latest.update(node_frames())
    exporter = OtlpExporter(receiver.url, latest, timeout_s=5)
    try:
        assert exporter.export_now()
    finally:
        exporter.shutdown()
    metrics = by_name(receiver.metrics[0])
    ttft = metrics["vllm.time_to_first_token_seconds"]  # OTLP names may not hold ':'
    (p,) = ttft.histogram.data_points
    assert p.count == 3 and p.sum == pytest.approx(2.594) and ttft.unit == "s"
    assert sum(p.bucket_counts) == 3 and len(p.bucket_counts) == len(p.explicit_bounds) + 1
    assert metrics["vllm.num_requests_running"].gauge.data_points[0].as_double == 24


def test_findings_arrive_as_log_records_with_severity_and_entity(receiver):
    latest = LatestFrames(node="node-a")
    exporter = OtlpExporter(receiver.url, latest, timeout_s=5)
    storm = Finding("kv_eviction_storm", Severity.CRITICAL, T + 100, T + 400, "KV evictions at 40/s on GPU 3",
                    gpu=3, node="node-a", pid=4003, runbook="GpudiagKvEvictionStorm", fixes=["paged-kv"],
                    evidence=[Evidence(M.engine_kv_evictions_total, 40.0, 0.1, 5.0, "1/s")])
    try:
        exporter.emit_finding(storm, state="open")
        exporter.emit_finding(storm, state="resolved")
        assert exporter.flush_findings()
    finally:
        exporter.shutdown()
    records = [r for req in receiver.logs for rl in req.resource_logs for sl in rl.scope_logs for r in sl.log_records]
    assert attrs(receiver.logs[0].resource_logs[0].resource.attributes)["service.name"] == "gpudiag-agent"
    assert [attrs(r.attributes)["gpudiag.finding.state"] for r in records] == ["open", "resolved"]
    opened, resolved = records
    assert opened.body.string_value == "KV evictions at 40/s on GPU 3"
    assert opened.severity_text == "ERROR" and opened.severity_number == 17
    assert opened.event_name == "gpudiag.finding"
    a = attrs(opened.attributes)
    assert a["gpudiag.finding.kind"] == "kv_eviction_storm" and a["gpudiag.finding.id"] == storm.id
    assert a["gpu"] == 3 and a["pid"] == 4003 and a["gpudiag.finding.fixes"] == ["paged-kv"]
    assert '"observed": 40.0' in a["gpudiag.finding.evidence"]
    assert opened.time_unix_nano == int((T + 100) * 1e9) and resolved.time_unix_nano == int((T + 400) * 1e9)


def test_a_collector_that_is_down_costs_a_counted_failure_not_an_exception(receiver, caplog):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    latest = LatestFrames(node="node-a")
    latest.update(node_frames())
    caplog.set_level("ERROR", logger="gpudiag.agent.otlp")
    exporter = OtlpExporter(dead, latest, timeout_s=1)
    try:
        assert not exporter.export_now()
        assert not exporter.export_now()
        health = exporter.health()
        assert health["push_errors_total"] == 2 and health["failing"]
        assert exporter.metric_rows() == [{M.agent_otlp_push_errors_total: 2}]
        assert len([r for r in caplog.records if "push to" in r.getMessage()]) == 1  # logged once
    finally:
        exporter.shutdown()


def test_the_background_push_delivers_without_being_asked(receiver):
    latest = LatestFrames(node="node-a")
    latest.update(node_frames())
    exporter = OtlpExporter(receiver.url, latest, interval_s=0.05, timeout_s=5).start()
    try:
        with receiver.got:
            assert receiver.got.wait_for(lambda: len(receiver.metrics) >= 2, timeout=30)
    finally:
        exporter.shutdown()


def test_endpoints_are_base_urls_or_signal_urls_and_bad_ones_fail_in_one_line():
    assert signal_urls("http://collector:4318") == ("http://collector:4318/v1/metrics", "http://collector:4318/v1/logs")
    assert signal_urls("https://c:4318/v1/metrics/")[1] == "https://c:4318/v1/logs"
    for bad in ("collector:4318", "grpc://collector:4317", "http://"):
        with pytest.raises(GpudiagError) as err:
            signal_urls(bad)
        assert "\n" not in str(err.value)
