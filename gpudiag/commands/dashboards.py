"""``gpudiag dashboards``: export the Grafana dashboards, alert rules and runbooks, or regenerate them.

``export --out DIR`` writes DIR/dashboards/*.json (Grafana's dashboard JSON
model, for file provisioning or import), DIR/alerts.yaml (Prometheus
rule_files) and DIR/runbooks/<AlertName>.md, with every runbook_url and
dashboard link pointing at ``--runbook-base-url``. ``generate`` rewrites the
committed files from the catalog; ``generate --check`` only says whether they
are up to date (exit 1 and the stale files when not).
"""

from __future__ import annotations

import json
from pathlib import Path

import typer

from gpudiag.errors import GpudiagError


def export(out: Path, runbook_base_url: str) -> dict[str, list[str]]:
    """Write dashboards, alert rules and runbooks under ``out``; returns the paths written by kind."""
    from gpudiag.dashboards import alerts, generate

    from .runbook import runbooks

    if not runbook_base_url.startswith(("http://", "https://", "file://")):
        raise GpudiagError(f"--runbook-base-url must be an http(s):// or file:// URL, not {runbook_base_url!r}")
    try:
        (out / "dashboards").mkdir(parents=True, exist_ok=True)
        (out / "runbooks").mkdir(parents=True, exist_ok=True)
        written: dict[str, list[str]] = {"dashboards": [], "rules": [], "runbooks": []}
        for key, fn in generate.DASHBOARDS.items():
            path = out / "dashboards" / f"gpudiag-{key}.json"
            path.write_text(generate.dump_json(fn(runbook_base_url)), encoding="utf-8")
            written["dashboards"].append(str(path))
        rules = out / alerts.RULES_FILE
        rules.write_text(alerts.render_rules(runbook_base_url), encoding="utf-8")
        written["rules"].append(str(rules))
        from gpudiag.dashboards import engine_rules

        recorded = out / engine_rules.RULES_FILE  # the alerts on engine series read these recorded names
        recorded.write_text(engine_rules.render_rules(), encoding="utf-8")
        written["rules"].append(str(recorded))
        for name, text in runbooks().items():
            path = out / "runbooks" / f"{name}.md"
            path.write_text(text, encoding="utf-8")
            written["runbooks"].append(str(path))
    except OSError as exc:
        raise GpudiagError(f"cannot write to {out}: {exc.strerror or exc}") from None
    return written


def register(app: typer.Typer) -> None:
    """Add ``gpudiag dashboards export|generate``."""
    from gpudiag.dashboards import DEFAULT_RUNBOOK_BASE_URL

    sub = typer.Typer(help="Grafana dashboards, Prometheus alert rules and runbooks.", no_args_is_help=True)

    @sub.command("export")
    def export_command(
        out: Path = typer.Option(..., "--out", metavar="DIR", help="Folder to write into (created)."),
        runbook_base_url: str = typer.Option(DEFAULT_RUNBOOK_BASE_URL, "--runbook-base-url", metavar="URL",
                                             help="Where runbooks/<AlertName>.md will be served."),
        as_json: bool = typer.Option(False, "--json", help="Print the files written as one JSON document."),
    ):
        """Write the dashboards, alert rules and runbooks for import into Grafana and Prometheus."""
        written = export(out, runbook_base_url)
        if as_json:
            typer.echo(json.dumps(written, indent=2))
        else:
            for kind, paths in written.items():
                typer.echo(f"{kind}: {len(paths)} file(s) in {Path(paths[0]).parent}")

    @sub.command("generate")
    def generate_command(
        check: bool = typer.Option(False, "--check", help="Only check that the committed files are up to date."),
    ):
        """Regenerate the committed dashboards, alerts.yaml and alerts_test.yaml from the catalog."""
        from gpudiag.dashboards import generate

        if check:
            stale = generate.stale_files()
            if stale:
                typer.echo("stale generated files (run `gpudiag dashboards generate`): " + ", ".join(stale), err=True)
                raise typer.Exit(1)
            typer.echo("generated files are up to date")
            return
        for path in generate.write_all():
            typer.echo(str(path))

    app.add_typer(sub, name="dashboards")
