"""Every engine dialect read by the engine probe over HTTP, mapped onto the catalog's engine vocabulary.

The pages are what each engine writes: names, types, labels and bucket bounds copied from the
engine's own source (cited per page), the counts those of a busy replica.
"""

from __future__ import annotations

import json

import pytest
from http_support import PageServer

from gpudiag.catalog import CATALOG, M
from gpudiag.probes import engine_dialects
from gpudiag.probes.engine_scrape import EngineScrapeProbe


def hist(name: str, labels: str, bounds, observations, scale_sum: float = 1.0) -> str:
    """Histogram lines of ``observations`` in ``bounds`` (cumulative, +Inf last), as prometheus_client writes them."""
    sep = "," if labels else ""
    lines = [f"# TYPE {name} histogram"]
    for b in bounds:
        n = sum(1 for o in observations if o <= b)
        lines.append(f'{name}_bucket{{{labels}{sep}le="{float(b)}"}} {float(n)}')
    lines.append(f'{name}_bucket{{{labels}{sep}le="+Inf"}} {float(len(observations))}')
    lines.append(f"{name}_count{{{labels}}} {float(len(observations))}")
    lines.append(f"{name}_sum{{{labels}}} {sum(observations) * scale_sum}")
    return "\n".join(lines) + "\n"


# python/sglang/srt/metrics/collector.py: TokenizerMetricsCollector and SchedulerMetricsCollector defaults.
SGLANG_TTFT = [0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400]
SGLANG_ITL = [0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060, 0.080, 0.100,
              0.200, 0.400, 0.600, 0.800, 1.000, 2.000, 4.000, 6.000, 8.000]
SGLANG_QUEUE = [0.0, 0.1, 0.2, 0.5, 1, 2, 3, 4, 5, 10, 15, 20, 30, 40, 50, 60, 70, 80, 90, 100, 200, 300, 400, 500,
                600, 700, 800, 900, 1000, 1200, 1400, 1600, 1800, 2000, 2500, 3000]
_SGS = 'engine_type="unified",model_name="meta-llama/Llama-3.1-8B-Instruct",moe_ep_rank="0",pp_rank="0",tp_rank="0"'
_SGT = 'model_name="meta-llama/Llama-3.1-8B-Instruct"'
SGLANG_PAGE = f"""\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{{{_SGS}}} 24.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{{{_SGS}}} 7.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{{{_SGS}}} 0.87
# HELP sglang:max_total_num_tokens Maximum total number of tokens in the KV cache pool.
# TYPE sglang:max_total_num_tokens gauge
sglang:max_total_num_tokens{{{_SGS}}} 412000.0
# HELP sglang:num_used_tokens The number of used tokens.
# TYPE sglang:num_used_tokens gauge
sglang:num_used_tokens{{{_SGS}}} 358440.0
# HELP sglang:cache_hit_rate The prefix cache hit rate.
# TYPE sglang:cache_hit_rate gauge
sglang:cache_hit_rate{{{_SGS}}} 0.61
# HELP sglang:num_retracted_requests_total Total number of retracted requests.
# TYPE sglang:num_retracted_requests_total counter
sglang:num_retracted_requests_total{{{_SGS}}} 3.0
# HELP sglang:prompt_tokens_total Number of prefill tokens processed.
# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{{{_SGT}}} 120000.0
# HELP sglang:generation_tokens_total Number of generation tokens processed.
# TYPE sglang:generation_tokens_total counter
sglang:generation_tokens_total{{{_SGT}}} 45000.0
# HELP sglang:cached_tokens_total Number of cached prompt tokens.
# TYPE sglang:cached_tokens_total counter
sglang:cached_tokens_total{{{_SGT}}} 80000.0
""" + hist("sglang:time_to_first_token_seconds", _SGT, SGLANG_TTFT, [0.15] * 60 + [0.7] * 30 + [3.0] * 10) \
    + hist("sglang:inter_token_latency_seconds", _SGT, SGLANG_ITL, [0.009] * 900 + [0.05] * 100) \
    + hist("sglang:queue_time_seconds", _SGS, SGLANG_QUEUE, [0.05] * 80 + [1.5] * 20)

# tensorrt_llm/metrics/collector.py (MetricsCollector, prefix trtllm_), labels model_name and engine_type.
TRT_TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
            80.0, 160.0, 640.0, 2560.0]
TRT_TPOT = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
_TR = 'engine_type="trtllm",model_name="nemotron-nano-3"'
TRTLLM_PAGE = f"""\
# HELP trtllm_num_requests_running Number of active requests
# TYPE trtllm_num_requests_running gauge
trtllm_num_requests_running{{{_TR}}} 31.0
# HELP trtllm_num_requests_waiting Number of queued requests
# TYPE trtllm_num_requests_waiting gauge
trtllm_num_requests_waiting{{{_TR}}} 4.0
# HELP trtllm_kv_cache_utilization KV cache utilization
# TYPE trtllm_kv_cache_utilization gauge
trtllm_kv_cache_utilization{{{_TR}}} 0.72
# HELP trtllm_kv_cache_max_blocks Maximum number of KV cache blocks
# TYPE trtllm_kv_cache_max_blocks gauge
trtllm_kv_cache_max_blocks{{{_TR}}} 6239.0
# HELP trtllm_kv_cache_used_blocks Number of used KV cache blocks
# TYPE trtllm_kv_cache_used_blocks gauge
trtllm_kv_cache_used_blocks{{{_TR}}} 4492.0
# HELP trtllm_kv_cache_tokens_per_block Number of tokens per KV cache block
# TYPE trtllm_kv_cache_tokens_per_block gauge
trtllm_kv_cache_tokens_per_block{{{_TR}}} 64.0
# HELP trtllm_prompt_tokens_total Cumulative number of prompt (input) tokens processed.
# TYPE trtllm_prompt_tokens_total counter
trtllm_prompt_tokens_total{{{_TR}}} 98000.0
# HELP trtllm_generation_tokens_total Cumulative number of generation (output) tokens produced.
# TYPE trtllm_generation_tokens_total counter
trtllm_generation_tokens_total{{{_TR}}} 51000.0
# HELP trtllm_prompt_cached_tokens_total Process-lifetime total prompt tokens served from KV cache.
# TYPE trtllm_prompt_cached_tokens_total counter
trtllm_prompt_cached_tokens_total{{{_TR}}} 12000.0
""" + hist("trtllm_time_to_first_token_seconds", _TR, TRT_TTFT, [0.09] * 50 + [0.3] * 50) \
    + hist("trtllm_time_per_output_token_seconds", _TR, TRT_TPOT, [0.02] * 100)

# tensorrtllm_backend custom_metrics_reporter.cc (nv_trt_llm_*) and Triton core (nv_inference_*; the
# first-response histogram in milliseconds with --metrics-config histogram_latencies=true).
_TT = 'model="tensorrt_llm",version="1"'
TRITON_PAGE = f"""\
# HELP nv_inference_request_success Number of successful inference requests, all batch sizes
# TYPE nv_inference_request_success counter
nv_inference_request_success{{{_TT}}} 420
# HELP nv_inference_queue_duration_us Cumulative inference queuing duration in microseconds
# TYPE nv_inference_queue_duration_us counter
nv_inference_queue_duration_us{{{_TT}}} 81234
# HELP nv_trt_llm_request_metrics TRT LLM request metrics
# TYPE nv_trt_llm_request_metrics gauge
nv_trt_llm_request_metrics{{{_TT},request_type="context"}} 1
nv_trt_llm_request_metrics{{{_TT},request_type="scheduled"}} 9
nv_trt_llm_request_metrics{{{_TT},request_type="max"}} 512
nv_trt_llm_request_metrics{{{_TT},request_type="active"}} 9
nv_trt_llm_request_metrics{{{_TT},request_type="waiting"}} 2
# HELP nv_trt_llm_kv_cache_block_metrics TRT LLM KV cache block metrics
# TYPE nv_trt_llm_kv_cache_block_metrics gauge
nv_trt_llm_kv_cache_block_metrics{{kv_cache_block_type="tokens_per",{_TT}}} 64
nv_trt_llm_kv_cache_block_metrics{{kv_cache_block_type="used",{_TT}}} 3120
nv_trt_llm_kv_cache_block_metrics{{kv_cache_block_type="free",{_TT}}} 3119
nv_trt_llm_kv_cache_block_metrics{{kv_cache_block_type="max",{_TT}}} 6239
nv_trt_llm_kv_cache_block_metrics{{kv_cache_block_type="fraction",{_TT}}} 0.5
""" + hist("nv_inference_first_response_histogram_ms", _TT, [100, 500, 2000, 5000], [80] * 70 + [300] * 30)

# NIM for LLMs: vLLM's names without the prefix, at /v1/metrics.
_NIM = 'model_name="meta/llama-3.1-8b-instruct"'
NIM_PAGE = f"""\
# TYPE num_requests_running gauge
num_requests_running{{{_NIM}}} 5.0
# TYPE num_requests_waiting gauge
num_requests_waiting{{{_NIM}}} 1.0
# TYPE num_request_max gauge
num_request_max{{{_NIM}}} 256.0
# TYPE gpu_cache_usage_perc gauge
gpu_cache_usage_perc{{{_NIM}}} 0.25
# TYPE prompt_tokens_total counter
prompt_tokens_total{{{_NIM}}} 7000.0
# TYPE generation_tokens_total counter
generation_tokens_total{{{_NIM}}} 3000.0
""" + hist("time_to_first_token_seconds", _NIM, TRT_TTFT, [0.2] * 10)

# tools/server/server.cpp (handle_metrics): no labels, no histograms.
LLAMACPP_PAGE = """\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 5120
# HELP llamacpp:prompt_seconds_total Prompt process time
# TYPE llamacpp:prompt_seconds_total counter
llamacpp:prompt_seconds_total 2.5
# HELP llamacpp:tokens_predicted_total Number of generation tokens processed.
# TYPE llamacpp:tokens_predicted_total counter
llamacpp:tokens_predicted_total 2048
# HELP llamacpp:n_decode_total Total number of llama_decode() calls
# TYPE llamacpp:n_decode_total counter
llamacpp:n_decode_total 2100
# HELP llamacpp:predicted_tokens_seconds Average generation throughput in tokens/s.
# TYPE llamacpp:predicted_tokens_seconds gauge
llamacpp:predicted_tokens_seconds 41.2
# HELP llamacpp:requests_processing Number of requests processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 2
# HELP llamacpp:requests_deferred Number of requests deferred.
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 5
"""

# router/src/server.rs: durations in seconds, 35 buckets 0.0001 x 1.5^i; no labels on these.
TGI_BOUNDS = [0.0001 * 1.5 ** i for i in range(1, 36)]
TGI_PAGE = """\
# TYPE tgi_queue_size gauge
tgi_queue_size 12
# TYPE tgi_batch_current_size gauge
tgi_batch_current_size 16
# TYPE tgi_request_count counter
tgi_request_count 900
""" + hist("tgi_request_queue_duration", "", TGI_BOUNDS, [0.5] * 40 + [4.0] * 10) \
    + hist("tgi_request_duration", "", TGI_BOUNDS, [6.0] * 50)


@pytest.fixture
def endpoint():
    ep = PageServer()
    yield ep
    ep.close()


def _scrape(endpoint, path, page):
    endpoint.pages[path] = page
    probe = EngineScrapeProbe(endpoint.base + path)
    (row,) = probe.sample(1.0)[0].rows
    return row, probe.status()


def _name(column):
    return CATALOG[column].name


def test_sglang_maps_onto_the_vocabulary_and_its_retractions_are_preemptions(endpoint):
    row, status = _scrape(endpoint, "/metrics", SGLANG_PAGE)
    assert status["dialect"] == "sglang"
    assert row[M.num_requests_running] == 24 and row[M.num_requests_waiting] == 7
    assert row[M.kv_cache_usage_perc] == pytest.approx(0.87)
    assert row[M.engine_kv_capacity_tokens] == 412000 and row[M.engine_kv_used_tokens] == 358440
    assert row[M.num_preemptions_total] == 3
    assert row[M.prefix_cache_queries_total] == 120000 and row[M.prefix_cache_hits_total] == 80000
    assert row[M.generation_tokens_total] == 45000
    ttft = row[M.time_to_first_token_seconds]
    assert ttft["count"] == 100 and ttft["p50"] == pytest.approx(0.1 + 0.1 * 50 / 60)
    assert row[M.inter_token_latency_seconds]["p50"] == pytest.approx(0.008 + 0.002 * 500 / 900)
    assert row[M.request_queue_time_seconds]["count"] == 100
    assert row["model"] == "meta-llama/Llama-3.1-8B-Instruct"
    # What SGLang does not export is said, with why; nothing it exports is called missing.
    assert _name(M.request_prefill_time_seconds) in status["lacks"]
    assert _name(M.num_preemptions_total) not in status["lacks"]
    # The one series SGLang has and this page lacks (no request finished since the start).
    assert status["missing_metrics"] == [_name(M.e2e_request_latency_seconds)]


def test_trtllm_serve_capacity_is_blocks_times_tokens_and_it_has_no_preemption_counter(endpoint):
    row, status = _scrape(endpoint, "/prometheus/metrics", TRTLLM_PAGE)
    assert status["dialect"] == "trtllm"
    assert row[M.num_requests_running] == 31 and row[M.num_requests_waiting] == 4
    assert row[M.kv_cache_usage_perc] == pytest.approx(0.72)
    assert row[M.engine_kv_capacity_tokens] == 6239 * 64 and row[M.engine_kv_used_tokens] == 4492 * 64
    assert row[M.prefix_cache_hits_total] == 12000 and row[M.prefix_cache_queries_total] == 98000
    assert row[M.time_to_first_token_seconds]["count"] == 100
    assert row[M.inter_token_latency_seconds]["p90"] == pytest.approx(0.01 + 0.015 * 0.9)
    assert M.num_preemptions_total not in row
    assert "no preemption counter" in status["lacks"][_name(M.num_preemptions_total)]
    assert _name(M.num_preemptions_total) not in status["missing_metrics"]


def test_triton_selects_by_label_and_converts_milliseconds(endpoint):
    row, status = _scrape(endpoint, "/metrics", TRITON_PAGE)
    assert status["dialect"] == "triton"
    assert row[M.num_requests_waiting] == 2 and row[M.num_requests_running] == 9
    assert row[M.kv_cache_usage_perc] == pytest.approx(0.5)
    assert row[M.engine_kv_capacity_tokens] == 6239 * 64
    first = row[M.time_to_first_token_seconds]
    assert first["count"] == 100 and first["p50"] == pytest.approx(0.1 * 50 / 70)  # 100 ms bucket, in seconds
    assert first["mean"] == pytest.approx((80 * 70 + 300 * 30) / 100 / 1000)
    assert row["model"] == "tensorrt_llm"
    assert _name(M.inter_token_latency_seconds) in status["lacks"]


def test_nim_unprefixed_names(endpoint):
    row, status = _scrape(endpoint, "/v1/metrics", NIM_PAGE)
    assert status["dialect"] == "nim"
    assert row[M.num_requests_running] == 5 and row[M.kv_cache_usage_perc] == pytest.approx(0.25)
    assert row[M.prompt_tokens_total] == 7000 and row[M.time_to_first_token_seconds]["count"] == 10
    assert _name(M.num_preemptions_total) in status["lacks"]


def test_llamacpp_and_its_kv_occupancy_from_slots(endpoint):
    row, status = _scrape(endpoint, "/metrics", LLAMACPP_PAGE)
    assert status["dialect"] == "llamacpp"
    assert row[M.num_requests_running] == 2 and row[M.num_requests_waiting] == 5
    assert row[M.prompt_tokens_total] == 5120 and row[M.generation_tokens_total] == 2048
    assert _name(M.time_to_first_token_seconds) in status["lacks"]
    assert M.kv_cache_usage_perc not in row and status["slots_error"]  # no /slots (started without --slots)
    # GET /slots of a 4-slot server, two busy (the shape of tools/server's slot JSON).
    slots = [{"id": 0, "n_ctx": 4096, "is_processing": True, "n_prompt_tokens_processed": 1000,
              "next_token": [{"n_decoded": 24}]},
             {"id": 1, "n_ctx": 4096, "is_processing": True, "n_prompt_tokens_processed": 3000,
              "next_token": [{"n_decoded": 72}]},
             {"id": 2, "n_ctx": 4096, "is_processing": False, "n_prompt_tokens_processed": 900,
              "next_token": [{"n_decoded": 3}]},
             {"id": 3, "n_ctx": 4096, "is_processing": False}]
    # The probe reads /slots next to /metrics when the page has no KV gauge.
    endpoint.pages["/slots"] = json.dumps(slots)
    row = EngineScrapeProbe(endpoint.base + "/metrics").sample(2.0)[0].rows[0]
    assert row[M.kv_cache_usage_perc] == pytest.approx(0.25) and row[M.engine_kv_capacity_tokens] == 4 * 4096
    held, capacity, usage = engine_dialects.slots_kv_usage(slots)
    assert (held, capacity) == (4096.0, 4 * 4096.0) and usage == pytest.approx(0.25)
    assert engine_dialects.slots_kv_usage({"slots": [{"n_ctx": 10, "n_past": 5}]})[2] == pytest.approx(0.5)
    assert engine_dialects.slots_kv_usage([{"id": 0}]) is None and engine_dialects.slots_kv_usage("x") is None


def test_tgi_is_read(endpoint):
    row, status = _scrape(endpoint, "/metrics", TGI_PAGE)
    assert status["dialect"] == "tgi"
    assert row[M.num_requests_waiting] == 12 and row[M.num_requests_running] == 16
    assert row[M.request_queue_time_seconds]["count"] == 50
    assert TGI_BOUNDS[20] < row[M.request_queue_time_seconds]["p50"] <= TGI_BOUNDS[21]  # the bucket of 0.5 s
    assert row[M.e2e_request_latency_seconds]["count"] == 50
    assert _name(M.time_to_first_token_seconds) in status["lacks"]
    assert _name(M.kv_cache_usage_perc) in status["lacks"]


@pytest.mark.parametrize("names,dialect", [
    (["vllm:kv_cache_usage_perc", "vllm:num_requests_running"], "vllm"),
    (["vllm:gpu_cache_usage_perc", "vllm:num_requests_running"], "vllm-v0"),
    (["sglang:num_queue_reqs"], "sglang"),
    (["trtllm_num_requests_running"], "trtllm"),
    (["nv_inference_request_success", "nv_gpu_utilization"], "triton"),
    (["num_requests_running", "gpu_cache_usage_perc"], "nim"),
    (["llamacpp:requests_processing"], "llamacpp"),
    (["tgi_queue_size"], "tgi"),
    (["python_gc_objects_collected_total"], None),
])
def test_detect(names, dialect):
    assert engine_dialects.detect(names) == dialect


def test_every_dialect_cites_its_source_and_every_column_is_in_the_catalog():
    for d in engine_dialects.DIALECTS.values():
        assert "/" in d.source and d.metrics_path.startswith("/")
        for s in d.series:
            assert s.column is None or s.column in CATALOG
            assert s.type in ("gauge", "counter", "histogram")
            assert list(s.buckets) == sorted(s.buckets)
        for column in d.lacks:
            assert column in engine_dialects.VOCABULARY
        # Every vocabulary column is either filled or said to be missing, with a reason.
        assert set(engine_dialects.VOCABULARY) <= d.fills() | set(engine_dialects.missing(d))


# vllm/v1/metrics/loggers.py: cache_config_info carries the pool's size in its labels; the residency
# histograms (--kv-cache-metrics) share one bucket list.
VLLM_KV_RESIDENCY = [0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600,
                     1200, 1800]
_VL = 'engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"'
VLLM_EXTRAS_PAGE = f"""\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{{_VL}}} 3.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{{_VL}}} 0.4
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{{block_size="16",cache_dtype="auto",{_VL},gpu_memory_utilization="0.9",num_gpu_blocks="27000"}} 1
""" + hist("vllm:kv_block_lifetime_seconds", _VL, VLLM_KV_RESIDENCY, [0.5] * 30 + [40.0] * 10) \
    + hist("vllm:kv_block_reuse_gap_seconds", _VL, VLLM_KV_RESIDENCY, [3.0] * 20) \
    + hist("vllm:request_decode_time_seconds", _VL, TRT_TTFT, [4.0] * 5)


def test_vllm_capacity_from_cache_config_and_its_kv_residency_histograms(endpoint):
    row, status = _scrape(endpoint, "/metrics", VLLM_EXTRAS_PAGE)
    assert status["dialect"] == "vllm"
    assert row[M.engine_kv_capacity_tokens] == 27000 * 16
    life = row[M.kv_block_lifetime_seconds]
    assert life["count"] == 40 and 0.2 < life["p50"] <= 0.5 and 30 < life["p90"] <= 60
    assert row[M.kv_block_reuse_gap_seconds]["count"] == 20
    assert row[M.request_decode_time_seconds]["count"] == 5
    assert _name(M.kv_block_lifetime_seconds) not in status["missing_metrics"]


@pytest.mark.parametrize("args, says", [
    (["engine", "serve", "--device", "sim", "--dialect", "bogus"], "--dialect 'bogus': the reference engine speaks"),
    (["engine", "serve", "--device", "sim", "--dialect", "tgi"], "--dialect 'tgi': the reference engine speaks"),
    (["agent", "--sim", "kv-eviction-storm", "--dialect", "0=vllm,x=sglang"], "give NAME or GPU=NAME"),
    (["agent", "--dialect", "sglang"], "--dialect applies to --sim only"),
])
def test_a_dialect_the_engine_does_not_speak_is_one_line_and_exit_2(cli, tmp_path, args, says):
    # refused at once: an agent that started instead would run until the timeout fails the test
    p = cli(*args, "--store", str(tmp_path / "s.db"), timeout=60) if args[0] == "agent" else cli(*args, timeout=60)
    assert p.returncode == 2, p.stderr
    assert says in p.stderr and "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert not (tmp_path / "s.db").exists()  # refused before anything was opened


@pytest.mark.parametrize("blocks, tokens", [("27000", 27000 * 16), ("None", None), ("", None), ("nan", None),
                                            ("inf", None), ("-5", None), ("0", None), ("1e400", None)])
def test_cache_config_capacity_from_a_recorded_file_and_what_it_refuses(tmp_path, blocks, tokens):
    """vLLM's pool in a recorded scrape (``--file``): num_gpu_blocks x block_size; a label that is no positive
    finite number (vLLM writes "None" before it has sized the pool) gives no capacity, and no error."""
    from gpudiag import file_source

    path = tmp_path / "scrape.om"
    path.write_text(
        "# TYPE vllm:num_requests_running gauge\n"
        f'vllm:num_requests_running{{{_VL}}} 3 1770000000\n'
        f'vllm:num_requests_running{{{_VL}}} 4 1770000001\n'
        "# TYPE vllm:cache_config_info gauge\n"
        f'vllm:cache_config_info{{block_size="16",{_VL},num_gpu_blocks="{blocks}"}} 1 1770000000\n'
        f'vllm:cache_config_info{{block_size="16",{_VL},num_gpu_blocks="{blocks}"}} 1 1770000001\n'
        "# EOF\n")
    window, _ = file_source.load_window([str(path)])
    eng = window.table("engine")
    got = eng[M.engine_kv_capacity_tokens].dropna().unique().tolist() if M.engine_kv_capacity_tokens in eng else []
    assert got == ([tokens] if tokens else [])
    assert eng[M.num_requests_running].dropna().tolist()[-1] == 4
