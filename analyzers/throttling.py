"""throttling: the GPU runs below its clocks because of heat or power, or runs too hot.

Definitions (per GPU, 1 s NVML samples):
- throttled: a heat or power clock-event reason is active (NVML's
  sw/hw thermal slowdown, sw power cap, hw slowdown, hw power brake; the
  benign reasons — idle, application clocks, sync boost, display — are not
  throttling) AND the SM clock is at most CLOCK_RATIO_THRESHOLD of its
  maximum (a reason flag at full clock costs nothing);
- hot: GPU core temperature above TEMPERATURE_THRESHOLD_C (SCENARIOS.md's
  golden signal for an infra board).

A finding is an episode of throttled or hot samples lasting at least
MIN_DURATION_S; critical when a hardware protection (hw_slowdown,
hw_thermal_slowdown, hw_power_brake_slowdown) cut the clocks.
"""

from __future__ import annotations

import numpy as np

from gpudiag.catalog import M
from gpudiag.findings import Evidence, Finding, Severity, alert_name
from gpudiag.frames import Rows, Window
from gpudiag.units import fmt_ratio

from .common import dict_flag, episodes, label_int, per_entity

KIND = "throttling"

HEAT_OR_POWER_REASONS = ("sw_power_cap", "hw_slowdown", "sw_thermal_slowdown", "hw_thermal_slowdown",
                         "hw_power_brake_slowdown")
# The hardware protecting itself halves clocks or more: work slows at once.
HARDWARE_REASONS = frozenset({"hw_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown"})
# Boost clocks dither a few percent under a power cap; a tenth below the
# maximum is where kernels measurably slow down.
CLOCK_RATIO_THRESHOLD = 0.9
# SCENARIOS.md, "five golden signals": GPU temperature > 85 C.
TEMPERATURE_THRESHOLD_C = 85.0
# A power cap for a few seconds of a burst is how boost works; a minute is a condition.
MIN_DURATION_S = 60.0
MERGE_GAP_S = 120.0
# Throttling is cured on the machine (cooling, power limits), not by a gpudiag repro fix.
FIX_NAMES: tuple[str, ...] = ()


def analyze(window: Window) -> list[Finding]:
    """Throttling and overheating episodes per GPU."""
    gpu = window.rows("gpu")
    if gpu.empty:
        return []
    findings = []
    every_row = _table_flags(gpu)
    for key, g in per_entity(gpu, ["node", "gpu"]):
        t = g["t"].to_numpy(float)
        reasons = _reasons(g) if every_row is None else _entity_reasons(every_row, g.positions)
        clock_ratio = _clock_ratio(g)
        temp = g[M.gpu_temperature_celsius].to_numpy(float) if M.gpu_temperature_celsius in g \
            else np.full(len(t), np.nan)
        active = np.zeros(len(t), dtype=bool)
        for flags in reasons.values():
            active |= flags
        # An unknown ratio (NaN) does not clear a flag: NVML sets it only while it limits clocks.
        throttled = active & ~(clock_ratio > CLOCK_RATIO_THRESHOLD)
        hot = temp > TEMPERATURE_THRESHOLD_C
        power = g[M.gpu_power_watts].to_numpy(float) if M.gpu_power_watts in g else None
        limit = g[M.gpu_power_limit_watts].to_numpy(float) if M.gpu_power_limit_watts in g else None
        for start, end in episodes(t, throttled | hot, MERGE_GAP_S, MIN_DURATION_S):
            # The samples are in time order: the episode is one slice of them.
            sel = slice(int(np.searchsorted(t, start, side="left")), int(np.searchsorted(t, end, side="right")))
            seen = sorted(r for r, flags in reasons.items() if (flags[sel] & throttled[sel]).any())
            hardware = bool(HARDWARE_REASONS & set(seen))
            ratios = clock_ratio[sel]
            known = ratios[np.isfinite(ratios)]
            clock_min = float(known.min()) if known.size else None
            temp_max = float(np.nanmax(temp[sel])) if np.isfinite(temp[sel]).any() else None
            what = []
            if seen:
                what.append(f"clocks throttled by {', '.join(seen)} " + (
                    f"down to {fmt_ratio(clock_min)} of maximum" if clock_min is not None
                    else "(SM clock against its maximum not exported)"))
            if temp_max is not None and temp_max > TEMPERATURE_THRESHOLD_C:
                what.append(f"temperature up to {temp_max:.0f} C")
            evidence = [
                Evidence("gpu_sm_clock_ratio", clock_min, 1.0, CLOCK_RATIO_THRESHOLD, "ratio"),
                Evidence(M.gpu_temperature_celsius, temp_max, None, TEMPERATURE_THRESHOLD_C, "celsius"),
                Evidence("throttled_seconds", float(throttled[sel].sum()), 0.0, MIN_DURATION_S, "seconds"),
            ]
            if power is not None and limit is not None:
                evidence.append(Evidence(M.gpu_power_watts, float(np.nanmax(power[sel])), None,
                                         float(np.nanmax(limit[sel])), "watts"))
            findings.append(Finding(
                kind=KIND, severity=Severity.CRITICAL if hardware else Severity.WARNING,
                start_s=float(start), end_s=float(end), node=key.get("node"), gpu=label_int(key.get("gpu")),
                summary=f"GPU {label_int(key.get('gpu'))} for {(end - start) / 60:.0f} min: " + "; ".join(what),
                evidence=evidence, runbook=alert_name(KIND), fixes=list(FIX_NAMES),
                details={"reasons": seen, "hardware_slowdown": hardware},
            ))
    return findings


def _reasons(g) -> dict[str, np.ndarray]:
    """Per heat/power reason, a mask of the samples in which it was active."""
    if M.gpu_clock_throttle_active not in g:
        return {}
    out = {}
    values = g[M.gpu_clock_throttle_active]
    for reason in HEAT_OR_POWER_REASONS:
        out[reason] = dict_flag(values, reason)
    return {r: m for r, m in out.items() if m.any()}


def _table_flags(gpu) -> dict[str, np.ndarray] | None:
    """:func:`_reasons` of every row of the window at once, None for rows other than a whole table.

    A flag is a function of its row alone, so each GPU's flags are its rows of these; the
    dicts are read once per reason instead of once per reason and GPU.
    """
    if not isinstance(gpu, Rows) or gpu.positions is not None:
        return None
    return _reasons(gpu)


def _entity_reasons(flags: dict[str, np.ndarray], positions: np.ndarray | None) -> dict[str, np.ndarray]:
    """:func:`_reasons` of one GPU's rows (at ``positions`` in the table, None: all) from :func:`_table_flags`."""
    out = {}
    for reason, mask in flags.items():  # reasons active nowhere in the window are already left out
        m = mask if positions is None else mask[positions]
        if m.any():
            out[reason] = m
    return out


def _clock_ratio(g) -> np.ndarray:
    """SM clock over its maximum per sample; NaN where either is not known (never a made-up 0)."""
    if M.gpu_sm_clock_hertz not in g or M.gpu_sm_clock_max_hertz not in g:
        return np.full(len(g), np.nan)
    clock = g[M.gpu_sm_clock_hertz].to_numpy(float)
    top = g[M.gpu_sm_clock_max_hertz].to_numpy(float)
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = clock / top
    return np.where(np.isfinite(ratio) & (top > 0), ratio, np.nan)
