"""Memory-leak bugs of the engine process, one per layer of the three colours (SCENARIOS.md §6, DESIGN.md).

A leak here is a bug in the engine, and the bug is the mechanism: every
``every_requests``-th completed request leaves ``bytes_per_leak`` behind in
one layer, through the same allocator model and device memory as everything
else, so the colours move the way a real process's do:

- ``allocated`` (white): a tensor is kept alive (appended to a list nobody
  drains); the caching allocator allocates it, so white, grey and black rise.
- ``pool`` (grey): a CUDA graph is captured into a private memory pool of its
  own and kept. The capture's workspace goes back to that pool when the
  capture ends, so it is reserved but not allocated, and no other allocation
  may use it (torch releases a private pool only when its graph is destroyed):
  grey and black rise, white stays flat.
- ``driver`` (black): memory is cudaMalloc'd outside PyTorch (a native
  extension's scratch) and never freed: black rises alone.

When the leak's allocation finds no device memory the process has run out of
memory: the request that needed it fails, and :attr:`Leak.first_oom_s` says when
that first happened.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from gpudiag.errors import GpudiagError
from gpudiag.reference_engine.core.allocator import AllocatorStats, CachingAllocator, OutOfMemory
from gpudiag.reference_engine.sim.sim_gpu import SimGPU

ALLOCATED, POOL, DRIVER = "allocated", "pool", "driver"
LAYERS = (ALLOCATED, POOL, DRIVER)


@dataclass
class LeakFault:
    """Which layer leaks, how much per leak, and how often (one leak per ``every_requests`` completions)."""

    layer: str
    bytes_per_leak: int
    every_requests: int = 1

    def validate(self) -> None:
        """Raise GpudiagError on a leak that cannot be simulated."""
        if self.layer not in LAYERS:
            raise GpudiagError(f"unknown leak layer {self.layer!r}; valid: {', '.join(LAYERS)}")
        if self.bytes_per_leak <= 0 or self.every_requests <= 0:
            raise GpudiagError("a leak needs a positive size and a positive request interval")


class Leak:
    """The bug at work on one simulated GPU: what it holds, and when it first ran out of memory."""

    def __init__(self, fault: LeakFault, gpu: SimGPU):
        fault.validate()
        self.fault = fault
        self.gpu = gpu
        self.leaks = 0  # allocations the bug made and kept
        self.failures = 0  # leak allocations that found no memory (each failed a request)
        self.first_oom_s: float | None = None
        self._completions = 0
        self._kept_tensors: list[int] = []  # allocated: the list nobody drains
        self._graph_pools: list[CachingAllocator] = []  # pool: graphs kept alive with their private pools
        self._pool_reserved = 0
        self._pool_ooms = 0

    def on_request_done(self, t: float) -> bool:
        """The completed request's share of the bug; False when it ran out of device memory (the request fails)."""
        self._completions += 1
        if self._completions % self.fault.every_requests:
            return True
        ok = {ALLOCATED: self._keep_tensor, POOL: self._capture_graph, DRIVER: self._native_malloc}[self.fault.layer]()
        if ok:
            self.leaks += 1
            return True
        self.failures += 1
        if self.first_oom_s is None:
            self.first_oom_s = t
        return False

    def _keep_tensor(self) -> bool:
        try:
            self._kept_tensors.append(self.gpu.allocator.malloc(self.fault.bytes_per_leak))
        except OutOfMemory:
            return False
        return True

    def _capture_graph(self) -> bool:
        owner = f"{SimGPU.ENGINE}:graph-pool-{len(self._graph_pools)}"
        self.gpu.memory.join_cap(owner, SimGPU.ENGINE)
        pool = CachingAllocator(self.gpu.memory, owner)
        try:
            addr = self._malloc_with_release(pool)
        except OutOfMemory:
            self._pool_ooms += 1
            return False
        pool.free(addr)  # the capture ends: its workspace stays reserved in the graph's private pool
        self._graph_pools.append(pool)
        self._pool_reserved += pool.stats().reserved_bytes
        return True

    def _malloc_with_release(self, pool: CachingAllocator) -> int:
        # torch's retry before an OOM frees the cached blocks of the process's ordinary pools too.
        try:
            return pool.malloc(self.fault.bytes_per_leak)
        except OutOfMemory:
            self.gpu.allocator.empty_cache()
            return pool.malloc(self.fault.bytes_per_leak)

    def _native_malloc(self) -> bool:
        return self.gpu.memory.reserve(self.fault.bytes_per_leak, f"{SimGPU.ENGINE}:native")

    def torch_stats(self, a: AllocatorStats) -> AllocatorStats:
        """The process's allocator statistics with the kept graphs' private pools counted in, as torch's
        memory_stats() counts every pool of the device."""
        if not self._graph_pools and not self._pool_ooms:
            return a
        return replace(a, reserved_bytes=a.reserved_bytes + self._pool_reserved,
                       free_reserved_bytes=a.free_reserved_bytes + self._pool_reserved,
                       segment_count=a.segment_count + len(self._graph_pools), num_ooms=a.num_ooms + self._pool_ooms)
