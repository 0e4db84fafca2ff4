"""A real vLLM fleet through a real Prometheus: the preemption storms are found, the calm runs stay calm.

The 72 InferenceX runs of vLLM V1 on B200 (../shared/data/real/series/inferencex) are written back as
the series vLLM exported (tests/real_vllm.py), backfilled into one Prometheus with each run as its own
scrape target, and each run's window is investigated as ``gpudiag investigate --prometheus URL --node
RUN --from --to`` does it: :func:`gpudiag.promql_source.load_window`, every analyzer of the registry,
the causal chain, the document (one run also through the command line). The scrapes carry no latency
histograms: what the analyzers say, they say from preemptions, KV usage, the queue and token counters.
"""

from __future__ import annotations

import json
import time
import urllib.parse

import pytest
import real_vllm
from prometheus_support import backfilled_prometheus, get_json

from gpudiag import investigate, promql_source
from gpudiag.analyzers.registry import run_all

if not real_vllm.INFERENCEX.is_dir():
    pytest.skip(f"no real vLLM runs at {real_vllm.INFERENCEX} (../shared/data/real is not checked out here)",
                allow_module_level=True)

# The runs that preempt hundreds of times with the KV cache at 100 % (index.csv). tp2_bs512_offloadon
# is one too, cut short: its benchmark ended 70 s into the storm, 70 preemptions at 33 a minute (ten
# times the detection rate) with the cache 99.5 % full and the queue from 0 to 50 in that minute.
STORMS = {"tp1_bs512_offloadon": 1086, "tp1_bs256_offloadon": 883, "tp1_bs512_offloadoff": 848,
          "tp1_bs256_offloadoff": 654, "tp2_bs512_offloadon": 70}
# promtool writes two-hour blocks: every run moved into one block, ending before now.
BLOCK_S = 7200
MARGIN_S = 600
# A range query's last step falls up to one step (about a scrape interval) before --to: each window
# runs a little past its run's last scrape, so that scrape is in it.
END_SLACK_S = 2.0


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """Prometheus over every run's series: (url, {node: (first, last) scrape time})."""
    tmp = tmp_path_factory.mktemp("prom-vllm")
    runs = real_vllm.runs()
    longest = max(r.duration_s for r in runs)
    t0 = (int(time.time() - longest - MARGIN_S) // BLOCK_S) * BLOCK_S
    with open(tmp / "series.om", "w") as fh:
        spans = real_vllm.write_openmetrics(runs, fh, t0)
    # 160 MB of text: removed once it is in the TSDB
    with backfilled_prometheus(tmp, tmp / "series.om", "vllm:num_requests_running", t0 + 60, keep_text=False) as url:
        yield url, spans


@pytest.fixture(scope="module")
def verdicts(fleet):
    """Per run (node name): (run, window, findings, document) of the investigation of its window."""
    url, spans = fleet
    out = {}
    for run in real_vllm.runs():
        first, last = spans[run.node]
        window = promql_source.load_window(url, start=f"{first:.3f}", end=f"{last + END_SLACK_S:.3f}",
                                           node=run.node)
        findings = run_all(window)
        out[run.node] = (run, window, findings, investigate.document(window, findings))
    return out


def _kinds(doc) -> dict[str, list[dict]]:
    by_kind: dict[str, list[dict]] = {}
    for f in doc["findings"]:
        by_kind.setdefault(f["kind"], []).append(f)
    return by_kind


def test_the_series_in_prometheus_hold_what_the_benchmark_measured(fleet, verdicts):
    url, spans = fleet
    at = max(last for _, last in spans.values()) + 1
    span_s = int(at - min(first for first, _ in spans.values())) + 1

    def per_run(expr: str) -> dict[str, float]:
        q = urllib.parse.quote(f"max by (instance) ({expr})")
        got = get_json(f"{url}/api/v1/query?query={q}&time={at:.3f}")["data"]["result"]
        return {r["metric"]["instance"].rsplit(":", 1)[0]: float(r["value"][1]) for r in got}

    kv = per_run(f"max_over_time(vllm:kv_cache_usage_perc[{span_s}s])")
    waiting = per_run(f"max_over_time(vllm:num_requests_waiting[{span_s}s])")
    preempted = per_run(f"max_over_time(vllm:num_preemptions_total[{span_s}s])")
    for node, (run, window, _, _) in verdicts.items():
        assert kv[node] == pytest.approx(run.kv_max_ratio, abs=1e-6), node
        assert waiting[node] == run.waiting_max, node
        assert preempted[node] == run.preemptions, node
        # The window read back for the analyzers: one engine, its counter whole (range queries sample
        # gauges on their step, so a gauge's peak between two steps may fall out of it).
        e = window.table("engine")
        assert set(e["node"]) == {node}, node
        pre = e["num_preemptions_total"].to_numpy(float)
        assert pre[-1] - pre[0] == run.preemptions, node


@pytest.mark.parametrize("node", sorted(STORMS))
def test_a_run_that_preempts_hundreds_of_times_at_a_full_cache_is_a_storm_of_demand_over_capacity(verdicts, node):
    run, _, _, doc = verdicts[node]
    assert run.preemptions == STORMS[node]
    storms = _kinds(doc)["kv_eviction_storm"]
    assert len(storms) == 1, [f["summary"] for f in storms]
    f = storms[0]
    assert f["severity"] in ("warning", "critical"), f["summary"]
    assert f["details"]["cause"] == "demand_over_capacity" and f["details"]["kv_paged"] is True
    assert "paged-kv" not in f["fixes"] and "chunked-kv" not in f["fixes"]
    assert "max-num-seqs" in f["fixes"]
    ev = {e["metric"]: e for e in f["evidence"]}
    assert ev["kv_evictions_per_second_mean"]["observed"] >= ev["kv_evictions_per_second_mean"]["threshold"]
    assert ev["kv_cache_usage_median_ratio"]["observed"] >= 0.99
    assert ev["num_requests_waiting"]["observed"] > ev["num_requests_waiting"]["baseline"]
    assert ev["generation_tokens_per_second"]["observed"] > 0
    assert f["details"]["evictions"] >= 0.95 * run.preemptions
    # No latency histograms were scraped: decode latency is said to be unjudged, not read as fine.
    assert any(m.startswith("decode latency") for m in f["details"]["missing"])
    assert "decode latency not judged" in f["summary"]
    # The storm ran with offload on where the command line turned it on: the KV connector answered.
    assert f["details"]["kv_offload"] == ("on" if "kv_offloading_backend" in run.command else "off")
    assert ("kv-offload" in f["fixes"]) == (f["details"]["kv_offload"] != "on")
    assert doc["worst_severity"] in ("warning", "critical")


def test_the_calm_runs_raise_nothing_of_warning_level_and_no_storm_or_fragmentation(verdicts):
    calm = [node for node, (run, *_) in verdicts.items() if run.preemptions == 0]
    assert len(calm) >= 40
    for node in calm:
        _, _, findings, doc = verdicts[node]
        assert not {"kv_eviction_storm", "memory_fragmentation"} & set(_kinds(doc)), (node, doc["findings"])
        assert doc["worst_severity"] in (None, "info"), (node, [f["summary"] for f in doc["findings"]])
        assert investigate.exit_code(findings) == 0


def test_a_handful_of_preemptions_is_the_capacity_edge_not_a_storm(verdicts):
    handful = [node for node, (run, *_) in verdicts.items() if run.preemptions and node not in STORMS]
    assert len(handful) >= 20
    for node in handful:
        run, _, findings, doc = verdicts[node]
        assert run.preemptions < 20 and run.kv_max_ratio >= 0.9997  # a few, each at a full cache
        assert doc["worst_severity"] in (None, "info"), (node, [f["summary"] for f in doc["findings"]])
        assert not {"kv_eviction_storm", "memory_fragmentation"} & set(_kinds(doc)), node
        assert investigate.exit_code(findings) == 0


def test_the_largest_storm_is_found_by_the_command_line_with_its_exit_code(cli, fleet):
    url, spans = fleet
    first, last = spans["tp1_bs512_offloadon"]
    p = cli("investigate", "--prometheus", url, "--from", f"{first:.3f}", "--to", f"{last + END_SLACK_S:.3f}",
            "--node", "tp1_bs512_offloadon", "--json")
    assert p.returncode == 1, p.stderr
    doc = json.loads(p.stdout)
    storm = _kinds(doc)["kv_eviction_storm"][0]
    assert storm["node"] == "tp1_bs512_offloadon" and storm["details"]["evictions"] >= 1000
    # What the fleet lacks is listed as gaps, with the analyzers it blinds.
    gaps = {g["check"] for g in doc["gaps"]}
    assert "finished requests (TTFT, TPOT)" in gaps and "serving engine" not in gaps
