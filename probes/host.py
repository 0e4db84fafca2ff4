"""The host's view of GPU processes and of the node: CPU (per process and per thread), memory, switches.

A GPU that waits for its host shows low utilization while one host thread sits
near 100 % of a core (SCENARIOS.md §2); this probe gives the per-thread figure
and the thread's name (``/proc/PID/task/TID/comm``: ``pt_main_thread``,
``tokenizer``...) so the starving thread is named, not guessed.

CPU figures are differences between two ticks: a process (or thread) seen for
the first time has no CPU columns yet, rather than a made-up zero.

Which processes to watch comes from ``targets``: a callable returning the
latest (gpu, uuid, pid, process) rows, usually the NVML probe's process rows
(one host process on two GPUs yields two rows with the same host figures).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import psutil

from gpudiag.catalog import M
from gpudiag.frames import Frame
from gpudiag.probes.base import MissingFields, Probe, proc_comm

Targets = Callable[[], Iterable[dict[str, Any]]]

_LABELS = ("node", "gpu", "uuid", "pid", "process")


@dataclass
class _CpuMark:
    t: float
    cpu_s: float


class HostProbe(Probe):
    """Node CPU, load, memory and swap ("node" frame); host figures of each GPU process ("process" frame)."""

    name = "host"

    def __init__(self, targets: Targets | None = None, *, interval_s: float = 1.0, top_threads: int = 5,
                 node: str | None = None, proc_root: str = "/proc"):
        self.interval_s = interval_s
        self.targets = targets or (lambda: ())
        self.top_threads = top_threads
        self.node = node
        self.proc_root = proc_root
        self._missing = MissingFields()
        self._processes: dict[int, psutil.Process] = {}
        self._proc_marks: dict[int, _CpuMark] = {}
        self._thread_marks: dict[tuple[int, int], _CpuMark] = {}
        self._node_mark = self._node_cpu_mark()
        self._last_targets = 0

    def set_targets(self, rows: Iterable[dict[str, Any]]) -> None:
        """Watch exactly these (gpu, uuid, pid, process) rows from now on."""
        frozen = [dict(r) for r in rows]
        self.targets = lambda: frozen

    # -- node ---------------------------------------------------------------------------

    @staticmethod
    def _node_cpu_mark() -> tuple[float, float]:
        """(busy seconds, total seconds) over all CPUs since boot; idle and iowait count as not busy."""
        times = psutil.cpu_times()
        total = sum(times)
        idle = times.idle + getattr(times, "iowait", 0.0)
        return total - idle, total

    def _node_row(self) -> dict[str, Any]:
        row: dict[str, Any] = {}
        if self.node:
            row["node"] = self.node
        busy, total = self._node_cpu_mark()
        d_busy, d_total = busy - self._node_mark[0], total - self._node_mark[1]
        self._node_mark = (busy, total)
        if d_total > 0:
            row[M.node_cpu_utilization_ratio] = min(1.0, max(0.0, d_busy / d_total))
        try:
            row[M.node_load1] = os.getloadavg()[0]
        except OSError:
            self._missing.add("node", M.node_load1, "no load average on this platform")
        mem = psutil.virtual_memory()
        row[M.node_memory_total_bytes] = mem.total
        row[M.node_memory_used_bytes] = mem.total - mem.available  # what the kernel cannot hand out at once
        row[M.node_swap_used_bytes] = psutil.swap_memory().used
        row["cpu_count"] = psutil.cpu_count()
        return row

    # -- processes --------------------------------------------------------------------

    def _process(self, pid: int) -> psutil.Process | None:
        proc = self._processes.get(pid)
        if proc is not None and proc.is_running():  # is_running also catches a reused PID
            return proc
        self._proc_marks.pop(pid, None)
        try:
            proc = psutil.Process(pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            self._processes.pop(pid, None)
            return None
        self._processes[pid] = proc
        return proc

    def _host_columns(self, pid: int, now: float) -> dict[str, Any] | None:
        proc = self._process(pid)
        if proc is None:
            return None
        out: dict[str, Any] = {}
        try:
            with proc.oneshot():
                times = proc.cpu_times()
                cpu_s = times.user + times.system
                out[M.process_resident_memory_bytes] = proc.memory_info().rss
                switches = proc.num_ctx_switches()
                out[M.process_context_switches_total] = {"voluntary": switches.voluntary,
                                                         "involuntary": switches.involuntary}
                out["threads"] = proc.num_threads()
                threads = proc.threads()
        except psutil.NoSuchProcess:
            self._processes.pop(pid, None)
            return None
        except psutil.AccessDenied:
            self._missing.add(f"pid{pid}", "host", "no permission to read this process (run as its user or root)")
            return out or None
        mark = self._proc_marks.get(pid)
        if mark is not None and now > mark.t:
            out[M.process_cpu_utilization_ratio] = max(0.0, (cpu_s - mark.cpu_s) / (now - mark.t))
        self._proc_marks[pid] = _CpuMark(now, cpu_s)
        ranked = self._thread_ratios(pid, threads, now)
        if ranked:
            out[M.process_thread_cpu_max_ratio] = ranked[0][1]
            out["top_threads"] = [{"tid": tid, "name": proc_comm(pid, self.proc_root, task=tid),
                                   "cpu_ratio": ratio} for tid, ratio in ranked[:self.top_threads]]
        return out

    def _thread_ratios(self, pid: int, threads, now: float) -> list[tuple[int, float]]:
        """(tid, CPU seconds per wall second) of threads seen at the previous tick, busiest first."""
        ratios = []
        seen = set()
        for th in threads:
            key = (pid, th.id)
            seen.add(key)
            cpu_s = th.user_time + th.system_time
            mark = self._thread_marks.get(key)
            if mark is not None and now > mark.t:
                ratios.append((th.id, max(0.0, (cpu_s - mark.cpu_s) / (now - mark.t))))
            self._thread_marks[key] = _CpuMark(now, cpu_s)
        for key in [k for k in self._thread_marks if k[0] == pid and k not in seen]:
            del self._thread_marks[key]
        ratios.sort(key=lambda x: -x[1])
        return ratios

    def sample(self, now: float) -> list[Frame]:
        """A "node" frame and a "process" frame with the host columns of every target process."""
        node_frame = Frame("node", now, [self._node_row()])
        rows = []
        per_pid: dict[int, dict[str, Any] | None] = {}
        targets = list(self.targets())
        for target in targets:
            pid = target.get("pid")
            if pid is None or target.get("pid_mapped") is False:
                continue  # a host PID this namespace cannot see: nothing to read
            pid = int(pid)
            if pid not in per_pid:
                per_pid[pid] = self._host_columns(pid, now)
            columns = per_pid[pid]
            if columns is None:
                continue
            row = {k: target[k] for k in _LABELS if k in target}
            if row.get("process") is None:
                row["process"] = proc_comm(pid, self.proc_root)
            row.update(columns)
            rows.append(row)
        for pid in [p for p in self._processes if p not in per_pid]:  # forget processes no longer watched
            self._processes.pop(pid, None)
            self._proc_marks.pop(pid, None)
            for key in [k for k in self._thread_marks if k[0] == pid]:
                del self._thread_marks[key]
        self._last_targets = len(targets)
        return [node_frame, Frame("process", now, rows)]

    def status(self) -> dict[str, Any]:
        """Always available (procfs); lists processes it could not read."""
        return {"name": self.name, "available": True, "reason": "", "missing_fields": self._missing.as_dict(),
                "watched_processes": len(self._processes), "targets": self._last_targets}
