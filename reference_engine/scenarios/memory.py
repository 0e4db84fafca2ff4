"""Memory incidents: fragmentation OOM, co-tenant, leaks by layer, and the healthy baseline.

Registered into ``scenarios.SCENARIOS``; parameters live here and nowhere else.
"""

from __future__ import annotations

from gpudiag.reference_engine.core.kv_manager import KVConfig
from gpudiag.reference_engine.core.leaks import ALLOCATED, DRIVER, POOL, LeakFault
from gpudiag.reference_engine.core.scheduler import SchedulerConfig
from gpudiag.reference_engine.scenarios import STORM_FIXES, Fix, Scenario
from gpudiag.reference_engine.scenarios.workload import LengthDist, Phase, RequestClass, Workload
from gpudiag.reference_engine.sim.engine import EngineConfig
from gpudiag.reference_engine.sim.sim_gpu import DeviceLayout

KIB, MIB, GIB = 1024, 1024**2, 1024**3


# --- healthy (the baseline every memory scenario departs from) ---------------------
# Mistral-7B on an A100-80GB with vLLM's defaults: paged KV (16-token blocks) sized to
# gpu_memory_utilization 0.9, no torch cap; steady chat traffic well inside capacity.
HEALTHY_DURATION_S = 3600.0
HEALTHY_QPS = 2.0
_CHAT = RequestClass("chat", 1.0, LengthDist(400, 0.8, 16, 4000), LengthDist(400, 0.6, 16, 2000))


def _healthy_engine() -> EngineConfig:
    return EngineConfig(
        gpu="A100-80GB", model="mistral-7b",
        kv=KVConfig(strategy="paged", block_size=16),
        scheduler=SchedulerConfig(policy="lru", batching="fcfs"),
        layout=DeviceLayout(memory_fraction=1.0, activation_bytes=4 * GIB, gpu_memory_utilization=0.9),
    )


def _steady(duration_s: float, qps: float) -> Workload:
    return Workload(qps=qps, duration_s=duration_s, phases=[Phase("steady", 0.0, duration_s, (_CHAT,))])


# --- pool-leak, driver-leak, tensor-leak (SCENARIOS.md §6) ---------------------------
# The healthy engine and load with one bug each. The device's free 10 % (about 7.5 GiB
# after the CUDA context) is what a leak eats; at ~0.7 MiB/s it is gone after about three
# hours, so the detector has hours to warn (the field report's warned 2 h ahead).
LEAK_DURATION_S = 3.25 * 3600.0
LEAK_QPS = 1.4
LEAKS = {
    # The output logits of the last four positions of every request (4 x 32000 x fp32) are
    # appended to a list for a debugging endpoint that nobody drains.
    "tensor-leak": LeakFault(ALLOCATED, 4 * 32000 * 4),
    # About one request in 80 brings sampling options outside the decode graph's; the engine
    # captures a graph for it into a private memory pool of its own (not the shared pool) and
    # keeps every graph. Each capture's 40 MiB workspace stays reserved in its pool.
    "pool-leak": LeakFault(POOL, 40 * MIB, every_requests=80),
    # A custom sampling extension cudaMallocs a 512 KiB scratch per request and never frees it.
    "driver-leak": LeakFault(DRIVER, 512 * KIB),
}


def _leaky_engine(fault: LeakFault):
    def build() -> EngineConfig:
        cfg = _healthy_engine()
        cfg.leak = LeakFault(fault.layer, fault.bytes_per_leak, fault.every_requests)
        return cfg
    return build


def _no_leak(cfg: EngineConfig) -> None:
    cfg.leak = None


_LEAK_SUMMARIES = {
    "tensor-leak": "per-request tensors kept in a list: allocated (white) grows at flat load until OOM",
    "pool-leak": "CUDA graphs kept, each in a private pool of its own: reserved (grey) grows, allocated flat",
    "driver-leak": "a native extension's cudaMalloc never freed: driver-charged memory (black) grows, reserved flat",
}

SCENARIOS: dict[str, Scenario] = {
    "healthy": Scenario(
        "healthy", "steady chat traffic on paged KV with headroom: no finding should appear",
        _healthy_engine, lambda: _steady(HEALTHY_DURATION_S, HEALTHY_QPS),
        [("steady", 0.0, HEALTHY_DURATION_S)], {}, (),
    ),
}
# Allocated memory that grows at flat load reaches the pool's limit within the run, so the
# forecast sees the OOM coming; reserved and driver-charged growth leave allocated flat.
_LEAK_FINDINGS = {"tensor-leak": ("memory_leak", "oom_forecast")}

for _name, _fault in LEAKS.items():
    SCENARIOS[_name] = Scenario(
        _name, _LEAK_SUMMARIES[_name], _leaky_engine(_fault), lambda: _steady(LEAK_DURATION_S, LEAK_QPS),
        [("leaking", 0.0, LEAK_DURATION_S)],
        {"no-leak": Fix("no-leak", "the bug fixed: nothing is kept after the request completes", _no_leak)},
        _LEAK_FINDINGS.get(_name, ("memory_leak",)),
    )


# --- cotenant (SCENARIOS.md §4) -------------------------------------------------------
# Llama-2-7B (no GQA: 512 KiB of KV per token) on an A100-80GB where a leftover training
# process still holds half the memory: the KV pool, sized from the free memory at start,
# gets well under half of its nominal size, and a load the engine carries with room to
# spare on a GPU of its own keeps it paging.
COTENANT_DURATION_S = 1800.0
COTENANT_QPS = 0.9
COTENANT_BYTES = 40 * GIB
_RAG = RequestClass("rag", 1.0, LengthDist(2000, 0.4, 256, 6000), LengthDist(500, 0.4, 32, 1500))


def _cotenant_engine() -> EngineConfig:
    return EngineConfig(
        gpu="A100-80GB", model="llama-7b",
        kv=KVConfig(strategy="paged", block_size=16),
        scheduler=SchedulerConfig(policy="lru", batching="fcfs"),
        layout=DeviceLayout(memory_fraction=1.0, activation_bytes=4 * GIB, gpu_memory_utilization=0.9),
        other_tenant_bytes=COTENANT_BYTES,
    )


def _dedicated_gpu(cfg: EngineConfig) -> None:
    cfg.other_tenant_bytes = 0


SCENARIOS["cotenant"] = Scenario(
    "cotenant", "a leftover training process holds half the GPU: tiny KV pool, constant paging, long waits",
    _cotenant_engine,
    lambda: Workload(qps=COTENANT_QPS, duration_s=COTENANT_DURATION_S,
                     phases=[Phase("serving", 0.0, COTENANT_DURATION_S, (_RAG,))]),
    [("serving", 0.0, COTENANT_DURATION_S)],
    {"dedicated-gpu": Fix("dedicated-gpu", "a dedicated node pool and GPU memory in the pod spec: no co-tenant",
                          _dedicated_gpu)},
    ("gpu_cotenant",),
)


# --- fragmentation-oom (SCENARIOS.md §3) ----------------------------------------------
# A 16 GB card (T4: 15 GiB as NVML counts it) serving Mistral-7B with 8-bit weights
# (7.2 GB): after weights, activations and the CUDA context ~6.5 GiB is left for KV under
# the engine's cap, "~8 GB free" as nvidia-smi shows it after loading. Each request's KV is
# one contiguous region grown by realloc+copy by a quarter at a time from 16 MiB (the way a
# cache that is torch.cat'ed as it grows behaves, in coarser steps), the caching allocator
# splits cached segments for the many sizes, and as concurrency rises the free memory
# ends up in holes no new region fits.
FRAG_DURATION_S = 3600.0
FRAG_PHASES = (("low", 0.0, 1200.0, 0.3), ("rising", 1200.0, 2400.0, 0.55), ("peak", 2400.0, 3600.0, 0.92))
# Chat turns, and one request in ten a long generation whose region grows many times.
_FRAG_MIX = (RequestClass("short", 0.9, LengthDist(400, 0.6, 16, 3000), LengthDist(150, 0.6, 16, 1500)),
             RequestClass("long", 0.1, LengthDist(1500, 0.4, 200, 4000), LengthDist(1200, 0.4, 200, 3000)))


def _frag_engine() -> EngineConfig:
    return EngineConfig(
        gpu="T4", model="mistral-7b-w8",
        kv=KVConfig(strategy="contiguous", initial_bytes=16 * MIB, growth_factor=1.25),
        scheduler=SchedulerConfig(policy="lru", batching="fcfs"),
        layout=DeviceLayout(memory_fraction=0.95, activation_bytes=1 * GIB),
    )


def _frag_workload() -> Workload:
    return Workload(qps=FRAG_PHASES[0][3], duration_s=FRAG_DURATION_S,
                    phases=[Phase(name, a, b, _FRAG_MIX, qps) for name, a, b, qps in FRAG_PHASES])


def _chunked(cfg: EngineConfig) -> None:
    # One chunk holds the median request (~550 tokens of 128 KiB): most requests need one.
    cfg.kv.strategy = "chunked"
    cfg.kv.chunk_bytes = 64 * MIB


def _expandable(cfg: EngineConfig) -> None:
    cfg.expandable_segments = True


SCENARIOS["fragmentation-oom"] = Scenario(
    "fragmentation-oom", "OOM with ~8 GB free on a 16 GB card as concurrency rises: the free memory is small holes",
    _frag_engine, _frag_workload,
    [(name, a, b) for name, a, b, _ in FRAG_PHASES],
    {"paged-kv": STORM_FIXES["paged-kv"],
     "chunked-kv": Fix("chunked-kv", "fixed 64 MiB chunks appended, no contiguity", _chunked),
     "expandable-segments": Fix("expandable-segments",
                                "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: free pages in holes are unmapped "
                                "and mapped again where a region needs them", _expandable)},
    # The forecast is a trend from the run's start (memory grows with concurrency) that the
    # holes then cut short: a root of its own, older than the first failure in a hole.
    ("memory_fragmentation", "oom_forecast"),
)
