"""The reference engine over HTTP: /generate, /metrics (vLLM's dialect or --dialect), /health, admission, drain.

Threads: the HTTP server answers each connection on its own thread; one
engine thread owns the :class:`~.llm_engine.LLMEngine` and runs its steps.
A request is checked (400 with a message when malformed or impossible),
offered to admission control (:mod:`.admission`: 503 while WARMING or
DRAINING, 429 with ``Retry-After`` beyond the bounded queue or the token
bucket), then handed to the engine thread, which feeds it to the scheduler
and reports its tokens back. The handler waits for them and answers with
the whole result, or streams one JSON line per token (``"stream": true``).

SIGTERM (:meth:`EngineServer.request_drain`) turns the state to DRAINING:
new requests get 503, everything accepted runs to its end and is answered,
then the server stops and :meth:`EngineServer.run` returns 0; 1 when the
drain deadline passed with requests still open (they are answered 503).

``/metrics`` comes from the engine's frames through the agent's own
Prometheus collector (:mod:`gpudiag.agent.prom_exporter`): every name from
the catalog, vLLM-dialect series included. The serving process publishes its
white and grey memory through :func:`gpudiag.probes.torch_reporter.instrument`
(cpu and sim: from the allocator model; cuda: torch's own allocator), so the
agent's torch probe finds it like any instrumented process.
"""

from __future__ import annotations

import json
import logging
import math
import queue
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from gpudiag.catalog import M
from gpudiag.errors import GpudiagError
from gpudiag.exposition import LatestFrames, encode_text, log_request_failure
from gpudiag.frames import Frame
from gpudiag.probes import engine_dialects
from gpudiag.reference_engine.core.sequence import TIERS, Status
from gpudiag.reference_engine.model.llm_engine import ENGINE_NAME, LLMEngine, LLMEngineConfig
from gpudiag.reference_engine.serving.admission import AdmissionConfig, AdmissionController, ServingState, Verdict

log = logging.getLogger("gpudiag.engine")

DEFAULT_PORT = 8000
# A prompt of the longest context the presets take (32k tokens) as JSON is ~100 KiB;
# a body beyond 1 MiB is not a prompt.
MAX_BODY_BYTES = 1 << 20
# A bounded queue by default: beyond this many waiting requests, 429 instead of an ever
# longer wait (SCENARIOS.md §5); the rate limit is off unless asked for.
DEFAULT_MAX_QUEUE = 128
DEFAULT_PRIORITY = "internal"
# Kubernetes' default termination grace period is 30 s: finish in-flight work inside it.
DEFAULT_DRAIN_TIMEOUT_S = 25.0
# A body up to this many times the limit is read and dropped before the 400 (the client
# sees the answer); a larger one is refused unread and the connection closed.
OVERSIZE_DRAIN_FACTOR = 16
# A client that opened a connection and sends nothing must not hold a thread forever.
CLIENT_READ_TIMEOUT_S = 10.0
_REQUEST_FIELDS = {"prompt": str, "max_tokens": int, "priority": str, "stream": bool, "ignore_eos": bool}
# Each path and the methods it answers. Another method on one of them is 405 with an Allow header;
# HEAD is GET without the body.
ROUTES = {"/generate": ("POST",), "/metrics": ("GET", "HEAD"), "/health": ("GET", "HEAD")}


@dataclass
class ServerConfig:
    """Where the server listens, what it admits, where its telemetry goes."""

    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    engine: LLMEngineConfig = field(default_factory=LLMEngineConfig)
    admission: AdmissionConfig = field(default_factory=lambda: AdmissionConfig(max_queue=DEFAULT_MAX_QUEUE))
    max_body_bytes: int = MAX_BODY_BYTES
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S
    otlp_endpoint: str | None = None
    runtime_dir: str | None = None  # the reporter's directory (default: the torch reporter's)
    reporter_interval_s: float = 1.0
    node: str = "localhost"
    dialect: str | None = None  # /metrics in another engine's names (reference_engine.serving.dialect_metrics)

    def validate(self) -> None:
        """Raise GpudiagError on settings no server could run with."""
        if not 0 <= self.port <= 65535:
            raise GpudiagError(f"--port must be in 0..65535, got {self.port}")
        if self.max_body_bytes <= 0:
            raise GpudiagError("max_body_bytes must be positive")
        if not self.drain_timeout_s > 0:
            raise GpudiagError("the drain timeout must be positive")
        self.engine.validate()
        self.admission.validate()
        if self.otlp_endpoint:
            from gpudiag.reference_engine.serving.tracing import traces_url

            traces_url(self.otlp_endpoint)


class BadRequest(Exception):
    """A request the server answers with 400 and this message."""


def parse_generate(body: bytes) -> dict:
    """The fields of a /generate body (prompt, max_tokens, priority, stream, ignore_eos); BadRequest when malformed."""
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, ValueError) as exc:
        raise BadRequest(f"the body is not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise BadRequest(f"the body must be a JSON object, got {type(data).__name__}")
    unknown = sorted(set(data) - set(_REQUEST_FIELDS))
    if unknown:
        raise BadRequest(f"unknown fields {', '.join(unknown)}; expected {', '.join(_REQUEST_FIELDS)}")
    for name, kind in _REQUEST_FIELDS.items():
        if name in data and (not isinstance(data[name], kind) or (kind is int and isinstance(data[name], bool))):
            raise BadRequest(f"{name} must be a {'string' if kind is str else kind.__name__}, "
                             f"got {type(data[name]).__name__}")
    if "prompt" not in data or not data["prompt"]:
        raise BadRequest("prompt is required (a non-empty string)")
    if "max_tokens" not in data:
        raise BadRequest("max_tokens is required (a positive integer)")
    if data["max_tokens"] <= 0:
        raise BadRequest(f"max_tokens must be positive, got {data['max_tokens']}")
    priority = data.get("priority", DEFAULT_PRIORITY)
    if priority not in TIERS:
        raise BadRequest(f"unknown priority {priority!r}; valid: {', '.join(TIERS)}")
    return {"prompt": data["prompt"], "max_tokens": data["max_tokens"], "tier": TIERS.index(priority),
            "stream": data.get("stream", False), "ignore_eos": data.get("ignore_eos", False)}


class _Pending:
    """One accepted request between its handler thread and the engine thread."""

    __slots__ = ("events", "ignore_eos", "max_tokens", "prompt_ids", "seq", "stream", "tier")

    def __init__(self, prompt_ids: list[int], max_tokens: int, tier: int, stream: bool, ignore_eos: bool):
        self.prompt_ids = prompt_ids
        self.max_tokens = max_tokens
        self.tier = tier
        self.stream = stream
        self.ignore_eos = ignore_eos
        self.seq = None
        # ("token", id) while streaming, then ("done", result) or ("error", status, message)
        self.events: queue.SimpleQueue = queue.SimpleQueue()


def result_of(seq) -> dict:
    """The /generate answer for a finished sequence."""
    from gpudiag.reference_engine.model.tokenizer import ByteTokenizer

    timings = seq.latencies() if seq.first_token_s is not None else {}
    return {"id": seq.seq_id, "text": ByteTokenizer().decode(seq.output_ids), "tokens": seq.output_ids,
            "finish_reason": seq.finish_reason, "prompt_tokens": seq.prompt_tokens,
            "output_tokens": seq.generated, "preemptions": seq.preemptions,
            "timings": {"queue_s": timings.get(M.request_queue_time_seconds),
                        "prefill_s": timings.get(M.request_prefill_time_seconds),
                        "ttft_s": timings.get(M.time_to_first_token_seconds),
                        "tpot_s": timings.get(M.inter_token_latency_seconds),
                        "e2e_s": timings.get(M.e2e_request_latency_seconds)}}


class _HTTPServer(ThreadingHTTPServer):
    # socketserver listens with a backlog of 5: a burst of clients overflows it and the
    # kernel resets the connections it cannot queue, where the admission control is meant to
    # answer them with 429. Serving frontends listen with hundreds (uvicorn: 2048).
    request_queue_size = 1024

    def handle_error(self, request, client_address):
        # Called from socketserver's own except block: the exception is the current one.
        log_request_failure(log, client_address, sys.exc_info()[1])


class EngineServer:
    """The engine, its admission control and its HTTP front, with a drain on request."""

    def __init__(self, cfg: ServerConfig, *, clock=time.monotonic):
        cfg.validate()
        self.cfg = cfg
        self.clock = clock
        self.admission = AdmissionController(cfg.admission, now=clock(), state=ServingState.WARMING)
        self.engine: LLMEngine | None = None
        self.latest = LatestFrames(cfg.node, export_engine_dialect=True)
        from gpudiag.reference_engine.serving.dialect_metrics import parse_spec, speaking_registry

        spec = parse_spec(cfg.dialect)
        self.registry = speaking_registry(self.latest, spec)
        # The dialect's engine serves its page at its own path (trtllm-serve /prometheus/metrics, NIM
        # /v1/metrics): the same page answers there too, so a scraper configured for the engine finds it.
        dialect_paths = {engine_dialects.get(spec).metrics_path} if isinstance(spec, str) else set()
        self.metrics_paths = {"/metrics"} | dialect_paths
        self.tracer = None
        self.reporter = None
        self.model_info: dict = {}
        self.lost = 0
        self._lock = threading.Lock()  # the engine: its steps and the reads of its figures
        self._cond = threading.Condition()  # the inbox and the open-request count
        self._inbox: list[_Pending] = []
        self._gone: list[_Pending] = []  # accepted requests whose client went away
        self._by_seq: dict[int, _Pending] = {}
        self._open = 0  # accepted and not yet answered
        self._arrived = 0  # reached admission (accepted or refused with 429)
        self._stop_engine = False
        self._drain = threading.Event()
        self._engine_thread: threading.Thread | None = None
        self.httpd = _HTTPServer((cfg.host, cfg.port), _handler_class(self))
        self.httpd.daemon_threads = True
        self._http_thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """The base URL the server listens on."""
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    # -- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        """Listen (answering WARMING), build and warm the engine, then serve."""
        self._http_thread = threading.Thread(target=self.httpd.serve_forever, name="gpudiag-engine-http",
                                             daemon=True)
        self._http_thread.start()
        log.info("listening on %s (warming)", self.url)
        engine = LLMEngine(self.cfg.engine, clock=self.clock, node=self.cfg.node)
        engine.warm_up()
        self.model_info = {"model": engine.model_config.name, "fingerprint": engine.fingerprint(),
                           M.engine_model_info: 1}
        if self.cfg.otlp_endpoint:
            from gpudiag.reference_engine.serving.tracing import RequestTracer

            self.tracer = RequestTracer(self.cfg.otlp_endpoint, clock=self.clock,
                                        resource_attributes={"host.name": self.cfg.node})
            engine.observer = self.tracer
        with self._lock:
            self.engine = engine
        self._start_reporter()
        self._engine_thread = threading.Thread(target=self._engine_loop, name="gpudiag-engine-loop", daemon=True)
        self._engine_thread.start()
        self.admission.ready(self.clock())
        log.info("serving %s on %s (device %s, KV %s, %d bytes; fingerprint %s)", engine.model_config.name,
                 self.url, self.cfg.engine.device, engine.kv.name, engine.kv.capacity_bytes,
                 self.model_info["fingerprint"][:12])

    def _start_reporter(self) -> None:
        from gpudiag.probes.torch_reporter import instrument

        source = None if self.cfg.engine.device == "cuda" else self.engine.reporter_entries
        self.reporter = instrument(runtime_dir=self.cfg.runtime_dir, interval_s=self.cfg.reporter_interval_s,
                                   stats_source=source)
        if self.reporter is not None:
            log.info("publishing allocator figures to %s", self.reporter.path)

    def request_drain(self) -> None:
        """Begin draining (safe from a signal handler): no new requests, in-flight ones finish."""
        self._drain.set()

    def run(self) -> int:
        """Start, serve until a drain is requested, drain; 0 when no accepted request was lost."""
        try:
            self.start()
            self._drain.wait()
            return self._finish_drain()
        finally:
            self.close()

    def _finish_drain(self) -> int:
        with self._cond:
            self.admission.drain(self.clock())
        log.info("draining: %d requests in flight", self._open)
        deadline = self.clock() + self.cfg.drain_timeout_s
        with self._cond:
            self._cond.notify_all()
            while self._open and self.clock() < deadline:
                self._cond.wait(timeout=0.05)
            self.lost = self._open
        if self.lost:
            log.error("drain deadline of %g s passed with %d requests unanswered", self.cfg.drain_timeout_s,
                      self.lost)
            return 1
        log.info("drained: every accepted request was answered")
        return 0

    def close(self) -> None:
        """Stop the engine thread and the HTTP server; answer 503 to anything still open; stop telemetry."""
        with self._cond:
            self._stop_engine = True
            self._cond.notify_all()
            for p in list(self._by_seq.values()) + self._inbox:
                p.events.put(("error", 503, "the server stopped before this request finished"))
        if self._engine_thread is not None:
            self._engine_thread.join(timeout=5.0)
        if self._http_thread is not None:  # shutdown() waits for serve_forever: only if it ran
            self.httpd.shutdown()
        self.httpd.server_close()
        if self.reporter is not None:
            self.reporter.stop()
            self.reporter = None
        if self.tracer is not None:
            self.tracer.shutdown()
            self.tracer = None

    # -- the engine thread ------------------------------------------------------------------
    def _engine_loop(self) -> None:
        engine = self.engine
        while True:
            with self._cond:
                while not self._inbox and not self._gone and not engine.has_unfinished and not self._stop_engine:
                    self._cond.wait()
                if self._stop_engine:
                    return
                new, self._inbox = self._inbox, []
                gone, self._gone = self._gone, []
            try:
                with self._lock:
                    for p in gone:
                        if p.seq is not None and self._by_seq.pop(p.seq.seq_id, None) is not None:
                            engine.abort(p.seq)
                    for p in new:
                        if any(p is g for g in gone):
                            continue  # gone before it reached the engine
                        try:
                            p.seq = engine.add_request(p.prompt_ids, p.max_tokens, p.tier, kind="http",
                                                       stop_at_eos=not p.ignore_eos)
                        except GpudiagError as exc:
                            p.events.put(("error", 400, str(exc)))
                            continue
                        self._by_seq[p.seq.seq_id] = p
                    seqs = engine.step() if engine.has_unfinished else []
                    rows = engine.take_request_rows()
            except Exception as exc:  # noqa: BLE001 - a failed step is answered, then the server drains
                log.exception("engine step failed")
                with self._cond:
                    for p in list(self._by_seq.values()) + new:
                        p.events.put(("error", 500, f"engine step failed: {type(exc).__name__}: {exc}"))
                    self._by_seq.clear()
                self.request_drain()
                return
            if rows:
                self.latest.update([Frame("request", time.time(), rows)])
            for s in seqs:
                p = self._by_seq.get(s.seq_id)
                if p is None:
                    continue
                if s.status in (Status.FINISHED, Status.FAILED):
                    del self._by_seq[s.seq_id]
                    if s.finish_reason == "kv_capacity":
                        p.events.put(("error", 503, "the request could not get KV-cache memory; retry later"))
                    else:
                        if p.stream:
                            p.events.put(("token", s.token_ids[-1]))
                        p.events.put(("done", result_of(s)))
                elif p.stream:
                    p.events.put(("token", s.token_ids[-1]))

    # -- the door ---------------------------------------------------------------------------
    def queue_depth(self) -> int:
        """Accepted requests not yet running: the inbox and the scheduler's waiting queue."""
        engine = self.engine
        return len(self._inbox) + (len(engine.sched.waiting) if engine is not None else 0)

    def admit(self, parsed: dict) -> tuple[_Pending | None, int, str, float | None]:
        """Check and admit one parsed request: (pending, 200, "", None) or (None, status, message, retry_after)."""
        engine = self.engine
        prompt_ids: list[int] = []
        if engine is not None:
            try:
                prompt_ids = engine.tokenizer.encode(parsed["prompt"])
                engine.check_request(prompt_ids, parsed["max_tokens"])
            except GpudiagError as exc:
                return None, 400, str(exc), None
        with self._cond:
            now = self.clock()
            if self._drain.is_set():
                self.admission.drain(now)
            verdict = self.admission.offer(now, self.queue_depth())
            if verdict is Verdict.NOT_SERVING:
                state = self.admission.state_at(now)
                return None, 503, f"the server is {state.name} and takes no new requests", None
            self._arrived += 1
            if verdict is not Verdict.ACCEPTED:
                why = "the queue is full" if verdict is Verdict.QUEUE_FULL else "over the request rate limit"
                return None, 429, f"{why}; retry later", self.admission.retry_after_s(now)
            p = _Pending(prompt_ids, parsed["max_tokens"], parsed["tier"], parsed["stream"], parsed["ignore_eos"])
            self._inbox.append(p)
            self._open += 1
            self._cond.notify_all()
        return p, 200, "", None

    def client_gone(self, pending: _Pending) -> None:
        """The client of an accepted request went away: stop computing for it."""
        with self._cond:
            self._gone.append(pending)
            self._cond.notify_all()

    def answered(self) -> None:
        """An accepted request's answer was written (or its client went away)."""
        with self._cond:
            self._open -= 1
            self._cond.notify_all()

    # -- what the server publishes ------------------------------------------------------------
    def state(self) -> ServingState:
        """The serving state now."""
        with self._cond:
            if self._drain.is_set():
                self.admission.drain(self.clock())
            return self.admission.state_at(self.clock())

    def health(self) -> tuple[int, dict]:
        """HTTP status (200 while taking requests, else 503) and the body of /health."""
        state = self.state()
        engine = self.engine
        body = {"state": state.name, "in_flight": self._open}
        if engine is not None:
            body.update(running=len(engine.sched.running), waiting=len(engine.sched.waiting),
                        model=engine.model_config.name, device=self.cfg.engine.device)
        return (200 if state.accepts else 503), body

    def metrics_text(self) -> bytes:
        """The Prometheus text of /metrics (engine, serving state, allocator, request histograms)."""
        state = self.state()
        server_columns = {
            M.engine_serving_state: {s.value: int(s is state) for s in ServingState},
            M.engine_requests_rejected_total: self.admission.rejected_total,
            **self.model_info,
        }
        with self._lock:
            engine = self.engine
            if engine is None:
                frames = [Frame("engine", time.time(), [{"node": self.cfg.node, "gpu": 0, "engine": ENGINE_NAME,
                                                          **server_columns}])]
            else:
                frames = engine.frames()
                frames[0].rows[0].update(server_columns)
                frames[0].rows[0][M.engine_requests_arrived_total] = self._arrived
        self.latest.update(frames)
        return encode_text(self.registry)


def _handler_class(server: EngineServer):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "gpudiag-engine"
        timeout = CLIENT_READ_TIMEOUT_S

        def log_message(self, fmt, *args):
            log.debug("%s %s", self.address_string(), fmt % args)

        def _send(self, status: int, body: bytes, content_type: str, headers: dict | None = None) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
            # http.server's own refusals (a bad request line, an unknown method, headers too long)
            # answer in JSON like every other error here, not with an HTML page.
            self.close_connection = True
            self._error(code, message or self.responses.get(code, ("error",))[0])

        def _route(self) -> str | None:
            """The request's path when its method is one the path answers; else answer 404 or 405, None."""
            path = self.path.split("?", 1)[0]
            if path in server.metrics_paths:
                path = "/metrics"
            allowed = ROUTES.get(path)
            if allowed is None:
                self.close_connection = True
                routes = ", ".join(f"{methods[0]} {p}" for p, methods in ROUTES.items())
                self._error(404, f"no such path {path}; try {routes}")
                return None
            if self.command not in allowed:
                self.close_connection = True  # a body sent with it is not read
                self._error(405, f"{path} answers {' and '.join(allowed)}, not {self.command}",
                            {"Allow": ", ".join(allowed)})
                return None
            return path

        def do_HEAD(self):
            self.do_GET()

        def _not_allowed(self):
            self._route()  # no route answers this method: 404 or 405

        do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _not_allowed

        def _json(self, status: int, data: dict, headers: dict | None = None) -> None:
            self._send(status, json.dumps(data).encode(), "application/json", headers)

        def _error(self, status: int, message: str, headers: dict | None = None) -> None:
            self._json(status, {"error": message}, headers)

        def do_GET(self):
            path = self._route()
            if path == "/metrics":
                self._send(200, server.metrics_text(), "text/plain; version=0.0.4; charset=utf-8")
            elif path == "/health":
                status, body = server.health()
                self._json(status, body)

        def do_POST(self):
            if self._route() is None:
                return
            body = self._body()
            if body is None:
                return
            try:
                parsed = parse_generate(body)
            except BadRequest as exc:
                self._error(400, str(exc))
                return
            pending, status, message, retry_after = server.admit(parsed)
            if pending is None:
                headers = {"Retry-After": str(int(math.ceil(retry_after)))} if retry_after is not None else None
                self._error(status, message, headers)
                return
            try:
                self._answer(pending)
            except (BrokenPipeError, ConnectionResetError):
                log.debug("the client of a request went away before its answer")
                server.client_gone(pending)
            finally:
                server.answered()

        def _body(self) -> bytes | None:
            if self.headers.get("Transfer-Encoding"):
                self.close_connection = True
                self._error(400, "chunked request bodies are not accepted; send Content-Length")
                return None
            try:
                length = int(self.headers.get("Content-Length", ""))
            except ValueError:
                self.close_connection = True
                self._error(400, "Content-Length is required")
                return None
            if length < 0 or length > server.cfg.max_body_bytes:
                self.close_connection = True
                if length <= OVERSIZE_DRAIN_FACTOR * server.cfg.max_body_bytes:
                    # Read what was sent, so the client gets the answer and not a reset mid-upload.
                    left = length
                    while left > 0:
                        got = len(self.rfile.read(min(1 << 16, left)))
                        if not got:
                            break
                        left -= got
                self._error(400, f"the body is {length} bytes; at most {server.cfg.max_body_bytes} are accepted")
                return None
            return self.rfile.read(length)

        def _answer(self, pending: _Pending) -> None:
            if not pending.stream:
                event = pending.events.get()
                if event[0] == "done":
                    self._json(200, event[1])
                else:
                    self._error(event[1], event[2])
                return
            self.send_response(200)
            self.send_header("Content-Type", "application/x-ndjson")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            from gpudiag.reference_engine.model.tokenizer import StreamDecoder

            decoder = StreamDecoder()
            while True:
                event = pending.events.get()
                if event[0] == "token":
                    line = {"token": event[1], "text": decoder.push(event[1])}
                elif event[0] == "done":
                    line = {"done": True, **event[1]}
                else:
                    line = {"done": True, "error": event[2], "status": event[1]}
                self._chunk(json.dumps(line).encode() + b"\n")
                if event[0] != "token":
                    break
            self.wfile.write(b"0\r\n\r\n")

        def _chunk(self, data: bytes) -> None:
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()

    return Handler
