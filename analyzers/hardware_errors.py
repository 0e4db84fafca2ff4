"""hardware_errors: the GPU, its memory or its links report errors that keep coming.

Definitions (per GPU, NVML counters, cumulative as the NVML probe gives them):
- XID events by code (``gpu_xid_errors_total`` {code: count});
- ECC errors, corrected and uncorrected (``gpu_ecc_errors_total``
  {scope: {kind: count}}; the volatile scope when present, since the
  aggregate one also holds counts from before the last driver load);
- retired pages and remapped rows (the memory repairing itself);
- NVLink error counters by kind and the PCIe replay counter (a link
  retransmitting: P99 up with P50 normal, SCENARIOS.md's quick lookup);
- a GPU that fell off the bus (``gpu_lost``).

"Rising" is the counter's increase over the window (a reset restarts it).
One finding per GPU spans the first to the last sample at which any counter
rose; critical for uncorrected ECC, a lost GPU, an uncorrectable row remap
or an XID of CRITICAL_XIDS, else warning.
"""

from __future__ import annotations

import numpy as np

from gpudiag.catalog import M
from gpudiag.findings import Evidence, Finding, Severity, alert_name
from gpudiag.frames import Window

from .common import (
    constant_per_entity,
    counter_increase,
    dict_keys,
    dict_total,
    label_int,
    labelled_total,
    only_zeros,
    per_entity,
)

KIND = "hardware_errors"

# NVIDIA's XID catalog: codes that mean the GPU needs a reset or a
# replacement (double-bit ECC 48, internal micro-controller 61/62, row-remap
# failure 64, NVLink 74, fallen off the bus 79, uncontained ECC 95, GSP
# 119/120). Others (13, 31, 43: faults of the application) are warnings.
CRITICAL_XIDS = frozenset({"48", "61", "62", "64", "74", "79", "95", "119", "120"})
# Corrected ECC errors happen on healthy HBM; a hundred within one window is
# the rate at which NVIDIA's page retirement starts acting.
CORRECTED_ECC_THRESHOLD = 100
# A link retrains and retransmits now and then; ten in one window is a link
# that keeps doing it.
NVLINK_ERRORS_THRESHOLD = 10
PCIE_REPLAY_THRESHOLD = 10
# Hardware is fixed on the machine (reset, drain, RMA), not by a gpudiag repro fix.
FIX_NAMES: tuple[str, ...] = ()


def analyze(window: Window) -> list[Finding]:
    """Rising hardware error counters per GPU."""
    gpu = window.rows("gpu")
    if gpu.empty:
        return []
    findings = []
    for key, g in per_entity(gpu, ["node", "gpu"]):
        t = g["t"].to_numpy(float)
        rises: list[tuple[str, float, float | None, bool]] = []  # metric, increase, threshold, critical
        rose_at = np.zeros(len(t), dtype=bool)

        def check(metric, series, threshold, critical, rises=rises, rose_at=rose_at):
            _rise(rises, rose_at, metric, series, threshold, critical)

        for code, series in _by_label(g, M.gpu_xid_errors_total).items():
            check(f"{M.gpu_xid_errors_total}{{xid={code}}}", series, None, code in CRITICAL_XIDS)
        ecc = _ecc(g)
        if ecc is not None:
            check(f"{M.gpu_ecc_errors_total}{{kind=uncorrected}}", ecc["uncorrected"], None, True)
            check(f"{M.gpu_ecc_errors_total}{{kind=corrected}}", ecc["corrected"], CORRECTED_ECC_THRESHOLD, False)
        if M.gpu_retired_pages_total in g:
            check(M.gpu_retired_pages_total, labelled_total(g[M.gpu_retired_pages_total]), None, False)
        remap = _by_label(g, M.gpu_remapped_rows_total)
        if "uncorrectable" in remap:
            check(f"{M.gpu_remapped_rows_total}{{kind=uncorrectable}}", remap["uncorrectable"], None, True)
        if "correctable" in remap:
            check(f"{M.gpu_remapped_rows_total}{{kind=correctable}}", remap["correctable"], None, False)
        if M.gpu_nvlink_errors_total in g:
            check(M.gpu_nvlink_errors_total, labelled_total(g[M.gpu_nvlink_errors_total]),
                  NVLINK_ERRORS_THRESHOLD, False)
        if M.gpu_pcie_replay_total in g:
            check(M.gpu_pcie_replay_total, g[M.gpu_pcie_replay_total].to_numpy(float), PCIE_REPLAY_THRESHOLD, False)
        if M.gpu_lost in g:
            lost = g[M.gpu_lost].to_numpy(float) == 1
            if lost.any():
                rises.append((M.gpu_lost, 1.0, None, True))
                rose_at |= lost
        if not rises:
            continue
        when = t[rose_at] if rose_at.any() else t
        critical = any(c for *_, c in rises)
        words = ", ".join(f"{m} +{inc:.0f}" for m, inc, *_ in rises)
        findings.append(Finding(
            kind=KIND, severity=Severity.CRITICAL if critical else Severity.WARNING,
            start_s=float(when[0]), end_s=float(when[-1]), node=key.get("node"), gpu=label_int(key.get("gpu")),
            summary=f"GPU {label_int(key.get('gpu'))} hardware errors rising: {words}",
            evidence=[Evidence(m, inc, 0.0, thr, "") for m, inc, thr, _ in rises],
            runbook=alert_name(KIND), fixes=list(FIX_NAMES),
            details={"counters": {m: inc for m, inc, *_ in rises}},
        ))
    return findings


# Every counter analyze reads; one that holds one value per GPU over the window has not risen.
_COUNTERS = (M.gpu_xid_errors_total, M.gpu_ecc_errors_total, M.gpu_retired_pages_total, M.gpu_remapped_rows_total,
             M.gpu_nvlink_errors_total, M.gpu_pcie_replay_total)


def may_find(window: Window) -> bool:
    """False only when :func:`analyze` is sure to find nothing in ``window``: no error counter moved, no GPU lost.

    A finding needs a counter that rose within one GPU's samples (a code or a kind that
    appears counts from 0, so a row whose keys differ from the one before counts as a
    move) or a lost GPU. A healthy node's counters hold still for days, the aggregate ECC
    counts of a GPU's past included; the agent's streaming analysis skips the analyzer then.
    """
    if window.rows("gpu").empty:
        return False
    if not only_zeros(window, "gpu", M.gpu_lost):
        return True
    return not all(constant_per_entity(window, "gpu", ("node", "gpu"), column) for column in _COUNTERS)


def _rise(rises, rose_at, metric, series, threshold, critical) -> None:
    """Record a counter that rose by at least ``threshold`` (any rise for a critical one or no threshold)."""
    inc = counter_increase(series)
    if inc <= 0 or not (threshold is None or inc >= threshold or critical):
        return
    rises.append((metric, inc, threshold, critical))
    rose_at |= np.nan_to_num(np.diff(series, prepend=series[:1])) != 0


def _by_label(g, column) -> dict[str, np.ndarray]:
    """A labelled counter split by its first label: {label value: series} (NaN where a row lacks it)."""
    if column not in g:
        return {}
    values = g[column]
    out = {}
    for label in dict_keys(values):
        # A code missing from a row's dict has not occurred yet: 0, not "not measured".
        out[label] = dict_total(values, label, default=0.0)
    return out


def _ecc(g) -> dict[str, np.ndarray] | None:
    if M.gpu_ecc_errors_total not in g:
        return None
    values = g[M.gpu_ecc_errors_total]
    scope = "volatile" if "volatile" in dict_keys(values) else "aggregate"
    return {kind: dict_total(values, scope, kind) for kind in ("corrected", "uncorrected")}
