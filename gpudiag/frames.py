"""Frames and windows: the data that flows from probes to the store and the analyzers.

A probe yields a Frame per tick: one row (a plain dict) per entity — a GPU, a
process on a GPU, a serving engine, a finished request, the node, a (pid, CUDA
API) pair. Row keys are entity labels (``gpu``, ``uuid``, ``pid``,
``process``, ``node``, ``engine``, ``api``, ...) and metric columns from the
catalog (``M.gpu_utilization_ratio``, ...). Counters are cumulative, as in
Prometheus; analyzers take differences.

A Window is a time range of frames as one pandas DataFrame per kind, each with
a ``t`` column (seconds; simulated seconds on the simulated GPU, Unix time
otherwise). Analyzers take a Window and return findings.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable

if TYPE_CHECKING:  # pandas is imported where windows are built: probes only need Frame
    import pandas as pd

FRAME_KINDS = ("gpu", "process", "engine", "request", "node", "cuda_api")


@dataclass
class Frame:
    """One tick of one probe: rows of one entity kind at time ``t``."""

    kind: str
    t: float
    rows: list[dict[str, Any]]

    def __post_init__(self):
        if self.kind not in FRAME_KINDS:
            raise ValueError(f"unknown frame kind {self.kind!r}; expected one of {', '.join(FRAME_KINDS)}")


@dataclass
class Window:
    """Frames of one time range, one DataFrame per kind, plus what is known about gaps."""

    tables: dict[str, pd.DataFrame]
    start_s: float
    end_s: float
    node: str | None = None
    sources: list[str] = field(default_factory=list)
    gaps: list[str] = field(default_factory=list)  # what could not be observed, and why

    def table(self, kind: str) -> pd.DataFrame:
        """The DataFrame of one kind, sorted by ``t``; an empty one (with ``t``) when absent."""
        df = self.tables.get(kind)
        if df is None:
            import pandas as pd

            return pd.DataFrame({"t": pd.Series(dtype=float)})
        return df

    def has(self, kind: str, column: str | None = None) -> bool:
        """True when the window holds rows of ``kind`` (with a non-null ``column``, if given)."""
        df = self.tables.get(kind)
        if df is None or df.empty:
            return False
        if column is None:
            return True
        return column in df.columns and bool(df[column].notna().any())

    @classmethod
    def from_frames(cls, frames: Iterable[Frame], *, node: str | None = None,
                    sources: list[str] | None = None, gaps: list[str] | None = None) -> "Window":
        """Build a window from frames (rows of the same kind are concatenated)."""
        rows: dict[str, list[dict[str, Any]]] = {}
        start, end = float("inf"), float("-inf")
        for fr in frames:
            start, end = min(start, fr.t), max(end, fr.t)
            bucket = rows.setdefault(fr.kind, [])
            for r in fr.rows:
                bucket.append({"t": fr.t, **r})
        return cls.from_rows(rows, start_s=start if start != float("inf") else 0.0,
                             end_s=end if end != float("-inf") else 0.0,
                             node=node, sources=sources, gaps=gaps)

    @classmethod
    def from_rows(cls, rows: dict[str, list[dict[str, Any]]], *, start_s: float, end_s: float,
                  node: str | None = None, sources: list[str] | None = None,
                  gaps: list[str] | None = None) -> "Window":
        """Build a window from row lists per kind (each row carries its own ``t``)."""
        import pandas as pd

        tables = {}
        for kind, rs in rows.items():
            if rs:
                tables[kind] = pd.DataFrame.from_records(rs).sort_values("t", kind="stable").reset_index(drop=True)
        return cls(tables, start_s, end_s, node, list(sources or []), list(gaps or []))
