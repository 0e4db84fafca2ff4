"""Frames and windows: the data that flows from probes to the store and the analyzers.

A probe yields a Frame per tick: one row (a plain dict) per entity — a GPU, a
process on a GPU, a serving engine, a finished request, the node, a (pid, CUDA
API) pair. Row keys are entity labels (``gpu``, ``uuid``, ``pid``,
``process``, ``node``, ``engine``, ``api``, ...) and metric columns from the
catalog (``M.gpu_utilization_ratio``, ...). Counters are cumulative, as in
Prometheus; analyzers take differences.

A Window is a time range of frames, one table per kind, each with a ``t``
column (seconds; simulated seconds on the simulated GPU, Unix time otherwise)
and sorted by it. Analyzers take a Window and return findings.

Two forms of one table:

* ``window.table(kind)``: a pandas DataFrame, for reports and offline tools;
* ``window.rows(kind)``: :class:`Rows`, the same rows read column by column
  from numpy arrays (:class:`Table`). It answers the part of the DataFrame
  interface the analyzers use (``col in rows``, ``rows[col].to_numpy(float)``,
  boolean masks, ``isna``/``notna``/``dropna``, ``iloc``, reductions, small
  ``groupby``) without building a DataFrame per entity, and hands anything
  else to a real DataFrame of the same rows. Entity groups and label codes are
  computed once per table and shared by every analyzer.

A window built by the agent holds only Tables (pandas is imported only if a
DataFrame is asked for), cut from one :class:`TableBuffer` per kind,
appended ten seconds at a time and cut at the front as the window slides,
which keeps each chunk's label codes and each entity's row positions as rows
come and go, so a window costs what its new rows cost. One built from
DataFrames (the store, Prometheus, ``from_rows``) reads them through a Table
made on first use. In a Table, values that are dicts of numbers (per-label
counters such as ``gpu_ecc_errors_total``) are kept as one float array per
leaf (:class:`DictColumn`), so a day of them is not millions of Python dicts.

The package, by concern:

* :mod:`.columns`: Frame, FrameColumns, DictColumn, LazyColumns; a list of values as a numpy column;
* :mod:`.codes`: label codes (factorize, merge, cut, renumber);
* :mod:`.grouping`: entity groups and the copies of a column in their order;
* :mod:`.table`: Table;
* :mod:`.buffer`: TableBuffer, the agent's sliding window of one kind;
* :mod:`.rows`: Rows and Column, the DataFrame-like views the analyzers read;
* :mod:`.window`: Window.

What other packages use is imported from here.
"""

from __future__ import annotations

from .buffer import TableBuffer
from .codes import cut_codes, factorize, held_uniques, merge_codes, sorted_codes
from .columns import (
    FRAME_KINDS,
    LEAF_BOOLS,
    NAN,
    DictColumn,
    Frame,
    FrameColumns,
    LazyColumns,
    column_array,
    concat_columns,
    fill_of,
    forward_fill,
    is_na,
    layout_groups,
    live_dtype,
    object_array,
)
from .grouping import BufferPool
from .rows import Column, Rows
from .table import Table
from .window import Window

__all__ = [
    "BufferPool",
    "Column",
    "DictColumn",
    "FRAME_KINDS",
    "Frame",
    "FrameColumns",
    "LEAF_BOOLS",
    "LazyColumns",
    "NAN",
    "Rows",
    "Table",
    "TableBuffer",
    "Window",
    "column_array",
    "concat_columns",
    "cut_codes",
    "factorize",
    "fill_of",
    "forward_fill",
    "held_uniques",
    "is_na",
    "layout_groups",
    "live_dtype",
    "merge_codes",
    "object_array",
    "sorted_codes",
]
