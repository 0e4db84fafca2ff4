"""``gpudiag analyze``: reports on recorded artifacts -- profiler traces and memory snapshots."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from gpudiag.units import fmt_bytes, fmt_ratio, fmt_seconds

analyze_app = typer.Typer(
    help="Analyze recorded artifacts: PyTorch profiler traces and memory snapshots.",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode=None,
)


def register(app: typer.Typer) -> None:
    """Add the ``analyze`` sub-commands to the gpudiag app."""
    app.add_typer(analyze_app, name="analyze")


def _json_safe(v: Any) -> Any:
    if isinstance(v, float):
        return None if math.isnan(v) or math.isinf(v) else v
    if isinstance(v, dict):
        return {k: _json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_json_safe(x) for x in v]
    return v


def _emit_json(doc: dict) -> None:
    sys.stdout.write(json.dumps(_json_safe(doc), indent=2) + "\n")


def _pct(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f} %"


def _print_findings(console: Console, findings: list[dict]) -> None:
    if not findings:
        console.print("No findings.")
        return
    for f in findings:
        console.print(f"[{f['severity']}] {f['kind']}: {f['summary']}", markup=False)
        console.print(f"    runbook {f['runbook']}; fixes: {', '.join(f['fixes']) or 'none'}", markup=False)


@analyze_app.command("trace")
def trace_command(
    file: Annotated[Path, typer.Argument(help="PyTorch profiler (Kineto) trace, .json or .json.gz.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON document instead of tables.")] = False,
) -> None:
    """Idle / compute / non-compute time of the device and per stream, idle causes, queue length and launch delay."""
    from gpudiag.analyzers.kineto import analyze_trace, skipped_text
    from gpudiag.analyzers.trace_reader import read_kineto_trace

    trace = read_kineto_trace(file)
    report = analyze_trace(trace)
    doc = report.to_dict()
    doc["file"] = str(file)
    if as_json:
        _emit_json(doc)
        return
    console = Console()
    device = "MTIA device" if doc["device_kind"] == "MTIA" else "GPU"
    overall = Table(title=f"{device} time in {file.name} (Holistic Trace Analysis definitions)")
    for col in ("span", "idle", "compute", "non-compute", "profiler steps", "workload"):
        overall.add_column(col, justify="right")
    steps = f"{doc['profiler_steps']}" + (" (last excluded)" if doc["last_step_excluded"] else "")
    overall.add_row(fmt_seconds(doc["span_s"]), _pct(doc["idle_pct"]), _pct(doc["compute_pct"]),
                    _pct(doc["non_compute_pct"]), steps, doc["workload"]["kind"])
    console.print(overall)
    time_table = Table(title="Per stream, sync records left out: time (host / kernel / other are shares of idle time)")
    for col in ("stream", "role", "idle", "compute", "non-compute", "host wait", "kernel wait", "other"):
        time_table.add_column(col, justify="right")
    queue_table = Table(title="Per stream: launch queue and launch delay (launches onto an idle stream)")
    for col in ("stream", "queue mean", "queue max", "queue empty", "delay p50", "delay p95", "queued"):
        queue_table.add_column(col, justify="right")
    for s in doc["streams"]:
        ib, q, d = s["idle_breakdown"], s["queue_length"], s["launch_delay"]
        name = f"{s['stream']}" + (" *" if s["stream"] == doc["busiest_stream"] else "")
        time_table.add_row(name, s["role"], _pct(s["idle_pct"]), _pct(s["compute_pct"]), _pct(s["non_compute_pct"]),
                           fmt_ratio(ib["host_wait_ratio"]), fmt_ratio(ib["kernel_wait_ratio"]),
                           fmt_ratio(ib["other_ratio"]))
        queue_table.add_row(name, "n/a" if q["mean"] is None else f"{q['mean']:.1f}",
                            "n/a" if q["max"] is None else f"{q['max']:.0f}",
                            fmt_ratio(q["empty_time_ratio"]), fmt_seconds(d["p50_s"]), fmt_seconds(d["p95_s"]),
                            str(d["queued"]))
    console.print(time_table)
    console.print(queue_table)
    console.print("* the compute stream (most compute time; a stream mostly running NCCL kernels never counts)")
    skipped = skipped_text(doc["skipped_activities"], doc["skipped_example"])
    if skipped:
        console.print(skipped, markup=False)
    _print_findings(console, doc["findings"])
    for f in doc["findings"]:
        _print_trace_finding_details(console, f.get("details", {}))


def _print_trace_finding_details(console: Console, details: dict) -> None:
    """The workload, the evidence behind each fix and what was missing, under a trace finding."""
    if details.get("workload"):
        console.print(f"    workload: {details['workload']} ({'; '.join(details.get('workload_reasons', []))})",
                      markup=False)
    for fix, why in (details.get("fix_evidence") or {}).items():
        console.print(f"    {fix}: {why}", markup=False)
    if details.get("missing"):
        console.print(f"    missing: {details['missing']}", markup=False)


@analyze_app.command("snapshot")
def snapshot_command(
    file: Annotated[Path, typer.Argument(help="Pickled torch.cuda.memory._snapshot() (from _dump_snapshot).")],
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON document instead of tables.")] = False,
    html: Annotated[Path | None, typer.Option("--html", help="Also write a self-contained HTML segment map.")] = None,
    top: Annotated[int, typer.Option("--top", min=1, help="Segments in the table, most free bytes first.")] = 20,
) -> None:
    """Fragmentation of the caching allocator: free bytes, largest hole, per segment and overall."""
    from gpudiag.analyzers.snapshot import fragmentation_report, write_segment_map_html
    from gpudiag.safe_pickle import load_snapshot

    report = fragmentation_report(load_snapshot(file))
    if html is not None:
        write_segment_map_html(report, html)
    doc = report.to_dict()
    doc["file"] = str(file)
    doc["html"] = None if html is None else str(html)
    if as_json:
        _emit_json(doc)
        return
    console = Console()
    totals = Table(title=f"Caching allocator in {file.name}")
    totals.add_column("")
    for d in doc["devices"]:
        totals.add_column(f"GPU {d['device']}", justify="right")
    rows = [
        ("segments", "segment_count", str), ("reserved", "reserved_bytes", fmt_bytes),
        ("allocated", "allocated_bytes", fmt_bytes), ("pending free", "pending_free_bytes", fmt_bytes),
        ("free", "free_bytes", fmt_bytes), ("largest free block", "largest_free_block_bytes", fmt_bytes),
        ("external fragmentation", "external_fragmentation_ratio", fmt_ratio),
        ("inactive split", "inactive_split_bytes", fmt_bytes), ("OOM events", "oom_events", str),
    ]
    for label, key, fmt in rows:
        totals.add_row(label, *(fmt(d[key]) for d in doc["devices"]))
    console.print(totals)
    segs = sorted(doc["segments"], key=lambda s: -s["free_bytes"])[:top]
    if segs:
        table = Table(title=f"Segments with the most free bytes ({len(segs)} of {len(doc['segments'])})")
        for col in ("#", "GPU", "pool", "reserved", "allocated", "free", "largest free", "frag.", "blocks"):
            table.add_column(col, justify="right")
        for s in segs:
            table.add_row(str(s["index"]), str(s["device"]), s["segment_type"], fmt_bytes(s["reserved_bytes"]),
                          fmt_bytes(s["allocated_bytes"]), fmt_bytes(s["free_bytes"]),
                          fmt_bytes(s["largest_free_block_bytes"]), fmt_ratio(s["external_fragmentation_ratio"]),
                          str(s["block_count"]))
        console.print(table)
    _print_findings(console, doc["findings"])
    if html is not None:
        console.print(f"Segment map written to {html}")
