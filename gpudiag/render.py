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

from gpudiag.findings import Evidence, Finding
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
        if f.pod:
            gpu += f" pod {f.namespace + '/' if f.namespace else ''}{f.pod}"
        end = "ongoing at the run's end" if f.open else fmt_seconds(f.end_s)
        head.append(f"{gpu}  {fmt_seconds(f.start_s)} → {end}\n")
        head.append("  " * depth + "   " + f.summary)
        if f.caused_by:
            head.append("\n" + "  " * depth + "   caused by: " + ", ".join(f.caused_by), style="dim")
        parts.append(head)
        parts.append(evidence_table(f.evidence, " "))
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


def identity_column(table: Table, header: str, labels: Iterable[object] = (), *,
                    max_width: int = IDENTITY_MAX_WIDTH, **options) -> None:
    """Add the column that names a row: as wide as its longest label, up to ``max_width``; never "…".

    Labels that fit ``max_width`` stay on one line. A longer label wraps at its
    words (a single long word folds) within ``max_width``, whole, instead of
    losing the characters that tell two rows apart; held on one line it would
    push the figures beside it off the screen's edge (rich lets a column's
    minimum win over the screen).
    """
    widest = max([len(header)] + [len(str(v)) for v in labels])
    if widest <= max_width:
        table.add_column(header, no_wrap=True, overflow="fold", min_width=widest, **options)
    else:
        table.add_column(header, overflow="fold", width=max_width, **options)


def figure_column(table: Table, header: str, **options) -> None:
    """Add a column of figures: it folds rather than truncates, and its header's words stay whole."""
    options.setdefault("min_width", max(len(word) for word in header.split()) if header.strip() else 1)
    table.add_column(header, overflow="fold", **options)


def text_column(table: Table, header: str, **options) -> None:
    """Add a free-text column (a summary, a reason): it wraps at words and takes the width that is left."""
    options.setdefault("ratio", 1)
    table.add_column(header, overflow="fold", **options)


# The widest an evidence table's metric column grows: the longest metric names (42 characters,
# process_torch_external_fragmentation_ratio) with a chain's indent stay on one line beside the
# three figures at 80 columns inside a panel (76 - 28 for the figures and their spaces).
EVIDENCE_METRIC_MAX_WIDTH = 48


def evidence_table(evidence: Iterable[Evidence], indent: str = "") -> Table:
    """A finding's evidence: each metric named whole (folded, never cut), its figures beside it.

    ``indent`` goes before each metric name, so the table sits under its finding in a chain.
    """
    evidence = list(evidence)
    table = terminal_table(box=None, header_style="dim")
    identity_column(table, indent + "metric", [indent + e.metric for e in evidence],
                    max_width=EVIDENCE_METRIC_MAX_WIDTH)
    for col in ("observed", "baseline", "threshold"):
        figure_column(table, col)
    for e in evidence:
        table.add_row(indent + e.metric, fmt_value(e.observed, e.unit), fmt_value(e.baseline, e.unit),
                      fmt_value(e.threshold, e.unit))
    return table
