"""gpu_cotenant: another process holds memory on the engine's GPU, and the engine's KV pool shrank for it.

Definitions (per GPU, over 1 s samples):
- the engine's process: the pid of the engine rows when they carry one,
  else the process on that GPU whose name is the engine's name, else the
  one with an in-process allocator reporter (torch columns);
- a co-tenant: any other pid on that GPU whose driver-charged memory
  (NVML per-process used memory) is at least COTENANT_MIN_RATIO of the
  device (a monitoring agent's CUDA context is not one);
- nominal KV capacity: ``engine_kv_capacity_nominal_bytes`` of the engine row when
  the deployment states it, else the larger of the highest
  engine_kv_capacity_bytes of the window and the capacity plus the
  co-tenants' memory (an engine sizes its KV pool from the free memory it
  finds at start, so whatever a co-tenant holds is missing from it).

A finding covers the samples with a co-tenant present while KV capacity is at
most KV_BELOW_NOMINAL_RATIO of nominal; critical below KV_CRITICAL_RATIO.
The chain assembler puts it ahead of the eviction storm and latency
regression it causes on the same GPU.
"""

from __future__ import annotations

import numpy as np

from gpudiag.catalog import M
from gpudiag.findings import Evidence, Finding, Severity, alert_name
from gpudiag.frames import Window
from gpudiag.units import fmt_bytes

from .common import episodes, label_int, per_entity, subset

KIND = "gpu_cotenant"

NOMINAL_KV_KEY = M.engine_kv_capacity_nominal_bytes
# A twentieth of the device: more than a CUDA context plus library
# workspaces (a few hundred MiB), less than any real workload.
COTENANT_MIN_RATIO = 0.05
# A fifth of the KV pool gone is felt as preemptions under peak load.
KV_BELOW_NOMINAL_RATIO = 0.8
# Half of it gone: the engine pages constantly and first requests time out (SCENARIOS.md §4).
KV_CRITICAL_RATIO = 0.5
MERGE_GAP_S = 60.0
# A process that holds memory for less than a minute is a probe or a health check.
MIN_DURATION_S = 60.0
FIX_NAMES = ("dedicated-gpu",)


def analyze(window: Window) -> list[Finding]:
    """Co-tenant processes on an engine's GPU, with the KV capacity they cost it."""
    proc, eng, gpu = window.rows("process"), window.rows("engine"), window.rows("gpu")
    if proc.empty or eng.empty or not window.has("process", M.process_gpu_memory_bytes) \
            or not window.has("engine", M.engine_kv_capacity_bytes):
        return []
    findings = []
    for key, e in per_entity(eng, ["node", "gpu"]):
        procs = subset(proc, key)
        procs = procs[procs[M.process_gpu_memory_bytes].notna()] if not procs.empty else procs
        if procs.empty or "pid" not in procs:
            continue
        engine_pid = _engine_pid(e, procs)
        total = _device_bytes(gpu, key)
        min_bytes = COTENANT_MIN_RATIO * total if total else COTENANT_MIN_RATIO * 80 * 1024**3
        others = procs[procs["pid"] != engine_pid] if engine_pid is not None else procs
        others = others[others[M.process_gpu_memory_bytes] >= min_bytes]
        if others.empty:
            continue
        held = others.groupby("t")[M.process_gpu_memory_bytes].sum()
        t = e["t"].to_numpy(float)
        kv = e[M.engine_kv_capacity_bytes].to_numpy(float)
        cot = held.reindex(t, method="nearest", tolerance=2.0).to_numpy(float)
        cot = np.nan_to_num(cot)
        nominal = _nominal(e, kv, cot)
        ratio = np.where(nominal > 0, kv / np.maximum(nominal, 1.0), 1.0)
        mask = (cot > 0) & (ratio <= KV_BELOW_NOMINAL_RATIO)
        for start, end in episodes(t, mask, MERGE_GAP_S, MIN_DURATION_S):
            sel = (t >= start) & (t <= end)
            inside = others[(others["t"] >= start) & (others["t"] <= end)]
            top = inside.groupby("pid")[M.process_gpu_memory_bytes].max().sort_values(ascending=False)
            pid = int(top.index[0])
            name = _name(inside, pid)
            worst = float(ratio[sel].min())
            i = int(np.argmin(np.where(sel, ratio, np.inf)))
            findings.append(Finding(
                kind=KIND, severity=Severity.CRITICAL if worst <= KV_CRITICAL_RATIO else Severity.WARNING,
                start_s=float(start), end_s=float(end), node=key.get("node"), gpu=label_int(key.get("gpu")),
                pid=pid,
                summary=(f"pid {pid}{f' ({name})' if name else ''} holds {fmt_bytes(top.iloc[0])} on the engine's "
                         f"GPU {label_int(key.get('gpu'))}; KV capacity {fmt_bytes(kv[i])} vs "
                         f"{fmt_bytes(nominal[i])} nominal ({worst:.0%})"),
                evidence=[
                    Evidence("cotenant_gpu_memory_bytes", float(cot[sel].max()), 0.0, min_bytes, "bytes"),
                    Evidence(M.engine_kv_capacity_bytes, float(kv[i]), float(nominal[i]),
                             KV_BELOW_NOMINAL_RATIO * float(nominal[i]), "bytes"),
                    Evidence("kv_capacity_of_nominal_ratio", worst, 1.0, KV_BELOW_NOMINAL_RATIO, "ratio"),
                ],
                runbook=alert_name(KIND), fixes=list(FIX_NAMES),
                details={"cotenant_pids": [int(p) for p in top.index], "engine_pid": engine_pid,
                         "nominal_kv_capacity_bytes": float(nominal[i]), "nominal_source": _source(e)},
            ))
    return findings


def _engine_pid(e, procs):
    if "pid" in e and e["pid"].notna().any():
        return int(e["pid"].dropna().iloc[-1])
    if "engine" in e and "process" in procs:
        names = set(e["engine"].dropna().astype(str))
        hit = procs[procs["process"].astype(str).isin(names)]
        if not hit.empty:
            return int(hit["pid"].iloc[-1])
    for col in (M.process_torch_reserved_bytes, M.process_torch_allocated_bytes):
        if col in procs and procs[col].notna().any():
            return int(procs[procs[col].notna()]["pid"].iloc[-1])
    return None


def _device_bytes(gpu, key) -> float | None:
    g = subset(gpu, key)
    if g.empty or M.gpu_memory_total_bytes not in g or g[M.gpu_memory_total_bytes].isna().all():
        return None
    return float(g[M.gpu_memory_total_bytes].max())


def _nominal(e, kv, cot) -> np.ndarray:
    if NOMINAL_KV_KEY in e and e[NOMINAL_KV_KEY].notna().any():
        return np.full(len(kv), float(e[NOMINAL_KV_KEY].dropna().iloc[-1]))
    return np.maximum(np.nanmax(kv), kv + cot)


def _source(e) -> str:
    if NOMINAL_KV_KEY in e and e[NOMINAL_KV_KEY].notna().any():
        return f"stated by the engine ({NOMINAL_KV_KEY})"
    return "highest KV capacity in the window, or capacity plus the co-tenants' memory"


def _name(df, pid):
    if "process" not in df:
        return None
    names = df[df["pid"] == pid]["process"].dropna()
    return str(names.iloc[-1]) if not names.empty else None
