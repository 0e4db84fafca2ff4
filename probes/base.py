"""The probe interface every reader of the world implements, and the procfs facts probes share.

A probe is sampled once per tick by the agent (or ``gpudiag top``):
``sample(now)`` returns frames (one row per entity, columns named after the
catalog). Three rules hold for every probe:

* A field the source cannot give is ABSENT from the row (or None), never 0:
  a zero is a measurement, an absent key is "not measured".
* A missing field or a missing device never raises; ``status()`` says what is
  missing and why. ``sample`` raises :class:`ProbeError` only when the probe as
  a whole failed this tick (the endpoint refused the connection, the library
  call that lists devices failed).
* A metric with labels beyond its entity's (``kind``, ``reason``, ``xid``,
  ``scope``...) is a dict keyed by the first extra label's value, nested once
  per further label, e.g. ``row[M.gpu_ecc_errors_total] ==
  {"volatile": {"corrected": 0, "uncorrected": 0}, "aggregate": {...}}``.
"""

from __future__ import annotations

import os
from typing import Any

from gpudiag.frames import Frame

# The inode of the initial (host) PID namespace is fixed by the kernel
# (PROC_PID_INIT_INO in include/linux/proc_ns.h); NVML always reports PIDs in it.
HOST_PID_NAMESPACE_INODE = 0xEFFFFFFC


class ProbeError(Exception):
    """The probe as a whole failed this tick (one field or one device missing is not an error)."""


class Probe:
    """Base class of every probe: a name, a sampling interval, ``sample``, ``status`` and ``close``."""

    name: str = "probe"
    interval_s: float = 1.0

    def sample(self, now: float) -> list[Frame]:
        """Read the world once; frames stamped ``now``. Raises ProbeError only for a whole-probe failure."""
        raise NotImplementedError

    def status(self) -> dict[str, Any]:
        """What the probe can and cannot see: ``available``, ``reason``, ``missing_fields`` and more."""
        return {"name": self.name, "available": True, "reason": "", "missing_fields": {}}

    def close(self) -> None:
        """Release what the probe holds (library handles, sockets). Safe to call twice."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


class MissingFields:
    """Fields a source answered "not supported" or "no permission" for: recorded once, never retried.

    Keys are ``(entity, field)``, e.g. ``("gpu0", "gpu_fan_speed_ratio")``; the
    value is the reason. ``status()`` of a probe reports ``as_dict()``.
    """

    def __init__(self):
        self._missing: dict[tuple[str, str], str] = {}

    def add(self, entity: str, field: str, reason: str) -> None:
        """Remember that ``field`` of ``entity`` cannot be read, and why (first reason wins)."""
        self._missing.setdefault((entity, field), reason)

    def has(self, entity: str, field: str) -> bool:
        """True when the field was found missing before (so the caller does not ask again)."""
        return (entity, field) in self._missing

    def forget(self, entity: str) -> None:
        """Drop what is known about one entity (it was replaced, e.g. a GPU came back after a reset)."""
        for key in [k for k in self._missing if k[0] == entity]:
            del self._missing[key]

    def as_dict(self) -> dict[str, dict[str, str]]:
        """``{entity: {field: reason}}``, JSON-ready."""
        out: dict[str, dict[str, str]] = {}
        for (entity, field), reason in sorted(self._missing.items()):
            out.setdefault(entity, {})[field] = reason
        return out


# --- procfs facts shared by the NVML, host and torch probes ----------------------------


def read_text(path: str, limit_bytes: int = 65536) -> str | None:
    """The text of a small procfs/sysfs file, or None when it cannot be read (gone, no permission)."""
    try:
        with open(path, "rb") as fh:
            return fh.read(limit_bytes).decode("utf-8", "replace")
    except OSError:
        return None


def proc_status_field(pid: int, field: str, proc_root: str = "/proc") -> str | None:
    """One field of /proc/PID/status (e.g. ``NSpid``, ``Uid``, ``voluntary_ctxt_switches``), or None."""
    text = read_text(f"{proc_root}/{pid}/status")
    if text is None:
        return None
    prefix = field + ":"
    for line in text.splitlines():
        if line.startswith(prefix):
            return line[len(prefix):].strip()
    return None


def proc_nspid(pid: int, proc_root: str = "/proc") -> list[int] | None:
    """The PID in each nested PID namespace, outermost (that procfs's namespace) first; None when unknown."""
    value = proc_status_field(pid, "NSpid", proc_root)
    if not value:
        return None
    try:
        return [int(x) for x in value.split()]
    except ValueError:
        return None


def proc_stat_fields(pid: int, proc_root: str = "/proc", task: int | None = None) -> list[str] | None:
    """Fields of /proc/PID/stat (or /proc/PID/task/TID/stat) after the command name; None when gone.

    The command name may contain spaces and parentheses, so the split starts
    after the last ``)``; index 0 of the result is field 3 (state) of proc(5).
    """
    path = f"{proc_root}/{pid}/stat" if task is None else f"{proc_root}/{pid}/task/{task}/stat"
    text = read_text(path)
    if not text:
        return None
    end = text.rfind(")")
    if end < 0:
        return None
    return text[end + 1:].split()


def proc_start_ticks(pid: int, proc_root: str = "/proc") -> int | None:
    """Start time of a process in clock ticks since boot (proc(5) field 22); tells a reused PID apart."""
    fields = proc_stat_fields(pid, proc_root)
    if fields is None or len(fields) < 20:
        return None
    try:
        return int(fields[19])
    except ValueError:
        return None


def proc_comm(pid: int, proc_root: str = "/proc", task: int | None = None) -> str | None:
    """The command name (comm) of a process or one of its threads, or None when gone."""
    path = f"{proc_root}/{pid}/comm" if task is None else f"{proc_root}/{pid}/task/{task}/comm"
    text = read_text(path, 256)
    return text.strip() if text is not None else None


def pid_namespace_inode(pid: int | str = "self", proc_root: str = "/proc") -> int | None:
    """The inode of a process's PID namespace (``readlink /proc/PID/ns/pid``), or None when unreadable."""
    try:
        link = os.readlink(f"{proc_root}/{pid}/ns/pid")
    except OSError:
        return None
    try:
        return int(link[link.index("[") + 1:link.index("]")])
    except ValueError:
        return None


def in_host_pid_namespace() -> bool | None:
    """True when this process shares the host's PID namespace (so NVML's PIDs are ours), None if unknown."""
    inode = pid_namespace_inode("self")
    if inode is None:
        return None
    return inode == HOST_PID_NAMESPACE_INODE
