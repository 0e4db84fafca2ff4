"""``gpudiag export``: the store's frames as Parquet or CSV files that DuckDB, pandas and polars read as they are.

One file per frame kind and interval (default: an hour), plain columns under the catalog's names,
SI units, labels as strings (see :mod:`gpudiag.export`). ``--parquet`` needs pyarrow (the
``export`` extra); ``--csv`` needs nothing more.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Optional

import typer


def register(app: typer.Typer) -> None:
    """Add ``gpudiag export``."""
    app.command("export")(export)


def export(
    store: Optional[str] = typer.Option(None, "--store", help="Timeline store written by `gpudiag agent` (SQLite)."),
    start: Optional[str] = typer.Option(None, "--from", help="Start: ISO-8601 (no offset = local time) or Unix "
                                        "seconds (default: the store's first sample)."),
    end: Optional[str] = typer.Option(None, "--to", help="End, included (default: the store's last sample)."),
    kind: Optional[str] = typer.Option(None, "--kind", help="Frame kinds, comma-separated: gpu,process,engine,"
                                       "request,node,cuda_api (default: all)."),
    parquet: Optional[str] = typer.Option(None, "--parquet", help="Write Parquet files into this directory "
                                          "(needs pyarrow: pip install 'gpudiag[export]')."),
    csv_dir: Optional[str] = typer.Option(None, "--csv", help="Write CSV files into this directory."),
    interval: str = typer.Option("1h", "--interval", help="One file per kind and interval of this length, cut at "
                                 "its multiples in UTC (30m, 1h, 1d)."),
    node: Optional[str] = typer.Option(None, "--node", help="Only this node's rows."),
    progress: Optional[bool] = typer.Option(None, "--progress/--no-progress", help="A line per interval on "
                                            "stderr (default: on a terminal)."),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON summary (files, rows, columns) on stdout."),
):
    """Export the store's frames to Parquet or CSV: one file per kind and interval, plain columns.

    Exit codes: 0 written; 2 bad input (one line on stderr).
    """
    from gpudiag import export as X
    from gpudiag.errors import GpudiagError
    from gpudiag.investigate import parse_duration, parse_time

    if store is None:
        raise GpudiagError("give the store to export: --store PATH (written by gpudiag agent)")
    if (parquet is None) == (csv_dir is None):
        raise GpudiagError("give one output: --parquet DIR or --csv DIR")
    fmt, out_dir = ("parquet", parquet) if parquet is not None else ("csv", csv_dir)
    kinds = X.parse_kinds(kind)
    interval_s = parse_duration(interval)
    if interval_s < 1:
        raise GpudiagError(f"--interval {interval!r} is under a second")
    if fmt == "parquet" and not X.have_pyarrow():
        raise GpudiagError(X.INSTALL_PYARROW)
    lo = parse_time(start, "--from") if start is not None else None
    hi = parse_time(end, "--to") if end is not None else None
    if lo is not None and hi is not None and lo >= hi:
        raise GpudiagError(f"--from ({X.iso(lo)}) must be before --to ({X.iso(hi)})")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise GpudiagError(f"{out_dir} exists and is not a directory")

    from gpudiag.agent.store import Store

    with Store.open(store, readonly=True) as db:
        held = db.time_range()
        if held is None:
            raise GpudiagError(f"store {store} holds no frames")
        first, last = held
        lo = first if lo is None else lo
        hi = last if hi is None else hi
        if lo > hi:
            raise GpudiagError(f"--from ({X.iso(lo)}) is after the store's last sample ({X.iso(last)})"
                               if start is not None else
                               f"--to ({X.iso(hi)}) is before the store's first sample ({X.iso(first)})")
        if lo > last or hi < first:
            raise GpudiagError(f"no data between {X.iso(lo)} and {X.iso(hi)}: the store holds "
                               f"{X.iso(first)} to {X.iso(last)}")
        try:
            os.makedirs(out_dir, exist_ok=True)
        except OSError as exc:
            raise GpudiagError(f"cannot create {out_dir}: {exc.strerror or exc}") from None
        show = sys.stderr.isatty() if progress is None else progress
        try:
            summary = X.export_store(db, start_s=lo, end_s=hi, kinds=kinds, fmt=fmt, out_dir=out_dir,
                                     interval_s=interval_s, node=node,
                                     progress=X.stderr_progress if show else None)
        except OSError as exc:
            raise GpudiagError(f"cannot write into {out_dir}: {exc.strerror or exc}") from None
    if as_json:
        sys.stdout.write(json.dumps(summary, indent=2) + "\n")
        return 0
    total = sum(summary["rows"].values())
    for k, n in summary["rows"].items():
        files = [f for f in summary["files"] if f["kind"] == k]
        if files:
            size = sum(f["bytes"] for f in files)
            typer.echo(f"{k:<9} {n:>12,} rows  {len(files):>4} files  {size / 2**20:9.1f} MiB")
    typer.echo(f"{total:,} rows from {summary['from_iso']} to {summary['to_iso']} in "
               f"{len(summary['files'])} {fmt.upper()} files under {summary['dir']}")
    return 0
