"""Fragmentation of the PyTorch caching allocator, from a memory snapshot.

A snapshot (``torch.cuda.memory._snapshot()``, pickled by
``_dump_snapshot``) lists the allocator's segments -- each one ``cudaMalloc``
(or one mapped range of an expandable segment) -- and, in address order, the
blocks they are cut into. A block is

* ``active_allocated``: held by a tensor;
* ``active_pending_free`` (torch's C++ name; its docs say
  ``active_awaiting_free``): freed by the caller but still in use by another
  stream, so not reusable yet;
* ``inactive``: free, reusable by a request that fits in it.

Free memory that is cut into holes cannot serve a request larger than the
largest hole even when the sum of holes would: that is external
fragmentation, the gap behind "CUDA out of memory" with gigabytes reported
free.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpudiag.analyzers.memory_fragmentation import FIXES as FRAGMENTATION_FIXES

# One definition of "fragmented", shared with the timeline analyzer.
from gpudiag.analyzers.memory_fragmentation import FRAGMENTATION_RATIO_THRESHOLD
from gpudiag.analyzers.memory_fragmentation import KIND as FRAGMENTATION_KIND
from gpudiag.catalog import M
from gpudiag.errors import GpudiagError
from gpudiag.findings import Evidence, Finding, Severity, alert_name

ALLOCATED, PENDING_FREE, INACTIVE = "active_allocated", "active_pending_free", "inactive"
STATE_ALIASES = {
    "active_allocated": ALLOCATED,
    "active_pending_free": PENDING_FREE,
    "active_awaiting_free": PENDING_FREE,
    "inactive": INACTIVE,
}

# Below a tenth of the reserved bytes free, the ratio describes crumbs: the
# allocator is simply full, which is a capacity question, not fragmentation.
MIN_FREE_RESERVED_RATIO = 0.1

STATE_COLOURS = {ALLOCATED: "#d62728", PENDING_FREE: "#ff7f0e", INACTIVE: "#2ca02c"}


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
    requested_bytes: int = 0
    largest_free_block_bytes: int = 0
    inactive_split_bytes: int = 0
    segment_count: int = 0
    blocks_by_state: Counter = field(default_factory=Counter)

    def add(self, seg: SegmentReport) -> None:
        """Count one segment in."""
        self.reserved_bytes += seg.reserved_bytes
        self.allocated_bytes += seg.allocated_bytes
        self.pending_free_bytes += seg.pending_free_bytes
        self.free_bytes += seg.free_bytes
        self.requested_bytes += seg.requested_bytes
        self.largest_free_block_bytes = max(self.largest_free_block_bytes, seg.largest_free_block_bytes)
        self.inactive_split_bytes += seg.inactive_split_bytes
        self.segment_count += 1
        self.blocks_by_state.update(b.state for b in seg.blocks)

    @property
    def external_fragmentation_ratio(self) -> float:
        """1 - largest free block / free bytes over all these segments."""
        return external_fragmentation(self.largest_free_block_bytes, self.free_bytes)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form."""
        return {
            "reserved_bytes": self.reserved_bytes,
            "allocated_bytes": self.allocated_bytes,
            "pending_free_bytes": self.pending_free_bytes,
            "free_bytes": self.free_bytes,
            "requested_bytes": self.requested_bytes,
            "largest_free_block_bytes": self.largest_free_block_bytes,
            "external_fragmentation_ratio": self.external_fragmentation_ratio,
            "inactive_split_bytes": self.inactive_split_bytes,
            "segment_count": self.segment_count,
            "block_count": sum(self.blocks_by_state.values()),
            "blocks_by_state": {s: self.blocks_by_state.get(s, 0) for s in (ALLOCATED, PENDING_FREE, INACTIVE)},
        }


@dataclass
class SnapshotReport:
    """The fragmentation report of one snapshot."""

    segments: list[SegmentReport]
    totals: PoolTotals
    devices: dict[int, PoolTotals]
    oom_events: dict[int, int]
    trace_time_s: dict[int, tuple[float, float]]
    findings: list[Finding] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """The JSON document of ``gpudiag analyze snapshot --json``."""
        return {
            **self.totals.to_dict(),
            "devices": [
                {"device": d, **t.to_dict(), "oom_events": self.oom_events.get(d, 0)}
                for d, t in sorted(self.devices.items())
            ],
            "oom_events": sum(self.oom_events.values()),
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
                            address if isinstance(address, int) else None))
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
        device=device if isinstance(device, int) else 0,
        address=address if isinstance(address, int) else None,
        stream=stream if isinstance(stream, int) else None,
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


def _device_traces(traces: Any) -> tuple[dict[int, int], dict[int, tuple[float, float]]]:
    """OOM counts and (first, last) event times in seconds, per device, from ``device_traces``."""
    ooms: dict[int, int] = {}
    spans: dict[int, tuple[float, float]] = {}
    if traces is None:
        return ooms, spans
    if not isinstance(traces, list):
        raise _bad("'device_traces' must be a list (one list of events per device)")
    for device, events in enumerate(traces):
        if not isinstance(events, list):
            raise _bad(f"device_traces[{device}] must be a list of events")
        times = []
        for ev in events:
            if not isinstance(ev, dict):
                raise _bad(f"device_traces[{device}] holds a {type(ev).__name__}, not an event dict")
            if ev.get("action") == "oom":
                ooms[device] = ooms.get(device, 0) + 1
            t = ev.get("time_us")
            if isinstance(t, (int, float)) and not isinstance(t, bool):
                times.append(t * 1e-6)
        if times:
            spans[device] = (min(times), max(times))
    return ooms, spans


def fragmentation_report(snapshot: Any) -> SnapshotReport:
    """Per segment, per device and overall: reserved, allocated, pending-free and free bytes,
    the largest free block, external fragmentation (1 - largest free block / free bytes),
    inactive-split bytes and block counts; OOM events from ``device_traces``; and the
    memory_fragmentation findings.

    ``snapshot`` is the unpickled object: a dict with ``segments`` (and
    optionally ``device_traces``), or a bare list of segments as
    ``torch.cuda.memory_snapshot()`` returns. GpudiagError when it has another shape.
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
    ooms, spans = _device_traces(traces)
    report = SnapshotReport(segments, totals, devices, ooms, spans)
    report.findings = fragmentation_findings(report)
    return report


def fragmentation_findings(report: SnapshotReport) -> list[Finding]:
    """One ``memory_fragmentation`` finding per device whose free pool is cut into holes.

    Fires when free bytes are at least MIN_FREE_RESERVED_RATIO of reserved and
    external fragmentation is at least FRAGMENTATION_RATIO_THRESHOLD. Critical
    when the device's trace also recorded an OOM (out of memory with memory
    free), warning otherwise.
    """
    out = []
    for device, t in sorted(report.devices.items()):
        if t.reserved_bytes <= 0 or t.free_bytes < MIN_FREE_RESERVED_RATIO * t.reserved_bytes:
            continue
        ratio = t.external_fragmentation_ratio
        if ratio < FRAGMENTATION_RATIO_THRESHOLD:
            continue
        ooms = report.oom_events.get(device, 0)
        start, end = report.trace_time_s.get(device, (0.0, 0.0))
        free_mib, hole_mib = t.free_bytes / 2**20, t.largest_free_block_bytes / 2**20
        summary = (f"caching allocator on GPU {device}: {free_mib:.0f} MiB free in reserved segments but the "
                   f"largest free block is {hole_mib:.0f} MiB (external fragmentation {ratio:.0%})")
        if ooms:
            summary += f"; {ooms} OOM event(s) recorded with that memory free"
        out.append(Finding(
            kind=FRAGMENTATION_KIND,
            severity=Severity.CRITICAL if ooms else Severity.WARNING,
            start_s=start,
            end_s=end,
            summary=summary,
            gpu=device,
            evidence=[
                Evidence(M.process_torch_external_fragmentation_ratio, ratio,
                         threshold=FRAGMENTATION_RATIO_THRESHOLD, unit="ratio"),
                Evidence(M.process_torch_largest_free_block_bytes, t.largest_free_block_bytes,
                         baseline=t.free_bytes, unit="bytes"),
                Evidence(M.process_reserved_minus_allocated_bytes, t.reserved_bytes - t.allocated_bytes,
                         threshold=MIN_FREE_RESERVED_RATIO * t.reserved_bytes, unit="bytes"),
                Evidence(M.process_torch_inactive_split_bytes, t.inactive_split_bytes, unit="bytes"),
                Evidence(M.process_torch_ooms_total, ooms),
            ],
            runbook=alert_name(FRAGMENTATION_KIND),
            fixes=list(FRAGMENTATION_FIXES),
            details={"segments": t.segment_count, "free_bytes": t.free_bytes},
        ))
    return out


# --- the segment map ------------------------------------------------------------------

def segment_map_figure(report: SnapshotReport):
    """A plotly figure: one horizontal bar per segment, its blocks in address order coloured by state."""
    import plotly.graph_objects as go

    labels = [f"{s.index}: GPU {s.device} {s.segment_type} {s.reserved_bytes / 2**20:.0f} MiB"
              for s in report.segments]
    fig = go.Figure()
    for state in (ALLOCATED, PENDING_FREE, INACTIVE):
        ys, xs, bases, hover = [], [], [], []
        for seg, label in zip(report.segments, labels):
            for b in seg.blocks:
                if b.state != state:
                    continue
                ys.append(label)
                xs.append(b.size_bytes / 2**20)
                bases.append(b.offset_bytes / 2**20)
                addr = f"0x{b.address:x}" if b.address is not None else "n/a"
                hover.append(f"{state}<br>address {addr}<br>offset {b.offset_bytes / 2**20:.2f} MiB"
                             f"<br>size {b.size_bytes / 2**20:.2f} MiB"
                             f"<br>requested {b.requested_bytes / 2**20:.2f} MiB")
        fig.add_trace(go.Bar(
            y=ys, x=xs, base=bases, orientation="h", name=state,
            marker={"color": STATE_COLOURS[state], "line": {"color": "#333", "width": 0.5}},
            hovertext=hover, hoverinfo="text",
        ))
    t = report.totals
    fig.update_layout(
        title=(f"Caching allocator segments: {t.reserved_bytes / 2**20:.0f} MiB reserved, "
               f"{t.allocated_bytes / 2**20:.0f} MiB allocated, {t.free_bytes / 2**20:.0f} MiB free, "
               f"largest free block {t.largest_free_block_bytes / 2**20:.0f} MiB, "
               f"external fragmentation {t.external_fragmentation_ratio:.0%}"),
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
