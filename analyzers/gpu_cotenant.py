"""gpu_cotenant: another process holds memory on the engine's GPU, and the engine's KV pool shrank for it.

Definitions (per GPU, over 1 s samples):
- the engine's process: the pids the engine rows carry (every one of them,
  so an engine that restarted in the window is not its own co-tenant; the
  last is the one reported), else the process on that GPU whose name is the
  engine's name (analyzers.common.engine_identity, as memory_leak and
  oom_forecast read it), else the one with an in-process allocator reporter
  (torch columns);
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
from gpudiag.frames import Rows, Window
from gpudiag.units import fmt_bytes

from .common import engine_identity, episodes, label_int, per_entity, subset

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
            or not window.has("engine", M.engine_kv_capacity_bytes) or "pid" not in proc:
        return []
    on_gpu = _on_gpu(proc)
    findings = []
    for key, e in per_entity(eng, ["node", "gpu"]):
        procs = _processes(on_gpu, key)
        if not procs:
            continue
        total = _device_bytes(gpu, key)
        min_bytes = COTENANT_MIN_RATIO * total if total else COTENANT_MIN_RATIO * 80 * 1024**3
        # A process whose greatest memory is below min_bytes holds that much at no sample (nan_to_num
        # below moves NaN, never counted, -inf, to the least float, below any min_bytes, and +inf,
        # which makes the greatest inf), so it is no co-tenant whoever the engine is: a GPU without
        # any other is done before the engine is told.
        big = [q for q in procs if not q.peak < min_bytes]
        if not big:
            continue
        names, pids = engine_identity(e)
        engine_pid = _engine_pid(e, procs, names, pids)
        # Every pid the engine rows state is the engine's (one that restarted in the window, too).
        others = [q for q in big if q.pid != engine_pid and q.pid not in pids]
        rows = [(q, np.flatnonzero(q.ok & (np.nan_to_num(q.mem) >= min_bytes))) for q in others]
        rows = [(q, at) for q, at in rows if at.size]
        if not rows:
            continue
        held_t, held = _held_by_t([q.t[at] for q, at in rows], [q.mem[at] for q, at in rows])
        t = e["t"].to_numpy(float)
        kv = e[M.engine_kv_capacity_bytes].to_numpy(float)
        cot = np.nan_to_num(_nearest(held_t, held, t, tolerance=2.0))
        nominal = _nominal(e, kv, cot)
        ratio = np.where(nominal > 0, kv / np.maximum(nominal, 1.0), 1.0)
        mask = (cot > 0) & (ratio <= KV_BELOW_NOMINAL_RATIO)
        for start, end in episodes(t, mask, MERGE_GAP_S, MIN_DURATION_S):
            sel = (t >= start) & (t <= end)
            top = []  # (most held inside the episode, pid, its last name there)
            for q, at in rows:
                ts = q.t[at]
                inside = at[(ts >= start) & (ts <= end)]
                if inside.size:
                    top.append((float(q.mem[inside].max()), q.pid, q.name_at(inside), _pod_at(q, inside)))
            top.sort(key=lambda x: -x[0])
            held_max, pid, name, pod = top[0]
            engine_pod = next((_pod_at(q, np.flatnonzero(q.ok)) for q in procs if q.pid == engine_pid), None)
            worst = float(ratio[sel].min())
            i = int(np.argmin(np.where(sel, ratio, np.inf)))
            findings.append(Finding(
                kind=KIND, severity=Severity.CRITICAL if worst <= KV_CRITICAL_RATIO else Severity.WARNING,
                start_s=float(start), end_s=float(end), node=key.get("node"), gpu=label_int(key.get("gpu")),
                pid=pid,
                summary=(f"pid {pid}{f' ({name})' if name else ''}{f' in pod {pod}' if pod else ''} holds "
                         f"{fmt_bytes(held_max)} on the engine's GPU {label_int(key.get('gpu'))}"
                         f"{f' (engine pod {engine_pod})' if engine_pod and engine_pod != pod else ''}; "
                         f"KV capacity {fmt_bytes(kv[i])} vs "
                         f"{fmt_bytes(nominal[i])} nominal ({worst:.0%})"),
                evidence=[
                    Evidence("cotenant_gpu_memory_bytes", float(cot[sel].max()), 0.0, min_bytes, "bytes"),
                    Evidence(M.engine_kv_capacity_bytes, float(kv[i]), float(nominal[i]),
                             KV_BELOW_NOMINAL_RATIO * float(nominal[i]), "bytes"),
                    Evidence("kv_capacity_of_nominal_ratio", worst, 1.0, KV_BELOW_NOMINAL_RATIO, "ratio"),
                ],
                runbook=alert_name(KIND), fixes=list(FIX_NAMES),
                details={"cotenant_pids": [p for _, p, _, _ in top], "engine_pid": engine_pid,
                         **({"cotenant_pods": [q for *_, q in top if q], "engine_pod": engine_pod}
                            if any(q for *_, q in top) or engine_pod else {}),
                         "nominal_kv_capacity_bytes": float(nominal[i]), "nominal_source": _source(e)},
            ))
    return findings


def _on_gpu(proc) -> dict[tuple, list[_Process]]:
    """The processes of each GPU with a memory sample, one entity each.

    Their rows are read once and shared with the other per-process analyzers, never
    gathered per GPU; on the window's table the memory of every process is read as
    one column in entity order, and each one's greatest value comes from one reduction.
    """
    keys = tuple(k for k in ("node", "gpu", "pid") if k in proc)  # as per_entity groups them
    whole = _Whole.of(proc, keys)
    on_gpu: dict[tuple, list[_Process]] = {}
    for g, (key, p) in enumerate(per_entity(proc, list(keys))):
        if _isna(key.get("pid")):
            continue
        if whole is not None:
            peak = whole.peaks[g]
            if peak != peak:
                continue  # no sample holds a value
            q = _Process(key, p, None, None, peak, whole, g)
        else:
            mem = p[M.process_gpu_memory_bytes].to_numpy(float)
            ok = ~np.isnan(mem)
            if not ok.any():
                continue
            q = _Process(key, p, mem, ok, np.nan)
        on_gpu.setdefault((key.get("node"), key.get("gpu")), []).append(q)
    return on_gpu


class _Whole:
    """Every process of the window's table in entity order: its memory, each one's greatest value, and
    (read when asked) the time of each one's last sample with memory and a value in a given column."""

    def __init__(self, proc: Rows, keys: tuple, mem: np.ndarray, starts: np.ndarray):
        self.proc, self.keys, self.mem, self.starts = proc, keys, mem, starts  # mem: as kept (floats or ints)
        self.bounds = starts.tolist()
        # As floats, the greatest of the floats (conversion keeps order); NaN for a process without a value.
        self.peaks = np.fmax.reduceat(mem, starts[:-1]).astype(float).tolist()
        self._last: dict[str, list[float] | None] = {}

    @classmethod
    def of(cls, proc, keys: tuple) -> _Whole | None:
        """None when the table does not give its memory column so (rows that are not the whole table,
        values kept other than as numbers)."""
        got = proc.entity_column(keys, M.process_gpu_memory_bytes) if isinstance(proc, Rows) else None
        if got is None or got[0].dtype.kind not in "fiub":
            return None
        return cls(proc, keys, got[0], got[1])

    def mem_of(self, g: int) -> np.ndarray:
        """Process ``g``'s memory as floats (converted for the few processes read, not the whole column)."""
        mem = self.mem[self.bounds[g]:self.bounds[g + 1]]
        return mem if mem.dtype.kind == "f" else mem.astype(float)

    def last_with(self, col: str) -> list[float] | None:
        """Per process, :meth:`_Process.last_where` of ``col`` holding a value; None: not told so."""
        if col not in self._last:
            self._last[col] = self._read_last(col)
        return self._last[col]

    def _read_last(self, col: str) -> list[float] | None:
        got, t = self.proc.entity_column(self.keys, col), self.proc.entity_column(self.keys, "t")
        if got is None or t is None or got[0].dtype.kind not in "fiub" or t[0].dtype.kind not in "fiub":
            return None
        has = ~np.isnan(self.mem) if self.mem.dtype.kind == "f" else np.ones(len(self.mem), dtype=bool)
        if got[0].dtype.kind == "f":  # integers are never missing
            has &= ~np.isnan(got[0])
        bounds, out = self.bounds, [-np.inf] * (len(self.bounds) - 1)
        for g in np.flatnonzero(np.logical_or.reduceat(has, self.starts[:-1])).tolist():
            s, e = bounds[g], bounds[g + 1]
            last = e - 1 if has[e - 1] else s + int(np.flatnonzero(has[s:e])[-1])
            out[g] = float(t[0][last])
        return out


class _Process:
    """One pid on one GPU: its rows, driver-charged memory, which of them hold a value, and the
    greatest of them (NaN: not read)."""

    __slots__ = ("key", "rows", "pid", "_mem", "_ok", "peak", "_t", "_whole", "_g")

    def __init__(self, key: dict, rows, mem: np.ndarray | None, ok: np.ndarray | None, peak: float,
                 whole: _Whole | None = None, g: int = -1):
        self.key, self.rows, self._mem, self._ok, self.peak = key, rows, mem, ok, peak
        self.pid = int(key["pid"])
        self._t = None
        self._whole, self._g = whole, g  # the table's processes, and which of them this one is

    @property
    def mem(self) -> np.ndarray:
        if self._mem is None:
            self._mem = self._whole.mem_of(self._g)
        return self._mem

    @property
    def ok(self) -> np.ndarray:
        if self._ok is None:
            self._ok = ~np.isnan(self.mem)
        return self._ok

    @property
    def t(self) -> np.ndarray:
        if self._t is None:
            self._t = self.rows["t"].to_numpy(float)
        return self._t

    def last_where(self, mask: np.ndarray) -> float:
        """Time of the last sample (with memory) where ``mask`` holds; -inf when none."""
        at = np.flatnonzero(mask & self.ok)
        return float(self.t[at[-1]]) if at.size else -np.inf

    def last_with(self, col: str) -> float:
        """:meth:`last_where` ``col`` holds a value."""
        got = self._whole.last_with(col) if self._whole is not None else None
        return got[self._g] if got is not None else self.last_where(self.rows[col].notna().to_numpy())

    def value_at(self, name: str, i: int):
        """Column ``name`` at row ``i`` of this process (read from the table, not gathered)."""
        rows = self.rows
        if isinstance(rows, Rows) and name in rows.table.columns:
            pos = rows.positions
            return rows.table.values_at(name, np.array([i if pos is None else int(pos[i])], dtype=np.int64))[0]
        return rows[name].to_numpy()[i]

    def name_at(self, at: np.ndarray) -> str | None:
        """The last process name among rows ``at``."""
        if "process" not in self.rows:
            return None
        codes, uniques = self._codes()
        named = at[codes[at] >= 0]
        return str(uniques[codes[named[-1]]]) if named.size else None

    def _codes(self):
        col = self.rows["process"]
        got = col.codes() if hasattr(col, "codes") and callable(col.codes) else None  # pandas: none kept
        if got is None:
            values = self.rows["process"].to_numpy()
            uniques = sorted({str(v) for v in values if v is not None and v == v})
            lut = {u: i for i, u in enumerate(uniques)}
            got = (np.array([lut.get(str(v), -1) if v is not None and v == v else -1 for v in values]), uniques)
        return got


def _pod_at(q: _Process, at: np.ndarray) -> str | None:
    """``namespace/pod`` of the process at its last row among ``at`` (Kubernetes), else None."""
    if not at.size or "pod" not in q.rows:
        return None
    pod = _str_or_none(q.value_at("pod", int(at[-1])))
    if not pod:
        return None
    ns = _str_or_none(q.value_at("namespace", int(at[-1]))) if "namespace" in q.rows else None
    return f"{ns}/{pod}" if ns else pod


def _processes(on_gpu: dict[tuple, list[_Process]], key: dict) -> list[_Process]:
    """The processes on the engine's GPU (a label the engine rows lack matches any)."""
    node, gpu_label = key.get("node"), key.get("gpu")
    out = []
    for (n, g), procs in on_gpu.items():
        if _same(n, node) and _same(g, gpu_label):
            out.extend(procs)
    return out


def _engine_pid(e, procs: list[_Process], names: frozenset, pids: frozenset):
    """The engine's pid: the last its rows state, else the process named as the engine (``names``, ``pids``:
    common.engine_identity), else the one with torch columns."""
    if pids:
        return int(e["pid"].dropna().iloc[-1])
    if names:
        best = _last_named(procs, names)
        if best[0] > -np.inf:
            return best[1]
    for col in (M.process_torch_reserved_bytes, M.process_torch_allocated_bytes):
        best = max(((q.last_with(col), q.pid) for q in procs if col in q.rows),
                   default=(-np.inf, None))
        if best[0] > -np.inf:
            return best[1]
    return None


def _last_named(procs: list[_Process], names: set[str]) -> tuple[float, int]:
    """(time, pid) of the latest sample with memory where a process carried one of ``names``.

    A process named so at its own last sample needs no more reading; one that
    is not can only have carried the name earlier, so its names are read only
    when its last sample is later than the best found that way. (-inf, -1) when none did.
    """
    best, unsure = (-np.inf, -1), []
    table = procs[0].rows.table if procs and isinstance(procs[0].rows, Rows) else None
    if table is not None and "process" in table.columns:
        # Every name the table's process column holds: none of the engine's, no process had it.
        if not any(str(u) in names for u in table.distinct("process")):
            return best
    for q in procs:
        if "process" not in q.rows:
            continue
        at = np.flatnonzero(q.ok)
        if not at.size:
            continue
        last = float(q.t[at[-1]])
        if _str_or_none(q.value_at("process", int(at[-1]))) in names:
            best = max(best, (last, q.pid))
        else:
            unsure.append((last, q))
    for last, q in unsure:
        if last > best[0]:
            best = max(best, (q.last_where(_named(q, names)), q.pid))
    return best


def _str_or_none(v) -> str | None:
    return None if _isna(v) else str(v)


def _named(q: _Process, names: set[str]) -> np.ndarray:
    codes, uniques = q._codes()
    lut = np.array([str(u) in names for u in uniques] + [False], dtype=bool)
    return lut[codes]


def _held_by_t(times: list[np.ndarray], held: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(sample times, memory summed over the processes at each)."""
    grid = max(times, key=len) if times else None
    if grid is not None and len(grid) and bool((grid[1:] > grid[:-1]).all()):
        # Processes sampled at the ticks of the longest one (the usual case), which are then all the
        # ticks: each sample's tick is found by a search instead of sorting every sample of the GPU;
        # bincount adds them in the order the general path below does, so the sums agree to the bit.
        at = [np.searchsorted(grid, x) for x in times]
        if all(len(x) == 0 or (int(i.max()) < len(grid) and np.array_equal(grid[i], x)) for i, x in zip(at, times)):
            return grid, np.bincount(np.concatenate(at), weights=np.concatenate(held), minlength=len(grid))
    t = np.concatenate(times)
    uniq, inverse = np.unique(t, return_inverse=True)
    return uniq, np.bincount(inverse, weights=np.concatenate(held), minlength=len(uniq))


def _nearest(xt: np.ndarray, xv: np.ndarray, t: np.ndarray, tolerance: float) -> np.ndarray:
    """``xv`` at the sample of ``xt`` nearest each ``t`` (a tie takes the later one), NaN beyond ``tolerance``."""
    if xt.size == 0:
        return np.full(len(t), np.nan)
    right = np.clip(np.searchsorted(xt, t, side="left"), 0, len(xt) - 1)
    left = np.clip(right - 1, 0, len(xt) - 1)
    pick = np.where(np.abs(xt[left] - t) < np.abs(xt[right] - t), left, right)
    out = xv[pick].astype(float)
    out[np.abs(xt[pick] - t) > tolerance] = np.nan
    return out


def _same(a, b) -> bool:
    """Equal labels, or a label one side lacks."""
    return _isna(a) or _isna(b) or a == b


def _isna(v) -> bool:
    return v is None or (isinstance(v, float) and v != v)


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
