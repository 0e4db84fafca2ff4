"""The store's frames as plain files: one Parquet or CSV file per frame kind and interval.

What a reader gets (DuckDB, pandas, polars, a spreadsheet), whatever the store's own encoding:

- the catalog's column names (``gpu_utilization_ratio``), values in SI units as the store
  holds them (bytes, seconds, hertz, watts, ratios), ``t`` in Unix seconds;
- a catalog metric is a float64 column (a Prometheus sample is a double), so every file of
  one kind has the same type for it whether or not an interval misses a value;
- labels as plain values: text as strings (never dictionary codes or categoricals), a GPU
  index or a pid as an integer;
- a dict-valued column (counters by kind, the reasons a value is missing) as one column per
  key, ``name.key`` (nested: ``name.key.sub``); a column of mixed or nested values that are
  not plain numbers or text as JSON text;
- a missing value as null (an empty CSV field).

Only this module's Parquet writer imports pyarrow (the optional ``export`` extra); the agent
never does.
"""

from __future__ import annotations

import csv
import json
import math
import os
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Callable

import numpy as np

from gpudiag.catalog import CATALOG
from gpudiag.errors import GpudiagError
from gpudiag.frames import FRAME_KINDS, DictColumn, Table

FORMATS = ("parquet", "csv")
DEFAULT_INTERVAL_S = 3600.0  # one file per kind and hour: an hour of a busy node's requests is ~300k rows
# A dict column with more distinct keys than this is written as JSON text: a column per key
# would make a file of thousands of mostly empty columns.
MAX_KEYS_PER_DICT_COLUMN = 256
INSTALL_PYARROW = "--parquet needs pyarrow: pip install 'gpudiag[export]' (or write CSV with --csv DIR)"


@dataclass
class PlainColumn:
    """One output column: ``type`` is float64, int64, bool or string; ``missing`` marks nulls (None: none)."""

    name: str
    type: str
    values: Any  # float64/int64/bool ndarray, or a list of str/None for string
    missing: np.ndarray | None = None

    def python_values(self) -> list:
        """The values as Python objects, None where missing."""
        if self.type == "string":
            return list(self.values)
        out = self.values.tolist()
        if self.missing is not None:
            for i in np.flatnonzero(self.missing):
                out[i] = None
        return out


def _is_missing(v) -> bool:
    return v is None or (isinstance(v, (float, np.floating)) and math.isnan(v))


def _json_text(v) -> str:
    return json.dumps(v, default=str, sort_keys=True, separators=(",", ":"))


def _typed(name: str, values: list, metric: bool) -> PlainColumn:
    """A column of Python objects as the narrowest plain type that holds every value."""
    n = len(values)
    missing = np.fromiter((_is_missing(v) for v in values), dtype=bool, count=n)
    present = [v for v, m in zip(values, missing) if not m]
    types = {type(v) for v in present}
    if not present:
        return PlainColumn(name, "float64", np.full(n, np.nan), missing) if metric else \
            PlainColumn(name, "string", [None] * n, missing)
    if all(issubclass(t, (bool, np.bool_)) for t in types):
        out = np.zeros(n, dtype=bool)
        out[~missing] = [bool(v) for v in present]
        return PlainColumn(name, "bool", out, missing if missing.any() else None)
    if not metric and all(issubclass(t, (int, np.integer)) and not issubclass(t, (bool, np.bool_)) for t in types) \
            and all(-(2**63) <= int(v) < 2**63 for v in present):
        out = np.zeros(n, dtype=np.int64)
        out[~missing] = [int(v) for v in present]
        return PlainColumn(name, "int64", out, missing if missing.any() else None)
    if all(issubclass(t, (int, float, np.integer, np.floating)) and not issubclass(t, (bool, np.bool_))
           for t in types):
        out = np.full(n, np.nan)
        out[~missing] = [float(v) for v in present]
        return PlainColumn(name, "float64", out, missing)
    if all(issubclass(t, str) for t in types):
        return PlainColumn(name, "string", [None if m else v for v, m in zip(values, missing)], missing)
    return PlainColumn(name, "string", [None if m else _json_text(v) for v, m in zip(values, missing)], missing)


def _flatten_into(d: dict, prefix: str, i: int, leaves: dict[str, dict[int, Any]]) -> None:
    for k, v in d.items():
        path = f"{prefix}.{k}"
        if isinstance(v, dict) and v:
            _flatten_into(v, path, i, leaves)
        else:
            leaves.setdefault(path, {})[i] = v


def _flattened(name: str, values: np.ndarray, metric: bool) -> list[PlainColumn] | None:
    """A column of dicts as one column per (nested) key; None when it has too many keys."""
    leaves: dict[str, dict[int, Any]] = {}
    for i, v in enumerate(values):
        if isinstance(v, dict):
            _flatten_into(v, name, i, leaves)
            if len(leaves) > MAX_KEYS_PER_DICT_COLUMN:
                return None
    n = len(values)
    out = []
    for path, at in leaves.items():
        column = [None] * n
        for i, v in at.items():
            column[i] = v
        out.append(_typed(path, column, metric))
    return out


def _text_column(name: str, a: np.ndarray) -> PlainColumn | None:
    """An object column of strings (and None) as a string column, at C speed; None for anything else.

    Labels are most of an export's object columns: testing each value in Python took 70 % of
    exporting a node's hour.
    """
    types = set(map(type, a))
    if not types <= {str, type(None)} or str not in types:
        return None
    if type(None) not in types:
        return PlainColumn(name, "string", a.tolist())
    missing = np.equal(a, None)
    return PlainColumn(name, "string", a.tolist(), missing)


def plain_columns(table: Table) -> list[PlainColumn]:
    """A window's Table of one kind as plain columns (see the module docstring), ``t`` first."""
    out: list[PlainColumn] = []
    names = list(table.columns)
    names.sort(key=lambda c: c != "t")
    for name in names:
        col = table.columns[name]
        metric = name in CATALOG
        a = col.to_objects() if isinstance(col, DictColumn) else np.asarray(col)
        if a.dtype.kind == "f":
            out.append(PlainColumn(name, "float64", a.astype(np.float64, copy=False), np.isnan(a)))
        elif a.dtype.kind in "iu":
            out.append(PlainColumn(name, "float64", a.astype(np.float64)) if metric else
                       PlainColumn(name, "int64", a.astype(np.int64, copy=False)))
        elif a.dtype.kind == "b":
            out.append(PlainColumn(name, "bool", a))
        else:
            text = _text_column(name, a)
            if text is not None:
                out.append(text)
                continue
            present = [v for v in a if not _is_missing(v)]
            flat = _flattened(name, a, metric) if present and all(isinstance(v, dict) for v in present) else None
            out.extend(flat if flat is not None else [_typed(name, list(a), metric)])
    return out


# -- writers ------------------------------------------------------------------------------------
def have_pyarrow() -> bool:
    """True when pyarrow (the ``export`` extra) can be imported."""
    try:
        import pyarrow  # noqa: F401
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        return False
    return True


def write_parquet(path: str, columns: list[PlainColumn]) -> None:
    """Write ``columns`` as one Parquet file (zstd; strings as UTF-8, nulls as nulls)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    types = {"float64": pa.float64(), "int64": pa.int64(), "bool": pa.bool_(), "string": pa.string()}
    arrays = []
    for c in columns:
        if c.type == "string":
            arrays.append(pa.array(c.values, type=pa.string()))
        else:
            mask = c.missing if c.missing is not None and c.missing.any() else None
            arrays.append(pa.array(c.values, type=types[c.type], mask=mask))
    table = pa.Table.from_arrays(arrays, names=[c.name for c in columns])
    tmp = path + ".part"
    pq.write_table(table, tmp, compression="zstd")
    os.replace(tmp, path)


def _csv_cells(c: PlainColumn) -> list:
    if c.type == "float64":
        # repr gives the shortest text that reads back as the very same double. Most columns hold
        # few distinct values (capacities, limits, clocks): each is written out once.
        values = c.values
        distinct, inverse = np.unique(values, return_inverse=True)
        if len(distinct) * 4 <= len(values):
            cells = np.array([repr(v) for v in distinct.tolist()], dtype=object)[inverse.reshape(-1)].tolist()
        else:
            cells = [repr(v) for v in values.tolist()]
    elif c.type == "bool":
        cells = ["true" if v else "false" for v in c.values.tolist()]
    elif c.type == "int64":
        cells = [str(v) for v in c.values.tolist()]
    else:
        return ["" if v is None else v for v in c.values]
    if c.missing is not None:
        for i in np.flatnonzero(c.missing):
            cells[i] = ""
    return cells


def write_csv(path: str, columns: list[PlainColumn]) -> None:
    """Write ``columns`` as one CSV file: a header of names, RFC 4180 quoting, empty fields for nulls."""
    tmp = path + ".part"
    with open(tmp, "w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh, lineterminator="\n")
        w.writerow([c.name for c in columns])
        w.writerows(zip(*(_csv_cells(c) for c in columns)))
    os.replace(tmp, path)


# -- the export ---------------------------------------------------------------------------------
def parse_kinds(text: str | None) -> list[str]:
    """'gpu,process' -> ['gpu', 'process']; every kind when None; GpudiagError naming an unknown one."""
    if text is None:
        return list(FRAME_KINDS)
    kinds = [k.strip() for k in text.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in FRAME_KINDS]
    if unknown or not kinds:
        raise GpudiagError(f"unknown frame kind {unknown[0] if unknown else text!r}; "
                           f"--kind takes a comma-separated list of {', '.join(FRAME_KINDS)}")
    return list(dict.fromkeys(kinds))


def iso(t: float) -> str:
    """Unix seconds as UTC ISO-8601."""
    return datetime.fromtimestamp(t, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _stamp(t: float) -> str:
    return datetime.fromtimestamp(t, tz=timezone.utc).strftime("%Y%m%dT%H%M%SZ")


def intervals(lo: float, hi: float, interval_s: float) -> list[tuple[float, float]]:
    """[lo, hi] cut at multiples of ``interval_s`` (whole hours for 3600): each [a, b), the last [a, hi]."""
    cuts = [lo]
    edge = (math.floor(lo / interval_s) + 1) * interval_s
    while edge < hi:
        cuts.append(edge)
        edge += interval_s
    cuts.append(hi)
    return list(zip(cuts[:-1], cuts[1:]))


def export_store(store, *, start_s: float, end_s: float, kinds: list[str], fmt: str, out_dir: str,
                 interval_s: float = DEFAULT_INTERVAL_S, node: str | None = None,
                 progress: Callable[[int, int, dict], None] | None = None) -> dict[str, Any]:
    """Write the store's rows of ``kinds`` in [start_s, end_s] to ``out_dir``; return the summary.

    ``store`` is an open Store (read-only is enough). One file per kind and interval that holds
    rows, named ``KIND-YYYYMMDDTHHMMSSZ.EXT`` after the interval's start (UTC).
    """
    if fmt not in FORMATS:
        raise GpudiagError(f"unknown export format {fmt!r}; expected one of {', '.join(FORMATS)}")
    write = write_parquet if fmt == "parquet" else write_csv
    spans = intervals(start_s, end_s, interval_s)
    files: list[dict[str, Any]] = []
    rows = {k: 0 for k in kinds}
    columns: dict[str, dict[str, str]] = {k: {} for k in kinds}
    for i, (a, b) in enumerate(spans):
        window = store.window(a, b, kinds, node=node)
        for kind in kinds:
            table = window.columns(kind)
            if not table.n:
                continue
            if i < len(spans) - 1:  # [a, b): the row at b belongs to the next interval
                keep = int(np.searchsorted(np.asarray(table.columns["t"]), b, side="left"))
                table = table.slice(0, keep) if keep < table.n else table
                if not table.n:
                    continue
            cols = plain_columns(table)
            path = os.path.join(out_dir, f"{kind}-{_stamp(a)}.{fmt}")
            write(path, cols)
            files.append({"path": path, "kind": kind, "from": a, "to": b, "rows": table.n,
                          "bytes": os.path.getsize(path)})
            rows[kind] += table.n
            for c in cols:
                columns[kind].setdefault(c.name, c.type)
        window.release()
        if progress is not None:
            progress(i + 1, len(spans), rows)
    return {
        "store": store.path, "format": fmt, "dir": os.path.abspath(out_dir), "from": start_s, "to": end_s,
        "from_iso": iso(start_s), "to_iso": iso(end_s), "interval_s": interval_s, "node": node,
        "rows": rows, "files": files,
        "columns": {k: [{"name": n, "type": t, "unit": _unit(n)}
                        for n, t in cols.items()] for k, cols in columns.items() if cols},
    }


def _unit(name: str) -> str | None:
    """The catalog unit of a column (of ``name.key``: its column's), None off the catalog."""
    metric = CATALOG.get(name.split(".", 1)[0])
    return None if metric is None else metric.unit


def stderr_progress(done: int, total: int, rows: dict) -> None:
    """One progress line per interval on stderr (rewritten in place on a terminal)."""
    tty = sys.stderr.isatty()
    line = f"exporting: interval {done}/{total}, {sum(rows.values()):,} rows"
    sys.stderr.write(("\r" + line + ("\n" if done == total else "")) if tty else line + "\n")
    sys.stderr.flush()
