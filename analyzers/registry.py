"""Every analyzer over a window, in one call, chain-assembled."""

from __future__ import annotations

from collections.abc import Iterable

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


# Kinds whose streaming findings stay open until a whole window has passed without an analysis
# confirming them (the agent's FindingLog): their analyzers judge trends that a window may fail
# to confirm while they go on (the reason next to each).
HELD_FOR_A_WINDOW = frozenset(m.KIND for m in (memory_leak, oom_forecast) if m.HELD_FOR_A_WINDOW)
# What an analyzer is given back while findings of its kind are open (next to each, with the reason).
HELD_ARGUMENTS = {latency_regression.KIND: latency_regression.held_arguments}

# Cheap tests, next to each analyzer, that return False only when the analyzer is sure to find
# nothing in a window (a condition every finding needs does not hold). The agent analyzes its
# window every 10 s; on a healthy node most analyzers find nothing, and these tests cost a
# fraction of a millisecond against several for the analysis.
MAY_FIND = {
    memory_fragmentation.KIND: memory_fragmentation.may_find,
    kv_eviction_storm.KIND: kv_eviction_storm.may_find,
    cpu_starved_gpu.KIND: cpu_starved_gpu.may_find,
    degenerate_kernel_launch.KIND: degenerate_kernel_launch.may_find,
    hardware_errors.KIND: hardware_errors.may_find,
}


def run_all(window: Window) -> list[Finding]:
    """Run every analyzer over ``window`` and return the findings, root causes first."""
    findings: list[Finding] = []
    for analyze in ANALYZERS.values():
        findings.extend(analyze(window))
    return chain.assemble(findings)


def held_arguments(open_findings: Iterable[Finding], window_s: float) -> dict[str, dict]:
    """Per kind, what its analyzer is given while findings of it are open (for :func:`run_streaming`):
    each :data:`HELD_ARGUMENTS` function over the open findings of its kind."""
    by_kind: dict[str, list[Finding]] = {}
    for f in open_findings:
        if f.kind in HELD_ARGUMENTS:
            by_kind.setdefault(f.kind, []).append(f)
    out = {kind: HELD_ARGUMENTS[kind](found, window_s) for kind, found in by_kind.items()}
    return {kind: kwargs for kind, kwargs in out.items() if kwargs}


def run_streaming(window: Window, open_kinds: Iterable[str] = (),
                  held: dict[str, dict] | None = None) -> list[Finding]:
    """:func:`run_all`'s findings, leaving out the analyzers whose :data:`MAY_FIND` test rules any out.

    An analyzer with a finding of its kind open (``open_kinds``) always runs, so what is
    open is updated and resolved by the analysis itself; ``held`` (:func:`held_arguments`)
    gives it what those findings were measured against.
    """
    keep = set(open_kinds)
    findings: list[Finding] = []
    for kind, analyze in ANALYZERS.items():
        may_find = MAY_FIND.get(kind)
        if may_find is not None and kind not in keep and not may_find(window):
            continue
        findings.extend(analyze(window, **(held or {}).get(kind, {})))
    return chain.assemble(findings)
