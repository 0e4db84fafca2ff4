"""``gpudiag investigate``: from an alert to a root cause in one command, over a window of the store or Prometheus
(or of recorded files: :mod:`gpudiag.file_source`).

Exit codes (usable from scripts and alert webhooks; gpudiag.investigate.EXIT_*): 0 nothing of
warning level found and every analyzer could judge the window, 1 a warning or critical finding,
2 bad input, 3 inconclusive: nothing of warning level found, but some analyzers could not judge
the window (an input missing, or the window too short for them; the coverage section says which).
"""

from __future__ import annotations

import json
import sys
from typing import Optional

import typer
from rich.console import Console, Group
from rich.panel import Panel
from rich.text import Text

from gpudiag.render import evidence_table, figure_column, identity_column, terminal_table
from gpudiag.units import fmt_bytes, fmt_seconds

_STYLE = {"critical": "bold red", "warning": "yellow", "info": "cyan"}


def register(app: typer.Typer) -> None:
    """Add ``gpudiag investigate``."""
    app.command("investigate")(investigate)


def investigate(
    store: Optional[str] = typer.Option(None, "--store", help="Timeline store written by `gpudiag agent` (SQLite)."),
    prometheus: Optional[str] = typer.Option(
        None, "--prometheus", help="Read the window from this Prometheus (or Thanos, Mimir) instead of a store: "
        "series of gpudiag's agent, dcgm-exporter and vLLM, e.g. http://prometheus:9090."),
    since: Optional[str] = typer.Option(
        None, "--since", help="Window length back from the latest sample: 90s, 30m, 2h, 1d (default 30m). "
        "With --prometheus it counts back from now. With a store and a running agent the latest sample is "
        "about now; a store written earlier, or by `agent --sim` (simulated time base: the agent's start time "
        "plus simulated seconds), ends where its data ends."),
    start: Optional[str] = typer.Option(None, "--from", help="Window start: ISO-8601 (no offset = local time) "
                                        "or Unix seconds."),
    end: Optional[str] = typer.Option(None, "--to", help="Window end (default: the store's latest sample; "
                                      "now with --prometheus)."),
    node: Optional[str] = typer.Option(None, "--node", help="Only this node's rows."),
    gpu: Optional[int] = typer.Option(None, "--gpu", help="Only this GPU's rows (index)."),
    step: Optional[str] = typer.Option(None, "--step", help="With --prometheus: the range queries' step (1s, "
                                       "15s). Default: the sample spacing of the most often scraped exporter, "
                                       "widened on long windows."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document on stdout."),
    html: Optional[str] = typer.Option(None, "--html", help="Also write a self-contained HTML report (charts) "
                                       "to this file."),
    files: Optional[list[str]] = typer.Option(
        None, "--file", help="Read the window from recorded telemetry instead: nvidia-smi --query-gpu logs, "
        "dcgm-exporter dumps (long CSV or text), OpenMetrics, a folder of /metrics scrapes; the format is "
        "recognised by content. Repeat --file, or list more paths after it. The window is the whole recording "
        "unless --from/--to select in it; --since counts back from its last sample."),
    more_files: Optional[list[str]] = typer.Argument(None, hidden=True),
):
    """Run every analyzer over a window of the store, Prometheus or recorded files: causal chain, evidence,
    memory, next steps, gaps and coverage.

    Exit codes: 0 nothing of warning level found, and every analyzer could judge the window;
    1 a warning or critical finding; 2 bad input (one line on stderr); 3 inconclusive: nothing
    of warning level found, but some analyzers could not judge the window (an input missing, or
    the window too short for them: see the coverage section).
    """
    from gpudiag import investigate as I
    from gpudiag.errors import GpudiagError

    if more_files and not files:
        raise GpudiagError(f"unexpected argument {more_files[0]!r}: paths of recorded files follow --file")
    files = [*(files or []), *(more_files or [])]
    given = [o for o, v in (("--store", store), ("--prometheus", prometheus), ("--file", files or None)) if v]
    if len(given) > 1:
        raise GpudiagError(f"{' and '.join(given)} exclude each other: give one source of the window, "
                           f"--store PATH, --prometheus URL or --file PATH ({' and '.join(given)} were both given)")
    if not given:
        raise GpudiagError("give the window's source: --store PATH (the agent's store) or --prometheus URL, "
                           "or --file PATH (recorded telemetry)")
    if step is not None and prometheus is None:
        raise GpudiagError("--step applies to --prometheus only (a store holds every sample)")
    bar = _Progress(enabled=sys.stderr.isatty() and not (as_json and not sys.stdout.isatty()))
    try:
        if prometheus is not None:
            from gpudiag import promql_source

            lo, hi = promql_source.resolve_window(since=since, start=start, end=end)
            bar.long = hi - lo >= PROGRESS_MIN_WINDOW_S
            window = promql_source.load_window(prometheus, since=since, start=start, end=end, node=node, gpu=gpu,
                                               step=step, progress=bar)
        elif files:
            from gpudiag import file_source

            bar.long = file_source.total_bytes(files) >= file_source.PROGRESS_MIN_BYTES
            window, reads = file_source.load_window(files, since=since, start=start, end=end, node=node, gpu=gpu,
                                                    progress=bar)
            bar.long = bar.long or window.end_s - window.start_s >= PROGRESS_MIN_WINDOW_S
        else:
            window = I.load_store_window(store, since=since, start=start, end=end, node=node, gpu=gpu)
            bar.long = window.end_s - window.start_s >= PROGRESS_MIN_WINDOW_S
        logged = [f for r in reads for f in r.findings] if files else []
        findings = _analyze(window, bar, logged)
        bar("report", 0, 1)
        covered = I.coverage(window)
        doc = I.document(window, findings, covered)
        if files:
            doc["files"] = [r.to_dict() for r in reads]
        if html is not None:
            I.write_html(html, window, findings, covered)
    finally:
        bar.close()
    from gpudiag.cli import skip_teardown

    skip_teardown()  # the window is not needed any more, and a day's takes long to free
    if as_json:
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
    else:
        out = Console(file=sys.stdout, highlight=False)
        if files:
            from gpudiag.file_source import describe

            for read in doc["files"]:
                for line in describe(read):
                    out.print(line, markup=False)
        _print(out, doc, findings, html)
    return I.exit_code(findings, covered)


# Windows shorter than this are analyzed in a few seconds: no bar flickers over them.
PROGRESS_MIN_WINDOW_S = 3600.0


class _Progress:
    """A transient progress bar on stderr, drawn only when enabled and the window is long."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.long = False
        self._bar = None
        self._task = None

    def __call__(self, description: str, done: int, total: int) -> None:
        if not (self.enabled and self.long):
            return
        if self._bar is None:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._bar = Progress(TextColumn("{task.description:<40}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), console=Console(file=sys.stderr), transient=True)
            self._bar.start()
            self._task = self._bar.add_task(description, total=total)
        # Stages are coarse (a range query, an analyzer): draw each one, not only what a 10 Hz refresh catches.
        self._bar.update(self._task, description=description, completed=done, total=total, refresh=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


def _analyze(window, progress, logged: list | None = None) -> list:
    """Every analyzer of the registry over the window, one progress step each, concluded as run_all does;
    ``logged``: findings read from logs (out-of-memory messages), joined before the chain is made."""
    from gpudiag.analyzers.registry import ANALYZERS, conclude

    findings = list(logged or [])
    for i, (kind, analyze) in enumerate(ANALYZERS.items()):
        progress(f"analyzer {kind}", i, len(ANALYZERS))
        findings.extend(analyze(window))
    progress("causal chain", len(ANALYZERS), len(ANALYZERS))
    return conclude(window, findings)


def _when(t: float | None, origin: float) -> str:
    from gpudiag.investigate import iso

    if t is None:
        return "n/a"
    return f"{iso(t)} (+{fmt_seconds(t - origin)})"


def _print(out: Console, doc: dict, findings, html: str | None) -> None:
    from gpudiag.investigate import coverage_verdict, iso

    w = doc["window"]
    origin = w["start_s"]
    covered = doc["coverage"]
    out.print(f"window {iso(w['start_s'])} to {iso(w['end_s'])} ({fmt_seconds(w['end_s'] - w['start_s'])})"
              f"  sources: {', '.join(doc['sources'])}", markup=False)
    if not findings:
        out.print(Panel(Text(coverage_verdict(covered, False), style="green" if covered["conclusive"] else "yellow"),
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
                                         "" if f.pid is None else f" pid {f.pid}",
                                         f" pod {f.namespace + '/' if f.namespace else ''}{f.pod}" if f.pod else ""))
            end = "ongoing at the window's end" if f.open else _when(f.end_s, origin)
            head.append(f"{entity}   {_when(f.start_s, origin)} → {end}\n")
            head.append(pad + "   " + f.summary)
            if f.caused_by:
                head.append("\n" + pad + "   caused by: " + ", ".join(f.caused_by), style="dim")
            parts.append(head)
            parts.append(evidence_table(f.evidence, "   " + pad))
        out.print(Panel(Group(*parts), title="Causal chain (root cause first)"))
    mem = [m for m in doc["memory"] if m["implicated"]] or doc["memory"]
    if mem:
        label = "implicated processes" if any(m["implicated"] for m in doc["memory"]) else "processes"
        table = terminal_table(f"Three-colour memory of the {label} (latest sample)")
        pods = any(m.get("pod") for m in mem)  # on Kubernetes: namespace/pod beside the process
        for col in ("node", "gpu", "pid", "process") + (("pod",) if pods else ()):
            identity_column(table, col, [_pod_of(m) if col == "pod" else "" if m[col] is None else m[col] for m in mem],
                            justify="left" if col in ("node", "process", "pod") else "right")
        for col in ("white", "grey", "black", "grey-white", "black-grey", "largest free block"):
            figure_column(table, col, justify="right")
        for m in mem:
            table.add_row(str(m["node"]), str(m["gpu"]), str(m["pid"]), str(m["process"] or ""),
                          *([_pod_of(m)] if pods else []),
                          fmt_bytes(m["white_bytes"]), fmt_bytes(m["grey_bytes"]), fmt_bytes(m["black_bytes"]),
                          fmt_bytes(m["grey_minus_white_bytes"]), fmt_bytes(m["black_minus_grey_bytes"]),
                          fmt_bytes(m["largest_free_block_bytes"]))
        out.print(table)
        reasons = sorted({r for m in mem for r in m["missing"].values()})
        for r in reasons:
            out.print(f"  n/a: {r}", markup=False, style="dim")
    if doc["next_steps"]:
        out.print("What to do next:", style="bold")
        shown: set[str] = set()  # a fix several findings share is shown under the first of them
        for step in doc["next_steps"]:
            out.print(f"  read the runbook:  {step['command']}", markup=False)
            for cmd in step["repro"]:
                if cmd not in shown:
                    shown.add(cmd)
                    out.print(f"    check a fix:     {cmd}", markup=False)
    if doc["gaps"]:
        out.print("Could not be checked:", style="bold")
        for g in doc["gaps"]:
            blinded = f" (blinds {', '.join(g['analyzers'])})" if g["analyzers"] else ""
            out.print(f"  {g['check']}: {g['reason']}{blinded}", markup=False)
    _print_coverage(out, covered, bool(findings))
    if html is not None:
        out.print(f"HTML report: {html}", markup=False)


def _print_coverage(out: Console, covered: dict, found: bool) -> None:
    """What could be judged: the analyzers that ran (on how much data), those that did not and why,
    the symptoms left unjudged."""
    from gpudiag.investigate import coverage_verdict

    out.print(f"Coverage: {coverage_verdict(covered, found)}", style="bold", markup=False)
    for r in covered["ran"]:
        kinds = dict.fromkeys((i["kind"], i["rows"], i["seconds"]) for i in r["inputs"])
        data = ", ".join(f"{kind} {rows} rows over {fmt_seconds(seconds)}" for kind, rows, seconds in kinds)
        out.print(f"  ran          {r['analyzer']}: {data}", markup=False)
    for r in covered["not_run"]:
        out.print(f"  did not run  {r['analyzer']}: {r['detail']}", markup=False, style="yellow")
    for u in covered["unjudged"]:
        out.print(f"  unjudged     {u['symptom']}: {u['detail']}", markup=False, style="dim")


def _pod_of(m: dict) -> str:
    """``namespace/pod`` of a memory row; "-" for a process in no known pod."""
    pod, ns = m.get("pod"), m.get("namespace")
    return (f"{ns}/{pod}" if ns else pod) if pod else "-"
