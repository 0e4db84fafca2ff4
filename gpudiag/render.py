"""Terminal rendering (rich): findings as a timeline with evidence tables, and the tables every command draws.

Tables share one width policy, so output reads at 80 columns and in a pipe:
the column that says which row this is (a GPU, a process, an engine, a
scenario) is never cut — it keeps its width and folds only if it alone is
wider than the screen; figures fold rather than end in "…"; free text wraps
at words and takes the room that is left.
"""

from __future__ import annotations

from collections.abc import Iterable

from rich import box
from rich.console import Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from gpudiag.findings import Finding
from gpudiag.units import fmt_seconds, fmt_value

# The widest an identity column claims before its labels fold: a long scenario or process
# name still leaves room for the figures beside it on an 80-column terminal.
IDENTITY_MAX_WIDTH = 28

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


def terminal_table(title: str | None = None, **options) -> Table:
    """A table drawn the house's way: a simple header rule, no outer padding, the title on the left."""
    options.setdefault("box", box.SIMPLE_HEAD)
    options.setdefault("pad_edge", False)
    options.setdefault("collapse_padding", True)  # one space between columns: 80 columns hold one more figure
    return Table(title=title, title_justify="left", **options)


def identity_column(table: Table, header: str, labels: Iterable[object] = (), **options) -> None:
    """Add the column that names a row: as wide as its longest label (up to IDENTITY_MAX_WIDTH), never "…".

    A label longer than the screen allows folds onto the next line, whole,
    instead of losing the characters that tell two rows apart.
    """
    widest = max([len(header)] + [len(str(v)) for v in labels])
    table.add_column(header, no_wrap=True, overflow="fold", min_width=min(widest, IDENTITY_MAX_WIDTH), **options)


def figure_column(table: Table, header: str, **options) -> None:
    """Add a column of figures: it folds rather than truncates, and its header's words stay whole."""
    options.setdefault("min_width", max(len(word) for word in header.split()) if header.strip() else 1)
    table.add_column(header, overflow="fold", **options)


def text_column(table: Table, header: str, **options) -> None:
    """Add a free-text column (a summary, a reason): it wraps at words and takes the width that is left."""
    options.setdefault("ratio", 1)
    table.add_column(header, overflow="fold", **options)
