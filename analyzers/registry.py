"""Every analyzer over a window, in one call, chain-assembled."""

from __future__ import annotations

from gpudiag.findings import Finding
from gpudiag.frames import Window

from . import chain, kv_eviction_storm, memory_fragmentation

ANALYZERS = {
    memory_fragmentation.KIND: memory_fragmentation.analyze,
    kv_eviction_storm.KIND: kv_eviction_storm.analyze,
}


def run_all(window: Window) -> list[Finding]:
    """Run every analyzer over ``window`` and return the findings, root causes first."""
    findings: list[Finding] = []
    for analyze in ANALYZERS.values():
        findings.extend(analyze(window))
    return chain.assemble(findings)
