"""The agent's timeline store: frames and findings in one SQLite file (WAL), crash-safe.

Layout
------
One table per frame kind (``frames_gpu``, ``frames_process``, ... for every
kind in :data:`gpudiag.frames.FRAME_KINDS`). A table row is a *chunk*: the
rows of that kind over a span of time, with ``t_start``/``t_end`` (indexed,
for time-range reads), the ``node`` when the chunk holds one node, the row
count and a compressed columnar block. Inside a block every row keeps its
``t``, its labels (``node``, ``gpu``, ``uuid``, ``pid``, ``process``,
``engine``, ...) and its catalog columns, so a block reads back as exactly
the rows that were appended. A block describes its own columns, so a column
new to the catalog needs no schema migration.

Why chunks rather than one SQLite row per entity per tick: a node of 8 GPUs
with 16 processes each produces about 180 rows and 1,400 values a second.
Measured on the development machine with the frames of
``bench/bench_exporter.py`` (8 GPUs x 16 processes, one of them with torch
allocator stats, 1 s): a wide table per kind (one column per catalog column,
labels interned into an entity id, indexed by time) takes about 250 MB per
GPU-day; a narrow (t, entity, column, value) table about 650 MB; these chunks
about 12 MB (11.6 MB since each column is a zstd frame of its own; 12.3 MB as one
deflate stream). SQLite spends a header byte and 1 to 8 payload bytes on every
value plus per-row and index overhead, while a chunk stores each column once,
grouped by entity, delta- or XOR-coded and zstd-compressed: a constant column costs
almost nothing and a slowly moving one a byte or two per value. Finished
requests (~80 a second on such a node) are the largest kind: their latencies
are kept to the microsecond, which halves their share. A read of a
time range decodes whole columns with numpy into the analyzers' Tables.

Writes: :meth:`Store.append` buffers frames; :meth:`Store.flush` (called by
the agent every second) encodes them into one small *fresh* chunk per kind
and commits them in one transaction. When a ``chunk_s`` interval (default
300 s of frame time) is complete, its fresh chunks are merged into one
*sealed* chunk, in its own transaction. Every change is a committed SQLite
transaction in WAL mode, so a kill -9 loses at most the frames appended
since the last flush and never leaves a half-written chunk; SQLite's WAL
recovery runs on the next open.

Failures: a full disk or a read-only store never raises into the caller.
:meth:`flush` logs the failure once per kind (again after a recovery),
counts it (:meth:`health`, exported as ``agent_store_errors_total``), keeps
the encoded chunks in memory up to ``max_pending_bytes`` (dropping the
oldest, counted) and writes them when the store is writable again.

One writer per store: a sidecar lock file (``PATH.lock``, ``flock``) holds
the writer's pid; a second writer is refused with a message naming it.
Readers open the file read-only (``mode=ro``) and never take the lock; WAL
lets them read while the writer writes, and the writer never waits for them.

Retention: chunks older than ``retention_s`` before the newest frame are
deleted, then the oldest chunks until the database is under ``max_bytes``
(pages are returned to the file system with incremental vacuum).

The package, by concern:

* :mod:`.codecs`: each column's codec (integers, floats, strings, dicts, JSON) and zstd;
* :mod:`.blocks`: a block of rows, sealed or fresh, encoded and decoded;
* :mod:`.reader`: the window reader (many blocks into one Table, columns decoded when first read);
* :mod:`.container`: the SQLite container (schema and migrations, lock, WAL, flushes and seals,
  retention, findings) and :class:`Store`.

What other packages use is imported from here.
"""

from __future__ import annotations

from .blocks import (
    LATENCY_RESOLUTION_DECIMALS,
    REPEAT_BY_TEXT_MAX_ROWS,
    decode_block,
    decode_table,
    encode_block,
    encode_fresh,
)
from .codecs import FIELDS_GAIN, FRONT_CODE_ARRAY_MAX_CHARS, FRONT_CODE_MIN_VALUES, REFERENCE_GAIN, SUM_OF_PARTS
from .container import (
    DEFAULT_CHUNK_S,
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_PENDING_BYTES,
    DEFAULT_RETENTION_S,
    MAX_SEALS_PER_FLUSH,
    MAX_UNENCODED_ROWS,
    MAX_WAITING_ROWS,
    MIGRATIONS,
    REOPEN_INTERVAL_S,
    RETENTION_CHECK_INTERVAL_S,
    SCHEMA_VERSION,
    SIZE_RETENTION_TARGET_RATIO,
    WAL_SIZE_LIMIT_BYTES,
    Store,
)
from .reader import DISTINCT_PER_ROW_MIN_ROWS, DISTINCT_PER_ROW_SHARE, READ_THREADS

__all__ = [
    "DEFAULT_CHUNK_S",
    "DEFAULT_MAX_BYTES",
    "DEFAULT_MAX_PENDING_BYTES",
    "DEFAULT_RETENTION_S",
    "DISTINCT_PER_ROW_MIN_ROWS",
    "DISTINCT_PER_ROW_SHARE",
    "FIELDS_GAIN",
    "FRONT_CODE_ARRAY_MAX_CHARS",
    "FRONT_CODE_MIN_VALUES",
    "LATENCY_RESOLUTION_DECIMALS",
    "MAX_SEALS_PER_FLUSH",
    "MAX_UNENCODED_ROWS",
    "MAX_WAITING_ROWS",
    "MIGRATIONS",
    "READ_THREADS",
    "REFERENCE_GAIN",
    "REOPEN_INTERVAL_S",
    "REPEAT_BY_TEXT_MAX_ROWS",
    "RETENTION_CHECK_INTERVAL_S",
    "SCHEMA_VERSION",
    "SIZE_RETENTION_TARGET_RATIO",
    "SUM_OF_PARTS",
    "Store",
    "WAL_SIZE_LIMIT_BYTES",
    "decode_block",
    "decode_table",
    "encode_block",
    "encode_fresh",
]
