"""``gpudiag agent``: the per-node daemon (probes, store, /metrics, OTLP, streaming findings).

Logs go to stderr, one line per event. SIGTERM or SIGINT flushes the store
and exits 0; SIGHUP re-reads ``--config`` (a new config that does not
validate is logged and the running one kept). A second agent on the same
store is refused with the store's message (exit 2).
"""

from __future__ import annotations

import logging
import math
import os
import signal
import sys
import threading
from typing import Optional

import typer

from gpudiag.errors import GpudiagError

log = logging.getLogger("gpudiag.agent")

# SIGTERM must end the agent within 5 s (systemd's and Kubernetes' grace periods are
# longer, but a node drain waits on every pod): stop() is given 3 s, and a stop that
# hangs anyway (a probe stuck in a driver call) is cut off here.
SHUTDOWN_DEADLINE_S = 4.5


def _setup_logging(verbose: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s gpudiag-agent %(levelname)s %(message)s"))
    root = logging.getLogger("gpudiag")
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    root.propagate = False


def run(config_path: str | None, overrides: dict, *, sim: str | None, speed: float, seed: int,
        verbose: bool = False, sim_pods: bool = False, dialect: str | None = None) -> int:
    """Run the agent until SIGTERM/SIGINT; returns the exit code."""
    from gpudiag.agent.config import load
    from gpudiag.agent.daemon import Agent

    _setup_logging(verbose)
    if not (0 < speed < math.inf):  # NaN and infinity too: the simulation is paced by it
        raise GpudiagError(f"--speed must be a positive number, got {speed:g}")
    if sim is None and speed != 1.0:
        raise GpudiagError("--speed applies to --sim only")
    if sim is None and sim_pods:
        raise GpudiagError("--sim-pods applies to --sim only")
    if sim is None and dialect is not None:
        raise GpudiagError("--dialect applies to --sim only (the simulated engine's /metrics)")
    from gpudiag.reference_engine.serving.dialect_metrics import parse_spec

    spec = parse_spec(dialect)
    config = load(config_path).with_overrides(overrides)
    # Opens the store: a second agent stops here.
    agent = Agent(config, sim=sim, speed=speed, seed=seed, sim_pods=sim_pods, dialect=spec)
    stop, hup = threading.Event(), threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, lambda *_: hup.set())
    started = False
    try:
        agent.start()  # a start that fails stops what it had started, then raises
        started = True
        while not stop.is_set():
            stop.wait(0.2)
            if hup.is_set():
                hup.clear()
                _reload(agent, config_path, overrides)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if started:
            log.info("stopping: flushing the store")
            cutoff = threading.Timer(SHUTDOWN_DEADLINE_S, _give_up)
            cutoff.daemon = True
            cutoff.start()
            agent.stop()
            cutoff.cancel()
    return 0


def _give_up() -> None:
    log.error("shutdown did not finish within %g s; exiting without waiting further", SHUTDOWN_DEADLINE_S)
    logging.shutdown()
    os._exit(1)


def _reload(agent, config_path: str | None, overrides: dict) -> None:
    from gpudiag.agent.config import load

    if config_path is None:
        log.info("SIGHUP: no --config to reload")
        return
    try:
        new = load(config_path).with_overrides(overrides)
    except GpudiagError as exc:
        log.error("SIGHUP: new config refused, keeping the running one: %s", exc)
        return
    try:
        changed = agent.reload(new)
    except Exception as exc:  # noqa: BLE001 - a failed reload must not end the agent
        log.error("SIGHUP: applying the new config failed: %s: %s", type(exc).__name__, exc)
        return
    if not changed:
        log.info("SIGHUP: config unchanged")


def register(app: typer.Typer) -> None:
    """Add ``gpudiag agent``."""

    @app.command("agent")
    def agent_command(
        config: Optional[str] = typer.Option(None, "--config", help="Agent config file (TOML)."),
        listen: Optional[str] = typer.Option(None, "--listen",
                                             help="HOST:PORT for /metrics (default 127.0.0.1:9400)."),
        store: Optional[str] = typer.Option(None, "--store", help="Timeline store file (SQLite)."),
        otlp_endpoint: Optional[str] = typer.Option(None, "--otlp-endpoint",
                                                    help="OTLP/HTTP collector, e.g. http://127.0.0.1:4318."),
        sim: Optional[str] = typer.Option(None, "--sim", help="Monitor the reference engine running SCENARIO "
                                                               "on the simulated GPU instead of this node."),
        speed: float = typer.Option(1.0, "--speed", help="With --sim: simulated seconds per wall second."),
        seed: int = typer.Option(0, "--seed", help="With --sim: the workload's random seed."),
        sim_pods: bool = typer.Option(False, "--sim-pods", help="With --sim: run the simulated processes in "
                                                                 "Kubernetes pods (pod labels as on a node)."),
        node: Optional[str] = typer.Option(None, "--node", help="The node label (default: the host name)."),
        dialect: Optional[str] = typer.Option(None, "--dialect",
                                              help="With --sim: the engine's series as another engine names "
                                                   "them (sglang, trtllm, triton, nim, llamacpp, vllm-v0), or "
                                                   "GPU=NAME,... per GPU."),
        verbose: bool = typer.Option(False, "--verbose", "-v", help="Debug logging."),
    ):
        """Run the per-node agent: probes, timeline store, /metrics, OTLP and streaming findings."""
        overrides = {"exporter.listen": listen, "store.path": store, "otlp.endpoint": otlp_endpoint,
                     "agent.node": node}
        code = run(config, overrides, sim=sim, speed=speed, seed=seed, verbose=verbose, sim_pods=sim_pods,
                   dialect=dialect)
        raise typer.Exit(code)
