"""The engine probe against a real HTTP endpoint speaking vLLM's metric dialect."""

from __future__ import annotations

import pytest
from http_support import PageServer

from gpudiag.catalog import M
from gpudiag.errors import GpudiagError
from gpudiag.probes import engine_scrape
from gpudiag.probes.base import ProbeError
from gpudiag.probes.engine_scrape import EngineScrapeProbe, histogram_quantile

VLLM_V1_PAGE = """\
# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 1234.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-2-7b-hf"} 12.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-2-7b-hf"} 30.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-2-7b-hf"} 0.93
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="meta-llama/Llama-2-7b-hf"} {preemptions}
vllm:num_preemptions_created{engine="0",model_name="meta-llama/Llama-2-7b-hf"} 1.7e9
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="meta-llama/Llama-2-7b-hf"} 51200.0
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="meta-llama/Llama-2-7b-hf"} 20480.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="meta-llama/Llama-2-7b-hf"} {b1}
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.5",model_name="meta-llama/Llama-2-7b-hf"} {b2}
vllm:time_to_first_token_seconds_bucket{engine="0",le="2.5",model_name="meta-llama/Llama-2-7b-hf"} {b3}
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="meta-llama/Llama-2-7b-hf"} {b3}
vllm:time_to_first_token_seconds_count{engine="0",model_name="meta-llama/Llama-2-7b-hf"} {b3}
vllm:time_to_first_token_seconds_sum{engine="0",model_name="meta-llama/Llama-2-7b-hf"} {ttft_sum}
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="meta-llama/Llama-2-7b-hf"} 0.0
"""

VLLM_V0_PAGE = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 3.0
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="m"} 0.5
# TYPE vllm:time_per_output_token_seconds histogram
vllm:time_per_output_token_seconds_bucket{le="0.05",model_name="m"} 8.0
vllm:time_per_output_token_seconds_bucket{le="0.4",model_name="m"} 10.0
vllm:time_per_output_token_seconds_bucket{le="+Inf",model_name="m"} 10.0
vllm:time_per_output_token_seconds_count{model_name="m"} 10.0
vllm:time_per_output_token_seconds_sum{model_name="m"} 0.6
"""

REFERENCE_ENGINE_PAGE = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0"} 4.0
vllm:num_requests_running{engine="1"} 6.0
# TYPE gpudiag_engine_kv_evictions_total counter
gpudiag_engine_kv_evictions_total{engine="0"} 17.0
gpudiag_engine_kv_evictions_total{engine="1"} 0.0
# TYPE gpudiag_engine_serving_state gauge
gpudiag_engine_serving_state{engine="0",state="serving"} 1.0
gpudiag_engine_serving_state{engine="0",state="draining"} 0.0
"""


@pytest.fixture
def endpoint():
    ep = PageServer()
    yield ep
    ep.close()


def _v1(preemptions=5.0, b=(60, 90, 100), ttft_sum=20.0):
    return (VLLM_V1_PAGE.replace("{preemptions}", str(preemptions)).replace("{b1}", str(b[0]))
            .replace("{b2}", str(b[1])).replace("{b3}", str(b[2])).replace("{ttft_sum}", str(ttft_sum)))


def test_a_vllm_endpoint_becomes_an_engine_row(endpoint):
    endpoint.page = _v1()
    probe = EngineScrapeProbe(endpoint.url, engine="replica-a", gpu=3)
    (frame,) = probe.sample(1.0)
    assert frame.kind == "engine"
    (row,) = frame.rows
    assert row["engine"] == "replica-a/0" and row["gpu"] == 3 and row["model"] == "meta-llama/Llama-2-7b-hf"
    assert row[M.num_requests_running] == 12 and row[M.num_requests_waiting] == 30
    assert row[M.kv_cache_usage_perc] == pytest.approx(0.93)
    assert row[M.num_preemptions_total] == 5 and row[M.prompt_tokens_total] == 51200
    ttft = row[M.time_to_first_token_seconds]
    assert ttft["count"] == 100 and ttft["mean"] == pytest.approx(0.2)
    assert ttft["p50"] == pytest.approx(0.1 * 50 / 60)  # inside the first bucket, interpolated
    assert ttft["p90"] == pytest.approx(0.5)
    assert ttft["p99"] == pytest.approx(0.5 + 2.0 * 9 / 10)
    assert "window" not in ttft  # no previous scrape to difference against


def test_the_second_scrape_summarises_the_interval_too(endpoint):
    endpoint.page = _v1()
    probe = EngineScrapeProbe(endpoint.url)
    probe.sample(1.0)
    endpoint.page = _v1(preemptions=9.0, b=(60, 90, 120), ttft_sum=60.0)  # 20 new requests, all slow
    (row,) = probe.sample(2.0)[0].rows
    window = row[M.time_to_first_token_seconds]["window"]
    assert window["count"] == 20 and window["mean"] == pytest.approx(2.0)
    assert 0.5 < window["p50"] <= 2.5
    assert row[M.num_preemptions_total] == 9


def test_unknown_and_missing_metrics_are_tolerated_and_listed(endpoint):
    endpoint.page = _v1()
    probe = EngineScrapeProbe(endpoint.url)
    probe.sample(1.0)
    status = probe.status()
    assert status["available"] is True
    assert "vllm:spec_decode_num_drafts" in status["unknown_metrics"]
    assert "python_gc_objects_collected" in status["unknown_metrics"]
    assert "vllm:prefix_cache_hits_total" in status["missing_metrics"]
    assert "vllm:e2e_request_latency_seconds" in status["missing_metrics"]
    assert "vllm:num_requests_running" not in status["missing_metrics"]
    assert not any(n.startswith("gpudiag_") for n in status["missing_metrics"]), \
        "a real vLLM is not expected to export the reference engine's own metrics"


def test_older_vllm_names_fill_the_same_columns(endpoint):
    endpoint.page = VLLM_V0_PAGE
    probe = EngineScrapeProbe(endpoint.url)
    (row,) = probe.sample(1.0)[0].rows
    assert row[M.kv_cache_usage_perc] == pytest.approx(0.5)
    itl = row[M.inter_token_latency_seconds]
    assert itl["count"] == 10 and itl["p50"] == pytest.approx(0.05 * 5 / 8)
    assert "vllm:kv_cache_usage_perc" not in probe.status()["missing_metrics"]
    assert row["engine"] == endpoint.url.split("/")[2]  # host:port when no name is given


def test_each_engine_on_the_endpoint_gets_its_row_and_gpudiag_metrics_keep_their_labels(endpoint):
    endpoint.page = REFERENCE_ENGINE_PAGE
    probe = EngineScrapeProbe(endpoint.url, engine="ref")
    rows = {r["engine"]: r for r in probe.sample(1.0)[0].rows}
    assert set(rows) == {"ref/0", "ref/1"}
    assert rows["ref/0"][M.num_requests_running] == 4 and rows["ref/1"][M.num_requests_running] == 6
    assert rows["ref/0"][M.engine_kv_evictions_total] == 17
    assert rows["ref/0"][M.engine_serving_state] == {"serving": 1.0, "draining": 0.0}
    assert "gpudiag_engine_batch_size" in probe.status()["missing_metrics"]


def test_an_endpoint_that_is_down_is_a_probe_error(endpoint):
    url = endpoint.url
    endpoint.close()
    probe = EngineScrapeProbe(url, timeout_s=1.0)
    with pytest.raises(ProbeError, match="cannot scrape"):
        probe.sample(1.0)
    assert probe.status()["available"] is False and "cannot scrape" in probe.status()["reason"]


def test_a_page_that_is_not_prometheus_text_is_a_probe_error(endpoint):
    endpoint.page = "<html><body>{not metrics</body></html>\n"
    endpoint.content_type = "text/html"
    with pytest.raises(ProbeError, match="Prometheus text"):
        EngineScrapeProbe(endpoint.url).sample(1.0)


def test_an_oversized_answer_is_refused(endpoint, monkeypatch):
    monkeypatch.setattr(engine_scrape, "MAX_RESPONSE_BYTES", 1024)
    endpoint.page = "# TYPE vllm:num_requests_running gauge\n" + "vllm:num_requests_running 1\n" * 200
    with pytest.raises(ProbeError, match="more than 1024 bytes"):
        EngineScrapeProbe(endpoint.url).sample(1.0)


@pytest.mark.parametrize("url", ["file:///etc/passwd", "ftp://127.0.0.1/metrics", "127.0.0.1:8000/metrics",
                                 "http:///metrics"])
def test_only_http_urls_are_scraped(url):
    with pytest.raises(GpudiagError, match="http"):
        EngineScrapeProbe(url)


def test_histogram_quantile_follows_promql():
    buckets = [(0.1, 50.0), (0.5, 90.0), (float("inf"), 100.0)]
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.1)
    assert histogram_quantile(0.7, buckets) == pytest.approx(0.1 + 0.4 * 20 / 40)
    assert histogram_quantile(0.99, buckets) == pytest.approx(0.5)  # in +Inf: the highest finite bound
    assert histogram_quantile(0.5, [(0.1, 0.0), (float("inf"), 0.0)]) is None
