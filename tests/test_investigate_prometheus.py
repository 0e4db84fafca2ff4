"""`gpudiag investigate --prometheus`: the same analyzers over windows read from a real Prometheus.

Two Prometheus servers (the Debian package, on loopback, each with its own
temporary config and data directory):

* one scrapes an agent running the kv-eviction-storm scenario in ``--sim``
  mode at 100x; once the simulated run has passed the storm, the window of
  the whole run is investigated;
* one starts on a TSDB backfilled with ``promtool tsdb create-blocks-from
  openmetrics``: two hours of one node as dcgm-exporter and vLLM export it
  (their names, labels and units), with an eviction storm, a thermal
  slowdown and an XID in it, and a quarter hour in which dcgm-exporter was
  not scraped.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prometheus_support import (
    cumulative,
    free_port,
    get_json,
    prometheus_over_span,
    start_prometheus,
    stop,
    wait,
    window_args,
)

from gpudiag import promql_source as P

# Simulated seconds per wall second: the storm (simulated ~4080-4680 s) is over ~48 s after the start.
SIM_SPEED = 100
STORM_OVER_SIM_S = 4800.0
# The agent's simulated engine is drained every 0.25 s: a faster scrape would only repeat samples.
SCRAPE_INTERVAL = "250ms"
SIM_DEADLINE_S = 150.0

NODE = "gpu-node-7"
SAMPLE_S = 5  # dcgm-exporter's and vLLM's series: one sample every 5 s, as a 5 s scrape gives
SPAN_S = 7200
# Offsets (s) into the backfilled two hours.
STORM = (3600, 4800)
HEAT = (5400, 6000)
XID_AT = 6300
DCGM_DOWN = (2000, 2900)
MIB = 1 << 20


@pytest.fixture(scope="module")
def sim_run(tmp_path_factory):
    """Prometheus scraping an agent in --sim kv-eviction-storm until the storm is over: (url, first, last)."""
    tmp = tmp_path_factory.mktemp("prom-sim")
    agent_port = free_port()
    prom, url, prom_log = start_prometheus(
        tmp, [{"job_name": "gpudiag", "static_configs": [{"targets": [f"127.0.0.1:{agent_port}"]}]}],
        {"scrape_interval": SCRAPE_INTERVAL, "scrape_timeout": SCRAPE_INTERVAL})
    agent_log = open(tmp / "agent.log", "wb")
    agent = None
    try:
        started = time.time()
        agent = subprocess.Popen(
            [sys.executable, "-m", "gpudiag", "agent", "--sim", "kv-eviction-storm", "--speed", str(SIM_SPEED),
             "--seed", "0", "--store", str(tmp / "store.db"), "--listen", f"127.0.0.1:{agent_port}"],
            stdout=agent_log, stderr=subprocess.STDOUT)

        def sim_seconds():
            result = get_json(f"{url}/api/v1/query?query=gpudiag_agent_sim_seconds")["data"]["result"]
            return float(result[0]["value"][1]) >= STORM_OVER_SIM_S

        wait(f"simulated time {STORM_OVER_SIM_S:g} s in Prometheus", SIM_DEADLINE_S, sim_seconds, agent, prom)
        stop(agent)
        yield url, started, time.time()
    finally:
        if agent is not None:
            stop(agent)
        stop(prom)
        prom_log.close()
        agent_log.close()


def test_an_eviction_storm_scraped_from_the_agent_is_found_through_prometheus(cli, sim_run):
    url, first, last = sim_run
    p = cli("investigate", "--prometheus", url, "--from", f"{first:.3f}", "--to", f"{last:.3f}", "--json")
    assert p.returncode == 1, p.stderr
    doc = json.loads(p.stdout)
    assert doc["sources"] == [f"prometheus:{url}"]
    # The longest storm finding: seed 0's storm has two episodes (the canned run finds 3100-3524 s and
    # 4137-4691 s), and at one sample per 25 simulated seconds which of them is found, and first, varies
    # with the machine's load (a loaded run's first finding: 120 s from ~3010 s).
    storm = max((f for f in doc["findings"] if f["kind"] == "kv_eviction_storm"),
                key=lambda f: f["end_s"] - f["start_s"])
    assert storm["node"] == "sim-node" and storm["gpu"] == 0
    # The frames are back on the simulated clock: the storm lasts simulated minutes, not wall seconds.
    assert storm["end_s"] - storm["start_s"] >= 300
    evidence = {e["metric"]: e for e in storm["evidence"]}
    assert evidence["recomputed_token_share"]["observed"] >= 0.05
    # TPOT from the vLLM-dialect histograms the agent exports: worse in the storm than outside it.
    assert evidence["tpot_p99_seconds"]["observed"] > evidence["tpot_p99_seconds"]["baseline"] > 0
    # Driver, allocator, engine and host views all came through Prometheus; only eBPF is absent with --sim.
    assert [g["kind"] for g in doc["gaps"]] == ["cuda_api"], doc["gaps"]
    implicated = [m for m in doc["memory"] if m["implicated"]]
    assert implicated and implicated[0]["white_bytes"] <= implicated[0]["grey_bytes"] <= implicated[0]["black_bytes"]


def test_node_and_gpu_select_the_agents_rows_and_an_unknown_node_is_named(cli, sim_run):
    url, first, last = sim_run
    window = ["--from", f"{first:.3f}", "--to", f"{last:.3f}"]
    p = cli("investigate", "--prometheus", url, *window, "--node", "sim-node", "--gpu", "0", "--json")
    assert p.returncode == 1, p.stderr
    assert json.loads(p.stdout)["window"]["node"] == "sim-node"
    p = cli("investigate", "--prometheus", url, *window, "--node", "no-such-node")
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "no node 'no-such-node'" in lines[0] and "sim-node" in lines[0], p.stderr


# --- dcgm-exporter and vLLM, backfilled ------------------------------------------------------------------

LATENCY_LE = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0)
# Cumulative share of a 5 s interval's 100 token gaps at or under each bound: healthy decode
# around 30-50 ms; in the storm, stalls behind recomputation spread it to half a second.
HEALTHY_ITL = (0.05, 0.2, 0.95, 0.99, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0)
STORM_ITL = (0.0, 0.02, 0.1, 0.2, 0.3, 0.45, 0.6, 0.85, 0.99, 1.0)
TOKENS_PER_INTERVAL = 100


def _in(offset: int, span: tuple[int, int]) -> bool:
    return span[0] <= offset < span[1]


def _openmetrics(t0: int) -> list[str]:
    """Two hours of one node as dcgm-exporter and vLLM export them, in OpenMetrics with timestamps."""
    offsets = range(0, SPAN_S, SAMPLE_S)
    # With its Kubernetes mapping on, dcgm-exporter names the pod the kubelet gave the GPU to.
    dcgm = (f'gpu="0",UUID="GPU-5fb1c2a4",Hostname="{NODE}",device="nvidia0",modelName="NVIDIA A100-SXM4-80GB",'
            f'pod="vllm-llama-0",namespace="serving",container="vllm"')
    vllm = f'instance="{NODE}:8000",job="vllm",model_name="llama-3-8b",engine="0"'
    out: list[str] = []

    def family(name: str, kind: str, labels: str, value, up=lambda o: True, suffix: str = "") -> None:
        out.append(f"# TYPE {name} {kind}")
        for o in offsets:
            if up(o):
                out.append(f"{name}{suffix}{{{labels}}} {value(o)} {t0 + o}")

    dcgm_up = lambda o: not _in(o, DCGM_DOWN)  # noqa: E731
    hot = lambda o: _in(o, HEAT)  # noqa: E731
    family("DCGM_FI_DEV_GPU_UTIL", "gauge", dcgm, lambda o: (30 if o % 20 else 97) if _in(o, STORM) else 82, dcgm_up)
    family("DCGM_FI_DEV_FB_USED", "gauge", dcgm, lambda o: 70000, dcgm_up)
    family("DCGM_FI_DEV_FB_FREE", "gauge", dcgm, lambda o: 11000, dcgm_up)
    family("DCGM_FI_DEV_FB_RESERVED", "gauge", dcgm, lambda o: 920, dcgm_up)
    family("DCGM_FI_DEV_SM_CLOCK", "gauge", dcgm, lambda o: 1005 if hot(o) else 1410, dcgm_up)
    family("DCGM_FI_DEV_MAX_SM_CLOCK", "gauge", dcgm, lambda o: 1410, dcgm_up)
    family("DCGM_FI_DEV_GPU_TEMP", "gauge", dcgm, lambda o: 91 if hot(o) else 62, dcgm_up)
    family("DCGM_FI_DEV_POWER_USAGE", "gauge", dcgm, lambda o: 310.5, dcgm_up)
    # NVML's bits: sw_thermal_slowdown 0x20 | hw_thermal_slowdown 0x40 while hot.
    family("DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", "gauge", dcgm, lambda o: 0x60 if hot(o) else 0, dcgm_up)
    family("DCGM_FI_DEV_XID_ERRORS", "gauge", dcgm, lambda o: 79 if o >= XID_AT else 0, dcgm_up)
    family("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "counter", dcgm, lambda o: 3, dcgm_up)

    family("vllm:num_requests_running", "gauge", vllm, lambda o: 64 if _in(o, STORM) else 40)
    family("vllm:num_requests_waiting", "gauge", vllm, lambda o: 25 if _in(o, STORM) else 0)
    family("vllm:kv_cache_usage_perc", "gauge", vllm, lambda o: 0.99 if _in(o, STORM) else 0.55)
    # Twelve preemptions a minute in the storm; one every ten minutes otherwise.
    family("vllm:num_preemptions", "counter", vllm,
           cumulative(offsets, lambda o: 1 if _in(o, STORM) or o % 600 == 0 else 0), suffix="_total")
    family("vllm:prompt_tokens", "counter", vllm, cumulative(offsets, lambda o: 4000), suffix="_total")
    family("vllm:generation_tokens", "counter", vllm, cumulative(offsets, lambda o: 1500), suffix="_total")
    shares = {o: STORM_ITL if _in(o, STORM) else HEALTHY_ITL for o in offsets}
    out.append("# TYPE vllm:inter_token_latency_seconds histogram")
    totals = [0.0] * (len(LATENCY_LE) + 1)
    rows: dict[str, list[str]] = {}
    total_sum = 0.0
    for o in offsets:
        for i, share in enumerate(shares[o] + (1.0,)):
            totals[i] += share * TOKENS_PER_INTERVAL
        total_sum += TOKENS_PER_INTERVAL * (0.25 if _in(o, STORM) else 0.04)
        name, at = "vllm:inter_token_latency_seconds", t0 + o
        for le, n in zip([f"{b}" for b in LATENCY_LE] + ["+Inf"], totals):
            rows.setdefault(le, []).append(f'{name}_bucket{{{vllm},le="{le}"}} {n:g} {at}')
        rows.setdefault("_count", []).append(f"{name}_count{{{vllm}}} {totals[-1]:g} {at}")
        rows.setdefault("_sum", []).append(f"{name}_sum{{{vllm}}} {total_sum:g} {at}")
    for lines in rows.values():
        out.extend(lines)
    return out


@pytest.fixture(scope="module")
def foreign(tmp_path_factory):
    """Prometheus over a TSDB backfilled with dcgm-exporter's and vLLM's series: (url, first sample time)."""
    with prometheus_over_span(tmp_path_factory, "prom-foreign", _openmetrics, SPAN_S, "DCGM_FI_DEV_GPU_TEMP") as got:
        yield got


def test_vllm_and_dcgm_series_give_a_storm_a_thermal_slowdown_and_an_xid(cli, foreign):
    url, t0 = foreign
    p = cli("investigate", "--prometheus", url, *window_args(t0, SPAN_S - SAMPLE_S), "--node", NODE, "--json")
    assert p.returncode == 1, p.stderr
    doc = json.loads(p.stdout)
    by_kind = {}
    for f in doc["findings"]:
        by_kind.setdefault(f["kind"], f)
    storm = by_kind["kv_eviction_storm"]
    assert t0 + STORM[0] - 120 <= storm["start_s"] and storm["end_s"] <= t0 + STORM[1] + 120
    ev = {e["metric"]: e for e in storm["evidence"]}
    # TPOT P99 from histogram_quantile-style interpolation over vllm:inter_token_latency_seconds_bucket.
    assert ev["tpot_p99_seconds"]["observed"] >= 3 * ev["tpot_p99_seconds"]["baseline"]
    assert storm["severity"] == "critical"
    assert ev["kv_cache_usage_perc"]["observed"] == pytest.approx(0.99)
    heat = by_kind["throttling"]
    assert heat["severity"] == "critical" and heat["gpu"] == 0 and heat["node"] == NODE
    assert t0 + HEAT[0] - 10 <= heat["start_s"] and heat["end_s"] <= t0 + HEAT[1] + 10
    assert "hw_thermal_slowdown" in heat["summary"] and "91 C" in heat["summary"]
    assert (heat["pod"], heat["namespace"], heat["container"]) == ("vllm-llama-0", "serving", "vllm")
    clock = next(e for e in heat["evidence"] if e["metric"] == "gpu_sm_clock_ratio")
    assert clock["observed"] == pytest.approx(1005 / 1410, abs=0.01)
    xid = by_kind["hardware_errors"]
    assert xid["severity"] == "critical" and any("xid=79" in e["metric"] for e in xid["evidence"])
    # What dcgm-exporter and vLLM do not export is named, with the analyzers it blinds.
    gaps = {g["check"]: g for g in doc["gaps"]}
    assert {"per-process driver memory (black)", "caching allocator (white, grey)", "engine KV capacity",
            "CUDA API (eBPF)", "host CPU"} <= set(gaps)
    assert "serving engine" not in gaps and "driver view (NVML)" not in gaps
    assert "finished requests (TTFT, TPOT)" not in gaps
    # The quarter hour without dcgm-exporter samples is listed (less Prometheus' 5 minute lookback).
    down = [g["reason"] for g in doc["gaps"] if g["check"] == "source"]
    assert any(f"no dcgm-exporter samples of node {NODE}" in r for r in down), down


def test_dcgm_units_become_si_and_labels_the_frames_own(foreign):
    url, t0 = foreign
    window = P.load_window(url, start=str(t0), end=str(t0 + 1800), node=NODE)
    gpu = window.table("gpu")
    row = gpu.iloc[len(gpu) // 2]
    assert row["node"] == NODE and row["gpu"] == 0 and row["uuid"] == "GPU-5fb1c2a4"
    assert (row["pod"], row["namespace"], row["container"]) == ("vllm-llama-0", "serving", "vllm")
    assert row["gpu_memory_used_bytes"] == 70000 * MIB
    assert row["gpu_memory_total_bytes"] == (70000 + 11000 + 920) * MIB
    assert row["gpu_utilization_ratio"] == pytest.approx(0.82)
    assert row["gpu_sm_clock_hertz"] == pytest.approx(1.41e9)
    assert row["gpu_clock_throttle_active"]["hw_thermal_slowdown"] == 0
    engine = window.table("engine")
    assert set(engine["node"]) == {NODE}  # vLLM's node is its scrape target's host
    assert engine["kv_cache_usage_perc"].iloc[-1] == pytest.approx(0.55)
    summary = engine["inter_token_latency_seconds"].dropna().iloc[-1]["window"]
    assert summary["count"] > 0 and 0.025 < summary["p50"] < summary["p99"] <= 0.1


def test_a_long_window_is_read_in_ranges_under_the_per_series_limit(cli, foreign):
    url, t0 = foreign
    # 0.5 s steps over two hours: 14,391 points per series, more than one range query takes.
    p = cli("investigate", "--prometheus", url, *window_args(t0, SPAN_S - SAMPLE_S), "--step", "0.5s", "--json")
    assert p.returncode == 1, p.stderr
    kinds = {f["kind"] for f in json.loads(p.stdout)["findings"]}
    assert {"kv_eviction_storm", "throttling", "hardware_errors"} <= kinds


def test_the_plan_keeps_every_range_under_11000_points():
    day = P.plan(0.0, 86400.0, scrape_interval_s=1.0)
    assert day.step_s == 2.0 and day.n_steps == 43201
    covered = [i for a, b in day.chunks for i in range(a, b + 1)]
    assert covered == list(range(day.n_steps))
    assert all(b - a + 1 <= P.PROMETHEUS_MAX_POINTS for a, b in day.chunks)
    assert P.plan(0.0, 1800.0, scrape_interval_s=15.0).step_s == 15.0
    assert P.plan(0.0, 1800.0, step_s=0.25).n_steps == 7201
    with pytest.raises(Exception, match="points per series"):
        P.plan(0.0, 86400.0, step_s=0.01)
    assert P.prom_duration_s("1m30s") == 90 and P.prom_duration_s("100ms") == 0.1
    assert P.prom_duration_s("soon") is None


def test_every_foreign_series_maps_to_a_catalog_column():
    from gpudiag.catalog import CATALOG

    for f in P.FOREIGN:
        assert f.column in CATALOG, f
        assert CATALOG[f.column].entity == "gpu", f
    mapped = P.mappings()
    assert {m.column for m in mapped["DCGM_FI_DEV_FB_USED"]} == {"gpu_memory_used_bytes", "gpu_memory_total_bytes"}
    assert mapped["vllm:gpu_cache_usage_perc"][0].column == "kv_cache_usage_perc"  # vLLM's older name


def test_dcgm_used_memory_alone_is_not_the_total():
    """A dcgm-exporter that exports FB_USED but not FB_FREE (a trimmed field list) tells no capacity:
    the GPU must not look full. With FB_FREE the total is used + free + reserved, in bytes."""
    import numpy as np

    minute = P.plan(0.0, 60.0, step_s=15.0)
    steps = np.arange(minute.n_steps)
    labels = {"gpu": "0", "Hostname": "n1", "UUID": "GPU-1"}
    used = ({"__name__": "DCGM_FI_DEV_FB_USED", **labels}, steps, np.full(steps.size, 70000.0))
    gpu = P.tables_from_series([used], minute)["gpu"]
    assert gpu["gpu_memory_used_bytes"].eq(70000.0 * P.MIB).all()
    assert "gpu_memory_total_bytes" not in gpu or gpu["gpu_memory_total_bytes"].isna().all()
    free = ({"__name__": "DCGM_FI_DEV_FB_FREE", **labels}, steps[1:], np.full(steps.size - 1, 10000.0))
    reserved = ({"__name__": "DCGM_FI_DEV_FB_RESERVED", **labels}, steps, np.full(steps.size, 500.0))
    gpu = P.tables_from_series([used, free, reserved], minute)["gpu"]
    total = gpu["gpu_memory_total_bytes"].to_numpy()
    assert np.isnan(total[0])  # no free memory at that step: no total either
    assert (total[1:] == 80500.0 * P.MIB).all()
    # Every summed column has exactly one anchor: without it, the sum would never be whole.
    summed: dict[str, int] = {}
    for f in P.FOREIGN:
        if f.sum:
            summed[f.column] = summed.get(f.column, 0) + f.anchor
    assert summed and all(n == 1 for n in summed.values()), summed


@pytest.mark.parametrize("args, message", [
    (["--from", "4102444800"], "in the future"),
    (["--from", "yesterday"], "malformed time"),
    (["--node", "no-such-node", "--since", "3h"], "no node 'no-such-node'"),
    (["--since", "2m"], "no gpudiag, dcgm-exporter or vLLM series"),
])
def test_bad_windows_and_nodes_give_one_line_and_exit_2(cli, foreign, args, message):
    url, _ = foreign
    p = cli("investigate", "--prometheus", url, *args)
    assert p.returncode == 2, p.stdout + p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in p.stderr, p.stderr


def test_windows_and_urls_that_cannot_be_read_are_refused_before_any_query():
    from gpudiag.errors import GpudiagError

    now = 1_800_000_000.0
    assert P.resolve_window(since="30m", start=None, end=None, now_s=now) == (now - 1800, now)
    assert P.resolve_window(since=None, start=str(now - 60), end=str(now + 600), now_s=now) == (now - 60, now)
    for kwargs, message in [({"since": "30x"}, "malformed duration"),
                            ({"start": "2024-05-01T03:00:00Z", "end": "2024-05-01T02:00:00Z"}, "must be before --to"),
                            ({"end": str(now)}, "--to needs --from"),
                            ({"since": "1h", "start": str(now)}, "either --since or --from")]:
        with pytest.raises(GpudiagError, match=re.escape(message)):
            P.resolve_window(**{"since": None, "start": None, "end": None, **kwargs}, now_s=now)
    with pytest.raises(GpudiagError, match="http:// or https:// URL"):
        P.PrometheusAPI("localhost:9090")


@pytest.mark.parametrize("args, message", [
    (["--prometheus", "http://127.0.0.1:{port}"], "cannot reach Prometheus at http://127.0.0.1:"),
    (["--prometheus", "http://127.0.0.1:{port}", "--store", "x.db"],
     "--store and --prometheus exclude each other: give one source"),
    ([], "--store PATH (the agent's store) or --prometheus URL"),
    (["--store", "x.db", "--step", "5s"], "--step applies to --prometheus only"),
])
def test_an_unreachable_or_missing_source_gives_one_line_and_exit_2(cli, args, message):
    port = free_port()  # nothing listens there
    p = cli("investigate", *[re.sub(r"\{port\}", str(port), a) for a in args])
    assert p.returncode == 2, p.stdout + p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in p.stderr, p.stderr


def _with_terminal_stderr(args: list[str], tmp: Path) -> tuple[int, str, bytes]:
    """Run ``gpudiag ARGS`` with stderr on a pseudo-terminal and stdout to a file: (rc, stdout, terminal bytes)."""
    import pty

    master, slave = pty.openpty()
    out = tmp / "stdout"
    with open(out, "wb") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "gpudiag", *args], stdout=fh, stderr=slave,
                                env={**os.environ, "TERM": "xterm-256color", "COLUMNS": "120"})
        os.close(slave)
        seen = []
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # the terminal's other side closed: the command ended
                break
            if not data:
                break
            seen.append(data)
        proc.wait(120)
    os.close(master)
    return proc.returncode, out.read_text(), b"".join(seen)


def test_a_long_window_draws_a_progress_bar_on_a_terminal_but_not_for_json_to_a_pipe(foreign, tmp_path):
    url, t0 = foreign
    args = ["investigate", "--prometheus", url, *window_args(t0, SPAN_S - SAMPLE_S), "--node", NODE]
    rc, stdout, terminal = _with_terminal_stderr(args, tmp_path)
    assert rc == 1, terminal.decode(errors="replace")
    assert "kv_eviction_storm" in stdout
    assert b"Prometheus: " in terminal and b"analyzer " in terminal, terminal[-2000:]
    rc, stdout, terminal = _with_terminal_stderr(args + ["--json"], tmp_path)
    assert rc == 1 and json.loads(stdout)["findings"]
    assert terminal == b"", terminal[-2000:]
