"""``gpudiag fingerprint FILE.safetensors [...]``: which weights is this, exactly?"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from gpudiag.errors import GpudiagError
from gpudiag.units import fmt_bytes


def register(app: typer.Typer) -> None:
    """Add the ``fingerprint`` command."""

    @app.command("fingerprint")
    def fingerprint(
        files: Annotated[list[Path], typer.Argument(
            metavar="FILE.safetensors...", help="safetensors files (several: the shards of one model).")],
        json_out: Annotated[bool, typer.Option("--json", help="Print one JSON document.")] = False,
    ) -> None:
        """SHA-256 over every tensor's name, dtype, shape and bytes, in name order.

        Identifies a swapped or corrupted model file independently of its name
        and of the order of tensors inside it. With several files, each gets a
        digest, and if they are shards of one model (no tensor name repeats)
        so does the whole: equal to the digest of the unsharded file.
        """
        from gpudiag.reference_engine.model.fingerprint import fingerprint_file, fingerprint_files

        per_file = [fingerprint_file(f) for f in files]
        combined = None
        combined_note = None
        if len(files) > 1:
            try:
                combined = fingerprint_files(files)
            except GpudiagError as exc:
                combined_note = str(exc)
        if json_out:
            doc = {"files": [{"path": str(f), **fp.to_dict()} for f, fp in zip(files, per_file)],
                   "combined": combined.to_dict() if combined else None}
            if combined_note:
                doc["combined_note"] = combined_note
            typer.echo(json.dumps(doc, indent=2))
            return
        from rich.console import Console

        out = Console(soft_wrap=True, highlight=False)
        for f, fp in zip(files, per_file):
            out.print(f"{fp.sha256}  {f}  ({fp.tensor_count} tensors, {fmt_bytes(fp.tensor_bytes)})")
        if combined:
            out.print(f"{combined.sha256}  (all {len(files)} files as one model: "
                      f"{combined.tensor_count} tensors, {fmt_bytes(combined.tensor_bytes)})")
        elif combined_note:
            out.print(f"no combined digest: {combined_note}")
