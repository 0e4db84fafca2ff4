"""``gpudiag analyze``: reports on recorded artifacts -- profiler traces and memory snapshots."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from gpudiag.findings import json_ready
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



def _emit_json(doc: dict) -> None:
    sys.stdout.write(json.dumps(json_ready(doc), indent=2) + "\n")


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
    device_total_gib: Annotated[float | None, typer.Option(
        "--device-total-gib", help="Each GPU's memory capacity in GiB, when the snapshot does not record it "
                                   "(torch's does not): stranded memory near capacity is judged only with it.",
    )] = None,
) -> None:
    """The caching allocator: stranded and releasable memory, holes, and what each OOM ran into."""
    from gpudiag.analyzers.snapshot import FIX_ADVICE, fragmentation_report, write_segment_map_html
    from gpudiag.errors import GpudiagError
    from gpudiag.safe_pickle import load_snapshot

    total_bytes = None
    if device_total_gib is not None:
        if not math.isfinite(device_total_gib) or device_total_gib <= 0:
            raise GpudiagError(f"--device-total-gib must be a positive number of GiB, not {device_total_gib}")
        total_bytes = int(device_total_gib * 2**30)
    report = fragmentation_report(load_snapshot(file), device_total_bytes=total_bytes)
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
        ("free", "free_bytes", fmt_bytes),
        ("  releasable (whole free segments)", "releasable_bytes", fmt_bytes),
        ("  stranded (in partly used segments)", "stranded_bytes", fmt_bytes),
        ("largest free block", "largest_free_block_bytes", fmt_bytes),
        ("external fragmentation", "external_fragmentation_ratio", fmt_ratio),
        ("inactive split", "inactive_split_bytes", fmt_bytes), ("OOM events", "oom_events", str),
        ("device capacity", "device_total_bytes", lambda v: "unknown" if v is None else fmt_bytes(v)),
    ]
    for label, key, fmt in rows:
        totals.add_row(label, *(fmt(d[key]) for d in doc["devices"]))
    console.print(totals)
    settings, workload = doc["allocator_settings"], doc["workload"]
    exp = settings["expandable_segments"]
    console.print(f"Expandable segments: {'not recorded' if exp is None else ('on' if exp else 'off')}"
                  + ("" if exp is None else f" (from {settings['expandable_segments_source'].replace('_', ' ')})")
                  + f". Workload: {workload['kind']}"
                  + (f" ({workload['evidence'][0]})" if workload["evidence"] else "") + ".", markup=False)
    if doc["ooms"]:
        ooms = Table(title="OOMs, with the pool replayed to their moment")
        for col in ("GPU", "requested", "free in pool", "largest free block", "free on device", "verdict"):
            ooms.add_column(col, justify="right")
        for o in doc["ooms"]:
            ooms.add_row(str(o["device"]), fmt_bytes(o["requested_bytes"]), fmt_bytes(o["pool_free_bytes"]),
                         fmt_bytes(o["largest_free_block_bytes"]), fmt_bytes(o["device_free_bytes"]),
                         o["verdict"])
        console.print(ooms)
    segs = sorted(doc["segments"], key=lambda s: -s["free_bytes"])[:top]
    if segs:
        table = Table(title=f"Segments with the most free bytes ({len(segs)} of {len(doc['segments'])})")
        for col in ("#", "GPU", "pool", "reserved", "allocated", "free", "largest free", "frag.", "blocks"):
            table.add_column(col, justify="right")
        for s in segs:
            table.add_row(f"{s['index']}" + (" *" if s["releasable"] else ""), str(s["device"]), s["segment_type"],
                          fmt_bytes(s["reserved_bytes"]), fmt_bytes(s["allocated_bytes"]), fmt_bytes(s["free_bytes"]),
                          fmt_bytes(s["largest_free_block_bytes"]), fmt_ratio(s["external_fragmentation_ratio"]),
                          str(s["block_count"]))
        console.print(table)
        if any(s["releasable"] for s in segs):
            console.print("* a whole free segment: releasable cache (empty_cache returns it), not a hole")
    _print_findings(console, doc["findings"])
    fixes = dict.fromkeys(x for f in doc["findings"] for x in f["fixes"])
    for fix in fixes:
        console.print(f"  {fix}: {FIX_ADVICE.get(fix, '')}", markup=False)
    if html is not None:
        console.print(f"Segment map written to {html}")
