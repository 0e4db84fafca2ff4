"""The in-process reporter: the PyTorch caching allocator's figures, published for the agent.

``gpudiag.instrument()`` inside a training or serving process starts one
daemon thread that, every ``interval_s``, reads ``torch.cuda.memory_stats``
for each device the process uses and writes them, with the pid, to
``<runtime dir>/torch-<pid>.json`` (written to a temporary file and renamed,
so the agent never reads half a file). The agent's torch probe discovers
these files. The white and grey layers of the three colours come from here.

On request it also writes a memory snapshot (``torch.cuda.memory._snapshot``,
a pickle, as torch writes it): the agent creates
``torch-<pid>.snapshot-request`` in the same directory, the reporter removes
it, writes ``torch-<pid>-snapshot-<unix seconds>.pickle`` and names it in its
next report. The request file carries no path: where snapshots go is fixed,
so a request cannot make the process write anywhere else.

Rules that keep it safe inside someone else's process:

* it never raises into the host process: ``instrument`` returns None on any
  failure, and the thread records errors in its report instead of raising;
* it never initialises CUDA: until the process itself has (``torch.cuda
  .is_initialized()``) the report lists no devices, so a later ``fork`` of
  data-loader workers is not poisoned;
* without torch or without CUDA it is a no-op with one log line;
* the runtime directory must be a real directory (not a symlink) owned by the
  process's user and not writable by group or others; otherwise the reporter
  does not start (a directory in /tmp can be planted by another user).

A process without torch (the reference engine's simulated GPU) can publish
the same report from its own figures with ``stats_source``.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import pickle
import stat
import threading
import time
from collections.abc import Callable
from typing import Any

from gpudiag.catalog import M
from gpudiag.probes.base import proc_comm, proc_start_ticks

log = logging.getLogger("gpudiag.instrument")

RUNTIME_DIR_ENV = "GPUDIAG_RUNTIME_DIR"
REPORT_SCHEMA = 1
REPORT_PREFIX = "torch-"
REPORT_SUFFIX = ".json"
SNAPSHOT_REQUEST_SUFFIX = ".snapshot-request"

# torch.cuda.memory_stats keys -> catalog columns (the report's device entries use the columns).
MEMORY_STATS_COLUMNS: dict[str, str] = {
    "allocated_bytes.all.current": M.process_torch_allocated_bytes,
    "reserved_bytes.all.current": M.process_torch_reserved_bytes,
    "active_bytes.all.current": M.process_torch_active_bytes,
    "inactive_split_bytes.all.current": M.process_torch_inactive_split_bytes,
    "requested_bytes.all.current": M.process_torch_requested_bytes,
    "segment.all.current": M.process_torch_segments,
    "num_alloc_retries": M.process_torch_alloc_retries_total,
    "num_ooms": M.process_torch_ooms_total,
}
REPORTED_COLUMNS = frozenset(MEMORY_STATS_COLUMNS.values()) | {M.process_torch_largest_free_block_bytes}

StatsSource = Callable[[], list[dict[str, Any]]]

_lock = threading.Lock()
_active: Reporter | None = None


def default_runtime_dir() -> str:
    """``$GPUDIAG_RUNTIME_DIR``, else ``$XDG_RUNTIME_DIR/gpudiag``, else ``/tmp/gpudiag-<uid>``."""
    explicit = os.environ.get(RUNTIME_DIR_ENV)
    if explicit:
        return explicit
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg):
        return os.path.join(xdg, "gpudiag")
    return f"/tmp/gpudiag-{os.getuid()}"


def ensure_private_dir(path: str) -> str | None:
    """Create ``path`` (mode 0700) or check it; None when fit for use, else why it is refused."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        st = os.lstat(path)
    except OSError as exc:
        return f"cannot create {path}: {exc.strerror}"
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a plain directory (a symlink or a file): refusing to write reports there"
    if st.st_uid != os.geteuid():
        return f"{path} belongs to uid {st.st_uid}, not to this process (uid {os.geteuid()}): refusing it"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o}): refusing it"
    return None


def report_path(runtime_dir: str, pid: int) -> str:
    """Where the reporter of ``pid`` writes its report."""
    return os.path.join(runtime_dir, f"{REPORT_PREFIX}{pid}{REPORT_SUFFIX}")


def snapshot_request_path(runtime_dir: str, pid: int) -> str:
    """The file whose existence asks the reporter of ``pid`` for a memory snapshot."""
    return os.path.join(runtime_dir, f"{REPORT_PREFIX}{pid}{SNAPSHOT_REQUEST_SUFFIX}")


def write_atomically(path: str, data: bytes, mode: int = 0o644) -> None:
    """Write ``data`` to a temporary file next to ``path`` and rename it over ``path``."""
    tmp = f"{os.path.dirname(path)}/.{os.path.basename(path)}.{os.getpid()}.{threading.get_ident()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _visible_devices() -> list[str] | None:
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    if value is None or value.strip() == "":
        return None
    return [v.strip() for v in value.split(",") if v.strip()]


def _torch_uuid(props: Any) -> str | None:
    uuid = getattr(props, "uuid", None)
    if uuid is None:
        return None
    text = str(uuid)
    return text if text.startswith(("GPU-", "MIG-")) else f"GPU-{text}"


class TorchCudaStats:
    """Reads the caching allocator of every device the process has touched, without initialising CUDA."""

    def __init__(self):
        import torch

        self.torch = torch
        self._props: dict[int, tuple[str | None, str | None]] = {}

    def __call__(self) -> list[dict[str, Any]]:
        """One entry per device in use: torch device index, NVML uuid/gpu where known, catalog columns."""
        cuda = self.torch.cuda
        if not cuda.is_initialized():
            return []
        visible = _visible_devices()
        current = cuda.current_device()
        out = []
        for device in range(cuda.device_count()):
            stats = cuda.memory_stats(device)
            if device != current and not stats.get("reserved_bytes.all.current"):
                continue  # a device this process never allocated on
            entry: dict[str, Any] = {"device": device}
            if device not in self._props:
                props = cuda.get_device_properties(device)
                self._props[device] = (_torch_uuid(props), getattr(props, "name", None))
            entry["uuid"], entry["name"] = self._props[device]
            if visible is None:
                entry["gpu"] = device
            elif device < len(visible):
                v = visible[device]
                if v.isdigit():
                    entry["gpu"] = int(v)
                elif entry["uuid"] is None:
                    entry["uuid"] = v
            for key, column in MEMORY_STATS_COLUMNS.items():
                if key in stats:
                    entry[column] = int(stats[key])
            out.append(entry)
        return out

    def snapshot(self) -> dict[str, Any]:
        """``torch.cuda.memory._snapshot()``: segments, blocks and (if recorded) allocation history."""
        if not self.torch.cuda.is_initialized():
            raise RuntimeError("CUDA is not initialised in this process yet")
        return self.torch.cuda.memory._snapshot()


class Reporter:
    """The daemon thread behind ``instrument``; ``tick()`` is one publication."""

    def __init__(self, runtime_dir: str, interval_s: float, stats: StatsSource,
                 snapshot: Callable[[], Any] | None = None):
        self.runtime_dir = runtime_dir
        self.interval_s = interval_s
        self.stats = stats
        self.snapshot_fn = snapshot
        self.pid = os.getpid()
        self.path = report_path(runtime_dir, self.pid)
        self.request_path = snapshot_request_path(runtime_dir, self.pid)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._base = {"schema": REPORT_SCHEMA, "pid": self.pid, "uid": os.geteuid(),
                      "start_ticks": proc_start_ticks(self.pid), "process": proc_comm(self.pid),
                      "interval_s": interval_s}
        self.last_snapshot: dict[str, Any] | None = None
        self.last_error: str | None = None
        self.ticks = 0

    def start(self) -> Reporter:
        """Publish once now, then every ``interval_s`` from a daemon thread."""
        self.tick()
        self._thread = threading.Thread(target=self._run, name="gpudiag-reporter", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.tick()

    def tick(self) -> None:
        """Read the figures, answer a pending snapshot request, write the report. Never raises."""
        try:
            if os.path.lexists(self.request_path):
                self._write_snapshot()
            try:
                devices = self.stats()
                self.last_error = None
            except Exception as exc:  # noqa: BLE001 - the host process's CUDA state is not ours to break
                devices = []
                self.last_error = f"{type(exc).__name__}: {exc}"
            report = dict(self._base, t=time.time(), devices=devices, snapshot=self.last_snapshot,
                          error=self.last_error)
            write_atomically(self.path, json.dumps(report, separators=(",", ":")).encode())
            self.ticks += 1
        except Exception as exc:  # noqa: BLE001 - a full disk or a vanished directory must not reach the host
            self.last_error = f"{type(exc).__name__}: {exc}"
            log.debug("gpudiag reporter tick failed: %s", self.last_error)

    def _write_snapshot(self) -> None:
        try:
            os.unlink(self.request_path)
        except OSError:
            pass
        now = time.time()
        if self.snapshot_fn is None:
            self.last_snapshot = {"t": now, "error": "this reporter cannot take snapshots (no torch CUDA)"}
            return
        try:
            data = pickle.dumps(self.snapshot_fn())
            path = os.path.join(self.runtime_dir, f"{REPORT_PREFIX}{self.pid}-snapshot-{int(now)}.pickle")
            write_atomically(path, data, mode=0o600)
            self.last_snapshot = {"t": now, "path": path, "bytes": len(data)}
        except Exception as exc:  # noqa: BLE001 - a failed snapshot is reported, never raised
            self.last_snapshot = {"t": now, "error": f"{type(exc).__name__}: {exc}"}

    def stop(self, remove_report: bool = True) -> None:
        """Stop the thread and (by default) remove the report, so the agent stops listing the process."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=max(1.0, self.interval_s * 2))
        if remove_report and self.pid == os.getpid():  # a forked child must not remove its parent's report
            try:
                os.unlink(self.path)
            except OSError:
                pass


def _no_op(reason: str) -> None:
    log.warning("gpudiag.instrument: %s; the memory reporter is off", reason)


def instrument(runtime_dir: str | None = None, interval_s: float = 1.0,
               stats_source: StatsSource | None = None) -> Reporter | None:
    """Start the memory reporter of this process (once; later calls return the running one).

    ``runtime_dir`` defaults to :func:`default_runtime_dir`; ``stats_source``
    replaces torch's allocator as the source of device entries (a list of
    dicts with ``device``, ``uuid``/``gpu`` and catalog columns). Returns the
    Reporter, or None when it is a no-op (no torch, no CUDA, unusable
    directory); never raises.
    """
    global _active
    try:
        with _lock:
            if _active is not None and _active._thread is not None and _active._thread.is_alive():
                return _active
            snapshot = None
            if stats_source is None:
                try:
                    import torch
                except Exception as exc:  # noqa: BLE001 - a broken torch install can raise anything
                    _no_op(f"torch cannot be imported ({type(exc).__name__})")
                    return None
                if getattr(torch.version, "cuda", None) is None and not getattr(torch.version, "hip", None):
                    _no_op(f"torch {torch.__version__} is a build without CUDA")
                    return None
                if torch.cuda.device_count() == 0:
                    _no_op("no CUDA device is visible to this process")
                    return None
                source = TorchCudaStats()
                stats_source, snapshot = source, source.snapshot
            directory = runtime_dir or default_runtime_dir()
            refused = ensure_private_dir(directory)
            if refused:
                _no_op(refused)
                return None
            reporter = Reporter(directory, interval_s, stats_source, snapshot).start()
            _active = reporter
            log.info("gpudiag.instrument: publishing allocator figures to %s every %.3g s",
                     reporter.path, interval_s)
            return reporter
    except Exception as exc:  # noqa: BLE001 - instrument() is called from user code: never raise into it
        _no_op(f"could not start ({type(exc).__name__}: {exc})")
        return None


def stop() -> None:
    """Stop the reporter ``instrument`` started, if any (also runs at interpreter exit)."""
    global _active
    with _lock:
        if _active is not None:
            _active.stop()
            _active = None


def _forget_in_child() -> None:
    """After fork the reporter thread is gone and the PID differs: the child starts afresh if it asks."""
    global _active
    _active = None


def _at_exit() -> None:
    try:
        stop()
    except Exception as exc:  # noqa: BLE001 - interpreter exit: nothing left to report to
        log.debug("gpudiag reporter stop at exit: %s", exc)


atexit.register(_at_exit)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)
