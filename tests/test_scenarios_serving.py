"""SCENARIOS.md §5 and §8 on the simulated GPU: a queue avalanche, LRU in multi-turn chat, a shared prefix.

Each incident comes from the mechanism (admission, client timeouts and retries,
a liveness probe; the paged pool's prefix cache and its eviction policy), is
found by its analyzer at the head of the chain, and its fix removes the finding
and moves the SLO the incident hurt. The pure pieces (admission control, the
prefix cache, conversation workloads) are checked on their own first.
"""

import json
import math

import numpy as np
import pytest

from gpudiag import repro
from gpudiag.analyzers import kv_eviction_storm, prefix_cache_thrash, queue_avalanche
from gpudiag.analyzers.common import counter_increase
from gpudiag.catalog import M
from gpudiag.errors import GpudiagError
from gpudiag.findings import Severity
from gpudiag.reference_engine import scenarios
from gpudiag.reference_engine.core.allocator import CachingAllocator, DeviceMemory
from gpudiag.reference_engine.core.kv_manager import KVConfig, make_kv_manager
from gpudiag.reference_engine.core.sequence import Sequence
from gpudiag.reference_engine.scenarios import serving as scenarios_serving
from gpudiag.reference_engine.scenarios.workload import LengthDist, Phase, RequestClass, Workload
from gpudiag.reference_engine.serving.admission import (
    AdmissionConfig,
    AdmissionController,
    BoundedQueue,
    ServingState,
    TokenBucket,
    Verdict,
)

MIB = 1024**2

# --- admission control, without any clock of its own -------------------------------------


def test_a_token_bucket_lets_a_burst_through_then_the_rate():
    b = TokenBucket(rate_per_s=2.0, burst=3, now=100.0)
    assert [b.try_take(100.0) for _ in range(4)] == [True, True, True, False]
    assert b.retry_after_s(100.0) == pytest.approx(0.5)
    assert b.try_take(100.5) and not b.try_take(100.5)
    assert b.available(99.0) == pytest.approx(0.0)  # an earlier "now" refills nothing
    assert b.available(200.0) == 3.0  # never above the burst
    assert math.isinf(b.retry_after_s(200.0, n=4))


def test_a_bounded_queue_refuses_instead_of_growing():
    q = BoundedQueue[str](2)
    assert q.put("a") and q.put("b") and q.full
    assert not q.put("c") and len(q) == 2
    assert q.remove("a") and not q.remove("zz")
    assert q.get() == "b" and len(q) == 0


def test_admission_answers_503_while_warming_and_429_beyond_the_queue_or_the_rate():
    adm = AdmissionController(AdmissionConfig(rate_per_s=1.0, burst=2, max_queue=5, calm_s=10.0), now=0.0)
    assert adm.state_at(0.0) is ServingState.WARMING
    assert adm.offer(0.0, 0) is Verdict.NOT_SERVING and Verdict.NOT_SERVING.http_status == 503
    adm.ready(30.0)
    assert adm.state_at(30.0) is ServingState.SERVING
    assert adm.offer(30.0, 5) is Verdict.QUEUE_FULL  # refused by the bound: no token spent
    assert adm.offer(30.0, 0) is Verdict.ACCEPTED and adm.offer(30.0, 0) is Verdict.ACCEPTED
    assert adm.offer(30.0, 0) is Verdict.RATE_LIMITED and Verdict.RATE_LIMITED.http_status == 429
    assert adm.state_at(30.0) is ServingState.THROTTLING
    assert adm.retry_after_s(30.0) == 1.0
    assert (adm.accepted_total, adm.rejected_total, adm.unavailable_total) == (2, 2, 1)
    assert adm.rejected_by_verdict == {Verdict.QUEUE_FULL: 1, Verdict.RATE_LIMITED: 1}
    assert adm.state_at(39.0) is ServingState.THROTTLING
    assert adm.state_at(40.0) is ServingState.SERVING and adm.state_since(40.0) == 40.0
    adm.drain(50.0)
    assert adm.offer(50.0, 0) is Verdict.NOT_SERVING and adm.state_at(60.0) is ServingState.DRAINING
    adm.restart(70.0)
    assert adm.state_at(70.0) is ServingState.WARMING


def test_admission_without_limits_queues_everything_and_bad_limits_are_refused():
    adm = AdmissionController(now=0.0, state=ServingState.SERVING)
    assert all(adm.offer(0.0, n) is Verdict.ACCEPTED for n in range(0, 10_000, 97))
    for bad in (AdmissionConfig(rate_per_s=0.0), AdmissionConfig(burst=0.5), AdmissionConfig(max_queue=-1)):
        with pytest.raises(GpudiagError):
            AdmissionController(bad)


# --- the prefix cache on the paged pool -------------------------------------------------------


def cache(policy="lru", blocks=10, half_life_s=100.0):
    """A paged pool of ``blocks`` 16-token blocks (1 KiB per token) with a prefix cache."""
    alloc = CachingAllocator(DeviceMemory(1024 * MIB), "engine")
    cfg = KVConfig(strategy="paged", block_size=16, prefix_caching=True, cache_policy=policy,
                   cache_half_life_s=half_life_s)
    return make_kv_manager(cfg, alloc, 1024, blocks * 16 * 1024)


def request(i, content, out=8):
    s = Sequence(i, 0.0, sum(n for _, n in content), out)
    s.content, s.output_segment = content, 10_000 + i
    return s


def test_requests_sharing_a_prefix_hold_its_blocks_once():
    kv = cache(blocks=20)
    prefix = (7, 64)  # four full blocks
    a, b = request(1, (prefix, (100, 5))), request(2, (prefix, (101, 5)))
    assert kv.allocate(a, a.num_tokens + 1) is None and a.cached_tokens == 0
    assert kv.allocate(b, b.num_tokens + 1) is None and b.cached_tokens == 64
    assert kv.logical_bytes == (70 + 70) * 1024  # what they address
    assert kv.used_bytes == (70 + 70 - 64) * 1024  # what is stored: the prefix once
    assert kv.reserved_bytes == (5 + 1) * 16 * 1024  # four shared blocks and one tail each
    assert (kv.queries_tokens, kv.hit_tokens) == (138, 64)
    kv.free(a)
    kv.free(b)
    assert kv.free_blocks == 20 and kv.reserved_bytes == 0 and kv.used_bytes == 0
    assert kv.cached_blocks == 4  # the prefix stays cached, unused
    assert kv.cache_metrics()[M.prefix_cache_hits_total] == 64


def test_the_next_turn_of_a_conversation_finds_the_previous_prompt_and_answer():
    kv = cache(blocks=20)
    turn1 = request(1, ((7, 40),), out=24)  # 40 prompt + 24 answer = 64 tokens = 4 full blocks
    kv.allocate(turn1, turn1.num_tokens + 1)  # prefill: the first answer token comes with it
    turn1.generated = 1
    kv.advance([turn1], 23)  # decode the rest
    turn1.generated = 24
    kv.free(turn1)
    turn2 = request(2, ((7, 40), (turn1.output_segment, 24), (8, 10)))
    kv.allocate(turn2, turn2.num_tokens + 1)
    assert turn2.cached_tokens == 64


def test_lru_lets_one_off_prompts_push_out_a_hot_prefix_and_lfu_with_decay_keeps_it():
    hits = {}
    for policy in ("lru", "lfu-decay"):
        kv = cache(policy)
        hot = ((1, 32), (2, 1))  # two full blocks, used three times
        for k in range(3):
            kv.now = float(k)
            s = request(k, hot)
            assert kv.allocate(s, s.num_tokens + 1) is None
            kv.free(s)
        for j in range(6):  # one-off prompts of two full blocks each, never seen again
            kv.now = 10.0 + j
            s = request(10 + j, ((100 + j, 32), (200 + j, 1)))
            assert kv.allocate(s, s.num_tokens + 1) is None
            kv.free(s)
        kv.now = 20.0
        s = request(50, hot)
        kv.allocate(s, s.num_tokens + 1)
        hits[policy] = s.cached_tokens
        if policy == "lru":
            # The miss is counted as a recompute of evicted KV, not as new traffic.
            assert kv.recomputed_tokens == 32
    assert hits == {"lru": 0, "lfu-decay": 32}


def test_a_pool_with_no_room_left_fails_the_allocation_and_changes_nothing():
    kv = cache(blocks=4)
    a = request(1, ((1, 40),))
    assert kv.allocate(a, a.num_tokens + 1) is None
    before = (kv.free_blocks, kv.reserved_bytes, kv.live_tokens)
    b = request(2, ((2, 40),))
    assert kv.allocate(b, b.num_tokens + 1) == 3 * 16 * 1024
    assert (kv.free_blocks, kv.reserved_bytes, kv.live_tokens) == before


def test_prefix_caching_needs_paged_kv_and_a_known_policy():
    with pytest.raises(GpudiagError, match="paged"):
        KVConfig(strategy="contiguous", prefix_caching=True).validate()
    with pytest.raises(GpudiagError, match="policy"):
        KVConfig(prefix_caching=True, cache_policy="fifo").validate()


def test_conversations_extend_the_previous_turn_and_plain_workloads_draw_as_before():
    chat = RequestClass("chat", 1.0, LengthDist(100, 0.5, 16, 400), LengthDist(50, 0.5, 8, 200),
                        shared_prefix_tokens=30, turns=LengthDist(4, 0.0, 4, 4), think_s=LengthDist(20, 0.0, 20, 20))
    wl = Workload(qps=0.05, duration_s=600.0, phases=[Phase("p", 0.0, 600.0, (chat,))])
    seqs = wl.generate(3)
    assert [s.seq_id for s in seqs] == list(range(len(seqs)))
    assert all(a.arrival_s <= b.arrival_s for a, b in zip(seqs, seqs[1:]))
    by_start: dict[tuple, list] = {}
    for s in seqs:
        by_start.setdefault(s.content[:2], []).append(s)
    for turns in by_start.values():
        assert turns[0].content[0] == turns[-1].content[0] and turns[0].content[0][1] == 30  # the shared prefix
        for prev, nxt in zip(turns, turns[1:]):
            assert nxt.content[: len(prev.content)] == prev.content
            assert nxt.content[len(prev.content)] == (prev.output_segment, prev.max_output_tokens)
            assert nxt.prompt_tokens == sum(n for _, n in nxt.content)
            assert nxt.arrival_s - prev.arrival_s == pytest.approx(20.0)
    plain = RequestClass("plain", 1.0, LengthDist(100, 0.5, 16, 400), LengthDist(50, 0.5, 8, 200))
    a = Workload(qps=2.0, duration_s=60.0, phases=[Phase("p", 0.0, 60.0, (plain,))]).generate(5)
    assert all(s.content is None and s.output_segment is None for s in a)
    assert [s.seq_id for s in a] == list(range(len(a)))


# --- scenario runs -----------------------------------------------------------------------------


class _Runs:
    """``runs[name, fix]``: (run, document) at seed 0, from the runs the test run shares (each computed once)."""

    def __init__(self, scenario_run):
        self._run = scenario_run
        self._docs: dict = {}

    def __getitem__(self, key):
        if key not in self._docs:
            res = self._run(*key)
            self._docs[key] = (res, repro.document(res))
        return self._docs[key]


@pytest.fixture(scope="module")
def runs(scenario_run):
    return _Runs(scenario_run)


def kinds(res):
    return [f.kind for f in res.findings]


def only(res, kind):
    found = [f for f in res.findings if f.kind == kind]
    assert len(found) == 1, [f.summary for f in res.findings]
    return found[0]


def phase(doc, name):
    return next(p for p in doc["phases"] if p["name"] == name)


def engine_increase(res, col, start, end):
    e = res.window.table("engine")
    sel = (e["t"] >= start) & (e["t"] <= end + 1)
    return counter_increase(e[col].to_numpy(float)[sel.to_numpy()])


def assert_heads_the_chain_alone(res, kind):
    """The expected finding comes first, and every other critical finding is one it caused."""
    head = res.findings[0]
    assert head.kind == kind and not head.caused_by
    for f in res.findings[1:]:
        if f.severity is Severity.CRITICAL:
            assert head.id in f.caused_by, f.summary


# queue-avalanche (§5)

def test_an_unbounded_queue_at_peak_times_out_clients_and_restarts_the_instance(runs):
    res, doc = runs["queue-avalanche", None]
    assert_heads_the_chain_alone(res, "queue_avalanche")
    f = only(res, "queue_avalanche")
    a, b = scenarios_serving.AVALANCHE_PEAK
    # It lasts as long as the peak: it may close a few samples early, as the last timeouts stop.
    assert a - 60 <= f.start_s <= a + 120 and b - 30 <= f.end_s <= b + 600
    assert f.severity is Severity.CRITICAL and f.fixes == ["bounded-queue"]
    assert f.details["timeouts"] >= 100 and f.details["restarts"] >= 2 and f.details["rejected"] == 0
    lat = only(res, "latency_regression")
    assert f.id in lat.caused_by
    fe = res.engine.frontend
    assert fe.timed_out_total >= 100 and fe.restarts_total >= 2 and fe.dropped_by_restarts > 500
    # The --json document says so too.
    assert (doc["totals"]["timed_out"], doc["totals"]["restarts"], doc["totals"]["rejected_429"]) == \
        (fe.timed_out_total, fe.restarts_total, 0)
    # The instance came back through WARMING, serving nothing meanwhile.
    states = res.window.table("engine")[M.engine_serving_state]
    assert any(s["warming"] == 1 for s in states) and states.iloc[0]["serving"] == 1
    peak, before = phase(doc, "peak")["slo"], phase(doc, "before")["slo"]
    assert peak["ttft_p99_s"] > 10.0 and peak["ttft_p99_s"] > 10 * before["ttft_p99_s"]
    assert phase(doc, "after")["slo"]["ttft_p50_s"] < 2 * before["ttft_p50_s"]  # it recovers


def test_a_token_bucket_and_a_bounded_queue_turn_timeouts_into_429s_and_keep_throughput(runs):
    res, doc = runs["queue-avalanche", "bounded-queue"]
    base, _ = runs["queue-avalanche", None]
    assert "queue_avalanche" not in kinds(res) and "latency_regression" not in kinds(res)
    assert not [f for f in res.findings if f.severity is Severity.CRITICAL]
    fe = res.engine.frontend
    # Refused, not queued: the queue no longer times clients out (a generation near the longest output
    # can still outlast the client's timeout on its own) and the instance never restarts.
    assert fe.timed_out_total <= base.engine.frontend.timed_out_total / 50
    assert fe.restarts_total == 0 and fe.admission.rejected_total > 1000
    assert doc["totals"]["rejected_429"] == fe.admission.rejected_total and doc["totals"]["restarts"] == 0
    assert doc["totals"]["timed_out"] == fe.timed_out_total
    a, b = scenarios_serving.AVALANCHE_PEAK
    rejected = engine_increase(res, M.engine_requests_rejected_total, a, b)
    assert rejected > 1000  # the overload is refused during the peak, never queued
    # Throughput: what the instance finishes during the peak, fixed vs collapsed.
    done, done_base = (engine_increase(r, M.engine_requests_finished_total, a, b) for r in (res, base))
    assert done >= 1.4 * done_base
    assert done / (b - a) >= 0.9 * scenarios_serving.ADMISSION_RATE_PER_S
    # Accepted requests keep their latency through the peak.
    peak, before = phase(doc, "peak")["slo"], phase(doc, "before")["slo"]
    assert peak["ttft_p99_s"] <= 1.5 * before["ttft_p99_s"]
    assert peak["tpot_p99_s"] <= 1.5 * before["tpot_p99_s"]
    states = res.window.table("engine")
    in_peak = states[(states["t"] > a) & (states["t"] <= b)][M.engine_serving_state]
    assert sum(s["throttling"] for s in in_peak) > 0.5 * len(in_peak)
    assert not any(s["warming"] for s in states[M.engine_serving_state])


# lru-multiturn (§8)

def test_lru_throws_conversations_history_out_and_turns_recompute_it(runs):
    res, doc = runs["lru-multiturn", None]
    assert_heads_the_chain_alone(res, "prefix_cache_thrash")
    f = only(res, "prefix_cache_thrash")
    assert f.fixes == ["lfu-decay"] and f.end_s == doc["duration_s"]
    assert f.start_s < scenarios_serving.MULTITURN_WARMUP_S  # thrashing once the cache is full
    assert f.details["refetch_share"] >= prefix_cache_thrash.REFETCH_SHARE_THRESHOLD
    kv = res.engine.kv
    assert kv.recomputed_tokens >= 0.25 * kv.queries_tokens
    assert "kv_eviction_storm" not in kinds(res)  # nothing running was evicted: a cache policy problem


def test_lfu_with_time_decay_keeps_early_turns_and_the_inter_token_jitter_shrinks(runs):
    res, doc = runs["lru-multiturn", "lfu-decay"]
    base, base_doc = runs["lru-multiturn", None]
    assert "prefix_cache_thrash" not in kinds(res)
    assert not [f for f in res.findings if f.severity is Severity.CRITICAL]
    kv, kv_base = res.engine.kv, base.engine.kv
    assert kv.recomputed_tokens <= kv_base.recomputed_tokens / 2.5
    assert kv.hit_tokens / kv.queries_tokens >= kv_base.hit_tokens / kv_base.queries_tokens + 0.1
    # Returning turns find most of their conversation cached.
    steady = scenarios_serving.MULTITURN_WARMUP_S
    turns = [s for s in res.engine.finished if s.kind == "conversation" and len(s.content) > 2 and s.arrival_s > steady]
    assert np.mean([s.cached_tokens / s.prompt_tokens for s in turns]) >= 0.7
    # Jitter, defined as the standard deviation of every inter-token gap: halved at least.
    jitter, jitter_base = res.engine.token_gaps.stdev_s(), base.engine.token_gaps.stdev_s()
    assert jitter <= jitter_base / 2 and jitter < 0.015
    assert res.engine.token_gaps.percentile(99.9) <= base.engine.token_gaps.percentile(99.9) / 2
    assert phase(doc, "steady")["slo"]["tpot_p99_s"] <= phase(base_doc, "steady")["slo"]["tpot_p99_s"]


# prefix-sharing (§8)

def test_a_shared_prefix_without_prefix_caching_overflows_the_kv_pool(runs):
    res, doc = runs["prefix-sharing", None]
    # The shared prompts fill the pool: decode slows (latency_regression, from about 5 min) two
    # minutes before the first eviction (the storm, from about 7 min). Both come of the same
    # demand; a storm that starts later cannot be the latency's cause, so both head the chain.
    roots = {f.kind for f in res.findings if not f.caused_by}
    assert roots <= {"kv_eviction_storm", "latency_regression"} and "kv_eviction_storm" in roots
    storm = only(res, "kv_eviction_storm")
    assert storm.start_s >= scenarios_serving.SHARING_BUSY[0]
    # The pool is full of tokens, not of holes: the suggested fix is to share them.
    assert storm.details["kv_token_fill_ratio"] >= kv_eviction_storm.DEMAND_FILL_RATIO
    assert storm.fixes[0] == "prefix-caching"
    assert phase(doc, "quiet")["evictions"] == 0 and phase(doc, "busy")["evictions"] > 50
    assert phase(doc, "busy")["slo"]["ttft_p99_s"] > 30.0


def test_prefix_caching_shares_the_prefix_blocks_and_kv_demand_shrinks_by_almost_nine_tenths(runs):
    res, doc = runs["prefix-sharing", "prefix-caching"]
    base, _ = runs["prefix-sharing", None]
    assert not res.findings
    assert doc["totals"]["evictions"] == 0 and doc["totals"]["alloc_failures"] == 0
    e = res.window.table("engine")
    assert (e[M.prefix_cache_hits_total].iloc[-1] / e[M.prefix_cache_queries_total].iloc[-1]) >= 0.9
    totals = doc["totals"]
    assert totals["prefix_cache_hit_tokens"] >= 0.9 * totals["prefix_cache_queried_tokens"] > 0
    assert runs["prefix-sharing", None][1]["totals"]["prefix_cache_queried_tokens"] == 0  # no cache, no lookups
    # KV demand at the busiest moment: stored bytes over the bytes the running requests address.
    peak = e[M.engine_kv_logical_bytes].idxmax()
    saving = 1 - e[M.engine_kv_used_bytes][peak] / e[M.engine_kv_logical_bytes][peak]
    assert 0.85 <= saving <= 0.92
    assert phase(doc, "busy")["slo"]["ttft_p99_s"] < 2.0
    busy_done = engine_increase(res, M.engine_requests_finished_total, *scenarios_serving.SHARING_BUSY)
    assert busy_done > 1.2 * engine_increase(base, M.engine_requests_finished_total, *scenarios_serving.SHARING_BUSY)


def test_no_serving_analyzer_fires_on_the_memory_storm():
    res = repro.run(scenarios.get("kv-eviction-storm"), "paged-kv", seed=0, overrides=lambda c, w: setattr(
        w, "duration_s", 600.0))
    assert queue_avalanche.analyze(res.window) == [] and prefix_cache_thrash.analyze(res.window) == []


@pytest.mark.parametrize("name,fix,kind", [
    ("queue-avalanche", "bounded-queue", "queue_avalanche"),
    ("lru-multiturn", "lfu-decay", "prefix_cache_thrash"),
    ("prefix-sharing", "prefix-caching", "kv_eviction_storm"),
])
def test_repro_runs_each_serving_scenario_and_fix_from_the_command_line(cli, name, fix, kind):
    r = cli("repro", name, "--fix", fix, "--json", "--seed", "1")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["scenario"] == name and doc["fix"] == fix and doc["seed"] == 1
    # The scenario's finding heads a chain (prefix-sharing's latency regression, from the same demand,
    # starts before the storm and heads one of its own).
    (head,) = [f for f in doc["baseline_run"]["findings"] if f["kind"] == kind and not f["caused_by"]][:1]
    assert fix in head["fixes"]
    assert kind not in [f["kind"] for f in doc["findings"]]
