"""Latency by context length: one bucket definition, gpudiag's by-bucket histograms from request rows."""

from __future__ import annotations

import math

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpudiag import catalog
from gpudiag.catalog import CATALOG, CONTEXT_BUCKETS, M, context_bucket
from gpudiag.exposition import LatestFrames, catalog_samples, encode_text, registry_for
from gpudiag.frames import Frame
from gpudiag.reference_engine import scenarios
from gpudiag.reference_engine.sim.engine import SimEngine

ENGINE = {"node": "node-a", "gpu": 0, "engine": "gpudiag-engine"}


@pytest.mark.parametrize(("tokens", "bucket"), [
    (1, "<=512"), (512, "<=512"), (513, "<=2k"), (2048, "<=2k"), (2049, "<=8k"), (8192, "<=8k"),
    (8193, "<=32k"), (32768, "<=32k"), (32769, ">32k"), (1_000_000, ">32k"),
])
def test_a_request_falls_in_the_bucket_whose_upper_edge_first_holds_its_tokens(tokens, bucket):
    assert context_bucket(tokens) == bucket


def test_unknown_token_counts_have_no_bucket():
    for tokens in (None, math.nan, -1, "300", True):
        assert context_bucket(tokens) is None


def test_the_bucket_labels_are_the_catalogs_edges_in_order():
    assert CONTEXT_BUCKETS == ("<=512", "<=2k", "<=8k", "<=32k", ">32k")
    assert list(catalog.CONTEXT_BUCKET_EDGES_TOKENS) == sorted(catalog.CONTEXT_BUCKET_EDGES_TOKENS)


def request(prompt, output, ttft=0.2, itl=0.03, e2e=3.0, **extra):
    row = {**ENGINE, "request_id": f"r{prompt}-{output}", M.time_to_first_token_seconds: ttft,
           M.inter_token_latency_seconds: itl, M.e2e_request_latency_seconds: e2e, M.request_queue_time_seconds: 0.01}
    if prompt is not None:
        row["prompt_tokens"] = prompt
    if output is not None:
        row["output_tokens"] = output
    return {**row, **extra}


def counts(text: str, name: str) -> dict[tuple, float]:
    """{sorted labels: value} of the ``_count`` samples of one histogram family."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == f"{name}_count":
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


def scrape(latest: LatestFrames) -> str:
    return encode_text(registry_for(latest)).decode()


def test_request_rows_fill_the_by_context_histograms_by_prompt_plus_output_tokens():
    latest = LatestFrames(node="node-a", export_engine_dialect=True)
    latest.update([Frame("request", 1.0, [request(300, 100), request(400, 112), request(1500, 3000, itl=0.2),
                                          request(30000, 5000)])])
    text = scrape(latest)
    by_bucket = counts(text, CATALOG[M.request_inter_token_latency_seconds].name)
    got = {dict(k)["context_bucket"]: v for k, v in by_bucket.items()}
    assert got == {"<=512": 2.0, "<=8k": 1.0, ">32k": 1.0}  # 400 + 112 = 512 is still <=512
    assert all(dict(k)["engine"] == "gpudiag-engine" and dict(k)["gpu"] == "0" for k in by_bucket)
    # vLLM's own histogram of the same observations: one series, no context label, every request
    vllm = counts(text, CATALOG[M.inter_token_latency_seconds].name)
    assert list(vllm.values()) == [4.0] and all("context_bucket" not in dict(k) for k in vllm)
    # the long request's slow decode lands in its own bucket only
    fam = next(f for f in text_string_to_metric_families(text)
               if f.name == CATALOG[M.request_inter_token_latency_seconds].name)
    sums = {s.labels["context_bucket"]: s.value for s in fam.samples if s.name.endswith("_sum")}
    assert sums["<=8k"] == pytest.approx(0.2) and sums["<=512"] == pytest.approx(0.06)


def test_queue_time_has_no_by_context_copy():
    latest = LatestFrames(node="node-a")
    latest.update([Frame("request", 1.0, [request(300, 100)])])
    samples = catalog_samples(latest.snapshot())
    assert set(samples) == set(catalog.BY_CONTEXT.values())


def test_by_context_histograms_are_exported_without_the_engine_dialect():
    latest = LatestFrames(node="node-a")  # the agent beside a real engine: vllm:* come from the engine itself
    latest.update([Frame("request", 1.0, [request(300, 100)])])
    text = scrape(latest)
    assert "vllm:" not in text
    for column in catalog.BY_CONTEXT.values():
        assert list(counts(text, CATALOG[column].name).values()) == [1.0], column


def test_a_request_without_token_counts_is_in_vllms_histogram_but_in_no_bucket():
    latest = LatestFrames(node="node-a", export_engine_dialect=True)
    latest.update([Frame("request", 1.0, [request(None, None), request(300, None), request(300, 100)])])
    text = scrape(latest)
    assert list(counts(text, CATALOG[M.e2e_request_latency_seconds].name).values()) == [3.0]
    assert list(counts(text, CATALOG[M.request_e2e_latency_seconds].name).values()) == [1.0]


def test_a_row_that_names_its_own_bucket_keeps_it():
    latest = LatestFrames(node="node-a")
    latest.update([Frame("request", 1.0, [request(300, 100, context_bucket="<=32k")])])
    got = counts(scrape(latest), CATALOG[M.request_time_to_first_token_seconds].name)
    assert [dict(k)["context_bucket"] for k in got] == ["<=32k"]


def test_the_simulated_storms_requests_reach_the_short_and_long_buckets():
    cfg, wl = scenarios.get("kv-eviction-storm").build()
    a, _ = scenarios.STORM_LONG_PHASE
    wl.duration_s = a + 900  # into the long phase, long enough for long generations to finish
    latest = LatestFrames(node="sim-node")
    finished = 0
    for fr in SimEngine(cfg, wl, seed=0).frames():
        if fr.kind == "request":
            latest.update([fr])
            finished += len(fr.rows)
    got = counts(scrape(latest), CATALOG[M.request_e2e_latency_seconds].name)
    by_bucket = {dict(k)["context_bucket"]: v for k, v in got.items()}
    assert {"<=512", "<=2k", "<=8k"} <= set(by_bucket) <= set(CONTEXT_BUCKETS)
    assert sum(by_bucket.values()) == finished
