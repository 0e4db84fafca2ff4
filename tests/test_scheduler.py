"""The scheduler's admission: who gets KV memory when the head of the queue cannot."""

from __future__ import annotations

from gpudiag.reference_engine.core.allocator import CachingAllocator, DeviceMemory
from gpudiag.reference_engine.core.kv_manager import KVConfig, make_kv_manager
from gpudiag.reference_engine.core.scheduler import Scheduler, SchedulerConfig
from gpudiag.reference_engine.core.sequence import Sequence, Status

MIB = 1024**2
BYTES_PER_TOKEN = 128 * 1024


def _scheduler(pool_tokens: int, **cfg) -> Scheduler:
    mem = DeviceMemory(4 * pool_tokens * BYTES_PER_TOKEN)
    kv = make_kv_manager(KVConfig(strategy="paged", block_size=16), CachingAllocator(mem, "engine"),
                         BYTES_PER_TOKEN, pool_tokens * BYTES_PER_TOKEN)
    return Scheduler(SchedulerConfig(**{"admission_lookahead": 4, **cfg}), kv)


def test_long_recomputes_that_cannot_get_memory_do_not_hold_back_the_short_requests_behind_them():
    sched = _scheduler(pool_tokens=4096)
    resident = Sequence(0, 0.0, prompt_tokens=3000, max_output_tokens=100)
    sched.add(resident)
    assert sched.schedule_prefill(0.0) == [resident]
    # Far more preempted long sequences than the lookahead at the head of the queue; none fits.
    longs = [Sequence(1 + i, 1.0, prompt_tokens=2000, max_output_tokens=100, preemptions=1) for i in range(12)]
    short = Sequence(100, 2.0, prompt_tokens=64, max_output_tokens=10)
    for s in longs + [short]:
        sched.add(s)
    batch = sched.schedule_prefill(3.0)
    assert batch == [short]
    assert short.status is Status.RUNNING
    assert list(sched.waiting) == longs  # they keep their places at the head
    assert sched.stats.alloc_failures == 1  # one attempt; the rest were known not to fit
    assert sched.admission_blocked  # until memory is freed, nobody else can get in


def test_allocation_attempts_that_fail_are_bounded_by_the_lookahead():
    sched = _scheduler(pool_tokens=4096)
    resident = Sequence(0, 0.0, prompt_tokens=3000, max_output_tokens=100)
    sched.add(resident)
    sched.schedule_prefill(0.0)
    # Each one smaller than the last, so each is worth an attempt, and each fails.
    shrinking = [Sequence(1 + i, 1.0, prompt_tokens=2000 - 16 * i, max_output_tokens=100) for i in range(12)]
    short = Sequence(100, 2.0, prompt_tokens=64, max_output_tokens=10)
    for s in shrinking + [short]:
        sched.add(s)
    assert sched.schedule_prefill(3.0) == []
    assert sched.stats.alloc_failures == sched.cfg.admission_lookahead + 1


def test_a_short_arrival_ends_a_decode_run_even_while_a_request_that_cannot_fit_waits():
    # A run of decode steps ends at the next arrival that could be admitted. A request known
    # not to fit at the head of the queue must not make the engine ignore arrivals until the
    # next second: the short one behind it is admitted at its arrival, not up to a second later.
    from gpudiag.reference_engine import scenarios
    from gpudiag.reference_engine.sim.engine import SimEngine

    cfg, wl = scenarios.get("kv-eviction-storm").build(None)
    engine = SimEngine(cfg, wl, seed=0)
    resident = Sequence(0, 0.0, prompt_tokens=100, max_output_tokens=3000)
    huge = Sequence(1, 0.01, prompt_tokens=400_000, max_output_tokens=10)  # more KV than the pool holds
    short = Sequence(2, 0.35, prompt_tokens=100, max_output_tokens=10)
    engine.requests = [resident, huge, short]
    for i, _ in enumerate(engine.frames()):
        if short.first_scheduled_s is not None or i > 5:
            break
    assert engine.sched.admission_blocked and huge.status is Status.WAITING
    assert short.first_scheduled_s is not None and short.first_scheduled_s - short.arrival_s < 0.1


# ---- the growing request preempting itself, FIFO requeue, the recompute watermark -----------------

def _full(sched: Scheduler, n: int = 3) -> list[Sequence]:
    """``n`` sequences of 335 prompt tokens admitted one after another (with 1,024 tokens, the pool's
    last block), each at the end of its last block: the next token of each needs a new block."""
    seqs = [Sequence(i, float(i), prompt_tokens=335, max_output_tokens=500) for i in range(n)]
    for i, s in enumerate(seqs):
        sched.add(s)
        assert sched.schedule_prefill(float(i)) == [s]
    for s in seqs:
        s.generated = 16 * ((s.prompt_tokens + 15) // 16) - s.prompt_tokens
    return seqs


def test_under_self_the_sequence_that_cannot_grow_is_the_one_preempted():
    sched = _scheduler(1024, policy="self")
    old, mid, new = _full(sched)
    sched.prepare_decode(6.0)
    # The oldest takes the pool's last free block; the next finds none and gives up its own KV, and
    # the newest then has its blocks. Under lru it would have evicted the oldest instead.
    assert mid.status is Status.WAITING and mid.preemptions == 1
    assert old.status is new.status is Status.RUNNING
    assert sched.stats.evictions == 1
    lru = _scheduler(1024)
    old, mid, new = _full(lru)
    lru.prepare_decode(6.0)
    assert old.status is Status.WAITING and mid.status is new.status is Status.RUNNING


def test_fifo_requeue_brings_preempted_sequences_back_in_the_order_they_were_preempted():
    for requeue, expected in (("fifo", [0, 1, 2]), ("head", [2, 1, 0])):
        sched = _scheduler(4096, policy="self", requeue=requeue)
        seqs = [Sequence(i, 0.0, prompt_tokens=100, max_output_tokens=50) for i in range(3)]
        arrival = Sequence(9, 1.0, prompt_tokens=100, max_output_tokens=50)
        for s in seqs:
            sched.add(s)
        assert sched.schedule_prefill(0.0) == seqs
        sched.add(arrival)
        for s in seqs:
            sched.preempt(s)
        assert [s.seq_id for s in sched.waiting] == expected + [9], requeue


def test_the_recompute_watermark_keeps_room_for_new_requests():
    """A preempted sequence is re-admitted only while the watermark stays free after it; a new request
    is not held to it, and the held one is not counted as an allocation failure."""
    block = 16 * BYTES_PER_TOKEN
    sched = _scheduler(1024, recompute_watermark_bytes=20 * block)
    resident = Sequence(0, 0.0, prompt_tokens=600, max_output_tokens=100)  # 38 of the 64 blocks
    sched.add(resident)
    assert sched.schedule_prefill(0.0) == [resident]
    back = Sequence(1, 0.5, prompt_tokens=100, max_output_tokens=50, preemptions=1)  # 7 blocks
    new = Sequence(2, 1.0, prompt_tokens=100, max_output_tokens=50)
    sched.add(back)
    sched.add(new)
    # 26 blocks free: after the recompute's 7, 19 would be left, under the watermark of 20.
    assert sched.schedule_prefill(1.0) == [new]
    assert list(sched.waiting) == [back] and sched.stats.alloc_failures == 0
    assert sched.admission_blocked  # nothing is retried until memory is freed
    sched.finish(resident, 2.0)
    assert sched.schedule_prefill(2.0) == [back]


def test_the_new_options_are_checked():
    import pytest

    from gpudiag.errors import GpudiagError

    with pytest.raises(GpudiagError, match="requeue"):
        SchedulerConfig(requeue="tail").validate()
    with pytest.raises(GpudiagError, match="watermark"):
        SchedulerConfig(recompute_watermark_bytes=-1).validate()


def test_a_first_admission_skips_what_a_replayed_cache_served_and_a_recompute_does_not():
    sched = _scheduler(pool_tokens=4096)
    seq = Sequence(0, 0.0, prompt_tokens=1000, max_output_tokens=10)
    seq.reused_tokens = 1000  # more than may be skipped: the last prompt token is always computed
    sched.add(seq)
    assert sched.schedule_prefill(0.0) == [seq] and seq.cached_tokens == 999
    sched.preempt(seq)
    assert sched.schedule_prefill(1.0) == [seq] and seq.cached_tokens == 0
    assert sched.stats.recomputed_tokens == seq.num_tokens
