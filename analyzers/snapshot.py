"""The PyTorch caching allocator from a memory snapshot: free memory, holes, and what an OOM ran into.

A snapshot (``torch.cuda.memory._snapshot()``, pickled by ``_dump_snapshot``)
lists the allocator's segments -- each one ``cudaMalloc`` (or one mapped range
of an expandable segment) -- and, in address order, the blocks they are cut
into. A block is

* ``active_allocated``: held by a tensor;
* ``active_pending_free`` (torch's C++ name; its docs say
  ``active_awaiting_free``): freed by the caller but still in use by another
  stream, so not reusable yet;
* ``inactive``: free, reusable by a request that fits in it.

Definitions (per segment, summed per device and over the snapshot):

* free = the bytes of inactive blocks;
* releasable = the whole size of a segment with no active block: cache that
  ``torch.cuda.empty_cache()`` returns to the device, and that the allocator
  itself frees and retries with before it raises an OOM. It is not a hole;
* stranded = the free bytes of a segment that still holds an active block:
  neither a tensor nor ``empty_cache`` can take them back, and a request
  larger than the largest of them cannot use them. With expandable segments
  it overstates a little: ``empty_cache`` also unmaps the whole free pages
  inside such a segment;
* external fragmentation = 1 - largest free block / free bytes (as before);
  the stranded share of it, 1 - largest stranded block / stranded bytes, is
  what the info verdict reads, since whole free segments are no holes.

The device trace (``device_traces``, recorded by
``torch.cuda.memory._record_memory_history``) holds the allocator's actions:
``alloc``, ``free_requested``, ``free_completed``, ``segment_alloc``,
``segment_free``, ``segment_map`` / ``segment_unmap`` (expandable segments),
``snapshot`` and ``oom``. An ``oom`` entry's ``size`` is the request that
failed and its ``device_free`` (``addr`` in the C++ TraceEntry) the bytes the
device still had free. The pool at the moment of the OOM is rebuilt as
PyTorch's memory viewer does: from the snapshot's segments and active blocks,
every later action undone in reverse order. A snapshot dumped in an OOM
handler shows the pool after the failed step unwound, so its free figures say
nothing about the moment of the failure; the replayed pool does. Blocks freed
after the OOM are rebuilt from the trace's request size rounded up to 512
bytes, so the replayed free bytes may overstate by less than 1 MiB per such
block (the allocator may have left an unsplit remainder in them). torch's
snapshot does not record allocator retries, so a failed allocation means an
``oom`` entry.

Verdicts (per device):

* an OOM whose request exceeded the largest free block of its stream at that
  moment while the pool's free bytes plus the device's free bytes held it:
  fragmentation, critical -- the allocation failed for lack of a fitting hole;
* an OOM whose request exceeded the pool's and the device's free bytes
  together: capacity, critical, reported under the ``oom_forecast`` kind (the
  device ran out of memory; here the snapshot saw it happen, time to OOM 0);
* stranded bytes at least STRANDED_RESERVED_RATIO_WARNING of reserved with
  reserved at least NEAR_CAPACITY_RESERVED_RATIO of the device's capacity:
  fragmentation, warning. The capacity is not in torch's snapshot; it is read
  from a ``device_total_bytes`` entry when a tool added one, or given on the
  command line; when unknown, this ground is not judged and the finding says so;
* otherwise, stranded bytes at least STRANDED_RESERVED_RATIO_INFO of reserved
  and cut into holes (stranded fragmentation at least
  STRANDED_FRAGMENTATION_RATIO_INFO): fragmentation, info, with the figures
  and the evidence that is missing.

Fixes fit the evidence and the workload read from the stack frames: allocator
settings for holes (``expandable_segments`` unless already on,
``max_split_size_mb`` and ``garbage_collection_threshold`` unless set),
``empty_cache`` at phase boundaries when much is releasable, a lower peak for
capacity (activation checkpointing and smaller micro-batches when training),
and KV-cache layouts only when the frames show a serving engine with a KV cache.
"""

from __future__ import annotations

import bisect
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpudiag.analyzers.memory_fragmentation import KIND as FRAGMENTATION_KIND
from gpudiag.analyzers.oom_forecast import KIND as CAPACITY_KIND
from gpudiag.catalog import M
from gpudiag.errors import GpudiagError
from gpudiag.findings import Evidence, Finding, Severity, alert_name

MIB = 2**20

ALLOCATED, PENDING_FREE, INACTIVE = "active_allocated", "active_pending_free", "inactive"
STATE_ALIASES = {
    "active_allocated": ALLOCATED,
    "active_pending_free": PENDING_FREE,
    "active_awaiting_free": PENDING_FREE,
    "inactive": INACTIVE,
}

# A quarter of what the process holds stranded in holes, with the device nearly full, is
# memory the next large request cannot get: neither the pool (no hole fits) nor the device
# (too little left) has it, and empty_cache cannot return it. Below a quarter the holes
# are the ordinary slack of a caching allocator.
STRANDED_RESERVED_RATIO_WARNING = 0.25
# Reserved at nine tenths of the device leaves one tenth, less the CUDA context and the
# libraries' workspaces (several hundred MiB), for new segments: less than a training
# step's or a batch's peak on most workloads, so stranded memory starts to decide OOMs.
NEAR_CAPACITY_RESERVED_RATIO = 0.9
# Below a tenth of reserved stranded, the holes are crumbs not worth a line.
STRANDED_RESERVED_RATIO_INFO = 0.1
# Stranded bytes in one hole serve any request up to their size; half of them outside the
# largest hole is where max_split_size_mb and expandable segments start to matter (the
# live analyzer's reading of external fragmentation, restated for the stranded bytes).
STRANDED_FRAGMENTATION_RATIO_INFO = 0.5
# A quarter of reserved in whole free segments is cache worth returning at a phase boundary
# (after evaluation, between training and generation) when other work shares the device.
RELEASABLE_RESERVED_RATIO_EMPTY_CACHE = 0.25
# The caching allocator rounds every block to 512 bytes (kMinBlockSize); blocks rebuilt from
# the trace get at least that.
BLOCK_ROUND_BYTES = 512

STATE_COLOURS = {ALLOCATED: "#d62728", PENDING_FREE: "#ff7f0e", INACTIVE: "#2ca02c"}
RELEASABLE_COLOUR = "#c7c7c7"

# Fix names, as findings carry them, with what each means on this workload.
FIX_ADVICE = {
    "expandable-segments": "set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: segments grow in place, so "
                           "freed space stays contiguous",
    "max-split-size": "set PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:<MiB>: blocks above it are never split, so "
                      "large holes stay whole",
    "garbage-collection-threshold": "set PYTORCH_CUDA_ALLOC_CONF=garbage_collection_threshold:0.8: unused cached "
                                    "blocks are reclaimed before the pool reaches its limit",
    "empty-cache": "call torch.cuda.empty_cache() at phase boundaries (after evaluation, between training and "
                   "generation): it returns the whole free segments",
    "activation-checkpointing": "recompute activations in backward instead of keeping them "
                                "(torch.utils.checkpoint): a lower peak per step",
    "smaller-micro-batches": "split the batch into smaller micro-batches and accumulate gradients: the same "
                             "effective batch at a lower peak",
    "smaller-batches": "use smaller batches or shorter sequences: a lower peak",
    "paged-kv": "keep the KV cache in fixed-size blocks from one pool (paged KV): no contiguous growth",
    "chunked-kv": "grow the KV cache in fixed chunks (chunked KV): no realloc-and-copy",
}

# Stack frames that show how the process used the GPU. A backward pass (the autograd
# engine, AccumulateGrad, generated *Backward nodes) or an optimizer step means training;
# torch.autograd.VariableType appears in every eager op, training or not, and proves nothing.
TRAINING_FRAME = re.compile(r"autograd::Engine::evaluate_function|AccumulateGrad|Backward\d*::apply"
                            r"|_engine_run_backward|^backward$")
TRAINING_FILE = re.compile(r"/torch/optim/")
# A serving engine with a KV cache: the engines by name, their KV modules, paged attention,
# and gpudiag's own reference engine.
KV_CACHE_FRAME = re.compile(r"vllm|sglang|tensorrt_llm|lmdeploy|text_generation_server|kv_?cache"
                            r"|paged_?attention|reference_engine", re.IGNORECASE)
# torch's optimizer hooks annotate the trace (external_annotations) with these names.
TRAINING_ANNOTATION = re.compile(r"^Optimizer\.(step|zero_grad)")


@dataclass
class Block:
    """One block of a segment."""

    offset_bytes: int
    size_bytes: int
    requested_bytes: int
    state: str
    address: int | None


@dataclass
class SegmentReport:
    """Bytes and holes of one segment."""

    index: int
    device: int
    address: int | None
    stream: int | None
    segment_type: str
    is_expandable: bool
    reserved_bytes: int
    allocated_bytes: int
    pending_free_bytes: int
    free_bytes: int
    requested_bytes: int
    largest_free_block_bytes: int
    inactive_split_bytes: int
    blocks: list[Block]

    @property
    def releasable(self) -> bool:
        """No active block: empty_cache returns the whole segment."""
        return self.allocated_bytes + self.pending_free_bytes == 0

    @property
    def releasable_bytes(self) -> int:
        """The segment's size when it is releasable, else 0."""
        return self.reserved_bytes if self.releasable else 0

    @property
    def stranded_bytes(self) -> int:
        """Free bytes held in place by an active block of the same segment."""
        return 0 if self.releasable else self.free_bytes

    @property
    def external_fragmentation_ratio(self) -> float:
        """1 - largest free block / free bytes (0 with nothing free)."""
        return external_fragmentation(self.largest_free_block_bytes, self.free_bytes)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (without the block list)."""
        counts = Counter(b.state for b in self.blocks)
        return {
            "index": self.index,
            "device": self.device,
            "address": self.address,
            "stream": self.stream,
            "segment_type": self.segment_type,
            "is_expandable": self.is_expandable,
            "reserved_bytes": self.reserved_bytes,
            "allocated_bytes": self.allocated_bytes,
            "pending_free_bytes": self.pending_free_bytes,
            "free_bytes": self.free_bytes,
            "stranded_bytes": self.stranded_bytes,
            "releasable_bytes": self.releasable_bytes,
            "releasable": self.releasable,
            "requested_bytes": self.requested_bytes,
            "largest_free_block_bytes": self.largest_free_block_bytes,
            "external_fragmentation_ratio": self.external_fragmentation_ratio,
            "inactive_split_bytes": self.inactive_split_bytes,
            "block_count": len(self.blocks),
            "blocks_by_state": {s: counts.get(s, 0) for s in (ALLOCATED, PENDING_FREE, INACTIVE)},
        }


def external_fragmentation(largest_free_bytes: int, free_bytes: int) -> float:
    """External fragmentation = 1 - largest free block / free bytes; 0 when nothing is free."""
    return 1.0 - largest_free_bytes / free_bytes if free_bytes > 0 else 0.0


@dataclass
class PoolTotals:
    """Sums over a set of segments (one device, or the whole snapshot)."""

    reserved_bytes: int = 0
    allocated_bytes: int = 0
    pending_free_bytes: int = 0
    free_bytes: int = 0
    stranded_bytes: int = 0
    releasable_bytes: int = 0
    requested_bytes: int = 0
    largest_free_block_bytes: int = 0
    largest_stranded_block_bytes: int = 0
    inactive_split_bytes: int = 0
    segment_count: int = 0
    blocks_by_state: Counter = field(default_factory=Counter)

    def add(self, seg: SegmentReport) -> None:
        """Count one segment in."""
        self.reserved_bytes += seg.reserved_bytes
        self.allocated_bytes += seg.allocated_bytes
        self.pending_free_bytes += seg.pending_free_bytes
        self.free_bytes += seg.free_bytes
        self.stranded_bytes += seg.stranded_bytes
        self.releasable_bytes += seg.releasable_bytes
        self.requested_bytes += seg.requested_bytes
        self.largest_free_block_bytes = max(self.largest_free_block_bytes, seg.largest_free_block_bytes)
        if not seg.releasable:
            self.largest_stranded_block_bytes = max(self.largest_stranded_block_bytes,
                                                    seg.largest_free_block_bytes)
        self.inactive_split_bytes += seg.inactive_split_bytes
        self.segment_count += 1
        self.blocks_by_state.update(b.state for b in seg.blocks)

    @property
    def external_fragmentation_ratio(self) -> float:
        """1 - largest free block / free bytes over all these segments."""
        return external_fragmentation(self.largest_free_block_bytes, self.free_bytes)

    @property
    def stranded_fragmentation_ratio(self) -> float:
        """1 - largest stranded block / stranded bytes: how cut up the memory empty_cache cannot return is."""
        return external_fragmentation(self.largest_stranded_block_bytes, self.stranded_bytes)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form."""
        return {
            "reserved_bytes": self.reserved_bytes,
            "allocated_bytes": self.allocated_bytes,
            "pending_free_bytes": self.pending_free_bytes,
            "free_bytes": self.free_bytes,
            "stranded_bytes": self.stranded_bytes,
            "releasable_bytes": self.releasable_bytes,
            "requested_bytes": self.requested_bytes,
            "largest_free_block_bytes": self.largest_free_block_bytes,
            "largest_stranded_block_bytes": self.largest_stranded_block_bytes,
            "external_fragmentation_ratio": self.external_fragmentation_ratio,
            "stranded_fragmentation_ratio": self.stranded_fragmentation_ratio,
            "inactive_split_bytes": self.inactive_split_bytes,
            "segment_count": self.segment_count,
            "block_count": sum(self.blocks_by_state.values()),
            "blocks_by_state": {s: self.blocks_by_state.get(s, 0) for s in (ALLOCATED, PENDING_FREE, INACTIVE)},
        }


@dataclass
class OomEvent:
    """One ``oom`` entry of a device trace, and the pool replayed to that moment.

    ``verdict`` is ``fragmentation`` (the request exceeded the largest free block of its
    stream while pool plus device free held it), ``capacity`` (pool plus device free fell
    short of the request) or ``undetermined`` (the pool could not be replayed, or a free
    block of the stream was large enough: another limit, such as a memory fraction, failed it).
    """

    device: int
    index: int
    time_s: float | None
    requested_bytes: int
    device_free_bytes: int | None
    stream: int | None
    replay_error: str | None = None
    pool_reserved_bytes: int | None = None
    pool_active_bytes: int | None = None
    pool_free_bytes: int | None = None
    largest_free_block_bytes: int | None = None

    @property
    def total_free_bytes(self) -> int | None:
        """Free in the pool plus free on the device at the moment of the OOM (None when either is unknown)."""
        if self.pool_free_bytes is None or self.device_free_bytes is None:
            return None
        return self.pool_free_bytes + self.device_free_bytes

    @property
    def verdict(self) -> str:
        """fragmentation, capacity or undetermined (see the class docstring)."""
        total = self.total_free_bytes
        if total is None or self.largest_free_block_bytes is None:
            return "undetermined"
        if total < self.requested_bytes:
            return "capacity"
        if self.requested_bytes > self.largest_free_block_bytes:
            return "fragmentation"
        return "undetermined"

    def to_dict(self) -> dict[str, Any]:
        """The JSON form."""
        return {
            "device": self.device,
            "trace_index": self.index,
            "time_s": self.time_s,
            "stream": self.stream,
            "requested_bytes": self.requested_bytes,
            "device_free_bytes": self.device_free_bytes,
            "pool_reserved_bytes": self.pool_reserved_bytes,
            "pool_active_bytes": self.pool_active_bytes,
            "pool_free_bytes": self.pool_free_bytes,
            "largest_free_block_bytes": self.largest_free_block_bytes,
            "total_free_bytes": self.total_free_bytes,
            "verdict": self.verdict,
            "replay_error": self.replay_error,
        }


@dataclass
class AllocatorSettings:
    """What the snapshot says about PYTORCH_CUDA_ALLOC_CONF (None: not recorded)."""

    expandable_segments: bool | None
    expandable_segments_source: str  # "allocator_settings", "segments" or "not recorded"
    alloc_conf: str | None = None
    max_split_size_bytes: int | None = None  # None: unset (torch records -1) or not recorded
    garbage_collection_threshold: float | None = None  # None: unset (0.0) or not recorded

    def to_dict(self) -> dict[str, Any]:
        """The JSON form."""
        return {
            "expandable_segments": self.expandable_segments,
            "expandable_segments_source": self.expandable_segments_source,
            "PYTORCH_CUDA_ALLOC_CONF": self.alloc_conf,
            "max_split_size_bytes": self.max_split_size_bytes,
            "garbage_collection_threshold": self.garbage_collection_threshold,
        }


@dataclass
class Workload:
    """What the stack frames say the process did: training, inference, serving (with a KV cache) or unknown."""

    kind: str
    kv_cache: bool
    evidence: list[str]

    def to_dict(self) -> dict[str, Any]:
        """The JSON form."""
        return {"kind": self.kind, "kv_cache": self.kv_cache, "evidence": list(self.evidence)}


@dataclass
class SnapshotReport:
    """The allocator report of one snapshot."""

    segments: list[SegmentReport]
    totals: PoolTotals
    devices: dict[int, PoolTotals]
    oom_events: dict[int, int]
    trace_time_s: dict[int, tuple[float, float]]
    ooms: list[OomEvent] = field(default_factory=list)
    settings: AllocatorSettings = field(default_factory=lambda: AllocatorSettings(None, "not recorded"))
    workload: Workload = field(default_factory=lambda: Workload("unknown", False, []))
    device_total_bytes: dict[int, int] = field(default_factory=dict)
    findings: list[Finding] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """The JSON document of ``gpudiag analyze snapshot --json``."""
        return {
            **self.totals.to_dict(),
            "devices": [
                {"device": d, **t.to_dict(), "oom_events": self.oom_events.get(d, 0),
                 "device_total_bytes": self.device_total_bytes.get(d)}
                for d, t in sorted(self.devices.items())
            ],
            "oom_events": sum(self.oom_events.values()),
            "ooms": [o.to_dict() for o in self.ooms],
            "allocator_settings": self.settings.to_dict(),
            "workload": self.workload.to_dict(),
            "segments": [s.to_dict() for s in self.segments],
            "findings": [f.to_dict() for f in self.findings],
        }


# --- reading the snapshot's shape ----------------------------------------------------

def _bad(what: str) -> GpudiagError:
    return GpudiagError(f"not a PyTorch memory snapshot: {what}")


def _int(v: Any, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise _bad(f"{what} must be an integer, found {type(v).__name__}")
    return v


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _segment(index: int, seg: Any) -> SegmentReport:
    if not isinstance(seg, dict):
        raise _bad(f"segment {index} is a {type(seg).__name__}, not a dict")
    raw_blocks = seg.get("blocks")
    if not isinstance(raw_blocks, list):
        raise _bad(f"segment {index} has no 'blocks' list")
    blocks: list[Block] = []
    offset = 0
    for j, b in enumerate(raw_blocks):
        if not isinstance(b, dict):
            raise _bad(f"block {j} of segment {index} is a {type(b).__name__}, not a dict")
        state = STATE_ALIASES.get(b.get("state"))
        if state is None:
            raise _bad(f"block {j} of segment {index} has the unknown state {b.get('state')!r}")
        size = _int(b.get("size"), f"the size of block {j} of segment {index}")
        requested = b.get("requested_size", size if state == ALLOCATED else 0)
        address = b.get("address")
        blocks.append(Block(offset, size, _int(requested, f"requested_size of block {j}"), state,
                            address if _is_int(address) else None))
        offset += size
    total = seg.get("total_size", offset)
    total = _int(total, f"total_size of segment {index}")
    is_expandable = bool(seg.get("is_expandable", False))
    free = [b.size_bytes for b in blocks if b.state == INACTIVE]
    free_bytes = sum(free)
    # torch's inactive_split_bytes: free blocks of a segment cut into more
    # than one block (they cannot be released without their neighbours);
    # torch leaves expandable segments out of that statistic.
    split = len(blocks) > 1 and not is_expandable
    device = seg.get("device", 0)
    stream = seg.get("stream")
    address = seg.get("address")
    return SegmentReport(
        index=index,
        device=device if _is_int(device) else 0,
        address=address if _is_int(address) else None,
        stream=stream if _is_int(stream) else None,
        segment_type=str(seg.get("segment_type", "")),
        is_expandable=is_expandable,
        reserved_bytes=total,
        allocated_bytes=sum(b.size_bytes for b in blocks if b.state == ALLOCATED),
        pending_free_bytes=sum(b.size_bytes for b in blocks if b.state == PENDING_FREE),
        free_bytes=free_bytes,
        requested_bytes=sum(b.requested_bytes for b in blocks if b.state == ALLOCATED),
        largest_free_block_bytes=max(free, default=0),
        inactive_split_bytes=free_bytes if split else 0,
        blocks=blocks,
    )


def _device_traces(traces: Any) -> list[list[dict]]:
    """``device_traces`` checked for shape: one list of event dicts per device."""
    if traces is None:
        return []
    if not isinstance(traces, list):
        raise _bad("'device_traces' must be a list (one list of events per device)")
    for device, events in enumerate(traces):
        if not isinstance(events, list):
            raise _bad(f"device_traces[{device}] must be a list of events")
        for ev in events:
            if not isinstance(ev, dict):
                raise _bad(f"device_traces[{device}] holds a {type(ev).__name__}, not an event dict")
    return traces


def _time_s(ev: dict) -> float | None:
    t = ev.get("time_us")
    if isinstance(t, (int, float)) and not isinstance(t, bool):
        return t * 1e-6
    return None


def _trace_spans(traces: list[list[dict]]) -> dict[int, tuple[float, float]]:
    """(first, last) event time in seconds per device, for devices whose events carry times."""
    spans = {}
    for device, events in enumerate(traces):
        times = [t for t in map(_time_s, events) if t is not None]
        if times:
            spans[device] = (min(times), max(times))
    return spans


# --- the pool at the moment of an OOM ------------------------------------------------

class _ReplayError(Exception):
    pass


def _event_int(ev: dict, key: str) -> int:
    v = ev.get(key)
    if not _is_int(v):
        raise _ReplayError(f"a {ev.get('action')} entry has no integer {key!r}")
    return v


def _undo_map(ranges: dict[int, list], addr: int, size: int) -> None:
    """Undo a segment_map: carve [addr, addr + size) out of the mapped range holding it."""
    for start, (length, stream) in list(ranges.items()):
        if start <= addr and addr + size <= start + length:
            del ranges[start]
            if addr > start:
                ranges[start] = [addr - start, stream]
            if addr + size < start + length:
                ranges[addr + size] = [start + length - addr - size, stream]
            return
    raise _ReplayError(f"segment_map at {addr:#x} lies in no mapped range")


def _undo_unmap(ranges: dict[int, list], addr: int, size: int, stream: Any) -> None:
    """Undo a segment_unmap: map [addr, addr + size) again, joined to its neighbours of the same stream."""
    ranges[addr] = [size, stream]
    starts = sorted(ranges)
    i = starts.index(addr)
    if i + 1 < len(starts) and addr + size == starts[i + 1] and ranges[starts[i + 1]][1] == stream:
        ranges[addr][0] += ranges.pop(starts[i + 1])[0]
    if i > 0:
        prev = starts[i - 1]
        if prev + ranges[prev][0] == addr and ranges[prev][1] == stream:
            ranges[prev][0] += ranges.pop(addr)[0]


def pool_at(segments_raw: list, device: int, events: list[dict], index: int) -> dict[str, Any]:
    """The device's pool just before trace entry ``index``: reserved, active and free bytes, and
    the largest free block per stream.

    Starts from the snapshot's segments and active blocks (the state at the dump) and undoes
    every entry after ``index``, latest first, as PyTorch's memory viewer does. Raises
    GpudiagError when the trace and the segments disagree (a trace cut short, actions skipped).
    """
    ranges: dict[int, list] = {}  # start -> [length, stream]: mapped address ranges (segments)
    active: dict[int, int] = {}  # address -> bytes: allocated and pending-free blocks
    for seg in segments_raw:
        if not isinstance(seg, dict) or seg.get("device", 0) != device:
            continue
        base = seg.get("address")
        if not _is_int(base):
            raise GpudiagError("a segment has no address, so the trace cannot be replayed against it")
        addr = base
        for b in seg.get("blocks", []):
            if STATE_ALIASES.get(b.get("state")) != INACTIVE:
                active[addr] = b["size"]
            addr += b["size"]
        ranges[base] = [seg.get("total_size", addr - base), seg.get("stream")]
    try:
        for ev in reversed(events[index + 1:]):
            action = ev.get("action")
            if action == "alloc":
                addr = _event_int(ev, "addr")
                if active.pop(addr, None) is None:
                    raise _ReplayError(f"the block allocated at {addr:#x} is not live after it")
            elif action == "free_completed":
                size = _event_int(ev, "size")
                active[_event_int(ev, "addr")] = -(-size // BLOCK_ROUND_BYTES) * BLOCK_ROUND_BYTES
            elif action == "segment_alloc":
                if ranges.pop(_event_int(ev, "addr"), None) is None:
                    raise _ReplayError(f"the segment allocated at {ev['addr']:#x} is not reserved after it")
            elif action == "segment_free":
                ranges[_event_int(ev, "addr")] = [_event_int(ev, "size"), ev.get("stream")]
            elif action == "segment_map":
                _undo_map(ranges, _event_int(ev, "addr"), _event_int(ev, "size"))
            elif action == "segment_unmap":
                _undo_unmap(ranges, _event_int(ev, "addr"), _event_int(ev, "size"), ev.get("stream"))
            # free_requested only marks a live block pending; oom, snapshot, annotate change nothing
    except _ReplayError as exc:
        raise GpudiagError(f"the device trace does not replay onto the snapshot: {exc}") from None
    addrs = sorted(active)
    reserved = sum(length for length, _ in ranges.values())
    active_bytes = 0
    largest: dict[Any, int] = {}
    for start in sorted(ranges):
        length, stream = ranges[start]
        end, cursor = start + length, start
        for a in addrs[bisect.bisect_left(addrs, start):bisect.bisect_left(addrs, end)]:
            if a < cursor:
                raise GpudiagError(f"the device trace does not replay onto the snapshot: blocks overlap at {a:#x}")
            largest[stream] = max(largest.get(stream, 0), a - cursor)
            cursor = a + active[a]
            active_bytes += active[a]
        if cursor > end:
            raise GpudiagError(f"the device trace does not replay onto the snapshot: a block overruns "
                               f"the segment at {start:#x}")
        largest[stream] = max(largest.get(stream, 0), end - cursor)
    if active_bytes != sum(active.values()):
        raise GpudiagError("the device trace does not replay onto the snapshot: a live block lies in no segment")
    return {"reserved_bytes": reserved, "active_bytes": active_bytes, "free_bytes": reserved - active_bytes,
            "largest_free_block_bytes_by_stream": largest}


def _largest_for(by_stream: dict[Any, int], stream: int | None) -> int:
    """The largest free block a request on ``stream`` could use: a free block serves only its own
    stream. When the request's or some segment's stream is not recorded, every block counts."""
    if stream is None or None in by_stream:
        return max(by_stream.values(), default=0)
    return by_stream.get(stream, 0)


def _oom_events(segments_raw: list, traces: list[list[dict]]) -> list[OomEvent]:
    out = []
    for device, events in enumerate(traces):
        for i, ev in enumerate(events):
            if ev.get("action") != "oom":
                continue
            free = ev.get("device_free", ev.get("addr"))  # the Python snapshot renames the C++ entry's addr
            stream = ev.get("stream")
            size = ev.get("size")
            oom = OomEvent(device=device, index=i, time_s=_time_s(ev),
                           requested_bytes=size if _is_int(size) else 0,
                           device_free_bytes=free if _is_int(free) else None,
                           stream=stream if _is_int(stream) else None)
            try:
                pool = pool_at(segments_raw, device, events, i)
            except GpudiagError as exc:
                oom.replay_error = str(exc)
            else:
                oom.pool_reserved_bytes = pool["reserved_bytes"]
                oom.pool_active_bytes = pool["active_bytes"]
                oom.pool_free_bytes = pool["free_bytes"]
                oom.largest_free_block_bytes = _largest_for(pool["largest_free_block_bytes_by_stream"], oom.stream)
            out.append(oom)
    return out


# --- settings, workload and capacity ----------------------------------------------------

def allocator_settings(snapshot: Any, segments: list[SegmentReport]) -> AllocatorSettings:
    """Expandable segments and the split / garbage-collection settings, as the snapshot records them.

    Recent torch writes ``allocator_settings`` (the parsed PYTORCH_CUDA_ALLOC_CONF); older
    snapshots only mark each segment ``is_expandable``.
    """
    raw = snapshot.get("allocator_settings") if isinstance(snapshot, dict) else None
    raw = raw if isinstance(raw, dict) else {}
    conf = raw.get("PYTORCH_CUDA_ALLOC_CONF")
    conf = conf if isinstance(conf, str) else None
    exp = raw.get("expandable_segments")
    if not isinstance(exp, bool) and conf is not None:
        exp = re.search(r"expandable_segments\s*:\s*true", conf, re.IGNORECASE) is not None
    source = "allocator_settings"
    if not isinstance(exp, bool):
        has_flag = isinstance(snapshot, dict) and any(
            isinstance(s, dict) and "is_expandable" in s for s in snapshot.get("segments", []))
        exp = any(s.is_expandable for s in segments) if has_flag else None
        source = "segments" if has_flag else "not recorded"
    split = raw.get("max_split_size")
    gc = raw.get("garbage_collection_threshold")
    # torch records an unset max_split_size as -1 (or SIZE_MAX) and an unset threshold as 0
    return AllocatorSettings(
        expandable_segments=exp,
        expandable_segments_source=source,
        alloc_conf=conf,
        max_split_size_bytes=split if _is_int(split) and 0 < split < 2**63 - 1 else None,
        garbage_collection_threshold=float(gc) if isinstance(gc, (int, float)) and not isinstance(gc, bool)
        and gc > 0 else None,
    )


def _frames_of(snapshot: Any):
    segments = snapshot.get("segments", []) if isinstance(snapshot, dict) else snapshot
    for seg in segments if isinstance(segments, list) else []:
        if isinstance(seg, dict):
            yield seg.get("frames")
            for b in seg.get("blocks") or []:
                if isinstance(b, dict):
                    yield b.get("frames")
    traces = snapshot.get("device_traces") if isinstance(snapshot, dict) else None
    for events in traces if isinstance(traces, list) else []:
        for ev in events if isinstance(events, list) else []:
            if isinstance(ev, dict):
                yield ev.get("frames")


def _frame_text(name: str, filename: str) -> str:
    """``frame NAME in FILE`` without C++ template and parameter lists, and with the file's last two parts."""
    short = re.split(r"[(<]", name, maxsplit=1)[0].strip() or name
    where = "/".join(filename.split("/")[-2:]) if filename and filename != "??" else ""
    return f"frame {short[:80]}" + (f" in {where}" if where else "")


def workload_of(snapshot: Any) -> Workload:
    """Training, inference, serving (a KV-cache engine) or unknown, from the stack frames and annotations.

    Each (function, file) pair is read once: snapshots repeat the same frames hundreds of thousands of times.
    """
    seen: set[tuple[str, str]] = set()
    evidence: dict[str, str] = {}
    for frames in _frames_of(snapshot):
        if not isinstance(frames, list):
            continue
        for fr in frames:
            if not isinstance(fr, dict):
                continue
            key = (str(fr.get("name", "")), str(fr.get("filename", "")))
            if key in seen:
                continue
            seen.add(key)
            name, filename = key
            if "kv" not in evidence and (KV_CACHE_FRAME.search(name) or KV_CACHE_FRAME.search(filename)):
                evidence["kv"] = _frame_text(name, filename)
            if "training" not in evidence and (TRAINING_FRAME.search(name) or TRAINING_FILE.search(filename)):
                evidence["training"] = _frame_text(name, filename)
    annotations = snapshot.get("external_annotations") if isinstance(snapshot, dict) else None
    if "training" not in evidence and isinstance(annotations, list):
        for a in annotations:
            name = a.get("name") if isinstance(a, dict) else None
            if isinstance(name, str) and TRAINING_ANNOTATION.search(name):
                evidence["training"] = f"annotation {name}"
                break
    kv = "kv" in evidence
    if kv:
        kind = "serving"
    elif "training" in evidence:
        kind = "training"
    elif seen:
        kind = "inference"
        evidence["inference"] = "stack frames without a backward pass or an optimizer step"
    else:
        kind = "unknown"
    return Workload(kind, kv, list(evidence.values()))


def device_totals(snapshot: Any, devices, given_bytes: int | None = None) -> dict[int, int]:
    """Each device's memory capacity: ``given_bytes`` for all when given, else the snapshot's
    ``device_total_bytes`` entry (an integer, a list by device index, or a dict by device).

    torch's own snapshot does not carry it; a device without one is left out (unknown).
    """
    if given_bytes is not None:
        return {d: given_bytes for d in devices}
    raw = snapshot.get("device_total_bytes") if isinstance(snapshot, dict) else None
    out = {}
    for d in devices:
        if _is_int(raw):
            v = raw
        elif isinstance(raw, list) and d < len(raw):
            v = raw[d]
        elif isinstance(raw, dict):
            v = raw.get(d, raw.get(str(d)))
        else:
            v = None
        if _is_int(v) and v > 0:
            out[d] = v
    return out


# --- the report ----------------------------------------------------------------------

def fragmentation_report(snapshot: Any, device_total_bytes: int | None = None) -> SnapshotReport:
    """Per segment, per device and overall: reserved, allocated, pending-free, free, stranded and
    releasable bytes, the largest free block, external fragmentation and block counts; every OOM
    of the device traces with the pool replayed to its moment; allocator settings; the workload;
    and the findings (see the module docstring).

    ``snapshot`` is the unpickled object: a dict with ``segments`` (and optionally
    ``device_traces``, ``allocator_settings``, ``external_annotations``), or a bare list of
    segments as ``torch.cuda.memory_snapshot()`` returns. ``device_total_bytes``, when given,
    is every device's capacity. GpudiagError when the snapshot has another shape.
    """
    if isinstance(snapshot, list):
        segments_raw, traces = snapshot, None
    elif isinstance(snapshot, dict):
        if "segments" not in snapshot:
            raise _bad("the dict has no 'segments' key")
        segments_raw, traces = snapshot["segments"], snapshot.get("device_traces")
    else:
        raise _bad(f"expected a dict with 'segments', found {type(snapshot).__name__}")
    if not isinstance(segments_raw, list):
        raise _bad("'segments' must be a list")
    segments = [_segment(i, s) for i, s in enumerate(segments_raw)]
    totals = PoolTotals()
    devices: dict[int, PoolTotals] = {}
    for seg in segments:
        totals.add(seg)
        devices.setdefault(seg.device, PoolTotals()).add(seg)
    events = _device_traces(traces)
    ooms = _oom_events(segments_raw, events)
    report = SnapshotReport(
        segments, totals, devices, dict(Counter(o.device for o in ooms)), _trace_spans(events), ooms,
        allocator_settings(snapshot, segments), workload_of(snapshot),
        device_totals(snapshot, sorted(devices), device_total_bytes),
    )
    report.findings = memory_findings(report)
    return report


def _mib(n: float | None) -> str:
    return "n/a" if n is None else f"{n / MIB:.0f} MiB"


def _fragmentation_fixes(report: SnapshotReport, t: PoolTotals, harmful: bool) -> list[str]:
    """Holes: expandable segments unless on; with harm shown, also the split and reclaim settings
    unless set (without harm, one setting to try first is enough)."""
    s = report.settings
    fixes = []
    if s.expandable_segments is not True:
        fixes.append("expandable-segments")
        if harmful and s.max_split_size_bytes is None:  # ignored under expandable segments
            fixes.append("max-split-size")
    if harmful and s.garbage_collection_threshold is None:
        fixes.append("garbage-collection-threshold")
    if t.reserved_bytes and t.releasable_bytes >= RELEASABLE_RESERVED_RATIO_EMPTY_CACHE * t.reserved_bytes:
        fixes.append("empty-cache")
    if report.workload.kv_cache:
        fixes += ["paged-kv", "chunked-kv"]
    return fixes


def _capacity_fixes(report: SnapshotReport) -> list[str]:
    if report.workload.kind == "training":
        return ["activation-checkpointing", "smaller-micro-batches"]
    return ["smaller-batches"]


def _expandable_note(report: SnapshotReport) -> str:
    s = report.settings
    if s.expandable_segments is None:
        return "whether expandable segments were on is not recorded"
    return f"expandable segments {'on' if s.expandable_segments else 'off'}"


def _workload_note(report: SnapshotReport) -> str:
    w = report.workload
    if w.kind == "unknown":
        return "workload unknown (no stack frames recorded)"
    return f"{w.kind} workload" + (" with a KV cache" if w.kv_cache else "")


def memory_findings(report: SnapshotReport) -> list[Finding]:
    """The findings of one snapshot, per device (the verdicts of the module docstring)."""
    out: list[Finding] = []
    for device in sorted(set(report.devices) | set(report.oom_events)):
        t = report.devices.get(device, PoolTotals())
        ooms = [o for o in report.ooms if o.device == device]
        for verdict in ("fragmentation", "capacity", "undetermined"):
            chosen = [o for o in ooms if o.verdict == verdict]
            if chosen:
                out.append(_oom_finding(report, device, t, verdict, chosen))
        # With an OOM the segments may show the pool after the failed step unwound: their free
        # memory says nothing about the failure, and the OOM finding has told its moment.
        if not ooms:
            f = _stranded_finding(report, device, t)
            if f is not None:
                out.append(f)
    return out


def _oom_finding(report: SnapshotReport, device: int, t: PoolTotals, verdict: str,
                 ooms: list[OomEvent]) -> Finding:
    # The one OOM the summary tells: the one that missed by the most.
    worst = max(ooms, key=lambda o: o.requested_bytes - (o.total_free_bytes or 0))
    times = [o.time_s for o in ooms if o.time_s is not None]
    start, end = (min(times), max(times)) if times else (0.0, 0.0)
    n = f"{len(ooms)} OOMs; the worst: " if len(ooms) > 1 else ""
    dump_free = f"{_mib(t.free_bytes)} free at the dump"
    if verdict == "fragmentation":
        kind, fixes = FRAGMENTATION_KIND, _fragmentation_fixes(report, t, harmful=True)
        summary = (f"out of memory on GPU {device} for lack of a fitting hole: {n}a {_mib(worst.requested_bytes)} "
                   f"request found at most a {_mib(worst.largest_free_block_bytes)} free block while "
                   f"{_mib(worst.pool_free_bytes)} was free in the pool and {_mib(worst.device_free_bytes)} "
                   f"on the device; {_expandable_note(report)}; {_workload_note(report)}")
    elif verdict == "capacity":
        kind, fixes = CAPACITY_KIND, _capacity_fixes(report)
        short = worst.requested_bytes - (worst.total_free_bytes or 0)
        summary = (f"out of memory at capacity on GPU {device} (the OOM happened; not a forecast): {n}a "
                   f"{_mib(worst.requested_bytes)} request met {_mib(worst.pool_free_bytes)} free in the pool "
                   f"(largest block {_mib(worst.largest_free_block_bytes)}) and {_mib(worst.device_free_bytes)} "
                   f"free on the device, {_mib(short)} short, replayed from the device trace up to the OOM; "
                   f"the {dump_free} came only after the failed step unwound; {_expandable_note(report)}; "
                   f"{_workload_note(report)}: lower the peak")
    else:
        kind, fixes = CAPACITY_KIND, _capacity_fixes(report)
        why = worst.replay_error or (
            "the device trace records no free bytes" if worst.device_free_bytes is None else
            f"a {_mib(worst.largest_free_block_bytes)} free block of its stream would have fit it; another "
            "limit (a per-process memory fraction, a private pool) refused it")
        summary = (f"out of memory on GPU {device}: {n}a {_mib(worst.requested_bytes)} request failed with "
                   f"{_mib(worst.device_free_bytes)} free on the device; capacity or fragmentation cannot be "
                   f"told apart: {why}; {_expandable_note(report)}; {_workload_note(report)}")
    evidence = [
        Evidence(M.process_torch_ooms_total, len(ooms), unit=""),
        Evidence(M.process_torch_largest_free_block_bytes, worst.largest_free_block_bytes,
                 threshold=worst.requested_bytes, unit="bytes"),
        Evidence(M.process_reserved_minus_allocated_bytes, worst.pool_free_bytes, unit="bytes"),
        Evidence(M.process_torch_reserved_bytes, worst.pool_reserved_bytes, unit="bytes"),
    ]
    if device in report.device_total_bytes:
        evidence.append(Evidence(M.gpu_memory_total_bytes, report.device_total_bytes[device], unit="bytes"))
    details = {
        "verdict": verdict, "ooms": len(ooms), "requested_bytes": worst.requested_bytes,
        "device_free_bytes": worst.device_free_bytes, "pool_free_bytes": worst.pool_free_bytes,
        "pool_reserved_bytes": worst.pool_reserved_bytes, "largest_free_block_bytes": worst.largest_free_block_bytes,
        "total_free_bytes": worst.total_free_bytes, "free_bytes_at_dump": t.free_bytes,
        "expandable_segments": report.settings.expandable_segments, "workload": report.workload.kind,
        "device_total_bytes": report.device_total_bytes.get(device),
    }
    if kind == CAPACITY_KIND:
        details["time_to_oom_s"] = 0.0  # the forecast's figure, for a failure the snapshot saw
    return Finding(kind=kind, severity=Severity.CRITICAL, start_s=start, end_s=end, summary=summary, gpu=device,
                   evidence=evidence, runbook=alert_name(kind), fixes=fixes, details=details)


def _stranded_finding(report: SnapshotReport, device: int, t: PoolTotals) -> Finding | None:
    if t.reserved_bytes <= 0:
        return None
    share = t.stranded_bytes / t.reserved_bytes
    total = report.device_total_bytes.get(device)
    fill = t.reserved_bytes / total if total else None
    harmful = (share >= STRANDED_RESERVED_RATIO_WARNING and fill is not None
               and fill >= NEAR_CAPACITY_RESERVED_RATIO)
    if not harmful and (share < STRANDED_RESERVED_RATIO_INFO
                        or t.stranded_fragmentation_ratio < STRANDED_FRAGMENTATION_RATIO_INFO):
        return None
    figures = (f"{_mib(t.free_bytes)} free in reserved segments on GPU {device}: {_mib(t.releasable_bytes)} "
               f"releasable (whole free segments, returned by empty_cache) and {_mib(t.stranded_bytes)} "
               f"stranded in partly used segments ({share:.0%} of {_mib(t.reserved_bytes)} reserved, largest "
               f"stranded hole {_mib(t.largest_stranded_block_bytes)}); {_expandable_note(report)}; "
               f"{_workload_note(report)}")
    if harmful:
        summary = (f"stranded memory near capacity: {figures}; reserved is {fill:.0%} of the device's "
                   f"{_mib(total)}, so a request larger than the largest hole has little room left")
    else:
        capacity = ("the device's capacity is unknown (not in the snapshot), so nearness to it is not judged"
                    if fill is None else f"reserved is {fill:.0%} of the device's {_mib(total)}")
        summary = (f"holes without evidence of harm: {figures}; no failed allocation recorded and {capacity}")
    start, end = report.trace_time_s.get(device, (0.0, 0.0))
    evidence = [
        Evidence(M.process_torch_external_fragmentation_ratio, t.external_fragmentation_ratio, unit="ratio"),
        Evidence(M.process_torch_largest_free_block_bytes, t.largest_free_block_bytes, baseline=t.free_bytes,
                 unit="bytes"),
        Evidence(M.process_reserved_minus_allocated_bytes, t.reserved_bytes - t.allocated_bytes, unit="bytes"),
        Evidence(M.process_torch_inactive_split_bytes, t.inactive_split_bytes, unit="bytes"),
        Evidence(M.process_torch_reserved_bytes, t.reserved_bytes,
                 threshold=None if total is None else NEAR_CAPACITY_RESERVED_RATIO * total, unit="bytes"),
        Evidence(M.process_torch_ooms_total, 0),
    ]
    if total is not None:
        evidence.append(Evidence(M.gpu_memory_total_bytes, total, unit="bytes"))
    return Finding(
        kind=FRAGMENTATION_KIND,
        severity=Severity.WARNING if harmful else Severity.INFO,
        start_s=start, end_s=end, summary=summary, gpu=device, evidence=evidence,
        runbook=alert_name(FRAGMENTATION_KIND), fixes=_fragmentation_fixes(report, t, harmful),
        details={"segments": t.segment_count, "free_bytes": t.free_bytes, "stranded_bytes": t.stranded_bytes,
                 "releasable_bytes": t.releasable_bytes, "stranded_reserved_ratio": share,
                 "stranded_fragmentation_ratio": t.stranded_fragmentation_ratio,
                 "device_total_bytes": total, "reserved_device_ratio": fill,
                 "expandable_segments": report.settings.expandable_segments,
                 "workload": report.workload.kind},
    )


# --- the segment map ------------------------------------------------------------------

# Legend entries of the segment map: a free block is stranded or part of a releasable segment.
MAP_LAYERS = (
    (ALLOCATED, STATE_COLOURS[ALLOCATED]),
    (PENDING_FREE, STATE_COLOURS[PENDING_FREE]),
    ("inactive: stranded", STATE_COLOURS[INACTIVE]),
    ("inactive: releasable segment", RELEASABLE_COLOUR),
)


def _map_layer(seg: SegmentReport, b: Block) -> str:
    if b.state != INACTIVE:
        return b.state
    return "inactive: releasable segment" if seg.releasable else "inactive: stranded"


def segment_map_figure(report: SnapshotReport):
    """A plotly figure: one horizontal bar per segment, its blocks in address order coloured by state;
    free blocks are told apart as stranded (in a partly used segment) or releasable (a whole free segment)."""
    import plotly.graph_objects as go

    labels = [f"{s.index}: GPU {s.device} {s.segment_type} {s.reserved_bytes / MIB:.0f} MiB"
              + (" releasable" if s.releasable else "") for s in report.segments]
    fig = go.Figure()
    for layer, colour in MAP_LAYERS:
        ys, xs, bases, hover = [], [], [], []
        for seg, label in zip(report.segments, labels):
            for b in seg.blocks:
                if _map_layer(seg, b) != layer:
                    continue
                ys.append(label)
                xs.append(b.size_bytes / MIB)
                bases.append(b.offset_bytes / MIB)
                addr = f"0x{b.address:x}" if b.address is not None else "n/a"
                hover.append(f"{layer}<br>address {addr}<br>offset {b.offset_bytes / MIB:.2f} MiB"
                             f"<br>size {b.size_bytes / MIB:.2f} MiB"
                             f"<br>requested {b.requested_bytes / MIB:.2f} MiB")
        fig.add_trace(go.Bar(
            y=ys, x=xs, base=bases, orientation="h", name=layer,
            marker={"color": colour, "line": {"color": "#333", "width": 0.5}},
            hovertext=hover, hoverinfo="text",
        ))
    t = report.totals
    fig.update_layout(
        title=(f"Caching allocator segments: {t.reserved_bytes / MIB:.0f} MiB reserved, "
               f"{t.allocated_bytes / MIB:.0f} MiB allocated, {t.free_bytes / MIB:.0f} MiB free: "
               f"{t.stranded_bytes / MIB:.0f} MiB stranded, {t.releasable_bytes / MIB:.0f} MiB releasable; "
               f"largest free block {t.largest_free_block_bytes / MIB:.0f} MiB"),
        barmode="overlay",
        xaxis_title="offset in segment (MiB)",
        yaxis={"autorange": "reversed", "type": "category"},
        height=max(300, 28 * len(report.segments) + 150),
        legend_title="block state",
    )
    return fig


def write_segment_map_html(report: SnapshotReport, path: str | Path) -> Path:
    """Write the segment map as one self-contained HTML file (plotly.js embedded, no CDN)."""
    p = Path(path)
    try:
        segment_map_figure(report).write_html(str(p), include_plotlyjs=True, full_html=True)
    except OSError as exc:
        raise GpudiagError(f"cannot write {p}: {exc.strerror or exc}") from None
    return p
