"""``gpudiag probe cuda``: the CUDA runtime and driver calls of processes, seen with eBPF.

    gpudiag probe cuda [--pid PID ...] [--lib PATH ...] [--duration S] [--json] [--events]
                       [--no-launches] [-- COMMAND ARGS...]

Without --pid or COMMAND every process that maps a CUDA library is probed. With
COMMAND the probe starts it, probes it from its first CUDA call (the command is held at
the moment it opens a CUDA library until the uprobes are in place) and stops when it
exits; under sudo the command runs as the invoking user (SUDO_UID/SUDO_GID), not as root.

Ctrl-C or SIGTERM ends the run with the summary (SIGTERM is passed on to the command).

Exit codes: 0 the probe ran (the command's own exit code is in the summary); 2 the
probe cannot run here (not root, no bcc, no kernel headers: one line says which and the
fix) or the arguments are wrong; 130 interrupted before the probe started.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from contextlib import nullcontext
from typing import Any

import typer
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from gpudiag.errors import GpudiagError
from gpudiag.findings import json_ready
from gpudiag.units import fmt_bytes, fmt_seconds

probe_app = typer.Typer(
    help="Attach probes to processes from outside (eBPF).",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode=None,
)

POLL_S = 0.02  # how often held library loads and events are served while probing
CHILD_GRACE_S = 10  # how long an interrupted run waits for the command to exit before reporting
SUMMARY_WIDTH = 160  # columns of the summary when stdout is not a terminal (a file, a pipe)

# Names of the return codes seen most; anything else is shown as its number.
RUNTIME_ERRORS = {1: "cudaErrorInvalidValue", 2: "cudaErrorMemoryAllocation", 3: "cudaErrorInitializationError",
                  35: "cudaErrorInsufficientDriver", 100: "cudaErrorNoDevice", 700: "cudaErrorIllegalAddress",
                  999: "cudaErrorUnknown"}
DRIVER_ERRORS = {1: "CUDA_ERROR_INVALID_VALUE", 2: "CUDA_ERROR_OUT_OF_MEMORY", 3: "CUDA_ERROR_NOT_INITIALIZED",
                 100: "CUDA_ERROR_NO_DEVICE", 400: "CUDA_ERROR_INVALID_HANDLE", 700: "CUDA_ERROR_ILLEGAL_ADDRESS",
                 999: "CUDA_ERROR_UNKNOWN"}

# The command starts held: this stub waits for one byte on a pipe, so that the probe can
# mark its pid before the command makes any call, drops to the invoking user if asked,
# then becomes the command (same pid). A second pipe, closed by a successful exec, carries
# the errno of a failed one back, so that a command that cannot run is an error, not a run.
_HOLD = ("import os, sys\n"
         "fd, status, uid, gid = (int(a) for a in sys.argv[1:5])\n"
         "groups = sys.argv[5]\n"
         "os.set_inheritable(status, False)\n"
         "os.read(fd, 1); os.close(fd)\n"
         "try:\n"
         "    if uid >= 0:\n"
         "        os.setgroups([int(g) for g in groups.split(',') if g]); os.setgid(gid); os.setuid(uid)\n"
         "    os.execvp(sys.argv[6], sys.argv[6:])\n"
         "except OSError as exc:\n"
         "    os.write(status, str(exc.errno).encode())\n"
         "    os._exit(127)\n")


def register(app: typer.Typer) -> None:
    """Add the ``probe`` sub-commands to the gpudiag app."""
    app.add_typer(probe_app, name="probe")


def error_name(api: str, code: int) -> str:
    """The symbolic name of a CUDA return code (runtime ``cuda*`` or driver ``cu*``)."""
    names = RUNTIME_ERRORS if api.startswith("cuda") else DRIVER_ERRORS
    return names.get(code, str(code))


_terminated = False


def _terminate(signum, frame) -> None:
    global _terminated
    _terminated = True
    raise KeyboardInterrupt



def _ns(v: float | None) -> str:
    return "-" if v is None else fmt_seconds(v / 1e9)


def _invoking_user() -> tuple[int, int, list[int]] | None:
    """(uid, gid, groups) of the user behind sudo, to run the command as; None to keep ours."""
    if os.geteuid() != 0 or "SUDO_UID" not in os.environ:
        return None
    try:
        uid, gid = int(os.environ["SUDO_UID"]), int(os.environ.get("SUDO_GID", os.environ["SUDO_UID"]))
    except ValueError:
        raise GpudiagError("SUDO_UID/SUDO_GID are not numbers: refusing to guess whom to run the "
                           "command as") from None
    if uid == 0:
        return None
    groups = [gid]
    user = os.environ.get("SUDO_USER")
    if user:
        try:
            groups = os.getgrouplist(user, gid)
        except (KeyError, OSError):
            pass
    return uid, gid, groups


def _start_command(argv: list[str], stdout) -> tuple[subprocess.Popen, int, int]:
    """Start ``argv`` held before exec; returns the process, the pipe end that releases it and the
    pipe end that :func:`_exec_error` reads."""
    who = _invoking_user()
    uid, gid, groups = who if who else (-1, -1, [])
    read_end, write_end = os.pipe()
    status_read, status_write = os.pipe()
    try:
        child = subprocess.Popen([sys.executable, "-c", _HOLD, str(read_end), str(status_write), str(uid), str(gid),
                                  ",".join(map(str, groups)), *argv], pass_fds=(read_end, status_write),
                                 stdout=stdout)
    except OSError as exc:
        os.close(write_end)
        os.close(status_read)
        raise GpudiagError(f"cannot start the probe's launcher {sys.executable}: {exc.strerror}") from None
    finally:
        os.close(read_end)
        os.close(status_write)
    return child, write_end, status_read


def _exec_error(status_read: int) -> str | None:
    """Wait until the released command has become itself; None, or why it could not (its errno's text)."""
    chunks = []
    while chunk := os.read(status_read, 64):  # end of file: the exec closed the pipe
        chunks.append(chunk)
    os.close(status_read)
    if not chunks:
        return None
    try:
        return os.strerror(int(b"".join(chunks)))
    except ValueError:
        return "the launcher failed"


def _flags(api: str, rec: dict, proc: dict) -> str:
    flags = []
    if rec["error_burst"]:
        flags.append("ERROR BURST")
    elif rec["errors"]:
        flags.append("errors")
    degenerate = sum(d["count"] for d in proc["degenerate_launches"] if d["api"] == api)
    if degenerate:
        flags.append(f"grid 1x1x1 x{degenerate}")
    return ", ".join(flags)


def _short_error(api: str, code: int) -> str:
    name = error_name(api, code)
    for prefix in ("CUDA_ERROR_", "cudaError"):
        if name.startswith(prefix):
            return f"{code} {name[len(prefix):]}"
    return name


def render_table(snap: dict, rates: dict | None = None) -> Table:
    """The per-process, per-API table (a CALLS/S column when ``rates`` are given)."""
    table = Table(title="CUDA API calls (eBPF)", title_justify="left", expand=False)
    columns = [("PROCESS", "left"), ("API", "left"), ("CALLS", "right"), ("CALLS/S", "right"),
               ("ERRORS", "left"), ("BYTES", "right"), ("P50", "right"), ("P95", "right"), ("P99", "right"),
               ("FLAGS", "left")]
    if rates is None:
        columns.remove(("CALLS/S", "right"))
    for col, justify in columns:
        table.add_column(col, justify=justify, no_wrap=col not in ("ERRORS", "FLAGS"))
    order = {name: i for i, name in enumerate(snap["apis_probed"])}
    for proc in snap["processes"]:
        for api, rec in sorted(proc["apis"].items(), key=lambda kv: order.get(kv[0], 99)):
            errors = ", ".join(f"{n}x {_short_error(api, int(code))}" for code, n in sorted(rec["errors"].items()))
            lat = rec["latency_ns"]
            flags = _flags(api, rec, proc)
            cells = [f"{proc['pid']} {proc['comm'] or '?'}", api, str(rec["calls"])]
            if rates is not None:
                rate = rates.get((proc["pid"], api))
                cells.append("-" if rate is None else f"{rate:.0f}")
            cells += [errors or "-", fmt_bytes(rec["bytes"]) if rec["bytes"] else "-", _ns(lat["p50"]),
                      _ns(lat["p95"]), _ns(lat["p99"])]
            alarm = "BURST" in flags or "grid" in flags
            table.add_row(*cells, Text(flags, style="bold red" if alarm else ""))
    return table


def render_status(snap: dict) -> Text:
    """Lines under the table: what is attached, what was lost, per-process memory and CPU."""
    lines = []
    attached = ", ".join(f"{os.path.basename(a['path'])} ({len(a['apis'])} APIs)" for a in snap["probes_attached"])
    lines.append(f"attached: {attached or 'no CUDA library yet'}; launch probes "
                 f"{'on' if snap['launch_probes'] else 'off (--no-launches)'}; host tracepoints "
                 f"{'on' if snap['host_tracepoints'] else 'off'}; dropped events {snap['dropped_events']}")
    for proc in snap["processes"]:
        parts = [f"pid {proc['pid']} {proc['comm'] or '?'}" + ("" if proc["alive"] else " (exited)")]
        if proc.get("pod_uid"):
            parts.append(f"pod {proc['pod_uid']}")
        if proc.get("container_id"):
            parts.append(f"container {proc['container_id'][:12]}")
        if proc["outstanding"] or proc["outstanding_bytes"]:
            n = sum(o["count"] for o in proc["outstanding"])
            parts.append(f"outstanding {fmt_bytes(proc['outstanding_bytes'])} in {n} allocations")
        if proc["kernel_launches"]:
            parts.append(f"launches {proc['kernel_launches']}")
        if proc["offcpu"]:
            parts.append(f"off-CPU {fmt_seconds(proc['offcpu']['offcpu_s'])} "
                         f"(run-queue {fmt_seconds(proc['offcpu']['runqueue_wait_s'])})")
        if proc["oom_killed"]:
            parts.append("KILLED BY THE OOM KILLER")
        lines.append(", ".join(parts))
    return Text("\n".join(lines))


def render_summary(snap: dict) -> Group:
    """The end-of-run report: the table, leaks by stack, launch shapes, degenerate launches."""
    parts: list[Any] = [render_table(snap), render_status(snap)]
    for proc in snap["processes"]:
        head = f"pid {proc['pid']} {proc['comm'] or '?'}"
        for o in proc["outstanding"][:5]:
            frames = "\n    ".join(o["stack"][:8]) or "(no stack)"
            parts.append(Text(f"{head}: {fmt_bytes(o['bytes'])} in {o['count']} allocation(s) never freed "
                              f"({', '.join(o['apis'])}, oldest {fmt_seconds(o['oldest_age_s'])}) at\n    {frames}"))
        if proc["launches"]:
            t = Table(title=f"{head}: kernel launches", title_justify="left")
            for col in ("FUNCTION", "GRID", "BLOCK", "SHARED", "COUNT"):
                t.add_column(col, justify="left" if col == "FUNCTION" else "right")
            for launch in proc["launches"][:10]:
                t.add_row(launch["function"], "x".join(map(str, launch["grid"])), "x".join(map(str, launch["block"])),
                          fmt_bytes(launch["shared_mem_bytes"]), str(launch["count"]))
            parts.append(t)
        for d in proc["degenerate_launches"]:
            frames = "\n    ".join(d["stack"][:8]) or "(no stack)"
            parts.append(Text(f"{head}: {d['function']} launched {d['count']} time(s) with grid (1,1,1), "
                              f"sampled at\n    {frames}", style="bold"))
        if proc["offcpu"] and proc["offcpu"]["threads"]:
            busiest = proc["offcpu"]["threads"][0]
            name = f" {busiest['comm']}" if busiest["comm"] else ""
            parts.append(Text(f"{head}: most off-CPU thread {busiest['tid']}{name}: "
                              f"{fmt_seconds(busiest['offcpu_s'])} "
                              f"(run-queue {fmt_seconds(busiest['runqueue_wait_s'])})"))
    for k in snap["oom_kills"]:
        parts.append(Text(f"OOM kill: pid {k['pid']} {k['comm']} ({fmt_bytes(k['anon_rss_bytes'])} anonymous)",
                          style="bold red"))
    if snap.get("command"):
        cmd = snap["command"]
        code = cmd["exit_code"]
        parts.append(Text(f"command {' '.join(cmd['argv'])}: " +
                          ("still running" if code is None else f"exit code {code}")))
    for note in snap["notes"]:
        parts.append(Text(f"note: {note}", style="dim"))
    return Group(*parts)


def _event_line(ev: dict) -> str:
    what = ev["api"]
    if "grid" in ev:
        what += f" {ev['function']} grid={tuple(ev['grid'])} block={tuple(ev['block'])}"
    if ev["bytes"]:
        what += f" {fmt_bytes(ev['bytes'])}"
    if "kind" in ev:
        what += f" {ev['kind']}"
    top = ev["stack"][0] if ev["stack"] else "?"
    return (f"{ev['t_ns'] / 1e9:.6f} pid={ev['pid']} tid={ev['tid']} {what} -> {error_name(ev['api'], ev['ret'])}"
            f" in {_ns(ev['latency_ns'])} at {top}")


def _rates(snap: dict, prev: dict | None, dt: float) -> dict:
    out = {}
    if prev is None or dt <= 0:
        return out
    before = {(p["pid"], api): rec["calls"] for p in prev["processes"] for api, rec in p["apis"].items()}
    for p in snap["processes"]:
        for api, rec in p["apis"].items():
            out[(p["pid"], api)] = (rec["calls"] - before.get((p["pid"], api), 0)) / dt
    return out


@probe_app.command("cuda", context_settings={"allow_interspersed_args": False})
def cuda(
    pid: list[int] = typer.Option([], "--pid", metavar="PID",
                                  help="A process to probe (repeatable; its children too)."),
    lib: list[str] = typer.Option([], "--lib", metavar="PATH", help="A CUDA library file to attach to (repeatable)."),
    duration: float | None = typer.Option(None, "--duration", metavar="S", min=0.0, help="Stop after S seconds."),
    json_out: bool = typer.Option(False, "--json", help="One JSON document on stdout at the end."),
    events: bool = typer.Option(False, "--events", help="Also stream one event per call, with its stack."),
    no_launches: bool = typer.Option(False, "--no-launches",
                                     help="Leave kernel launches unprobed (they are the costly probes)."),
    interval: float = typer.Option(1.0, "--interval", metavar="S", min=0.1, help="Seconds between table refreshes."),
    command: list[str] | None = typer.Argument(None, metavar="[-- COMMAND ARGS...]",
                                               help="A command to start and probe until it exits."),
) -> None:
    """Count CUDA runtime/driver calls, errors, bytes and latency per process, from outside (root)."""
    from gpudiag.probes import cuda_libs
    from gpudiag.probes.cuda_ebpf import CudaApiProbe

    command = list(command or [])
    if command and pid:
        raise GpudiagError("give either --pid or a COMMAND, not both")
    if any(p <= 0 for p in pid):
        raise GpudiagError("--pid takes positive process ids")
    for p in pid:
        if not os.path.exists(f"/proc/{p}"):
            raise GpudiagError(f"--pid {p}: no such process")
    libraries = [cuda_libs.library_from_path(path) for path in lib]
    console = Console(stderr=json_out)
    # SIGTERM (timeout, systemd, kill) ends the run like Ctrl-C: summary, resume, detach.
    previous_term = signal.signal(signal.SIGTERM, _terminate)
    probe = CudaApiProbe(pid or ([] if command else None), libraries=libraries, launches=not no_launches,
                         events=events)
    try:
        probe.start()
    except KeyboardInterrupt:
        probe.close()
        signal.signal(signal.SIGTERM, previous_term)
        sys.stderr.write("gpudiag: error: interrupted while attaching the probes\n")
        raise typer.Exit(130) from None
    child, release, interrupted = None, None, False
    all_events: list[dict] = []
    try:
        if command:
            child, release, exec_status = _start_command(command, stdout=sys.stderr if json_out else None)
            probe.add_process(child.pid, stop_on_load=True)
            os.write(release, b"x")
            os.close(release)
            release = None
            why = _exec_error(exec_status)
            if why is not None:
                child.wait()
                raise GpudiagError(f"cannot run {command[0]}: {why}")
            probe.add_process(child.pid, stop_on_load=True)  # again, now that it is the command: its name
        live_view = sys.stdout.isatty() and not json_out
        started = time.monotonic()
        deadline = started + duration if duration is not None else None
        next_tick, prev, prev_t = started, None, started
        with (Live(console=console, refresh_per_second=4, transient=True) if live_view else nullcontext()) as live:
            try:
                while True:
                    probe.poll()
                    if events:
                        fresh = probe.events()
                        all_events.extend(fresh)
                        if not json_out:
                            for ev in fresh:
                                console.print(_event_line(ev), markup=False, highlight=False)
                    now = time.monotonic()
                    if child is not None and child.poll() is not None:
                        break
                    if deadline is not None and now >= deadline:
                        break
                    if live is not None and now >= next_tick:
                        snap = probe.snapshot()
                        live.update(Group(render_table(snap, _rates(snap, prev, now - prev_t)), render_status(snap)))
                        prev, prev_t, next_tick = snap, now, now + interval
                    time.sleep(POLL_S)
            except KeyboardInterrupt:
                interrupted = True
                if child is not None and child.poll() is None:
                    if _terminated:  # Ctrl-C reached the command from the terminal; SIGTERM did not
                        child.terminate()
                    try:
                        child.wait(timeout=CHILD_GRACE_S)
                    except (subprocess.TimeoutExpired, KeyboardInterrupt):
                        pass
        probe.poll()
        snap = probe.snapshot()
        if events:
            all_events.extend(probe.events())
        snap["interrupted"] = interrupted
        if command:
            snap["command"] = {"argv": command, "pid": child.pid if child else None,
                               "exit_code": child.returncode if child else None}
        if events:
            snap["events"] = all_events
        if json_out:
            sys.stdout.write(json.dumps(json_ready(snap), indent=1) + "\n")
            sys.stdout.flush()
        else:
            out = Console()
            if not out.is_terminal:
                out = Console(width=max(out.width, SUMMARY_WIDTH))
            out.print(render_summary(snap))
    finally:
        if release is not None:
            os.close(release)
        probe.close()
        signal.signal(signal.SIGTERM, previous_term)
