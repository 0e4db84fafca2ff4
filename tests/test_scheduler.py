"""The scheduler's admission: who gets KV memory when the head of the queue cannot."""

from __future__ import annotations

from gpudiag.reference_engine.core.allocator import CachingAllocator, DeviceMemory
from gpudiag.reference_engine.core.kv_manager import KVConfig, make_kv_manager
from gpudiag.reference_engine.core.scheduler import Scheduler, SchedulerConfig
from gpudiag.reference_engine.core.sequence import Sequence, Status

MIB = 1024**2
BYTES_PER_TOKEN = 128 * 1024


def _scheduler(pool_tokens: int) -> Scheduler:
    mem = DeviceMemory(4 * pool_tokens * BYTES_PER_TOKEN)
    kv = make_kv_manager(KVConfig(strategy="paged", block_size=16), CachingAllocator(mem, "engine"),
                         BYTES_PER_TOKEN, pool_tokens * BYTES_PER_TOKEN)
    return Scheduler(SchedulerConfig(admission_lookahead=4), kv)


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
