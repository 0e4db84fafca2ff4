"""A simulated run's window written to a real store, as the agent would have written it."""

from __future__ import annotations

import math
from collections.abc import Callable

from gpudiag.agent.store import Store
from gpudiag.frames import Frame


def write_window(window, path: str, t0: float, *, edit: Callable[[str, dict], None] | None = None,
                 annotate: Callable[[list[Frame]], list[Frame]] | None = None) -> str:
    """Every table of ``window`` (a repro run's) as frames from ``t0`` on, one flush per kind: ``path``.

    ``edit(kind, row)`` changes a row in place first (what a real probe adds); NaN values are left
    out, as a probe leaves out what it did not measure; ``annotate`` sees each kind's frames.
    """
    store = Store.open(path)
    try:
        for kind, df in window.tables.items():
            by_t: dict[float, list[dict]] = {}
            for row in df.to_dict("records"):
                t = row.pop("t")
                if edit is not None:
                    edit(kind, row)
                by_t.setdefault(t, []).append({k: v for k, v in row.items()
                                               if not (isinstance(v, float) and math.isnan(v))})
            frames = [Frame(kind, t0 + t, rows) for t, rows in by_t.items()]
            store.append(annotate(frames) if annotate is not None else frames)
            store.flush()
    finally:
        store.close()
    return path
