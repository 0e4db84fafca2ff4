"""`investigate --prometheus` over every engine dialect, in a real Prometheus.

The TSDB is backfilled (``promtool tsdb create-blocks-from openmetrics``) with an hour of one
node serving with SGLang, trtllm-serve, Triton with the TensorRT-LLM backend, NIM, llama.cpp
and TGI side by side (each its own scrape target), named as each engine names its series
(names, labels and bucket bounds from its source, see gpudiag/probes/engine_dialects.py).
SGLang goes through a retraction storm at a full KV cache: the analyzer that finds vLLM's
preemption storm finds SGLang's.
"""

from __future__ import annotations

import json

import pytest
from prometheus_support import cumulative, prometheus_over_span, window_args

from gpudiag import promql_source as P
from gpudiag.catalog import M

NODE = "serve-node-3"
SAMPLE_S = 15
SPAN_S = 3600
STORM = (1500, 2700)
SGLANG_ITL = (0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060, 0.080, 0.100,
              0.200, 0.400, 0.600, 0.800, 1.000, 2.000, 4.000, 6.000, 8.000)
TRITON_FIRST_MS = (100, 500, 2000, 5000)
TARGETS = {"sglang": f"{NODE}:30000", "trtllm": f"{NODE}:8000", "triton": f"{NODE}:8002", "nim": f"{NODE}:8003",
           "llamacpp": f"{NODE}:8080", "tgi": f"{NODE}:3000"}


def _storm(o: int) -> bool:
    return STORM[0] <= o < STORM[1]


def _openmetrics(t0: int) -> list[str]:
    offsets = range(0, SPAN_S, SAMPLE_S)
    out: list[str] = []

    def target(dialect: str, extra: str = "") -> str:
        return f'instance="{TARGETS[dialect]}",job="{dialect}"' + ("," + extra if extra else "")

    def family(name: str, kind: str, labels: str, value, suffix: str = "", typed: bool = True) -> None:
        if typed:
            out.append(f"# TYPE {name} {kind}")
        for o in offsets:
            out.append(f"{name}{suffix}{{{labels}}} {value(o)} {t0 + o}")

    def histogram(name: str, labels: str, bounds, per_sample) -> None:
        """per_sample(o) -> observations in that interval."""
        out.append(f"# TYPE {name} histogram")
        counts = [0] * (len(bounds) + 1)
        total = 0.0
        rows: dict[str, list[str]] = {}
        for o in offsets:
            obs = per_sample(o)
            for x in obs:
                for i, b in enumerate(list(bounds) + [float("inf")]):
                    if x <= b:
                        counts[i] += 1  # counts per bucket; the cumulative counts are written below
                        break
            total += sum(obs)
            running = 0
            for i, le in enumerate([repr(float(b)) for b in bounds] + ["+Inf"]):
                running += counts[i]
                rows.setdefault(le, []).append(f'{name}_bucket{{{labels},le="{le}"}} {running} {t0 + o}')
            rows.setdefault("_count", []).append(f"{name}_count{{{labels}}} {sum(counts)} {t0 + o}")
            rows.setdefault("_sum", []).append(f"{name}_sum{{{labels}}} {total:g} {t0 + o}")
        for lines in rows.values():
            out.extend(lines)

    # SGLang: scheduler series with rank labels, tokenizer series with model_name only.
    sgs = target("sglang", 'engine_type="unified",model_name="qwen3-8b",moe_ep_rank="0",pp_rank="0",tp_rank="0"')
    sgt = target("sglang", 'model_name="qwen3-8b"')
    family("sglang:num_running_reqs", "gauge", sgs, lambda o: 64 if _storm(o) else 40)
    family("sglang:num_queue_reqs", "gauge", sgs, lambda o: 25 if _storm(o) else 0)
    family("sglang:token_usage", "gauge", sgs, lambda o: 0.99 if _storm(o) else 0.55)
    family("sglang:max_total_num_tokens", "gauge", sgs, lambda o: 412000)
    family("sglang:num_retracted_requests", "counter", sgs, cumulative(offsets, lambda o: 3 if _storm(o) else 0),
           suffix="_total")
    family("sglang:prompt_tokens", "counter", sgt, cumulative(offsets, lambda o: 12000), suffix="_total")
    family("sglang:generation_tokens", "counter", sgt, cumulative(offsets, lambda o: 4500), suffix="_total")
    family("sglang:cached_tokens", "counter", sgt, cumulative(offsets, lambda o: 6000), suffix="_total")
    histogram("sglang:inter_token_latency_seconds", sgt, SGLANG_ITL,
              lambda o: [0.3] * 60 + [0.05] * 40 if _storm(o) else [0.009] * 95 + [0.03] * 5)
    # trtllm-serve: KV full, no preemption counter at all.
    tr = target("trtllm", 'engine_type="trtllm",model_name="nemotron-nano-3"')
    family("trtllm_num_requests_running", "gauge", tr, lambda o: 31)
    family("trtllm_num_requests_waiting", "gauge", tr, lambda o: 4)
    family("trtllm_kv_cache_utilization", "gauge", tr, lambda o: 0.97)
    family("trtllm_prompt_tokens", "counter", tr, cumulative(offsets, lambda o: 9000), suffix="_total")
    # Triton: label-selected gauges; first response in milliseconds.
    tt = target("triton", 'model="tensorrt_llm",version="1"')
    out.append("# TYPE nv_trt_llm_request_metrics gauge")
    for rtype, v in (("waiting", 2), ("scheduled", 9), ("max", 512)):
        family("nv_trt_llm_request_metrics", "gauge", f'{tt},request_type="{rtype}"', lambda o, v=v: v, typed=False)
    out.append("# TYPE nv_trt_llm_kv_cache_block_metrics gauge")
    family("nv_trt_llm_kv_cache_block_metrics", "gauge", f'{tt},kv_cache_block_type="fraction"', lambda o: 0.5,
           typed=False)
    histogram("nv_inference_first_response_histogram_ms", tt, TRITON_FIRST_MS, lambda o: [80] * 7 + [300] * 3)
    # NIM, llama.cpp, TGI: their queue and batch.
    family("num_requests_waiting", "gauge", target("nim", 'model_name="meta/llama-3.1-8b-instruct"'), lambda o: 1)
    family("gpu_cache_usage_perc", "gauge", target("nim", 'model_name="meta/llama-3.1-8b-instruct"'), lambda o: 0.25)
    family("llamacpp:requests_deferred", "gauge", target("llamacpp"), lambda o: 5)
    family("llamacpp:requests_processing", "gauge", target("llamacpp"), lambda o: 2)
    family("tgi_queue_size", "gauge", target("tgi"), lambda o: 12)
    family("tgi_batch_current_size", "gauge", target("tgi"), lambda o: 16)
    return out


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """Prometheus over the backfilled hour: (url, first sample time)."""
    with prometheus_over_span(tmp_path_factory, "prom-dialects", _openmetrics, SPAN_S, "tgi_queue_size") as got:
        yield got


def test_every_dialect_becomes_an_engine_of_its_own(engines):
    url, t0 = engines
    window = P.load_window(url, start=str(t0), end=str(t0 + SPAN_S - SAMPLE_S), node=NODE)
    engine = window.table("engine")
    rows = {e: df for e, df in engine.groupby("engine")}
    assert set(rows) == set(TARGETS.values())  # one engine per scrape target
    last = {e: df.iloc[-1] for e, df in rows.items()}
    sg = last[TARGETS["sglang"]]
    assert sg[M.num_requests_running] == 40 and sg[M.kv_cache_usage_perc] == pytest.approx(0.55)
    assert sg[M.engine_kv_capacity_tokens] == 412000
    assert sg[M.prefix_cache_queries_total] > sg[M.prefix_cache_hits_total] > 0
    storm = rows[TARGETS["sglang"]]
    assert storm[M.num_preemptions_total].max() == 3 * (STORM[1] - STORM[0]) // SAMPLE_S
    itl = storm[M.inter_token_latency_seconds].dropna().iloc[-1]["window"]
    assert itl["p50"] < 0.01  # healthy again after the storm
    tr = last[TARGETS["trtllm"]]
    assert tr[M.num_requests_running] == 31 and tr[M.kv_cache_usage_perc] == pytest.approx(0.97)
    assert M.num_preemptions_total not in rows[TARGETS["trtllm"]] or \
        rows[TARGETS["trtllm"]][M.num_preemptions_total].isna().all()
    tt = last[TARGETS["triton"]]
    assert tt[M.num_requests_waiting] == 2 and tt[M.num_requests_running] == 9
    first = rows[TARGETS["triton"]][M.time_to_first_token_seconds].dropna().iloc[-1]["window"]
    assert 0.0 < first["p50"] <= 0.1  # 100 ms bucket, read in seconds
    assert last[TARGETS["nim"]][M.kv_cache_usage_perc] == pytest.approx(0.25)
    assert last[TARGETS["llamacpp"]][M.num_requests_waiting] == 5
    assert last[TARGETS["tgi"]][M.num_requests_running] == 16


def test_sglangs_retraction_storm_is_the_eviction_storm(cli, engines):
    url, t0 = engines
    p = cli("investigate", "--prometheus", url, *window_args(t0, SPAN_S - SAMPLE_S), "--node", NODE, "--json")
    assert p.returncode == 1, p.stderr
    doc = json.loads(p.stdout)
    storms = [f for f in doc["findings"] if f["kind"] == "kv_eviction_storm"]
    assert storms, [f["kind"] for f in doc["findings"]]
    storm = storms[0]
    assert t0 + STORM[0] - 120 <= storm["start_s"] and storm["end_s"] <= t0 + STORM[1] + 120
    ev = {e["metric"]: e for e in storm["evidence"]}
    assert ev["kv_cache_usage_perc"]["observed"] == pytest.approx(0.99)


def test_an_engine_without_a_preemption_counter_is_said_to_be_unjudged_not_guessed(engines):
    """trtllm-serve at a 97 % full KV cache: no preemption counter, so the storm analyzer cannot run."""
    from gpudiag.analyzers.registry import coverage
    from gpudiag.frames import Window

    url, t0 = engines
    window = P.load_window(url, start=str(t0), end=str(t0 + SPAN_S - SAMPLE_S), node=NODE)
    engine = window.table("engine")
    trt = engine[engine["engine"] == TARGETS["trtllm"]].dropna(axis=1, how="all").reset_index(drop=True)
    alone = Window({"engine": trt}, window.start_s, window.end_s, NODE, window.sources, [])
    not_run = {n["analyzer"]: n for n in coverage(alone)["not_run"]}
    storm = not_run["kv_eviction_storm"]
    assert storm["reason"] == "missing_input"
    assert M.num_preemptions_total in storm["detail"]
