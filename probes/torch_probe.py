"""The agent's side of the in-process reporter: finds the reports, checks them, yields process rows.

Reports (``torch-<pid>.json``, see :mod:`gpudiag.probes.torch_reporter`) are
read from the runtime directories of every user the agent can see. A report
is believed only if:

* it is a regular file (not a symlink) of at most ``max_report_bytes``, plain
  JSON of the known schema, whose ``pid`` matches its file name;
* the process is alive and is the one that wrote it (same start time, so a
  reused PID does not inherit a dead process's figures);
* the file belongs to the user the process runs as (one user cannot publish
  figures in the name of another user's process).

Anything else is ignored and listed in ``status()["ignored"]``. A report that
stopped updating yields rows with the white and grey layers absent and the
reason in ``white_missing_reason`` / ``grey_missing_reason``.

A reporter inside a container publishes its own namespace's PID; when that
PID is not ours the probe finds the process whose innermost NSpid and start
time match.
"""

from __future__ import annotations

import glob
import json
import os
import re
import stat
import time
from collections.abc import Callable
from typing import Any

from gpudiag.frames import Frame
from gpudiag.probes.base import Probe, proc_nspid, proc_start_ticks, proc_status_field
from gpudiag.probes.torch_reporter import (
    REPORT_SCHEMA,
    REPORTED_COLUMNS,
    default_runtime_dir,
    snapshot_request_path,
)

_REPORT_NAME = re.compile(r"^torch-(\d+)\.json$")

# A report older than this many of its own intervals (and at least the floor) is stale:
# the reporter thread is stuck or the process is frozen.
STALE_INTERVALS = 5
STALE_FLOOR_S = 15.0


def default_runtime_dirs() -> list[str]:
    """This user's runtime directory plus every user's that is visible (the agent may run as root)."""
    # Of /tmp, only the per-uid directories the reporter itself creates; the configured one whatever its name.
    per_uid = [d for d in sorted(glob.glob("/tmp/gpudiag-*")) if d[len("/tmp/gpudiag-"):].isdigit()]
    dirs = [default_runtime_dir()] + sorted(glob.glob("/run/user/*/gpudiag")) + per_uid
    seen, out = set(), []
    for d in dirs:
        if d not in seen:
            seen.add(d)
            out.append(d)
    return out


class TorchProbe(Probe):
    """White and grey layers (and the rest of the allocator's figures) per (gpu, pid) from reporter files."""

    name = "torch"

    def __init__(self, runtime_dirs: list[str] | None = None, *, interval_s: float = 1.0,
                 gpu_index_by_uuid: Callable[[], dict[str, int]] | None = None, node: str | None = None,
                 proc_root: str = "/proc", max_report_bytes: int = 1 << 20,
                 clock: Callable[[], float] = time.time):
        self.interval_s = interval_s
        self._explicit_dirs = runtime_dirs
        self.gpu_index_by_uuid = gpu_index_by_uuid or (dict)
        self.node = node
        self.proc_root = proc_root
        self.max_report_bytes = max_report_bytes
        self._clock = clock
        self._ignored: dict[str, str] = {}
        self._reporters: list[dict[str, Any]] = []
        self._resolved: dict[tuple[int, int | None], int | None] = {}

    @property
    def runtime_dirs(self) -> list[str]:
        """The directories searched for reports."""
        return list(self._explicit_dirs) if self._explicit_dirs is not None else default_runtime_dirs()

    # -- validation ---------------------------------------------------------------------

    def _read_report(self, path: str, file_pid: int) -> tuple[dict[str, Any] | None, os.stat_result | None, str]:
        try:
            st = os.lstat(path)
        except OSError as exc:
            return None, None, f"cannot stat: {exc.strerror}"
        if not stat.S_ISREG(st.st_mode):
            return None, st, "not a regular file"
        if st.st_size > self.max_report_bytes:
            return None, st, f"larger than {self.max_report_bytes} bytes"
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            with os.fdopen(fd, "rb") as fh:
                report = json.loads(fh.read(self.max_report_bytes + 1))
        except (OSError, ValueError) as exc:
            return None, st, f"unreadable report ({type(exc).__name__})"
        if not isinstance(report, dict) or report.get("schema") != REPORT_SCHEMA:
            return None, st, "unknown report schema"
        if report.get("pid") != file_pid:
            return None, st, "pid in the report differs from the file name"
        if not isinstance(report.get("devices"), list):
            return None, st, "report without a device list"
        return report, st, ""

    def _resolve_pid(self, pid: int, start_ticks: int | None) -> int | None:
        """The PID, in our namespace, of the process that wrote the report; None when it is gone."""
        if start_ticks is None:
            return pid if os.path.isdir(f"{self.proc_root}/{pid}") else None
        if proc_start_ticks(pid, self.proc_root) == start_ticks:
            return pid
        key = (pid, start_ticks)
        if key in self._resolved:
            found = self._resolved[key]
            if found is not None and proc_start_ticks(found, self.proc_root) == start_ticks:
                return found
        found = None
        for entry in os.listdir(self.proc_root):
            if not entry.isdigit():
                continue
            nspid = proc_nspid(int(entry), self.proc_root)
            if nspid and len(nspid) > 1 and nspid[-1] == pid and \
                    proc_start_ticks(int(entry), self.proc_root) == start_ticks:
                found = int(entry)
                break
        self._resolved[key] = found
        return found

    def _owner_matches(self, pid: int, st: os.stat_result) -> bool:
        uids = proc_status_field(pid, "Uid", self.proc_root)
        if uids is None:
            return False
        try:
            return st.st_uid in {int(u) for u in uids.split()}
        except ValueError:
            return False

    # -- sampling -----------------------------------------------------------------------

    def sample(self, now: float) -> list[Frame]:
        """One "process" frame: a row per (device, pid) of every believed report."""
        rows: list[dict[str, Any]] = []
        self._ignored = {}
        self._reporters = []
        wall = self._clock()
        by_uuid = self.gpu_index_by_uuid() or {}
        for directory in self.runtime_dirs:
            try:
                names = os.listdir(directory)
            except OSError:
                continue
            for name in sorted(names):
                match = _REPORT_NAME.match(name)
                if not match:
                    continue
                path = os.path.join(directory, name)
                rows.extend(self._rows_of(path, int(match.group(1)), wall, by_uuid))
        return [Frame("process", now, rows)]

    def _rows_of(self, path: str, file_pid: int, wall: float, by_uuid: dict[str, int]) -> list[dict[str, Any]]:
        report, st, why = self._read_report(path, file_pid)
        if report is None:
            self._ignored[path] = why
            return []
        pid = self._resolve_pid(file_pid, report.get("start_ticks"))
        if pid is None:
            self._ignored[path] = f"process {file_pid} is gone (stale report)"
            return []
        if not self._owner_matches(pid, st):
            self._ignored[path] = f"file owner uid {st.st_uid} is not the user of process {pid}"
            return []
        try:
            age_s = max(0.0, wall - float(report.get("t", 0.0)))
            interval = float(report.get("interval_s") or self.interval_s)
        except (TypeError, ValueError):
            self._ignored[path] = "malformed time fields"
            return []
        stale_after = max(STALE_INTERVALS * interval, STALE_FLOOR_S)
        stale = age_s > stale_after
        devices = [d for d in report["devices"] if isinstance(d, dict)]
        self._reporters.append({"pid": pid, "reported_pid": file_pid, "path": path, "age_s": round(age_s, 3),
                                "stale": stale, "devices": len(devices), "error": report.get("error"),
                                "snapshot": report.get("snapshot")})
        rows = []
        for entry in devices:
            uuid = entry.get("uuid") if isinstance(entry.get("uuid"), str) else None
            gpu = by_uuid.get(uuid) if uuid else None
            if gpu is None and isinstance(entry.get("gpu"), int):
                gpu = entry["gpu"]
            row: dict[str, Any] = {"gpu": gpu, "uuid": uuid, "pid": pid,
                                   "process": report.get("process") if isinstance(report.get("process"), str)
                                   else None,
                                   "torch_device": entry.get("device"), "torch_report_age_s": age_s}
            if self.node:
                row["node"] = self.node
            if stale:
                reason = f"the reporter of process {pid} has not written for {age_s:.0f} s"
                row["white_missing_reason"] = row["grey_missing_reason"] = reason
            else:
                for column in REPORTED_COLUMNS:
                    value = entry.get(column)
                    if isinstance(value, (int, float)) and not isinstance(value, bool):
                        row[column] = value
            rows.append(row)
        return rows

    def request_snapshot(self, pid: int) -> str:
        """Ask the reporter of ``pid`` for a memory snapshot; returns the request file's path.

        The reporter answers at its next tick; its report's ``snapshot`` field
        then names the pickle (load it only with a restricted unpickler).
        """
        for reporter in self._reporters:
            if reporter["pid"] == pid or reporter["reported_pid"] == pid:
                directory = os.path.dirname(reporter["path"])
                path = snapshot_request_path(directory, reporter["reported_pid"])
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o644)
                os.close(fd)
                return path
        from gpudiag.errors import GpudiagError

        raise GpudiagError(f"no in-process reporter for pid {pid}: call gpudiag.instrument() in that process")

    def status(self) -> dict[str, Any]:
        """Reporters found (pid, age, stale), files ignored and why."""
        available = bool(self._reporters)
        reason = "" if available else (
            "no in-process reporter found in " + ", ".join(self.runtime_dirs)
            + ": call gpudiag.instrument() in the training or serving process")
        return {"name": self.name, "available": available, "reason": reason, "missing_fields": {},
                "reporters": list(self._reporters), "ignored": dict(self._ignored)}
