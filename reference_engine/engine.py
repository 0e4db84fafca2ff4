"""The engine loop on the simulated GPU: requests in, steps on a virtual clock, frames out.

Each iteration is one engine step (a prefill of newly admitted sequences or a
decode over the running batch). Runs of decode steps in which nothing
happens — no arrival that could be admitted, no sequence finishing, no KV
allocation, no sample boundary — are charged in one go: the roofline cost of
k steps has a closed form, so a two-hour run takes seconds.

Every simulated second yields frames (gpu, process, engine, node) and every
finished request a request row, named from the metric catalog.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

from gpudiag.catalog import M
from gpudiag.errors import GpudiagError
from gpudiag.frames import Frame
from gpudiag.reference_engine.gpu_specs import spec as gpu_spec
from gpudiag.reference_engine.kv_manager import KVConfig, make_kv_manager
from gpudiag.reference_engine.scheduler import Scheduler, SchedulerConfig
from gpudiag.reference_engine.sequence import TIERS, Sequence, Status
from gpudiag.reference_engine.sim_gpu import MODELS, CostModel, DeviceLayout, SimGPU
from gpudiag.reference_engine.workload import Workload

MIB = 1024**2
ENGINE_PID = 4242
ENGINE_PROCESS = "gpudiag-engine"


@dataclass
class EngineConfig:
    """Everything that makes one engine instance: device, model, KV, scheduler."""

    gpu: str = "A100-80GB"
    model: str = "llama-7b"
    kv: KVConfig = field(default_factory=KVConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    layout: DeviceLayout = field(default_factory=DeviceLayout)
    cost: CostModel = field(default_factory=CostModel)
    max_split_size_mb: int | None = None
    expandable_segments: bool = False
    other_tenant_bytes: int = 0

    def validate(self) -> None:
        """Raise GpudiagError on a configuration that cannot run."""
        if self.model not in MODELS:
            raise GpudiagError(f"unknown model {self.model!r}; known: {', '.join(MODELS)}")
        gpu_spec(self.gpu)
        self.kv.validate()
        self.scheduler.validate()
        if self.max_split_size_mb is not None and self.max_split_size_mb <= 0:
            raise GpudiagError("max_split_size_mb must be positive")


class VirtualClock:
    """Simulated time. ``speed=None`` runs as fast as possible; a number paces it to wall time."""

    def __init__(self, speed: float | None = None, sleep: Callable[[float], None] = time.sleep):
        if speed is not None and speed <= 0:
            raise GpudiagError(f"speed must be positive, got {speed}")
        self.speed = speed
        self.now = 0.0
        self._sleep = sleep
        self._wall0 = time.monotonic()

    def advance_to(self, t: float) -> None:
        self.now = max(self.now, t)
        if self.speed is not None:
            delay = self._wall0 + self.now / self.speed - time.monotonic()
            if delay > 0:
                self._sleep(delay)


class SimEngine:
    """The reference engine on a simulated GPU."""

    def __init__(self, cfg: EngineConfig, workload: Workload, seed: int = 0, *,
                 clock: VirtualClock | None = None, node: str = "sim-node", gpu_index: int = 0):
        cfg.validate()
        self.cfg = cfg
        self.workload = workload
        self.requests = workload.generate(seed)
        self.clock = clock or VirtualClock()
        self.node = node
        self.gpu_index = gpu_index
        self.uuid = f"GPU-sim-{gpu_index:02d}-{seed:08x}"
        model = MODELS[cfg.model]
        self.gpu = SimGPU(gpu_spec(cfg.gpu), model, cfg.layout, cfg.cost,
                          max_split_size_bytes=cfg.max_split_size_mb * MIB if cfg.max_split_size_mb else None,
                          expandable_segments=cfg.expandable_segments,
                          other_tenant_bytes=cfg.other_tenant_bytes)
        self._kv_nominal_bytes = self.gpu.kv_nominal_bytes  # before the KV pool takes its share
        self.kv = make_kv_manager(cfg.kv, self.gpu.allocator, model.kv_bytes_per_token, self.gpu.kv_capacity_bytes)
        self.sched = Scheduler(cfg.scheduler, self.kv)
        self.finished: list[Sequence] = []
        # cumulative counters (Prometheus-style)
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.last_batch = 0
        self._next_arrival = 0
        self._failed_bytes_in_second = 0
        self._temperature = 35.0
        self._pending_requests: list[Sequence] = []  # finished since the last sample
        self._evictions_charged = 0

    # -- the loop ----------------------------------------------------------------
    def frames(self, progress: Callable[[float], None] | None = None) -> Iterator[Frame]:
        """Run the workload to its end, yielding each second's frames as it completes."""
        duration = self.workload.duration_s
        emitted = 0  # seconds [0, emitted) have been emitted
        t = 0.0
        reqs = self.requests
        while t < duration:
            t = self._admit_arrivals(t)
            if not self.sched.has_work:
                t = reqs[self._next_arrival].arrival_s if self._next_arrival < len(reqs) else duration
            elif self.sched.can_admit() and (batch := self.sched.schedule_prefill(t)):
                t = self._prefill(t, batch)
            else:
                t = self._decode(t)
            self.clock.advance_to(min(t, duration))
            while emitted + 1 <= min(t, duration):
                yield from self._sample(emitted)
                emitted += 1
                if progress is not None:
                    progress(emitted)
        while emitted < int(duration):
            yield from self._sample(emitted)
            emitted += 1

    def _admit_arrivals(self, t: float) -> float:
        reqs = self.requests
        while self._next_arrival < len(reqs) and reqs[self._next_arrival].arrival_s <= t:
            self.sched.add(reqs[self._next_arrival])
            self._next_arrival += 1
        return t

    def _charge(self, t: float, gpu_s: float, host_s: float) -> float:
        """Advance the clock over host work then GPU work; returns the new time."""
        total = gpu_s + host_s
        if total > 0:
            self.gpu.busy.add(t, t + total, gpu_s / total)
        return t + total

    def _prefill(self, t: float, batch: list[Sequence]) -> float:
        cost = self.cfg.cost
        counts = [s.num_tokens for s in batch]
        gpu_s = cost.prefill_gpu_s(self.gpu.spec, self.gpu.model, counts)
        alloc_s, _ = self.gpu.allocator_host_time_since_last()
        host_s = cost.host_step_cost_s(len(batch)) + alloc_s + cost.host_per_request_s * sum(
            1 for s in batch if s.preemptions == 0) + self._eviction_host_s()
        t = self._charge(t, gpu_s, host_s)
        self.prompt_tokens_total += sum(counts)
        self.last_batch = len(batch)
        for s in batch:
            if s.first_token_s is None:
                s.first_token_s = t
                s.generated = 1
                self.generation_tokens_total += 1
            if s.remaining <= 0:
                self._finish(s, t)
        return t

    def _eviction_host_s(self) -> float:
        st = self.sched.stats
        n = st.evictions - self._evictions_charged
        self._evictions_charged = st.evictions
        return n * self.cfg.cost.eviction_host_s

    def _decode(self, t: float) -> float:
        cost, spec, model = self.cfg.cost, self.gpu.spec, self.gpu.model
        copied_before = self.kv.copy_bytes_total
        batch = list(self.sched.prepare_decode(t))
        alloc_s, _ = self.gpu.allocator_host_time_since_last()
        extra_host = alloc_s + self._eviction_host_s()
        copy_gpu = cost.copy_gpu_s(spec, self.kv.copy_bytes_total - copied_before)
        if not batch:
            return self._charge(t, copy_gpu, extra_host + cost.host_step_s)
        n = len(batch)
        ctx = sum(s.num_tokens for s in batch)
        step_gpu = cost.decode_gpu_s(spec, model, n, ctx)
        step = step_gpu + cost.host_step_cost_s(n)
        # How many identical steps can run before something happens.
        k = min(s.remaining for s in batch)
        next_second = math.floor(t) + 1.0
        k = min(k, max(1, math.ceil((next_second - t) / step)))
        if self._next_arrival < len(self.requests) and len(self.sched.running) < self.cfg.scheduler.max_num_seqs \
                and not self.sched.admission_blocked:
            gap = self.requests[self._next_arrival].arrival_s - t
            k = min(k, max(1, math.ceil(gap / step)))
        elif self.sched.waiting and self.sched.can_admit():
            k = 1
        k = max(1, self.kv.steps_without_alloc(batch, limit=max(1, k)))
        # KV read grows by one token per sequence per step: use the mean context of the run.
        mean_ctx = ctx + n * (k - 1) / 2.0
        gpu_s = k * cost.decode_gpu_s(spec, model, n, int(mean_ctx)) + copy_gpu
        host_s = k * cost.host_step_cost_s(n) + extra_host
        self.kv.advance(batch, k)
        t = self._charge(t, gpu_s, host_s)
        self.last_batch = n
        self.generation_tokens_total += k * n
        for s in batch:
            s.generated += k
            if s.remaining <= 0:
                self._finish(s, t)
        return t

    def _finish(self, seq: Sequence, t: float) -> None:
        self.sched.finish(seq, t)
        self.finished.append(seq)
        self._pending_requests.append(seq)

    # -- sampling ------------------------------------------------------------------
    def _sample(self, second: int) -> Iterator[Frame]:
        """Frames describing second [second, second+1), stamped at its end."""
        t = float(second + 1)
        gpu_busy, host_busy = self.gpu.busy.second(second)
        a = self.gpu.allocator.stats()
        spec = self.gpu.spec
        labels = {"node": self.node, "gpu": self.gpu_index, "uuid": self.uuid}
        # First-order thermal lag toward a utilization-dependent target.
        target = 34.0 + 38.0 * gpu_busy
        self._temperature += (target - self._temperature) * 0.05
        yield Frame("gpu", t, [{
            **labels,
            M.gpu_utilization_ratio: gpu_busy,
            M.gpu_memory_utilization_ratio: gpu_busy * 0.8,
            M.gpu_memory_used_bytes: self.gpu.memory.used_bytes(),
            M.gpu_memory_total_bytes: spec.memory_bytes,
            M.gpu_sm_clock_hertz: spec.sm_clock_max_hz,
            M.gpu_sm_clock_max_hertz: spec.sm_clock_max_hz,
            M.gpu_memory_clock_hertz: spec.memory_clock_max_hz,
            M.gpu_memory_clock_max_hertz: spec.memory_clock_max_hz,
            M.gpu_power_watts: spec.idle_power_w + (spec.power_limit_w * 0.85 - spec.idle_power_w) * gpu_busy,
            M.gpu_power_limit_watts: spec.power_limit_w,
            M.gpu_temperature_celsius: round(self._temperature, 2),
            M.gpu_performance_state: 0,
        }])
        engine_cpu = min(1.0, host_busy + 0.02)
        yield Frame("process", t, [{
            **labels, "pid": ENGINE_PID, "process": ENGINE_PROCESS,
            M.process_gpu_memory_bytes: self.gpu.driver_bytes(),
            M.process_torch_allocated_bytes: a.allocated_bytes,
            M.process_torch_reserved_bytes: a.reserved_bytes,
            M.process_torch_active_bytes: a.active_bytes,
            M.process_torch_inactive_split_bytes: a.inactive_split_bytes,
            M.process_torch_requested_bytes: a.requested_bytes,
            M.process_torch_largest_free_block_bytes: a.largest_free_block_bytes,
            M.process_torch_segments: a.segment_count,
            M.process_torch_alloc_retries_total: a.num_alloc_retries,
            M.process_torch_ooms_total: a.num_ooms,
            M.process_reserved_minus_allocated_bytes: a.reserved_bytes - a.allocated_bytes,
            M.process_driver_minus_reserved_bytes: self.gpu.driver_bytes() - a.reserved_bytes,
            M.process_cpu_utilization_ratio: engine_cpu,
            M.process_thread_cpu_max_ratio: min(1.0, host_busy + 0.005),
        }])
        st = self.sched.stats
        failed = st.largest_failed_bytes
        st.largest_failed_bytes = 0
        yield Frame("engine", t, [{
            "node": self.node, "gpu": self.gpu_index, "engine": ENGINE_PROCESS,
            M.num_requests_running: len(self.sched.running),
            M.num_requests_waiting: len(self.sched.waiting),
            M.kv_cache_usage_perc: self.kv.usage_ratio,
            M.num_preemptions_total: st.evictions,
            M.prompt_tokens_total: self.prompt_tokens_total,
            M.generation_tokens_total: self.generation_tokens_total,
            M.engine_batch_size: self.last_batch,
            M.engine_kv_evictions_total: st.evictions,
            M.engine_recomputed_tokens_total: st.recomputed_tokens,
            M.engine_kv_alloc_failures_total: st.alloc_failures,
            M.engine_kv_failed_request_bytes: failed,
            M.engine_kv_capacity_bytes: self.kv.capacity_bytes,
            M.engine_kv_capacity_nominal_bytes: self._kv_nominal_bytes,
            M.engine_kv_used_bytes: self.kv.used_bytes,
            M.engine_kv_reserved_bytes: self.kv.reserved_bytes,
            M.engine_requests_finished_total: len(self.finished),
            M.engine_requests_arrived_total: self._next_arrival,
        }])
        yield Frame("node", t, [{"node": self.node, M.node_cpu_utilization_ratio: engine_cpu / SIM_NODE_CPUS}])
        if self._pending_requests:
            rows = []
            for s in self._pending_requests:
                rows.append({"node": self.node, "gpu": self.gpu_index, "engine": ENGINE_PROCESS,
                             "request_id": s.seq_id, "kind": s.kind, "tier": TIERS[s.tier],
                             "arrival_s": s.arrival_s, "finish_s": s.finish_s,
                             "prompt_tokens": s.prompt_tokens, "output_tokens": s.generated,
                             "preemptions": s.preemptions, **s.latencies()})
            self._pending_requests = []
            yield Frame("request", t, rows)

    def unfinished(self) -> int:
        """Requests that arrived but had not finished when the run ended."""
        return sum(1 for s in self.requests[: self._next_arrival] if s.status is not Status.FINISHED)


# A simulated node has the cores of a typical 8-GPU server; the engine uses one.
SIM_NODE_CPUS = 128
