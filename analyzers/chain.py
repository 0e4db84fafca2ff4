"""The chain assembler: links findings on the same node and GPU into cause -> effect chains.

A finding B is caused by A when the relation A -> B is declared in CAUSES,
both are on the same node and GPU, and A started before B ended and ended no
earlier than LINK_SLACK_S before B started. Roots (findings nothing else
explains) come first, each followed by what it caused.
"""

from __future__ import annotations

from gpudiag.findings import Finding

# Declared cause -> effect relations between finding kinds.
CAUSES: dict[str, tuple[str, ...]] = {
    "memory_fragmentation": ("kv_eviction_storm", "oom_forecast", "latency_regression"),
    "memory_leak": ("oom_forecast", "memory_fragmentation"),
    "gpu_cotenant": ("kv_eviction_storm", "memory_fragmentation", "latency_regression", "oom_forecast"),
    # Lost capacity (evictions and recompute, a starved GPU) piles requests up in the queue.
    "kv_eviction_storm": ("latency_regression", "queue_avalanche"),
    "cpu_starved_gpu": ("latency_regression", "queue_avalanche"),
    "queue_avalanche": ("latency_regression",),
    "prefix_cache_thrash": ("latency_regression",),
    "degenerate_kernel_launch": ("latency_regression",),
    "throttling": ("latency_regression",),
    "hardware_errors": ("latency_regression", "throttling"),
}
# A cause may end a little before its effect is detected (rates look back).
LINK_SLACK_S = 300.0


def assemble(findings: list[Finding]) -> list[Finding]:
    """Set ``caused_by`` from the declared relations and order the findings root cause first."""
    by_id = {}
    for f in findings:
        by_id[f.id] = f
    for effect in findings:
        for cause in findings:
            if cause is effect or effect.kind not in CAUSES.get(cause.kind, ()):
                continue
            if (cause.node, cause.gpu) != (effect.node, effect.gpu):
                continue
            if cause.start_s <= effect.end_s and cause.end_s >= effect.start_s - LINK_SLACK_S:
                if cause.id not in effect.caused_by:
                    effect.caused_by.append(cause.id)
    ordered: list[Finding] = []
    seen: set[str] = set()

    def visit(f: Finding) -> None:
        if f.id in seen:
            return
        seen.add(f.id)
        ordered.append(f)
        for g in sorted(findings, key=lambda x: (x.start_s, x.kind)):
            if f.id in g.caused_by:
                visit(g)

    roots = [f for f in findings if not any(c in by_id for c in f.caused_by)]
    for f in sorted(roots, key=lambda x: (-x.severity.rank, x.start_s, x.kind)):
        visit(f)
    for f in sorted(findings, key=lambda x: (x.start_s, x.kind)):
        visit(f)
    return ordered
