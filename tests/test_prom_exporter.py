"""The Prometheus endpoint: what a scrape of a busy node shows, and who may scrape it."""

from __future__ import annotations

import base64
import http.client
import logging
import shutil
import socket
import ssl
import subprocess
import threading
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from netstat import listen_overflows
from prometheus_client.parser import text_string_to_metric_families

from gpudiag import exposition
from gpudiag.agent import prom_exporter
from gpudiag.agent.prom_exporter import BasicAuth, hash_password, parse_listen, serve
from gpudiag.catalog import BY_CONTEXT, BY_NAME, CATALOG, HISTOGRAM, INFO, METRICS, M, request_context_bucket
from gpudiag.errors import GpudiagError
from gpudiag.exposition import LATENCY_BUCKETS_S, LatestFrames, registry_for
from gpudiag.findings import Finding, Severity
from gpudiag.frames import Frame

GIB = 1024**3
T = 1_767_225_600.0


def small_node(t: float = T, processes: int = 2) -> list[Frame]:
    """Two GPUs with a few processes, an engine each, finished requests and the eBPF view."""
    gpu_rows, proc_rows, engine_rows, requests, api_rows = [], [], [], [], []
    for g in range(2):
        labels = {"node": "node-a", "gpu": g, "uuid": f"GPU-{g}0000000-aaaa"}
        gpu_rows.append({
            **labels, "name": "NVIDIA H100 80GB HBM3", "pci_bus_id": f"00000000:1{g}:00.0",
            "driver_version": "550.54.15", "cuda_driver_version": "12.4", "mig_mode": "disabled",
            "virtualization_mode": "none", M.gpu_info: 1,
            M.gpu_utilization_ratio: 0.63 + g / 100,
            M.gpu_memory_used_bytes: 70 * GIB,
            M.gpu_memory_total_bytes: 80 * GIB,
            M.gpu_power_watts: 612.5,
            M.gpu_fan_speed_ratio: None,  # not measured (SXM parts have no fan): no sample
            M.gpu_temperature_celsius: float("nan"),  # not measured either
            M.gpu_ecc_errors_total: {"volatile": {"corrected": 2, "uncorrected": 0},
                                     "aggregate": {"corrected": 7, "uncorrected": 1}},
            M.gpu_clock_throttle_active: {"sw_power_cap": 1, "hw_slowdown": 0},
            M.gpu_xid_errors_total: {79: 1} if g == 1 else {},
        })
        for j in range(processes):
            proc_rows.append({**labels, "pid": 4000 + 10 * g + j, "process": "python3",
                              M.process_gpu_memory_bytes: (40 + j) * GIB,
                              M.process_torch_allocated_bytes: 30 * GIB if j == 0 else None,
                              M.process_context_switches_total: {"voluntary": 900, "involuntary": 12}})
        engine_rows.append({"node": "node-a", "gpu": g, "engine": "vllm", "model": "llama-3-8b",
                            "fingerprint": "9f2c", M.engine_model_info: 1,
                            M.num_requests_running: 24, M.kv_cache_usage_perc: 0.91,
                            M.engine_kv_evictions_total: 17,
                            M.engine_serving_state: {"serving": 1, "draining": 0}})
        for latency in (0.004, 0.09, 2.5):
            requests.append({"node": "node-a", "gpu": g, "engine": "vllm", "request_id": f"r{g}-{latency}",
                             M.time_to_first_token_seconds: latency, M.e2e_request_latency_seconds: latency * 10})
    api_rows.append({"node": "node-a", "pid": 4000, "process": "python3", "api": "cudaMalloc",
                     M.cuda_api_calls_total: 420,
                     M.cuda_api_latency_seconds: {"buckets": [(1e-06, 100.0), (4e-06, 400.0), (float("inf"), 420.0)],
                                                  "sum": 0.0012, "count": 420}})
    api_rows.append({"node": "node-a", "pid": 4000, "process": "python3", "api": "cudaMalloc", "code": 2,
                     M.cuda_api_errors_total: 3})
    return [Frame("gpu", t, gpu_rows), Frame("process", t, proc_rows), Frame("engine", t, engine_rows),
            Frame("request", t, requests), Frame("cuda_api", t, api_rows),
            Frame("node", t, [{"node": "node-a", M.node_load1: 3.5}])]


def scrape(url: str, **kwargs) -> tuple[int, str, dict]:
    """GET url; (status, body, headers), also for 4xx answers."""
    req = urllib.request.Request(url, headers=kwargs.pop("headers", {}))
    try:
        with urllib.request.urlopen(req, timeout=10, **kwargs) as resp:
            return resp.status, resp.read().decode(), dict(resp.headers)
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode(), dict(err.headers)


def samples_of(text: str) -> dict[str, dict[tuple, float]]:
    """{sample name: {sorted label items: value}}; an empty label is left out, as Prometheus stores it."""
    out: dict[str, dict[tuple, float]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, {})[tuple(sorted((k, v) for k, v in s.labels.items() if v != ""))] = s.value
    return out


def latest_with_findings(**kwargs) -> LatestFrames:
    latest = LatestFrames(node="node-a", **kwargs)
    latest.update(small_node())
    latest.set_agent_rows([{"probe": "nvml", M.agent_tick_seconds: 0.004},
                           {"probe": "nvml", "kind": "timeout", M.agent_probe_errors_total: 2},
                           {"kind": "disk_full", M.agent_store_errors_total: 5}])
    storm = Finding("kv_eviction_storm", Severity.CRITICAL, T - 60, T, "evictions 40/s", gpu=1, node="node-a", pid=4010)
    same_entity = Finding("kv_eviction_storm", Severity.CRITICAL, T - 30, T, "evictions", gpu=1, node="node-a",
                          pid=4011)
    latest.set_findings([storm, same_entity.to_dict()])
    return latest


@pytest.fixture
def served():
    servers = []

    def start(latest: LatestFrames, **kwargs):
        server = serve(registry_for(latest), port=0, **kwargs)
        servers.append(server)
        return server

    yield start
    for s in servers:
        s.close()


def test_a_scrape_shows_the_newest_frames_with_catalog_names_help_and_labels(served):
    server = served(latest_with_findings())
    assert server.host == "127.0.0.1"  # the default bind
    status, body, headers = scrape(server.url)
    assert status == 200 and headers["Content-Type"].startswith("text/plain; version=0.0.4")
    families = list(text_string_to_metric_families(body))
    for fam in families:
        metric = BY_NAME.get(fam.name) or BY_NAME.get(fam.name + "_total") or BY_NAME.get(fam.name + "_info")
        assert metric is not None, f"{fam.name} is not a catalog name"
        assert fam.documentation == metric.help
        assert fam.type == {INFO: "gauge"}.get(metric.type, metric.type)
        for s in fam.samples:
            extra = ("le",) if s.name.endswith("_bucket") else ()
            assert tuple(s.labels) == metric.labels + extra, s
    got = samples_of(body)
    gpu0 = (("gpu", "0"), ("node", "node-a"), ("uuid", "GPU-00000000-aaaa"))
    assert got[CATALOG[M.gpu_utilization_ratio].name][gpu0] == 0.63
    assert CATALOG[M.gpu_fan_speed_ratio].name not in got  # None: not measured, no sample
    assert CATALOG[M.gpu_temperature_celsius].name not in got  # NaN: not measured, no sample
    ecc = got[CATALOG[M.gpu_ecc_errors_total].name]
    assert ecc[tuple(sorted(gpu0 + (("scope", "aggregate"), ("kind", "uncorrected"))))] == 1
    assert len(ecc) == 8  # 2 GPUs x 2 scopes x 2 kinds
    assert got[CATALOG[M.gpu_xid_errors_total].name] == {
        (("gpu", "1"), ("node", "node-a"), ("uuid", "GPU-10000000-aaaa"), ("xid", "79")): 1.0}
    throttle = got[CATALOG[M.gpu_clock_throttle_active].name]
    assert throttle[tuple(sorted(gpu0 + (("reason", "sw_power_cap"),)))] == 1
    info = got[CATALOG[M.gpu_info].name]
    assert any(dict(k)["name"] == "NVIDIA H100 80GB HBM3" and dict(k)["driver_version"] == "550.54.15"
               for k in info)
    process = got[CATALOG[M.process_gpu_memory_bytes].name]
    assert process[(("gpu", "1"), ("node", "node-a"), ("pid", "4011"), ("process", "python3"),
                    ("uuid", "GPU-10000000-aaaa"))] == 41 * GIB
    assert len(got[CATALOG[M.process_torch_allocated_bytes].name]) == 2  # only the instrumented ones
    assert got[CATALOG[M.engine_serving_state].name][
        (("engine", "vllm"), ("gpu", "0"), ("node", "node-a"), ("state", "serving"))] == 1
    # The eBPF probe's own histogram passes through.
    lat = CATALOG[M.cuda_api_latency_seconds].name
    assert got[lat + "_count"][(("api", "cudaMalloc"), ("node", "node-a"), ("pid", "4000"),
                                ("process", "python3"))] == 420
    assert got[CATALOG[M.cuda_api_errors_total].name][
        (("api", "cudaMalloc"), ("code", "2"), ("node", "node-a"), ("pid", "4000"), ("process", "python3"))] == 3
    # The agent's own metrics, and one series per open finding entity (two pids, one series).
    assert got[CATALOG[M.agent_store_errors_total].name] == {(("kind", "disk_full"), ("node", "node-a")): 5}
    assert got[CATALOG[M.finding_active].name] == {
        (("gpu", "1"), ("kind", "kv_eviction_storm"), ("node", "node-a"), ("severity", "critical")): 1}
    # vLLM's own names are left to the engine's endpoint.
    assert not any(name.startswith("vllm:") for name in got)


def test_in_engine_dialect_mode_finished_requests_fill_the_latency_histograms(served):
    latest = latest_with_findings(export_engine_dialect=True)
    got = samples_of(scrape(served(latest).url)[1])
    assert got[CATALOG[M.num_requests_running].name]
    ttft = CATALOG[M.time_to_first_token_seconds].name
    labels = (("engine", "vllm"), ("gpu", "0"), ("node", "node-a"))
    assert got[ttft + "_count"][labels] == 3 and got[ttft + "_sum"][labels] == pytest.approx(2.594)

    def bucket(le):
        return got[ttft + "_bucket"][tuple(sorted(labels + (("le", le),)))]

    assert bucket("0.001") == 0 and bucket("0.005") == 1 and bucket("0.1") == 2 and bucket("+Inf") == 3
    assert len([k for k in got[ttft + "_bucket"] if dict(k)["gpu"] == "0"]) == len(LATENCY_BUCKETS_S) + 1
    latest.update([Frame("request", T + 1, [{"node": "node-a", "gpu": 0, "engine": "vllm",
                                             M.time_to_first_token_seconds: 0.05}])])
    assert samples_of(scrape(served(latest).url)[1])[ttft + "_count"][labels] == 4  # cumulative


def _one_by_one(rows, node="node-a"):
    """The histograms the request rows make counted one row at a time, straight from the rules:
    {column: {label values: (bucket counts, sum)}}."""
    import bisect
    import math

    def label(row, name, bucket):
        if name == "context_bucket" and bucket is not None:
            return bucket
        v = row.get(name)
        v = node if v is None and name == "node" else v
        if v is None or (isinstance(v, float) and math.isnan(v)):
            return ""
        return str(int(v)) if isinstance(v, float) and v.is_integer() else str(v)

    out = {}
    for row in rows:
        bucket = request_context_bucket(row)
        for key, value in row.items():
            metric = CATALOG.get(key)
            if metric is None or metric.type != HISTOGRAM or not isinstance(value, (int, float)) \
                    or value != value:
                continue
            targets = [(metric, None)]
            by_ctx = BY_CONTEXT.get(key)
            if by_ctx is not None and by_ctx not in row and bucket is not None:
                targets.append((CATALOG[by_ctx], bucket))
            for m, b in targets:
                labels = tuple(label(row, n, b) for n in m.labels)
                counts, total = out.setdefault(m.column, {}).get(labels, ([0] * (len(LATENCY_BUCKETS_S) + 1), 0.0))
                counts[bisect.bisect_left(LATENCY_BUCKETS_S, float(value))] += 1
                out[m.column][labels] = (counts, total + float(value))
    return out


def _exported(hist):
    """A snapshot's histograms as {column: {labels: (per-bucket counts, sum)}}."""
    out = {}
    for column, per in hist.items():
        for labels, (buckets, total) in per.items():
            cumulative = [n for _, n in buckets]
            counts = [int(cumulative[0])] + [int(b - a) for a, b in zip(cumulative, cumulative[1:])]
            out.setdefault(column, {})[labels] = (counts, total)
    return out


def test_request_rows_counted_in_batches_make_the_histograms_one_by_one_counting_makes():
    """Request rows wait until a reader needs the histograms and are counted together; the result is
    the one-row-at-a-time count: buckets (edges included), sums, labels, context buckets, shapes."""
    import random

    rng = random.Random(7)
    ttft, itl, e2e = M.time_to_first_token_seconds, M.inter_token_latency_seconds, M.e2e_request_latency_seconds
    rows = []
    for i in range(3000):
        row = {"node": "node-a", "gpu": rng.choice([0, 1, 2.0]), "engine": rng.choice(["vllm", "sglang"])}
        if i % 7:
            row.update(prompt_tokens=rng.choice([0, 100, 411, 412, 2048, 2047, 30000, -5, None, True, 1.5e9]),
                       output_tokens=rng.choice([100, 0, 1, 2**70]))
        row[ttft] = rng.choice([rng.uniform(0, 70), *LATENCY_BUCKETS_S, None, float("nan"), float("inf"), 0.0])
        row[itl] = rng.choice([rng.uniform(0, 0.2), False, 1])
        if i % 5 == 0:
            row[e2e] = rng.uniform(0, 100)
        if i % 11 == 0:
            row["context_bucket"] = rng.choice(["<=512", ""])
        rows.append(row)
    latest = LatestFrames(node="node-a", export_engine_dialect=True)
    for k in range(0, len(rows), 250):  # a tick's rows at a time, read now and then
        latest.update([Frame("request", T + k, rows[k:k + 250])])
        if k % 1000 == 750:
            latest.snapshot()
    got, want = _exported(latest.snapshot().histograms), _one_by_one(rows)
    assert set(got) == set(want) and set(got) >= {ttft, itl, e2e, *(BY_CONTEXT[c] for c in (ttft, itl, e2e))}
    for column in want:
        assert set(got[column]) == set(want[column]), column
        for labels, (counts, total) in want[column].items():
            assert got[column][labels][0] == counts, (column, labels)
            assert got[column][labels][1] == pytest.approx(total, rel=1e-9), (column, labels)


def test_the_context_bucket_of_many_requests_at_once_is_catalogs_of_each():
    values = [0, 1, 511, 512, 513, 2047, 2048, 2049, 8192, 32768, 32769, -1, 0.5, 511.5, float("nan"),
              float("inf"), float("-inf"), None, True, False, "300", 2**80, -(2**80), 10**400, -(10**400)]
    rows = [{"prompt_tokens": p, "output_tokens": o} for p in values for o in (0, 1, 2**80, None, 12.5, True)]
    assert exposition._context_buckets(rows, tuple(rows[0])) == [request_context_bucket(r) for r in rows]


def test_request_rows_never_waiting_for_a_reader_are_counted_in_bounded_batches():
    latest = LatestFrames(node="node-a")
    ttft = M.time_to_first_token_seconds
    n = 3 * exposition.MAX_WAITING_REQUESTS + 17
    for k in range(0, n, 100):
        latest.update([Frame("request", T + k, [{"gpu": 0, ttft: 0.01}] * min(100, n - k))])
        assert len(latest._waiting) < exposition.MAX_WAITING_REQUESTS
    (buckets, total), = latest.snapshot().histograms[ttft].values()
    assert buckets[-1] == ("+Inf", float(n)) and total == pytest.approx(0.01 * n)


def test_hostile_request_rows_are_no_observation_and_never_break_a_scrape(served):
    """Values no float holds, labels that are lists, rows that are not dicts, infinities: a scrape
    still answers, and only what is a number is counted."""
    ttft = M.time_to_first_token_seconds
    latest = LatestFrames(node="node-a")
    latest.update([Frame("request", T, [
        {"gpu": 0, ttft: 10**400},  # no float holds it: not an observation
        {"gpu": [0, 1], ttft: 0.2},  # a list for a label: its text
        "not a row",
        None,
        {"gpu": 0, ttft: float("inf")},
        {"gpu": 0, ttft: -0.5, "prompt_tokens": 10**400, "output_tokens": 1},
    ])])
    hist = latest.snapshot().histograms[ttft]
    assert hist[("node-a", "0", "")][0][-1] == ("+Inf", 2.0)  # inf and -0.5
    assert hist[("node-a", "[0, 1]", "")][0][-1] == ("+Inf", 1.0)
    with urllib.request.urlopen(served(latest).url, timeout=10) as resp:
        assert resp.status == 200 and b"gpudiag_" in resp.read()


def test_request_rows_of_changing_shapes_are_observed_each_by_its_own_shape():
    ttft, by_ctx = M.time_to_first_token_seconds, M.request_time_to_first_token_seconds
    base = {"node": "node-a", "gpu": 0, "engine": "vllm"}
    latest = LatestFrames(node="node-a")
    latest.update([Frame("request", T, [
        {**base, ttft: 0.02, "prompt_tokens": 100, "output_tokens": 20},  # by context from its tokens
        {**base, ttft: 0.03},  # no tokens: no context bucket
        {**base, ttft: 0.04, by_ctx: 0.04, "context_bucket": "given"},  # its own by-context value: not doubled
        {**base, ttft: 0.05, "prompt_tokens": 100, "output_tokens": 20},  # the first shape again
        {**base, ttft: None, "prompt_tokens": 100, "output_tokens": 20},  # not a number: not observed
    ])])
    hist = latest.snapshot().histograms
    assert sum(h[0][-1][1] for h in hist[ttft].values()) == 4
    by_bucket = {labels: h[0][-1][1] for labels, h in hist[by_ctx].items()}
    assert sorted(by_bucket.values()) == [1.0, 2.0]
    assert any("given" in labels for labels in by_bucket) and sum(by_bucket.values()) == 3


def test_the_next_tick_replaces_the_last_so_an_exited_process_disappears(served):
    latest = LatestFrames(node="node-a")
    latest.update(small_node(processes=2))
    server = served(latest)
    name = CATALOG[M.process_gpu_memory_bytes].name
    assert len(samples_of(scrape(server.url)[1])[name]) == 4
    latest.update([fr for fr in small_node(T + 1, processes=1) if fr.kind == "process"])
    after = samples_of(scrape(server.url)[1])
    assert len(after[name]) == 2
    assert CATALOG[M.gpu_utilization_ratio].name in after  # kinds not updated keep their newest rows


def every_catalog_metric() -> LatestFrames:
    """A node whose rows carry every metric of the catalog, each with all its labels."""
    rows: dict[str, list[dict]] = {}
    agent_rows, findings = [], []
    for metric in METRICS:
        labels = {name: ("3" if name in ("gpu", "pid", "xid", "code") else f"{name}-x") for name in metric.labels}
        if metric.entity == "finding":
            findings.append({"kind": "kv_eviction_storm", "severity": "warning", "gpu": 3, "node": "node-a"})
        elif metric.entity == "agent":
            agent_rows.append({**labels, metric.column: 1.0})
        elif metric.type == HISTOGRAM and metric.entity == "request":
            rows.setdefault("request", []).append({**labels, metric.column: 0.2})
        elif metric.type == HISTOGRAM:
            rows.setdefault(metric.entity, []).append(
                {**labels, metric.column: {"buckets": [(0.001, 1.0), (float("inf"), 2.0)], "sum": 0.5, "count": 2}})
        else:
            assert metric.entity in ("gpu", "process", "engine", "node", "cuda_api"), metric
            rows.setdefault(metric.entity, []).append({**labels, metric.column: 1.0})
    latest = LatestFrames(node="node-a")
    latest.update([Frame(kind, T, rs) for kind, rs in rows.items()])
    latest.set_agent_rows(agent_rows)
    latest.set_findings(findings)
    return latest


def _promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool not installed (scripts/system-deps.d/20-prometheus.sh installs Debian's prometheus)")
    return path


def test_a_burst_of_scrapers_is_queued_by_the_listener_not_dropped_by_the_kernel(served):
    # Prometheus replicas, a federation and on-call curl loops scrape at once; a listen queue
    # of socketserver's default 5 overflows and the kernel drops or resets the connections.
    server = served(latest_with_findings())
    clients = 64
    barrier = threading.Barrier(clients)

    def one(_):
        barrier.wait()
        return socket.create_connection((server.host, server.port), timeout=30)

    before = listen_overflows()
    with ThreadPoolExecutor(max_workers=clients) as pool:
        conns = list(pool.map(one, range(clients)))
    try:
        for conn in conns:
            conn.sendall(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
        replies = []
        for conn in conns:
            data = b""
            while chunk := conn.recv(65536):
                data += chunk
            replies.append(data)
    finally:
        for conn in conns:
            conn.close()
    assert all(r.startswith(b"HTTP/1.0 200") for r in replies)
    if before is not None:
        assert listen_overflows() == before


def test_promtool_check_metrics_finds_nothing_to_lint_in_any_catalog_metric(served):
    promtool = _promtool()
    latest = every_catalog_metric()
    body = scrape(served(latest).url)[1]
    exported = {fam.name for fam in text_string_to_metric_families(body)}
    assert len(exported) == len([m for m in METRICS if m.dialect == "gpudiag"])  # every one was scraped
    result = subprocess.run([promtool, "check", "metrics"], check=False, input=body, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0 and result.stdout == "" and result.stderr == "", result.stdout + result.stderr


def test_with_the_engine_dialect_promtool_reports_only_vllms_own_colons(served):
    promtool = _promtool()
    latest = every_catalog_metric()
    latest.export_engine_dialect = True
    body = scrape(served(latest).url)[1]
    result = subprocess.run([promtool, "check", "metrics"], check=False, input=body, capture_output=True, text=True,
                            timeout=60)
    complaints = (result.stdout + result.stderr).strip().splitlines()
    vllm = {m.name for m in METRICS if m.dialect == "vllm"}
    assert {line.split()[0] for line in complaints} == vllm
    assert all(line.endswith("metric names should not contain ':'") for line in complaints)


# --- TLS, basic auth, binding --------------------------------------------------------------


@pytest.fixture
def self_signed(tmp_path):
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl CLI not installed: cannot make a test certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=60)
    return str(cert), str(key)


def test_tls_serves_the_metrics_to_a_client_that_trusts_the_certificate(served, self_signed):
    cert, key = self_signed
    server = served(latest_with_findings(), tls_cert=cert, tls_key=key)
    assert server.url.startswith("https://127.0.0.1:")
    status, body, _ = scrape(server.url, context=ssl.create_default_context(cafile=cert))
    assert status == 200 and CATALOG[M.gpu_utilization_ratio].name in samples_of(body)
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
        scrape(server.url, context=ssl.create_default_context())  # an untrusted certificate
    with pytest.raises((ConnectionError, urllib.error.URLError, http.client.HTTPException)):
        scrape(server.url.replace("https://", "http://"))  # no plain-text fallback
    # A client that connects and never speaks TLS does not stop the others being served.
    idle = socket.create_connection((server.host, server.port))
    try:
        assert scrape(server.url, context=ssl.create_default_context(cafile=cert))[0] == 200
    finally:
        idle.close()


def test_tls_with_a_missing_key_file_fails_in_one_line(tmp_path, self_signed):
    cert, _ = self_signed
    with pytest.raises(GpudiagError) as err:
        serve(registry_for(LatestFrames()), port=0, tls_cert=cert, tls_key=str(tmp_path / "missing.pem"))
    assert "TLS" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(GpudiagError, match="both tls_cert and tls_key"):
        serve(registry_for(LatestFrames()), port=0, tls_cert=cert)


def test_basic_auth_answers_401_without_the_right_credentials_and_200_with_them(served):
    auth = BasicAuth("prometheus", hash_password("correct horse battery staple"))
    server = served(latest_with_findings(), basic_auth=auth)

    def header(user, password):
        return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}

    status, _, headers = scrape(server.url)
    assert status == 401 and headers["WWW-Authenticate"].startswith('Basic realm="gpudiag"')
    assert scrape(server.url, headers=header("prometheus", "wrong"))[0] == 401
    assert scrape(server.url, headers=header("grafana", "correct horse battery staple"))[0] == 401
    assert scrape(server.url, headers={"Authorization": "Basic !!!not-base64"})[0] == 401
    assert scrape(server.url, headers={"Authorization": "Bearer token"})[0] == 401
    assert scrape(server.url.replace("/metrics", "/healthz"))[0] == 401  # nothing is open without it
    status, body, _ = scrape(server.url, headers=header("prometheus", "correct horse battery staple"))
    assert status == 200 and CATALOG[M.finding_active].name in samples_of(body)


def test_a_plain_text_password_in_the_config_is_refused():
    with pytest.raises(GpudiagError, match="not in plain text"):
        BasicAuth("prometheus", "correct horse battery staple")
    with pytest.raises(GpudiagError, match="64 hex digits"):
        BasicAuth("prometheus", "sha256$00ff$abcd")
    salted = hash_password("pw")
    assert salted != hash_password("pw")  # a fresh salt each time
    assert hash_password("pw", bytes.fromhex(salted.split("$")[1])) == salted


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "", "192.0.2.10"])
def test_binding_beyond_loopback_is_refused_without_the_explicit_allow(host):
    with pytest.raises(GpudiagError, match="not a loopback address.*allow_non_loopback"):
        serve(registry_for(LatestFrames()), host=host, port=0)


def test_binding_all_interfaces_works_when_explicitly_allowed_and_warns_without_tls(served, caplog):
    caplog.set_level(logging.WARNING, logger="gpudiag.agent.prom_exporter")
    server = served(latest_with_findings(), host="0.0.0.0", allow_non_loopback=True)
    assert scrape(f"http://127.0.0.1:{server.port}/metrics")[0] == 200
    assert any("without TLS and basic auth" in r.getMessage() for r in caplog.records)


def test_localhost_and_ipv6_loopback_are_loopback(served):
    assert served(LatestFrames(), host="localhost").port > 0
    if socket.has_ipv6:
        try:
            server = served(LatestFrames(), host="::1")
        except GpudiagError as exc:  # a kernel without IPv6 on lo
            pytest.skip(f"no IPv6 loopback here: {exc}")
        assert server.url.startswith("http://[::1]:")


def test_listen_addresses_parse_and_bad_ones_fail_in_one_line():
    assert parse_listen("127.0.0.1:9400") == ("127.0.0.1", 9400)
    assert parse_listen("[::1]:9401") == ("::1", 9401)
    assert parse_listen(":9402") == ("127.0.0.1", 9402)
    for bad in ("9400", "127.0.0.1:http", "127.0.0.1:70000"):
        with pytest.raises(GpudiagError):
            parse_listen(bad)


def test_an_idle_endpoint_sleeps_until_a_client_comes_and_close_wakes_it(monkeypatch):
    # A polling accept loop wakes every poll interval whether or not anyone scrapes
    # (socketserver's serve_forever: 0.07 % of a core at 5 a second on an idle node).
    import selectors

    waits = []
    real = selectors.DefaultSelector

    class Counting(real):
        def select(self, timeout=None):
            waits.append(timeout)
            return super().select(timeout)

    monkeypatch.setattr(selectors, "DefaultSelector", Counting)
    server = serve(registry_for(latest_with_findings()), port=0)
    try:
        for _ in range(3):
            with urllib.request.urlopen(server.url, timeout=10) as resp:
                assert resp.status == 200
        threading.Event().wait(0.5)
        assert waits and all(t is None for t in waits)  # no timeout: blocked until a client or close()
        assert len(waits) <= 4  # one wait per connection, plus the one in progress
    finally:
        server.close()
    assert not server._thread.is_alive()
    with socket.socket() as s:  # the port is free again
        s.bind((server.host, server.port))


class _BrokenCollector:
    """A collector with a bug: collect() raises."""

    def collect(self):
        raise RuntimeError("a row the collector cannot read")


def test_a_collector_bug_is_a_500_and_one_error_line_and_the_endpoint_keeps_serving(caplog):
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_BrokenCollector())
    server = serve(registry, port=0)
    try:
        with caplog.at_level(logging.DEBUG, logger="gpudiag.agent.prom_exporter"):
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(server.url, timeout=5)
            assert err.value.code == 500
            assert b"log says why" in err.value.read()
            with urllib.request.urlopen(server.url.replace("/metrics", "/healthz"), timeout=5) as resp:
                assert resp.status == 200
    finally:
        server.close()
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == ["collecting /metrics failed: RuntimeError: a row the collector cannot read"]
    assert not any(r.exc_info for r in caplog.records)


def test_a_scraper_that_hangs_up_is_a_debug_line_and_a_handler_failure_one_error_line(served, caplog,
                                                                                      monkeypatch):
    import struct


    server = served(latest_with_findings())
    with caplog.at_level(logging.DEBUG, logger="gpudiag.agent.prom_exporter"):
        for _ in range(10):  # a scraper past its timeout closes with a reset
            s = socket.create_connection(("127.0.0.1", server.port), timeout=5)
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            s.close()
        with urllib.request.urlopen(server.url, timeout=5) as resp:
            assert resp.status == 200  # still serving
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
        # A failure outside the collector (here: answering) is a bug: one error line, no traceback.
        # Only this request fails to answer: a reset connection above whose handler thread runs late
        # (a loaded machine) must not meet the patched method too.
        send = prom_exporter._Handler._send

        def failing_send(handler, *a, **k):
            if handler.path.endswith("?case=fail"):
                raise ValueError("cannot answer")
            return send(handler, *a, **k)

        monkeypatch.setattr(prom_exporter._Handler, "_send", failing_send)
        with pytest.raises((urllib.error.URLError, http.client.HTTPException, ConnectionError)):
            urllib.request.urlopen(server.url + "?case=fail", timeout=5)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert [r.getMessage() for r in errors] == ["request from 127.0.0.1 failed: ValueError: cannot answer"]
    assert not any(r.exc_info for r in errors)


def _through_families(latest: LatestFrames) -> bytes:
    """The text prometheus_client's family objects make of the collector (encode_text's general path)."""
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry(auto_describe=False)
    registry.register(exposition.FramesCollector(latest))
    return exposition.encode_text(registry)


def test_the_text_written_straight_from_the_samples_is_the_text_of_the_family_objects(monkeypatch):
    # A scrape writes the samples without prometheus_client's family objects; the text must be what
    # they make of the same samples, byte for byte: every catalog metric with all its labels, label
    # values that need escaping, both dialects, findings and self-metrics, observed histograms, a
    # probe's own histograms (one with a negative first bucket has no _count and _sum), counters.
    def odd(latest: LatestFrames) -> LatestFrames:
        latest.update([Frame("cuda_api", T, [
            {"node": 'node "a"\\b\nc', "pid": 4000, "process": "py\\thon", "api": "cudaFree",
             M.cuda_api_calls_total: 2**70,
             M.cuda_api_latency_seconds: {"buckets": [(-1.0, 1.0), (2.5e-7, 3.0)], "sum": 1e-6, "count": 3}},
            {"node": "node-a", "pid": 4001, "process": "p", "api": "cudaMalloc", M.cuda_api_calls_total: 0.1,
             M.cuda_api_latency_seconds: {"buckets": [(1e-06, 2.0), (float("inf"), 5.0)], "sum": 7e-6, "count": 5}},
            {"node": "node-a", "pid": 4002, "process": "p", "api": "cudaMemcpy", M.cuda_api_calls_total: 1,
             M.cuda_api_latency_seconds: {"buckets": "not buckets", "sum": 1.0}},
        ])])
        return latest

    cases = [latest_with_findings(), latest_with_findings(export_engine_dialect=True), every_catalog_metric(),
             odd(LatestFrames(node="node-a")), LatestFrames()]
    def no_families(self):
        raise AssertionError("the agent's registry is written without family objects")

    texts = []
    for i, latest in enumerate(cases):
        want = _through_families(latest)
        with monkeypatch.context() as m:
            m.setattr(exposition.FramesCollector, "collect", no_families)
            texts.append(exposition.encode_text(registry_for(latest)))
        assert texts[-1] == want, i
    got = texts[3].decode()
    assert 'gpudiag_cuda_api_latency_seconds_count{node="node-a",pid="4001",process="p",api="cudaMalloc"} 5.0' in got
    assert 'le="-1.0"' in got and 'node="node \\"a\\"\\\\b\\nc"' in got
    assert 'gpudiag_cuda_api_latency_seconds_sum{node="node \\"a' not in got  # a negative first bucket: no _sum
    assert 'pid="4002"' in got and 'gpudiag_cuda_api_latency_seconds_bucket{node="node-a",pid="4002"' not in got
    assert texts[4] == b""
