"""``gpudiag top``: a live view of the node's GPUs, the three colours of each process, and the engines.

Per GPU: utilization, memory, temperature, power against its limit, SM clock
against its maximum and the active throttle reasons. Per process: the three
memory layers drawn nested (white = allocated inside grey = reserved inside
black = what the driver charges) and host CPU with the busiest thread. Per
engine: running and waiting requests, KV-cache usage, preemptions, latency.

``--once --json`` prints one frame as one JSON document. ``--sim [SCENARIO]``
reads the reference engine's simulated GPU instead of the real one. ``q``
quits the live view.
"""

from __future__ import annotations

import json
import math
import os
import select
import socket
import sys
import time
from typing import Annotated, Any

import typer
from rich import box
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text
from typer.core import TyperCommand

from gpudiag.agent.tracker import ThreeColourTracker
from gpudiag.catalog import M
from gpudiag.errors import GpudiagError
from gpudiag.frames import Frame
from gpudiag.probes.base import Probe, ProbeError
from gpudiag.units import fmt_bytes, fmt_ratio, fmt_seconds

DEFAULT_SCENARIO = "kv-eviction-storm"

# The nested bar's glyphs: distinct shapes, so the layers read without colour too.
WHITE_GLYPH, GREY_GLYPH, BLACK_GLYPH, FREE_GLYPH = "█", "▓", "░", "·"
BAR_WIDTH = 30


class _TopCommand(TyperCommand):
    """Lets ``--sim`` stand alone (the default scenario) or take a scenario name."""

    def parse_args(self, ctx, args):
        """Insert the default scenario after a bare ``--sim``."""
        out = []
        for i, arg in enumerate(args):
            out.append(arg)
            if arg == "--sim" and (i + 1 == len(args) or args[i + 1].startswith("-")):
                out.append(DEFAULT_SCENARIO)
        return super().parse_args(ctx, out)


# --- collecting ------------------------------------------------------------------------


def open_probes(sim: str | None, *, speed: float = 1.0, seed: int = 0, engine_urls: list[str] = (),
                runtime_dirs: list[str] | None = None) -> list[Probe]:
    """The probes ``top`` reads: the simulated GPU's, or NVML + host + torch reporters + engine endpoints."""
    from gpudiag.probes.engine_scrape import EngineScrapeProbe

    engines = [EngineScrapeProbe(url) for url in engine_urls]
    if sim is not None:
        try:
            from gpudiag.probes.sim import open_sim_probes
        except ImportError:
            raise GpudiagError("the simulated GPU backend is not available") from None
        return list(open_sim_probes(sim, speed=speed, seed=seed)) + engines
    from gpudiag.probes.host import HostProbe
    from gpudiag.probes.nvml import NvmlProbe
    from gpudiag.probes.torch_probe import TorchProbe

    latest: dict[str, list[dict[str, Any]]] = {"gpu": [], "nvml": [], "torch": []}

    def uuid_index() -> dict[str, int]:
        return {r["uuid"]: r["gpu"] for r in latest["gpu"] if r.get("uuid")}

    def host_targets() -> list[dict[str, Any]]:
        """NVML's processes, plus those only an in-process reporter names (no NVML, or PID not mapped)."""
        targets = list(latest["nvml"])
        known = {(t.get("uuid"), t.get("pid")) for t in targets}
        targets += [{k: r.get(k) for k in ("gpu", "uuid", "pid", "process")} for r in latest["torch"]
                    if (r.get("uuid"), r.get("pid")) not in known]
        return targets

    nvml = _Recording(NvmlProbe(), latest, {"gpu": "gpu", "process": "nvml"})
    torch_probe = _Recording(TorchProbe(runtime_dirs, gpu_index_by_uuid=uuid_index), latest, {"process": "torch"})
    return [nvml, torch_probe, HostProbe(targets=host_targets)] + engines


class _Recording(Probe):
    """A probe whose last rows other probes follow (the host probe reads the processes NVML lists)."""

    def __init__(self, inner: Probe, latest: dict[str, list[dict[str, Any]]], slots: dict[str, str]):
        self.inner, self.latest, self.slots = inner, latest, slots
        self.name, self.interval_s = inner.name, inner.interval_s

    def sample(self, now: float) -> list[Frame]:
        """The inner probe's frames, remembered by kind."""
        frames = self.inner.sample(now)
        for kind, slot in self.slots.items():
            self.latest[slot] = [r for fr in frames if fr.kind == kind for r in fr.rows]
        return frames

    def status(self) -> dict[str, Any]:
        """The inner probe's status."""
        return self.inner.status()

    def close(self) -> None:
        """Close the inner probe."""
        self.inner.close()


class TopModel:
    """One tick of every probe, joined by the three-colour tracker into what ``top`` shows."""

    def __init__(self, probes: list[Probe], *, sim: str | None = None, node: str | None = None):
        self.probes = probes
        self.keys = _unique_names(probes)
        self.sim = sim
        self.node = node or socket.gethostname()
        self.tracker = ThreeColourTracker(window_s=120.0)
        self.errors: dict[str, str] = {}

    def tick(self, now: float | None = None) -> dict[str, Any]:
        """Sample every probe once and return the view as plain data (JSON-ready)."""
        now = time.time() if now is None else now
        frames: list[Frame] = []
        self.errors = {}
        for key, probe in zip(self.keys, self.probes):
            try:
                got = probe.sample(now)
            except ProbeError as exc:
                self.errors[key] = str(exc)
                continue
            except Exception as exc:  # noqa: BLE001 - one broken probe must not take the view down
                self.errors[key] = f"internal error: {type(exc).__name__}: {exc}"
                continue
            frames.extend(got)
        by_kind: dict[str, list[dict[str, Any]]] = {}
        for fr in frames:
            if fr.kind != "process":
                by_kind.setdefault(fr.kind, []).extend(fr.rows)
        statuses = {}
        for key, probe in zip(self.keys, self.probes):
            try:
                statuses[key] = probe.status()
            except Exception as exc:  # noqa: BLE001 - as above, for its status
                statuses[key] = {"available": False, "reason": f"{type(exc).__name__}: {exc}"}
        notes = {}
        nvml = statuses.get("nvml")
        if nvml and not nvml.get("available"):
            notes["black"] = f"NVML unavailable: {nvml.get('reason')}"
        processes = self.tracker.update(now, frames, layer_notes=notes).rows
        node_rows = by_kind.get("node", [])
        return {"t": now, "node": self.node, "sim": self.sim,
                "host": node_rows[-1] if node_rows else {},
                "gpus": sorted(by_kind.get("gpu", []), key=lambda r: (r.get("gpu") is None, r.get("gpu"))),
                "processes": processes, "engines": by_kind.get("engine", []),
                "probes": statuses, "errors": dict(self.errors)}

    def close(self) -> None:
        """Close every probe."""
        for probe in self.probes:
            try:
                probe.close()
            except Exception as exc:  # noqa: BLE001 - closing on the way out: say it, go on
                sys.stderr.write(f"gpudiag top: closing {probe.name}: {exc}\n")


def _unique_names(probes: list[Probe]) -> list[str]:
    """Probe names, numbered where several share one (two engine endpoints: engine, engine2)."""
    seen: dict[str, int] = {}
    out = []
    for p in probes:
        seen[p.name] = seen.get(p.name, 0) + 1
        out.append(p.name if seen[p.name] == 1 else f"{p.name}{seen[p.name]}")
    return out


def _json_safe(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, (str, int, bool)) or value is None:
        return value
    return str(value)


# --- drawing ---------------------------------------------------------------------------


def three_colour_bar(white: float | None, grey: float | None, black: float | None, scale: float,
                     width: int = BAR_WIDTH) -> Text:
    """The layers drawn nested: white inside grey inside black, on a scale of ``scale`` bytes.

    A layer that is missing is simply not drawn (the outer ones still are);
    an inner layer larger than its outer one (the sources sample at different
    instants) is clipped to it.
    """
    text = Text()
    if not scale or scale <= 0:
        return text.append(FREE_GLYPH * width, style="dim")

    def cells(v: float | None) -> int:
        return 0 if v is None else max(0, min(width, round(v / scale * width)))

    b = cells(black)
    g = cells(grey) if black is None else min(cells(grey), b)
    w = cells(white) if grey is None and black is None else min(cells(white), g if grey is not None else b)
    g = max(g, w)
    b = max(b, g)
    text.append(WHITE_GLYPH * w, style="bold white")
    text.append(GREY_GLYPH * (g - w), style="grey62")
    text.append(BLACK_GLYPH * (b - g), style="grey35")
    text.append(FREE_GLYPH * (width - b), style="dim")
    return text


def ratio_bar(ratio: float | None, width: int = 10) -> Text:
    """A plain bar for a 0..1 ratio, followed by its percentage."""
    if ratio is None:
        return Text("n/a", style="dim")
    filled = max(0, min(width, round(ratio * width)))
    style = "red" if ratio >= 0.9 else "yellow" if ratio >= 0.7 else "green"
    return Text("█" * filled, style=style) + Text("·" * (width - filled), style="dim") + Text(
        f" {ratio * 100:4.0f}%")


def _fmt(value: Any, fmt: str, scale: float = 1.0) -> str:
    return "n/a" if value is None else format(value * scale, fmt)


def _throttles(row: dict[str, Any]) -> str:
    reasons = row.get(M.gpu_clock_throttle_active)
    if not isinstance(reasons, dict):
        return "n/a"
    active = [name for name, on in reasons.items() if on]
    return ", ".join(active) if active else "none"


def _gpu_table(view: dict[str, Any]) -> Table:
    table = Table(title="GPUs", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("GPU", "name", "util", "memory", "temp", "power", "SM clock", "throttle"):
        table.add_column(col, no_wrap=True, min_width=3)
    for g in view["gpus"]:
        if g.get(M.gpu_lost):
            table.add_row(str(g.get("gpu")), g.get("name") or "?", Text("LOST", style="bold red"),
                          Text(g.get("lost_reason") or "", style="red"), "", "", "", "")
            continue
        used, total = g.get(M.gpu_memory_used_bytes), g.get(M.gpu_memory_total_bytes)
        mem = ratio_bar(used / total if used is not None and total else None)
        mem.append(f" {fmt_bytes(used)}/{fmt_bytes(total)}")
        temp = _fmt(g.get(M.gpu_temperature_celsius), ".0f") + " °C"
        if g.get(M.gpu_memory_temperature_celsius) is not None:
            temp += f" (HBM {g[M.gpu_memory_temperature_celsius]:.0f})"
        power = f"{_fmt(g.get(M.gpu_power_watts), '.0f')}/{_fmt(g.get(M.gpu_power_limit_watts), '.0f')} W"
        clock = (f"{_fmt(g.get(M.gpu_sm_clock_hertz), '.0f', 1e-6)}/"
                 f"{_fmt(g.get(M.gpu_sm_clock_max_hertz), '.0f', 1e-6)} MHz")
        name = g.get("name") or "?"
        if g.get("metrics_unreliable"):
            name += " (unreliable: MIG/vGPU)"
        table.add_row(str(g.get("gpu")), name, ratio_bar(g.get(M.gpu_utilization_ratio)), mem, temp, power,
                      clock, _throttles(g))
    return table


def _process_table(view: dict[str, Any], bar_width: int) -> Table:
    table = Table(title=f"Processes   {WHITE_GLYPH} allocated (white)  {GREY_GLYPH} reserved (grey)  "
                        f"{BLACK_GLYPH} driver (black)", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("GPU", "PID", "process", "memory", "white / grey / black", "trend/s", "CPU", "top thread"):
        table.add_column(col, no_wrap=True, min_width=3)
    # One scale for every bar: the largest layer on screen, so processes compare at a glance
    # (the GPU table shows each process's share of the device).
    peak = max([v for p in view["processes"] for v in (p.get(M.process_gpu_memory_bytes),
                                                        p.get(M.process_torch_reserved_bytes),
                                                        p.get(M.process_torch_allocated_bytes)) if v] or [0])
    for p in view["processes"]:
        white, grey, black = (p.get(M.process_torch_allocated_bytes), p.get(M.process_torch_reserved_bytes),
                              p.get(M.process_gpu_memory_bytes))
        trend = p.get(M.process_gpu_memory_growth_bytes_per_second)
        if trend is None:
            trend = p.get(M.process_torch_reserved_growth_bytes_per_second)
        cpu = p.get(M.process_cpu_utilization_ratio)
        threads = p.get("top_threads") or []
        top = f"{threads[0]['name']} {threads[0]['cpu_ratio'] * 100:.0f}%" if threads else ""
        table.add_row(str(p.get("gpu")), str(p.get("pid")), (p.get("process") or "?")[:16],
                      three_colour_bar(white, grey, black, peak, bar_width),
                      f"{fmt_bytes(white)} / {fmt_bytes(grey)} / {fmt_bytes(black)}",
                      "n/a" if trend is None else fmt_bytes(trend),
                      "n/a" if cpu is None else f"{cpu * 100:.0f}%", top)
    return table


def _engine_table(view: dict[str, Any]) -> Table:
    table = Table(title="Engines", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("engine", "running", "waiting", "KV usage", "preemptions", "TTFT p99", "ITL p99"):
        table.add_column(col, no_wrap=True)
    for e in view["engines"]:
        ttft = (e.get(M.time_to_first_token_seconds) or {})
        itl = (e.get(M.inter_token_latency_seconds) or {})
        ttft_p99 = (ttft.get("window") or ttft).get("p99") if isinstance(ttft, dict) else None
        itl_p99 = (itl.get("window") or itl).get("p99") if isinstance(itl, dict) else None
        table.add_row(str(e.get("engine")), _fmt(e.get(M.num_requests_running), ".0f"),
                      _fmt(e.get(M.num_requests_waiting), ".0f"), ratio_bar(e.get(M.kv_cache_usage_perc)),
                      _fmt(e.get(M.num_preemptions_total), ".0f"), fmt_seconds(ttft_p99), fmt_seconds(itl_p99))
    return table


def render(view: dict[str, Any], width: int = 200) -> Group:
    """The whole screen for one view, for a terminal ``width`` columns wide."""
    host = view.get("host") or {}
    head = Text(f"gpudiag top  {view['node']}  {time.strftime('%H:%M:%S', time.localtime(view['t']))}",
                style="bold")
    if view.get("sim"):
        head.append(f"  [simulated GPU: {view['sim']}]", style="magenta")
    if host:
        head.append(f"   CPU {fmt_ratio(host.get(M.node_cpu_utilization_ratio))}"
                    f"  load {_fmt(host.get(M.node_load1), '.2f')}"
                    f"  mem {fmt_bytes(host.get(M.node_memory_used_bytes))}"
                    f"/{fmt_bytes(host.get(M.node_memory_total_bytes))}"
                    f"  swap {fmt_bytes(host.get(M.node_swap_used_bytes))}")
    parts: list[Any] = [head]
    parts.append(_gpu_table(view) if view["gpus"] else Text("GPUs: none seen", style="yellow"))
    bar_width = BAR_WIDTH if width >= 150 else 12
    parts.append(_process_table(view, bar_width) if view["processes"]
                 else Text("Processes: no GPU process seen", style="dim"))
    if view["engines"]:
        parts.append(_engine_table(view))
    notes = Text()
    for name, error in view.get("errors", {}).items():
        notes.append(f"{name}: {error}\n", style="red")
    for name, st in view["probes"].items():
        if not st.get("available") and st.get("reason") and name not in view.get("errors", {}):
            notes.append(f"{name}: {st['reason']}\n", style="yellow")
    parts.append(notes)
    parts.append(Text("q quits", style="dim"))
    return Group(*parts)


# --- the command -----------------------------------------------------------------------


def _run_live(model: TopModel, interval_s: float, console: Console) -> None:
    fd = sys.stdin.fileno() if sys.stdin and sys.stdin.isatty() else None
    saved = None
    if fd is not None:
        import termios
        import tty

        saved = termios.tcgetattr(fd)
        tty.setcbreak(fd)
    try:
        with Live(render(model.tick(), console.width), console=console, screen=True, auto_refresh=False) as live:
            next_tick = time.monotonic() + interval_s
            while True:
                timeout = max(0.0, next_tick - time.monotonic())
                if fd is not None:
                    ready, _, _ = select.select([fd], [], [], timeout)
                    if ready:
                        key = os.read(fd, 32)
                        if b"q" in key.lower():
                            return
                        continue
                else:
                    time.sleep(timeout)
                next_tick += interval_s
                live.update(render(model.tick(), console.width), refresh=True)
    except KeyboardInterrupt:
        return
    finally:
        if saved is not None:
            import termios

            termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def register(app: typer.Typer) -> None:
    """Add the ``top`` command."""

    @app.command("top", cls=_TopCommand)
    def top(
        sim: Annotated[str | None, typer.Option(
            "--sim", metavar="[SCENARIO]",
            help=f"Read the simulated GPU running SCENARIO (default {DEFAULT_SCENARIO}).")] = None,
        once: Annotated[bool, typer.Option("--once", help="Print one frame and exit.")] = False,
        json_out: Annotated[bool, typer.Option("--json", help="With --once: one JSON document on stdout.")] = False,
        interval: Annotated[float, typer.Option("--interval", min=0.1, help="Seconds between frames.")] = 1.0,
        engine: Annotated[list[str] | None, typer.Option(
            "--engine", metavar="URL", help="A serving engine's /metrics URL (repeatable).")] = None,
        runtime_dir: Annotated[list[str] | None, typer.Option(
            "--runtime-dir", metavar="DIR", help="Where in-process reporters write (repeatable).")] = None,
        speed: Annotated[float, typer.Option(
            "--speed", min=0.01, help="With --sim: simulated seconds per second.")] = 1.0,
        seed: Annotated[int, typer.Option("--seed", help="With --sim: the workload's random seed.")] = 0,
    ) -> None:
        """A live view: GPUs, each process's three memory colours and host CPU, engine queue and KV usage."""
        if json_out and not once:
            raise GpudiagError("--json prints one frame: use it with --once")
        probes = open_probes(sim, speed=speed, seed=seed, engine_urls=engine or [], runtime_dirs=runtime_dir or None)
        model = TopModel(probes, sim=sim)
        try:
            if once:
                model.tick()  # CPU figures and trends are differences: take a baseline first
                time.sleep(min(interval, 1.0))
                view = model.tick()
                if json_out:
                    sys.stdout.write(json.dumps(_json_safe(view), indent=1) + "\n")
                else:
                    console = Console()
                    console.print(render(view, console.width))
                return
            _run_live(model, interval, Console())
        finally:
            model.close()
