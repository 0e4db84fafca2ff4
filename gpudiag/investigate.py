"""Investigation of one window: findings, the memory of the implicated processes, next steps and gaps.

``gpudiag investigate`` reads a window from the store (or from Prometheus:
:mod:`gpudiag.promql_source`), runs every analyzer over it (the registry's,
the same code the agent streams) and turns window and findings into one document (schema in the
docs/investigate.md, "--json"). Everything here is pure except
:func:`load_store_window` (reads the store) and :func:`write_html` (writes
the report); the time arguments are parsed by :func:`parse_time` and
:func:`parse_duration`.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

import numpy as np

from gpudiag.catalog import M
from gpudiag.errors import GpudiagError
from gpudiag.findings import Finding, Severity, deep_clean, worst_severity
from gpudiag.frames import Window

if TYPE_CHECKING:  # pandas is imported by the chart functions only: a --json investigation never needs it
    import pandas as pd

DEFAULT_SINCE_S = 1800.0
# Charts bin per minute: the TPOT P99 of a minute of finished requests is what an SLO dashboard shows.
CHART_BIN_S = 60.0
# Memory traces are thinned to at most this many points each, so a 24 h window stays a few MB of HTML.
MAX_CHART_POINTS = 2000
# Charts are read by people: memory in GiB (plotly would label 60e9 bytes "60B").
GIB = float(1 << 30)

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d)\s*$", re.IGNORECASE)
_DURATION_UNIT_S = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(text: str) -> float:
    """'90s', '30m', '2h', '1d' -> seconds; GpudiagError for anything else or zero."""
    m = _DURATION.match(text or "")
    if not m:
        raise GpudiagError(f"malformed duration {text!r}: use a number with s, m, h or d (90s, 30m, 2h)")
    seconds = float(m.group(1)) * _DURATION_UNIT_S[m.group(2).lower()]
    if seconds <= 0:
        raise GpudiagError(f"duration {text!r} must be positive")
    return seconds


def parse_time(text: str, option: str) -> float:
    """Unix seconds or ISO-8601 (an ISO time without offset is local time) -> Unix seconds."""
    s = (text or "").strip()
    try:
        value = float(s)
    except ValueError:
        try:
            dt = datetime.fromisoformat(s)
        except ValueError:
            raise GpudiagError(f"malformed time for {option}: {text!r}; use ISO-8601 "
                               f"(2024-05-01T03:00:00Z) or Unix seconds") from None
        return dt.timestamp()
    if not math.isfinite(value) or value < 0:
        raise GpudiagError(f"malformed time for {option}: {text!r}; Unix seconds must be a non-negative number")
    return value


def resolve_window(time_range: tuple[float, float], *, since: str | None, start: str | None, end: str | None,
                   now_s: float | None = None) -> tuple[float, float]:
    """The [start, end] to read from a store whose samples span ``time_range``.

    ``--since`` counts back from the store's latest sample (with a running
    agent that is about now; a store written earlier, or by ``--sim`` on its
    simulated time base, has its own end). ``--from`` without ``--to`` runs to
    the latest sample. A window after both now and the latest sample is in the
    future; one that misses the store's data holds nothing to investigate.
    """
    now_s = time.time() if now_s is None else now_s
    first, last = time_range
    if since is not None and (start is not None or end is not None):
        raise GpudiagError("give either --since or --from/--to, not both")
    if end is not None and start is None:
        raise GpudiagError("--to needs --from (or use --since)")
    if start is None:
        span = parse_duration(since) if since is not None else DEFAULT_SINCE_S
        return max(first, last - span), last
    lo = parse_time(start, "--from")
    hi = parse_time(end, "--to") if end is not None else max(last, lo)
    if lo > max(now_s, last):
        raise GpudiagError(f"the window starts at {iso(lo)}, in the future (now {iso(now_s)}; "
                           f"the store's data ends at {iso(last)})")
    if lo >= hi:
        raise GpudiagError(f"--from ({iso(lo)}) must be before --to ({iso(hi)})")
    if lo > last or hi < first:
        raise GpudiagError(f"no data between {iso(lo)} and {iso(hi)}: the store holds "
                           f"{iso(first)} to {iso(last)}")
    return lo, hi


def iso(t: float) -> str:
    """Unix seconds as UTC ISO-8601; small values (a simulated time base from 0) as seconds."""
    if t < 1e9:
        return f"{t:.0f} s"
    return datetime.fromtimestamp(t, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def load_store_window(path: str, *, since: str | None, start: str | None, end: str | None,
                      node: str | None, gpu: int | None) -> Window:
    """Open the store read-only and read the window the time options name (GpudiagError on bad input)."""
    from gpudiag.agent.store import Store

    with Store.open(path, readonly=True) as store:
        time_range = store.time_range()
        if time_range is None:
            raise GpudiagError(f"store {path} holds no samples yet: is the agent writing to it?")
        lo, hi = resolve_window(time_range, since=since, start=start, end=end)
        window = store.window(lo, hi, node=node)
        if node is not None and not any(window.columns(kind).n for kind in window.tables):
            everyone = store.window(lo, hi, kinds=["gpu", "node"])
            nodes = sorted({str(n) for kind in everyone.tables for n in _labels(everyone.columns(kind), "node")})
            raise GpudiagError(f"no node {node!r} in store {path} in this window; nodes there: "
                               f"{', '.join(nodes) or 'none'}")
    window.start_s, window.end_s = lo, hi
    window.node = node if node is not None else window.node
    window.sources = [f"store:{path}"]
    if gpu is not None:
        window = only_gpu(window, gpu)
    return window


def only_gpu(window: Window, gpu: int) -> Window:
    """The window's rows of one GPU (rows without a GPU label, the node's, are kept); GpudiagError when absent."""
    tables = {}
    for kind in window.tables:
        table = window.columns(kind)
        if "gpu" in table.columns:
            codes, uniques = table.codes("gpu")
            want = [i for i, u in enumerate(uniques) if _same_gpu(u, gpu)]
            table = table.take(np.flatnonzero(np.isin(codes, want)))
        tables[kind] = table
    if not any("gpu" in t.columns and t.n for t in tables.values()):
        seen = sorted({int(g) for kind in window.tables for g in _labels(window.columns(kind), "gpu")})
        raise GpudiagError(f"no GPU {gpu} in this window; GPUs there: {', '.join(map(str, seen)) or 'none'}")
    return Window.from_columns(tables, start_s=window.start_s, end_s=window.end_s, node=window.node,
                               sources=list(window.sources), gaps=list(window.gaps))


def _same_gpu(label, gpu: int) -> bool:
    try:
        return int(label) == gpu and float(label) == float(gpu)
    except (TypeError, ValueError):
        return False


def _labels(table, column: str) -> list:
    """The distinct non-missing values of a label column of a Table (none when it lacks the column)."""
    if column not in table.columns:
        return []
    # distinct, not the codes' uniques: those may hold a value only rows outside the window held.
    return [u for u in table.distinct(column) if u is not None and u == u]


@dataclass(frozen=True)
class Check:
    """One view of the GPU an analyzer needs: a frame kind (and column), why it may be missing, who needs it."""

    name: str
    kind: str
    column: str | None
    why_missing: str
    analyzers: tuple[str, ...]
    also_kind: str | None = None  # another frame kind whose rows carry the same column


CHECKS = (
    Check("driver view (NVML)", "gpu", M.gpu_utilization_ratio,
          "no GPU rows: NVML is unavailable (no NVIDIA driver or GPU) and no --sim engine ran",
          ("throttling", "hardware_errors", "cpu_starved_gpu", "oom_forecast")),
    Check("per-process driver memory (black)", "process", M.process_gpu_memory_bytes,
          "NVML listed no process memory (not available under MIG without privileges, or no processes)",
          ("memory_leak", "gpu_cotenant")),
    Check("caching allocator (white, grey)", "process", M.process_torch_reserved_bytes,
          "no torch reporter: call gpudiag.instrument() in the process, or run an engine that reports "
          "its allocator", ("memory_fragmentation", "oom_forecast", "memory_leak")),
    Check("serving engine", "engine", M.num_requests_running,
          "no engine metrics: no vLLM or reference engine endpoint was scraped",
          ("kv_eviction_storm", "latency_regression")),
    Check("engine KV capacity", "engine", M.engine_kv_capacity_bytes,
          "the engine exports no KV capacity (gpudiag's engine metrics; vLLM has none)", ("gpu_cotenant",)),
    # Per-request rows, or the per-interval summaries of the engine's latency histograms (vLLM, Prometheus).
    Check("finished requests (TTFT, TPOT)", "request", M.inter_token_latency_seconds,
          "the engine reported no per-request latencies", ("latency_regression",), also_kind="engine"),
    Check("CUDA API (eBPF)", "cuda_api", None,
          "no eBPF data in this window: the agent's eBPF probe did not run, or saw no CUDA call (it needs root "
          "or CAP_BPF+CAP_PERFMON, bcc and kernel headers, and is off with --sim or probes.ebpf = \"off\"; the "
          "agent's log says which)", ("degenerate_kernel_launch", "cpu_starved_gpu")),
    Check("host CPU", "node", M.node_cpu_utilization_ratio, "no host rows: the procfs probe did not run",
          ("cpu_starved_gpu",)),
)


# The eBPF probe ran in a window that holds its host tracepoints' rows (no other source writes them).
EBPF_RAN_BUT_SAW_NO_CUDA = ("the eBPF probe ran but saw no CUDA runtime or driver call: no process on the node "
                            "called a CUDA library while it was probed (the agent's always-on probe leaves "
                            "kernel launches unprobed)")


def _why_missing(check: Check, window: Window) -> str:
    if check.kind == "cuda_api" and window.has("node", M.host_oom_kills_total):
        return EBPF_RAN_BUT_SAW_NO_CUDA
    return check.why_missing


def gaps(window: Window) -> list[dict[str, Any]]:
    """What could not be checked in this window: each missing view, why, and the analyzers it blinds."""
    out = [{"check": c.name, "kind": c.kind, "column": c.column, "reason": _why_missing(c, window),
            "analyzers": list(c.analyzers)}
           for c in CHECKS if not (window.has(c.kind, c.column) or (c.also_kind and window.has(c.also_kind, c.column)))]
    out.extend({"check": "source", "kind": None, "column": None, "reason": g, "analyzers": []} for g in window.gaps)
    return out


def _num(v) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(f) else f


def implicated(findings: list[Finding], entities: list[dict[str, Any]]) -> set[tuple]:
    """(node, gpu, pid) of the processes the findings name; a finding without a pid names its GPU's processes."""
    keys = set()
    for r in entities:
        for f in findings:
            if f.gpu is not None and r.get("gpu") != f.gpu:
                continue
            if f.node is not None and r.get("node") not in (None, f.node):
                continue
            if f.pid is None or f.pid == r.get("pid"):
                keys.add((r.get("node"), r.get("gpu"), r.get("pid")))
    return keys


def memory(window: Window, findings: list[Finding]) -> list[dict[str, Any]]:
    """The latest three colours of every process in the window, its gaps, and whether a finding implicates it."""
    from gpudiag.agent.tracker import BLACK, GREY, LAYER_COLUMNS, NO_REPORTER, NVML_NOT_LISTED, WHITE

    proc = window.rows("process")
    if proc.empty or "pid" not in proc:
        return []
    labels = [c for c in ("node", "gpu", "pid") if c in proc]
    wanted = [c for c in ("t", "process", "pod", "namespace", "container", M.process_torch_largest_free_block_bytes,
                          *LAYER_COLUMNS.values()) if c in proc]
    # The last observed value of each column per process, read back from each one's last rows
    # (a day holds ten million rows; the answer is in the last few of each process).
    latest = []
    for key, rows in proc.groups(tuple(labels)):
        ent = dict(zip(labels, key))
        for c in wanted:
            ent[c] = _last_observed(rows, c)
        latest.append(ent)
    named = implicated(findings, latest)
    out = []
    for ent in latest:
        layers = {layer: _num(ent.get(col)) for layer, col in LAYER_COLUMNS.items()}
        missing = {layer: NVML_NOT_LISTED if layer == BLACK else NO_REPORTER
                   for layer, v in layers.items() if v is None}
        w, g, b = layers[WHITE], layers[GREY], layers[BLACK]
        out.append({
            "node": ent.get("node"), "gpu": ent.get("gpu"), "pid": ent.get("pid"),
            "process": ent.get("process"),
            **{k: ent[k] for k in ("pod", "namespace", "container") if isinstance(ent.get(k), str) and ent[k]},
            "t": _num(ent["t"]),
            "white_bytes": w, "grey_bytes": g, "black_bytes": b,
            "grey_minus_white_bytes": None if w is None or g is None else g - w,
            "black_minus_grey_bytes": None if g is None or b is None else b - g,
            "largest_free_block_bytes": _num(ent.get(M.process_torch_largest_free_block_bytes)),
            "implicated": (ent.get("node"), ent.get("gpu"), ent.get("pid")) in named,
            "missing": missing,
        })
    return out


def _last_observed(rows, column: str):
    """The last non-missing value of ``column`` in ``rows`` (by time), or None; reads only the last rows it needs."""
    idx, n, k = rows.positions, len(rows), 16
    while True:
        lo = max(n - k, 0)
        vals = rows.table.values_at(column, np.arange(lo, n) if idx is None else idx[lo:n])
        if vals.dtype.kind == "f":
            ok = np.flatnonzero(~np.isnan(vals))
        elif vals.dtype == object:
            ok = np.flatnonzero([v is not None and v == v for v in vals.tolist()])
        else:
            ok = np.arange(len(vals))
        if ok.size:
            return vals[ok[-1]].item() if hasattr(vals[ok[-1]], "item") else vals[ok[-1]]
        if lo == 0:
            return None
        k *= 8


def next_steps(findings: list[Finding]) -> list[dict[str, Any]]:
    """Per runbook the findings point at: the runbook command and the repro commands that check a fix."""
    if not any(f.runbook for f in findings):
        return []  # the scenario table (and the simulator behind it) is read only to name fixes
    from gpudiag.reference_engine.scenarios import SCENARIOS

    out: dict[str, dict[str, Any]] = {}
    for f in findings:
        if not f.runbook:
            continue
        step = out.setdefault(f.runbook, {"runbook": f.runbook, "command": f"gpudiag runbook {f.runbook}",
                                          "findings": [], "repro": []})
        step["findings"].append(f.id)
        for sc in SCENARIOS.values():
            if f.kind not in sc.expected_findings:
                continue
            for fix in f.fixes:
                cmd = f"gpudiag repro {sc.name} --fix {fix}"
                if fix in sc.fixes and cmd not in step["repro"]:
                    step["repro"].append(cmd)
    return list(out.values())


# Exit codes of ``gpudiag investigate``: what a script or an alert webhook can tell without parsing.
EXIT_NOTHING_FOUND = 0  # nothing of warning level, and every analyzer could judge the window
EXIT_FOUND = 1  # a warning or critical finding
EXIT_BAD_INPUT = 2  # bad input (the CLI's GpudiagError)
EXIT_INCONCLUSIVE = 3  # nothing of warning level, but some analyzers could not judge the window


def exit_code(findings: list[Finding], coverage: dict[str, Any] | None = None) -> int:
    """EXIT_FOUND when a finding is of warning level or above; else EXIT_INCONCLUSIVE when ``coverage``
    (:func:`coverage`) says some analyzer could not run (an input missing, the window too short);
    else EXIT_NOTHING_FOUND."""
    worst = worst_severity(findings)
    if worst is not None and worst.rank >= Severity.WARNING.rank:
        return EXIT_FOUND
    if coverage is not None and not coverage["conclusive"]:
        return EXIT_INCONCLUSIVE
    return EXIT_NOTHING_FOUND


def coverage(window: Window) -> dict[str, Any]:
    """What could be judged in the window (analyzers.registry.coverage): which analyzers ran on how much
    data, which could not and why, which symptoms stayed unjudged."""
    from gpudiag.analyzers.registry import coverage as registry_coverage

    return registry_coverage(window)


def document(window: Window, findings: list[Finding], covered: dict[str, Any] | None = None) -> dict[str, Any]:
    """The investigation document (``--json``; schema in docs/investigate.md). ``covered``: :func:`coverage`
    of the window, when already known."""
    worst = worst_severity(findings)
    doc = {
        "window": {"start_s": window.start_s, "end_s": window.end_s, "node": window.node},
        "sources": list(window.sources),
        "gaps": gaps(window),
        "coverage": covered if covered is not None else coverage(window),
        "worst_severity": None if worst is None else worst.value,
        "findings": [f.to_dict() for f in findings],
        "memory": memory(window, findings),
        "next_steps": next_steps(findings),
    }
    doc = deep_clean(doc)
    # Finding.to_dict rounds to display precision; keep the window's edges exact for scripts that re-query.
    doc["window"]["start_s"], doc["window"]["end_s"] = float(window.start_s), float(window.end_s)
    return doc


# --- HTML report ----------------------------------------------------------------------

def _x(t: np.ndarray):
    """Chart x values: datetimes for Unix times, seconds for a simulated time base."""
    import pandas as pd

    t = np.asarray(t, dtype=float)
    if t.size and np.nanmin(t) >= 1e9:
        return pd.to_datetime(t, unit="s", utc=True)
    return t


def _thin(df: pd.DataFrame) -> pd.DataFrame:
    step = max(1, math.ceil(len(df) / MAX_CHART_POINTS))
    return df.iloc[::step]


def per_minute_tpot_p99(requests: pd.DataFrame) -> pd.DataFrame:
    """TPOT P99 of the requests that finished in each minute: columns ``t`` (bin start) and ``tpot_p99_s``."""
    import pandas as pd

    col = M.inter_token_latency_seconds
    if requests.empty or col not in requests:
        return pd.DataFrame({"t": [], "tpot_p99_s": []})
    r = requests[["t", col]].dropna()
    bins = (r["t"] // CHART_BIN_S) * CHART_BIN_S
    p99 = r.groupby(bins)[col].quantile(0.99)
    return pd.DataFrame({"t": p99.index.to_numpy(float), "tpot_p99_s": p99.to_numpy(float)})


def interval_p99(engine: pd.DataFrame, col: str) -> pd.DataFrame:
    """Columns ``t`` and ``p99_s``: the P99 of each interval summary (``{"window": {...}}``) of a latency column."""
    import pandas as pd

    t, v = [], []
    if not engine.empty and col in engine:
        for ti, s in zip(engine["t"].tolist(), engine[col].tolist()):
            win = s.get("window") if isinstance(s, dict) else None
            if win and win.get("count") and win.get("p99") is not None:
                t.append(ti)
                v.append(win["p99"])
    return pd.DataFrame({"t": np.array(t, float), "p99_s": np.array(v, float)})


def html_report(window: Window, findings: list[Finding], covered: dict[str, Any] | None = None) -> str:
    """One self-contained HTML page: the causal chain, each finding with the charts of its evidence, and
    the coverage (:func:`gpudiag.report_html.html_report`)."""
    from gpudiag import report_html

    return report_html.html_report(window, findings, covered)


def coverage_verdict(covered: dict[str, Any], found: bool) -> str:
    """One line: what the coverage makes of the window (with the findings, or with nothing found)."""
    ran, total = len(covered["ran"]), len(covered["ran"]) + len(covered["not_run"])
    if covered["conclusive"]:
        return (f"all {total} analyzers judged this window" if found
                else f"nothing wrong in what could be checked: all {total} analyzers judged this window")
    if found:
        return f"{ran} of {total} analyzers judged this window; the others could not (see coverage)"
    return (f"inconclusive: nothing found by the {ran} of {total} analyzers that could judge this window; "
            f"{total - ran} could not (see coverage)")


def coverage_html(covered: dict[str, Any], found: bool) -> str:
    """The report's coverage section: the verdict, each analyzer that ran or did not (and why), unjudged symptoms."""
    import html as H

    from gpudiag.units import fmt_seconds

    rows = "".join(
        f"<tr><td>{H.escape(r['analyzer'])}</td><td>ran</td><td>"
        + H.escape("; ".join(f"{i['column']} ({i['kind']}: {i['rows']} rows, {fmt_seconds(i['seconds'])})"
                             for i in r["inputs"])) + "</td></tr>" for r in covered["ran"])
    rows += "".join(f"<tr><td>{H.escape(r['analyzer'])}</td><td>did not run</td><td>{H.escape(r['detail'])}</td></tr>"
                    for r in covered["not_run"])
    unjudged = "".join(f"<li>{H.escape(u['symptom'])}: {H.escape(u['detail'])}</li>" for u in covered["unjudged"])
    return (f"<h3 id='coverage'>Coverage</h3><p>{H.escape(coverage_verdict(covered, found))}</p>"
            f"<table><tr><th>analyzer</th><th>status</th><th>inputs, or why not</th></tr>{rows}</table>"
            + (f"<h4>Symptoms left unjudged</h4><ul>{unjudged}</ul>" if unjudged else ""))


def write_html(path: str, window: Window, findings: list[Finding], covered: dict[str, Any] | None = None) -> None:
    """Write :func:`html_report` to ``path`` (GpudiagError when it cannot be written)."""
    try:
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(html_report(window, findings, covered))
    except OSError as exc:
        raise GpudiagError(f"cannot write the HTML report to {path}: {exc.strerror}") from None

