"""The SQLite container: the schema and its migrations, the writer's lock, WAL, flushes and seals,
retention, findings, and :class:`Store`, which ties them to the codecs and the window reader."""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import math
import operator
import os
import sqlite3
import threading
import time
from collections import deque
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import quote

import numpy as np

from gpudiag.catalog import M
from gpudiag.errors import GpudiagError
from gpudiag.frames import FRAME_KINDS, FrameColumns, Window

from .blocks import (
    _concat_columns,
    _flattened,
    _InBlock,
    _Joined,
    _uniform_node,
    decode_block,
    encode_block,
    encode_fresh,
)
from .codecs import _DAMAGED_BLOCK_ERRORS
from .reader import _block_mapper, _unguarded, _window_table

if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator
    from typing import Any

    from gpudiag.frames import Frame, Table


log = logging.getLogger("gpudiag.agent.store")

SCHEMA_VERSION = 7
DEFAULT_RETENTION_S = 7 * 86400.0
DEFAULT_MAX_BYTES = 2 * 1024**3
# Sealed chunks of 5 minutes: long enough that the per-entity first value of each
# column (the only value a delta does not shrink) is amortised over 300 samples,
# short enough that a 15-minute analyzer window decodes at most ~5 minutes it
# does not need.
DEFAULT_CHUNK_S = 300.0
# Chunks kept in memory while the store cannot be written: fresh chunks of an 8-GPU,
# 128-process node take ~7 kB a second, so 32 MiB holds over an hour of outage
# within the agent's memory budget.
DEFAULT_MAX_PENDING_BYTES = 32 * 1024**2
# Unflushed frames are encoded early past this many rows, so a caller that stops
# flushing cannot grow the buffer of Python dicts without bound.
MAX_UNENCODED_ROWS = 20_000
# While the writer is busy (a write waiting on the disk or another process' lock), frames wait
# unencoded; past this many rows (minutes of a busy node, tens of MB of dicts) the oldest are
# dropped and counted, so a writer hung for good cannot take the agent's memory with it.
# The cap guards against that stuck writer only: rows handed over while the writer is free are
# encoded into the backlog however many come at once (a caller appending ten minutes of a node
# in one call, then flushing, loses nothing), and the backlog has its own bound in bytes
# (max_pending_bytes).
MAX_WAITING_ROWS = 4 * MAX_UNENCODED_ROWS
# Retention is checked from flush() at most this often (wall clock).
RETENTION_CHECK_INTERVAL_S = 60.0
# A store that could not be opened for writing is retried at most this often.
REOPEN_INTERVAL_S = 10.0
# Size retention deletes down to this fraction of max_bytes, so it does not run
# again on the very next flush.
SIZE_RETENTION_TARGET_RATIO = 0.9
# The WAL is truncated back to this size after a checkpoint (it would otherwise
# keep its high-water mark on disk).
WAL_SIZE_LIMIT_BYTES = 8 * 1024**2
# Sealed chunks are built at most this many intervals per flush, so catching up
# after an outage does not stall one flush.
MAX_SEALS_PER_FLUSH = 4


def _table(kind: str) -> str:
    return f"frames_{kind}"


@dataclass
class _Chunk:
    """An encoded chunk not yet committed (written at the next successful flush)."""

    kind: str
    t_start: float
    t_end: float
    node: str | None
    n_rows: int
    block: bytes
    twin: dict | None = None  # encode_fresh's twin, until the chunk is committed (or its flush fails)


# --- schema and migrations ----------------------------------------------------------------


def _create_kind_table(conn: sqlite3.Connection, kind: str) -> None:
    t = _table(kind)
    conn.execute(f"CREATE TABLE IF NOT EXISTS {t} (t_start REAL NOT NULL, t_end REAL NOT NULL, node TEXT,"
                 " n_rows INTEGER NOT NULL, sealed INTEGER NOT NULL, data BLOB NOT NULL)")
    conn.execute(f"CREATE INDEX IF NOT EXISTS {t}_t_end ON {t} (t_end, t_start)")
    conn.execute(f"CREATE INDEX IF NOT EXISTS {t}_fresh ON {t} (t_start) WHERE sealed = 0")


def _migration_1_initial(conn: sqlite3.Connection) -> None:
    for kind in FRAME_KINDS:
        _create_kind_table(conn, kind)
    conn.execute("CREATE TABLE IF NOT EXISTS findings (id TEXT PRIMARY KEY, kind TEXT NOT NULL,"
                 " severity TEXT NOT NULL, start_s REAL NOT NULL, end_s REAL, json TEXT NOT NULL)")
    conn.execute("CREATE INDEX IF NOT EXISTS findings_time ON findings (start_s, end_s)")


def _migration_2_findings_entity(conn: sqlite3.Connection) -> None:
    # Findings are looked up by GPU (the exporter's active findings per GPU, `investigate
    # --gpu`): the entity moves out of the JSON into indexed columns, backfilled.
    conn.execute("ALTER TABLE findings ADD COLUMN node TEXT")
    conn.execute("ALTER TABLE findings ADD COLUMN gpu INTEGER")
    conn.execute("UPDATE findings SET node = json_extract(json, '$.node'), gpu = json_extract(json, '$.gpu')")
    conn.execute("CREATE INDEX IF NOT EXISTS findings_gpu ON findings (gpu, end_s)")


def _migration_3_zstd_chunks(conn: sqlite3.Connection) -> None:
    # Chunks written from now on are zstd blocks (see _ZSTD_MAGIC), which a gpudiag of schema 2
    # cannot read: the version bump makes it refuse the store by name instead. The zlib chunks
    # already stored stay as they are (every reader still decodes them) and age out.
    pass


def _migration_4_zigzag_ints(conn: sqlite3.Connection) -> None:
    # Sealed chunks from now on may hold zigzag integer columns ("zz" in a column's header),
    # which a gpudiag of schema 3 would decode into wrong numbers without noticing: the
    # version bump makes it refuse the store instead. Chunks already stored read as they are.
    pass


def _migration_5_reference_ints(conn: sqlite3.Connection) -> None:
    # Sealed chunks from now on may hold integer columns stored as values less their minimum
    # ("ref") and front-coded string dictionaries ("front"): a gpudiag of schema 4 would read
    # the first as steps, wrong numbers without noticing, so the version bump makes it refuse
    # the store instead. Chunks already stored read as they are.
    pass


def _migration_6_dictionary_fields(conn: sqlite3.Connection) -> None:
    # Sealed chunks from now on may hold string dictionaries stored as fields in the column's
    # payload ("fields"): a gpudiag of schema 5 finds no values in the header and cannot read
    # them, so the version bump makes it refuse the store instead. Chunks already stored read
    # as they are.
    pass


def _migration_7_ttft_of_parts(conn: sqlite3.Connection) -> None:
    # Sealed chunks from now on may store TTFT against queue time + prefill time: a gpudiag of
    # schema 6 knows sums of three terms only and cannot read it, so the version bump makes it
    # refuse the store instead. Chunks already stored read as they are.
    pass


MIGRATIONS: tuple[tuple[int, str, Any], ...] = (
    (1, "initial", _migration_1_initial),
    (2, "findings_entity", _migration_2_findings_entity),
    (3, "zstd_chunks", _migration_3_zstd_chunks),
    (4, "zigzag_ints", _migration_4_zigzag_ints),
    (5, "reference_ints", _migration_5_reference_ints),
    (6, "dictionary_fields", _migration_6_dictionary_fields),
    (7, "ttft_of_parts", _migration_7_ttft_of_parts),
)
assert MIGRATIONS[-1][0] == SCHEMA_VERSION


def _error_kind(exc: BaseException) -> str:
    """The store-errors counter label of a failure: disk_full, read_only, io, busy, corrupt or other."""
    if isinstance(exc, sqlite3.Error):
        code = getattr(exc, "sqlite_errorcode", None)
        primary = code & 0xFF if isinstance(code, int) else None
        text = str(exc).lower()
        if primary == 13 or "disk is full" in text:
            return "disk_full"
        if primary in (8, 3, 23) or "readonly" in text or "read-only" in text:
            return "read_only"
        if primary == 14:  # SQLITE_CANTOPEN: the directory refuses the -wal/-shm files
            return "read_only"
        if primary in (5, 6):
            return "busy"
        if primary in (11, 26):
            return "corrupt"
        if primary == 10:
            return "io"
        return "other"
    if isinstance(exc, OSError):
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return "disk_full"
        if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            return "read_only"
        return "io"
    return "other"


class Store:
    """A gpudiag timeline store (see the module docstring). Create it with :meth:`Store.open`."""

    def __init__(self, path: str, *, readonly: bool, retention_s: float, max_bytes: int, chunk_s: float,
                 max_pending_bytes: int, must_write: bool = False):
        self.path = os.path.abspath(path)
        self.readonly = readonly
        self.must_write = must_write
        # What this writer made that was not there before (directories, the file, its lock):
        # discard() removes them, so a start that failed leaves nothing behind.
        self._created: list[str] = []
        self.retention_s = float(retention_s)
        self.max_bytes = int(max_bytes)
        self.chunk_s = float(chunk_s)
        self.max_pending_bytes = int(max_pending_bytes)
        self._conn: sqlite3.Connection | None = None
        self._lock_fd: int | None = None
        # Two locks: _mutex serializes the writer (the connection, the backlog, seals, retention),
        # which may wait seconds on the disk or on another process' write lock (busy timeout);
        # _buffer guards only what append and upsert_finding hand over, so the threads that hand
        # frames over (the agent's probes, under its ingest lock) never wait for a write.
        self._mutex = threading.RLock()
        self._buffer = threading.Lock()
        self._unencoded: list[FrameColumns] = []
        self._unencoded_rows = 0
        self._backlog: deque[_Chunk] = deque()
        self._backlog_bytes = 0
        # Per kind, the twins (encode_fresh) of the fresh chunks this writer committed, by rowid:
        # (t_end, rows, columns). A seal takes them instead of decoding the chunks it merges.
        self._twins: dict[str, dict[int, tuple[float, int, dict]]] = {}
        self._repeats: dict[str, dict] = {}  # per kind, its last fresh block's columns (encode_fresh)
        self._pending_findings: dict[str, dict] = {}
        self._errors: dict[str, int] = {}
        self._logged: set[str] = set()
        self._last_error: str | None = None
        self._last_error_kind = "other"
        self._schema_version = 0
        self._dropped_rows = 0
        self._last_flush_s: float | None = None
        # The database's used bytes as the last flush's transaction left them (health() reports them
        # every second: read inside a write transaction they cost no transaction of their own);
        # None after anything else wrote, to be read again.
        self._db_bytes: int | None = None
        self._last_retention = 0.0
        self._last_reopen = 0.0
        self._oldest_fresh: dict[str, float | None] = {}
        self._newest: dict[str, float | None] = {}
        self._closed = False

    # -- opening ---------------------------------------------------------------------------
    @classmethod
    def open(cls, path: str, *, readonly: bool = False, retention_s: float = DEFAULT_RETENTION_S,
             max_bytes: int = DEFAULT_MAX_BYTES, chunk_s: float = DEFAULT_CHUNK_S,
             max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES, must_write: bool = False) -> Store:
        """Open (and for writing, create or migrate) the store at ``path``.

        For writing: takes the writer lock (GpudiagError naming the other agent's
        pid when it is held) and applies pending schema migrations. A store that
        cannot be written (read-only file system, permissions, disk full) does not
        raise: the store is returned degraded, counts the failure in
        :meth:`health`, buffers and retries; with ``must_write`` (a writer that is
        starting: a path that cannot be written now is a mistake, not an outage)
        it raises GpudiagError instead and leaves nothing it created behind, unless
        the failure is another process holding SQLite's write lock for a moment.
        For reading (``readonly=True``): a missing, empty, corrupt or foreign file
        raises GpudiagError (one line).
        """
        if retention_s <= 0 or max_bytes <= 0 or chunk_s <= 0:
            raise GpudiagError("store retention_s, max_bytes and chunk_s must be positive")
        store = cls(path, readonly=readonly, retention_s=retention_s, max_bytes=max_bytes, chunk_s=chunk_s,
                    max_pending_bytes=max_pending_bytes, must_write=must_write)
        if readonly:
            store._open_reader()
        else:
            store._open_writer(first=True)
        return store

    def _open_reader(self) -> None:
        path = self.path
        if not os.path.exists(path):
            raise GpudiagError(f"store {path} does not exist (an agent creates it: gpudiag agent --store {path})")
        if os.path.isdir(path):
            raise GpudiagError(f"store {path} is a directory, not a store file")
        if os.path.getsize(path) == 0:
            raise GpudiagError(f"store {path} is empty: not a gpudiag store")
        uri = f"file:{quote(path)}?mode=ro"
        try:
            conn = self._connect(uri)
            try:
                self._check_schema(conn, writable=False)
            except sqlite3.OperationalError as exc:
                if "unable to open" not in str(exc) or os.path.exists(path + "-wal"):
                    raise
                # No -shm can be created next to a store on a read-only medium and no WAL is
                # pending: nothing can change the file while we read it.
                conn.close()
                conn = self._connect(f"file:{quote(path)}?mode=ro&immutable=1")
                self._check_schema(conn, writable=False)
        except sqlite3.DatabaseError as exc:
            raise GpudiagError(f"store {path} is not a readable gpudiag store: {exc}") from None
        self._conn = conn
        self._schema_version = int(self.meta().get("schema_version", 0))

    @staticmethod
    def _connect(target: str) -> sqlite3.Connection:
        conn = sqlite3.connect(target, uri=target.startswith("file:"), isolation_level=None,
                               check_same_thread=False, timeout=5.0)
        return conn

    def _check_schema(self, conn: sqlite3.Connection, *, writable: bool) -> int:
        """The store's schema version (0 for a brand-new file); GpudiagError for a foreign or newer file."""
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if not tables:
            if writable:
                return 0
            raise GpudiagError(f"store {self.path} holds no tables: not a gpudiag store")
        if "meta" not in tables:
            raise GpudiagError(f"{self.path} is an SQLite file but not a gpudiag store (no meta table)")
        row = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
        try:
            version = int(row[0])
        except (TypeError, ValueError):
            raise GpudiagError(f"{self.path} is not a gpudiag store (no schema_version)") from None
        if version > SCHEMA_VERSION:
            raise GpudiagError(f"store {self.path} has schema {version}, newer than this gpudiag reads "
                               f"({SCHEMA_VERSION}); upgrade gpudiag")
        return version

    def _take_lock(self) -> None:
        lock_path = self.path + ".lock"
        try:
            # O_NOFOLLOW: the agent may run as root; a planted link must not redirect the pid write.
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise GpudiagError(f"store lock {lock_path} is a symbolic link; refusing to use it") from None
            if _error_kind(exc) != "read_only" or not os.path.exists(lock_path):
                raise
            # The directory refuses new files; an existing lock file can still be locked read-only.
            fd = os.open(lock_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                pid = os.pread(fd, 32, 0).decode().strip() or "unknown"
            finally:
                os.close(fd)
            raise GpudiagError(f"store {self.path} is in use by another agent (pid {pid})") from None
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError:
            pass  # a read-only lock file still locks; the pid is informational
        self._lock_fd = fd

    def _open_writer(self, *, first: bool) -> bool:
        """Lock, connect, migrate. True when writable; False (counted, logged) when not."""
        self._last_reopen = time.monotonic()
        try:
            directory = os.path.dirname(self.path)
            if not os.path.isdir(directory):
                missing = []
                while directory and not os.path.isdir(directory):
                    missing.append(directory)
                    directory = os.path.dirname(directory)
                os.makedirs(os.path.dirname(self.path), exist_ok=True)
                if first:
                    self._created += reversed(missing)
            if first:
                self._created += [p for p in (self.path + ".lock", self.path) if not os.path.lexists(p)]
            if self._lock_fd is None:
                self._take_lock()
            conn = self._connect(self.path)
            try:
                self._prepare(conn)
            except BaseException:
                conn.close()
                raise
        except GpudiagError:
            raise
        except (sqlite3.DatabaseError, OSError) as exc:
            kind = _error_kind(exc)
            if kind in ("corrupt", "other") and isinstance(exc, sqlite3.DatabaseError):
                self._release_lock()
                raise GpudiagError(f"store {self.path} is not a writable gpudiag store: {exc}") from None
            if first and self.must_write and kind != "busy":
                self.discard()
                raise GpudiagError(f"store {self.path} cannot be written ({kind}: {exc}); give a --store path "
                                   f"this user can create and write") from None
            self._failed(kind, exc, "cannot open the store for writing")
            return False
        self._conn = conn
        self._db_bytes = None
        self._load_spans()
        if not first:
            self._recovered()
        return True

    def _prepare(self, conn: sqlite3.Connection) -> None:
        version = self._check_schema(conn, writable=True)
        self._schema_version = SCHEMA_VERSION
        if version == 0:
            # Only an empty database can change these; incremental auto-vacuum lets size
            # retention hand pages back to the file system.
            conn.execute("PRAGMA auto_vacuum = INCREMENTAL")
        mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            raise sqlite3.OperationalError(f"cannot switch to WAL mode (journal_mode={mode}): read-only store")
        # NORMAL in WAL mode: a committed transaction survives the process being killed;
        # only an OS crash or power loss can lose the last transactions (never corrupt).
        conn.execute("PRAGMA synchronous = NORMAL")
        conn.execute(f"PRAGMA journal_size_limit = {WAL_SIZE_LIMIT_BYTES}")
        self._migrate(conn, version)
        conn.execute("BEGIN IMMEDIATE")
        try:
            for kind in FRAME_KINDS:  # kinds added to FRAME_KINDS later get their table here
                _create_kind_table(conn, kind)
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise

    def _migrate(self, conn: sqlite3.Connection, version: int) -> None:
        for number, name, apply in MIGRATIONS:
            if number <= version:
                continue
            conn.execute("BEGIN IMMEDIATE")
            try:
                if number == 1:
                    conn.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
                    conn.execute("INSERT OR IGNORE INTO meta VALUES ('created_s', ?)", (repr(time.time()),))
                apply(conn)
                row = conn.execute("SELECT value FROM meta WHERE key = 'migrations'").fetchone()
                history = json.loads(row[0]) if row else []
                history.append({"version": number, "name": name, "applied_s": time.time()})
                conn.execute("INSERT OR REPLACE INTO meta VALUES ('migrations', ?)", (json.dumps(history),))
                conn.execute("INSERT OR REPLACE INTO meta VALUES ('schema_version', ?)", (str(number),))
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            if version:
                log.info("store %s migrated to schema %d (%s)", self.path, number, name)

    def _release_lock(self) -> None:
        if self._lock_fd is not None:
            try:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            finally:
                os.close(self._lock_fd)
                self._lock_fd = None

    # -- failures --------------------------------------------------------------------------
    def _count(self, kind: str) -> None:
        self._errors[kind] = self._errors.get(kind, 0) + 1

    def _failed(self, kind: str, exc: BaseException, what: str) -> None:
        self._count(kind)
        self._last_error_kind = kind
        self._last_error = f"{kind}: {exc}"
        if kind not in self._logged:
            self._logged.add(kind)
            log.error("store %s: %s (%s: %s); live metrics go on, frames are buffered in memory "
                      "(up to %d bytes) and written when the store is writable again",
                      self.path, what, kind, exc, self.max_pending_bytes)

    def _recovered(self) -> None:
        if self._logged:
            log.warning("store %s is writable again (after %s)", self.path, ", ".join(sorted(self._logged)))
            self._logged.clear()

    # -- writing ---------------------------------------------------------------------------
    def append(self, frames: Iterable[Frame]) -> None:
        """Buffer frames for the next :meth:`flush` (nothing touches the disk here)."""
        by_kind: dict[str, list[Frame]] = {}
        for fr in frames:
            if fr.rows:
                by_kind.setdefault(fr.kind, []).append(fr)
        self.append_columns([FrameColumns.of(kind, frs) for kind, frs in by_kind.items()])

    def append_columns(self, chunks: Iterable[FrameColumns]) -> None:
        """Buffer rows already made columns (:meth:`FrameColumns.of`) for the next :meth:`flush`.

        The arrays are kept as they are, never changed: the agent's window reads the same ones.
        """
        self._need_writer()
        with self._buffer:
            for c in chunks:
                if c.n:
                    self._unencoded.append(c)
                    self._unencoded_rows += c.n
            over = self._unencoded_rows > MAX_UNENCODED_ROWS
        if not over:
            return
        # Rows beyond MAX_UNENCODED_ROWS are encoded here (compact in the backlog) unless the
        # writer is busy: then the flush that holds it takes them when it is done.
        if self._mutex.acquire(blocking=False):
            try:
                self._encode_unencoded()
            finally:
                self._mutex.release()
            return
        with self._buffer:
            if self._unencoded_rows > MAX_WAITING_ROWS:
                # The writer has been stuck for minutes (a hung disk): keep the newest rows.
                cut, rows = 0, self._unencoded_rows
                while rows > MAX_WAITING_ROWS and cut < len(self._unencoded) - 1:
                    rows -= self._unencoded[cut].n
                    cut += 1
                del self._unencoded[:cut]
                self._dropped_rows += self._unencoded_rows - rows
                self._unencoded_rows = rows

    def upsert_finding(self, finding) -> None:
        """Record a finding (a Finding or a dict in its JSON form), replacing one with the same id.

        Written at the next flush; :meth:`findings` of this store sees it at once.
        """
        self._need_writer()
        if hasattr(finding, "to_dict"):
            d = finding.to_dict()
            # to_dict() rounds floats to 6 significant digits for display, which moves a Unix
            # timestamp by up to an hour and a half: the store keeps the span exact.
            d["start_s"], d["end_s"] = finding.start_s, finding.end_s
        else:
            d = dict(finding)
        for key in ("id", "kind", "severity", "start_s"):
            if d.get(key) is None:
                raise ValueError(f"finding without {key!r}: {d!r}")
        with self._buffer:
            self._pending_findings[str(d["id"])] = d

    def _encode_unencoded(self) -> None:
        """Encode the frames handed over so far into the backlog (the caller holds the writer's lock)."""
        with self._buffer:
            chunks, self._unencoded, self._unencoded_rows = self._unencoded, [], 0
        by_kind: dict[str, list[FrameColumns]] = {}
        for c in chunks:
            by_kind.setdefault(c.kind, []).append(c)
        for kind, chunks in by_kind.items():
            # Several chunks of a kind in one flush join as a seal joins fresh blocks.
            n, columns = (chunks[0].n, dict(chunks[0].columns)) if len(chunks) == 1 else \
                _concat_columns([(c.n, dict(c.columns)) for c in chunks])
            ts = columns["t"]
            block, twin = encode_fresh(columns, n, self._repeats.setdefault(kind, {}))
            chunk = _Chunk(kind, float(ts.min()), float(ts.max()), _uniform_node(columns), n, block, twin)
            self._backlog.append(chunk)
            self._backlog_bytes += len(chunk.block)
        while self._backlog_bytes > self.max_pending_bytes and self._backlog:
            dropped = self._backlog.popleft()
            self._backlog_bytes -= len(dropped.block)
            with self._buffer:
                self._dropped_rows += dropped.n_rows

    def flush(self, *, seal: bool = True) -> int:
        """Write everything buffered in one transaction; return the rows written (0 on failure).

        Never raises for a full disk or a read-only store: the failure is logged
        once, counted in :meth:`health`, and the data stays buffered (bounded).
        Also seals complete intervals and, at most once a minute, applies retention;
        ``seal=False`` leaves both to a later flush.
        """
        self._need_writer()
        with self._mutex:
            self._encode_unencoded()
            if not self._backlog and not self._pending_findings:
                return 0
            if self._conn is None:
                if time.monotonic() - self._last_reopen < REOPEN_INTERVAL_S:
                    self._count(self._last_error_kind)  # same failure as the last open attempt
                    return 0
                try:
                    ok = self._open_writer(first=False)
                except GpudiagError as exc:  # another agent took the store meanwhile
                    self._failed("busy", exc, "cannot open the store for writing")
                    return 0
                if not ok:
                    return 0
            started = time.perf_counter()
            conn = self._conn
            chunks = list(self._backlog)
            with self._buffer:
                findings = list(self._pending_findings.values())
            rowids = []
            try:
                conn.execute("BEGIN IMMEDIATE")
                for c in chunks:
                    rowids.append(conn.execute(
                        f"INSERT INTO {_table(c.kind)} (t_start, t_end, node, n_rows, sealed, data)"
                        " VALUES (?, ?, ?, ?, 0, ?)", (c.t_start, c.t_end, c.node, c.n_rows, c.block)).lastrowid)
                for d in findings:
                    conn.execute(
                        "INSERT INTO findings (id, kind, severity, start_s, end_s, json, node, gpu)"
                        " VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (id) DO UPDATE SET kind = excluded.kind,"
                        " severity = excluded.severity, start_s = excluded.start_s, end_s = excluded.end_s,"
                        " json = excluded.json, node = excluded.node, gpu = excluded.gpu",
                        (str(d["id"]), d["kind"], str(d["severity"]), float(d["start_s"]),
                         None if d.get("end_s") is None else float(d["end_s"]),
                         json.dumps(d, default=str), d.get("node"), d.get("gpu")))
                used = self._used_bytes(conn)
                conn.execute("COMMIT")
            except sqlite3.Error as exc:
                self._rollback()
                self._failed(_error_kind(exc), exc, "cannot write frames")
                for c in chunks:  # a backlog that waits out an outage is bounded by its blocks' bytes alone
                    c.twin = None
                return 0
            self._backlog.clear()
            self._backlog_bytes = 0
            self._db_bytes = used
            for c, rowid in zip(chunks, rowids):
                if c.twin is not None:
                    self._twins.setdefault(c.kind, {})[rowid] = (c.t_end, c.n_rows, c.twin)
                    c.twin = None
            for c in chunks:
                old, new = self._oldest_fresh.get(c.kind), self._newest.get(c.kind)
                self._oldest_fresh[c.kind] = c.t_start if old is None else min(old, c.t_start)
                self._newest[c.kind] = c.t_end if new is None else max(new, c.t_end)
            with self._buffer:
                for d in findings:
                    if self._pending_findings.get(str(d["id"])) is d:
                        del self._pending_findings[str(d["id"])]
            self._recovered()
            written = sum(c.n_rows for c in chunks)
            if seal:
                try:
                    self._seal(final=False)
                    if time.monotonic() - self._last_retention >= RETENTION_CHECK_INTERVAL_S:
                        self.enforce_retention()
                except sqlite3.Error as exc:  # the frames above are committed; this only delays tidying
                    self._rollback()
                    self._failed(_error_kind(exc), exc, "cannot seal chunks or apply retention")
            self._last_flush_s = time.perf_counter() - started
            return written

    def _rollback(self) -> None:
        try:
            if self._conn is not None and self._conn.in_transaction:
                self._conn.execute("ROLLBACK")
        except sqlite3.Error:
            pass

    def _load_spans(self) -> None:
        """Read, per kind, the oldest fresh chunk start and the newest frame (kept in memory after)."""
        self._oldest_fresh, self._newest = {}, {}
        for kind in FRAME_KINDS:
            t = _table(kind)
            self._oldest_fresh[kind] = self._conn.execute(
                f"SELECT min(t_start) FROM {t} WHERE sealed = 0").fetchone()[0]
            self._newest[kind] = self._conn.execute(f"SELECT max(t_end) FROM {t}").fetchone()[0]

    def _seal(self, *, final: bool) -> None:
        """Merge fresh chunks of complete intervals into sealed ones (every interval when ``final``)."""
        conn = self._conn
        seals = 0
        for kind in FRAME_KINDS:
            t = _table(kind)
            oldest, newest = self._oldest_fresh.get(kind), self._newest.get(kind)
            if oldest is None or newest is None:
                continue
            if not final and math.floor(oldest / self.chunk_s) >= math.floor(newest / self.chunk_s):
                continue  # the oldest fresh chunk's interval is still open
            boundary = math.inf if final else math.floor(newest / self.chunk_s) * self.chunk_s
            fresh = conn.execute(f"SELECT rowid, t_start FROM {t} WHERE sealed = 0 AND t_end < ?"
                                 " ORDER BY t_start, rowid", (boundary,)).fetchall()
            twins = self._twins.get(kind, {})
            listed = {rowid for rowid, _ in fresh}
            for rowid in [r for r, (t_end, _, _) in twins.items() if t_end < boundary and r not in listed]:
                del twins[rowid]  # its chunk is gone (retention): never to be sealed
            groups: dict[float, list[int]] = {}
            for rowid, t_start in fresh:
                groups.setdefault(math.floor(t_start / self.chunk_s), []).append(rowid)
            for _, members in sorted(groups.items()):
                if seals >= MAX_SEALS_PER_FLUSH and not final:
                    break
                blocks, damaged = self._fresh_columns(t, twins, members)
                n, columns = _concat_columns(blocks) if blocks else (0, {})
                block = encode_block(columns, n, sealed=True) if n else None
                conn.execute("BEGIN IMMEDIATE")
                try:
                    # A damaged chunk stays as it is (a read of its rows says it is damaged), marked
                    # sealed so that no later seal tries it again.
                    conn.executemany(f"UPDATE {t} SET sealed = 1 WHERE rowid = ?", [(rowid,) for rowid in damaged])
                    conn.executemany(f"DELETE FROM {t} WHERE rowid = ?",
                                     [(rowid,) for rowid in members if rowid not in damaged])
                    if block is not None:
                        ts = columns["t"]
                        conn.execute(f"INSERT INTO {t} (t_start, t_end, node, n_rows, sealed, data)"
                                     " VALUES (?, ?, ?, ?, 1, ?)",
                                     (float(ts.min()), float(ts.max()), _uniform_node(columns), n, block))
                    conn.execute("COMMIT")
                except BaseException:
                    self._rollback()
                    raise
                finally:
                    self._db_bytes = None
                seals += 1
            self._oldest_fresh[kind] = conn.execute(f"SELECT min(t_start) FROM {t} WHERE sealed = 0").fetchone()[0]
            if seals >= MAX_SEALS_PER_FLUSH and not final:
                return

    def _fresh_columns(self, table: str, twins: dict, rowids: list[int]) -> tuple[list[tuple[int, dict]], list[int]]:
        """The raw, flattened columns of fresh chunks (their twins where kept, taken, else decoded),
        and the chunks among them too damaged to read.

        A number column every twin left in its block (of one dtype) is read from the blocks straight
        into one joined array, the same object in every chunk's columns (see _concat_columns).
        """
        kept = {r: twins.pop(r) for r in rowids if r in twins}
        joined: dict[str, _Joined] = {}
        if len(kept) == len(rowids):
            refs = [cols for _, _, cols in kept.values()]
            total = sum(n for _, n, _ in kept.values())
            for name, ref in refs[0].items():
                if isinstance(ref, _InBlock) and all(
                        isinstance(c.get(name), _InBlock) and c[name].dtype == ref.dtype for c in refs):
                    joined[name] = _Joined(np.empty(total, dtype=ref.dtype))
        out, damaged, pos = [], [], 0
        for i in range(0, len(rowids), 100):  # SQLite's bound-parameter limit; a hundred blocks at a time
            part = rowids[i:i + 100]
            data = dict(self._conn.execute(f"SELECT rowid, data FROM {table} WHERE rowid IN"
                                           f" ({','.join('?' * len(part))})", part).fetchall())
            for r in part:
                try:
                    if r not in kept:
                        out.append(_flattened(decode_block(data[r], raw=True)))
                        continue
                    _, n, cols = kept.pop(r)
                    numbers = {name: ref.read(data[r]) for name, ref in cols.items() if isinstance(ref, _InBlock)}
                    if any(len(a) != n for a in numbers.values()):
                        raise ValueError("a number column's frame holds the wrong row count")
                except _DAMAGED_BLOCK_ERRORS as exc:
                    log.warning("store %s: fresh chunk %s of %s is damaged (%s: %s); it is kept as it is and"
                                " left out of its interval's sealed chunk", self.path, r, table,
                                type(exc).__name__, exc)
                    self._count("damaged")
                    damaged.append(r)
                    continue
                for name, a in numbers.items():
                    if name in joined:
                        joined[name].array[pos:pos + n] = a
                        cols[name] = joined[name]
                    else:
                        cols[name] = a  # _concat_columns copies it into the joined column
                out.append((n, cols))
                pos += n
        if damaged:
            for j in joined.values():
                j.array = j.array[:pos]
        return out, damaged

    def enforce_retention(self, now_s: float | None = None) -> int:
        """Delete chunks older than ``retention_s`` (before ``now_s``, default the newest frame),
        then the oldest chunks until the database is under ``max_bytes``. Returns chunks deleted."""
        self._need_writer()
        with self._mutex:
            self._last_retention = time.monotonic()
            self._db_bytes = None
            conn = self._conn
            if conn is None:
                return 0
            deleted = 0
            tables = [_table(k) for k in FRAME_KINDS]
            if now_s is None:
                ends = [conn.execute(f"SELECT max(t_end) FROM {t}").fetchone()[0] for t in tables]
                ends = [e for e in ends if e is not None]
                now_s = max(ends) if ends else None
            conn.execute("BEGIN IMMEDIATE")
            try:
                if now_s is not None:
                    cutoff = now_s - self.retention_s
                    for t in tables:
                        deleted += conn.execute(f"DELETE FROM {t} WHERE t_end < ?", (cutoff,)).rowcount
                    conn.execute("DELETE FROM findings WHERE end_s IS NOT NULL AND end_s < ?", (cutoff,))
                if self._used_bytes(conn) > self.max_bytes:
                    deleted += self._delete_oldest(conn, tables, int(self.max_bytes * SIZE_RETENTION_TARGET_RATIO))
                conn.execute("COMMIT")
            except BaseException:
                self._rollback()
                raise
            if deleted:
                conn.executescript("PRAGMA incremental_vacuum;")  # execute() would free one page only
            return deleted

    def _delete_oldest(self, conn: sqlite3.Connection, tables: list[str], target_bytes: int) -> int:
        """Delete the oldest chunks (all kinds, by end time) until the database uses <= target_bytes."""
        deleted = 0
        # What deleting a chunk frees is not its length: the pages its frames fill hold slack
        # and index entries too (more), and pages it shares with chunks that stay are not freed
        # (less). Each pass counts every chunk as its share of all the pages the database uses,
        # an overestimate (that includes the schema's own pages), so a pass deletes no more than
        # it must; then it measures and goes on. Counted at their length, chunks were taken to
        # free too little: a store of small chunks at twice its limit deleted every one of them.
        for _ in range(64):
            used = self._used_bytes(conn)
            need = used - target_bytes
            if need <= 0:
                break
            candidates = sorted((t_end, t, rowid, size) for t in tables for rowid, t_end, size in conn.execute(
                f"SELECT rowid, t_end, length(data) FROM {t}"))
            if not candidates:
                break
            per_byte = max(used / max(sum(c[3] for c in candidates), 1), 1.0)
            freed = 0.0
            victims: dict[str, list[int]] = {}
            for _, t, rowid, size in candidates:
                victims.setdefault(t, []).append(rowid)
                freed += size * per_byte
                if freed >= need:
                    break
            for t, rowids in victims.items():
                conn.executemany(f"DELETE FROM {t} WHERE rowid = ?", [(r,) for r in rowids])
                deleted += len(rowids)
        return deleted

    @staticmethod
    def _used_bytes(conn: sqlite3.Connection) -> int:
        pages = conn.execute("PRAGMA page_count").fetchone()[0]
        free = conn.execute("PRAGMA freelist_count").fetchone()[0]
        size = conn.execute("PRAGMA page_size").fetchone()[0]
        return (pages - free) * size

    def _need_writer(self) -> None:
        if self.readonly:
            raise GpudiagError(f"store {self.path} is open read-only")
        if self._closed:
            raise GpudiagError(f"store {self.path} is closed")

    # -- reading ---------------------------------------------------------------------------
    @contextmanager
    def snapshot(self) -> Iterator[Store]:
        """Hold one read snapshot for several reads (window, findings, time_range agree).

        The writer keeps writing meanwhile (WAL); what it writes becomes visible
        after the block.
        """
        with self._mutex:
            conn = self._reader_conn()
            if conn is None or conn.in_transaction:
                yield self
                return
            self._guard(conn.execute, "BEGIN")
            try:
                yield self
            finally:
                try:
                    if conn.in_transaction:
                        conn.execute("COMMIT")  # ends a read transaction: nothing to lose
                except sqlite3.Error:
                    pass  # a damaged file already raised the read's own GpudiagError

    def _reader_conn(self) -> sqlite3.Connection | None:
        if self._closed:
            raise GpudiagError(f"store {self.path} is closed")
        return self._conn

    def _guard(self, fn, *args):
        """Run a read; a corrupt file becomes one GpudiagError line."""
        try:
            return fn(*args)
        except sqlite3.DatabaseError as exc:
            raise GpudiagError(f"store {self.path} cannot be read: {exc}") from None
        except _DAMAGED_BLOCK_ERRORS as exc:
            raise GpudiagError(f"store {self.path} holds a damaged chunk: {exc}") from None

    def _query(self, sql: str, params=()) -> list[tuple]:
        conn = self._reader_conn()
        if conn is None:
            return []
        return self._guard(lambda: conn.execute(sql, params).fetchall())

    def _kind_tables(self) -> set[str]:
        return {r[0] for r in self._query("SELECT name FROM sqlite_master WHERE type = 'table'")}

    def window(self, start_s: float, end_s: float, kinds: Iterable[str] | None = None, *,
               node: str | None = None) -> Window:
        """Frames with ``start_s <= t <= end_s`` as a Window (one DataFrame per kind, sorted by ``t``).

        The writer's own window also holds chunks still waiting for a writable store.
        """
        wanted = list(FRAME_KINDS if kinds is None else kinds)
        for kind in wanted:
            if kind not in FRAME_KINDS:
                raise GpudiagError(f"unknown frame kind {kind!r}; expected one of {', '.join(FRAME_KINDS)}")
        tables: dict[str, Table] = {}
        nodes: set[str] = set()
        with self.snapshot():
            present = self._kind_tables()
            for kind in wanted:
                blocks: list[bytes] = []
                if _table(kind) in present:
                    sql = f"SELECT t_start, rowid, data FROM {_table(kind)} WHERE t_end >= ? AND t_start <= ?"
                    params: tuple = (start_s, end_s)
                    if node is not None:
                        sql += " AND (node = ? OR node IS NULL)"
                        params += (node,)
                    # Ordered here, not with ORDER BY: SQLite would copy every chunk's blob into
                    # a temporary sort tree, which costs more than reading them.
                    rows = self._query(sql, params)
                    rows.sort(key=operator.itemgetter(0, 1))
                    blocks += [r[2] for r in rows]
                if not self.readonly:
                    blocks += [c.block for c in list(self._backlog)
                               if c.kind == kind and c.t_end >= start_s and c.t_start <= end_s]
                table = self._guard(self._table_of, blocks, start_s, end_s, node, self._guard)
                if table is not None:
                    tables[kind] = table
                    if "node" in table.columns:
                        nodes.update(v for v in table.distinct("node") if isinstance(v, str))
        if node is None and len(nodes) == 1:
            node = nodes.pop()
        return Window.from_columns(tables, start_s=float(start_s), end_s=float(end_s), node=node,
                                   sources=[f"store:{self.path}"])

    @staticmethod
    def _table_of(blocks: list[bytes], start_s: float, end_s: float, node: str | None,
                  guard=_unguarded) -> Table | None:
        """The blocks' rows in [start_s, end_s] (of ``node``) as one Table sorted by ``t``; None when none.

        Columns, not a DataFrame: a day of a node is ten million rows, and the analyzers read
        arrays; the label codes each block was written with are kept, so nothing is factorized
        again (a DataFrame is still built when a caller asks ``window.tables`` for one).
        """
        with _block_mapper(len(blocks)) as mapper:
            return _window_table(blocks, start_s, end_s, node, mapper, guard)

    def findings(self, start_s: float, end_s: float, *, kinds: Iterable[str] | None = None,
                 gpu: int | None = None) -> list[dict]:
        """Findings whose span overlaps [start_s, end_s] (an open end counts as ongoing), by start time."""
        sql = "SELECT json FROM findings WHERE start_s <= ? AND (end_s IS NULL OR end_s >= ?)"
        params: tuple = (end_s, start_s)
        if gpu is not None:
            # Schema 1 (readable without migration) kept the GPU only inside the JSON.
            sql += " AND gpu = ?" if self._schema_version >= 2 else " AND json_extract(json, '$.gpu') = ?"
            params += (int(gpu),)
        rows = self._query(sql, params) if "findings" in self._kind_tables() else []
        by_id = {d["id"]: d for d in (json.loads(r[0]) for r in rows)}
        if not self.readonly:
            with self._buffer:
                pending = list(self._pending_findings.values())
            for d in pending:
                if d["start_s"] <= end_s and (d.get("end_s") is None or d["end_s"] >= start_s) \
                        and (gpu is None or d.get("gpu") == gpu):
                    by_id[d["id"]] = d
        wanted = None if kinds is None else set(kinds)
        out = [d for d in by_id.values() if wanted is None or d["kind"] in wanted]
        return sorted(out, key=lambda d: (d["start_s"], d["id"]))

    def time_range(self) -> tuple[float, float] | None:
        """(first t, last t) over every kind, or None for a store without frames."""
        lo, hi = math.inf, -math.inf
        with self.snapshot():
            present = self._kind_tables()
            for kind in FRAME_KINDS:
                if _table(kind) in present:
                    a, b = self._query(f"SELECT min(t_start), max(t_end) FROM {_table(kind)}")[0]
                    if a is not None:
                        lo, hi = min(lo, a), max(hi, b)
        if not self.readonly:
            for c in list(self._backlog):
                lo, hi = min(lo, c.t_start), max(hi, c.t_end)
        return None if lo == math.inf else (lo, hi)

    def meta(self) -> dict[str, Any]:
        """The meta table: schema_version (int), migrations (list), created_s, and anything else stored."""
        out: dict[str, Any] = {}
        for key, value in self._query("SELECT key, value FROM meta") if self._conn is not None else []:
            out[key] = json.loads(value) if key == "migrations" else value
        if "schema_version" in out:
            out["schema_version"] = int(out["schema_version"])
        return out

    def health(self) -> dict[str, Any]:
        """Writer health for the agent's self-metrics.

        ``store_errors_total`` (by kind: disk_full, read_only, io, busy, corrupt,
        other) feeds ``agent_store_errors_total``; ``last_flush_seconds`` feeds
        ``agent_store_write_seconds``; ``dropped_rows_total`` counts rows lost
        when the in-memory buffer overflowed.
        """
        with self._mutex:
            db_bytes = self._db_bytes if self._conn is not None else None
            if db_bytes is None and self._conn is not None:
                try:
                    db_bytes = self._db_bytes = self._used_bytes(self._conn)
                except sqlite3.Error:
                    pass
            return {
                "path": self.path,
                "writable": (not self.readonly) and self._conn is not None and not self._logged,
                "store_errors_total": dict(self._errors),
                "last_error": self._last_error,
                "dropped_rows_total": self._dropped_rows,
                "buffered_rows": self._unencoded_rows + sum(c.n_rows for c in self._backlog),
                "buffered_bytes": self._backlog_bytes,
                "last_flush_seconds": self._last_flush_s,
                "db_bytes": db_bytes,
            }

    def metric_rows(self) -> list[dict[str, Any]]:
        """:meth:`health` as self-metrics rows for ``LatestFrames.set_agent_rows`` (catalog ``agent_*`` columns)."""
        h = self.health()
        rows: list[dict[str, Any]] = [{"kind": kind, M.agent_store_errors_total: n}
                                      for kind, n in sorted(h["store_errors_total"].items())]
        rows.append({"probe": "store", M.agent_dropped_events_total: h["dropped_rows_total"]})
        if h["last_flush_seconds"] is not None:
            rows.append({M.agent_store_write_seconds: h["last_flush_seconds"]})
        if h["db_bytes"] is not None:
            rows.append({M.agent_store_bytes: h["db_bytes"]})
        return rows

    def close(self) -> None:
        """Flush (writer), seal every interval, release the lock and close. Safe to call twice."""
        if self._closed:
            return
        try:
            if not self.readonly:
                self.flush()
                lost = self.health()["buffered_rows"]
                if lost:
                    log.error("store %s closed with %d rows that could not be written", self.path, lost)
                with self._mutex:
                    if self._conn is not None and not self._backlog:
                        try:
                            self._seal(final=True)
                            self._conn.executescript("PRAGMA incremental_vacuum;")  # execute() would free one page only
                        except sqlite3.Error as exc:
                            self._failed(_error_kind(exc), exc, "cannot seal chunks at close")
        finally:
            with self._mutex:
                self._closed = True
                if self._conn is not None:
                    self._conn.close()
                    self._conn = None
                self._release_lock()

    def discard(self) -> None:
        """Close, then remove what this writer created: the file, its lock and the directories made for it.

        For a writer whose start failed: a store that existed before is closed and kept as it was.
        """
        self.close()
        if self.path in self._created:
            for suffix in ("-wal", "-shm", "-journal"):  # SQLite's own, gone after a clean close but a crash
                with suppress(FileNotFoundError):
                    os.unlink(self.path + suffix)
        for made in reversed(self._created):
            try:
                if os.path.isdir(made) and not os.path.islink(made):
                    os.rmdir(made)  # only when empty: never a file someone else put there
                else:
                    os.unlink(made)
            except OSError:
                pass
        self._created = []

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> bool:
        self.close()
        return False
