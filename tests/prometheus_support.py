"""A real Prometheus for the tests: started on loopback with its own config and TSDB, and backfilled.

Debian's ``prometheus`` and ``promtool`` packages (scripts/system-deps.d/20-prometheus.sh; CI installs
them). Each server gets a free port, a temporary config and data directory, and is stopped by the
fixture that started it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

PROMETHEUS = "/usr/bin/prometheus"
PROMTOOL = "/usr/bin/promtool"
READY_S = 30.0
STOP_GRACE_S = 10.0
# promtool parses its input once per two-hour block it writes: a few hours of series take seconds.
BACKFILL_TIMEOUT_S = 300


def free_port() -> int:
    """A TCP port nothing listens on now (loopback)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str):
    """GET ``url`` and decode its JSON body."""
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.load(r)


def wait(what: str, deadline_s: float, probe, *procs: subprocess.Popen):
    """Poll ``probe`` until it returns something true; fail when ``deadline_s`` passes or a process exits."""
    end = time.monotonic() + deadline_s
    while True:
        for p in procs:
            if p.poll() is not None:
                pytest.fail(f"{what}: {p.args[0]} exited with {p.returncode}")
        try:
            got = probe()
        except (OSError, urllib.error.URLError, ValueError, KeyError, IndexError):
            got = None
        if got:
            return got
        if time.monotonic() > end:
            pytest.fail(f"{what}: not within {deadline_s:g} s")
        time.sleep(0.25)


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL after STOP_GRACE_S."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(STOP_GRACE_S)


def start_prometheus(tmp: Path, scrape_configs: list, global_cfg: dict | None = None):
    """Prometheus on a free loopback port over ``tmp/tsdb``, ready to answer: (process, url, log file)."""
    if not os.path.exists(PROMETHEUS):
        pytest.fail(f"{PROMETHEUS} not found: install Debian's prometheus package "
                    "(scripts/system-deps.d/20-prometheus.sh; CI runs it)")
    port = free_port()
    (tmp / "prometheus.yml").write_text(yaml.safe_dump({"global": global_cfg or {},
                                                        "scrape_configs": scrape_configs}))
    log = open(tmp / "prometheus.log", "wb")
    proc = subprocess.Popen([PROMETHEUS, f"--config.file={tmp / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait("prometheus /-/ready", READY_S, lambda: urllib.request.urlopen(f"{url}/-/ready", timeout=2).status == 200,
         proc)
    return proc, url, log


def backfill(openmetrics: Path, tsdb: Path) -> None:
    """Write the samples of an OpenMetrics file (with timestamps) as TSDB blocks under ``tsdb``."""
    if not os.path.exists(PROMTOOL):
        pytest.fail(f"{PROMTOOL} not found: install Debian's prometheus package "
                    "(scripts/system-deps.d/20-prometheus.sh; CI runs it)")
    made = subprocess.run([PROMTOOL, "tsdb", "create-blocks-from", "openmetrics", "-q", str(openmetrics),
                           str(tsdb)], capture_output=True, text=True, timeout=BACKFILL_TIMEOUT_S)
    assert made.returncode == 0, made.stderr


@contextlib.contextmanager
def backfilled_prometheus(tmp: Path, openmetrics: Path, ready_query: str, ready_at: float, *,
                          keep_text: bool = True):
    """Prometheus over the samples of an OpenMetrics file, once ``ready_query`` answers at ``ready_at``: its url.

    The file is backfilled into ``tmp/tsdb`` (and removed after unless ``keep_text``); Prometheus is
    stopped on the way out.
    """
    backfill(openmetrics, tmp / "tsdb")
    if not keep_text:
        openmetrics.unlink()
    prom, url, log = start_prometheus(tmp, [])
    try:
        wait("backfilled series queryable", READY_S,
             lambda: get_json(f"{url}/api/v1/query?query={ready_query}&time={ready_at}")["data"]["result"], prom)
        yield url
    finally:
        stop(prom)
        log.close()


@contextlib.contextmanager
def prometheus_over_span(tmp_path_factory, name: str, openmetrics_of, span_s: int, ready_query: str):
    """Prometheus over a span of ``span_s`` seconds ending ten minutes ago, whose OpenMetrics lines
    (``# EOF`` left out) ``openmetrics_of(t0)`` returns: (url, t0), where t0 is the span's first sample
    time (on a whole minute)."""
    tmp = tmp_path_factory.mktemp(name)
    t0 = (int(time.time()) - span_s - 600) // 60 * 60
    (tmp / "series.om").write_text(openmetrics_text(openmetrics_of(t0)))
    with backfilled_prometheus(tmp, tmp / "series.om", ready_query, t0 + 600) as url:
        yield url, t0


def openmetrics_text(lines) -> str:
    """An OpenMetrics document of ``lines``, ended by the ``# EOF`` that promtool requires."""
    return "\n".join([*lines, "# EOF"]) + "\n"


def cumulative(offsets, per_sample):
    """A counter's value at each offset: the running sum of ``per_sample(offset)``, as a function of the offset."""
    total, values = 0.0, {}
    for o in offsets:
        total += per_sample(o)
        values[o] = total
    return lambda o: values[o]


def window_args(t0: int, end_s: float) -> list[str]:
    """``--from t0 --to t0+end_s`` for a command reading a backfilled span."""
    return ["--from", str(t0), "--to", str(t0 + end_s)]
