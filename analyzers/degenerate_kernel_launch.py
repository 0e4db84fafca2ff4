"""degenerate_kernel_launch: a kernel launched with far too few blocks runs many times slower.

Input: ``cuda_api`` rows (eBPF launch probes, or the simulated GPU) of two shapes.

- per process (no ``api``, no ``function``): ``cuda_kernel_launches_total``
  and ``cuda_degenerate_launches_total`` (launches with grid (1,1,1)), as
  the eBPF probe's frames give them;
- per kernel function (a ``function`` label): cumulative
  ``cuda_function_launches_total``; ``cuda_function_grid_blocks``, the blocks
  per launch (grid x*y*z) of the interval's launches (median); and, when a
  source measures it, ``cuda_function_duration_seconds``, the mean GPU time
  per launch in the interval. Any of these may be absent.

A function's launches are degenerate when its blocks per launch are 1 or at
most 1/GRID_DROP_RATIO of its usual blocks (the launch-weighted median over
the window of its launches wider than one block), AND they are slow: a duration at least DURATION_RATIO times the
usual one, or, when the window holds no normal launch to compare with, a
single block running for at least LONG_SINGLE_BLOCK_S. Without per-function
rows, the per-process counter alone gives a warning when grid (1,1,1)
launches are at least DEGENERATE_SHARE of all launches and number at least
MIN_DEGENERATE_LAUNCHES (durations unknown: the finding says so).

The slowdown a finding reports (``slowdown_ratio``) is the median GPU time per
degenerate launch over the usual time per normal launch, both in the window.
It is a time per launch, not per unit of work: when the slow kernel slows the
engine, batches grow and each launch does more, so it exceeds the kernel's
slowdown for the same work and grows as the window takes in more of the
incident.

Rows carry pid, not GPU: the GPU is taken from the process rows of that pid.
"""

from __future__ import annotations

import numpy as np

from gpudiag.catalog import M
from gpudiag.findings import Evidence, Finding, Severity, alert_name
from gpudiag.frames import Window
from gpudiag.units import fmt_seconds

from .common import counter_increase, label_int, per_entity

KIND = "degenerate_kernel_launch"

# Sixteen times fewer blocks than usual cannot fill an A100's 108 SMs for a
# kernel whose grid normally does: a launch configuration bug, not tuning.
GRID_DROP_RATIO = 16.0
# Four times the usual duration is a regression no input change explains;
# the field report's kernel ran about 40x slower.
DURATION_RATIO = 4.0
# One block on one SM for a millisecond leaves the rest of the GPU idle;
# legitimate single-block kernels (scalar reductions, bookkeeping) take microseconds.
LONG_SINGLE_BLOCK_S = 1e-3
# Per-process counter only: a few single-block launches are normal
# bookkeeping; a twentieth of all launches, by the hundred, is not.
DEGENERATE_SHARE = 0.05
MIN_DEGENERATE_LAUNCHES = 100
FIX_NAMES = ("correct-grid",)


def analyze(window: Window) -> list[Finding]:
    """Degenerate launches per process (and kernel function, where rows name it)."""
    api = window.rows("cuda_api")
    if api.empty or "pid" not in api:
        return []
    gpu_of = _gpu_of_pid(window.rows("process"))
    findings = []
    functions = api[api["function"].notna()] if "function" in api else api.iloc[:0]
    plain = api[api["function"].isna()] if "function" in api else api
    if "api" in plain:
        plain = plain[plain["api"].isna()]
    for key, f in per_entity(functions, ["node", "pid", "function"]):
        finding = _function_finding(key, f, gpu_of)
        if finding is not None:
            findings.append(finding)
    if functions.empty:
        for key, p in per_entity(plain, ["node", "pid"]):
            finding = _counter_finding(key, p, gpu_of)
            if finding is not None:
                findings.append(finding)
    return findings


def may_find(window: Window) -> bool:
    """False only when :func:`analyze` is sure to find nothing in ``window``: no row has grid sizes or a
    degenerate-launch count (the always-on eBPF probes do not hook launches); the agent's streaming
    analysis skips the analyzer then."""
    return window.has("cuda_api", M.cuda_function_grid_blocks) \
        or window.has("cuda_api", M.cuda_degenerate_launches_total)


def _function_finding(key, f, gpu_of) -> Finding | None:
    if M.cuda_function_grid_blocks not in f or f[M.cuda_function_grid_blocks].isna().all():
        return None
    t = f["t"].to_numpy(float)
    blocks = f[M.cuda_function_grid_blocks].to_numpy(float)
    launches = _interval_launches(f, len(t))
    duration = f[M.cuda_function_duration_seconds].to_numpy(float) if M.cuda_function_duration_seconds in f \
        else np.full(len(t), np.nan)
    wide = blocks > 1
    usual_blocks = _weighted_median(blocks[wide], launches[wide]) if wide.any() else 1.0
    small = (blocks <= 1) | (blocks <= usual_blocks / GRID_DROP_RATIO)
    normal = ~small & ~np.isnan(blocks)
    usual_duration = _weighted_median(duration[normal], launches[normal]) if normal.any() else float("nan")
    if not np.isnan(usual_duration):
        slow = duration >= DURATION_RATIO * usual_duration
    else:
        slow = (blocks <= 1) & (duration >= LONG_SINGLE_BLOCK_S)
    bad = small & slow & (launches > 0)
    if not bad.any():
        return None
    n_bad = float(launches[bad].sum())
    d_bad = float(np.nanmedian(duration[bad]))
    slowdown = d_bad / usual_duration if usual_duration and not np.isnan(usual_duration) else float("nan")
    b_bad = float(np.nanmin(blocks[bad]))
    name = str(key.get("function"))
    pid = label_int(key.get("pid"))
    grid = "(1,1,1)" if b_bad <= 1 else f"{b_bad:.0f} blocks"
    usual = f"{usual_blocks:.0f} blocks usually" if normal.any() else "no normal launch in the window"
    return Finding(
        kind=KIND, severity=Severity.CRITICAL, start_s=float(t[bad][0]), end_s=float(t[bad][-1]),
        node=key.get("node"), gpu=gpu_of.get((key.get("node"), pid), gpu_of.get((None, pid))), pid=pid,
        summary=(f"{name} launched with grid {grid} ({usual}) {n_bad:.0f} times, {fmt_seconds(d_bad)} per launch"
                 + (f" against {fmt_seconds(usual_duration)} per normal launch in this window ({slowdown:.0f}x the "
                    f"time per launch, more work per launch included)" if not np.isnan(slowdown) else "")),
        evidence=[
            Evidence(M.cuda_function_grid_blocks, b_bad, usual_blocks if normal.any() else None,
                     usual_blocks / GRID_DROP_RATIO if normal.any() else 1.0, ""),
            Evidence(M.cuda_function_duration_seconds, d_bad,
                     None if np.isnan(usual_duration) else usual_duration,
                     DURATION_RATIO * usual_duration if not np.isnan(usual_duration) else LONG_SINGLE_BLOCK_S,
                     "seconds"),
            Evidence(M.cuda_function_launches_total, n_bad, 0.0, None, ""),
        ],
        runbook=alert_name(KIND), fixes=list(FIX_NAMES),
        details={"function": name, "degenerate_launches": n_bad, "slowdown_ratio": slowdown},
    )


def _counter_finding(key, p, gpu_of) -> Finding | None:
    if M.cuda_degenerate_launches_total not in p or p[M.cuda_degenerate_launches_total].isna().all():
        return None
    t = p["t"].to_numpy(float)
    degenerate = p[M.cuda_degenerate_launches_total].to_numpy(float)
    n_deg = counter_increase(degenerate)
    n_all = counter_increase(p[M.cuda_kernel_launches_total].to_numpy(float)) \
        if M.cuda_kernel_launches_total in p else float("nan")
    share = n_deg / n_all if n_all and n_all > 0 else float("nan")
    if n_deg < MIN_DEGENERATE_LAUNCHES or not share >= DEGENERATE_SHARE:
        return None
    rose = np.flatnonzero(np.nan_to_num(np.diff(degenerate, prepend=degenerate[:1])) > 0)
    pid = label_int(key.get("pid"))
    return Finding(
        kind=KIND, severity=Severity.WARNING, start_s=float(t[rose[0]]), end_s=float(t[rose[-1]]),
        node=key.get("node"), gpu=gpu_of.get((key.get("node"), pid), gpu_of.get((None, pid))), pid=pid,
        summary=(f"pid {pid} launched {n_deg:.0f} kernels with grid (1,1,1), {share:.0%} of its launches; "
                 "durations not measured: see which function with `gpudiag probe cuda`"),
        evidence=[
            Evidence(M.cuda_degenerate_launches_total, n_deg, 0.0, MIN_DEGENERATE_LAUNCHES, ""),
            Evidence("degenerate_launch_share_ratio", share, 0.0, DEGENERATE_SHARE, "ratio"),
        ],
        runbook=alert_name(KIND), fixes=list(FIX_NAMES),
        details={"degenerate_launches": n_deg, "durations": "not measured"},
    )


def _interval_launches(f, n) -> np.ndarray:
    """Launches per row from the cumulative per-function counter (1 per row when it is absent)."""
    if M.cuda_function_launches_total not in f or f[M.cuda_function_launches_total].isna().all():
        return np.ones(n)
    c = f[M.cuda_function_launches_total].to_numpy(float)
    inc = np.diff(c, prepend=c[:1])
    return np.nan_to_num(np.where(inc < 0, c, inc))


def _weighted_median(x: np.ndarray, w: np.ndarray) -> float:
    ok = ~np.isnan(x) & (w > 0)
    if not ok.any():
        return float("nan")
    order = np.argsort(x[ok])
    xs, ws = x[ok][order], w[ok][order]
    cum = np.cumsum(ws)
    return float(xs[np.searchsorted(cum, cum[-1] / 2.0)])


def _gpu_of_pid(proc) -> dict:
    """(node, pid) -> GPU index from the process rows (also (None, pid) for rows without a node)."""
    if proc.empty or "pid" not in proc or "gpu" not in proc:
        return {}
    out = {}
    rows = proc[["pid", "gpu"] + (["node"] if "node" in proc else [])].dropna(subset=["pid", "gpu"])
    rows = rows.drop_duplicates()
    pids, gpus = rows["pid"].tolist(), rows["gpu"].tolist()
    nodes = rows["node"].tolist() if "node" in rows else [None] * len(pids)
    for node, pid, gpu in zip(nodes, pids, gpus):
        out.setdefault((node, int(pid)), int(gpu))
        out.setdefault((None, int(pid)), int(gpu))
    return out
