"""The scheduler under vLLM V1's rules (vllm/v1/core/sched/scheduler.py, FCFS), as a fitted twin runs it:
the newest running request is preempted, no admission in a step that preempted, and the waiting queue
stops at a head that does not fit."""

from __future__ import annotations

import pytest

from gpudiag.catalog import M
from gpudiag.errors import GpudiagError
from gpudiag.reference_engine.core.allocator import CachingAllocator, DeviceMemory
from gpudiag.reference_engine.core.kv_manager import KVConfig, make_kv_manager
from gpudiag.reference_engine.core.scheduler import Scheduler, SchedulerConfig
from gpudiag.reference_engine.core.sequence import Sequence, Status

BYTES_PER_TOKEN = 128 * 1024


def _scheduler(pool_tokens: int, **cfg) -> Scheduler:
    mem = DeviceMemory(4 * pool_tokens * BYTES_PER_TOKEN)
    kv = make_kv_manager(KVConfig(strategy="paged", block_size=16), CachingAllocator(mem, "engine"),
                         BYTES_PER_TOKEN, pool_tokens * BYTES_PER_TOKEN)
    return Scheduler(SchedulerConfig(**cfg), kv)


V1 = {"policy": "newest", "admit_while_preempting": False, "admission_lookahead": 0}


def _full_pool(sched: Scheduler) -> list[Sequence]:
    """Three requests admitted one after another, filling a 1,024-token pool to the last block."""
    seqs = [Sequence(i, float(i), prompt_tokens=335, max_output_tokens=500) for i in range(3)]
    for i, s in enumerate(seqs):
        sched.add(s)
        assert sched.schedule_prefill(float(i)) == [s]
    return seqs


def test_the_newest_request_is_preempted_and_nothing_is_admitted_in_that_step():
    sched = _scheduler(1024, **V1)
    old, mid, new = _full_pool(sched)
    waiting = Sequence(9, 5.0, prompt_tokens=16, max_output_tokens=10)
    sched.add(waiting)
    for s in (old, mid, new):  # each has filled its last block: the next token needs a new one
        s.generated = 16 * ((s.prompt_tokens + 15) // 16) - s.prompt_tokens
    sched.prepare_decode(6.0)
    assert new.status is Status.WAITING and new.preemptions == 1  # the last to join, as running.pop()
    assert old.status is mid.status is Status.RUNNING
    assert list(sched.waiting)[0] is new  # back at the head of the queue
    assert not sched.can_admit()  # a step that preempted admits nobody
    sched.prepare_decode(7.0)  # a step without a preemption
    assert sched.can_admit()  # the hold lifts


def test_the_canned_rule_preempts_the_longest_resident_instead():
    sched = _scheduler(1024)
    old, mid, new = _full_pool(sched)
    for s in (old, mid, new):
        s.generated = 16 * ((s.prompt_tokens + 15) // 16) - s.prompt_tokens
    sched.prepare_decode(6.0)
    assert old.status is Status.WAITING and new.status is Status.RUNNING


def test_nothing_passes_a_head_that_does_not_fit():
    sched = _scheduler(4096, **V1)
    resident = Sequence(0, 0.0, prompt_tokens=3000, max_output_tokens=100)
    sched.add(resident)
    assert sched.schedule_prefill(0.0) == [resident]
    long = Sequence(1, 1.0, prompt_tokens=2000, max_output_tokens=100)
    short = Sequence(2, 2.0, prompt_tokens=64, max_output_tokens=10)
    sched.add(long)
    sched.add(short)
    assert sched.schedule_prefill(3.0) == []  # the head fails; the short one behind it is not tried
    assert sched.schedule_prefill(4.0) == []  # nor once the head is known not to fit
    assert list(sched.waiting) == [long, short] and short.status is Status.WAITING


# ---- the host KV tier (vLLM's --kv-offloading-size, native CPU backend) ---------------------------------

def _offload_scheduler(pool_tokens: int, host_tokens: int) -> Scheduler:
    mem = DeviceMemory(4 * pool_tokens * BYTES_PER_TOKEN)
    kv = make_kv_manager(KVConfig(strategy="paged", block_size=16, offload_bytes=host_tokens * BYTES_PER_TOKEN),
                         CachingAllocator(mem, "engine"), BYTES_PER_TOKEN, pool_tokens * BYTES_PER_TOKEN)
    return Scheduler(SchedulerConfig(**V1), kv)


def test_a_preempted_request_loads_its_full_blocks_back_from_the_host_tier():
    sched = _offload_scheduler(1024, host_tokens=4096)
    old, mid, new = _full_pool(sched)
    for s in (old, mid, new):
        s.generated = 16 * ((s.prompt_tokens + 15) // 16) - s.prompt_tokens
    sched.prepare_decode(6.0)
    assert new.status is Status.WAITING
    sched.finish(old, 7.0)
    sched.prepare_decode(8.0)  # a step without a preemption lifts the hold on admission
    assert sched.schedule_prefill(9.0) == [new]
    # 336 tokens were stored (21 full blocks). The last token is always computed (its logits sample the
    # next one), so the lookup stops at 335 tokens: 20 full blocks come back, 16 tokens are recomputed.
    assert new.cached_tokens == 320
    assert sched.stats.recomputed_tokens == 16
    loaded = sched.kv.take_host_loaded_bytes()
    assert loaded == 320 * BYTES_PER_TOKEN and sched.kv.take_host_loaded_bytes() == 0
    m = sched.kv.cache_metrics()
    assert m[M.external_prefix_cache_hits_total] == 320
    assert m[M.external_prefix_cache_queries_total] == 3 * 335 + 336  # every admission looks its tokens up


def test_the_host_tier_drops_the_least_recently_stored_first():
    sched = _offload_scheduler(4096, host_tokens=64)  # four blocks
    a, b, c = (Sequence(i, 0.0, prompt_tokens=32, max_output_tokens=10) for i in (1, 2, 3))
    for s in (a, b, c):
        sched.add(s)
    assert sched.schedule_prefill(0.0) == [a, b, c]  # each stores 33 tokens: two full blocks
    sched.preempt(a)
    sched.preempt(b)  # the tier is full
    sched.finish(c, 1.0)  # c's two blocks push out a's, the least recently stored
    assert sched.schedule_prefill(2.0) == [b, a]
    # b rebuilds 32 tokens, the last computed: one full block comes back; a's blocks are gone.
    assert (b.cached_tokens, a.cached_tokens) == (16, 0)
    assert sched.kv.cache_metrics()[M.external_prefix_cache_hits_total] == 16


def test_a_host_tier_needs_the_paged_strategy_without_prefix_caching():
    for cfg in (KVConfig(strategy="contiguous", offload_bytes=2**30),
                KVConfig(strategy="paged", prefix_caching=True, offload_bytes=2**30),
                KVConfig(strategy="paged", offload_bytes=-1)):
        with pytest.raises(GpudiagError, match="host KV tier"):
            cfg.validate()
