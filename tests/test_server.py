"""`gpudiag engine serve`: the real-tensor engine over HTTP, as a client and an operator meet it.

Each server is a real ``gpudiag engine serve`` process on loopback (tiny
model, device cpu); the tests are its clients. Counts and times are bounded:
every HTTP call has a socket timeout, loads are a fixed number of requests.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from netstat import listen_overflows
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from prometheus_client.parser import text_string_to_metric_families

from gpudiag.catalog import CATALOG, VLLM_PREFIX, M
from gpudiag.probes.engine_scrape import EngineScrapeProbe
from gpudiag.probes.torch_probe import TorchProbe
from gpudiag.reference_engine.model.model import build_model
from gpudiag.reference_engine.model.model_config import PRESETS

HTTP_TIMEOUT_S = 60.0
START_TIMEOUT_S = 120.0


class Traces:
    """An OTLP/HTTP trace receiver: decodes every POST to /v1/traces and keeps its spans."""

    def __init__(self):
        self.spans = []
        self.got = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                request = ExportTraceServiceRequest.FromString(body)
                payload = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)
                with receiver.got:
                    for rs in request.resource_spans:
                        for ss in rs.scope_spans:
                            receiver.spans.extend(ss.spans)
                    receiver.got.notify_all()

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def wait_for(self, predicate, timeout_s: float = 30.0):
        deadline = time.monotonic() + timeout_s
        with self.got:
            while not predicate(self.spans) and time.monotonic() < deadline:
                self.got.wait(timeout=0.2)
            return list(self.spans)

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


class Served:
    """A `gpudiag engine serve` subprocess and a small HTTP client for it."""

    def __init__(self, tmp_path, *args, env=None):
        self.runtime_dir = tmp_path / "runtime"
        self.runtime_dir.mkdir(mode=0o700)
        self.log_path = tmp_path / "serve.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gpudiag", "engine", "serve", "--device", "cpu", "--model-config", "tiny",
             "--port", "0", "--runtime-dir", str(self.runtime_dir), "--threads", "1", *map(str, args)],
            stdout=subprocess.DEVNULL, stderr=self._log, env={**os.environ, **(env or {})})
        self.port = self._wait_serving()

    def _wait_serving(self) -> int:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            text = self.log_path.read_text()
            if " serving " in text:
                return int(text.split("serving ", 1)[1].split("http://127.0.0.1:", 1)[1].split(" ", 1)[0])
            if self.proc.poll() is not None:
                raise AssertionError(f"the server exited with {self.proc.returncode}:\n{text}")
            time.sleep(0.1)
        raise AssertionError(f"the server did not start serving:\n{self.log_path.read_text()}")

    def request(self, method: str, path: str, body=None, headers=None):
        """(status, headers, body bytes); ``body`` a dict is sent as JSON, bytes as they are."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=HTTP_TIMEOUT_S)
        try:
            data = json.dumps(body).encode() if isinstance(body, dict) else body
            conn.request(method, path, body=data, headers=headers or {})
            resp = conn.getresponse()
            return resp.status, dict(resp.getheaders()), resp.read()
        finally:
            conn.close()

    def generate(self, **body):
        status, headers, data = self.request("POST", "/generate", body)
        return status, headers, json.loads(data) if data else None

    def generate_admitted(self, tries: int = 5, **body):
        """Generate as a polite client does: on 429, wait the Retry-After it was given and try again."""
        for _ in range(tries):
            status, headers, out = self.generate(**body)
            if status != 429:
                return status, headers, out
            time.sleep(int(headers["Retry-After"]))
        raise AssertionError(f"still refused after {tries} tries")

    def metrics(self) -> dict:
        status, _, data = self.request("GET", "/metrics")
        assert status == 200
        return {f.name: f for f in text_string_to_metric_families(data.decode())}

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def _value(families, column, **labels) -> float:
    metric = CATALOG[column]
    # The parser names a counter's family without its _total; the sample keeps it.
    family = families[metric.name.removesuffix("_total") if metric.type == "counter" else metric.name]
    name = metric.name
    for s in family.samples:
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    raise AssertionError(f"no sample {name} {labels}")


@pytest.fixture(scope="module")
def traces():
    receiver = Traces()
    yield receiver
    receiver.close()


# The served instance's admission limits (the burst test reasons from them).
MAX_QUEUE, RATE_PER_S, BURST = 4, 30, 6


@pytest.fixture(scope="module")
def served(tmp_path_factory, traces):
    # Limits sized to be exceeded: at most 4 in a batch, 4 waiting, 30 requests/s in bursts of 6.
    server = Served(tmp_path_factory.mktemp("served"), "--max-num-seqs", 4, "--max-queue", MAX_QUEUE,
                    "--rate", RATE_PER_S, "--burst", BURST, "--otlp-endpoint", traces.url,
                    env={"OTEL_BSP_SCHEDULE_DELAY": "200"})
    yield server
    server.stop()


def test_a_prompt_comes_back_as_text_tokens_and_timings(served):
    status, _, out = served.generate_admitted(prompt="The GPU is", max_tokens=8, priority="vip")
    assert status == 200
    assert out["output_tokens"] == len(out["tokens"]) == 8 and out["finish_reason"] == "length"
    assert out["prompt_tokens"] == len(b"The GPU is") + 1  # bytes after BOS
    t = out["timings"]
    assert 0 <= t["queue_s"] <= t["ttft_s"] <= t["e2e_s"] and t["tpot_s"] > 0
    assert t["prefill_s"] > 0 and t["queue_s"] + t["prefill_s"] == pytest.approx(t["ttft_s"])


def test_a_streamed_generation_sends_one_line_per_token_then_the_result(served):
    status, headers, data = served.request("POST", "/generate", {"prompt": "hi", "max_tokens": 5, "stream": True})
    assert status == 200 and headers["Content-Type"] == "application/x-ndjson"
    lines = [json.loads(x) for x in data.decode().splitlines()]
    assert [x["token"] for x in lines[:-1]] == lines[-1]["tokens"] and len(lines) == 6
    assert lines[-1]["done"] is True


def test_a_client_that_hangs_up_mid_stream_stops_its_generation_and_frees_its_kv(served):
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=HTTP_TIMEOUT_S)
    conn.request("POST", "/generate", body=json.dumps({"prompt": "a long answer please", "max_tokens": 900,
                                                         "stream": True, "ignore_eos": True}))
    resp = conn.getresponse()
    assert resp.status == 200 and json.loads(resp.readline())  # the first token arrived: it runs
    tokens_before = _value(served.metrics(), M.generation_tokens_total)
    conn.close()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        health = json.loads(served.request("GET", "/health")[2])
        if health["running"] == 0 and health["in_flight"] == 0:
            break
        time.sleep(0.05)
    assert health["running"] == 0 and health["in_flight"] == 0
    families = served.metrics()
    assert _value(families, M.engine_kv_reserved_bytes) == 0
    assert _value(families, M.generation_tokens_total) - tokens_before < 890  # stopped long before its 900


@pytest.mark.parametrize("body,message", [
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "JSON object"),
    ({"prompt": 42, "max_tokens": 4}, "prompt must be a string"),
    ({"prompt": "x", "max_tokens": "4"}, "max_tokens must be a int"),
    ({"prompt": "x", "max_tokens": True}, "max_tokens must be a int"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens must be positive"),
    ({"prompt": "x", "max_tokens": -3}, "max_tokens must be positive"),
    ({"prompt": "x", "max_tokens": 5000}, "exceeds the context"),
    ({"prompt": "x", "max_tokens": 4, "priority": "gold"}, "unknown priority"),
    ({"prompt": "x", "max_tokens": 4, "temperature": 0.7}, "unknown fields temperature"),
    ({"max_tokens": 4}, "prompt is required"),
    ({"prompt": "x"}, "max_tokens is required"),
    (b'{"prompt": "' + b"x" * (2 << 20) + b'", "max_tokens": 4}', "at most"),
    (None, "at most"),
], ids=["invalid-json", "not-an-object", "prompt-type", "max-tokens-type", "max-tokens-bool", "max-tokens-zero",
        "max-tokens-negative", "beyond-context", "unknown-priority", "unknown-field", "no-prompt", "no-max-tokens",
        "oversized-body", "oversized-declared-length"])
def test_a_bad_request_gets_400_with_a_message_and_the_server_keeps_serving(served, body, message):
    if body is None:  # a client that declares a huge body is refused before it sends any of it
        conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=HTTP_TIMEOUT_S)
        conn.putrequest("POST", "/generate")
        conn.putheader("Content-Length", str(1 << 30))
        conn.endheaders()
        resp = conn.getresponse()
        status, data = resp.status, resp.read()
        conn.close()
    else:
        status, _, data = served.request("POST", "/generate", body, {"Content-Type": "application/json"})
    assert status == 400
    assert message in json.loads(data)["error"]
    status, _, out = served.generate_admitted(prompt="still there?", max_tokens=2)
    assert status == 200 and out["output_tokens"] == 2


ROUTES = {"/generate": "POST", "/metrics": "GET, HEAD", "/health": "GET, HEAD"}
WRONG_METHODS = [(path, method) for path, allow in ROUTES.items()
                 for method in ("GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS") if method not in allow]


@pytest.mark.parametrize("path, method", WRONG_METHODS, ids=[f"{m}-{p}" for p, m in WRONG_METHODS])
def test_a_route_asked_with_another_method_answers_405_with_allow_and_a_json_error(served, path, method):
    body = b'{"prompt": "x", "max_tokens": 2}' if method in ("PUT", "PATCH", "POST") else None
    status, headers, data = served.request(method, path, body, {"Content-Type": "application/json"})
    assert status == 405 and headers["Allow"] == ROUTES[path]
    if method == "HEAD":
        assert data == b""
    else:
        assert headers["Content-Type"] == "application/json"
        assert json.loads(data)["error"] == f"{path} answers {ROUTES[path].replace(', ', ' and ')}, not {method}"
    status, _, out = served.generate_admitted(prompt="still there?", max_tokens=2)
    assert status == 200 and out["output_tokens"] == 2


def test_head_is_get_without_a_body_and_an_unknown_method_or_path_is_a_json_error(served):
    status, headers, data = served.request("HEAD", "/health")
    assert status == 200 and data == b"" and int(headers["Content-Length"]) > 0
    status, headers, data = served.request("BREW", "/generate")
    assert status == 501 and headers["Content-Type"] == "application/json" and json.loads(data)["error"]
    status, _, data = served.request("DELETE", "/nowhere")
    assert status == 404 and "no such path /nowhere; try POST /generate, GET /metrics, GET /health" in json.loads(
        data)["error"]


def test_under_overload_the_excess_gets_429_with_retry_after_and_every_accepted_request_completes(served):
    before = served.metrics()
    rejected_before = _value(before, M.engine_requests_rejected_total)
    finished_before = _value(before, M.engine_requests_finished_total)
    sent = 120

    def one(i):
        return served.generate(prompt=f"request {i} of the burst", max_tokens=12, priority="batch", ignore_eos=True)

    # The tests before this one spend tokens up to the moment it starts: let the bucket fill up
    # (a wait for the bucket's own refill time, not a limit on anyone's speed).
    time.sleep(BURST / RATE_PER_S + 0.1)
    overflows_before = listen_overflows()
    with ThreadPoolExecutor(max_workers=16) as pool:
        results = list(pool.map(one, range(sent)))
    # The burst is answered by the admission control, not by the kernel: a listen queue that
    # overflows drops connections and, with SYN cookies, resets some (the tests run one at a time).
    if overflows_before is not None:
        assert listen_overflows() == overflows_before
    statuses = [s for s, _, _ in results]
    accepted = [out for s, _, out in results if s == 200]
    refused = [(h, out) for s, h, out in results if s == 429]
    assert not [s for s in statuses if s >= 500]
    assert len(accepted) + len(refused) == sent
    assert refused, "a burst of 120 from 16 clients against 30/s and a queue of 4 must be refused in part"
    # A full bucket and an idle engine take at least the first min(BURST, MAX_QUEUE) arrivals; more only
    # as fast as the engine moves queued requests into its batch, which is the machine's speed.
    assert len(accepted) >= min(BURST, MAX_QUEUE)
    assert all((out["finish_reason"], out["output_tokens"]) == ("length", 12) for out in accepted)
    assert all(int(h["Retry-After"]) >= 1 and "retry later" in out["error"] for h, out in refused)
    status, _, health = served.request("GET", "/health")
    assert status == 200 and json.loads(health)["state"] == "THROTTLING"
    after = served.metrics()
    assert _value(after, M.engine_requests_rejected_total) - rejected_before == len(refused)
    assert _value(after, M.engine_requests_finished_total) - finished_before == len(accepted)
    assert _value(after, M.engine_serving_state, state="throttling") == 1.0


def test_metrics_parse_as_prometheus_text_in_vllms_dialect_with_gpudiags_engine_metrics(served):
    assert served.generate_admitted(prompt="count me", max_tokens=3)[0] == 200
    families = served.metrics()
    names = {CATALOG[c].name.removesuffix("_total") if CATALOG[c].type == "counter" else CATALOG[c].name: c
             for c in CATALOG}
    for column in (M.num_requests_running, M.num_requests_waiting, M.kv_cache_usage_perc, M.num_preemptions_total,
                   M.prompt_tokens_total, M.generation_tokens_total, M.time_to_first_token_seconds,
                   M.inter_token_latency_seconds, M.e2e_request_latency_seconds, M.request_queue_time_seconds,
                   M.request_prefill_time_seconds,
                   M.engine_kv_evictions_total, M.engine_recomputed_tokens_total, M.engine_serving_state,
                   M.engine_model_info, M.process_torch_allocated_bytes, M.process_torch_reserved_bytes,
                   M.process_gpu_memory_bytes):
        assert column in names.values() and any(names.get(f) == column for f in families), column
    assert all(CATALOG[c].name.startswith(VLLM_PREFIX) for c in (M.num_requests_running, M.kv_cache_usage_perc,
                                                                  M.time_to_first_token_seconds))
    ttft = families[CATALOG[M.time_to_first_token_seconds].name]
    assert ttft.type == "histogram"
    count = [s.value for s in ttft.samples if s.name.endswith("_count")][0]
    assert count >= 1
    assert _value(families, M.generation_tokens_total) >= 3
    (info,) = families[CATALOG[M.engine_model_info].name].samples
    assert info.labels["model"] == "tiny"
    assert info.labels["fingerprint"] == build_model(PRESETS["tiny"], seed=0).fingerprint().sha256
    white = _value(families, M.process_torch_allocated_bytes)
    grey = _value(families, M.process_torch_reserved_bytes)
    black = _value(families, M.process_gpu_memory_bytes)
    assert 0 < white <= grey < black


def test_clients_that_hang_up_early_are_no_traceback_and_the_server_keeps_serving(served):
    # A scraper that times out and closes (the agent's engine probe under load) resets the
    # connection; the server meets that reading the request or writing the answer.
    for _ in range(20):
        s = socket.create_connection(("127.0.0.1", served.port), timeout=HTTP_TIMEOUT_S)
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with a reset
        s.close()
    assert served.metrics()  # still serving
    assert "Traceback" not in served.log_path.read_text()


def test_the_agents_engine_probe_reads_the_server_as_it_reads_a_vllm(served):
    assert served.generate_admitted(prompt="scrape me", max_tokens=4)[0] == 200
    probe = EngineScrapeProbe(f"http://127.0.0.1:{served.port}/metrics")
    (frame,) = probe.sample(time.time())
    (row,) = frame.rows
    families = served.metrics()
    assert row[M.generation_tokens_total] == _value(families, M.generation_tokens_total)
    assert row[M.engine_kv_capacity_bytes] == _value(families, M.engine_kv_capacity_bytes)
    assert row[M.num_requests_running] == 0


def test_the_serving_process_publishes_its_memory_and_the_torch_probe_reads_it(served):
    report = served.runtime_dir / f"torch-{served.proc.pid}.json"
    deadline = time.monotonic() + 10
    while not report.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert report.exists()
    probe = TorchProbe(runtime_dirs=[str(served.runtime_dir)])
    (frame,) = probe.sample(time.time())
    (row,) = [r for r in frame.rows if r["pid"] == served.proc.pid]
    families = served.metrics()
    assert row[M.process_torch_reserved_bytes] == _value(families, M.process_torch_reserved_bytes)
    assert row[M.process_torch_allocated_bytes] > 0 and row["gpu"] == 0
    assert probe.status()["available"]


def test_each_request_is_a_trace_of_queued_prefill_and_decode_spans(served, traces):
    status, _, out = served.generate_admitted(prompt="trace me", max_tokens=6)
    assert status == 200
    spans = traces.wait_for(lambda spans: any(
        s.name == "generate" and any(a.key == "gpudiag.request_id" and a.value.int_value == out["id"]
                                     for a in s.attributes) for s in spans))
    (root,) = [s for s in spans if s.name == "generate" and any(
        a.key == "gpudiag.request_id" and a.value.int_value == out["id"] for a in s.attributes)]
    children = [s for s in spans if s.trace_id == root.trace_id and s.parent_span_id == root.span_id]
    assert sorted(s.name for s in children) == ["decode", "prefill", "queued"]
    (decode,) = [s for s in children if s.name == "decode"]
    # The first token comes from the prefill, every other from one decode step.
    assert [e.name for e in decode.events] == ["decode_step"] * (out["output_tokens"] - 1)
    assert root.start_time_unix_nano <= decode.start_time_unix_nano <= decode.end_time_unix_nano \
        <= root.end_time_unix_nano


def test_sigterm_mid_load_drains_every_in_flight_request_and_exits_0(tmp_path):
    # The sim device paces each step to the cost model's time (a 7B model's decode step of
    # ~10 ms, slowed 5x): ten requests of 30 tokens in batches of 4 stay in flight for
    # seconds, however busy this machine is, and cost it no CPU.
    server = Served(tmp_path, "--device", "sim", "--model-config", "llama-7b", "--sim-speed", 0.2,
                    "--max-num-seqs", 4, "--drain-timeout", 120)
    try:
        n = 10
        with ThreadPoolExecutor(max_workers=n) as pool:
            futures = [pool.submit(server.generate, prompt=f"long generation {i}", max_tokens=30, ignore_eos=True)
                       for i in range(n)]
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                _, _, health = server.request("GET", "/health")
                if json.loads(health)["in_flight"] == n:
                    break
                time.sleep(0.02)
            assert json.loads(health)["in_flight"] == n, (health, [f.result()[:3:2] for f in futures if f.done()])
            server.proc.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            status, _, late = server.generate(prompt="too late", max_tokens=4)
            assert status == 503 and "DRAINING" in late["error"]
            results = [f.result() for f in futures]
        assert [s for s, _, _ in results] == [200] * n
        assert all(out["output_tokens"] == 30 for _, _, out in results)
        assert server.proc.wait(timeout=60) == 0
        assert "every accepted request was answered" in server.log_path.read_text()
        assert not list(server.runtime_dir.glob("torch-*.json"))  # the report goes with the process
    finally:
        server.stop()


@pytest.mark.parametrize(("args", "message"), [
    (["--device", "tpu"], "unknown device"),
    (["--port", "99999"], "--port must be in 0..65535"),
    (["--port", "0", "--model-config", "/nonexistent.json"], "cannot read model config"),
    (["--port", "0", "--kv-strategy", "foo"], "unknown KV strategy"),
    (["--port", "0", "--block-size", "0"], "block size must be a positive"),
    (["--port", "0", "--checkpoint", "/nonexistent.safetensors"], "cannot read /nonexistent.safetensors"),
    (["--port", "0", "--device", "sim", "--kv-capacity-mb", "nan"], "--kv-capacity-mb must be a positive number"),
    (["--port", "0", "--device", "sim", "--sim-speed", "nan"], "sim_speed must be a positive number"),
    (["--port", "0", "--device", "sim", "--sim-speed", "inf"], "sim_speed must be a positive number"),
    (["--port", "0", "--device", "sim", "--kv-capacity-mb", "inf"], "--kv-capacity-mb must be a positive number"),
    # 1 EiB: host tensors of that size cannot be made on any machine this runs on
    (["--port", "0", "--device", "cpu", "--kv-capacity-mb", str(2**40)], "more than this host's available memory"),
])
def test_bad_serve_options_are_one_error_line_and_exit_2(cli, args, message):
    out = cli("engine", "serve", *args, timeout=120)
    assert out.returncode == 2, out.stderr
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("gpudiag: error:")]
    assert len(errors) == 1 and message in errors[0], out.stderr
    assert "Traceback" not in out.stderr and out.stdout == ""


@pytest.mark.parametrize("dialect, path, name", [("trtllm", "/prometheus/metrics", "trtllm_"),
                                                 ("nim", "/v1/metrics", "num_requests_running")])
def test_a_dialect_is_served_where_its_engine_serves_it(tmp_path, dialect, path, name):
    """A scraper configured for trtllm-serve or NIM finds the page at that engine's path; /metrics still answers."""
    server = Served(tmp_path, "--device", "sim", "--model-config", "llama-7b", "--dialect", dialect)
    try:
        status, _, body = server.generate(prompt="hello", max_tokens=4)
        assert status == 200, body
        pages = {}
        for p in (path, "/metrics"):
            status, _, text = server.request("GET", p)
            assert status == 200, (p, text[:200])
            pages[p] = text.decode()
        assert name in pages[path] and "vllm:" not in pages[path]
        assert pages[path].split("\n# EOF")[0].count("\n") > 10
        status, _, text = server.request("GET", "/nowhere/metrics")
        assert status == 404
    finally:
        server.stop()
