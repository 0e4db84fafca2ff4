"""Behaviour of the caching-allocator model (gpudiag.reference_engine.core.allocator)."""

from __future__ import annotations

import dataclasses
import pickle
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpudiag.reference_engine.core.allocator import (
    EXPANDABLE_PAGE_SIZE,
    GIB,
    KIB,
    MIB,
    AllocatorStats,
    CachingAllocator,
    DeviceMemory,
    OutOfMemory,
    get_allocation_size,
    round_size,
)

PAGE = EXPANDABLE_PAGE_SIZE


def make(total=8 * GIB, **kw):
    dev = DeviceMemory(total)
    return dev, CachingAllocator(dev, "engine", **kw)


def blocks_of(alloc):
    """[(segment_address, segment_total, [(addr, size, state), ...]), ...] from snapshot()."""
    return [
        (
            s["address"],
            s["total_size"],
            [(b["address"], b["size"], b["state"]) for b in s["blocks"]],
        )
        for s in alloc.snapshot()
    ]


def fragment(alloc):
    """Nine 6 MiB tensors (three per 20 MiB segment when classic); free the middle of each three."""
    addrs = [alloc.malloc(6 * MIB) for _ in range(9)]
    for i in (1, 4, 7):
        alloc.free(addrs[i])
    return addrs


# ------------------------------------------------------------------ rounding, pools, segments


@pytest.mark.parametrize(
    "size, rounded",
    [(1, 512), (511, 512), (512, 512), (513, 1024), (MIB, MIB), (MIB + 1, MIB + 512)],
)
def test_requests_round_up_to_a_multiple_of_512_bytes(size, rounded):
    assert round_size(size) == rounded
    _, alloc = make()
    a = alloc.malloc(size)
    assert alloc.block_size(a) == rounded
    assert alloc.stats().requested_bytes == size
    alloc.check_invariants()


def test_one_byte_gets_a_512_byte_block_in_a_2_mib_small_segment():
    dev, alloc = make()
    a = alloc.malloc(1)
    st_ = alloc.stats()
    assert alloc.block_size(a) == 512
    assert st_.allocated_bytes == 512 and st_.requested_bytes == 1
    assert st_.reserved_bytes == 2 * MIB and st_.segment_count == 1
    assert dev.used_bytes("engine") == 2 * MIB
    (seg,) = alloc.snapshot()
    assert seg["segment_type"] == "small" and seg["total_size"] == 2 * MIB
    assert [(b["size"], b["state"]) for b in seg["blocks"]] == [
        (512, "active_allocated"),
        (2 * MIB - 512, "inactive"),
    ]


def test_small_requests_pack_into_the_same_2_mib_segment():
    _, alloc = make()
    a, b = alloc.malloc(100), alloc.malloc(600)
    assert b == a + 512
    assert alloc.stats().segment_count == 1
    assert alloc.stats().inactive_split_bytes == 2 * MIB - 512 - 1024


def test_a_1_mib_request_is_small_and_one_byte_more_is_large():
    _, alloc = make()
    alloc.malloc(MIB)
    assert [s["segment_type"] for s in alloc.snapshot()] == ["small"]
    alloc.malloc(MIB + 1)
    assert sorted(s["segment_type"] for s in alloc.snapshot()) == ["large", "small"]
    assert alloc.stats().reserved_bytes == 2 * MIB + 20 * MIB


def test_a_5_mib_request_is_carved_from_a_20_mib_segment():
    _, alloc = make()
    a = alloc.malloc(5 * MIB)
    st_ = alloc.stats()
    assert alloc.block_size(a) == 5 * MIB
    assert st_.reserved_bytes == 20 * MIB and st_.segment_count == 1
    assert st_.inactive_split_bytes == 15 * MIB and st_.largest_free_block_bytes == 15 * MIB
    assert blocks_of(alloc) == [
        (a, 20 * MIB, [(a, 5 * MIB, "active_allocated"), (a + 5 * MIB, 15 * MIB, "inactive")])
    ]


def test_a_25_mib_request_gets_its_own_26_mib_segment_and_keeps_the_unsplittable_1_mib():
    _, alloc = make()
    a = alloc.malloc(25 * MIB)
    st_ = alloc.stats()
    assert st_.reserved_bytes == 26 * MIB
    # remainder 1 MiB is not > kSmallSize, so the large block is not split
    assert alloc.block_size(a) == 26 * MIB
    assert st_.allocated_bytes == 26 * MIB and st_.requested_bytes == 25 * MIB
    assert st_.free_reserved_bytes == 0 and st_.largest_free_block_bytes == 0


def test_a_large_segment_is_split_when_more_than_1_mib_is_left_over():
    _, alloc = make()
    a = alloc.malloc(24 * MIB + 512 * KIB)  # 26 MiB segment, 1.5 MiB left over
    assert alloc.block_size(a) == 24 * MIB + 512 * KIB
    assert alloc.stats().largest_free_block_bytes == MIB + 512 * KIB


@pytest.mark.parametrize(
    "size, seg",
    [
        (1, 2 * MIB),
        (MIB, 2 * MIB),
        (MIB + 1, 20 * MIB),
        (10 * MIB - 512, 20 * MIB),
        (10 * MIB - 1, 10 * MIB),
        (10 * MIB, 10 * MIB),
        (25 * MIB, 26 * MIB),
        (300 * MIB + 1, 302 * MIB),
    ],
)
def test_segment_sizes_follow_get_allocation_size(size, seg):
    assert get_allocation_size(round_size(size)) == seg
    _, alloc = make()
    alloc.malloc(size)
    assert alloc.stats().reserved_bytes == seg


# --------------------------------------------------------------------------- split, merge, best fit


def test_a_freed_block_merges_with_its_free_neighbours():
    _, alloc = make()
    a, b, c = (alloc.malloc(4 * MIB) for _ in range(3))
    alloc.free(a)
    alloc.free(c)  # merges with the 8 MiB tail
    assert [(sz, state) for _, sz, state in blocks_of(alloc)[0][2]] == [
        (4 * MIB, "inactive"),
        (4 * MIB, "active_allocated"),
        (12 * MIB, "inactive"),
    ]
    assert alloc.stats().inactive_split_bytes == 16 * MIB
    alloc.free(b)  # merges with both neighbours: the segment is one free block again
    assert blocks_of(alloc) == [(a, 20 * MIB, [(a, 20 * MIB, "inactive")])]
    st_ = alloc.stats()
    assert st_.inactive_split_bytes == 0 and st_.largest_free_block_bytes == 20 * MIB
    alloc.check_invariants()


def test_blocks_never_merge_across_segments():
    _, alloc = make()
    x = alloc.malloc(12 * MIB)
    y = alloc.malloc(12 * MIB)
    alloc.free(x)
    alloc.free(y)
    assert alloc.stats().segment_count == 2
    assert alloc.stats().largest_free_block_bytes == 12 * MIB


def test_best_fit_picks_the_smallest_free_block_that_fits():
    _, alloc = make()
    x1 = alloc.malloc(6 * MIB)
    alloc.malloc(2 * MIB)
    x2 = alloc.malloc(3 * MIB)
    alloc.malloc(2 * MIB)
    x3 = alloc.malloc(5 * MIB)  # 2 MiB tail left free
    for a in (x1, x2, x3):
        alloc.free(a)  # free blocks: 6 MiB @x1, 3 MiB @x2, 7 MiB @x3
    assert alloc.malloc(2 * MIB + 512 * KIB) == x2
    assert alloc.malloc(5 * MIB + 512 * KIB) == x1
    assert alloc.malloc(7 * MIB) == x3
    alloc.check_invariants()


def test_best_fit_breaks_ties_by_lowest_address():
    _, alloc = make()
    a = alloc.malloc(4 * MIB)
    alloc.malloc(2 * MIB)
    b = alloc.malloc(4 * MIB)
    alloc.malloc(2 * MIB)
    alloc.malloc(8 * MIB)  # segment full
    alloc.free(b)
    alloc.free(a)
    assert alloc.malloc(3 * MIB) == a


def test_a_freed_block_is_reused_before_any_new_segment():
    _, alloc = make()
    a = alloc.malloc(12 * MIB)
    alloc.free(a)
    assert alloc.malloc(11 * MIB) == a
    assert alloc.stats().num_device_mallocs == 1


# --------------------------------------------------------------------------- retry and OOM


def test_cached_segments_are_released_and_the_cudamalloc_retried_when_the_device_is_full():
    dev, alloc = make(total=64 * MIB)
    alloc.free(alloc.malloc(12 * MIB))  # a 12 MiB segment sits in the cache
    assert dev.reserve(40 * MIB, "other process")
    a = alloc.malloc(14 * MIB)  # 12 MiB free on the device: fails, release the cache, retry
    st_ = alloc.stats()
    assert st_.num_alloc_retries == 1 and st_.num_ooms == 0
    assert st_.num_device_mallocs == 2 and st_.num_device_frees == 1
    assert st_.reserved_bytes == 14 * MIB and alloc.block_size(a) == 14 * MIB
    assert dev.used_bytes("engine") == 14 * MIB
    alloc.check_invariants()


def test_fragmented_free_memory_still_ends_in_out_of_memory():
    dev, alloc = make(total=60 * MIB)
    fragment(alloc)
    st_ = alloc.stats()
    assert st_.reserved_bytes == 60 * MIB and dev.free_bytes() == 0
    assert st_.free_reserved_bytes == 24 * MIB > 8 * MIB > st_.largest_free_block_bytes == 6 * MIB
    with pytest.raises(OutOfMemory) as info:
        alloc.malloc(8 * MIB)
    e = info.value
    assert (e.requested_bytes, e.allocated_bytes, e.reserved_bytes) == (8 * MIB, 36 * MIB, 60 * MIB)
    assert (e.free_reserved_bytes, e.largest_free_block_bytes, e.device_free_bytes) == (
        24 * MIB,
        6 * MIB,
        0,
    )
    assert e.allocation_bytes == 20 * MIB
    assert str(e).startswith(
        "CUDA out of memory. Tried to allocate 8.00 MiB; 60.00 MiB reserved, 36.00 MiB allocated, "
        "24.00 MiB free in reserved segments, largest free block 6.00 MiB"
    )
    st_ = alloc.stats()
    assert st_.num_ooms == 1 and st_.num_alloc_retries == 1
    alloc.check_invariants()
    assert alloc.malloc(6 * MIB)  # the allocator is still usable after an OOM


def test_expandable_segments_turn_the_fragmented_oom_into_a_success():
    dev, alloc = make(total=60 * MIB, expandable_segments=True)
    addrs = fragment(alloc)
    assert alloc.stats().reserved_bytes == 54 * MIB
    a = alloc.malloc(8 * MIB)  # device has 6 MiB: unmap the three 6 MiB holes, retry
    st_ = alloc.stats()
    assert st_.num_ooms == 0 and st_.num_alloc_retries == 1
    assert a == addrs[-1] + 6 * MIB  # appended at the end of the mapped range
    assert st_.reserved_bytes == 36 * MIB + 8 * MIB and dev.used_bytes("engine") == 44 * MIB
    assert st_.segment_count == 4  # mapped runs: [x0] [x2 x3] [x5 x6] [x8 new]
    alloc.check_invariants()


def test_out_of_memory_survives_pickling():
    e = OutOfMemory(8 * MIB, 36 * MIB, 60 * MIB, 24 * MIB, 6 * MIB, 0)
    e2 = pickle.loads(pickle.dumps(e))
    assert str(e2) == str(e) and e2.largest_free_block_bytes == 6 * MIB


def test_a_request_larger_than_the_device_is_out_of_memory():
    for kw in ({}, {"expandable_segments": True}):
        dev, alloc = make(total=2 * GIB, **kw)
        with pytest.raises(OutOfMemory):
            alloc.malloc(3 * GIB)
        assert alloc.stats().num_ooms == 1 and dev.used_bytes() == 0
        alloc.check_invariants()


# --------------------------------------------------------------------------- max_split_size


def test_an_oversize_cached_block_is_not_split_for_a_small_request():
    _, alloc = make(max_split_size_bytes=40 * MIB)
    big = alloc.malloc(100 * MIB)
    alloc.free(big)
    small = alloc.malloc(30 * MIB)  # < max_split: may not use the 100 MiB block
    assert small != big and alloc.stats().segment_count == 2
    mid = alloc.malloc(70 * MIB)  # >= max_split but 100 >= 70 + 20: not used either
    assert mid != big and alloc.stats().segment_count == 3
    close = alloc.malloc(90 * MIB)  # within kLargeBuffer: takes the whole block, unsplit
    assert close == big and alloc.block_size(close) == 100 * MIB
    assert alloc.stats().inactive_split_bytes == 0
    alloc.check_invariants()


def test_oversize_rules_treat_exactly_max_split_and_exactly_20_mib_over_as_too_big():
    _, alloc = make(max_split_size_bytes=40 * MIB)
    edge = alloc.malloc(40 * MIB)  # a 40 MiB block is oversize (>= max_split_size)
    alloc.free(edge)
    assert alloc.malloc(30 * MIB) != edge
    big = alloc.malloc(100 * MIB)
    alloc.free(big)
    assert alloc.malloc(80 * MIB) not in (edge, big)  # 100 >= 80 + 20: not used
    assert alloc.malloc(80 * MIB + 512) == big  # 100 < 80.0005 + 20: used whole
    assert alloc.malloc(40 * MIB) == edge  # a request >= max_split may take it
    alloc.check_invariants()


def test_without_max_split_size_the_same_cached_block_is_split():
    _, alloc = make()
    big = alloc.malloc(100 * MIB)
    alloc.free(big)
    assert alloc.malloc(30 * MIB) == big
    assert alloc.stats().largest_free_block_bytes == 70 * MIB


def test_oversize_cached_segments_are_released_first_without_counting_a_retry():
    dev, alloc = make(total=128 * MIB, max_split_size_bytes=40 * MIB)
    alloc.free(alloc.malloc(100 * MIB))
    a = alloc.malloc(50 * MIB)  # 28 MiB free: release_available_cached_blocks frees the 100 MiB
    st_ = alloc.stats()
    assert st_.num_alloc_retries == 0 and st_.num_device_frees == 1
    assert alloc.block_size(a) == 50 * MIB and dev.used_bytes("engine") == 50 * MIB
    alloc.check_invariants()


def test_max_split_size_below_20_mib_is_rejected():
    with pytest.raises(ValueError):
        make(max_split_size_bytes=16 * MIB)


# --------------------------------------------------------------------------- expandable segments


def test_expandable_segments_map_2_mib_pages_at_the_end_of_one_segment():
    dev, alloc = make(expandable_segments=True)
    s = alloc.malloc(1)
    assert alloc.stats().reserved_bytes == 2 * MIB
    a = alloc.malloc(5 * MIB)  # 3 pages mapped, 1 MiB left free
    assert alloc.stats().reserved_bytes == 2 * MIB + 6 * MIB
    b = alloc.malloc(5 * MIB)  # uses the free 1 MiB and maps 2 more pages
    assert b == a + 5 * MIB
    st_ = alloc.stats()
    assert st_.reserved_bytes == 2 * MIB + 10 * MIB and st_.segment_count == 2
    assert st_.num_device_mallocs == 3 and st_.inactive_split_bytes == 0
    segs = alloc.snapshot()
    assert all(sg["is_expandable"] for sg in segs)
    assert {sg["segment_type"] for sg in segs} == {"small", "large"}
    assert dev.used_bytes("engine") == 12 * MIB and alloc.block_size(s) == 512
    alloc.check_invariants()


def test_empty_cache_unmaps_holes_in_the_middle_of_an_expandable_segment():
    _, alloc = make(expandable_segments=True)
    a, b, c = (alloc.malloc(6 * MIB) for _ in range(3))
    alloc.free(b)
    alloc.empty_cache()
    st_ = alloc.stats()
    assert st_.reserved_bytes == 12 * MIB and st_.num_device_frees == 1
    assert [(sg["address"], sg["total_size"]) for sg in alloc.snapshot()] == [
        (a, 6 * MIB),
        (c, 6 * MIB),
    ]
    assert alloc.malloc(5 * MIB) == b  # the hole is remapped first (lowest address)
    assert alloc.stats().segment_count == 1
    alloc.check_invariants()


def test_partial_pages_stay_mapped_after_empty_cache():
    _, alloc = make(expandable_segments=True)
    a = alloc.malloc(MIB + 512 * KIB)  # large pool: 1 page, 0.5 MiB free after it
    b = alloc.malloc(MIB + 512 * KIB)  # crosses into page 2
    alloc.malloc(MIB)  # small pool
    alloc.free(a)
    alloc.empty_cache()  # [0, 1.5 MiB) free holds no whole page
    assert alloc.stats().reserved_bytes == 4 * MIB + 2 * MIB
    alloc.free(b)
    alloc.empty_cache()
    assert alloc.stats().reserved_bytes == 2 * MIB  # only the small pool's page remains
    alloc.check_invariants()


def test_expandable_best_fit_prefers_a_block_that_cannot_grow():
    _, alloc = make(expandable_segments=True)
    a = alloc.malloc(4 * MIB)
    alloc.malloc(4 * MIB)
    c = alloc.malloc(2 * MIB + 512 * KIB)  # 1.5 MiB free at the end of the mapping
    alloc.free(a)  # a 4 MiB free hole at the start
    # the 1.5 MiB tail is the smaller fit, but counted with the unmapped space after
    # it (torch's expandable_size) it is the bigger one, so the hole is used
    assert alloc.malloc(MIB + 256 * KIB) == a
    assert alloc.stats().largest_free_block_bytes == 4 * MIB - (MIB + 256 * KIB)
    assert c  # the tail stays free for growth
    alloc.check_invariants()


# --------------------------------------------------------------------------- errors and reporting


def test_bad_sizes_and_bad_frees_are_rejected():
    _, alloc = make()
    for bad in (0, -1):
        with pytest.raises(ValueError):
            alloc.malloc(bad)
    a = alloc.malloc(10)
    alloc.free(a)
    with pytest.raises(ValueError):
        alloc.free(a)  # double free
    with pytest.raises(ValueError):
        alloc.free(12345)
    with pytest.raises(ValueError):
        alloc.block_size(a)
    alloc.check_invariants()


def test_device_memory_charges_owners_and_refuses_what_does_not_fit():
    dev = DeviceMemory(10 * MIB)
    assert dev.reserve(6 * MIB, "a") and dev.reserve(3 * MIB, "b")
    assert not dev.reserve(2 * MIB, "a")  # nothing charged on failure
    assert (dev.used_bytes(), dev.used_bytes("a"), dev.free_bytes()) == (9 * MIB, 6 * MIB, MIB)
    with pytest.raises(ValueError):
        dev.release(4 * MIB, "b")
    dev.release(6 * MIB, "a")
    assert dev.used_bytes("a") == 0 and dev.free_bytes() == 7 * MIB


def test_snapshot_has_torchs_shape_and_block_sizes_sum_to_the_segment():
    _, alloc = make()
    a = alloc.malloc(3000)
    alloc.malloc(5 * MIB)
    alloc.malloc(30 * MIB)
    alloc.free(a)
    segs = alloc.snapshot()
    assert len(segs) == 3 and [s["address"] for s in segs] == sorted(s["address"] for s in segs)
    seg_keys = {
        "device",
        "address",
        "total_size",
        "allocated_size",
        "active_size",
        "requested_size",
        "stream",
        "segment_type",
        "segment_pool_id",
        "is_expandable",
        "frames",
        "blocks",
    }
    for s in segs:
        assert set(s) == seg_keys
        assert (
            s["device"] == 0
            and s["stream"] == 0
            and s["segment_pool_id"] == [0, 0]
            and s["frames"] == []
        )
        assert s["is_expandable"] is False and s["segment_type"] in ("small", "large")
        assert sum(b["size"] for b in s["blocks"]) == s["total_size"]
        assert (
            s["allocated_size"]
            == s["active_size"]
            == sum(b["size"] for b in s["blocks"] if b["state"] == "active_allocated")
        )
        assert s["requested_size"] == sum(b["requested_size"] for b in s["blocks"])
        addr = s["address"]
        for b in s["blocks"]:
            assert set(b) == {"address", "size", "requested_size", "state", "frames"}
            assert b["address"] == addr and b["state"] in ("active_allocated", "inactive")
            addr += b["size"]
    assert sum(s["total_size"] for s in segs) == alloc.stats().reserved_bytes


def test_stats_is_a_frozen_record():
    _, alloc = make()
    st_ = alloc.stats()
    assert isinstance(st_, AllocatorStats)
    with pytest.raises(dataclasses.FrozenInstanceError):
        st_.allocated_bytes = 1  # type: ignore[misc]


# --------------------------------------------------------------------------- random workloads

SIZES = st.one_of(
    st.integers(1, 4 * KIB),
    st.integers(1, MIB),
    st.integers(MIB, 12 * MIB),
    st.integers(12 * MIB, 400 * MIB),
)
OPS = st.one_of(
    st.tuples(st.just("malloc"), SIZES),
    st.tuples(st.just("malloc"), SIZES),
    st.tuples(st.just("malloc"), SIZES),
    st.tuples(st.just("free"), st.integers(0, 1 << 20)),
    st.tuples(st.just("free"), st.integers(0, 1 << 20)),
    st.tuples(st.just("empty_cache"), st.none()),
    # another process takes all but ARG bytes of what is free, or returns what it took
    st.tuples(st.just("hog"), st.integers(0, GIB)),
)
CONFIGS = st.one_of(
    st.just({}),
    st.sampled_from([20 * MIB, 64 * MIB, 256 * MIB]).map(lambda m: {"max_split_size_bytes": m}),
    st.just({"expandable_segments": True}),
)


def check_externally(alloc, dev, live, other):
    """What a user can observe agrees with the model's own statistics."""
    st_ = alloc.stats()
    assert st_.allocated_bytes == sum(alloc.block_size(a) for a in live)
    assert st_.requested_bytes == sum(live.values())
    assert 0 <= st_.allocated_bytes <= st_.reserved_bytes <= dev.total_bytes
    assert dev.used_bytes() == st_.reserved_bytes + other
    segs = alloc.snapshot()
    assert len(segs) == st_.segment_count
    assert sum(s["total_size"] for s in segs) == st_.reserved_bytes
    end = None
    seen = {}
    for s in segs:  # blocks tile their segment exactly; segments do not overlap
        assert end is None or s["address"] >= end
        addr = s["address"]
        for b in s["blocks"]:
            assert b["address"] == addr
            addr += b["size"]
            if b["state"] == "active_allocated":
                seen[b["address"]] = b["requested_size"]
        assert addr == s["address"] + s["total_size"]
        end = addr
    assert seen == live


def run_ops(total, config, ops, check_every=1):
    dev = DeviceMemory(total)
    alloc = CachingAllocator(dev, "engine", **config)
    expandable = config.get("expandable_segments", False)
    live: dict[int, int] = {}
    other = 0
    for i, (op, arg) in enumerate(ops):
        if op == "malloc":
            before = alloc.stats()
            try:
                a = alloc.malloc(arg)
            except OutOfMemory as e:
                assert alloc.stats().num_ooms == before.num_ooms + 1
                assert e.requested_bytes == arg and e.reserved_bytes == alloc.stats().reserved_bytes
                need = round_size(arg)
                need = -(-need // PAGE) * PAGE if expandable else get_allocation_size(need)
                assert e.device_free_bytes < need  # an OOM only when the device truly lacks room
                assert e.device_free_bytes == dev.free_bytes()
            else:
                assert a not in live
                live[a] = arg
                assert alloc.block_size(a) >= round_size(arg)
        elif op == "free":
            if live:
                a = list(live)[arg % len(live)]
                alloc.free(a)
                del live[a]
        elif op == "empty_cache":
            alloc.empty_cache()
            for s in alloc.snapshot():
                for b in s["blocks"]:
                    if b["state"] != "inactive":
                        continue
                    if expandable:  # no whole page is left mapped inside a free block
                        first_page = -(-b["address"] // PAGE) * PAGE
                        assert first_page + PAGE > b["address"] + b["size"]
                    else:  # only free blocks of split segments remain
                        assert len(s["blocks"]) > 1
        else:  # hog
            if other:
                dev.release(other, "other")
                other = 0
            else:
                other = max(0, dev.free_bytes() - arg)
                assert dev.reserve(other, "other")
        if i % check_every == 0:
            alloc.check_invariants()
            check_externally(alloc, dev, live, other)
    for a in list(live):
        alloc.free(a)
    live.clear()
    st_ = alloc.stats()
    assert st_.allocated_bytes == 0 and st_.requested_bytes == 0 and st_.inactive_split_bytes == 0
    alloc.empty_cache()
    st_ = alloc.stats()
    assert st_.reserved_bytes == 0 and st_.segment_count == 0 and st_.largest_free_block_bytes == 0
    assert dev.used_bytes("engine") == 0 and alloc.snapshot() == []
    assert st_.device_malloc_bytes == st_.device_free_bytes
    alloc.check_invariants()
    return alloc


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(total_gib=st.integers(2, 8), config=CONFIGS, ops=st.lists(OPS, max_size=60))
def test_random_workloads_keep_every_invariant_and_drain_to_zero(total_gib, config, ops):
    run_ops(total_gib * GIB, config, ops)


@pytest.mark.parametrize(
    "config",
    [{}, {"max_split_size_bytes": 64 * MIB}, {"expandable_segments": True}],
    ids=["classic", "max_split", "expandable"],
)
def test_a_long_random_workload_hits_retries_and_ooms_and_stays_consistent(config):
    rng = random.Random(1234)
    ops = []
    for _ in range(2500):
        r = rng.random()
        if r < 0.5:
            kind = rng.random()
            size = (
                rng.randint(1, MIB)
                if kind < 0.5
                else rng.randint(MIB, 12 * MIB)
                if kind < 0.85
                else rng.randint(12 * MIB, 300 * MIB)
            )
            ops.append(("malloc", size))
        elif r < 0.93:
            ops.append(("free", rng.randrange(1 << 20)))
        elif r < 0.96:
            ops.append(("empty_cache", None))
        else:
            ops.append(("hog", rng.randint(0, GIB)))
    alloc = run_ops(4 * GIB, config, ops, check_every=7)
    st_ = alloc.stats()
    assert st_.num_alloc_retries > 0 and st_.num_ooms > 0
