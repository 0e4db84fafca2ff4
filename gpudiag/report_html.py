"""The ``gpudiag investigate --html`` report: read top-down, each finding with the charts of its own evidence.

The page holds, in this order:

1. the causal chain: one box per finding (kind, severity, start), arrows from
   cause to effect (an inline SVG; each box links to its section);
2. one section per finding: its summary and evidence rows, then the charts
   :data:`EVIDENCE_CHARTS` declares for its kind (a kind without a declaration
   gets :data:`GENERIC_CHARTS`). Each chart shades the finding's span (and
   its causes' spans) as a labelled band with a legend entry. A chart whose
   series hold no data in the window is left out, with one line naming the
   missing series;
3. what could not be checked, and the coverage section
   (:func:`gpudiag.investigate.coverage_html`).

Axes do not mislead: ratios run from 0 to 1, every other y axis (latency,
bytes, counts) starts at 0. plotly.js is embedded once; the page needs no
network.
"""

from __future__ import annotations

import html as H
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from gpudiag import investigate as I
from gpudiag.catalog import M, request_context_bucket
from gpudiag.findings import Finding
from gpudiag.frames import Window
from gpudiag.units import fmt_bytes, fmt_seconds, fmt_value

if TYPE_CHECKING:
    import pandas as pd
    import plotly.graph_objects as go

# Charts of windows shorter than an hour bin per 10 s: a 10-minute scenario needs more than ten points.
SHORT_WINDOW_S = 3600.0
SHORT_BIN_S = 10.0
# Memory traces in GiB: people read "62.3 GiB", not "6.7e10".
GIB = I.GIB
SEVERITY_FILL = {"critical": "rgba(220,0,0,0.10)", "warning": "rgba(240,160,0,0.12)", "info": "rgba(0,120,220,0.08)"}
SEVERITY_LINE = {"critical": "#c00000", "warning": "#d08000", "info": "#0060c0"}


@dataclass(frozen=True)
class Chart:
    """One chart of a finding's evidence: its title, the catalog series it draws, and how.

    ``draw(ctx, finding, fig)`` adds the traces; a chart that added none is left out of the
    report with a line naming ``series`` as missing. ``y`` is the left axis: "ratio" (0 to 1)
    or a title for an axis that starts at 0.
    """

    title: str
    series: tuple[str, ...]
    draw: Callable[[Context, Finding, Any], None]
    y: str


@dataclass
class Context:
    """The window's tables as DataFrames (read once per report) and the chart bin."""

    window: Window
    bin_s: float
    tables: dict[str, pd.DataFrame]

    def table(self, kind: str, finding: Finding | None = None, *, by_pid: bool = False) -> pd.DataFrame:
        """The rows of one frame kind, narrowed to the finding's GPU (and process when ``by_pid``)."""
        if kind not in self.tables:
            self.tables[kind] = self.window.table(kind)
        df = self.tables[kind]
        if finding is not None and not df.empty:
            if finding.gpu is not None and "gpu" in df:
                df = df[df["gpu"].isna() | (df["gpu"] == finding.gpu)] if df["gpu"].dtype == object \
                    else df[df["gpu"] == finding.gpu]
            if by_pid and finding.pid is not None and "pid" in df and (df["pid"] == finding.pid).any():
                df = df[df["pid"] == finding.pid]
        return df


# --- series helpers ---------------------------------------------------------------------


def _binned(df: pd.DataFrame, col: str, bin_s: float, how: str = "mean") -> pd.Series:
    if df.empty or col not in df:
        return _empty()
    r = df[["t", col]].dropna()
    if r.empty:
        return _empty()
    return r.groupby((r["t"] // bin_s) * bin_s)[col].agg(how)


def _empty():
    import pandas as pd

    return pd.Series(dtype=float)


def _increase(df: pd.DataFrame, col: str, bin_s: float,
              labels: tuple[str, ...] = ("gpu", "engine", "pid")) -> pd.Series:
    """Per-bin increase of a cumulative counter, summed over its entities (a reset counts from zero)."""
    import pandas as pd

    if df.empty or col not in df:
        return _empty()
    keys = [c for c in labels if c in df]
    groups = (rows for _, rows in df.groupby(keys, sort=True, dropna=False)) if keys else [df]
    parts = []
    for rows in groups:
        v = pd.to_numeric(rows[col], errors="coerce").dropna()
        if v.empty:
            continue
        inc = v.diff().fillna(0.0)
        inc[inc < 0] = v[inc < 0]
        t = rows.loc[v.index, "t"]
        parts.append(inc.groupby((t // bin_s) * bin_s).sum())
    return pd.concat(parts).groupby(level=0).sum() if parts else _empty()


def _flat(value, prefix: str = "") -> dict[str, float]:
    """A nested label dict (``{"volatile": {"corrected": 3}}``) as ``{"volatile/corrected": 3.0}``."""
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            out.update(_flat(v, f"{prefix}{k}/" if isinstance(v, dict) else f"{prefix}{k}"))
        return out
    f = I._num(value) if prefix else None
    return {prefix: f} if f is not None else {}


def labelled_counter_increases(df: pd.DataFrame, col: str, bin_s: float) -> dict[str, pd.Series]:
    """Per-bin increases of each label value of a dict-valued counter column (XID codes, ECC kinds)."""
    import pandas as pd

    if df.empty or col not in df:
        return {}
    rows = [(t, _flat(v)) for t, v in zip(df["t"].tolist(), df[col].tolist()) if isinstance(v, dict)]
    if not rows:
        return {}
    # A label absent before it first appears counted 0 there (an XID's first event is its 0 -> 1); a
    # label missing for a while after it appeared holds its last count (a gap, not a reset).
    wide = pd.DataFrame([r for _, r in rows], index=[t for t, _ in rows]).ffill().fillna(0.0)
    out = {}
    for label in wide.columns:
        v = wide[label]
        inc = v.diff().fillna(0.0).clip(lower=0.0)
        s = inc.groupby((v.index.to_numpy(float) // bin_s) * bin_s).sum()
        if s.sum() > 0:
            out[label] = s
    return out


def _line(fig, s: pd.Series, name: str, **kw) -> None:
    if s is not None and len(s):
        fig.add_trace(_go().Scatter(x=I._x(s.index.to_numpy(float)), y=s.to_numpy(float), name=name,
                                    mode=kw.pop("mode", "lines"), **kw))


def _bars(fig, s: pd.Series, name: str, **kw) -> None:
    if s is not None and len(s) and float(np.nansum(s.to_numpy(float))) > 0:
        fig.add_trace(_go().Bar(x=I._x(s.index.to_numpy(float)), y=s.to_numpy(float), name=name, **kw))


def _go():
    import plotly.graph_objects as go

    return go


def _per_gpu(ctx: Context, f: Finding, fig, col: str, label: str, **kw) -> None:
    gpu = ctx.table("gpu", f)
    if gpu.empty or col not in gpu:
        return
    for g, rows in gpu.groupby("gpu", sort=True):
        _line(fig, _binned(rows, col, ctx.bin_s), f"gpu {g} {label}", **kw)


# --- charts per kind ----------------------------------------------------------------------


def _draw_gpu_and_thread(ctx, f, fig):
    _per_gpu(ctx, f, fig, M.gpu_utilization_ratio, "utilization")
    proc = ctx.table("process", f, by_pid=True)
    thread = f.details.get("top_thread")
    for pid, rows in (proc.groupby("pid", sort=True) if not proc.empty and "pid" in proc else []):
        name = f"pid {pid} hottest thread{f' ({thread})' if thread and pid == f.pid else ''} CPU (1 = one core)"
        _line(fig, _binned(rows, M.process_thread_cpu_max_ratio, ctx.bin_s), name, line={"color": "#c00000"})
    _line(fig, _binned(ctx.table("node"), M.node_cpu_utilization_ratio, ctx.bin_s), "node CPU (all cores)",
          line={"dash": "dot", "color": "#888"})


def _draw_queue(ctx, f, fig):
    eng = ctx.table("engine", f)
    for col, name in ((M.num_requests_waiting, "requests waiting"),
                      (M.engine_preprocess_backlog_requests, "requests waiting for preprocessing"),
                      (M.num_requests_running, "requests running"), (M.engine_batch_size, "batch size")):
        _line(fig, _binned(eng, col, ctx.bin_s), name)


def _draw_launches_by_grid(ctx, f, fig):
    api = ctx.table("cuda_api", f, by_pid=True)
    fn = f.details.get("function")
    if api.empty or M.cuda_function_launches_total not in api or M.cuda_function_grid_blocks not in api:
        return
    rows = api.dropna(subset=[M.cuda_function_launches_total])
    if fn and "function" in rows and (rows["function"] == fn).any():
        rows = rows[rows["function"] == fn]
    one_block = rows[M.cuda_function_grid_blocks] <= DEGENERATE_GRID_BLOCKS
    name = fn or "all kernels"
    for label, sel, colour in (("grid (1,1,1): one block", one_block, "#c00000"),
                               ("grid of several blocks", ~one_block, "#0060c0")):
        s = _increase(rows[sel], M.cuda_function_launches_total, ctx.bin_s, ("pid", "function")) / ctx.bin_s
        _line(fig, s, f"{name} launches, {label}", line={"color": colour, "shape": "hv"})


# A launch of one thread block is the degenerate shape (the analyzer's grid (1,1,1)).
DEGENERATE_GRID_BLOCKS = 1


def _draw_kernel_time(ctx, f, fig):
    api = ctx.table("cuda_api", f, by_pid=True)
    if api.empty or M.cuda_function_duration_seconds not in api or "function" not in api:
        return
    for func, rows in api.dropna(subset=[M.cuda_function_duration_seconds]).groupby("function", sort=True):
        _line(fig, _binned(rows, M.cuda_function_duration_seconds, ctx.bin_s), f"{func} GPU time per launch")


def _layer_columns():
    from gpudiag.agent.tracker import LAYER_COLUMNS

    return LAYER_COLUMNS


# Which layer a leak or forecast names (its details["layer"]) is fitted on the chart.
LAYER_OF = {"allocated": "white", "reserved": "grey", "driver": "black", "non-releasable": "black"}
LAYER_STYLE = {"white": ("white: allocated", "#9a9a9a", "dot"), "grey": ("grey: reserved", "#555", "dash"),
               "black": ("black: driver", "#000", "solid")}


def _colour_lines(fig, proc, cols) -> None:
    """Each process's three colours (white, grey, black) as lines, in GiB."""
    for pid, rows in proc.groupby("pid", sort=True):
        rows = I._thin(rows)
        for layer, (label, colour, dash) in LAYER_STYLE.items():
            if cols[layer] in rows and rows[cols[layer]].notna().any():
                fig.add_trace(_go().Scatter(x=I._x(rows["t"]), y=rows[cols[layer]] / GIB, mode="lines",
                                            name=f"pid {pid} {label}", line={"color": colour, "dash": dash}))


def _draw_three_colours_trend(ctx, f, fig):
    cols = _layer_columns()
    proc = ctx.table("process", f, by_pid=True)
    if proc.empty:
        return
    _colour_lines(fig, proc, cols)
    if not fig.data:
        return
    gpu = ctx.table("gpu", f)
    capacity = float(gpu[M.gpu_memory_total_bytes].max()) if M.gpu_memory_total_bytes in gpu else None
    if capacity:
        fig.add_hline(y=capacity / GIB, line={"color": "#c00000", "dash": "dash"},
                      annotation_text=f"device memory {fmt_bytes(capacity)}", annotation_position="top left")
    _trend(ctx, f, fig, proc, cols, capacity)


def _trend(ctx, f, fig, proc, cols, capacity):
    """The least-squares line of the finding's layer over its span, carried on to the OOM it forecasts."""
    col = cols[LAYER_OF.get(str(f.details.get("layer")), "black")]
    if f.pid is not None and "pid" in proc:
        proc = proc[proc["pid"] == f.pid]
    r = proc[(proc["t"] >= f.start_s) & (proc["t"] <= f.end_s)][["t", col]].dropna() if col in proc else proc[:0]
    if len(r) < 2:
        return
    slope, icpt = np.polyfit(r["t"].to_numpy(float), r[col].to_numpy(float), 1)
    tto = I._num(f.details.get("time_to_oom_s"))
    t1 = f.end_s + (tto if tto is not None and slope > 0 else 0.0)
    if capacity and slope > 0:
        t1 = min(t1, max(f.end_s, (capacity - icpt) / slope))
    t = np.array([f.start_s, t1])
    fig.add_trace(_go().Scatter(x=I._x(t), y=(icpt + slope * t) / GIB, mode="lines",
                                name=f"fitted trend ({fmt_bytes(slope)}/s)", line={"color": "#c00000", "width": 3}))
    if tto is not None:
        text = "OOM reached" if tto <= 0 else f"time to OOM: {fmt_seconds(tto)}"
        fig.add_annotation(x=I._x(np.array([t1]))[0], y=(icpt + slope * t1) / GIB, text=text, showarrow=True,
                           font={"color": "#c00000"})


def _draw_evictions(ctx, f, fig):
    eng = ctx.table("engine", f)
    if M.engine_kv_evictions_total in eng:
        _bars(fig, _increase(eng, M.engine_kv_evictions_total, ctx.bin_s), f"KV evictions per {ctx.bin_s:.0f} s")
    else:  # vLLM counts an eviction as a preemption
        _bars(fig, _increase(eng, M.num_preemptions_total, ctx.bin_s), f"preemptions per {ctx.bin_s:.0f} s")
    _bars(fig, _increase(eng, M.engine_kv_alloc_failures_total, ctx.bin_s),
          f"KV allocation failures per {ctx.bin_s:.0f} s")


def _draw_kv_usage_util(ctx, f, fig):
    _line(fig, _binned(ctx.table("engine", f), M.kv_cache_usage_perc, ctx.bin_s), "KV cache usage")
    _per_gpu(ctx, f, fig, M.gpu_utilization_ratio, "utilization")


def _draw_tpot_by_context(ctx, f, fig):
    req = ctx.table("request", f)
    col = M.inter_token_latency_seconds
    if req.empty or col not in req:
        return
    buckets = [request_context_bucket(r) for r in req[["prompt_tokens", "output_tokens"]].to_dict("records")] \
        if {"prompt_tokens", "output_tokens"} <= set(req.columns) else [None] * len(req)
    req = req.assign(_bucket=buckets).dropna(subset=["_bucket", col])
    bin_s = max(ctx.bin_s, I.CHART_BIN_S)  # a P99 needs a minute's requests
    for bucket, rows in req.groupby("_bucket", sort=True):
        _line(fig, _binned(rows, col, bin_s, lambda v: v.quantile(0.99)), f"TPOT P99, context {bucket}",
              mode="lines+markers")


def _draw_clocks_reasons(ctx, f, fig):
    gpu = ctx.table("gpu", f)
    if gpu.empty or M.gpu_sm_clock_hertz not in gpu or M.gpu_sm_clock_max_hertz not in gpu:
        return
    for g, rows in gpu.groupby("gpu", sort=True):
        ratio = rows[M.gpu_sm_clock_hertz] / rows[M.gpu_sm_clock_max_hertz]
        _line(fig, _binned(rows.assign(_r=ratio), "_r", ctx.bin_s), f"gpu {g} SM clock / maximum")
        if M.gpu_clock_throttle_active in rows:
            flags = [(t, _flat(v)) for t, v in zip(rows["t"].tolist(), rows[M.gpu_clock_throttle_active].tolist())
                     if isinstance(v, dict)]
            import pandas as pd

            wide = pd.DataFrame([d for _, d in flags], index=[t for t, _ in flags]) if flags else pd.DataFrame()
            for reason in wide.columns:
                if reason != "gpu_idle" and wide[reason].fillna(0).any():
                    s = wide[reason].groupby((wide.index.to_numpy(float) // ctx.bin_s) * ctx.bin_s).max()
                    _line(fig, s, f"gpu {g} reason active: {reason}", line={"shape": "hv", "dash": "dot"})


def _draw_memory_by_owner(ctx, f, fig):
    proc = ctx.table("process", f)
    col = M.process_gpu_memory_bytes
    if proc.empty or col not in proc:
        return
    owner = "pod" if "pod" in proc and proc["pod"].notna().any() else "pid"
    for key, rows in proc.dropna(subset=[col]).groupby(owner, sort=True):
        rows = I._thin(rows.groupby("t", as_index=False)[col].sum()) if owner == "pod" else I._thin(rows)
        name = rows["process"].iloc[-1] if owner == "pid" and "process" in rows else ""
        fig.add_trace(_go().Scatter(x=I._x(rows["t"]), y=rows[col] / GIB, mode="lines", stackgroup="owners",
                                    name=f"{owner} {key} {name}".strip()))
    eng = ctx.table("engine", f)
    _line(fig, _binned(eng, M.engine_kv_capacity_bytes, ctx.bin_s) / GIB, "engine KV capacity",
          line={"dash": "dash", "color": "#c00000"})


def _draw_free_block(ctx, f, fig):
    proc = ctx.table("process", f, by_pid=True)
    col = M.process_torch_largest_free_block_bytes
    if not proc.empty and col in proc:
        for pid, rows in proc.dropna(subset=[col]).groupby("pid", sort=True):
            rows = I._thin(rows)
            fig.add_trace(_go().Scatter(x=I._x(rows["t"]), y=rows[col] / GIB, mode="lines",
                                        name=f"pid {pid} largest free block"))
    eng = ctx.table("engine", f)
    col = M.engine_kv_failed_request_bytes
    if not eng.empty and col in eng:
        failed = eng[eng[col].fillna(0) > 0]
        if not failed.empty:
            fig.add_trace(_go().Scatter(x=I._x(failed["t"]), y=failed[col] / GIB, mode="markers",
                                        name="failed KV request size", marker={"color": "red", "symbol": "x"}))


def _draw_reserved_minus_allocated(ctx, f, fig):
    cols = _layer_columns()
    proc = ctx.table("process", f, by_pid=True)
    if proc.empty or cols["white"] not in proc or cols["grey"] not in proc:
        return
    for pid, rows in proc.groupby("pid", sort=True):
        rows = I._thin(rows.dropna(subset=[cols["white"], cols["grey"]]))
        if not rows.empty:
            fig.add_trace(_go().Scatter(x=I._x(rows["t"]), y=(rows[cols["grey"]] - rows[cols["white"]]) / GIB,
                                        mode="lines", fill="tozeroy", name=f"pid {pid} reserved - allocated"))


def _latency_drawer(metric: str, short: str):
    def draw(ctx, f, fig):
        from gpudiag.analyzers.latency_regression import SLO_P99_S

        req = ctx.table("request", f)
        bin_s = max(ctx.bin_s, I.CHART_BIN_S)  # a P99 needs a minute's requests
        if not req.empty and metric in req:
            for q, dash in ((0.5, "dot"), (0.99, "solid")):
                _line(fig, _binned(req, metric, bin_s, lambda v, q=q: v.quantile(q)),
                      f"{short} P{q * 100:.0f} (per {bin_s:.0f} s)", mode="lines+markers", line={"dash": dash})
        else:  # no request rows (vLLM's metrics, Prometheus): the P99 of each interval's histogram
            p99 = I.interval_p99(ctx.table("engine", f), metric)
            if not p99.empty:
                _line(fig, p99.set_index("t")["p99_s"], f"{short} P99 (per interval)")
        if not fig.data:
            return
        base = next((e.baseline for e in f.evidence if e.metric == metric.replace("_seconds", "_p99_seconds")), None)
        source = (f.details.get("baseline_source") or {}).get(metric)
        if base is not None and source != "slo":
            fig.add_hline(y=base, line={"color": "#2a7", "dash": "dash"},
                          annotation_text=f"baseline P99 {fmt_seconds(base)}", annotation_position="bottom right")
        if metric in SLO_P99_S:
            fig.add_hline(y=SLO_P99_S[metric], line={"color": "#c00000", "dash": "dashdot"},
                          annotation_text=f"SLO P99 {fmt_seconds(SLO_P99_S[metric])}", annotation_position="top right")

    return draw


def _draw_queue_avalanche(ctx, f, fig):
    eng = ctx.table("engine", f)
    _line(fig, _binned(eng, M.num_requests_waiting, ctx.bin_s), "requests waiting")
    _line(fig, _binned(eng, M.num_requests_running, ctx.bin_s), "requests running")


def _draw_timeouts_restarts(ctx, f, fig):
    eng = ctx.table("engine", f)
    for col, name in ((M.engine_requests_timed_out_total, "timed out"), (M.engine_requests_rejected_total, "rejected"),
                      (M.engine_requests_failed_total, "failed"), (M.engine_restarts_total, "engine restarts")):
        _bars(fig, _increase(eng, col, ctx.bin_s), f"{name} per {ctx.bin_s:.0f} s")


def _draw_hit_ratio(ctx, f, fig):
    eng = ctx.table("engine", f)
    bin_s = max(ctx.bin_s, I.CHART_BIN_S)
    hits = _increase(eng, M.prefix_cache_hits_total, bin_s)
    queries = _increase(eng, M.prefix_cache_queries_total, bin_s)
    if len(queries):
        _line(fig, (hits / queries.where(queries > 0)).dropna(), "prefix cache hit ratio (tokens)")


def _draw_recomputed(ctx, f, fig):
    eng = ctx.table("engine", f)
    _bars(fig, _increase(eng, M.engine_prefix_cache_recomputed_tokens_total, ctx.bin_s),
          f"prompt tokens recomputed per {ctx.bin_s:.0f} s")


def _draw_error_events(ctx, f, fig):
    gpu = ctx.table("gpu", f)
    for col, label in ((M.gpu_xid_errors_total, "XID"), (M.gpu_ecc_errors_total, "ECC"),
                       (M.gpu_nvlink_errors_total, "NVLink"), (M.gpu_remapped_rows_total, "remapped rows"),
                       (M.gpu_retired_pages_total, "retired pages")):
        if col in gpu and gpu[col].map(lambda v: isinstance(v, dict)).any():
            for key, s in labelled_counter_increases(gpu, col, ctx.bin_s).items():
                _bars(fig, s, f"{label} {key}")
        elif col in gpu:
            _bars(fig, _increase(gpu, col, ctx.bin_s, ("gpu",)), label)
    fig.update_layout(barmode="stack")


def _draw_memory_generic(ctx, f, fig):
    proc = ctx.table("process", f)
    cols = _layer_columns()
    if proc.empty or "pid" not in proc:
        return
    _colour_lines(fig, proc, cols)


def _draw_util_generic(ctx, f, fig):
    _per_gpu(ctx, f, fig, M.gpu_utilization_ratio, "utilization")


UTILIZATION = Chart("GPU utilization", (M.gpu_utilization_ratio,), _draw_util_generic, "ratio")
THREE_COLOURS = Chart("Device memory per process: the three colours",
                      tuple(_col for _col in (M.process_torch_allocated_bytes, M.process_torch_reserved_bytes,
                                              M.process_gpu_memory_bytes)), _draw_memory_generic, "GiB")
LEAK_TREND = Chart("The three colours with the fitted trend and the time to OOM", THREE_COLOURS.series,
                   _draw_three_colours_trend, "GiB")
TTFT = Chart("TTFT P50 / P99 with the baseline and the SLO", (M.time_to_first_token_seconds,),
             _latency_drawer(M.time_to_first_token_seconds, "TTFT"), "seconds")
TPOT = Chart("TPOT P50 / P99 with the baseline and the SLO", (M.inter_token_latency_seconds,),
             _latency_drawer(M.inter_token_latency_seconds, "TPOT"), "seconds")

# Which charts show each finding kind's case (the evidence its analyzer judged). A kind not listed
# gets GENERIC_CHARTS.
EVIDENCE_CHARTS: dict[str, tuple[Chart, ...]] = {
    "cpu_starved_gpu": (
        Chart("GPU utilization beside the hottest host thread's CPU",
              (M.gpu_utilization_ratio, M.process_thread_cpu_max_ratio, M.node_cpu_utilization_ratio),
              _draw_gpu_and_thread, "ratio"),
        Chart("Requests queued for the GPU and for the host",
              (M.num_requests_waiting, M.engine_preprocess_backlog_requests, M.engine_batch_size),
              _draw_queue, "requests"),
    ),
    "degenerate_kernel_launch": (
        Chart("Kernel launches per second by grid shape",
              (M.cuda_function_launches_total, M.cuda_function_grid_blocks),
              _draw_launches_by_grid, "launches per second"),
        Chart("GPU time per launch", (M.cuda_function_duration_seconds,), _draw_kernel_time, "seconds"),
    ),
    "memory_leak": (LEAK_TREND,),
    "oom_forecast": (LEAK_TREND,),
    "kv_eviction_storm": (
        Chart("KV evictions and allocation failures",
              (M.engine_kv_evictions_total, M.num_preemptions_total, M.engine_kv_alloc_failures_total),
              _draw_evictions, "events per bin"),
        Chart("KV cache usage and GPU utilization", (M.kv_cache_usage_perc, M.gpu_utilization_ratio),
              _draw_kv_usage_util, "ratio"),
        Chart("TPOT P99 by context length", (M.inter_token_latency_seconds, "prompt_tokens", "output_tokens"),
              _draw_tpot_by_context, "seconds"),
    ),
    "throttling": (
        Chart("SM clock against throttle reasons", (M.gpu_sm_clock_hertz, M.gpu_sm_clock_max_hertz,
                                                    M.gpu_clock_throttle_active), _draw_clocks_reasons, "ratio"),
    ),
    "gpu_cotenant": (
        Chart("Device memory by process", (M.process_gpu_memory_bytes, M.engine_kv_capacity_bytes),
              _draw_memory_by_owner, "GiB"),
    ),
    "memory_fragmentation": (
        Chart("Largest free block vs failed request size",
              (M.process_torch_largest_free_block_bytes, M.engine_kv_failed_request_bytes), _draw_free_block, "GiB"),
        Chart("Reserved - allocated (cached, no tensor)", (M.process_torch_reserved_bytes,
                                                            M.process_torch_allocated_bytes),
              _draw_reserved_minus_allocated, "GiB"),
    ),
    "latency_regression": (TTFT, TPOT),
    "queue_avalanche": (
        Chart("Requests waiting and running", (M.num_requests_waiting, M.num_requests_running),
              _draw_queue_avalanche, "requests"),
        Chart("Timeouts, rejections and restarts",
              (M.engine_requests_timed_out_total, M.engine_requests_rejected_total, M.engine_restarts_total),
              _draw_timeouts_restarts, "events per bin"),
    ),
    "prefix_cache_thrash": (
        Chart("Prefix cache hit ratio", (M.prefix_cache_hits_total, M.prefix_cache_queries_total),
              _draw_hit_ratio, "ratio"),
        Chart("Prompt tokens recomputed after prefix-cache evictions",
              (M.engine_prefix_cache_recomputed_tokens_total,), _draw_recomputed, "tokens per bin"),
    ),
    "hardware_errors": (
        Chart("XID, ECC and NVLink error events", (M.gpu_xid_errors_total, M.gpu_ecc_errors_total,
                                                   M.gpu_nvlink_errors_total), _draw_error_events, "events per bin"),
    ),
}
GENERIC_CHARTS: tuple[Chart, ...] = (UTILIZATION, THREE_COLOURS)


def charts_for(kind: str) -> tuple[Chart, ...]:
    """The charts of a finding kind's evidence (:data:`GENERIC_CHARTS` for a kind without a declaration)."""
    return EVIDENCE_CHARTS.get(kind, GENERIC_CHARTS)


# --- one chart ---------------------------------------------------------------------------


def _shade(fig, f: Finding, ctx: Context, *, own: bool) -> None:
    """The finding's span as a labelled band with a legend entry."""
    end = f.end_s if f.end_s > f.start_s else f.start_s + ctx.bin_s  # an instant still shows
    x0, x1 = I._x(np.array([f.start_s, end]))
    label = f"{f.kind} ({f.severity.value})" + ("" if own else ", cause")
    fig.add_vrect(x0=x0, x1=x1, fillcolor=SEVERITY_FILL[f.severity.value], layer="below",
                  line={"width": 1 if own else 0, "color": SEVERITY_LINE[f.severity.value]},
                  # A cause's label runs up its band's left edge: it would cover the own label at the top.
                  label={"text": label, "textposition": "top left" if own else "middle left",
                         "textangle": 0 if own else -90,
                         "font": {"size": 11, "color": SEVERITY_LINE[f.severity.value]}},
                  name=f"span: {label}", showlegend=True)


def figure(chart: Chart, ctx: Context, f: Finding, causes: list[Finding]) -> go.Figure | None:
    """The chart drawn for one finding (its span and its causes' spans shaded); None when it has no data."""
    fig = _go().Figure()
    chart.draw(ctx, f, fig)
    if not fig.data:
        return None
    for cause in causes:
        _shade(fig, cause, ctx, own=False)
    _shade(fig, f, ctx, own=True)
    if chart.y == "ratio":
        fig.update_yaxes(range=[0, 1.05], title="ratio (0 to 1)", tickformat=".0%")
    else:
        fig.update_yaxes(rangemode="tozero", title=chart.y)
    fig.update_layout(title=chart.title, height=340, margin={"l": 60, "r": 20, "t": 50, "b": 40},
                      legend={"font": {"size": 10}}, template="plotly_white")
    return fig


# --- the causal chain --------------------------------------------------------------------

BOX_W, BOX_H, GAP_X, GAP_Y = 250, 58, 70, 18


def chain_svg(findings: list[Finding], window: Window) -> str:
    """The causal chain as an inline SVG: a box per finding (kind, severity, start), arrows cause -> effect.

    Columns are depths in the chain (a root first, then what it caused); each box links to its section.
    """
    by_id = {f.id: f for f in findings}
    depth: dict[str, int] = {}

    def depth_of(f: Finding, seen=()) -> int:
        if f.id not in depth:
            causes = [by_id[c] for c in f.caused_by if c in by_id and c not in seen]
            depth[f.id] = 1 + max((depth_of(c, (*seen, f.id)) for c in causes), default=-1)
        return depth[f.id]

    columns: dict[int, list[Finding]] = {}
    for f in sorted(findings, key=lambda f: (f.start_s, f.kind)):
        columns.setdefault(depth_of(f), []).append(f)
    pos = {}
    for d, fs in columns.items():
        for i, f in enumerate(fs):
            pos[f.id] = (10 + d * (BOX_W + GAP_X), 10 + i * (BOX_H + GAP_Y))
    width = 20 + (max(columns) + 1) * (BOX_W + GAP_X) - GAP_X
    height = 20 + max(len(fs) for fs in columns.values()) * (BOX_H + GAP_Y) - GAP_Y
    parts = ["<defs><marker id='arrow' viewBox='0 0 10 10' refX='10' refY='5' markerWidth='8' markerHeight='8' "
             "orient='auto-start-reverse'><path d='M 0 0 L 10 5 L 0 10 z' fill='#444'/></marker></defs>"]
    for f in findings:
        for c in f.caused_by:
            if c in pos:
                (x0, y0), (x1, y1) = pos[c], pos[f.id]
                parts.append(f"<line class='cause' x1='{x0 + BOX_W}' y1='{y0 + BOX_H / 2}' x2='{x1}' "
                             f"y2='{y1 + BOX_H / 2}' stroke='#444' stroke-width='1.5' marker-end='url(#arrow)'/>")
    for f in findings:
        x, y = pos[f.id]
        sev = f.severity.value
        when = _when(f.start_s, window)
        parts.append(
            f"<a href='#{H.escape(_anchor(f))}'><g class='finding'><rect x='{x}' y='{y}' width='{BOX_W}' "
            f"height='{BOX_H}' rx='6' fill='{SEVERITY_FILL[sev]}' stroke='{SEVERITY_LINE[sev]}' stroke-width='1.5'/>"
            f"<text x='{x + 8}' y='{y + 20}' font-size='14' font-weight='bold'>{H.escape(f.kind)}</text>"
            f"<text x='{x + 8}' y='{y + 40}' font-size='12' fill='{SEVERITY_LINE[sev]}'>{H.escape(sev)}, "
            f"from {H.escape(when)}</text></g></a>")
    return (f"<svg id='chain' xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' "
            f"font-family='sans-serif'>{''.join(parts)}</svg>")


def _when(t: float, window: Window) -> str:
    """A time as the window reads it: offset from the start for a simulated time base, else ISO."""
    if t < 1e9:
        return f"{fmt_seconds(t - window.start_s)} in"
    return I.iso(t)


def _anchor(f: Finding) -> str:
    return f"finding-{f.id}"


# --- the page -----------------------------------------------------------------------------

# A chart that fails to draw says so on the page (and to a browser test) instead of leaving a blank space.
ERROR_BOX_JS = ("window.addEventListener('error',function(e){var b=document.getElementById('report-errors');"
                "if(b){b.hidden=false;b.textContent+='A chart could not be drawn: '+e.message+'\\n';}});")


def _bin_seconds(window: Window) -> float:
    span = (window.end_s or 0.0) - (window.start_s or 0.0)
    return SHORT_BIN_S if 0 < span < SHORT_WINDOW_S else I.CHART_BIN_S


def _section(f: Finding, findings: list[Finding], ctx: Context, first_chart: list[bool]) -> str:
    by_id = {x.id: x for x in findings}
    causes = [by_id[c] for c in f.caused_by if c in by_id]
    end = "ongoing at the window's end" if f.open else _when(f.end_s, ctx.window)
    evidence = "".join(
        f"<tr><td>{H.escape(e.metric)}</td><td>{H.escape(fmt_value(e.observed, e.unit))}</td>"
        f"<td>{H.escape(fmt_value(e.baseline, e.unit)) if e.baseline is not None else ''}</td>"
        f"<td>{H.escape(fmt_value(e.threshold, e.unit)) if e.threshold is not None else ''}</td></tr>"
        for e in f.evidence)
    caused = ("<p>caused by: " + ", ".join(f"<a href='#{H.escape(_anchor(c))}'>{H.escape(c.kind)}</a>"
                                           for c in causes) + "</p>") if causes else ""
    out = [f"<section class='finding' id='{H.escape(_anchor(f))}' data-kind='{H.escape(f.kind)}'>"
           f"<h2><span class='sev sev-{f.severity.value}'>{H.escape(f.severity.value)}</span> {H.escape(f.kind)}</h2>"
           f"<p class='span'>from {H.escape(_when(f.start_s, ctx.window))} to {H.escape(end)}</p>"
           f"<p>{H.escape(f.summary)}</p>{caused}"
           + (f"<table class='evidence'><tr><th>evidence</th><th>observed</th><th>baseline</th><th>threshold</th>"
              f"</tr>{evidence}</table>" if evidence else "")]
    for i, chart in enumerate(charts_for(f.kind)):
        fig = figure(chart, ctx, f, causes)
        if fig is None:
            out.append(f"<p class='no-chart'>{H.escape(chart.title)}: not drawn, no data in this window for "
                       f"{H.escape(', '.join(chart.series))}</p>")
            continue
        out.append(fig.to_html(full_html=False, include_plotlyjs=first_chart[0],
                               div_id=f"chart-{_anchor(f)}-{i}", config={"displaylogo": False}))
        first_chart[0] = False
    return "".join(out) + "</section>"


def html_report(window: Window, findings: list[Finding], covered: dict[str, Any] | None = None) -> str:
    """One self-contained HTML page (plotly embedded once, no CDN): the causal chain, a section per
    finding with the charts of its evidence, what could not be checked and the coverage
    (``covered``: :func:`gpudiag.investigate.coverage` of the window, when already known)."""
    ctx = Context(window, _bin_seconds(window), {})
    ordered = sorted(findings, key=lambda f: (f.start_s, -f.severity.rank, f.kind))
    first_chart = [True]
    sections = [_section(f, findings, ctx, first_chart) for f in ordered]
    if not findings:
        generic = Finding("window", I.Severity.INFO, window.start_s, window.end_s, "no findings")
        for chart in GENERIC_CHARTS:
            fig = figure(chart, ctx, generic, [])
            if fig is not None:
                fig.layout.shapes, fig.layout.annotations = (), ()
                sections.append(fig.to_html(full_html=False, include_plotlyjs=first_chart[0]))
                first_chart[0] = False
    missing = "".join(f"<li>{H.escape(g['check'])}: {H.escape(g['reason'])}</li>" for g in I.gaps(window))
    covered = I.coverage(window) if covered is None else covered
    title = f"gpudiag investigate {I.iso(window.start_s)} to {I.iso(window.end_s)}"
    chain = (f"<h2>What happened</h2>{chain_svg(findings, window)}"
             "<p class='legend'>Arrows run from cause to effect; a box links to its finding. Shaded bands on the "
             "charts are findings' spans (framed: the section's own finding).</p>"
             if findings else "<h2>No findings</h2>")
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{H.escape(title)}</title>"
            "<style>body{font-family:sans-serif;margin:1em;max-width:1400px}td,th{padding:2px 8px;text-align:left}"
            "#report-errors{color:#b00;border:1px solid #b00;padding:4px}"
            "section.finding{border-top:2px solid #ddd;margin-top:1.5em}.no-chart{color:#666;font-style:italic}"
            ".sev{padding:1px 6px;border-radius:4px;color:#fff;font-size:0.8em}.sev-critical{background:#c00000}"
            ".sev-warning{background:#d08000}.sev-info{background:#0060c0}table.evidence{font-size:0.9em}</style>"
            f"<script>{ERROR_BOX_JS}</script>"
            "</head><body><pre id='report-errors' hidden></pre>"
            f"<h1>{H.escape(title)}</h1><p>sources: {H.escape(', '.join(window.sources))}</p>"
            + chain + "".join(sections)
            + (f"<h3>Could not be checked</h3><ul>{missing}</ul>" if missing else "")
            + I.coverage_html(covered, bool(findings)) + "</body></html>")

