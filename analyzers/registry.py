"""Every analyzer over a window, in one call, chain-assembled."""

from __future__ import annotations

from gpudiag.findings import Finding
from gpudiag.frames import Window

from . import (
    chain,
    cpu_starved_gpu,
    degenerate_kernel_launch,
    gpu_cotenant,
    hardware_errors,
    kv_eviction_storm,
    latency_regression,
    memory_fragmentation,
    memory_leak,
    oom_forecast,
    prefix_cache_thrash,
    queue_avalanche,
    throttling,
)

ANALYZERS = {
    memory_fragmentation.KIND: memory_fragmentation.analyze,
    kv_eviction_storm.KIND: kv_eviction_storm.analyze,
    oom_forecast.KIND: oom_forecast.analyze,
    memory_leak.KIND: memory_leak.analyze,
    cpu_starved_gpu.KIND: cpu_starved_gpu.analyze,
    gpu_cotenant.KIND: gpu_cotenant.analyze,
    degenerate_kernel_launch.KIND: degenerate_kernel_launch.analyze,
    throttling.KIND: throttling.analyze,
    hardware_errors.KIND: hardware_errors.analyze,
    queue_avalanche.KIND: queue_avalanche.analyze,
    prefix_cache_thrash.KIND: prefix_cache_thrash.analyze,
    latency_regression.KIND: latency_regression.analyze,
}


def run_all(window: Window) -> list[Finding]:
    """Run every analyzer over ``window`` and return the findings, root causes first."""
    findings: list[Finding] = []
    for analyze in ANALYZERS.values():
        findings.extend(analyze(window))
    return chain.assemble(findings)
