"""The chain assembler: links findings on the same node and GPU into cause -> effect chains.

A finding B is caused by A when the relation A -> B is declared in CAUSES,
both are on the same node and GPU, and:

- A started no later than B: ``A.start_s <= B.start_s + step_s``, where
  ``step_s`` is the window's sampling step (common.WindowClock; default
  common.DEFAULT_STEP_S). A cause seen on a coarser series may be detected
  up to one sample after its effect, never more: a cause that starts later
  is not the cause, whatever the overlap;
- A was still going when B started, or ended at most LINK_SLACK_S before:
  ``A.end_s >= B.start_s - LINK_SLACK_S``. A cause's harm outlasts it (a
  queue takes minutes to drain, rates look back), so an effect may start a
  little after its cause ended.

Roots (findings nothing else explains) come first, each followed by what it
caused.
"""

from __future__ import annotations

from gpudiag.findings import Finding

from .common import DEFAULT_STEP_S

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
# A cause may end this long before its effect starts: its harm outlasts it (a queue drains for
# minutes, the effect's rates look back over a minute or more).
LINK_SLACK_S = 300.0


def may_cause(cause: Finding, effect: Finding, step_s: float = DEFAULT_STEP_S) -> bool:
    """Whether ``cause`` may be linked as the cause of ``effect`` by time alone (the module's two rules)."""
    return cause.start_s <= effect.start_s + step_s and cause.end_s >= effect.start_s - LINK_SLACK_S


def assemble(findings: list[Finding], step_s: float = DEFAULT_STEP_S) -> list[Finding]:
    """Set ``caused_by`` from the declared relations and order the findings root cause first.

    ``step_s``: the window's sampling step (common.window_clock), how much later than its
    effect a cause may be seen to start.
    """
    ids = [f.id for f in findings]
    by_id = dict(zip(ids, findings))
    # Candidates meet only on the same node and GPU: pair within those groups, not all with all.
    groups: dict[tuple, list[int]] = {}
    for i, f in enumerate(findings):
        groups.setdefault((f.node, f.gpu), []).append(i)
    for members in groups.values():
        for e in members:
            effect = findings[e]
            for c in members:
                cause = findings[c]
                if c == e or effect.kind not in CAUSES.get(cause.kind, ()):
                    continue
                if may_cause(cause, effect, step_s):
                    if ids[c] not in effect.caused_by:
                        effect.caused_by.append(ids[c])
    by_time = sorted(range(len(findings)), key=lambda i: (findings[i].start_s, findings[i].kind))
    effects: dict[str, list[int]] = {}  # cause id -> its effects, in time order
    for i in by_time:
        for cid in findings[i].caused_by:
            effects.setdefault(cid, []).append(i)
    ordered: list[Finding] = []
    seen: set[str] = set()

    def visit(i: int) -> None:
        if ids[i] in seen:
            return
        seen.add(ids[i])
        ordered.append(findings[i])
        for j in effects.get(ids[i], ()):
            visit(j)

    roots = [i for i, f in enumerate(findings) if not any(c in by_id for c in f.caused_by)]
    for i in sorted(roots, key=lambda i: (-findings[i].severity.rank, findings[i].start_s, findings[i].kind)):
        visit(i)
    for i in by_time:
        visit(i)
    return ordered
