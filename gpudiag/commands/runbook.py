"""``gpudiag runbook [NAME]``: the runbook an alert links to, rendered in the terminal, or the list of them.

Runbooks are package data of gpudiag.runbooks (runbooks/<AlertName>.md), so
they read the same offline as at the alert's runbook_url. NAME is an alert
name (GpudiagKvEvictionStorm, any case) or a finding kind
(kv_eviction_storm).

The list is plain text, one runbook a line (its name, then the first
sentence of its meaning, shortened to the width), so it reads at 80 columns
and greps. A runbook is rich Markdown on a terminal and its Markdown source
in a pipe.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from importlib import resources

import typer
from rich.console import Console
from rich.markdown import Markdown

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


def first_sentence(text: str) -> str:
    """The first sentence of a Markdown paragraph, inline markup (`code`, **bold**, links) taken out."""
    plain = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    plain = re.sub(r"[`*_]{1,2}([^`*_]+)[`*_]{1,2}", r"\1", plain)
    m = re.match(r"(.+?[.!?])(\s|$)", plain)
    return (m.group(1) if m else plain).strip()


def list_lines(items: list[dict[str, str]], width: int) -> list[str]:
    """``NAME  first sentence of its meaning`` a line, names aligned, each line at most ``width`` wide.

    The name is never shortened (it is what ``gpudiag runbook NAME`` takes);
    the sentence is cut at a word and ends in "…" when the width runs out.
    """
    name_width = max([len(it["name"]) for it in items] + [len("runbook")])
    room = max(width - name_width - 2, 10)
    lines = []
    for it in items:
        text = first_sentence(it["summary"])
        if len(text) > room:
            text = text[: room - 1].rsplit(" ", 1)[0].rstrip(" ,;:—-") + "…"
        lines.append(f"{it['name']:<{name_width}}  {text}".rstrip())
    return lines


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
            width = shutil.get_terminal_size((80, 24)).columns  # COLUMNS, else the terminal, else 80
            typer.echo("\n".join(list_lines(items, width)))
            typer.echo(f"\n{len(items)} runbooks: gpudiag runbook NAME shows one")
            return
        key = resolve(name, books)
        if as_json:
            typer.echo(json.dumps({"name": key, "summary": summary(books[key]), "markdown": books[key]}, indent=2))
            return
        if sys.stdout.isatty():
            Console().print(Markdown(books[key]))
        else:
            typer.echo(books[key].rstrip("\n"))
