"""Terminal rendering of findings (rich): the chain as a timeline, evidence as small tables."""

from __future__ import annotations

from rich.console import Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from gpudiag.findings import Finding
from gpudiag.units import fmt_seconds, fmt_value

_STYLE = {"critical": "bold red", "warning": "yellow", "info": "cyan"}


def findings_panel(findings: list[Finding], title: str = "Findings", scenario=None) -> Panel:
    """The findings in chain order (root cause first), each with its evidence table.

    ``scenario`` (a reference_engine Scenario, for repro's runs): each finding's fixes that
    the scenario offers are shown as the ``gpudiag repro`` command that checks them.
    """
    if not findings:
        return Panel(Text("no findings", style="green"), title=title)
    parts = []
    ids = {f.id for f in findings}
    for f in findings:
        depth = 1 if any(c in ids for c in f.caused_by) else 0
        head = Text("  " * depth + ("└─ " if depth else ""))
        head.append(f"[{f.severity.value}] ", style=_STYLE[f.severity.value])
        head.append(f"{f.kind}", style="bold")
        gpu = "" if f.gpu is None else f" gpu {f.gpu}"
        end = "ongoing at the run's end" if f.open else fmt_seconds(f.end_s)
        head.append(f"{gpu}  {fmt_seconds(f.start_s)} → {end}\n")
        head.append("  " * depth + "   " + f.summary)
        if f.caused_by:
            head.append("\n" + "  " * depth + "   caused by: " + ", ".join(f.caused_by), style="dim")
        parts.append(head)
        ev = Table(show_header=True, header_style="dim", box=None, padding=(0, 1))
        for col in ("metric", "observed", "baseline", "threshold"):
            ev.add_column(col)
        for e in f.evidence:
            ev.add_row(e.metric, fmt_value(e.observed, e.unit), fmt_value(e.baseline, e.unit),
                       fmt_value(e.threshold, e.unit))
        parts.append(ev)
        nxt = Text("  " * depth + f"   runbook: {f.runbook}")
        checks = [f"gpudiag repro {scenario.name} --fix {x}" for x in f.fixes if x in scenario.fixes] \
            if scenario is not None else []
        if checks:
            nxt.append("   check a fix: " + " | ".join(checks), style="dim")
        parts.append(nxt)
    return Panel(Group(*parts), title=title)
