"""``gpudiag runbook [NAME]``: the runbook an alert links to, rendered in the terminal, or the list of them.

Runbooks are package data of gpudiag.runbooks (runbooks/<AlertName>.md), so
they read the same offline as at the alert's runbook_url. NAME is an alert
name (GpudiagKvEvictionStorm, any case) or a finding kind
(kv_eviction_storm).
"""

from __future__ import annotations

import json
from importlib import resources

import typer
from rich.console import Console
from rich.markdown import Markdown
from rich.table import Table

from gpudiag.errors import GpudiagError
from gpudiag.findings import alert_name


def runbooks() -> dict[str, str]:
    """Alert name -> Markdown text of every shipped runbook, sorted by name."""
    root = resources.files("gpudiag.runbooks")
    out = {}
    for entry in root.iterdir():
        if entry.name.endswith(".md"):
            out[entry.name[:-3]] = entry.read_text(encoding="utf-8")
    return dict(sorted(out.items()))


def summary(markdown: str) -> str:
    """The first paragraph of the Meaning section, on one line."""
    lines = markdown.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip().lower() == "## meaning") + 1
    except StopIteration:
        return ""
    para: list[str] = []
    for line in lines[start:]:
        if not line.strip():
            if para:
                break
            continue
        if line.startswith("#"):
            break
        para.append(line.strip())
    return " ".join(para)


def resolve(name: str, books: dict[str, str]) -> str:
    """The runbook name for an alert name (any case) or a finding kind; GpudiagError when there is none."""
    by_lower = {k.lower(): k for k in books}
    for candidate in (name, alert_name(name.strip().lower().replace("-", "_"))):
        key = by_lower.get(candidate.strip().lower())
        if key:
            return key
    raise GpudiagError(f"no runbook named {name!r}; `gpudiag runbook` lists them")


def register(app: typer.Typer) -> None:
    """Add ``gpudiag runbook``."""

    @app.command("runbook")
    def runbook_command(
        name: str = typer.Argument(None, metavar="NAME", help="Alert name (GpudiagKvEvictionStorm) or finding kind."),
        as_json: bool = typer.Option(False, "--json", help="Print one JSON document."),
    ):
        """Show the runbook of an alert (rendered Markdown), or list the runbooks."""
        books = runbooks()
        if name is None:
            items = [{"name": k, "summary": summary(v)} for k, v in books.items()]
            if as_json:
                typer.echo(json.dumps({"runbooks": items}, indent=2))
                return
            table = Table("runbook", "meaning", title="gpudiag runbooks (gpudiag runbook NAME)")
            for it in items:
                table.add_row(it["name"], it["summary"])
            Console().print(table)
            return
        key = resolve(name, books)
        if as_json:
            typer.echo(json.dumps({"name": key, "summary": summary(books[key]), "markdown": books[key]}, indent=2))
            return
        Console().print(Markdown(books[key]))
