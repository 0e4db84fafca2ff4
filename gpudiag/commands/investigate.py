"""``gpudiag investigate``: from an alert to a root cause in one command, over a window of the store.

Exit code 0 when nothing of warning level or above is found, 1 when
something is, 2 on bad input (usable from scripts and alert webhooks).
"""

from __future__ import annotations

import json
import sys
from typing import Optional

import typer
from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from gpudiag.units import fmt_bytes, fmt_seconds, fmt_value

_STYLE = {"critical": "bold red", "warning": "yellow", "info": "cyan"}


def register(app: typer.Typer) -> None:
    """Add ``gpudiag investigate``."""
    app.command("investigate")(investigate)


def investigate(
    store: str = typer.Option(..., "--store", help="Timeline store written by `gpudiag agent` (SQLite)."),
    since: Optional[str] = typer.Option(
        None, "--since", help="Window length back from the store's latest sample: 90s, 30m, 2h, 1d (default 30m). "
        "With a running agent the latest sample is about now; a store written earlier, or by `agent --sim` "
        "(simulated time base: the agent's start time plus simulated seconds), ends where its data ends."),
    start: Optional[str] = typer.Option(None, "--from", help="Window start: ISO-8601 (no offset = local time) "
                                        "or Unix seconds."),
    end: Optional[str] = typer.Option(None, "--to", help="Window end (default: the store's latest sample)."),
    node: Optional[str] = typer.Option(None, "--node", help="Only this node's rows."),
    gpu: Optional[int] = typer.Option(None, "--gpu", help="Only this GPU's rows (index)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document on stdout."),
    html: Optional[str] = typer.Option(None, "--html", help="Also write a self-contained HTML report (charts) "
                                       "to this file."),
):
    """Run every analyzer over a window of the store: causal chain, evidence, memory, next steps, gaps."""
    from gpudiag import investigate as I
    from gpudiag.analyzers.registry import run_all

    window = I.load_store_window(store, since=since, start=start, end=end, node=node, gpu=gpu)
    findings = run_all(window)
    doc = I.document(window, findings)
    if html is not None:
        I.write_html(html, window, findings)
    if as_json:
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
    else:
        _print(Console(file=sys.stdout, highlight=False), doc, findings, html)
    return I.exit_code(findings)


def _when(t: float | None, origin: float) -> str:
    from gpudiag.investigate import _iso

    if t is None:
        return "n/a"
    return f"{_iso(t)} (+{fmt_seconds(t - origin)})"


def _print(out: Console, doc: dict, findings, html: str | None) -> None:
    from gpudiag.investigate import _iso

    w = doc["window"]
    origin = w["start_s"]
    out.print(f"window {_iso(w['start_s'])} to {_iso(w['end_s'])} ({fmt_seconds(w['end_s'] - w['start_s'])})"
              f"  sources: {', '.join(doc['sources'])}", markup=False)
    if not findings:
        out.print(Panel(Text("nothing found: no analyzer reports a problem in this window", style="green"),
                        title="Causal chain"))
    else:
        parts = []
        ids = {f.id for f in findings}
        for f in findings:
            depth = 1 if any(c in ids for c in f.caused_by) else 0
            pad = "   " * depth
            head = Text(pad + ("└─ " if depth else ""))
            head.append(f"[{f.severity.value}] ", style=_STYLE[f.severity.value])
            head.append(f.kind, style="bold")
            entity = "".join(x for x in (f" node {f.node}" if f.node else "", "" if f.gpu is None else f" gpu {f.gpu}",
                                         "" if f.pid is None else f" pid {f.pid}"))
            head.append(f"{entity}   {_when(f.start_s, origin)} → {_when(f.end_s, origin)}\n")
            head.append(pad + "   " + f.summary)
            if f.caused_by:
                head.append("\n" + pad + "   caused by: " + ", ".join(f.caused_by), style="dim")
            parts.append(head)
            ev = Table(show_header=True, header_style="dim", box=None, padding=(0, 1))
            for col in ("   " + pad + "metric", "observed", "baseline", "threshold"):
                ev.add_column(col)
            for e in f.evidence:
                ev.add_row("   " + pad + e.metric, fmt_value(e.observed, e.unit), fmt_value(e.baseline, e.unit),
                           fmt_value(e.threshold, e.unit))
            parts.append(ev)
        out.print(Panel(Group(*parts), title="Causal chain (root cause first)"))
    mem = [m for m in doc["memory"] if m["implicated"]] or doc["memory"]
    if mem:
        label = "implicated processes" if any(m["implicated"] for m in doc["memory"]) else "processes"
        table = Table(title=f"Three-colour memory of the {label} (latest sample)")
        for col in ("node", "gpu", "pid", "process", "white", "grey", "black", "grey-white", "black-grey",
                    "largest free block"):
            table.add_column(col, justify="left" if col in ("node", "process") else "right")
        for m in mem:
            table.add_row(str(m["node"]), str(m["gpu"]), str(m["pid"]), str(m["process"] or ""),
                          fmt_bytes(m["white_bytes"]), fmt_bytes(m["grey_bytes"]), fmt_bytes(m["black_bytes"]),
                          fmt_bytes(m["grey_minus_white_bytes"]), fmt_bytes(m["black_minus_grey_bytes"]),
                          fmt_bytes(m["largest_free_block_bytes"]))
        out.print(table)
        reasons = sorted({r for m in mem for r in m["missing"].values()})
        for r in reasons:
            out.print(f"  n/a: {r}", markup=False, style="dim")
    if doc["next_steps"]:
        out.print("What to do next:", style="bold")
        for step in doc["next_steps"]:
            out.print(f"  read the runbook:  {step['command']}", markup=False)
            for cmd in step["repro"]:
                out.print(f"    check a fix:     {cmd}", markup=False)
    if doc["gaps"]:
        out.print("Could not be checked:", style="bold")
        for g in doc["gaps"]:
            blinded = f" (blinds {', '.join(g['analyzers'])})" if g["analyzers"] else ""
            out.print(f"  {g['check']}: {g['reason']}{blinded}", markup=False)
    if html is not None:
        out.print(f"HTML report: {html}", markup=False)
