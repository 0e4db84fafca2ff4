"""SCENARIOS.md §1 on the simulated GPU: the storm emerges from the mechanism, and paged KV removes it."""

import numpy as np
import pytest

from gpudiag import repro
from gpudiag.catalog import M
from gpudiag.reference_engine import scenarios


@pytest.fixture(scope="module")
def storm(scenario_run):
    res = scenario_run("kv-eviction-storm")
    return res, repro.document(res)


@pytest.fixture(scope="module")
def paged(scenario_run):
    res = scenario_run("kv-eviction-storm", "paged-kv")
    return res, repro.document(res)


def phases(doc):
    return {p["name"]: p for p in doc["phases"]}


def test_the_long_phase_brings_allocation_failures_and_evictions_that_calm_phases_do_not(storm):
    _, doc = storm
    ph = phases(doc)
    assert ph["before"]["evictions"] == 0 and ph["before"]["alloc_failures"] == 0
    assert ph["during"]["alloc_failures"] > 100
    assert ph["during"]["evictions"] > 50
    assert ph["after"]["evictions"] < ph["during"]["evictions"] / 2


def test_latency_comes_back_within_minutes_of_the_long_phase_and_paged_kv_never_leaves(storm, paged):
    # The field's storm "self-recovers" when the mix turns short again: the queue it left drains.
    ph = phases(storm[1])
    assert ph["before"]["recovered_after_s"] is None  # the reference
    assert ph["during"]["recovered_after_s"] is None  # not within the phase
    assert 0 < ph["after"]["recovered_after_s"] <= 1200  # seed 0: 6 min; seeds 1 and 2: 15 and 19
    fixed = phases(paged[1])
    assert fixed["during"]["recovered_after_s"] == 0 and fixed["after"]["recovered_after_s"] == 0


def test_the_load_stays_the_same_across_phases(storm):
    _, doc = storm
    qps = [p["qps"] for p in doc["phases"]]
    assert max(qps) / min(qps) < 1.05


def test_decode_latency_rises_while_time_to_first_token_stays_near_normal(storm):
    _, doc = storm
    ph = phases(doc)
    before, during = ph["before"]["slo"], ph["during"]["slo"]
    assert during["tpot_p99_s"] >= 1.5 * before["tpot_p99_s"]
    assert during["tpot_p999_s"] >= 1.7 * before["tpot_p999_s"]
    assert during["ttft_p50_s"] <= 1.5 * before["ttft_p50_s"]
    assert ph["after"]["slo"]["tpot_p50_s"] <= 1.1 * before["tpot_p50_s"]


def test_what_rises_in_time_to_first_token_is_queue_time_the_prefill_itself_stays_near_normal(storm):
    # The field: "prefill times stay normal". TTFT splits into the wait for room and the prefill;
    # in the storm the wait is what grows.
    res, doc = storm
    req = res.window.table("request")
    split = req[M.request_queue_time_seconds] + req[M.request_prefill_time_seconds]
    assert np.allclose(split, req[M.time_to_first_token_seconds], atol=1e-9)
    ph = phases(doc)
    before, during = ph["before"]["slo"], ph["during"]["slo"]
    assert during["prefill_p99_s"] <= 2.0 * before["prefill_p99_s"]
    assert during["queue_p99_s"] >= 10 * before["queue_p99_s"]
    # and the analyzer says so
    ttft = [f for f in res.findings if f.kind == "latency_regression" and M.time_to_first_token_seconds
            in f.details["metrics"]]
    assert ttft and all(f.details["ttft_cause"] == "queue" for f in ttft)


def test_fragmentation_is_found_with_a_failed_request_larger_than_the_largest_hole(storm):
    res, _ = storm
    frag = [f for f in res.findings if f.kind == "memory_fragmentation"]
    assert frag, "no memory_fragmentation finding"
    a, b = scenarios.STORM_LONG_PHASE
    assert all(a <= f.start_s <= b + 300 for f in frag)
    worst = max(frag, key=lambda f: f.details["failures_with_free_memory"])
    ev = {e.metric: e for e in worst.evidence}
    failed = ev["engine_kv_failed_request_bytes"].observed
    assert failed > ev["process_torch_largest_free_block_bytes"].observed
    assert ev["process_reserved_minus_allocated_bytes"].observed >= failed
    assert ev["process_torch_external_fragmentation_ratio"].observed >= 0.5


def test_an_eviction_storm_is_found_and_traced_back_to_fragmentation(storm):
    res, _ = storm
    storms = [f for f in res.findings if f.kind == "kv_eviction_storm"]
    assert len(storms) >= 1
    s = storms[0]
    a, b = scenarios.STORM_LONG_PHASE
    assert a <= s.start_s and s.end_s <= b + 600
    frag_ids = {f.id for f in res.findings if f.kind == "memory_fragmentation"}
    assert set(s.caused_by) & frag_ids
    ev = {e.metric: e for e in s.evidence}
    assert ev["tpot_p99_seconds"].observed > ev["tpot_p99_seconds"].baseline
    assert ev["recomputed_token_share"].observed >= 0.05
    # Utilization swings harder during the storm than outside it.
    osc = ev["gpu_utilization_oscillation_ratio"]
    assert osc.observed >= 1.5 * osc.baseline
    # The chain puts the root cause first.
    kinds = [f.kind for f in res.findings]
    assert kinds.index("memory_fragmentation") < kinds.index("kv_eviction_storm")


def _longest_reported(phase):
    """(bucket, numbers) of the longest context bucket with percentiles in a phase."""
    reported = [(b, v) for b, v in phase["by_context"].items() if v["tpot_p99_s"] is not None]
    return reported[-1]


def test_the_long_sequences_decode_several_times_slower_in_the_storm_and_paged_kv_restores_them(storm, paged):
    # SCENARIOS.md §1: "decode time per token ~50 ms -> >400 ms, long-sequence requests only".
    ph, fixed = phases(storm[1]), phases(paged[1])
    before = ph["before"]["slo"]["tpot_p99_s"]
    bucket, long_during = _longest_reported(ph["during"])
    assert bucket not in ph["before"]["by_context"] or ph["before"]["by_context"][bucket]["tpot_p99_s"] is None
    assert long_during["tpot_p99_s"] >= 3 * before
    assert long_during["tpot_p50_s"] <= 1.5 * ph["during"]["slo"]["tpot_p50_s"]  # a tail of evicted ones
    assert fixed["during"]["by_context"][bucket]["tpot_p99_s"] <= 1.5 * before


def test_a_context_bucket_of_few_requests_reports_its_count_and_no_percentiles(storm):
    for p in storm[1]["phases"]:
        for v in p["by_context"].values():
            assert v["requests"] > 0
            assert (v["tpot_p99_s"] is None) == (v["requests"] < repro.MIN_BUCKET_REQUESTS)
    assert sum(v["requests"] for v in phases(storm[1])["during"]["by_context"].values()) \
        == phases(storm[1])["during"]["requests"]


def test_paged_kv_removes_the_storm_and_keeps_decode_latency_close_to_normal(paged):
    res, doc = paged
    assert doc["totals"]["evictions"] == 0
    assert doc["totals"]["alloc_failures"] == 0
    assert not [f for f in res.findings if f.kind in ("kv_eviction_storm", "memory_fragmentation")]
    before = phases(doc)["before"]["slo"]
    assert doc["slo"]["tpot_p999_s"] <= 1.5 * before["tpot_p99_s"]


def test_the_document_has_the_documented_schema(storm):
    _, doc = storm
    for key in ("scenario", "fix", "seed", "slo", "phases", "totals", "findings"):
        assert key in doc
    slo_keys = {"ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "tpot_p999_s", "e2e_p99_s",
                "queue_p99_s", "prefill_p99_s"}
    assert slo_keys <= set(doc["slo"])
    assert [p["name"] for p in doc["phases"]] == ["before", "during", "after"]
    for p in doc["phases"]:
        assert {"name", "start_s", "end_s", "slo", "gpu_util_mean", "gpu_util_min", "gpu_util_max",
                "evictions", "alloc_failures"} <= set(p)
        assert slo_keys <= set(p["slo"])
    assert {"requests", "evictions", "recomputed_tokens", "alloc_failures", "num_alloc_retries",
            "num_ooms"} <= set(doc["totals"])
    for f in doc["findings"]:
        assert {"id", "kind", "severity", "start_s", "end_s", "gpu", "summary", "evidence", "caused_by",
                "runbook", "fixes"} <= set(f)
        assert f["severity"] in ("critical", "warning", "info")
        for e in f["evidence"]:
            assert {"metric", "observed", "baseline", "threshold"} <= set(e)
        sc = scenarios.get(doc["scenario"])
        assert set(f["fixes"]) <= set(sc.fixes)


def test_the_kv_managers_store_exactly_the_tokens_the_sequences_hold():
    from gpudiag.reference_engine.sim.engine import SimEngine

    for fix in (None, "paged-kv", "chunked-kv"):
        cfg, wl = scenarios.get("kv-eviction-storm").build(fix)
        wl.duration_s = 120
        eng = SimEngine(cfg, wl, seed=0)
        for _ in eng.frames():
            running = eng.sched.running
            assert eng.kv.live_tokens == sum(s.num_tokens for s in running), fix


def test_a_recomputed_sequence_stores_its_tokens_and_no_more():
    """Across evictions and recompute, stored KV matches the running sequences, and the paged pool never
    hands out more blocks than it has."""
    from gpudiag.reference_engine.sim.engine import SimEngine

    long_phase = scenarios.STORM_LONG_PHASE[0]
    # Contiguous KV evicts in the long phase; so does a paged pool on 40 % of the card (about 9 GiB of KV).
    start, end = long_phase, long_phase + 900
    for fix, fraction in ((None, None), ("paged-kv", 0.4)):
        cfg, wl = scenarios.get("kv-eviction-storm").build(fix)
        if fraction is not None:
            cfg.layout.memory_fraction = fraction
        wl.duration_s = end
        eng = SimEngine(cfg, wl, seed=0)
        recomputed = 0
        for fr in eng.frames():
            if fr.t < start:
                continue
            running = eng.sched.running
            recomputed += sum(1 for s in running if s.preemptions)
            assert eng.kv.live_tokens == sum(s.num_tokens for s in running), (fix, fr.t)
            if fix == "paged-kv":
                assert eng.kv.free_blocks >= 0, fr.t
        assert recomputed > 0, f"{fix}: no recomputed sequence ran in the window checked"


def test_priority_tiers_move_the_evictions_onto_the_batch_tier(storm, scenario_run):
    """SCENARIOS.md §1 fix 2 is a mitigation: fragmentation stays, but paying traffic is no longer evicted."""
    def preempted_by_tier(res):
        req = res.window.table("request")
        long_phase = req[(req["arrival_s"] >= scenarios.STORM_LONG_PHASE[0])
                         & (req["arrival_s"] < scenarios.STORM_LONG_PHASE[1])]
        return {tier: int((g["preemptions"] > 0).sum()) for tier, g in long_phase.groupby("tier")}

    before = preempted_by_tier(storm[0])
    after = preempted_by_tier(scenario_run("kv-eviction-storm", "priority-eviction"))
    assert before["vip"] > 0 and before["internal"] > 0
    assert after["vip"] == 0
    assert after["internal"] <= before["internal"] / 10
    assert after["batch"] > before["batch"]


# --- vLLM's counters alone: no latency histograms, no recompute count ------------------------------
# A vLLM engine as a Prometheus scrape gives it: preemptions, KV usage, queue and token counters.

NODE = "vllm-node"
MINUTE = 60


def vllm_window(n, preempt_every=None, storm=(0, 0), kv=0.7, storm_kv=0.997, waiting=lambda t, s: 0.0,
                gen_per_s=lambda t, s: 3000.0, **counters):
    """``n`` seconds of one vLLM engine; in ``storm`` one preemption every ``preempt_every`` seconds at
    ``storm_kv`` KV usage. ``waiting`` and ``gen_per_s`` take (t, in_storm); ``counters`` maps a column to
    its per-second increase."""
    from gpudiag.frames import Window

    rows, preempted, generated, totals = [], 0.0, 0.0, dict.fromkeys(counters, 0.0)
    for t in range(1, n + 1):
        in_storm = storm[0] <= t < storm[1]
        if in_storm and preempt_every and t % preempt_every == 0:
            preempted += 1
        generated += gen_per_s(t, in_storm)
        for col, per_s in counters.items():
            totals[col] += per_s
        rows.append({"t": float(t), "node": NODE, "engine": "0", M.num_preemptions_total: preempted,
                     M.kv_cache_usage_perc: storm_kv if in_storm else kv, M.num_requests_running: 200.0,
                     M.num_requests_waiting: waiting(t, in_storm), M.generation_tokens_total: generated,
                     **totals})
    return Window.from_rows({"engine": rows}, start_s=1.0, end_s=float(n), node=NODE)


def storms(window):
    from gpudiag.analyzers import kv_eviction_storm

    return [f for f in kv_eviction_storm.analyze(window) if f.kind == "kv_eviction_storm"]


def growing_queue(t, in_storm):
    return min(200.0, (t - 600) / 2) if in_storm else 0.0


def test_a_preemption_storm_at_a_full_kv_cache_is_found_on_vllm_counters_alone_and_says_what_it_lacked():
    from gpudiag.analyzers import kv_eviction_storm as S

    # Thirty preemptions a minute for fifteen minutes at a KV cache 99.7 % full, the queue growing to 200,
    # generation down a fifth: a storm, judged without any latency figure.
    w = vllm_window(1800, preempt_every=2, storm=(600, 1500), waiting=growing_queue,
                    gen_per_s=lambda t, s: 2400.0 if s and t >= 660 else 3000.0,
                    **{M.prefix_cache_queries_total: 5000.0, M.prefix_cache_hits_total: 2500.0})
    (f,) = storms(w)
    assert f.severity.value == "warning"
    # Rates look back a minute: the episode may start that far before its detection and end that far
    # after the last preemption.
    assert 600 - S.RATE_WINDOW_S <= f.start_s <= 600 and 1490 <= f.end_s <= 1500 + S.RATE_WINDOW_S
    ev = {e.metric: e for e in f.evidence}
    # 0.5 a second while it lasts; the minute each end of the episode dilutes the mean a little.
    assert 0.8 * 0.5 <= ev["kv_evictions_per_second_mean"].observed <= 0.5
    assert ev["kv_cache_usage_median_ratio"].observed == pytest.approx(0.997)
    assert ev[M.num_requests_waiting].observed == 200 and ev[M.num_requests_waiting].baseline == 0
    assert ev["generation_tokens_per_second"].observed == pytest.approx(2400)
    assert ev["generation_tokens_per_second"].baseline == pytest.approx(3000)
    # What it could not see is said, not silently read as fine.
    assert ev["tpot_p99_seconds"].observed != ev["tpot_p99_seconds"].observed  # NaN: not measured
    assert ev["recomputed_token_share"].observed is None
    missing = " | ".join(f.details["missing"])
    assert "decode latency not judged" in missing and "recomputed tokens" in missing
    assert "decode latency not judged" in f.summary
    # vLLM pages its KV: demand exceeded capacity, and paging is no fix.
    assert f.details["cause"] == S.CAUSE_DEMAND and f.details["kv_paged"] is True
    assert "not fragmentation" in f.summary
    assert "paged-kv" not in f.fixes and "chunked-kv" not in f.fixes
    assert f.fixes[:2] == ["max-num-seqs", "max-num-batched-tokens"]
    assert f.fixes[-1] == "max-model-len"


def test_throughput_halved_while_requests_wait_makes_the_storm_critical_and_an_empty_queue_does_not():
    halved = lambda t, s: 1200.0 if s and t >= 660 else 3000.0  # noqa: E731
    (f,) = storms(vllm_window(1800, preempt_every=2, storm=(600, 1500), waiting=growing_queue, gen_per_s=halved))
    assert f.severity.value == "critical"
    assert f.details["generation_throughput_ratio"] == pytest.approx(0.4, abs=0.05)
    # The same fall with nobody waiting is demand going away, not harm.
    (f,) = storms(vllm_window(1800, preempt_every=2, storm=(600, 1500), gen_per_s=halved))
    assert f.severity.value == "warning"


def test_a_handful_of_preemptions_at_a_full_cache_is_the_capacity_edge_not_a_storm():
    # Twelve preemptions in a quarter of an hour, three within a minute every four minutes, the
    # cache full throughout: the detection rate is reached again and again (one episode, its gaps
    # merged), but a preemption a minute is an engine at its edge, not preemption as a steady state.
    from gpudiag.analyzers import kv_eviction_storm as S
    from gpudiag.analyzers.common import episodes, windowed_rate
    from gpudiag.frames import Window

    bursts = [b + k for b in (100, 340, 580, 820) for k in (0, 20, 40)]
    rows = []
    for t in range(1, 1801):
        rows.append({"t": float(t), "node": NODE, "engine": "0",
                     M.num_preemptions_total: float(sum(1 for p in bursts if p <= t)),
                     M.kv_cache_usage_perc: 1.0, M.num_requests_waiting: 30.0,
                     M.generation_tokens_total: 3000.0 * t})
    t = np.array([r["t"] for r in rows])
    rate = windowed_rate(t, np.array([r[M.num_preemptions_total] for r in rows]), S.RATE_WINDOW_S)
    assert len(episodes(t, rate >= S.EVICTION_RATE_THRESHOLD, S.MERGE_GAP_S, S.MIN_DURATION_S)) == 1
    w = Window.from_rows({"engine": rows}, start_s=1.0, end_s=1800.0, node=NODE)
    assert storms(w) == []


def test_no_preemption_is_no_finding_even_with_a_full_cache_and_a_queue():
    w = vllm_window(1800, storm=(600, 1500), waiting=growing_queue)
    assert storms(w) == []


def test_sustained_preemptions_at_a_pool_that_is_not_full_make_no_storm_without_other_harm():
    # Nothing measured says it hurts: no latency, no recompute, and KV usage far from the limit.
    assert storms(vllm_window(1800, preempt_every=2, storm=(600, 1500), storm_kv=0.8)) == []


def test_prefix_caching_comes_first_when_off_and_offload_is_not_offered_when_seen_on():
    # No prefix-cache lookups: the engine does not share prompt prefixes; the KV connector answers
    # lookups: KV offload is on already.
    (f,) = storms(vllm_window(1800, preempt_every=2, storm=(600, 1500),
                              **{M.external_prefix_cache_queries_total: 800.0}))
    assert f.fixes[0] == "prefix-caching"
    assert f.details["kv_offload"] == "on" and "kv-offload" not in f.fixes
    # Without the connector's series, offload may or may not be on: offered, and said to be unknown.
    (f,) = storms(vllm_window(1800, preempt_every=2, storm=(600, 1500),
                              **{M.prefix_cache_queries_total: 5000.0, M.prefix_cache_hits_total: 100.0}))
    assert f.details["kv_offload"] == "unknown" and "kv-offload" in f.fixes
    assert any("KV offload" in m for m in f.details["missing"])
    # Prefix caching on with a hit ratio of 2 %: offered after the capacity knobs.
    assert f.details["prefix_cache_hit_ratio"] == pytest.approx(0.02)
    assert f.fixes.index("prefix-caching") > f.fixes.index("max-num-seqs")


def test_a_vllm_engines_gpu_has_no_fragmentation_finding_even_with_allocator_ooms():
    from gpudiag.analyzers import memory_fragmentation
    from gpudiag.frames import Window

    GiB, MiB = 1 << 30, 1 << 20
    n = 900
    proc = [{"t": float(t), "node": NODE, "gpu": 0, "pid": 4100, "process": "python3",
             M.process_torch_reserved_bytes: 40.0 * GiB, M.process_torch_allocated_bytes: 38.5 * GiB,
             M.process_torch_largest_free_block_bytes: 256.0 * MiB,
             M.process_torch_ooms_total: float(t // 100)} for t in range(1, n + 1)]
    eng = [{"t": float(t), "node": NODE, "engine": "0", M.num_preemptions_total: float(t // 2),
            M.kv_cache_usage_perc: 0.997} for t in range(1, n + 1)]
    w = Window.from_rows({"process": proc, "engine": eng}, start_s=1.0, end_s=float(n), node=NODE)
    assert memory_fragmentation.analyze(w) == []
    # ... and the storm it does have is demand over capacity.
    (f,) = storms(w)
    assert f.details["cause"] == "demand_over_capacity" and "paged-kv" not in f.fixes
