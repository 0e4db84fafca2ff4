"""A pure-Python model of PyTorch's CUDA caching allocator, for the simulated GPU.

The simulated GPU has no tensors and no real memory, but it must run out of
memory the way a real PyTorch process does: through fragmentation of cached
segments, allocation retries and OOMs that happen while "free" memory is still
reported. So instead of counting bytes, this module re-implements the
mechanism of ``c10/cuda/CUDACachingAllocator.cpp`` (``DeviceCachingAllocator``)
on top of a byte-counting model of the device's HBM (:class:`DeviceMemory`).
Sizes, addresses and statistics are exact integers; nothing here touches a GPU.

Modelled (names are the torch source's):

* ``round_size``: every request is rounded up to a multiple of
  ``kMinBlockSize`` (512 B).
* two pools, chosen by ``get_pool``: *small* for rounded sizes <= ``kSmallSize``
  (1 MiB), *large* otherwise.
* ``get_allocation_size``: a new segment (one ``cudaMalloc``, here
  :meth:`DeviceMemory.reserve`) is ``kSmallBuffer`` (2 MiB) for the small pool,
  ``kLargeBuffer`` (20 MiB) for large requests < ``kMinLargeAlloc`` (10 MiB),
  and the request rounded up to ``kRoundLarge`` (2 MiB) otherwise.
* ``get_free_block``: best fit -- the smallest cached free block of the pool
  with size >= request, ties broken by lowest address (torch's
  ``BlockComparatorSize``). With ``max_split_size``: a request below it never
  takes a block >= it ("oversize"), and a request >= it takes an oversize block
  only if the block is < request + ``kLargeBuffer``.
* ``should_split``: small pool (and every pool under expandable segments) splits
  when the remainder is >= ``kMinBlockSize``; the large pool splits when the
  request is < ``max_split_size`` and the remainder is > ``kSmallSize``.
  An unsplit block keeps its whole size (``allocated_bytes`` counts it).
* ``free_block`` / ``try_merge_blocks``: a freed block merges with free
  neighbours of the same segment (never across segments).
* the malloc retry ladder: ``alloc_block`` -> ``release_available_cached_blocks``
  (only when ``max_split_size`` is set: release the smallest cached oversize
  segment that covers the request, or else oversize segments from the largest
  down until enough is released) -> ``alloc_block`` -> ``release_cached_blocks``
  (release every whole-free segment of both pools; under expandable segments
  unmap free pages instead, and skip the oversize rung) -> ``alloc_block`` with
  ``isRetry`` (``num_alloc_retries += 1``) -> ``num_ooms += 1`` and
  :class:`OutOfMemory`. As in torch, ``num_alloc_retries`` counts only the
  last rung, not the oversize-release rung.
* ``emptyCache`` = ``release_cached_blocks``.
* expandable segments (``Note [Expandable Segments]``, ``ExpandableSegment``,
  ``find_expandable_block``, ``map_block``, ``unmap_block``,
  ``release_expandable_segment``): applied to BOTH pools, as torch does. Each
  pool gets a virtual segment of ~9/8 of the device's memory (a further one if a
  request cannot fit in the address space left); physical pages are mapped on
  demand at the lowest address with enough free+unmapped room (usually the end
  of the mapped part, or a hole left by an earlier unmap), and on retry /
  ``empty_cache`` every page lying wholly inside a free block is unmapped, so
  holes in the middle return memory to the device. Best fit uses torch's
  "expandable size" tie-break (a free block followed by unmapped space counts as
  that much bigger). Each map or unmap call counts as one device malloc/free.
  ``reserved_bytes`` counts mapped bytes; ``segment_count`` and
  :meth:`CachingAllocator.snapshot` count one segment per contiguous mapped
  range (torch's snapshot does the same); ``inactive_split_bytes`` leaves
  expandable segments out (torch does the same).
* statistics with torch's meanings (``memory_stats()`` keys ``allocated_bytes``,
  ``requested_bytes``, ``reserved_bytes``, ``active_bytes``,
  ``inactive_split_bytes``, ``num_alloc_retries``, ``num_ooms``,
  ``num_device_alloc``, ``num_device_free``), kept incrementally.

Simplified or left out:

* one stream (0), so no per-stream pools, ``recordStream``, CUDA events or
  deferred frees: ``active_bytes == allocated_bytes``.
* no CUDA-graph private pools, no ``roundup_power2_divisions``, no
  ``garbage_collection_threshold``, no ``set_per_process_memory_fraction``, no
  free-memory callbacks, no IPC, no peak/accumulated stat variants.
* expandable-segment pages are 2 MiB in both pools (torch maps the large pool's
  expandable segment in 20 MiB pages, ``kLargeBuffer``); see
  :data:`EXPANDABLE_PAGE_SIZE`.
* ``cudaMalloc`` is all-or-nothing against :class:`DeviceMemory`; there is no
  driver-side fragmentation or alignment cost, and addresses are synthetic
  (unique, never reused, never adjacent across segments).
* ``max_split_size_bytes`` must be >= 20 MiB, as torch requires
  (``max_split_size_mb`` >= 20).
* the OOM message follows torch's content, not its exact wording, and reports
  the caller's requested size (torch prints the segment size it tried to
  ``cudaMalloc``, available here as :attr:`OutOfMemory.allocation_bytes`).

Cost: malloc/free do a bisect over the pool's free blocks sorted by (size,
address) plus O(1) neighbour links (list insertion is a memmove); only the
retry path, ``empty_cache``, ``snapshot`` and ``check_invariants`` scan.

:class:`DeviceMemory` is the physical HBM shared by every owner on one GPU; an
allocator charges it under its ``owner`` name, which it must not share with
other users of the device (``check_invariants`` checks the charge equals the
allocator's reserved bytes).
"""

from __future__ import annotations

import operator
from bisect import bisect_left, insort
from dataclasses import dataclass

__all__ = [
    "EXPANDABLE_PAGE_SIZE",
    "GIB",
    "KIB",
    "K_LARGE_BUFFER",
    "K_MIN_BLOCK_SIZE",
    "K_MIN_LARGE_ALLOC",
    "K_ROUND_LARGE",
    "K_SMALL_BUFFER",
    "K_SMALL_SIZE",
    "MIB",
    "AllocatorStats",
    "CachingAllocator",
    "DeviceMemory",
    "OutOfMemory",
    "format_size",
    "get_allocation_size",
    "round_size",
]

KIB, MIB, GIB = 1024, 1024**2, 1024**3

K_MIN_BLOCK_SIZE = 512  # kMinBlockSize: every size is rounded to a multiple of this
K_SMALL_SIZE = 1 * MIB  # kSmallSize: largest "small" request
K_SMALL_BUFFER = 2 * MIB  # kSmallBuffer: small requests are packed in 2 MiB segments
K_LARGE_BUFFER = 20 * MIB  # kLargeBuffer: requests in (1, 10) MiB share 20 MiB segments
K_MIN_LARGE_ALLOC = 10 * MIB  # kMinLargeAlloc: from here on a request gets its own segment
K_ROUND_LARGE = 2 * MIB  # kRoundLarge: large segments are rounded up to 2 MiB
EXPANDABLE_PAGE_SIZE = 2 * MIB  # granularity of map/unmap in expandable segments

_VA_BASE = 0x7F00_0000_0000  # synthetic device virtual addresses start here
_SHIFT = 64  # free-list key = size << 64 | address
_MASK = (1 << _SHIFT) - 1
_NO_MAX_SPLIT = 1 << 62  # "max_split_size unset" (torch: SIZE_MAX)


def round_size(size: int) -> int:
    """torch's ``round_size`` (without ``roundup_power2_divisions``): up to a multiple of 512."""
    if size < K_MIN_BLOCK_SIZE:
        return K_MIN_BLOCK_SIZE
    return (size + K_MIN_BLOCK_SIZE - 1) // K_MIN_BLOCK_SIZE * K_MIN_BLOCK_SIZE


def get_allocation_size(size: int) -> int:
    """torch's ``get_allocation_size``: the segment size cudaMalloc'd for a rounded request."""
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return (size + K_ROUND_LARGE - 1) // K_ROUND_LARGE * K_ROUND_LARGE


def format_size(nbytes: int) -> str:
    """Human-readable size the way torch's ``format_size`` writes it."""
    if nbytes <= 1024:
        return f"{nbytes} bytes"
    if nbytes <= MIB:
        return f"{nbytes / KIB:.2f} KiB"
    if nbytes <= GIB:
        return f"{nbytes / MIB:.2f} MiB"
    return f"{nbytes / GIB:.2f} GiB"


# --------------------------------------------------------------------------- device


class DeviceMemory:
    """Physical HBM of one simulated GPU, shared by every owner.

    Owners are processes, the CUDA context, leaks: anything charging memory by name.
    """

    __slots__ = ("_by_owner", "_used", "total_bytes")

    def __init__(self, total_bytes: int):
        total_bytes = operator.index(total_bytes)
        if total_bytes <= 0:
            raise ValueError(f"device memory must be positive, got {total_bytes}")
        self.total_bytes = total_bytes
        self._used = 0
        self._by_owner: dict[str, int] = {}

    def used_bytes(self, owner: str | None = None) -> int:
        """Bytes held by ``owner``, or by all owners when ``owner`` is None."""
        if owner is None:
            return self._used
        return self._by_owner.get(owner, 0)

    def free_bytes(self) -> int:
        return self.total_bytes - self._used

    def owners(self) -> dict[str, int]:
        """A copy of the bytes held per owner (owners holding nothing are left out)."""
        return {k: v for k, v in self._by_owner.items() if v}

    def reserve(self, nbytes: int, owner: str) -> bool:
        """A cudaMalloc: charge ``nbytes`` to ``owner`` and return True if it fits, else False."""
        if nbytes < 0:
            raise ValueError(f"cannot reserve a negative size ({nbytes})")
        if self._used + nbytes > self.total_bytes:
            return False
        self._used += nbytes
        self._by_owner[owner] = self._by_owner.get(owner, 0) + nbytes
        return True

    def release(self, nbytes: int, owner: str) -> None:
        """A cudaFree of ``nbytes`` held by ``owner``; ValueError if it holds less."""
        held = self._by_owner.get(owner, 0)
        if nbytes < 0 or nbytes > held:
            raise ValueError(f"owner {owner!r} releases {nbytes} bytes but holds {held} bytes")
        self._by_owner[owner] = held - nbytes
        self._used -= nbytes

    def __repr__(self) -> str:
        return (
            f"DeviceMemory(total={format_size(self.total_bytes)}, "
            f"used={format_size(self._used)}, owners={self.owners()})"
        )


# --------------------------------------------------------------------------- errors, stats


class OutOfMemory(Exception):
    """Raised by CachingAllocator.malloc when the request cannot be satisfied.

    That is: no cached block fits and cudaMalloc fails even after freeing cached segments.
    """

    def __init__(
        self,
        requested_bytes: int,
        allocated_bytes: int,
        reserved_bytes: int,
        free_reserved_bytes: int,
        largest_free_block_bytes: int,
        device_free_bytes: int,
        *,
        rounded_bytes: int | None = None,
        allocation_bytes: int | None = None,
        device_total_bytes: int | None = None,
    ):
        self.requested_bytes = requested_bytes
        self.allocated_bytes = allocated_bytes
        self.reserved_bytes = reserved_bytes
        self.free_reserved_bytes = free_reserved_bytes
        self.largest_free_block_bytes = largest_free_block_bytes
        self.device_free_bytes = device_free_bytes
        # rounded request (round_size) and the segment size torch would cudaMalloc for it
        self.rounded_bytes = round_size(requested_bytes) if rounded_bytes is None else rounded_bytes
        self.allocation_bytes = (
            get_allocation_size(self.rounded_bytes)
            if allocation_bytes is None
            else allocation_bytes
        )
        self.device_total_bytes = device_total_bytes
        super().__init__(self._message())

    def _message(self) -> str:
        dev = f"device has {format_size(self.device_free_bytes)} free"
        if self.device_total_bytes is not None:
            dev += f" of {format_size(self.device_total_bytes)}"
        return (
            f"CUDA out of memory. Tried to allocate {format_size(self.requested_bytes)}; "
            f"{format_size(self.reserved_bytes)} reserved, "
            f"{format_size(self.allocated_bytes)} allocated, "
            f"{format_size(self.free_reserved_bytes)} free in reserved segments, "
            f"largest free block {format_size(self.largest_free_block_bytes)}; {dev}"
        )

    def __reduce__(self):
        return (
            _rebuild_oom,
            (
                self.requested_bytes,
                self.allocated_bytes,
                self.reserved_bytes,
                self.free_reserved_bytes,
                self.largest_free_block_bytes,
                self.device_free_bytes,
                self.rounded_bytes,
                self.allocation_bytes,
                self.device_total_bytes,
            ),
        )


def _rebuild_oom(req, alloc, res, free_res, largest, dev_free, rounded, alloc_sz, dev_total):
    return OutOfMemory(
        req,
        alloc,
        res,
        free_res,
        largest,
        dev_free,
        rounded_bytes=rounded,
        allocation_bytes=alloc_sz,
        device_total_bytes=dev_total,
    )


@dataclass(frozen=True)
class AllocatorStats:
    allocated_bytes: int  # sum of sizes of live (allocated) blocks (after rounding)
    requested_bytes: int  # sum of the sizes callers asked for, live blocks
    reserved_bytes: int  # sum of segment sizes (for expandable: mapped bytes)
    active_bytes: int  # = allocated_bytes in this model (no stream-pending frees)
    inactive_split_bytes: int  # free blocks inside segments that are split (not whole-segment free)
    free_reserved_bytes: int  # reserved - allocated
    largest_free_block_bytes: int  # largest free block in any segment (0 if none)
    segment_count: int
    num_alloc_retries: int
    num_ooms: int
    num_device_mallocs: int  # cudaMalloc (or page-map) calls made so far
    num_device_frees: int  # cudaFree (or page-unmap) calls made so far
    device_malloc_bytes: int  # cumulative
    device_free_bytes: int  # cumulative


# --------------------------------------------------------------------------- internals


class _Pool:
    """A BlockPool: free mapped blocks sorted by (size, address); unmapped ranges by address."""

    __slots__ = ("is_small", "keys", "unmapped")

    def __init__(self, is_small: bool):
        self.is_small = is_small
        self.keys: list[int] = []  # size << 64 | addr, ascending == best-fit order
        self.unmapped: list[int] = []  # addresses of unmapped blocks (expandable only)


class _Segment:
    """One cudaMalloc'd segment, or one expandable virtual segment."""

    __slots__ = ("base", "expandable", "head", "pool", "size")

    def __init__(self, base: int, size: int, pool: _Pool, expandable: bool):
        self.base = base
        self.size = size  # bytes (classic) or virtual address space (expandable)
        self.pool = pool
        self.expandable = expandable
        self.head: _Block | None = (
            None  # lowest-address block; never changes (merges keep the lower block)
        )


class _Block:
    """A contiguous range of a segment: allocated, free (mapped) or unmapped."""

    __slots__ = ("addr", "alloc", "isc", "mapped", "next", "prev", "req", "seg", "size")

    def __init__(self, addr: int, size: int, seg: _Segment, mapped: bool = True):
        self.addr = addr
        self.size = size
        self.req = 0  # requested size while allocated
        self.alloc = False
        self.mapped = mapped
        self.prev: _Block | None = None
        self.next: _Block | None = None
        self.seg = seg
        self.isc = False  # counted in inactive_split_bytes (free, split, classic segment)


# --------------------------------------------------------------------------- allocator


class CachingAllocator:
    """A model of ``DeviceCachingAllocator`` for one device and one stream (see module doc)."""

    def __init__(
        self,
        device: DeviceMemory,
        owner: str = "engine",
        *,
        max_split_size_bytes: int | None = None,
        expandable_segments: bool = False,
    ):
        if max_split_size_bytes is not None:
            max_split_size_bytes = operator.index(max_split_size_bytes)
            if max_split_size_bytes < K_LARGE_BUFFER:
                raise ValueError(
                    f"max_split_size_bytes must be >= {format_size(K_LARGE_BUFFER)} "
                    f"(torch: max_split_size_mb >= 20), got {max_split_size_bytes}"
                )
        self._device = device
        self._owner = owner
        self.max_split_size_bytes = max_split_size_bytes
        self._max_split = _NO_MAX_SPLIT if max_split_size_bytes is None else max_split_size_bytes
        self.expandable_segments = bool(expandable_segments)
        self._expandable = self.expandable_segments
        # virtual address space of one expandable segment: 9/8 of the device, in whole pages
        page = EXPANDABLE_PAGE_SIZE
        self._exp_va_size = -(-(device.total_bytes + device.total_bytes // 8) // page) * page

        self._small = _Pool(True)
        self._large = _Pool(False)
        self._live: dict[int, _Block] = {}  # addr -> allocated block
        self._free: dict[int, _Block] = {}  # addr -> free mapped block (in some pool's keys)
        self._unmapped: dict[int, _Block] = {}  # addr -> unmapped block (expandable)
        self._segments: dict[int, _Segment] = {}  # base -> segment
        self._next_va = _VA_BASE

        # incremental statistics
        self._allocated = 0
        self._requested = 0
        self._reserved = 0
        self._inactive_split = 0
        self._classic_segments = 0
        self._exp_runs = 0  # contiguous mapped ranges in expandable segments
        self._num_alloc_retries = 0
        self._num_ooms = 0
        self._num_device_mallocs = 0
        self._num_device_frees = 0
        self._device_malloc_bytes = 0
        self._device_free_bytes = 0

    # ------------------------------------------------------------------ public API

    @property
    def device(self) -> DeviceMemory:
        return self._device

    @property
    def owner(self) -> str:
        return self._owner

    def malloc(self, size: int) -> int:
        """Allocate ``size`` bytes; return the block's address. OutOfMemory if impossible."""
        if size.__class__ is not int:
            size = operator.index(size)
        if size <= 0:
            raise ValueError(f"malloc size must be > 0, got {size}")
        rsize = K_MIN_BLOCK_SIZE if size <= K_MIN_BLOCK_SIZE else (size + 511) & ~511
        small = rsize <= K_SMALL_SIZE
        pool = self._small if small else self._large

        block = self._get_free_block(pool, rsize)
        if block is None:
            block = self._alloc_block(pool, rsize, False)
            if block is None:
                if self._release_available_cached_blocks(pool, rsize):
                    block = self._alloc_block(pool, rsize, False)
                if block is None:
                    self._release_cached_blocks()
                    block = self._alloc_block(pool, rsize, True)
                    if block is None:
                        self._num_ooms += 1
                        raise self._make_oom(size, rsize)

        # should_split
        remaining = block.size - rsize
        if small or self._expandable:
            split = remaining >= K_MIN_BLOCK_SIZE
        else:
            split = rsize < self._max_split and remaining > K_SMALL_SIZE
        if split:
            rest = _Block(block.addr + rsize, remaining, block.seg)
            nxt = block.next
            rest.prev = block
            rest.next = nxt
            if nxt is not None:
                nxt.prev = rest
            block.next = rest
            block.size = rsize
            self._insert_free(rest)

        block.alloc = True
        block.req = size
        self._live[block.addr] = block
        self._allocated += block.size
        self._requested += size
        return block.addr

    def free(self, addr: int) -> None:
        """Return a live block to the cache, merging free neighbours; ValueError if not live."""
        block = self._live.pop(addr, None)
        if block is None:
            raise ValueError(f"free of an address that is not a live allocation: {addr!r}")
        self._allocated -= block.size
        self._requested -= block.req
        block.alloc = False
        block.req = 0
        prev = block.prev
        if prev is not None and not prev.alloc and prev.mapped:
            self._remove_free(prev)
            prev.size += block.size
            nxt = block.next
            prev.next = nxt
            if nxt is not None:
                nxt.prev = prev
            block = prev
        nxt = block.next
        if nxt is not None and not nxt.alloc and nxt.mapped:
            self._remove_free(nxt)
            block.size += nxt.size
            nn = nxt.next
            block.next = nn
            if nn is not None:
                nn.prev = block
        self._insert_free(block)

    def empty_cache(self) -> None:
        """torch.cuda.empty_cache: release whole-free segments (and unmap free pages)."""
        self._release_cached_blocks()

    def block_size(self, addr: int) -> int:
        """The rounded size of the live block at ``addr`` (may exceed round_size when unsplit)."""
        block = self._live.get(addr)
        if block is None:
            raise ValueError(f"not a live allocation: {addr!r}")
        return block.size

    def requested_size(self, addr: int) -> int:
        """The size the caller asked for when allocating the live block at ``addr``."""
        block = self._live.get(addr)
        if block is None:
            raise ValueError(f"not a live allocation: {addr!r}")
        return block.req

    def is_live(self, addr: int) -> bool:
        return addr in self._live

    def stats(self) -> AllocatorStats:
        largest = 0
        keys = self._large.keys
        if keys:
            largest = keys[-1] >> _SHIFT
        keys = self._small.keys
        if keys and (keys[-1] >> _SHIFT) > largest:
            largest = keys[-1] >> _SHIFT
        return AllocatorStats(
            allocated_bytes=self._allocated,
            requested_bytes=self._requested,
            reserved_bytes=self._reserved,
            active_bytes=self._allocated,
            inactive_split_bytes=self._inactive_split,
            free_reserved_bytes=self._reserved - self._allocated,
            largest_free_block_bytes=largest,
            segment_count=self._classic_segments + self._exp_runs,
            num_alloc_retries=self._num_alloc_retries,
            num_ooms=self._num_ooms,
            num_device_mallocs=self._num_device_mallocs,
            num_device_frees=self._num_device_frees,
            device_malloc_bytes=self._device_malloc_bytes,
            device_free_bytes=self._device_free_bytes,
        )

    def snapshot(self) -> list[dict]:
        """``torch.cuda.memory._snapshot()["segments"]``: a dict per segment (per mapped range)."""
        out: list[dict] = []
        for seg in sorted(self._segments.values(), key=lambda s: s.base):
            seg_type = "small" if seg.pool.is_small else "large"
            run: list[_Block] = []
            b = seg.head
            while b is not None:
                if b.mapped:
                    run.append(b)
                elif run:
                    out.append(self._segment_dict(run, seg_type, seg.expandable))
                    run = []
                b = b.next
            if run:
                out.append(self._segment_dict(run, seg_type, seg.expandable))
        return out

    def check_invariants(self) -> None:
        """Recount everything from scratch; AssertionError naming the first mismatch."""
        allocated = requested = reserved = inactive = 0
        classic_segments = exp_runs = 0
        largest = 0
        n_live = n_free = n_unmapped = 0
        page = EXPANDABLE_PAGE_SIZE
        pools = {id(self._small): self._small, id(self._large): self._large}
        keysets = {id(self._small): set(self._small.keys), id(self._large): set(self._large.keys)}
        unmapsets = {
            id(self._small): set(self._small.unmapped),
            id(self._large): set(self._large.unmapped),
        }
        last_end = None
        for base in sorted(self._segments):
            seg = self._segments[base]
            where = f"segment {base:#x} ({'expandable ' if seg.expandable else ''}"
            where += f"{'small' if seg.pool.is_small else 'large'}, {seg.size} B)"
            _check(seg.base == base, f"{where}: registered under the wrong base")
            _check(id(seg.pool) in pools, f"{where}: pool is not one of this allocator's")
            _check(last_end is None or base >= last_end, f"{where}: overlaps the previous segment")
            last_end = base + seg.size
            if not seg.expandable:
                _check(self._expandable is False, f"{where}: classic segment in expandable mode")
                if seg.pool.is_small:
                    _check(seg.size == K_SMALL_BUFFER, f"{where}: small segment is not 2 MiB")
                else:
                    _check(
                        seg.size == K_LARGE_BUFFER
                        or (seg.size >= K_MIN_LARGE_ALLOC and seg.size % K_ROUND_LARGE == 0),
                        f"{where}: large segment size is not 20 MiB or a 2 MiB multiple >= 10 MiB",
                    )
            _check(base % page == 0, f"{where}: base not 2 MiB aligned")
            b = seg.head
            _check(b is not None and b.prev is None, f"{where}: head block missing or has a prev")
            _check(b.addr == base, f"{where}: head block does not start at the segment base")
            expect = base
            prev = None
            mapped_bytes = 0
            in_run = False
            split = b.next is not None
            while b is not None:
                tag = f"{where}: block {b.addr:#x}+{b.size}"
                _check(b.seg is seg, f"{tag}: belongs to another segment")
                _check(b.prev is prev, f"{tag}: prev link broken")
                _check(
                    b.addr == expect,
                    f"{tag}: does not start where the previous block ends ({expect:#x})",
                )
                _check(b.size > 0, f"{tag}: empty block")
                _check(b.size % K_MIN_BLOCK_SIZE == 0, f"{tag}: size not a multiple of 512")
                if b.alloc:
                    _check(b.mapped, f"{tag}: allocated but unmapped")
                    _check(
                        self._live.get(b.addr) is b,
                        f"{tag}: allocated block missing from the live map",
                    )
                    _check(0 < b.req <= b.size, f"{tag}: requested size {b.req} outside (0, size]")
                    _check(round_size(b.req) <= b.size, f"{tag}: smaller than its rounded request")
                    _check(not b.isc, f"{tag}: allocated block counted as inactive split")
                    allocated += b.size
                    requested += b.req
                    n_live += 1
                elif b.mapped:
                    _check(
                        self._free.get(b.addr) is b, f"{tag}: free block missing from the free map"
                    )
                    key = (b.size << _SHIFT) | b.addr
                    _check(
                        key in keysets[id(seg.pool)],
                        f"{tag}: free block missing from its pool's size index",
                    )
                    _check(
                        prev is None or prev.alloc or not prev.mapped,
                        f"{tag}: two adjacent free blocks were not merged",
                    )
                    want_isc = (not seg.expandable) and split
                    _check(
                        b.isc == want_isc,
                        f"{tag}: inactive-split flag {b.isc}, expected {want_isc}",
                    )
                    if want_isc:
                        inactive += b.size
                    largest = max(largest, b.size)
                    n_free += 1
                else:
                    _check(seg.expandable, f"{tag}: unmapped block in a classic segment")
                    _check(
                        self._unmapped.get(b.addr) is b,
                        f"{tag}: unmapped block missing from the unmapped map",
                    )
                    _check(
                        b.addr in unmapsets[id(seg.pool)],
                        f"{tag}: unmapped block missing from its pool's list",
                    )
                    _check(
                        prev is None or prev.mapped,
                        f"{tag}: two adjacent unmapped blocks were not merged",
                    )
                    _check(
                        (b.addr - base) % page == 0 and b.size % page == 0,
                        f"{tag}: unmapped range not page aligned",
                    )
                    _check(not b.isc, f"{tag}: unmapped block counted as inactive split")
                    n_unmapped += 1
                if b.mapped:
                    mapped_bytes += b.size
                    if not in_run:
                        exp_runs += seg.expandable
                        in_run = True
                else:
                    in_run = False
                expect = b.addr + b.size
                prev = b
                b = b.next
            _check(
                expect == base + seg.size,
                f"{where}: blocks cover {expect - base} B, segment is {seg.size} B",
            )
            if seg.expandable:
                _check(
                    mapped_bytes % page == 0,
                    f"{where}: mapped bytes {mapped_bytes} not whole pages",
                )
            else:
                classic_segments += 1
            reserved += mapped_bytes

        _check(
            n_live == len(self._live),
            f"live map has {len(self._live)} entries, segments hold {n_live}",
        )
        _check(
            n_free == len(self._free),
            f"free map has {len(self._free)} entries, segments hold {n_free}",
        )
        _check(
            n_free == len(self._small.keys) + len(self._large.keys),
            "pool size indexes hold stale entries",
        )
        _check(n_unmapped == len(self._unmapped), "unmapped map holds stale entries")
        _check(
            n_unmapped == len(self._small.unmapped) + len(self._large.unmapped),
            "pool unmapped lists hold stale entries",
        )
        for pool in (self._small, self._large):
            _check(pool.keys == sorted(pool.keys), "a pool's size index is not sorted")
            _check(pool.unmapped == sorted(pool.unmapped), "a pool's unmapped list is not sorted")
            for k in pool.keys:
                blk = self._free.get(k & _MASK)
                _check(
                    blk is not None and blk.size == k >> _SHIFT,
                    f"size index entry {k & _MASK:#x} is stale",
                )
                _check(blk.seg.pool is pool, f"free block {blk.addr:#x} indexed in the wrong pool")

        st = self.stats()
        for name, want in (
            ("allocated_bytes", allocated),
            ("requested_bytes", requested),
            ("reserved_bytes", reserved),
            ("active_bytes", allocated),
            ("inactive_split_bytes", inactive),
            ("free_reserved_bytes", reserved - allocated),
            ("largest_free_block_bytes", largest),
            ("segment_count", classic_segments + exp_runs),
        ):
            got = getattr(st, name)
            _check(got == want, f"stats().{name} = {got}, recount gives {want}")
        _check(
            0 <= allocated <= reserved <= self._device.total_bytes,
            f"not 0 <= allocated ({allocated}) <= reserved ({reserved})"
            f" <= device total ({self._device.total_bytes})",
        )
        _check(
            self._device.used_bytes(self._owner) == reserved,
            f"device charges owner {self._owner!r} {self._device.used_bytes(self._owner)} B,"
            f" allocator reserves {reserved} B",
        )
        _check(
            st.device_malloc_bytes - st.device_free_bytes == reserved,
            f"cumulative device mallocs - frees ="
            f" {st.device_malloc_bytes - st.device_free_bytes}, reserved = {reserved}",
        )
        _check(
            st.num_device_frees <= st.num_device_mallocs or self._expandable,
            "more device frees than device mallocs",
        )

    def __repr__(self) -> str:
        st = self.stats()
        mode = "expandable" if self._expandable else "classic"
        return (
            f"CachingAllocator(owner={self._owner!r}, {mode}, "
            f"allocated={format_size(st.allocated_bytes)}, "
            f"reserved={format_size(st.reserved_bytes)}, "
            f"segments={st.segment_count})"
        )

    # ------------------------------------------------------------------ free-list plumbing

    def _insert_free(self, b: _Block) -> None:
        insort(b.seg.pool.keys, (b.size << _SHIFT) | b.addr)
        self._free[b.addr] = b
        if (b.prev is not None or b.next is not None) and not b.seg.expandable:
            b.isc = True
            self._inactive_split += b.size

    def _remove_free(self, b: _Block) -> None:
        keys = b.seg.pool.keys
        del keys[bisect_left(keys, (b.size << _SHIFT) | b.addr)]
        del self._free[b.addr]
        if b.isc:
            b.isc = False
            self._inactive_split -= b.size

    def _insert_unmapped(self, u: _Block) -> None:
        insort(u.seg.pool.unmapped, u.addr)
        self._unmapped[u.addr] = u

    def _remove_unmapped(self, u: _Block) -> None:
        lst = u.seg.pool.unmapped
        del lst[bisect_left(lst, u.addr)]
        del self._unmapped[u.addr]

    # ------------------------------------------------------------------ torch's steps

    def _get_free_block(self, pool: _Pool, rsize: int) -> _Block | None:
        keys = pool.keys
        i = bisect_left(keys, rsize << _SHIFT)
        n = len(keys)
        if i == n:
            return None
        free = self._free
        b = free[keys[i] & _MASK]
        if self._expandable:
            # prefer not to eat a block that could grow into unmapped space if a
            # block with a smaller "expandable size" follows (torch's expandable_size)
            nx = b.next
            es = b.size + (nx.size if nx is not None and not nx.mapped else 0)
            while i + 1 < n:
                c = free[keys[i + 1] & _MASK]
                nx = c.next
                ces = c.size + (nx.size if nx is not None and not nx.mapped else 0)
                if ces < es:
                    i += 1
                    b = c
                    es = ces
                else:
                    break
        ms = self._max_split
        if rsize < ms:
            if b.size >= ms:  # do not hand an oversize block to a small request
                return None
        elif b.size >= rsize + K_LARGE_BUFFER:  # oversize blocks only within kLargeBuffer
            return None
        del keys[i]
        del free[b.addr]
        if b.isc:
            b.isc = False
            self._inactive_split -= b.size
        return b

    def _alloc_block(self, pool: _Pool, rsize: int, is_retry: bool) -> _Block | None:
        if is_retry:
            self._num_alloc_retries += 1
        if self._expandable:
            return self._try_allocate_expandable_block(pool, rsize)
        asize = get_allocation_size(rsize)
        if not self._device.reserve(asize, self._owner):
            return None
        base = self._next_va
        self._next_va = base + asize + K_ROUND_LARGE  # a gap: segments never abut
        seg = _Segment(base, asize, pool, False)
        b = _Block(base, asize, seg)
        seg.head = b
        self._segments[base] = seg
        self._reserved += asize
        self._classic_segments += 1
        self._num_device_mallocs += 1
        self._device_malloc_bytes += asize
        return b

    def _release_segment(self, b: _Block) -> None:
        """release_block: cudaFree a classic whole-free segment (``b`` is its only block)."""
        self._remove_free(b)
        seg = b.seg
        del self._segments[seg.base]
        self._device.release(seg.size, self._owner)
        self._reserved -= seg.size
        self._classic_segments -= 1
        self._num_device_frees += 1
        self._device_free_bytes += seg.size
        b.seg = None  # type: ignore[assignment]

    def _release_available_cached_blocks(self, pool: _Pool, rsize: int) -> bool:
        if self.max_split_size_bytes is None or self._expandable:
            return False
        ms = self._max_split
        key = max(ms, rsize)
        keys = pool.keys
        free = self._free
        i = bisect_left(keys, key << _SHIFT)
        for j in range(i, len(keys)):  # smallest cached segment that alone covers the request
            b = free[keys[j] & _MASK]
            if b.prev is None and b.next is None:
                self._release_segment(b)
                return True
        # no single block is big enough: release oversize segments, largest first
        released = 0
        j = len(keys) - 1
        while j >= 0 and released < key:
            b = free[keys[j] & _MASK]
            if b.size < ms:
                break
            if b.prev is None and b.next is None:
                released += b.size
                self._release_segment(b)
            j -= 1
        return released >= key

    def _release_cached_blocks(self) -> None:
        free = self._free
        to_unmap: list[_Block] = []
        for pool in (self._large, self._small):
            if not pool.keys:
                continue
            for b in [free[k & _MASK] for k in pool.keys]:
                if b.seg.expandable:
                    to_unmap.append(b)
                elif b.prev is None and b.next is None:
                    self._release_segment(b)
        for b in to_unmap:
            self._unmap_block(b)
        if self._unmapped:
            for pool in (self._large, self._small):
                for addr in list(pool.unmapped):
                    u = self._unmapped[addr]
                    if u.prev is None and u.next is None:  # release_expandable_segment
                        self._remove_unmapped(u)
                        del self._segments[u.seg.base]

    # ------------------------------------------------------------------ expandable segments

    def _new_expandable_segment(self, pool: _Pool, min_size: int) -> _Block:
        page = EXPANDABLE_PAGE_SIZE
        va = self._exp_va_size
        if min_size > va:
            va = -(-min_size // page) * page
        base = self._next_va
        self._next_va = base + va + page
        seg = _Segment(base, va, pool, True)
        u = _Block(base, va, seg, mapped=False)
        seg.head = u
        self._segments[base] = seg
        self._insert_unmapped(u)
        return u

    def _find_expandable_block(self, pool: _Pool, size: int) -> _Block:
        """Lowest address where free + unmapped room reaches ``size`` (a new segment if none)."""
        unmapped = self._unmapped
        for addr in pool.unmapped:
            u = unmapped[addr]
            c = u
            p = u.prev
            if p is not None and not p.alloc:
                c = p
            room = 0
            x = c
            while x is not None and not x.alloc and room < size:
                room += x.size
                x = x.next
            if room >= size:
                return c
        return self._new_expandable_segment(pool, size)

    def _try_allocate_expandable_block(self, pool: _Pool, size: int) -> _Block | None:
        c = self._find_expandable_block(pool, size)
        if not c.mapped:
            c = self._map_block(c, min(c.size, size))
            if c is None:
                return None
        while c.size < size:
            nxt = c.next  # unmapped, by construction of _find_expandable_block
            c2 = self._map_block(nxt, min(size - c.size, nxt.size))
            if c2 is None:
                return None
            c = c2
        self._remove_free(c)
        return c

    def _map_block(self, u: _Block, nbytes: int) -> _Block | None:
        """Map the first ``nbytes`` (whole pages) of unmapped ``u``, merge, return the free block."""
        page = EXPANDABLE_PAGE_SIZE
        m = -(-nbytes // page) * page
        m = min(m, u.size)
        if not self._device.reserve(m, self._owner):
            return None
        self._reserved += m
        self._num_device_mallocs += 1
        self._device_malloc_bytes += m
        # the new mapped range joins the run before it (u.prev is mapped when it exists)
        # and, when u is mapped entirely, the run after it
        self._exp_runs += 1 - (u.prev is not None) - (m == u.size and u.next is not None)
        self._remove_unmapped(u)
        if m < u.size:
            rest = _Block(u.addr + m, u.size - m, u.seg, mapped=False)
            nxt = u.next
            rest.prev = u
            rest.next = nxt
            if nxt is not None:
                nxt.prev = rest
            u.next = rest
            u.size = m
            self._insert_unmapped(rest)
        u.mapped = True
        b = u
        p = b.prev
        if p is not None and not p.alloc and p.mapped:
            self._remove_free(p)
            p.size += b.size
            nxt = b.next
            p.next = nxt
            if nxt is not None:
                nxt.prev = p
            b = p
        nxt = b.next
        if nxt is not None and not nxt.alloc and nxt.mapped:
            self._remove_free(nxt)
            b.size += nxt.size
            nn = nxt.next
            b.next = nn
            if nn is not None:
                nn.prev = b
        self._insert_free(b)
        return b

    def _unmap_block(self, b: _Block) -> None:
        """Unmap every page lying wholly inside free block ``b`` (torch's unmap_block)."""
        seg = b.seg
        page = EXPANDABLE_PAGE_SIZE
        start = b.addr
        end = start + b.size
        u0 = seg.base + -(-(start - seg.base) // page) * page
        u1 = seg.base + (end - seg.base) // page * page
        if u0 >= u1:
            return
        self._remove_free(b)
        before = u0 - start
        after = end - u1
        n = u1 - u0
        prev = b.prev
        nxt = b.next
        left = before > 0 or (prev is not None and prev.mapped)
        right = after > 0 or (nxt is not None and nxt.mapped)
        self._exp_runs += left + right - 1
        if before > 0:
            u = _Block(u0, n, seg, mapped=False)
            b.size = before
            b.next = u
            u.prev = b
            u.next = nxt
            if nxt is not None:
                nxt.prev = u
            self._insert_free(b)
        else:
            u = b
            u.mapped = False
            u.size = n
        if after > 0:
            a = _Block(u1, after, seg)
            a.prev = u
            a.next = nxt
            u.next = a
            if nxt is not None:
                nxt.prev = a
            self._insert_free(a)
        p = u.prev
        if p is not None and not p.mapped:
            self._remove_unmapped(p)
            p.size += u.size
            nn = u.next
            p.next = nn
            if nn is not None:
                nn.prev = p
            u = p
        nx = u.next
        if nx is not None and not nx.mapped:
            self._remove_unmapped(nx)
            u.size += nx.size
            nn = nx.next
            u.next = nn
            if nn is not None:
                nn.prev = u
        self._insert_unmapped(u)
        self._device.release(n, self._owner)
        self._reserved -= n
        self._num_device_frees += 1
        self._device_free_bytes += n

    # ------------------------------------------------------------------ reporting helpers

    def _make_oom(self, size: int, rsize: int) -> OutOfMemory:
        st = self.stats()
        return OutOfMemory(
            size,
            st.allocated_bytes,
            st.reserved_bytes,
            st.free_reserved_bytes,
            st.largest_free_block_bytes,
            self._device.free_bytes(),
            rounded_bytes=rsize,
            allocation_bytes=get_allocation_size(rsize),
            device_total_bytes=self._device.total_bytes,
        )

    @staticmethod
    def _segment_dict(blocks: list[_Block], seg_type: str, expandable: bool) -> dict:
        total = allocated = requested = 0
        out_blocks = []
        for b in blocks:
            total += b.size
            if b.alloc:
                allocated += b.size
                requested += b.req
            out_blocks.append(
                {
                    "address": b.addr,
                    "size": b.size,
                    "requested_size": b.req,
                    "state": "active_allocated" if b.alloc else "inactive",
                    "frames": [],
                }
            )
        return {
            "device": 0,
            "address": blocks[0].addr,
            "total_size": total,
            "allocated_size": allocated,
            "active_size": allocated,
            "requested_size": requested,
            "stream": 0,
            "segment_type": seg_type,
            "segment_pool_id": [0, 0],
            "is_expandable": expandable,
            "frames": [],
            "blocks": out_blocks,
        }


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise AssertionError(f"allocator invariant violated: {message}")
