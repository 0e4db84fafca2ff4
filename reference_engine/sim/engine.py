"""The engine loop on the simulated GPU: requests in, steps on a virtual clock, frames out.

Each iteration is one engine step (a prefill of newly admitted sequences or a
decode over the running batch). Runs of decode steps in which nothing
happens — no arrival that could be admitted, no sequence finishing, no KV
allocation, no sample boundary — are charged in one go: the roofline cost of
k steps has a closed form, so a two-hour run takes seconds.

Every simulated second yields frames (gpu, process, engine, node; cuda_api
kernel-launch rows when ``kernel_launch_rows`` or a grid fault is on) and
every finished request a request row, named from the metric catalog. Where
request preprocessing is modelled (reference_engine/sim/preprocess.py), an
iteration may instead be the engine thread preprocessing a request or taking
ready ones off the workers' prefetch queue.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator

from gpudiag.catalog import M
from gpudiag.errors import GpudiagError
from gpudiag.frames import Frame
from gpudiag.probes.nvml import NVLINK_ERROR_KINDS, THROTTLE_REASON_BITS
from gpudiag.reference_engine.core.kv_manager import KVConfig, make_kv_manager
from gpudiag.reference_engine.core.leaks import Leak, LeakFault
from gpudiag.reference_engine.core.scheduler import Scheduler, SchedulerConfig
from gpudiag.reference_engine.core.sequence import TIERS, Sequence, Status
from gpudiag.reference_engine.serving.frontend import Frontend, FrontendConfig
from gpudiag.reference_engine.sim.gpu_specs import spec as gpu_spec
from gpudiag.reference_engine.sim.launches import GridFault, LaunchLog
from gpudiag.reference_engine.sim.preprocess import PreprocessConfig, Preprocessing
from gpudiag.reference_engine.sim.sim_gpu import MODELS, CostModel, DeviceLayout, SimGPU
from gpudiag.reference_engine.sim.token_gaps import TokenGaps

if TYPE_CHECKING:  # the scenarios room imports this module; the engine only reads a workload
    from gpudiag.reference_engine.scenarios.workload import Workload

MIB = 1024**2
ENGINE_PID = 4242
ENGINE_PROCESS = "gpudiag-engine"
# The other process that holds memory on the engine's GPU when ``other_tenant_bytes`` is set
# (SCENARIOS.md §4: a leftover training job), as NVML's per-process list shows it.
COTENANT_PID = 31337
COTENANT_PROCESS = "python train.py"
ENGINE_THREAD = "engine-loop"  # the one host thread that schedules, launches and (inline) preprocesses


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
    # Request preprocessing (cost in ``cost.preprocess_s``): on the engine thread, or in workers.
    preprocess: PreprocessConfig = field(default_factory=PreprocessConfig)
    # Export kernel-launch rows (cuda_api), as the eBPF launch probe would see them.
    kernel_launch_rows: bool = False
    # A kernel launched with a wrong grid (SCENARIOS.md §7); implies launch rows.
    grid_fault: GridFault | None = None
    # Admission control, clients that time out and retry, a liveness probe that restarts the
    # instance (SCENARIOS.md §5). None: every request is queued and waits as long as it takes.
    frontend: FrontendConfig | None = None
    # Record every inter-token gap (``SimEngine.token_gaps``) for jitter; off, it costs nothing.
    record_token_gaps: bool = False
    # A memory-leak bug in one layer of the process (SCENARIOS.md §6). None: nothing leaks.
    leak: LeakFault | None = None

    def validate(self) -> None:
        """Raise GpudiagError on a configuration that cannot run."""
        if self.model not in MODELS:
            raise GpudiagError(f"unknown model {self.model!r}; known: {', '.join(MODELS)}")
        gpu_spec(self.gpu)
        self.kv.validate()
        self.scheduler.validate()
        if self.max_split_size_mb is not None and self.max_split_size_mb <= 0:
            raise GpudiagError("max_split_size_mb must be positive")
        self.preprocess.validate()
        if self.grid_fault is not None:
            self.grid_fault.validate()
        if self.frontend is not None:
            self.frontend.validate()
        if self.leak is not None:
            self.leak.validate()


def engine_metrics(sched: Scheduler, kv, *, prompt_tokens_total: int, generation_tokens_total: int,
                   last_batch: int, kv_nominal_bytes: int, finished_total: int, arrived_total: int) -> dict:
    """The engine row's scheduler and KV figures in catalog columns (vLLM's dialect and gpudiag's own).

    Shared by the simulated and the real-tensor engine. The failed-request size is "in the last
    interval": reading it resets it.
    """
    st = sched.stats
    failed, st.largest_failed_bytes = st.largest_failed_bytes, 0
    return {
        M.num_requests_running: len(sched.running),
        M.num_requests_waiting: len(sched.waiting),
        M.kv_cache_usage_perc: kv.usage_ratio,
        M.num_preemptions_total: st.evictions,
        M.prompt_tokens_total: prompt_tokens_total,
        M.generation_tokens_total: generation_tokens_total,
        M.engine_batch_size: last_batch,
        M.engine_kv_evictions_total: st.evictions,
        M.engine_recomputed_tokens_total: st.recomputed_tokens,
        M.engine_kv_alloc_failures_total: st.alloc_failures,
        M.engine_kv_failed_request_bytes: failed,
        M.engine_kv_capacity_bytes: kv.capacity_bytes,
        M.engine_kv_capacity_nominal_bytes: kv_nominal_bytes,
        M.engine_kv_used_bytes: kv.used_bytes,
        M.engine_kv_reserved_bytes: kv.reserved_bytes,
        M.engine_requests_finished_total: finished_total,
        M.engine_requests_arrived_total: arrived_total,
        **kv.cache_metrics(),
    }


def check_seed(seed: int) -> None:
    """Raise GpudiagError unless ``seed`` can seed a run (a non-negative integer, of any size)."""
    # numpy's generators take any non-negative integer and refuse a negative one.
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise GpudiagError(f"seed must be a non-negative integer, got {seed}")


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
        check_seed(seed)
        cfg.validate()
        self.cfg = cfg
        self.workload = workload
        self.requests = workload.generate(seed)
        # A closed loop (a workload with ``clients``): its first ``clients`` requests arrive as
        # generated, each later one when an earlier one ends (its arrival_s is set then).
        self._released = getattr(workload, "clients", 0) or math.inf
        self._prefilled = False  # running_first: a prefill step ran since the last decode step
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
        self._pcie_tokens_seen = (0, 0)  # prompt and generated tokens at the last sample
        self._pending_requests: list[Sequence] = []  # finished since the last sample
        self._evictions_charged = 0
        c = cfg.cost
        self._pre = Preprocessing(cfg.preprocess, lambda s: c.preprocess_cost_s(s.prompt_tokens)) \
            if (c.preprocess_s or c.preprocess_s_per_token or cfg.preprocess.workers) else None
        self._launches = LaunchLog(self.gpu.spec, model, c, cfg.grid_fault) \
            if (cfg.kernel_launch_rows or cfg.grid_fault is not None) else None
        self._in_hand: Sequence | None = None  # preprocessed inline, joins the scheduler next iteration
        self._decoded_since_preprocess = False
        self.frontend = Frontend(cfg.frontend, self, seed) if cfg.frontend is not None else None
        self.token_gaps = TokenGaps()  # every inter-token gap, when the config asks for them
        self.leak = Leak(cfg.leak, self.gpu) if cfg.leak is not None else None
        self.failed_total = 0  # requests that ended in a CUDA out-of-memory error

    # -- the loop ----------------------------------------------------------------
    def frames(self, progress: Callable[[float], None] | None = None) -> Iterator[Frame]:
        """Run the workload to its end, yielding each second's frames as it completes."""
        duration = self.workload.duration_s
        emitted = 0  # seconds [0, emitted) have been emitted
        t = 0.0
        while t < duration:
            t = self._admit_arrivals(t)
            fed = self._preprocess(t) if self._pre is not None else t
            if fed > t:
                t = fed  # the engine thread preprocessed (or took requests off the queue) instead of stepping
            elif not self.sched.has_work:
                t = max(t, min(self._next_arrival_s(), duration))
                if self._pre is not None and (ready := self._pre.next_ready_s()) is not None:
                    t = min(t, ready)
            elif self.sched.can_admit() and not (self._prefilled and self.sched.running) \
                    and (batch := self.sched.schedule_prefill(t)):
                t = self._prefill(t, batch)
                self._prefilled = self.cfg.scheduler.running_first
            else:
                t = self._decode(t)
                self._prefilled = False
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
        if self.frontend is not None:
            self.frontend.step(t)
            return t
        reqs = self.requests
        while self._next_arrival < len(reqs) and reqs[self._next_arrival].arrival_s <= t:
            if self._pre is not None:
                self._pre.arrive(reqs[self._next_arrival])
            else:
                self.sched.add(reqs[self._next_arrival])
            self._next_arrival += 1
        return t

    def _preprocess(self, t: float) -> float:
        """Bring preprocessed requests into the scheduler; returns the engine thread's time after it.

        Inline, the thread preprocesses the oldest waiting request when the
        engine has a free slot and has decoded since the last one (or has
        nothing else to do); the request joins the scheduler when it is done,
        at the start of the next iteration. With workers, the thread takes
        ready requests off the prefetch queue, as many as it has free slots.
        """
        pre = self._pre
        if self._in_hand is not None:
            self.sched.add(self._in_hand)
            self._in_hand = None
            return t
        room = self.cfg.scheduler.max_num_seqs - len(self.sched.running) - len(self.sched.waiting)
        if not pre.inline:
            batch = pre.take_ready(t, max(0, room))
            for seq in batch:
                self.sched.add(seq)
            return self._charge(t, 0.0, len(batch) * self.cfg.preprocess.handoff_s)
        if room <= 0 or (self.sched.has_work and not self._decoded_since_preprocess) \
                or (taken := pre.take_one()) is None:
            return t
        self._in_hand, host_s = taken
        self._decoded_since_preprocess = False
        return self._charge(t, 0.0, host_s)

    def _preprocess_steps(self, t: float, step: float) -> int | float:
        """How many decode steps may run before the preprocessing stage has a request for the scheduler."""
        self._decoded_since_preprocess = True
        pre = self._pre
        if len(self.sched.running) + len(self.sched.waiting) >= self.cfg.scheduler.max_num_seqs:
            return math.inf
        if pre.inline:
            return 1 if pre.backlog else math.inf
        ready = pre.next_ready_s()
        return math.inf if ready is None else max(1, math.ceil((ready - t) / step))

    def _charge(self, t: float, gpu_s: float, host_s: float) -> float:
        """Advance the clock over host work then GPU work; returns the new time."""
        total = gpu_s + host_s
        if total > 0:
            self.gpu.busy.add(t, t + total, gpu_s / total)
        return t + total

    def _prefill(self, t: float, batch: list[Sequence]) -> float:
        cost = self.cfg.cost
        counts = [s.num_tokens for s in batch]
        cached = [s.cached_tokens for s in batch]  # KV the prefix cache already held
        gpu_s = cost.prefill_gpu_s(self.gpu.spec, self.gpu.model, [n - c for n, c in zip(counts, cached)], cached)
        if self._launches is not None:
            gpu_s += self._launches.record(t, counts, 0, decode=False)
        alloc_s, _ = self.gpu.allocator_host_time_since_last()
        # KV found in a host tier is copied in before the step's kernels run: no kernel runs meanwhile.
        load_s = cost.host_load_s(self.gpu.spec, self.kv.take_host_loaded_bytes())
        host_s = cost.host_step_cost_s(len(batch)) + alloc_s + load_s + cost.host_per_request_s * sum(
            1 for s in batch if s.preemptions == 0) + self._eviction_host_s()
        t = self._charge(t, gpu_s, host_s)
        self.prompt_tokens_total += sum(counts)
        self.last_batch = len(batch)
        for s in batch:
            if s.first_token_s is None:
                s.first_token_s = s.last_token_s = t
                s.generated = 1
                self.generation_tokens_total += 1
            else:
                # A recompute prefill samples the next token from its last position, as vLLM's does;
                # the KV manager was asked for that token's slot, so what it stores matches num_tokens.
                if self.cfg.record_token_gaps and s.last_token_s is not None:
                    self.token_gaps.add(t - s.last_token_s)
                s.last_token_s = t
                s.generated += 1
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
        if self._launches is not None:
            step += self._launches.fault_extra_s(t, [1] * n, ctx, decode=True)
        # How many identical steps can run before something happens.
        k = min(s.remaining for s in batch)
        next_second = math.floor(t) + 1.0
        k = min(k, max(1, math.ceil((next_second - t) / step)))
        # The next arrival ends the run when it could be admitted: with nothing waiting blocked, or
        # when it is worth trying itself (a short request behind a long one known not to fit).
        if (nxt := self._next_arrival_s()) < math.inf \
                and len(self.sched.running) < self.cfg.scheduler.max_num_seqs \
                and (not self.sched.admission_blocked or self._arrival_worth_trying()):
            gap = nxt - t
            k = min(k, max(1, math.ceil(gap / step)))
        elif self.sched.waiting and self.sched.can_admit():
            k = 1
        if self._pre is not None:
            k = min(k, self._preprocess_steps(t, step))
        k = max(1, self.kv.steps_without_alloc(batch, limit=max(1, k)))
        # KV read grows by one token per sequence per step: use the mean context of the run.
        mean_ctx = ctx + n * (k - 1) / 2.0
        gpu_s = k * cost.decode_gpu_s(spec, model, n, int(mean_ctx)) + copy_gpu
        if self._launches is not None:
            gpu_s += self._launches.record(t, [1] * n, int(mean_ctx), decode=True, steps=k)
        host_s = k * cost.host_step_cost_s(n) + extra_host
        self.kv.advance(batch, k)
        t0, t = t, self._charge(t, gpu_s, host_s)
        if self.cfg.record_token_gaps:
            self._record_gaps(batch, t0, t, k)
        self.last_batch = n
        self.generation_tokens_total += k * n
        for s in batch:
            s.generated += k
            if s.remaining <= 0:
                self._finish(s, t)
        return t

    def _arrival_worth_trying(self) -> bool:
        """Whether the next arrival could get KV memory now (no frontend: the arrival is known)."""
        if self.frontend is not None or self._next_arrival >= len(self.requests):
            return False
        return self.sched._worth_trying(self.requests[self._next_arrival])

    def _record_gaps(self, batch: list[Sequence], t0: float, t1: float, k: int) -> None:
        """Inter-token gaps of a run of ``k`` decode steps: each sequence's first since its last token, then steps."""
        step = (t1 - t0) / k
        first = t0 + step
        gaps = self.token_gaps
        for s in batch:
            if s.last_token_s is not None:
                gaps.add(first - s.last_token_s)
            s.last_token_s = t1
        gaps.add(step, len(batch) * (k - 1))

    def _next_arrival_s(self) -> float:
        """When the next request reaches the engine (inf when none will)."""
        if self.frontend is not None:
            return self.frontend.next_event_s()
        return self.requests[self._next_arrival].arrival_s if self._next_arrival < len(self.requests) else math.inf

    def _enqueue(self, seq: Sequence) -> None:
        """Hand an admitted request to preprocessing, where it is modelled, or to the scheduler."""
        if self._pre is not None:
            self._pre.arrive(seq)
        else:
            self.sched.add(seq)

    def _finish(self, seq: Sequence, t: float) -> None:
        self.sched.finish(seq, t)
        if self._released < len(self.requests):  # closed loop: the client sends its next request
            self.requests[self._released].arrival_s = t
            self._released += 1
        if self.leak is not None and not self.leak.on_request_done(t):
            seq.status = Status.FAILED  # its last step ran out of device memory: the client gets an error
            self.failed_total += 1
            return
        self.finished.append(seq)
        self._pending_requests.append(seq)

    # -- sampling ------------------------------------------------------------------
    def _sample(self, second: int) -> Iterator[Frame]:
        """Frames describing second [second, second+1), stamped at its end."""
        t = float(second + 1)
        gpu_busy, host_busy = self.gpu.busy.second(second)
        a = self.gpu.allocator.stats()
        if self.leak is not None:
            a = self.leak.torch_stats(a)
        spec = self.gpu.spec
        labels = {"node": self.node, "gpu": self.gpu_index, "uuid": self.uuid}
        # First-order thermal lag toward a utilization-dependent target.
        target = 34.0 + 38.0 * gpu_busy
        self._temperature += (target - self._temperature) * 0.05
        power_w = spec.idle_power_w + (spec.power_limit_w * 0.85 - spec.idle_power_w) * gpu_busy
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
            M.gpu_power_watts: power_w,
            M.gpu_power_limit_watts: spec.power_limit_w,
            M.gpu_temperature_celsius: round(self._temperature, 2),
            M.gpu_performance_state: 0,
            **self._links_and_errors(gpu_busy, power_w),
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
            **self._engine_thread(host_busy),
        }, *self._cotenant_rows(labels)])
        yield Frame("engine", t, [{
            "node": self.node, "gpu": self.gpu_index, "engine": ENGINE_PROCESS,
            **engine_metrics(self.sched, self.kv, prompt_tokens_total=self.prompt_tokens_total,
                             generation_tokens_total=self.generation_tokens_total, last_batch=self.last_batch,
                             kv_nominal_bytes=self._kv_nominal_bytes, finished_total=len(self.finished),
                             arrived_total=self._next_arrival),
            **self._preprocess_sample(second),
            **(self.frontend.metrics(t) if self.frontend is not None else {}),
            **({M.engine_requests_failed_total: self.failed_total} if self.leak is not None else {}),
        }])
        yield Frame("node", t, [{"node": self.node, M.node_cpu_utilization_ratio: engine_cpu / SIM_NODE_CPUS}])
        if self._launches is not None:
            yield Frame("cuda_api", t, self._launches.rows(second, {"node": self.node, "pid": ENGINE_PID,
                                                                   "process": ENGINE_PROCESS}))
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
        if self.frontend is not None:
            return self.frontend.in_flight()
        return sum(1 for s in self.requests[: self._next_arrival] if s.status is not Status.FINISHED)

    def _cotenant_rows(self, labels: dict) -> list[dict]:
        """The other process holding memory on this GPU, as NVML's per-process list shows it (no torch view)."""
        held = self.gpu.memory.used_bytes("cotenant")
        if not held:
            return []
        return [{**labels, "pid": COTENANT_PID, "process": COTENANT_PROCESS, M.process_gpu_memory_bytes: held}]

    def _engine_thread(self, host_busy: float) -> dict:
        """The busiest thread of the process, as the host probe names it (with preprocessing modelled)."""
        if self._pre is None:
            return {}
        return {"top_threads": [{"tid": ENGINE_PID, "name": ENGINE_THREAD, "cpu_ratio": min(1.0, host_busy + 0.005)}]}

    def _preprocess_sample(self, second: int) -> dict:
        """Preprocessing backlog, prefetch queue and worker shares at the end of ``second`` (when modelled)."""
        if self._pre is None:
            return {}
        self._pre.advance(second + 1.0)
        p = self._pre.sample(second)
        out = {M.engine_preprocess_backlog_requests: p["backlog"]}
        if not self._pre.inline:
            out.update({
                M.engine_prefetch_queue_requests: p["ready"],
                M.engine_prefetch_queue_capacity_requests: self.cfg.preprocess.queue_depth,
                M.engine_preprocess_workers_busy_ratio: p["busy_ratio"],
                M.engine_preprocess_workers_blocked_ratio: p["blocked_ratio"],
            })
        return out

    def _links_and_errors(self, gpu_busy: float, power_w: float) -> dict:
        """PCIe throughput, clock throttle reasons and error counters of the simulated GPU, for its gpu row.

        PCIe: each step's inputs cross host to device and each sampled token comes back
        (:data:`PCIE_H2D_BYTES_PER_TOKEN`, :data:`PCIE_D2H_BYTES_PER_TOKEN`), counted from
        the tokens processed since the previous sample; weights are resident before the run
        and KV never leaves the device, so nothing else crosses. Throttle reasons follow the
        thermal and power models (none while the GPU is cool and under its power limit; the
        simulated clocks do not drop). The simulated device has no faults: its ECC, NVLink,
        PCIe replay and row-remap counters read 0, the true reading of a healthy GPU. XID
        counters are per code, and like the NVML probe the sim exports a code only once it
        has happened (never); page retirement, the pre-Ampere mechanism that row remapping
        replaced on the SXM boards, is not reported.
        """
        prompt, generated = self.prompt_tokens_total, self.generation_tokens_total
        seen_prompt, seen_generated = self._pcie_tokens_seen
        self._pcie_tokens_seen = (prompt, generated)
        new_generated = generated - seen_generated
        out = {
            M.gpu_pcie_rx_bytes_per_second: float(PCIE_H2D_BYTES_PER_TOKEN * (prompt - seen_prompt + new_generated)),
            M.gpu_pcie_tx_bytes_per_second: float(PCIE_D2H_BYTES_PER_TOKEN * new_generated),
            M.gpu_pcie_replay_total: 0,
            M.gpu_clock_throttle_active: {**dict.fromkeys(THROTTLE_REASON_BITS, 0),
                                          "gpu_idle": int(gpu_busy == 0.0),
                                          "sw_power_cap": int(power_w >= self.gpu.spec.power_limit_w),
                                          "sw_thermal_slowdown": int(self._temperature >= SIM_SLOWDOWN_C)},
            M.gpu_ecc_errors_total: {scope: {"corrected": 0, "uncorrected": 0} for scope in ("volatile", "aggregate")},
        }
        if self.cfg.gpu in SXM_GPUS:
            out[M.gpu_nvlink_errors_total] = dict.fromkeys(NVLINK_ERROR_KINDS, 0)
            out[M.gpu_remapped_rows_total] = {"correctable": 0, "uncorrectable": 0}
        return out


# A simulated node has the cores of a typical 8-GPU server; the engine uses one.
SIM_NODE_CPUS = 128
# Host<->device bytes per token of an engine step, as the paged model takes its inputs:
# input id, position and KV slot (int64 each) go to the device for every scheduled token,
# and one int64 sampled id comes back per generated token (sampling runs on the device).
PCIE_H2D_BYTES_PER_TOKEN = 24
PCIE_D2H_BYTES_PER_TOKEN = 8
# Core temperature at which the simulated GPU reports sw_thermal_slowdown: about the
# "GPU Max Operating Temp" nvidia-smi -q gives for A100/H100 SXM boards, above the 85 °C
# alert. The thermal model settles at 72 °C under full load, so only a hotter model reaches it.
SIM_SLOWDOWN_C = 87.0
# The simulated GPUs that are SXM boards of an HGX node: NVLink to their peers and HBM
# with row remapping. The others are PCIe cards (no NVLink) whose GDDR6 error handling is
# modelled no further than its ECC counters.
SXM_GPUS = frozenset({"A100-40GB", "A100-80GB", "H100-SXM", "H200"})
