"""What a PyTorch "CUDA out of memory" message says, and the verdict it supports.

PyTorch's caching allocator explains each failed allocation in its exception text
(``c10/cuda/CUDACachingAllocator.cpp``). Two forms are in the field:

- PyTorch >= 2.1: ``Tried to allocate 742.00 MiB. GPU 0 has a total capacity of 79.15 GiB
  of which 188.31 MiB is free. Process 3295240 has 78.54 GiB memory in use. Including
  non-PyTorch memory, this process has 414.00 MiB memory in use. Of the allocated memory
  0 bytes is allocated by PyTorch, and 0 bytes is reserved by PyTorch but unallocated.``
  (the ``Process P has M`` sentences list every process NVML sees on the device; the
  failing process is one of them, or is left out when it cannot see its own pid);
- PyTorch <= 2.0: ``Tried to allocate 36.00 MiB (GPU 0; 7.93 GiB total capacity;
  130.35 MiB already allocated; 47.06 MiB free; 188.00 MiB reserved in total by PyTorch)``.

An OOM is harm by itself; what the message tells is whose memory it met. Definitions, for
one message:
- other processes' memory = the sum of the ``Process P has M`` figures, less this process's
  own ("this process has Q" including non-PyTorch memory);
- reserved-but-unallocated = what the failing process's allocator held free (its pool).

Verdicts, in order:
1. other processes held at least COTENANT_SHARE of the device and more than this process:
   ``gpu_cotenant``, critical (the allocation failed because another tenant has the GPU);
2. the pool held at least the request free (reserved-but-unallocated >= request) and yet
   the allocation failed: no free block fitted -- ``memory_fragmentation``, critical;
3. otherwise the process itself filled the device: an OOM at capacity, reported under
   ``oom_forecast`` (the forecast's end point, reached: ``time_to_oom_s`` 0), critical.

Repeated messages of one OOM (logged by several handlers) are one event: messages with the
same figures within DUPLICATE_WINDOW_S collapse. One finding per GPU and verdict, covering
its events, with the worst (largest request) as the evidence.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime

from gpudiag.findings import Evidence, Finding, Severity, alert_name
from gpudiag.units import fmt_bytes

COTENANT_KIND = "gpu_cotenant"
FRAGMENTATION_KIND = "memory_fragmentation"
# An OOM at capacity is the end point oom_forecast predicts; a memory snapshot reports it so too.
CAPACITY_KIND = "oom_forecast"

# A quarter of the device held by others is more than any monitoring agent or stray CUDA
# context (a few hundred MiB); it is a workload.
COTENANT_SHARE = 0.25
# The same OOM is often logged two or three times as the exception travels up the stack.
DUPLICATE_WINDOW_S = 5.0

_UNITS = {"b": 1, "bytes": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_SIZE = r"([0-9][0-9.,]*)\s*(bytes|B|KiB|MiB|GiB|TiB)"
_NEW = re.compile(r"Tried to allocate " + _SIZE + r"\.\s*GPU (\d+) has a total capacity of " + _SIZE
                  + r" of which " + _SIZE + r" is free\.", re.IGNORECASE)
_OLD = re.compile(r"Tried to allocate " + _SIZE + r" \(GPU (\d+); " + _SIZE + r" total capacity; "
                  + _SIZE + r" already allocated; " + _SIZE + r" free; " + _SIZE
                  + r" reserved in total by PyTorch\)", re.IGNORECASE)
_PROCESS = re.compile(r"Process (\d+) has " + _SIZE + r" memory in use", re.IGNORECASE)
_THIS = re.compile(r"this process has " + _SIZE + r" memory in use", re.IGNORECASE)
_POOL = re.compile(r"Of the allocated memory " + _SIZE + r" is allocated by PyTorch, and " + _SIZE
                   + r" is reserved by PyTorch but unallocated", re.IGNORECASE)
_STAMP = re.compile(r"(\d{4}-\d{2}-\d{2}[ T]\d{2}:\d{2}:\d{2})(?:[,.](\d{1,6}))?")


def _bytes(number: str, unit: str) -> int:
    return int(round(float(number.replace(",", "")) * _UNITS[unit.lower()]))


@dataclass
class OomEvent:
    """One failed allocation as the message tells it (bytes; ``time_s`` Unix seconds or None)."""

    line: int
    time_s: float | None
    gpu: int
    request_bytes: int
    total_bytes: int
    free_bytes: int
    processes: dict[int, int] = field(default_factory=dict)  # pid -> bytes in use (NVML)
    this_process_bytes: int | None = None
    allocated_bytes: int | None = None
    reserved_unallocated_bytes: int | None = None

    @property
    def others_bytes(self) -> int:
        """Memory the other processes on the device held."""
        total = sum(self.processes.values())
        if self.this_process_bytes is None:
            return total
        # The failing process is listed too when it can see its own pid: take it out once.
        own = next((p for p, b in self.processes.items() if b == self.this_process_bytes), None)
        return total - (self.this_process_bytes if own is not None else 0)

    def verdict(self) -> str:
        """The finding kind this event supports (module docstring, in order)."""
        others = self.others_bytes
        mine = self.this_process_bytes or 0
        if self.total_bytes and others >= COTENANT_SHARE * self.total_bytes and others > mine:
            return COTENANT_KIND
        if self.reserved_unallocated_bytes is not None and self.reserved_unallocated_bytes >= self.request_bytes:
            return FRAGMENTATION_KIND
        return CAPACITY_KIND

    def key(self) -> tuple:
        return (self.gpu, self.request_bytes, self.free_bytes, tuple(sorted(self.processes.items())))


def _time(text: str) -> float | None:
    m = _STAMP.search(text)
    if not m:
        return None
    try:
        t = datetime.fromisoformat(m.group(1).replace(" ", "T"))
    except ValueError:
        return None
    frac = m.group(2)
    return t.timestamp() + (int(frac) / 10 ** len(frac) if frac else 0.0)


def is_oom_line(text: str) -> bool:
    """True for a line holding a CUDA out-of-memory message of either form."""
    return "out of memory" in text and "Tried to allocate" in text and bool(_NEW.search(text) or _OLD.search(text))


def parse(lines: Iterable[str]) -> list[OomEvent]:
    """Every CUDA out-of-memory message in ``lines`` (one OOM logged twice stays twice:
    :func:`events` collapses them)."""
    out = []
    for n, text in enumerate(lines, 1):
        if "out of memory" not in text.lower() or "allocate" not in text:
            continue
        m = _NEW.search(text)
        if m:
            ev = OomEvent(line=n, time_s=_time(text), gpu=int(m.group(3)), request_bytes=_bytes(m.group(1), m.group(2)),
                          total_bytes=_bytes(m.group(4), m.group(5)), free_bytes=_bytes(m.group(6), m.group(7)))
            ev.processes = {int(p): _bytes(v, u) for p, v, u in _PROCESS.findall(text)}
            this = _THIS.search(text)
            if this:
                ev.this_process_bytes = _bytes(this.group(1), this.group(2))
            pool = _POOL.search(text)
            if pool:
                ev.allocated_bytes = _bytes(pool.group(1), pool.group(2))
                ev.reserved_unallocated_bytes = _bytes(pool.group(3), pool.group(4))
            out.append(ev)
            continue
        m = _OLD.search(text)
        if m:
            allocated = _bytes(m.group(6), m.group(7))
            reserved = _bytes(m.group(10), m.group(11))
            out.append(OomEvent(line=n, time_s=_time(text), gpu=int(m.group(3)),
                                request_bytes=_bytes(m.group(1), m.group(2)),
                                total_bytes=_bytes(m.group(4), m.group(5)),
                                free_bytes=_bytes(m.group(8), m.group(9)), this_process_bytes=reserved,
                                allocated_bytes=allocated, reserved_unallocated_bytes=max(0, reserved - allocated)))
    return out


def events(parsed: list[OomEvent]) -> list[OomEvent]:
    """``parsed`` with the repeats of one OOM (same figures within DUPLICATE_WINDOW_S) collapsed."""
    out: list[OomEvent] = []
    last: dict[tuple, float | None] = {}
    for ev in parsed:
        k = ev.key()
        if k in last:
            before = last[k]
            if before is None or ev.time_s is None or ev.time_s - before <= DUPLICATE_WINDOW_S:
                last[k] = ev.time_s if ev.time_s is not None else before
                continue
        last[k] = ev.time_s
        out.append(ev)
    return out


def findings(parsed: list[OomEvent], node: str | None = None) -> list[Finding]:
    """One finding per GPU and verdict over the OOM events (critical: an allocation failed)."""
    groups: dict[tuple[int, str], list[OomEvent]] = {}
    for ev in events(parsed):
        groups.setdefault((ev.gpu, ev.verdict()), []).append(ev)
    out = []
    for (gpu, kind), evs in sorted(groups.items()):
        worst = max(evs, key=lambda e: e.request_bytes)
        times = [e.time_s for e in evs if e.time_s is not None]
        start = min(times) if times else 0.0
        end = max(times) if times else 0.0
        n = len(evs)
        head = (f"{n} CUDA out-of-memory error{'s' if n != 1 else ''} on GPU {gpu} (as the process numbers it): "
                f"{fmt_bytes(worst.request_bytes)} asked with {fmt_bytes(worst.free_bytes)} free of "
                f"{fmt_bytes(worst.total_bytes)}")
        evidence = [Evidence("oom_request_bytes", worst.request_bytes, unit="bytes"),
                    Evidence("device_free_bytes", worst.free_bytes, threshold=worst.request_bytes, unit="bytes"),
                    Evidence("device_total_bytes", worst.total_bytes, unit="bytes")]
        details = {"oom_events": n, "lines": [e.line for e in evs][:20], "request_bytes": worst.request_bytes,
                   "device_free_bytes": worst.free_bytes, "device_total_bytes": worst.total_bytes}
        if kind == COTENANT_KIND:
            others = {p: b for p, b in worst.processes.items() if b != worst.this_process_bytes}
            top = max(others.items(), key=lambda kv: kv[1]) if others else (None, worst.others_bytes)
            summary = (f"{head}; process {top[0]} held {fmt_bytes(top[1])} of the GPU while this process had "
                       f"{fmt_bytes(worst.this_process_bytes or 0)}: another tenant has the memory")
            evidence.append(Evidence("other_processes_bytes", worst.others_bytes,
                                     threshold=COTENANT_SHARE * worst.total_bytes, unit="bytes"))
            details["other_pids"] = sorted(others)
            fixes = ["dedicated-gpu"]
            steps = (f"find what process {top[0]} is (nvidia-smi, `gpudiag top`) and free the GPU or schedule "
                     "elsewhere; request GPUs exclusively (Kubernetes GPU requests, CUDA_VISIBLE_DEVICES)")
        elif kind == FRAGMENTATION_KIND:
            summary = (f"{head}; the allocator held {fmt_bytes(worst.reserved_unallocated_bytes or 0)} free in its "
                       f"pool, more than asked, but no free block fitted")
            evidence.append(Evidence("reserved_unallocated_bytes", worst.reserved_unallocated_bytes,
                                     threshold=worst.request_bytes, unit="bytes"))
            fixes = ["PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True", "max_split_size_mb"]
            steps = "set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (or max_split_size_mb) and take a memory " \
                    "snapshot (`gpudiag analyze snapshot`) at the next OOM"
        else:
            summary = (f"{head}; this process held {fmt_bytes(worst.this_process_bytes or 0)} and its pool had "
                       f"{fmt_bytes(worst.reserved_unallocated_bytes or 0)} free: the workload outgrew the device")
            fixes = ["smaller-batch", "activation-checkpointing"]
            details["time_to_oom_s"] = 0.0
            steps = "lower the peak: smaller (micro-)batches, activation checkpointing, shorter sequences"
        details["next_step"] = steps
        out.append(Finding(kind=kind, severity=Severity.CRITICAL, start_s=start, end_s=end, summary=summary,
                           gpu=gpu, node=node, evidence=evidence, runbook=alert_name(kind), fixes=fixes,
                           details=details))
    return out
