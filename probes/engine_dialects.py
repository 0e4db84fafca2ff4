"""Every serving engine's metric dialect, mapped onto the catalog's engine vocabulary.

A serving engine names the same things its own way: vLLM's queue is
``vllm:num_requests_waiting``, SGLang's ``sglang:num_queue_reqs``, Triton's
``nv_trt_llm_request_metrics{request_type="waiting"}``. This module holds, per
engine, the series its own source declares (name, type, labels, histogram
buckets, with the source file cited above each table) and the catalog column
each one fills. What an engine does not export is listed in its ``lacks``
with the reason, so an analyzer that needs it reports the input as missing
(``analyzers.registry.coverage``) instead of guessing.

The vocabulary (:data:`VOCABULARY`) is the catalog's vLLM-dialect engine
metrics (queue, running, KV usage, preemptions, TTFT, inter-token latency,
tokens, prefix cache, queue/prefill/decode time) plus gpudiag's KV capacity in
tokens. Readers:

* :func:`detect` names the dialect of a scraped ``/metrics`` page;
* :func:`to_catalog` rewrites parsed families into catalog-named ones (the
  engine probe reads those as it reads vLLM);
* :func:`promql_mappings` gives ``investigate --prometheus`` the
  name -> column table with label conditions and unit factors;
* :func:`render` writes catalog-named exposition text in a dialect (the
  reference engine speaking SGLang, TensorRT-LLM...).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from gpudiag.catalog import CATALOG, COUNTER, GAUGE, HISTOGRAM, M

# --- the vocabulary -------------------------------------------------------------------------------

VOCABULARY: tuple[str, ...] = (
    M.num_requests_waiting, M.num_requests_running, M.kv_cache_usage_perc, M.engine_kv_capacity_tokens,
    M.num_preemptions_total, M.time_to_first_token_seconds, M.inter_token_latency_seconds,
    M.prompt_tokens_total, M.generation_tokens_total, M.prefix_cache_hits_total, M.prefix_cache_queries_total,
    M.request_queue_time_seconds, M.request_prefill_time_seconds, M.request_decode_time_seconds,
    M.e2e_request_latency_seconds,
)


@dataclass(frozen=True)
class Series:
    """One series an engine exports and the catalog column it fills.

    ``name`` is the family name as exposed (counters with their ``_total``);
    ``where`` selects the samples of a labelled family (``request_type="waiting"``);
    ``scale`` converts to the catalog's SI unit (a histogram's ``le`` bounds too);
    ``column`` None: the engine exports it and gpudiag reads none of it (listed for the record).
    """

    name: str
    type: str
    column: str | None
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()
    where: tuple[tuple[str, str], ...] = ()
    scale: float = 1.0
    note: str = ""


@dataclass(frozen=True)
class Dialect:
    """One engine's metric dialect."""

    name: str
    title: str
    source: str  # repo/path the names, labels and buckets were taken from
    metrics_path: str
    series: tuple[Series, ...]
    lacks: dict[str, str] = field(default_factory=dict)  # vocabulary column -> why the engine has none
    # Derived columns: column -> (numerator series name, denominator or factor series name, op)
    derived: tuple[tuple[str, str, str, str], ...] = ()
    read_only: bool = False  # a dialect gpudiag reads but the reference engine does not speak

    def by_name(self) -> dict[str, list[Series]]:
        out: dict[str, list[Series]] = {}
        for s in self.series:
            out.setdefault(s.name, []).append(s)
        return out

    def fills(self) -> set[str]:
        return {s.column for s in self.series if s.column} | {d[0] for d in self.derived}


def _s(name, type_, column, labels=(), buckets=(), where=(), scale=1.0, note="") -> Series:
    return Series(name, type_, column, tuple(labels), tuple(float(b) for b in buckets), tuple(where), scale, note)


def _cat(column, type_, labels=(), buckets=(), note="") -> Series:
    """A series under the name the catalog gives the column (vLLM's own: the catalog speaks vLLM's dialect)."""
    return _s(CATALOG[column].name, type_, column, labels, buckets, note=note)


# --- vLLM V1 ----------------------------------------------------------------------------------------
# vllm-project/vllm vllm/v1/metrics/loggers.py (PrometheusStatLogger). Labels: model_name, engine.
# Bucket lists as declared there; TensorRT-LLM's collector copies them ("Adapted from vLLM").
VLLM_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                     20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
VLLM_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                    40.0, 80.0)
VLLM_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                        240.0, 480.0, 960.0, 1920.0, 7680.0)
VLLM_KV_RESIDENCY_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 30, 60, 120,
                             300, 600, 1200, 1800)
_VL = ("model_name", "engine")

VLLM = Dialect(
    "vllm", "vLLM V1", "vllm-project/vllm vllm/v1/metrics/loggers.py", "/metrics",
    (
        _cat(M.num_requests_waiting, GAUGE, _VL),
        _cat(M.num_requests_running, GAUGE, _VL),
        _cat(M.kv_cache_usage_perc, GAUGE, _VL),
        _cat(M.num_preemptions_total, COUNTER, _VL),
        _cat(M.prompt_tokens_total, COUNTER, _VL),
        _cat(M.generation_tokens_total, COUNTER, _VL),
        _cat(M.prefix_cache_queries_total, COUNTER, _VL),
        _cat(M.prefix_cache_hits_total, COUNTER, _VL),
        _cat(M.time_to_first_token_seconds, HISTOGRAM, _VL, VLLM_TTFT_BUCKETS),
        _cat(M.inter_token_latency_seconds, HISTOGRAM, _VL, VLLM_ITL_BUCKETS),
        _cat(M.e2e_request_latency_seconds, HISTOGRAM, _VL,
           VLLM_REQUEST_BUCKETS),
        _cat(M.request_queue_time_seconds, HISTOGRAM, _VL, VLLM_REQUEST_BUCKETS),
        _cat(M.request_prefill_time_seconds, HISTOGRAM, _VL,
           VLLM_REQUEST_BUCKETS),
        _cat(M.request_decode_time_seconds, HISTOGRAM, _VL, VLLM_REQUEST_BUCKETS),
        _cat(M.kv_block_lifetime_seconds, HISTOGRAM, _VL, VLLM_KV_RESIDENCY_BUCKETS,
           note="only with --kv-cache-metrics"),
        _cat(M.kv_block_idle_before_evict_seconds, HISTOGRAM, _VL,
           VLLM_KV_RESIDENCY_BUCKETS, note="only with --kv-cache-metrics"),
        _cat(M.kv_block_reuse_gap_seconds, HISTOGRAM, _VL,
           VLLM_KV_RESIDENCY_BUCKETS, note="only with --kv-cache-metrics"),
        _s("vllm:cache_config_info", GAUGE, None, ("num_gpu_blocks", "block_size"),
           note="KV capacity in tokens = num_gpu_blocks x block_size (labels)"),
    ),
    {},
    derived=((M.engine_kv_capacity_tokens, "vllm:cache_config_info", "", "info_labels"),),
)

# --- vLLM V0 names (renamed or dropped in V1) ----------------------------------------------------------
# vllm-project/vllm vllm/engine/metrics.py (V0 Metrics class). Labels: model_name.
_V0 = ("model_name",)
VLLM_V0 = Dialect(
    "vllm-v0", "vLLM V0 names", "vllm-project/vllm vllm/engine/metrics.py", "/metrics",
    (
        _cat(M.num_requests_waiting, GAUGE, _V0),
        _cat(M.num_requests_running, GAUGE, _V0),
        _s("vllm:gpu_cache_usage_perc", GAUGE, M.kv_cache_usage_perc, _V0, note="V1: vllm:kv_cache_usage_perc"),
        _cat(M.num_preemptions_total, COUNTER, _V0),
        _cat(M.prompt_tokens_total, COUNTER, _V0),
        _cat(M.generation_tokens_total, COUNTER, _V0),
        _s("vllm:gpu_prefix_cache_queries_total", COUNTER, M.prefix_cache_queries_total, _V0,
           note="V1: vllm:prefix_cache_queries_total"),
        _s("vllm:gpu_prefix_cache_hits_total", COUNTER, M.prefix_cache_hits_total, _V0,
           note="V1: vllm:prefix_cache_hits_total"),
        _cat(M.time_to_first_token_seconds, HISTOGRAM, _V0, VLLM_TTFT_BUCKETS),
        _s("vllm:time_per_output_token_seconds", HISTOGRAM, M.inter_token_latency_seconds, _V0, VLLM_ITL_BUCKETS,
           note="V1: vllm:inter_token_latency_seconds"),
        _cat(M.e2e_request_latency_seconds, HISTOGRAM, _V0,
           VLLM_REQUEST_BUCKETS),
        _cat(M.request_queue_time_seconds, HISTOGRAM, _V0, VLLM_REQUEST_BUCKETS),
        _cat(M.request_prefill_time_seconds, HISTOGRAM, _V0,
           VLLM_REQUEST_BUCKETS),
        _cat(M.request_decode_time_seconds, HISTOGRAM, _V0, VLLM_REQUEST_BUCKETS),
        _s("vllm:cpu_cache_usage_perc", GAUGE, None, _V0, note="V0 only: swap space in use"),
        _s("vllm:num_requests_swapped", GAUGE, None, _V0, note="V0 only"),
    ),
    {M.engine_kv_capacity_tokens: "V0 exports no KV capacity gauge (vllm:cache_config_info holds num_gpu_blocks)"},
)

# --- SGLang ------------------------------------------------------------------------------------------
# sgl-project/sglang python/sglang/srt/metrics/collector.py (SchedulerMetricsCollector,
# TokenizerMetricsCollector). Scheduler labels: model_name, engine_type, tp_rank, pp_rank, moe_ep_rank
# (dp_rank with data parallelism); tokenizer labels: model_name.
SGLANG_TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
SGLANG_ITL_BUCKETS = (0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060, 0.080,
                      0.100, 0.200, 0.400, 0.600, 0.800, 1.000, 2.000, 4.000, 6.000, 8.000)
SGLANG_E2E_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600, 1200, 1800,
                      2400)
SGLANG_QUEUE_BUCKETS = (0.0, 0.1, 0.2, 0.5, 1, 2, 3, 4, 5, 10, 15, 20, 30, 40, 50, 60, 70, 80, 90, 100, 200, 300,
                        400, 500, 600, 700, 800, 900, 1000, 1200, 1400, 1600, 1800, 2000, 2500, 3000)
_SG = ("model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank")
_SGT = ("model_name",)
SGLANG = Dialect(
    "sglang", "SGLang", "sgl-project/sglang python/sglang/srt/metrics/collector.py", "/metrics",
    (
        _s("sglang:num_queue_reqs", GAUGE, M.num_requests_waiting, _SG),
        _s("sglang:num_running_reqs", GAUGE, M.num_requests_running, _SG),
        _s("sglang:token_usage", GAUGE, M.kv_cache_usage_perc, _SG),
        _s("sglang:max_total_num_tokens", GAUGE, M.engine_kv_capacity_tokens, _SG),
        _s("sglang:num_used_tokens", GAUGE, M.engine_kv_used_tokens, _SG),
        # A retraction frees a running request's KV and re-queues it: vLLM's preemption.
        _s("sglang:num_retracted_requests_total", COUNTER, M.num_preemptions_total, _SG,
           note="retractions; the older sglang:num_retracted_reqs is a gauge of the last interval"),
        _s("sglang:prompt_tokens_total", COUNTER, M.prompt_tokens_total, _SGT),
        _s("sglang:generation_tokens_total", COUNTER, M.generation_tokens_total, _SGT),
        # Every prompt token is looked up in the radix cache; cached_tokens are the ones found.
        _s("sglang:prompt_tokens_total", COUNTER, M.prefix_cache_queries_total, _SGT,
           note="every prompt token is looked up in the radix cache"),
        _s("sglang:cached_tokens_total", COUNTER, M.prefix_cache_hits_total, _SGT),
        _s("sglang:time_to_first_token_seconds", HISTOGRAM, M.time_to_first_token_seconds, _SGT,
           SGLANG_TTFT_BUCKETS),
        _s("sglang:inter_token_latency_seconds", HISTOGRAM, M.inter_token_latency_seconds, _SGT,
           SGLANG_ITL_BUCKETS),
        _s("sglang:e2e_request_latency_seconds", HISTOGRAM, M.e2e_request_latency_seconds, _SGT,
           SGLANG_E2E_BUCKETS),
        _s("sglang:queue_time_seconds", HISTOGRAM, M.request_queue_time_seconds, _SG, SGLANG_QUEUE_BUCKETS),
        _s("sglang:cache_hit_rate", GAUGE, None, _SG, note="a ratio of the last interval; the counters are read"),
        _s("sglang:gen_throughput", GAUGE, None, _SG),
        _s("sglang:num_retractions", HISTOGRAM, None, _SGT, note="retractions per finished request"),
        _s("sglang:per_stage_req_latency_seconds", HISTOGRAM, None, _SG + ("stage",),
           note="per-stage latency; its stage names vary with the disaggregation mode"),
    ),
    {M.request_prefill_time_seconds: "SGLang has no per-request prefill-time histogram",
     M.request_decode_time_seconds: "SGLang has no per-request decode-time histogram"},
)

# --- trtllm-serve ---------------------------------------------------------------------------------------
# NVIDIA/TensorRT-LLM tensorrt_llm/metrics/collector.py (MetricsCollector, prefix "trtllm_"), served by
# trtllm-serve at /prometheus/metrics. Labels: model_name, engine_type.
TRTLLM_PREFILL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0,
                          160.0, 640.0, 2560.0)
_TR = ("model_name", "engine_type")
TRTLLM = Dialect(
    "trtllm", "TensorRT-LLM (trtllm-serve)", "NVIDIA/TensorRT-LLM tensorrt_llm/metrics/collector.py",
    "/prometheus/metrics",
    (
        _s("trtllm_num_requests_waiting", GAUGE, M.num_requests_waiting, _TR),
        _s("trtllm_num_requests_running", GAUGE, M.num_requests_running, _TR),
        _s("trtllm_kv_cache_utilization", GAUGE, M.kv_cache_usage_perc, _TR),
        _s("trtllm_kv_cache_max_blocks", GAUGE, None, _TR, note="capacity = max_blocks x tokens_per_block"),
        _s("trtllm_kv_cache_used_blocks", GAUGE, None, _TR),
        _s("trtllm_kv_cache_tokens_per_block", GAUGE, None, _TR),
        _s("trtllm_prompt_tokens_total", COUNTER, M.prompt_tokens_total, _TR),
        _s("trtllm_generation_tokens_total", COUNTER, M.generation_tokens_total, _TR),
        _s("trtllm_prompt_tokens_total", COUNTER, M.prefix_cache_queries_total, _TR,
           note="every prompt token is looked up when block reuse is on"),
        _s("trtllm_prompt_cached_tokens_total", COUNTER, M.prefix_cache_hits_total, _TR),
        _s("trtllm_time_to_first_token_seconds", HISTOGRAM, M.time_to_first_token_seconds, _TR, VLLM_TTFT_BUCKETS),
        _s("trtllm_time_per_output_token_seconds", HISTOGRAM, M.inter_token_latency_seconds, _TR,
           VLLM_ITL_BUCKETS),
        _s("trtllm_e2e_request_latency_seconds", HISTOGRAM, M.e2e_request_latency_seconds, _TR,
           VLLM_REQUEST_BUCKETS),
        _s("trtllm_request_queue_time_seconds", HISTOGRAM, M.request_queue_time_seconds, _TR, VLLM_REQUEST_BUCKETS),
        _s("trtllm_request_prefill_time_seconds", HISTOGRAM, M.request_prefill_time_seconds, _TR,
           TRTLLM_PREFILL_BUCKETS),
        _s("trtllm_request_decode_time_seconds", HISTOGRAM, M.request_decode_time_seconds, _TR,
           VLLM_REQUEST_BUCKETS),
        _s("trtllm_kv_cache_hit_rate", GAUGE, None, _TR),
        _s("trtllm_num_paused_requests", GAUGE, None, _TR, note="paused, not evicted: no preemption count"),
    ),
    {M.num_preemptions_total: "trtllm-serve exports no preemption counter"},
    derived=((M.engine_kv_capacity_tokens, "trtllm_kv_cache_max_blocks", "trtllm_kv_cache_tokens_per_block", "mul"),
             (M.engine_kv_used_tokens, "trtllm_kv_cache_used_blocks", "trtllm_kv_cache_tokens_per_block", "mul")),
)

# --- Triton Inference Server with the TensorRT-LLM backend -----------------------------------------------
# triton-inference-server/tensorrtllm_backend inflight_batcher_llm/src/custom_metrics_reporter/
# custom_metrics_reporter.cc (nv_trt_llm_*, labels model, version plus one selector label), and
# triton-inference-server/server src/metrics.cc (nv_inference_*; first-response histogram with
# --metrics-config histogram_latencies=true, in milliseconds).
TRITON_FIRST_RESPONSE_BUCKETS_MS = (100, 500, 2000, 5000)
_TT = ("model", "version")
TRITON = Dialect(
    "triton", "Triton + TensorRT-LLM backend",
    "triton-inference-server/tensorrtllm_backend inflight_batcher_llm/src/custom_metrics_reporter/"
    "custom_metrics_reporter.cc", "/metrics",
    (
        _s("nv_trt_llm_request_metrics", GAUGE, M.num_requests_waiting, _TT + ("request_type",),
           where=(("request_type", "waiting"),)),
        _s("nv_trt_llm_request_metrics", GAUGE, M.num_requests_running, _TT + ("request_type",),
           where=(("request_type", "scheduled"),)),
        _s("nv_trt_llm_kv_cache_block_metrics", GAUGE, M.kv_cache_usage_perc, _TT + ("kv_cache_block_type",),
           where=(("kv_cache_block_type", "fraction"),)),
        _s("nv_trt_llm_kv_cache_block_metrics", GAUGE, None, _TT + ("kv_cache_block_type",),
           where=(("kv_cache_block_type", "max"),), note="capacity = max x tokens_per"),
        _s("nv_trt_llm_kv_cache_block_metrics", GAUGE, None, _TT + ("kv_cache_block_type",),
           where=(("kv_cache_block_type", "tokens_per"),)),
        _s("nv_trt_llm_kv_cache_block_metrics", GAUGE, None, _TT + ("kv_cache_block_type",),
           where=(("kv_cache_block_type", "used"),)),
        _s("nv_inference_first_response_histogram_ms", HISTOGRAM, M.time_to_first_token_seconds, _TT,
           TRITON_FIRST_RESPONSE_BUCKETS_MS, scale=1e-3,
           note="time to the first response: the first token only when the model streams"),
        _s("nv_inference_request_success", COUNTER, None, _TT),
        _s("nv_inference_queue_duration_us", COUNTER, None, _TT, note="cumulative; a mean, no distribution"),
        _s("nv_inference_pending_request_count", GAUGE, None, _TT),
    ),
    {M.num_preemptions_total: "the TensorRT-LLM backend exports no preemption counter",
     M.inter_token_latency_seconds: "Triton exports no inter-token latency",
     M.prompt_tokens_total: "Triton counts inferences, not prompt tokens",
     M.generation_tokens_total: "Triton counts inferences, not generated tokens",
     M.prefix_cache_hits_total: "the backend reports reused blocks as a gauge, no token counters",
     M.prefix_cache_queries_total: "the backend reports reused blocks as a gauge, no token counters",
     M.request_queue_time_seconds: "nv_inference_queue_duration_us is a cumulative sum (a mean, no quantiles)",
     M.request_prefill_time_seconds: "Triton has no prefill-time histogram",
     M.request_decode_time_seconds: "Triton has no decode-time histogram",
     M.e2e_request_latency_seconds: "nv_inference_request_duration_us is a cumulative sum (no quantiles)"},
    derived=((M.engine_kv_capacity_tokens, "nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type=max}",
              "nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type=tokens_per}", "mul"),
             (M.engine_kv_used_tokens, "nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type=used}",
              "nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type=tokens_per}", "mul")),
)

# --- NVIDIA NIM for LLMs -----------------------------------------------------------------------------------
# docs.nvidia.com/nim/large-language-models/latest/observability.html: vLLM's V0 names without the
# "vllm:" prefix, at /v1/metrics. Labels: model_name.
NIM = Dialect(
    "nim", "NVIDIA NIM for LLMs", "docs.nvidia.com/nim/large-language-models/latest/observability.html", "/v1/metrics",
    (
        _s("num_requests_waiting", GAUGE, M.num_requests_waiting, _V0),
        _s("num_requests_running", GAUGE, M.num_requests_running, _V0),
        _s("gpu_cache_usage_perc", GAUGE, M.kv_cache_usage_perc, _V0),
        _s("prompt_tokens_total", COUNTER, M.prompt_tokens_total, _V0),
        _s("generation_tokens_total", COUNTER, M.generation_tokens_total, _V0),
        _s("time_to_first_token_seconds", HISTOGRAM, M.time_to_first_token_seconds, _V0, VLLM_TTFT_BUCKETS),
        _s("time_per_output_token_seconds", HISTOGRAM, M.inter_token_latency_seconds, _V0, VLLM_ITL_BUCKETS),
        _s("e2e_request_latency_seconds", HISTOGRAM, M.e2e_request_latency_seconds, _V0, VLLM_REQUEST_BUCKETS),
        _s("num_request_max", GAUGE, None, _V0),
        _s("request_success_total", COUNTER, None, _V0 + ("finished_reason",)),
    ),
    {M.num_preemptions_total: "NIM's list has no preemption counter",
     M.engine_kv_capacity_tokens: "NIM exports no KV capacity",
     M.prefix_cache_hits_total: "NIM exports no prefix-cache counters",
     M.prefix_cache_queries_total: "NIM exports no prefix-cache counters",
     M.request_queue_time_seconds: "NIM exports no queue-time histogram",
     M.request_prefill_time_seconds: "NIM exports no prefill-time histogram",
     M.request_decode_time_seconds: "NIM exports no decode-time histogram"},
)

# --- llama.cpp server ----------------------------------------------------------------------------------------
# ggml-org/llama.cpp tools/server/server.cpp (handle_metrics, with --metrics). No labels, no histograms.
# Newer builds dropped llamacpp:kv_cache_usage_ratio and llamacpp:kv_cache_tokens: KV occupancy then
# comes from GET /slots (see slots_kv_usage).
LLAMACPP = Dialect(
    "llamacpp", "llama.cpp server", "ggml-org/llama.cpp tools/server/server.cpp", "/metrics",
    (
        _s("llamacpp:requests_deferred", GAUGE, M.num_requests_waiting),
        _s("llamacpp:requests_processing", GAUGE, M.num_requests_running),
        _s("llamacpp:kv_cache_usage_ratio", GAUGE, M.kv_cache_usage_perc, note="older builds; else /slots"),
        _s("llamacpp:kv_cache_tokens", GAUGE, M.engine_kv_used_tokens, note="older builds"),
        _s("llamacpp:prompt_tokens_total", COUNTER, M.prompt_tokens_total),
        _s("llamacpp:tokens_predicted_total", COUNTER, M.generation_tokens_total),
        _s("llamacpp:prompt_seconds_total", COUNTER, None),
        _s("llamacpp:tokens_predicted_seconds_total", COUNTER, None),
        _s("llamacpp:n_decode_total", COUNTER, None),
        _s("llamacpp:n_busy_slots_per_decode", GAUGE, None),
        _s("llamacpp:prompt_tokens_seconds", GAUGE, None, note="average prompt throughput, tokens/s"),
        _s("llamacpp:predicted_tokens_seconds", GAUGE, None, note="average generation throughput, tokens/s"),
    ),
    {M.num_preemptions_total: "llama.cpp's slots are never preempted",
     M.engine_kv_capacity_tokens: "capacity is n_ctx per slot, from /slots",
     M.time_to_first_token_seconds: "llama.cpp exports no latency histograms",
     M.inter_token_latency_seconds: "llama.cpp exports no latency histograms",
     M.e2e_request_latency_seconds: "llama.cpp exports no latency histograms",
     M.prefix_cache_hits_total: "llama.cpp exports no prefix-cache counters",
     M.prefix_cache_queries_total: "llama.cpp exports no prefix-cache counters",
     M.request_queue_time_seconds: "llama.cpp exports no latency histograms",
     M.request_prefill_time_seconds: "llama.cpp exports no latency histograms",
     M.request_decode_time_seconds: "llama.cpp exports no latency histograms"},
)

# --- Text Generation Inference (read only: archived) ----------------------------------------------------------
# huggingface/text-generation-inference router/src/server.rs (metrics-exporter-prometheus buckets) and
# router/src/infer (metric names). Histograms of seconds named *_duration (no unit suffix); no labels
# on the request series. Duration buckets: 35 steps, 0.0001 x 1.5^i.
TGI_DURATION_BUCKETS = tuple(0.0001 * 1.5 ** i for i in range(1, 36))
TGI = Dialect(
    "tgi", "Text Generation Inference", "huggingface/text-generation-inference router/src/server.rs", "/metrics",
    (
        _s("tgi_queue_size", GAUGE, M.num_requests_waiting),
        _s("tgi_batch_current_size", GAUGE, M.num_requests_running),
        _s("tgi_request_queue_duration", HISTOGRAM, M.request_queue_time_seconds, (), TGI_DURATION_BUCKETS),
        _s("tgi_request_duration", HISTOGRAM, M.e2e_request_latency_seconds, (), TGI_DURATION_BUCKETS),
        _s("tgi_request_mean_time_per_token_duration", HISTOGRAM, None, (), TGI_DURATION_BUCKETS,
           note="inference time / generated tokens: includes the prefill, so not inter-token latency"),
        _s("tgi_request_inference_duration", HISTOGRAM, None, (), TGI_DURATION_BUCKETS),
        _s("tgi_request_count", COUNTER, None),
        _s("tgi_request_success", COUNTER, None),
        _s("tgi_request_generated_tokens", HISTOGRAM, None, note="its _sum counts generated tokens"),
        _s("tgi_request_input_length", HISTOGRAM, None, note="its _sum counts prompt tokens"),
    ),
    {M.num_preemptions_total: "TGI exports no preemption counter",
     M.kv_cache_usage_perc: "TGI exports no KV usage",
     M.engine_kv_capacity_tokens: "TGI exports no KV capacity",
     M.time_to_first_token_seconds: "TGI exports no TTFT histogram",
     M.inter_token_latency_seconds: "tgi_request_mean_time_per_token_duration includes the prefill",
     M.prompt_tokens_total: "only as the _sum of tgi_request_input_length",
     M.generation_tokens_total: "only as the _sum of tgi_request_generated_tokens",
     M.prefix_cache_hits_total: "TGI exports no prefix-cache counters",
     M.prefix_cache_queries_total: "TGI exports no prefix-cache counters",
     M.request_prefill_time_seconds: "only per batch (tgi_batch_forward_duration{method=prefill})",
     M.request_decode_time_seconds: "only per batch (tgi_batch_forward_duration{method=decode})"},
    read_only=True,
)

DIALECTS: dict[str, Dialect] = {d.name: d for d in (VLLM, VLLM_V0, SGLANG, TRTLLM, TRITON, NIM, LLAMACPP, TGI)}
# Dialects the reference engine speaks (TGI is archived: read only).
SPOKEN: tuple[str, ...] = tuple(n for n, d in DIALECTS.items() if not d.read_only)


def get(name: str) -> Dialect:
    """The dialect called ``name``; KeyError lists the known ones."""
    try:
        return DIALECTS[name]
    except KeyError:
        raise KeyError(f"unknown engine dialect {name!r}; known: {', '.join(DIALECTS)}") from None


def missing(dialect: Dialect) -> dict[str, str]:
    """Vocabulary columns the dialect cannot fill -> why."""
    out = {}
    fills = dialect.fills()
    for column in VOCABULARY:
        if column not in fills:
            out[column] = dialect.lacks.get(column, f"{dialect.title} exports nothing for {column}")
    return out


# --- detection ------------------------------------------------------------------------------------------

_MARKERS = (  # (dialect, family names that identify it), checked in order
    ("sglang", ("sglang:",)),
    ("trtllm", ("trtllm_",)),
    ("triton", ("nv_trt_llm_", "nv_inference_")),
    ("llamacpp", ("llamacpp:",)),
    ("tgi", ("tgi_",)),
)
_V0_ONLY = frozenset({"vllm:gpu_cache_usage_perc", "vllm:time_per_output_token_seconds",
                      "vllm:gpu_prefix_cache_queries", "vllm:gpu_prefix_cache_hits", "vllm:num_requests_swapped",
                      "vllm:cpu_cache_usage_perc"})
_NIM_NAMES = frozenset({"num_requests_running", "num_requests_waiting", "gpu_cache_usage_perc"})


def family_of(sample_name: str) -> str:
    """A sample's family name (``_bucket``, ``_sum``, ``_count``, ``_created`` removed; ``_total`` kept)."""
    for suffix in ("_bucket", "_count", "_sum", "_created"):
        if sample_name.endswith(suffix):
            return sample_name[: -len(suffix)]
    return sample_name


def detect(names: Iterable[str]) -> str | None:
    """The dialect of a page whose sample or family names are ``names``; None when no engine's.

    vLLM V1 wins over V0 wherever a V1-only name is there (``vllm:kv_cache_usage_perc``);
    the reference engine's ``gpudiag_engine_*`` series speak vLLM V1 beside it.
    """
    fams = {family_of(n) for n in names}
    bare = {f[: -len("_total")] if f.endswith("_total") else f for f in fams}
    vllm = {f for f in fams if f.startswith("vllm:")}
    if vllm:
        v1 = {"vllm:kv_cache_usage_perc", "vllm:inter_token_latency_seconds", "vllm:prefix_cache_queries_total",
              "vllm:prefix_cache_queries"}
        if vllm & v1 or not (vllm & _V0_ONLY or bare & _V0_ONLY):
            return "vllm"
        return "vllm-v0"
    for name, prefixes in _MARKERS:
        if any(f.startswith(p) for f in fams for p in prefixes):
            return name
    if len(_NIM_NAMES & bare) >= 2:
        return "nim"
    return None


# --- mapping parsed families onto catalog names -----------------------------------------------------------


def _matches(series: Series, labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in series.where)


def _engine_labels(labels: dict[str, str], drop: tuple[str, ...]) -> dict[str, str]:
    out = {k: v for k, v in labels.items() if k not in drop}
    if "model" in out and "model_name" not in out:  # Triton's model label is the served model
        out["model_name"] = out.pop("model")
    return out


def to_catalog(families: list, dialect: Dialect) -> list:
    """Parsed families (prometheus_client) of ``dialect`` rewritten as catalog-named families.

    Gauges and counters become one sample per label set under the catalog name (label
    selectors such as ``request_type`` removed); histograms keep their buckets, their ``le``
    scaled to seconds. Derived columns (capacity = blocks x tokens per block) are added.
    Families the dialect does not map are dropped.
    """
    from prometheus_client.metrics_core import Metric
    from prometheus_client.samples import Sample

    table = dialect.by_name()
    out: dict[str, Any] = {}
    plain: dict[str, dict[tuple, float]] = {}  # "name{k=v}" -> {label items: value}, for derived columns
    for family in families:
        # prometheus_client names a counter family without _total; the table spells the exposed name.
        candidates = table.get(family.name) or table.get(family.name + "_total") or []
        if family.type != "histogram" and candidates:
            drop = tuple({k for c in candidates for k, _ in c.where})
            for s in family.samples:
                if s.name.endswith("_created"):
                    continue
                key = tuple(sorted(_engine_labels(dict(s.labels), drop).items()))
                for sel in _selector_names(s.name, s.labels):
                    plain.setdefault(sel, {})[key] = s.value
        for series in candidates:
            if series.column is None:
                continue
            metric = CATALOG[series.column]
            drop = tuple(k for k, _ in series.where)
            fam = out.get(metric.name)
            if fam is None:
                fam = out[metric.name] = Metric(_family_name(metric), metric.help,
                                                "histogram" if metric.type == HISTOGRAM else metric.type)
            for s in family.samples:
                if s.name.endswith("_created") or not _matches(series, s.labels):
                    continue
                labels = _engine_labels(dict(s.labels), drop)
                if metric.type == HISTOGRAM:
                    suffix = s.name[len(family.name):]
                    value = s.value * series.scale if suffix == "_sum" else s.value
                    if suffix == "_bucket":
                        le = float(labels["le"])
                        labels["le"] = "+Inf" if math.isinf(le) else repr(le * series.scale)
                    fam.samples.append(Sample(metric.name + suffix, labels, value, None, None))
                else:
                    fam.samples.append(Sample(metric.name, labels, s.value * series.scale, None, None))
    for column, num, den, op in dialect.derived:
        a, b = plain.get(num), plain.get(den)
        if op != "mul" or not a or not b:
            continue
        metric = CATALOG[column]
        fam = out.setdefault(metric.name, Metric(metric.name, metric.help, metric.type))
        for key, value in a.items():
            other = b.get(key, next(iter(b.values())))
            fam.samples.append(Sample(metric.name, dict(key), value * other if op == "mul" else value, None, None))
    if dialect.name == "vllm":
        _cache_config_capacity(families, out)
    return [f for f in out.values() if f.samples]


def _family_name(metric) -> str:
    name = metric.name
    return name[: -len("_total")] if metric.type == COUNTER and name.endswith("_total") else name


def _selector_names(name: str, labels: dict[str, str]) -> list[str]:
    """The names a sample answers to in ``derived``: its own and ``name{k=v}`` for each of its labels."""
    return [name] + [f"{name}{{{k}={v}}}" for k, v in labels.items()]


def _cache_config_capacity(families: list, out: dict) -> None:
    """vLLM's KV capacity in tokens: num_gpu_blocks x block_size of ``vllm:cache_config_info``."""
    from prometheus_client.metrics_core import Metric
    from prometheus_client.samples import Sample

    for name, column, factors in label_products("vllm"):
        metric = CATALOG[column]
        for family in families:
            if family.name != name:
                continue
            for s in family.samples:
                value = label_product(s.labels, factors)
                if value is None:
                    continue
                labels = {k: v for k, v in s.labels.items() if k in ("engine", "model_name")}
                fam = out.setdefault(metric.name, Metric(metric.name, metric.help, metric.type))
                fam.samples.append(Sample(metric.name, labels, value, None, None))


def label_products(dialect: str) -> list[tuple[str, str, tuple[str, ...]]]:
    """(series name, catalog column, labels) of the columns a dialect writes as the product of an
    info gauge's labels (vLLM's ``cache_config_info``: num_gpu_blocks x block_size tokens)."""
    d = DIALECTS[dialect]
    table = d.by_name()
    out = []
    for column, name, _, op in d.derived:
        if op == "info_labels":
            factors = next(s.labels for s in table[name] if s.column is None)
            out.append((name, column, factors))
    return out


def label_product(labels: dict[str, str], factors: tuple[str, ...]) -> float | None:
    """The product of ``labels``' numeric values named in ``factors``; None where one is absent or
    not a positive number (vLLM writes ``"None"`` before the pool is sized)."""
    value = 1.0
    for name in factors:
        try:
            x = float(labels[name])
        except (KeyError, ValueError):
            return None
        if not math.isfinite(x) or x <= 0:
            return None
        value *= x
    return value


def vllm_renames() -> dict[str, str]:
    """vLLM V0's names for what V1 (the catalog) names otherwise: old name -> the catalog's name."""
    return {s.name: CATALOG[s.column].name for s in VLLM_V0.series
            if s.column is not None and s.name != CATALOG[s.column].name}


def known_names() -> frozenset[str]:
    """Every family name some dialect declares (for a scraper's filter of what to parse)."""
    return frozenset(s.name for d in DIALECTS.values() for s in d.series)


# --- llama.cpp's /slots ----------------------------------------------------------------------------------


def slots_kv_usage(slots: Any) -> tuple[float, float, float] | None:
    """(tokens held, capacity in tokens, usage 0..1) from llama.cpp's ``GET /slots`` JSON; None if unreadable.

    Each slot owns ``n_ctx`` tokens of KV. A slot holds ``n_past`` tokens where the build reports
    it; otherwise its prompt (``n_prompt_tokens_processed``) plus what it decoded
    (``next_token[0].n_decoded``).
    """
    if isinstance(slots, dict):
        slots = slots.get("slots")
    if not isinstance(slots, list) or not slots:
        return None
    held = capacity = 0.0
    for slot in slots:
        if not isinstance(slot, dict):
            return None
        n_ctx = slot.get("n_ctx")
        if not isinstance(n_ctx, (int, float)) or isinstance(n_ctx, bool) or n_ctx <= 0:
            return None
        capacity += n_ctx
        tokens = slot.get("n_past")
        if not isinstance(tokens, (int, float)) or isinstance(tokens, bool):
            prompt = slot.get("n_prompt_tokens_processed") or 0
            nxt = slot.get("next_token")
            decoded = nxt[0].get("n_decoded", 0) if isinstance(nxt, list) and nxt and isinstance(nxt[0], dict) \
                else (nxt.get("n_decoded", 0) if isinstance(nxt, dict) else 0)
            tokens = (prompt if isinstance(prompt, (int, float)) else 0) + (
                decoded if isinstance(decoded, (int, float)) else 0)
            if not slot.get("is_processing", True):
                tokens = 0
        held += min(float(tokens), float(n_ctx))
    return held, capacity, held / capacity


# --- Prometheus: what investigate --prometheus reads ------------------------------------------------------


@dataclass(frozen=True)
class PromSeries:
    """One exported name another engine writes, as a PromQL reader takes it."""

    dialect: str
    name: str
    column: str
    type: str
    scale: float = 1.0
    where: tuple[tuple[str, str], ...] = ()


def prom_series(include_vllm: bool = False) -> list[PromSeries]:
    """Every (name, column) of the dialects other than vLLM's own names (the catalog holds those).

    Gauges and counters fill engine rows; histograms are read as interval summaries.
    NIM's, SGLang's... names appear once per column they fill.
    """
    out = []
    for d in DIALECTS.values():
        if d.name in ("vllm", "vllm-v0") and not include_vllm:
            continue
        for s in d.series:
            if s.column is None:
                continue
            out.append(PromSeries(d.name, s.name, s.column, s.type, s.scale, s.where))
    return out


# --- rendering: the reference engine speaking a dialect ---------------------------------------------------


_GPU_LABEL = re.compile(r'(?:^|,)gpu="([^"]*)"')
_LE_LABEL = re.compile(r'le="([^"]*)"')


def _number(v: float) -> str:
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v))


def render(text: str, dialect: str | dict[Any, str], *, default: str = "vllm") -> str:
    """Catalog-named exposition text (vLLM's names, gpudiag's own) rewritten in another dialect.

    ``dialect`` is one name, or ``{gpu label value: name}`` for a node whose GPUs run different
    engines (``default`` for series of other GPUs). Each vocabulary series becomes the engine's
    own name, label selector and unit (Triton's first-response histogram in milliseconds); a
    series the engine does not export is left out, as the engine would; gpudiag's own series
    (``gpudiag_*``) stay. Histogram buckets keep the reference engine's bounds. The text is
    rewritten line by line (text format 0.0.4 as the agent writes it: a ``# TYPE`` line before
    each family's samples).
    """
    from gpudiag.catalog import BY_NAME

    per_gpu = {str(k): v for k, v in dialect.items()} if isinstance(dialect, dict) else None
    for name in ([dialect] if isinstance(dialect, str) else list(dialect.values())) + [default]:
        get(name)
    tables: dict[str, dict[str, Series]] = {}

    def series_for(dname: str, column: str) -> Series | None:
        table = tables.get(dname)
        if table is None:
            table = tables[dname] = {}
            seen: set[tuple] = set()
            for s in get(dname).series:
                if s.column and s.column not in table and (s.name, s.where) not in seen:
                    table[s.column] = s
                    seen.add((s.name, s.where))
        return table.get(column)

    out: dict[str, tuple[str, str, list[str]]] = {}  # exposed family -> (type, help, sample lines)
    family, ftype, fhelp, metric = "", "untyped", "", None
    for line in text.splitlines():
        if not line:
            continue
        if line.startswith("#"):
            parts = line.split(None, 3)
            if len(parts) >= 3 and parts[1] == "HELP":
                fhelp = parts[3] if len(parts) > 3 else ""
            elif len(parts) >= 4 and parts[1] == "TYPE":
                family, ftype = parts[2], parts[3]
                metric = BY_NAME.get(family)
            continue
        brace = line.find("{")
        space = line.find(" ")
        end = brace if 0 <= brace < space else space
        name = line[:end]
        if brace == end:
            close = line.index("}", brace)
            labels, value = line[brace + 1:close], line[close + 1:].strip()
        else:
            labels, value = "", line[end + 1:].strip()
        dname = dialect if per_gpu is None else None
        if per_gpu is not None:
            g = _GPU_LABEL.search(labels)
            dname = per_gpu.get(g.group(1), default) if g else default
        if metric is None or metric.dialect != "vllm" or dname == "vllm" or not name.startswith(family):
            got = out.setdefault(family or name, (ftype, fhelp, []))
            got[2].append(line)
            continue
        series = series_for(dname, metric.column)
        if series is None:
            continue
        suffix = name[len(family):]
        if series.where:
            labels = ",".join(x for x in (labels, ",".join(f'{k}="{v}"' for k, v in series.where)) if x)
        if series.scale != 1.0:
            if suffix == "_bucket":
                le = _LE_LABEL.search(labels)
                if le is not None and le.group(1) != "+Inf":
                    scaled = _number(float(le.group(1)) / series.scale)
                    labels = labels[:le.start()] + f'le="{scaled}"' + labels[le.end():]
            elif suffix in ("_sum", ""):
                value = _number(float(value) / series.scale)
        exposed = series.name
        got = out.setdefault(exposed, (series.type, fhelp, []))
        got[2].append(f"{exposed}{suffix}{{{labels}}} {value}" if labels else f"{exposed}{suffix} {value}")
    lines = []
    for name, (typ, doc, samples) in out.items():
        lines.append(f"# HELP {name} {doc}")
        lines.append(f"# TYPE {name} {typ}")
        lines.extend(samples)
    return "\n".join(lines) + "\n"
