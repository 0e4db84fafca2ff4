"""Serving incidents: queue avalanche, LRU in multi-turn chat, shared prefixes.

Registered into ``scenarios.SCENARIOS``; parameters live here and nowhere else.
"""

from __future__ import annotations

from gpudiag.reference_engine.core.kv_manager import KVConfig
from gpudiag.reference_engine.core.scheduler import SchedulerConfig
from gpudiag.reference_engine.scenarios import Fix, Scenario
from gpudiag.reference_engine.scenarios.workload import LengthDist, Phase, RequestClass, Workload
from gpudiag.reference_engine.serving.admission import AdmissionConfig
from gpudiag.reference_engine.serving.frontend import FrontendConfig, LivenessProbe
from gpudiag.reference_engine.sim.engine import EngineConfig

# --- queue-avalanche (SCENARIOS.md §5) --------------------------------------------------
# A Mistral-7B replica on an A100-80GB serving chat turns, at most 64 sequences in a batch:
# it finishes about 8 requests a second. Ten minutes of peak at 12 QPS (1.5x that) between
# calm traffic at 4 QPS. Clients give up after 30 s and retry twice with backoff. The
# liveness probe, every 10 s, is answered after the queued work: later than 20 s is a
# failure, three in a row restart the instance, which then warms up for a minute.
AVALANCHE_DURATION_S = 2400.0
AVALANCHE_PEAK = (600.0, 1200.0)
AVALANCHE_QPS = 4.0
AVALANCHE_PEAK_QPS = 12.0
AVALANCHE_MAX_SEQS = 64
_CHAT = RequestClass("chat", 1.0, LengthDist(400, 0.6, 16, 2000), LengthDist(200, 0.6, 16, 1000))
CLIENT_TIMEOUT_S = 30.0
CLIENT_RETRIES = 2
RETRY_BACKOFF_S = 2.0
LIVENESS_PERIOD_S = 10.0
LIVENESS_TIMEOUT_S = 20.0
LIVENESS_FAILURES = 3
RESTART_WARMUP_S = 60.0
# The fix: a token bucket just under what the replica finishes (so the queue stays short and
# accepted requests keep their latency), a burst of a few seconds' arrivals, and a queue bound
# of about four seconds of work (well under the probe's timeout and the clients' patience).
ADMISSION_RATE_PER_S = 7.0
ADMISSION_BURST = 20.0
ADMISSION_MAX_QUEUE = 32


def _avalanche_engine() -> EngineConfig:
    return EngineConfig(
        gpu="A100-80GB", model="mistral-7b",
        kv=KVConfig(strategy="paged", block_size=16),
        scheduler=SchedulerConfig(max_num_seqs=AVALANCHE_MAX_SEQS),
        frontend=FrontendConfig(client_timeout_s=CLIENT_TIMEOUT_S, client_retries=CLIENT_RETRIES,
                                retry_backoff_s=RETRY_BACKOFF_S,
                                liveness=LivenessProbe(LIVENESS_PERIOD_S, LIVENESS_TIMEOUT_S, LIVENESS_FAILURES,
                                                       RESTART_WARMUP_S)),
    )


def _avalanche_workload() -> Workload:
    a, b = AVALANCHE_PEAK
    return Workload(qps=AVALANCHE_QPS, duration_s=AVALANCHE_DURATION_S, phases=[
        Phase("before", 0.0, a, (_CHAT,)),
        Phase("peak", a, b, (_CHAT,), qps=AVALANCHE_PEAK_QPS),
        Phase("after", b, AVALANCHE_DURATION_S, (_CHAT,)),
    ])


def _bounded_queue(cfg: EngineConfig) -> None:
    cfg.frontend.admission = AdmissionConfig(rate_per_s=ADMISSION_RATE_PER_S, burst=ADMISSION_BURST,
                                             max_queue=ADMISSION_MAX_QUEUE)


# --- lru-multiturn (SCENARIOS.md §8) -----------------------------------------------------
# Chat conversations on a Llama-2-7B-shaped model (512 KiB of KV per token, about 93k tokens of
# KV on an A100-80GB) with prefix caching: each turn's prompt is the conversation so far
# (an 800-token system prompt, then messages and answers), so its head is the KV of the
# earlier turns. Alongside, one-off requests (a short prompt, a long generation) that
# nobody continues: their blocks enter the cache and are never used again. They turn the
# cache over in well under a user's think time, so LRU throws a conversation's history out
# before the next turn and the turn recomputes it: a long prefill that stalls every decode.
MULTITURN_DURATION_S = 1800.0
MULTITURN_WARMUP_S = 600.0
MULTITURN_QPS = 3.5  # conversation starts plus one-off requests
_CHAT_TURNS = RequestClass("conversation", 0.014, LengthDist(150, 0.5, 16, 600), LengthDist(200, 0.5, 32, 800),
                        shared_prefix_tokens=800, turns=LengthDist(10, 0.4, 2, 20),
                        think_s=LengthDist(30, 0.5, 5, 240))
_ONE_OFF = RequestClass("one-off", 1.0, LengthDist(80, 0.4, 16, 400), LengthDist(500, 0.5, 16, 2000))
# A minute's half-life: a block used by turns a minute apart keeps a score near 2, so it
# outlives the one-off blocks that arrived during the user's last minute of thinking; a
# finished conversation's blocks decay out within minutes.
CACHE_HALF_LIFE_S = 60.0


def _multiturn_engine() -> EngineConfig:
    return EngineConfig(
        gpu="A100-80GB", model="llama-7b",
        kv=KVConfig(strategy="paged", block_size=16, prefix_caching=True, cache_policy="lru"),
        record_token_gaps=True,  # the incident is inter-token jitter
    )


def _multiturn_workload() -> Workload:
    return Workload(qps=MULTITURN_QPS, duration_s=MULTITURN_DURATION_S, phases=[
        Phase("warm-up", 0.0, MULTITURN_WARMUP_S, (_CHAT_TURNS, _ONE_OFF)),
        Phase("steady", MULTITURN_WARMUP_S, MULTITURN_DURATION_S, (_CHAT_TURNS, _ONE_OFF)),
    ])


def _lfu_decay(cfg: EngineConfig) -> None:
    cfg.kv.cache_policy = "lfu-decay"
    cfg.kv.cache_half_life_s = CACHE_HALF_LIFE_S


# --- prefix-sharing (SCENARIOS.md §8) ----------------------------------------------------
# Questions about one product on a Mistral-7B replica (A100-80GB, paged KV): every prompt
# starts with the same 2304-token product description, then a short question. Five quiet
# minutes at 1 QPS, then ten busy ones at 4 QPS. Without prefix caching each request holds
# (and prefills) its own copy of the description: the busy phase needs more KV than the
# pool has, and the scheduler evicts. With it the description's blocks are held once.
SHARING_DURATION_S = 900.0
SHARING_BUSY = (300.0, SHARING_DURATION_S)
SHARING_QPS = 1.0
SHARING_BUSY_QPS = 4.0
SHARING_PREFIX_TOKENS = 2304
_PRODUCT_QA = RequestClass("product-qa", 1.0, LengthDist(64, 0.5, 8, 400), LengthDist(192, 0.5, 16, 600),
                           shared_prefix_tokens=SHARING_PREFIX_TOKENS)


def _sharing_engine() -> EngineConfig:
    return EngineConfig(gpu="A100-80GB", model="mistral-7b", kv=KVConfig(strategy="paged", block_size=16))


def _sharing_workload() -> Workload:
    return Workload(qps=SHARING_QPS, duration_s=SHARING_DURATION_S, phases=[
        Phase("quiet", 0.0, SHARING_BUSY[0], (_PRODUCT_QA,)),
        Phase("busy", *SHARING_BUSY, (_PRODUCT_QA,), qps=SHARING_BUSY_QPS),
    ])


def _prefix_caching(cfg: EngineConfig) -> None:
    cfg.kv.prefix_caching = True


SCENARIOS: dict[str, Scenario] = {
    "queue-avalanche": Scenario(
        "queue-avalanche",
        "an unbounded queue at a peak above capacity: timeouts, liveness restarts, retries, throughput collapse",
        _avalanche_engine, _avalanche_workload,
        [("before", 0.0, AVALANCHE_PEAK[0]), ("peak", *AVALANCHE_PEAK),
         ("after", AVALANCHE_PEAK[1], AVALANCHE_DURATION_S)],
        {"bounded-queue": Fix("bounded-queue",
                              "token bucket and a bounded queue: 429 beyond them, never queued", _bounded_queue)},
        ("queue_avalanche",),
    ),
    "lru-multiturn": Scenario(
        "lru-multiturn",
        "multi-turn chat with prefix caching: LRU evicts early turns' KV under one-off prompts, turns recompute",
        _multiturn_engine, _multiturn_workload,
        [("warm-up", 0.0, MULTITURN_WARMUP_S), ("steady", MULTITURN_WARMUP_S, MULTITURN_DURATION_S)],
        {"lfu-decay": Fix("lfu-decay", "evict cached blocks by use count with exponential time decay", _lfu_decay)},
        ("prefix_cache_thrash",),
    ),
    "prefix-sharing": Scenario(
        "prefix-sharing",
        "many users share a long prompt prefix without prefix caching: KV demand and prefill multiply",
        _sharing_engine, _sharing_workload,
        [("quiet", 0.0, SHARING_BUSY[0]), ("busy", *SHARING_BUSY)],
        {"prefix-caching": Fix("prefix-caching", "share the prefix's KV blocks by hash (automatic prefix caching)",
                               _prefix_caching)},
        # The shared prompts fill the pool: decode slows (latency_regression) minutes before the
        # first eviction (the storm). Both come of the same demand, neither of the other.
        ("kv_eviction_storm", "latency_regression"),
    ),
}
