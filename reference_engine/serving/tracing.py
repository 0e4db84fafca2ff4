"""OpenTelemetry spans of the engine's requests, exported over OTLP/HTTP; off unless an endpoint is given.

One trace per request::

    generate            arrival -> last token (request id, tier, prompt/output tokens, finish reason)
    ├── queued          arrival -> first scheduled
    ├── prefill         each prefill step the request was in (recompute=true after a preemption)
    └── decode          first decode step -> last; an event "decode_step" per step (batch size)
    events on generate: "preempted" (its KV was evicted), "recompute" (its prefix prefilled again)

The engine calls the tracer's hooks only when one is installed, so with
tracing off a step costs one ``is None`` test. The hooks record times only;
spans are built when the request finishes (start and end times given
explicitly) and leave through the SDK's batch processor, off the engine
thread.
"""

from __future__ import annotations

import time
from urllib.parse import urlparse

from gpudiag.errors import GpudiagError
from gpudiag.reference_engine.core.sequence import TIERS
from gpudiag.reference_engine.model.llm_engine import EngineObserver, GenerationSequence

SERVICE_NAME = "gpudiag-engine"
# One event per decode step: a 4k-token generation must keep all of its steps
# (the SDK's default keeps 128 events a span).
MAX_SPAN_EVENTS = 8192


def traces_url(endpoint: str) -> str:
    """The traces URL of an OTLP/HTTP endpoint (a base URL such as http://127.0.0.1:4318, or the URL itself)."""
    parsed = urlparse(endpoint)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise GpudiagError(f"--otlp-endpoint {endpoint!r}: expected an http(s) URL such as http://127.0.0.1:4318")
    return endpoint.rstrip("/").removesuffix("/v1/traces") + "/v1/traces"


class _Record:
    __slots__ = ("decodes", "preempts", "prefills")

    def __init__(self):
        self.prefills: list[tuple[float, float, bool, int, int]] = []  # t0, t1, recompute, context, batch
        self.decodes: list[tuple[float, float, int]] = []  # t0, t1, batch
        self.preempts: list[float] = []


class RequestTracer(EngineObserver):
    """Builds each finished request's spans and exports them (``endpoint``: OTLP/HTTP collector)."""

    def __init__(self, endpoint: str, *, clock=time.monotonic, resource_attributes: dict | None = None):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import SpanLimits, TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        from gpudiag import __version__

        resource = Resource.create({"service.name": SERVICE_NAME, "service.version": __version__,
                                    **(resource_attributes or {})})
        self.provider = TracerProvider(resource=resource, span_limits=SpanLimits(max_events=MAX_SPAN_EVENTS))
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=traces_url(endpoint))))
        self.tracer = self.provider.get_tracer("gpudiag.reference_engine")
        # Engine times are on the monotonic clock; spans want Unix nanoseconds.
        self._offset_ns = time.time_ns() - int(clock() * 1e9)
        self._live: dict[int, _Record] = {}

    def _ns(self, t: float) -> int:
        return self._offset_ns + int(t * 1e9)

    def _record(self, seq) -> _Record:
        rec = self._live.get(seq.seq_id)
        if rec is None:
            rec = self._live[seq.seq_id] = _Record()
        return rec

    def on_step(self, kind, seqs, t0, t1):
        """Record the step against each of its sequences."""
        for s in seqs:
            rec = self._record(s)
            if kind == "prefill":
                rec.prefills.append((t0, t1, bool(rec.preempts), len(s.token_ids) - 1, len(seqs)))
            else:
                rec.decodes.append((t0, t1, len(seqs)))

    def on_preempt(self, seq, t):
        """Record the eviction."""
        self._record(seq).preempts.append(t)

    def on_finish(self, seq: GenerationSequence):
        """Emit the request's spans."""
        from opentelemetry import trace

        rec = self._live.pop(seq.seq_id, None) or _Record()
        end = seq.finish_s if seq.finish_s is not None else seq.arrival_s
        root = self.tracer.start_span("generate", start_time=self._ns(seq.arrival_s), attributes={
            "gpudiag.request_id": seq.seq_id, "gpudiag.tier": TIERS[seq.tier],
            "gpudiag.prompt_tokens": seq.prompt_tokens, "gpudiag.output_tokens": seq.generated,
            "gpudiag.preemptions": seq.preemptions, "gpudiag.finish_reason": seq.finish_reason or ""})
        ctx = trace.set_span_in_context(root)
        scheduled = seq.first_scheduled_s if seq.first_scheduled_s is not None else end
        self.tracer.start_span("queued", context=ctx, start_time=self._ns(seq.arrival_s)).end(self._ns(scheduled))
        for t in rec.preempts:
            root.add_event("preempted", timestamp=self._ns(t))
        for t0, t1, recompute, context, batch in rec.prefills:
            if recompute:
                root.add_event("recompute", {"gpudiag.tokens": context}, timestamp=self._ns(t0))
            span = self.tracer.start_span("prefill", context=ctx, start_time=self._ns(t0), attributes={
                "gpudiag.recompute": recompute, "gpudiag.tokens": context, "gpudiag.batch_size": batch})
            span.end(self._ns(t1))
        if rec.decodes:
            span = self.tracer.start_span("decode", context=ctx, start_time=self._ns(rec.decodes[0][0]),
                                          attributes={"gpudiag.steps": len(rec.decodes)})
            for t0, _, batch in rec.decodes:
                span.add_event("decode_step", {"gpudiag.batch_size": batch}, timestamp=self._ns(t0))
            span.end(self._ns(rec.decodes[-1][1]))
        root.end(self._ns(end))

    def shutdown(self) -> None:
        """Flush the spans still queued and stop the exporter."""
        self.provider.shutdown()
