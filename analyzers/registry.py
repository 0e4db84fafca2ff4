"""Every analyzer over a window, in one call, chain-assembled; and what each needs to run.

Every path that analyzes a window (``run_all``: ``gpudiag repro`` and
``gpudiag investigate``; ``run_streaming``: the agent) ends in :func:`conclude`:
the findings' spans are kept within the window's samples, those still going at
its end are flagged open, and the chain is assembled on the window's sampling
step. :func:`coverage` says which analyzers could judge a window, on how much
data, and which could not and why (REQUIRES, MIN_SPAN_S, SYMPTOMS).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from gpudiag.catalog import M
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
    pod_labels,
    prefix_cache_thrash,
    queue_avalanche,
    throttling,
)
from .common import WindowClock, clamp_to_window, window_clock

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

# --- what each analyzer needs ----------------------------------------------------------------------

# One input an analyzer cannot do without: any one of these (frame kind, column) pairs will do.
Need = tuple[tuple[str, str], ...]

# Per analyzer, every input it cannot find anything without (each a Need), as its analyze()
# reads them: a window lacking one could not be judged by it, whatever it holds. Optional
# evidence (a TPOT baseline beside a storm, load beside a leak) is left out.
REQUIRES: dict[str, tuple[Need, ...]] = {
    memory_fragmentation.KIND: (
        (("process", M.process_torch_reserved_bytes),),
        (("process", M.process_torch_largest_free_block_bytes),),
        # The size of the failed request: what no hole could hold.
        (("engine", M.engine_kv_failed_request_bytes),),
    ),
    kv_eviction_storm.KIND: (
        (("engine", M.engine_kv_evictions_total), ("engine", M.num_preemptions_total)),
    ),
    oom_forecast.KIND: (
        (("gpu", M.gpu_memory_total_bytes),),
        (("process", M.process_torch_reserved_bytes), ("process", M.process_gpu_memory_bytes)),
    ),
    memory_leak.KIND: (
        (("process", M.process_gpu_memory_bytes), ("process", M.process_torch_allocated_bytes)),
    ),
    cpu_starved_gpu.KIND: (
        (("gpu", M.gpu_utilization_ratio),),
        # A host-bound process: its busiest thread, or (eBPF) its run-queue wait or off-CPU time.
        (("process", M.process_thread_cpu_max_ratio), ("cuda_api", M.host_runqueue_wait_seconds_total),
         ("cuda_api", M.host_offcpu_seconds_total)),
    ),
    gpu_cotenant.KIND: (
        (("process", M.process_gpu_memory_bytes),),
        (("engine", M.engine_kv_capacity_bytes),),
    ),
    degenerate_kernel_launch.KIND: (
        (("cuda_api", M.cuda_function_grid_blocks), ("cuda_api", M.cuda_degenerate_launches_total)),
    ),
    throttling.KIND: (
        (("gpu", M.gpu_clock_throttle_active), ("gpu", M.gpu_temperature_celsius)),
    ),
    hardware_errors.KIND: (
        (("gpu", M.gpu_xid_errors_total), ("gpu", M.gpu_ecc_errors_total), ("gpu", M.gpu_retired_pages_total),
         ("gpu", M.gpu_remapped_rows_total), ("gpu", M.gpu_nvlink_errors_total), ("gpu", M.gpu_pcie_replay_total),
         ("gpu", M.gpu_lost)),
    ),
    queue_avalanche.KIND: (
        (("engine", M.engine_requests_timed_out_total), ("engine", M.engine_restarts_total)),
    ),
    prefix_cache_thrash.KIND: (
        (("engine", M.engine_prefix_cache_recomputed_tokens_total),),
        (("engine", M.prefix_cache_queries_total),),
    ),
    latency_regression.KIND: (
        # Finished requests, or the engine's latency histograms (each interval's summary).
        tuple((kind, column) for column in latency_regression.LATENCIES for kind in ("request", "engine")),
    ),
}

# Per analyzer, the shortest span of its inputs in which it can find anything: an episode's least
# duration, a trend's least span (taken from each analyzer's own constant, with its reason there).
# Analyzers of single events (a failed allocation, an error counter's rise, a launch) need none.
MIN_SPAN_S: dict[str, float] = {
    kv_eviction_storm.KIND: kv_eviction_storm.MIN_DURATION_S,
    oom_forecast.KIND: oom_forecast.MIN_TREND_SPAN_S,
    # A leak is a trend of oom_forecast.rising_slope: the same least span.
    memory_leak.KIND: oom_forecast.MIN_TREND_SPAN_S,
    cpu_starved_gpu.KIND: cpu_starved_gpu.MIN_DURATION_S,
    gpu_cotenant.KIND: gpu_cotenant.MIN_DURATION_S,
    throttling.KIND: throttling.MIN_DURATION_S,
    queue_avalanche.KIND: queue_avalanche.MIN_DURATION_S,
    prefix_cache_thrash.KIND: prefix_cache_thrash.MIN_DURATION_S,
    latency_regression.KIND: latency_regression.MIN_SPAN_S,
}
# Where each MIN_SPAN_S comes from, to name it in a report.
MIN_SPAN_SOURCE: dict[str, str] = {
    kv_eviction_storm.KIND: "kv_eviction_storm.MIN_DURATION_S",
    oom_forecast.KIND: "oom_forecast.MIN_TREND_SPAN_S",
    memory_leak.KIND: "oom_forecast.MIN_TREND_SPAN_S",
    cpu_starved_gpu.KIND: "cpu_starved_gpu.MIN_DURATION_S",
    gpu_cotenant.KIND: "gpu_cotenant.MIN_DURATION_S",
    throttling.KIND: "throttling.MIN_DURATION_S",
    queue_avalanche.KIND: "queue_avalanche.MIN_DURATION_S",
    prefix_cache_thrash.KIND: "prefix_cache_thrash.MIN_DURATION_S",
    latency_regression.KIND: "latency_regression.MIN_SPAN_S",
}


@dataclass(frozen=True)
class Symptom:
    """Something a user asks about a window, what measures it, and the analyzers that judge it."""

    name: str
    needs: Need  # any one of these measures it
    analyzers: tuple[str, ...]


_TTFT, _TPOT = M.time_to_first_token_seconds, M.inter_token_latency_seconds
SYMPTOMS = (
    Symptom("time to first token", (("request", _TTFT), ("engine", _TTFT)), (latency_regression.KIND,)),
    Symptom("decode latency (TPOT)", (("request", _TPOT), ("engine", _TPOT)),
            (latency_regression.KIND, kv_eviction_storm.KIND)),
    Symptom("KV cache evictions", REQUIRES[kv_eviction_storm.KIND][0], (kv_eviction_storm.KIND,)),
    Symptom("allocator fragmentation", REQUIRES[memory_fragmentation.KIND][1], (memory_fragmentation.KIND,)),
    Symptom("memory growth and OOM risk", REQUIRES[memory_leak.KIND][0], (memory_leak.KIND, oom_forecast.KIND)),
    Symptom("GPU shared with another process", REQUIRES[gpu_cotenant.KIND][0], (gpu_cotenant.KIND,)),
    Symptom("GPU starved by its host", REQUIRES[cpu_starved_gpu.KIND][1], (cpu_starved_gpu.KIND,)),
    Symptom("kernel launch shapes", REQUIRES[degenerate_kernel_launch.KIND][0], (degenerate_kernel_launch.KIND,)),
    Symptom("clocks and temperature", REQUIRES[throttling.KIND][0], (throttling.KIND,)),
    Symptom("hardware errors", REQUIRES[hardware_errors.KIND][0], (hardware_errors.KIND,)),
    Symptom("request queue and timeouts", REQUIRES[queue_avalanche.KIND][0], (queue_avalanche.KIND,)),
    Symptom("prefix cache reuse", REQUIRES[prefix_cache_thrash.KIND][0], (prefix_cache_thrash.KIND,)),
)

MISSING_INPUT, TOO_SHORT = "missing_input", "too_short"


def _missing_text(need: Need) -> str:
    """'no a or b in engine rows' / 'no a in process rows or b in cuda_api rows'."""
    kinds = list(dict.fromkeys(kind for kind, _ in need))
    columns = list(dict.fromkeys(column for _, column in need))
    if len(kinds) == 1:
        return f"no {' or '.join(columns)} in {kinds[0]} rows"
    if len(columns) == 1:
        return f"no {columns[0]} in {' or '.join(kinds)} rows"
    return "no " + " or ".join(f"{column} in {kind} rows" for kind, column in need)


def coverage(window: Window, clock: WindowClock | None = None) -> dict[str, Any]:
    """What could be judged in ``window``: per analyzer, the inputs it read (rows and seconds of their
    frame kind) or why it could not run (an input missing, or the inputs' span shorter than its
    MIN_SPAN_S); the symptoms no analyzer could judge; ``conclusive`` when every analyzer ran.

    A JSON-ready dict: ``{"conclusive", "first_s", "last_s", "step_s", "ran": [{"analyzer",
    "inputs": [{"kind", "column", "rows", "seconds"}]}], "not_run": [{"analyzer", "reason",
    "missing", "detail"}], "unjudged": [{"symptom", "detail"}]}``.
    """
    clock = clock or window_clock(window)
    ran, not_run = [], []
    blind: dict[str, str] = {}
    for kind in ANALYZERS:
        inputs, missing = [], []
        for need in REQUIRES.get(kind, ()):
            have = next(((k, c) for k, c in need if k in clock.kinds and window.has(k, c)), None)
            if have is None:
                missing.append(need)
            else:
                span = clock.kinds[have[0]]
                inputs.append({"kind": have[0], "column": have[1], "rows": span.rows, "seconds": span.seconds})
        if missing:
            detail = "; ".join(_missing_text(need) for need in missing)
            not_run.append({"analyzer": kind, "reason": MISSING_INPUT,
                            "missing": [[{"kind": k, "column": c} for k, c in need] for need in missing],
                            "detail": detail})
            blind[kind] = detail
            continue
        least = MIN_SPAN_S.get(kind, 0.0)
        held = min((i["seconds"] for i in inputs), default=clock.last_s - clock.first_s)
        if held < least:
            detail = (f"window too short: {kind} needs {least:.0f} s of data ({MIN_SPAN_SOURCE[kind]}), "
                      f"its inputs span {held:.0f} s")
            not_run.append({"analyzer": kind, "reason": TOO_SHORT, "missing": [], "detail": detail,
                            "needs_s": least, "held_s": held})
            blind[kind] = detail
            continue
        ran.append({"analyzer": kind, "inputs": inputs})
    unjudged = []
    for symptom in SYMPTOMS:
        if not any(k in clock.kinds and window.has(k, c) for k, c in symptom.needs):
            unjudged.append({"symptom": symptom.name, "detail": _missing_text(symptom.needs)})
        elif all(a in blind for a in symptom.analyzers):
            unjudged.append({"symptom": symptom.name,
                             "detail": "; ".join(f"{a}: {blind[a]}" for a in symptom.analyzers)})
    return {"conclusive": not not_run, "first_s": clock.first_s, "last_s": clock.last_s, "step_s": clock.step_s,
            "ran": ran, "not_run": not_run, "unjudged": unjudged}


# --- running them ------------------------------------------------------------------------------------


def conclude(window: Window, findings: list[Finding], clock: WindowClock | None = None) -> list[Finding]:
    """Every analysis' last step: spans kept within the window's samples, the findings still going at
    its last sample flagged open (common.clamp_to_window), the chain assembled on its sampling step."""
    clock = clock or window_clock(window)
    return chain.assemble(pod_labels.attribute(window, clamp_to_window(findings, clock)), clock.step_s)


def run_all(window: Window) -> list[Finding]:
    """Run every analyzer over ``window`` and return the findings, root causes first."""
    findings: list[Finding] = []
    for analyze in ANALYZERS.values():
        findings.extend(analyze(window))
    return conclude(window, findings)


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
    return conclude(window, findings)
