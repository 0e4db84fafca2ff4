"""``gpudiag top`` in a real terminal (tmux) and as one JSON frame.

With the simulated GPU backend installed the live test runs ``top --sim``.
Without it (and without a GPU) it runs ``top`` against what this machine
really has: a process publishing its allocator figures through the
in-process reporter, and a serving engine's metrics endpoint started here.
"""

from __future__ import annotations

import http.server
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from gpudiag.catalog import M
from gpudiag.commands.top import BLACK_GLYPH, GREY_GLYPH, WHITE_GLYPH, three_colour_bar

GIB = 1 << 30
HAVE_SIM = importlib.util.find_spec("gpudiag.probes.sim") is not None

ENGINE_PAGE = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="llama-7b"} 24.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="llama-7b"} 7.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="llama-7b"} 0.87
"""

_REPORTING_PROCESS = textwrap.dedent("""
    import sys, time
    from gpudiag.probes.torch_reporter import instrument
    stats = [{{"device": 0, "gpu": 0, "uuid": "GPU-demo", "{white}": 6 * 2**30, "{grey}": 9 * 2**30}}]
    instrument(runtime_dir=sys.argv[1], interval_s=0.2, stats_source=lambda: stats)
    print("ready", flush=True)
    time.sleep(120)
""").format(white=M.process_torch_allocated_bytes, grey=M.process_torch_reserved_bytes)


@pytest.fixture
def engine_url():
    page = ENGINE_PAGE.encode()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", str(len(page)))
            self.end_headers()
            self.wfile.write(page)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/metrics"
    server.shutdown()
    server.server_close()


@pytest.fixture
def reporting_process(tmp_path):
    runtime = tmp_path / "rt"
    runtime.mkdir(mode=0o700)
    proc = subprocess.Popen([sys.executable, "-c", _REPORTING_PROCESS, str(runtime)], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "ready"
    yield proc.pid, str(runtime)
    proc.kill()
    proc.wait()


def _top_args(runtime_dir: str, engine_url: str) -> list[str]:
    if HAVE_SIM:
        return ["top", "--sim", "--interval", "0.5"]
    return ["top", "--runtime-dir", runtime_dir, "--engine", engine_url, "--interval", "0.5"]


def _bar_lines(screen: str) -> list[str]:
    """Lines that draw a process's memory (both glyphs), not the legend."""
    return [line for line in screen.splitlines()
            if WHITE_GLYPH * 2 in line and GREY_GLYPH * 2 in line and "allocated (white)" not in line]


def _capture(session: str) -> str:
    return subprocess.run(["tmux", "capture-pane", "-p", "-t", session], capture_output=True, text=True,
                          check=False).stdout


def _wait_screen(session: str, predicate, timeout_s: float = 30.0) -> str:
    deadline = time.monotonic() + timeout_s
    screen = ""
    while time.monotonic() < deadline:
        screen = _capture(session)
        if predicate(screen):
            return screen
        time.sleep(0.2)
    raise AssertionError(f"the screen never showed what was expected; last screen:\n{screen}")


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (scripts/system-deps.d/30-tmux.sh)")
def test_top_draws_the_three_colour_bars_in_a_terminal_and_q_quits(tmp_path, reporting_process, engine_url):
    _, runtime_dir = reporting_process
    session = f"gpudiag-top-{os.getpid()}"
    # COLUMNS/LINES from the test runner's environment would override the terminal's real size
    command = " ".join(["env -u COLUMNS -u LINES", sys.executable, "-m", "gpudiag",
                        *_top_args(runtime_dir, engine_url)])
    env_prefix = f"cd {os.path.dirname(os.path.dirname(os.path.abspath(__file__)))} && "
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "200", "-y", "50",
                    f"{env_prefix}{command}; echo TOP-EXITED-$?; sleep 60"], check=True)
    try:
        screen = _wait_screen(session, lambda s: _bar_lines(s) and "q quits" in s and (HAVE_SIM or "87%" in s))
        assert "gpudiag top" in screen
        bar = _bar_lines(screen)[0]
        assert bar.index(WHITE_GLYPH) < bar.index(GREY_GLYPH), "white is drawn inside grey"
        if not HAVE_SIM:
            assert "87%" in screen  # KV-cache usage of the engine endpoint
            assert "6.0 GiB / 9.0 GiB / n/a" in bar  # black is missing here (no NVML): said, not drawn as 0
        subprocess.run(["tmux", "send-keys", "-t", session, "q"], check=True)
        screen = _wait_screen(session, lambda s: "TOP-EXITED-" in s, timeout_s=15)
        assert "TOP-EXITED-0" in screen
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True, check=False)


def test_once_json_is_one_parsable_frame(cli, reporting_process, engine_url):
    pid, runtime_dir = reporting_process
    proc = cli(*_top_args(runtime_dir, engine_url), "--once", "--json", timeout=120)
    assert proc.returncode == 0, proc.stderr
    view = json.loads(proc.stdout)
    assert set(view) >= {"t", "node", "gpus", "processes", "engines", "probes", "host"}
    if HAVE_SIM:
        assert view["gpus"] and view["processes"]
        return
    (row,) = [p for p in view["processes"] if p["pid"] == pid]
    assert row[M.process_torch_allocated_bytes] == 6 * GIB and row[M.process_torch_reserved_bytes] == 9 * GIB
    assert row[M.process_reserved_minus_allocated_bytes] == 3 * GIB
    assert row[M.process_gpu_memory_bytes] is None
    assert "NVML" in row["missing_reasons"][M.process_gpu_memory_bytes]
    assert row[M.process_cpu_utilization_ratio] is not None  # host CPU of the reporting process
    (engine,) = view["engines"]
    assert engine[M.kv_cache_usage_perc] == pytest.approx(0.87) and engine[M.num_requests_waiting] == 7
    assert view["host"][M.node_memory_total_bytes] > 0


def test_json_without_once_is_refused(cli):
    proc = cli("top", "--json")
    assert proc.returncode == 2 and "--once" in proc.stderr


def test_sim_once_json_reads_the_simulated_gpu_and_its_three_colours(cli):
    proc = cli("top", "--sim", "--once", "--json", "--speed", "50")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["sim"] == "kv-eviction-storm"
    assert doc["gpus"] and doc["gpus"][0]["gpu_memory_total_bytes"] > 0
    p = doc["processes"][0]
    assert p["process_torch_allocated_bytes"] <= p["process_torch_reserved_bytes"] <= p["process_gpu_memory_bytes"]


def test_sim_with_an_unknown_scenario_is_one_error_line(cli):
    proc = cli("top", "--sim", "nope", "--once", "--json")
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("gpudiag: error: unknown scenario 'nope'")


def test_the_bar_nests_white_inside_grey_inside_black():
    bar = three_colour_bar(2 * GIB, 6 * GIB, 8 * GIB, scale=10 * GIB, width=10).plain
    assert bar == WHITE_GLYPH * 2 + GREY_GLYPH * 4 + BLACK_GLYPH * 2 + "··"
    # layers sampled at different instants: an inner one never pokes out of its outer one
    assert three_colour_bar(7 * GIB, 6 * GIB, 5 * GIB, scale=10 * GIB, width=10).plain == WHITE_GLYPH * 5 + "·" * 5
    # a missing layer is not drawn; the others still are
    assert three_colour_bar(None, None, 5 * GIB, scale=10 * GIB, width=10).plain == BLACK_GLYPH * 5 + "·" * 5
    assert three_colour_bar(2 * GIB, 4 * GIB, None, scale=10 * GIB, width=10).plain == (
        WHITE_GLYPH * 2 + GREY_GLYPH * 2 + "·" * 6)


def test_the_gpu_table_shows_clocks_power_throttling_and_a_lost_gpu(monkeypatch, tmp_path):
    sys.path.insert(0, os.path.dirname(__file__))
    from fake_nvml import FakeNvml, FakeProcess
    from rich.console import Console

    from gpudiag.commands.top import TopModel, render
    from gpudiag.probes.node import open_probes

    fake = FakeNvml.node(3, 0)
    fake.gpus[0].throttle_bits = 0x4  # sw_power_cap
    fake.gpus[0].processes = [FakeProcess(os.getpid(), 2 * GIB)]
    fake.lose(2)
    fake.install(monkeypatch)
    model = TopModel(open_probes(None, runtime_dirs=[str(tmp_path)]))
    model.tick()
    view = model.tick()
    model.close()
    with open(os.devnull, "w") as sink:
        console = Console(width=200, record=True, file=sink)
        console.print(render(view, 200))
    screen = console.export_text()
    assert "sw_power_cap" in screen and "1410/1410 MHz" in screen and "250/400 W" in screen
    assert "LOST" in screen
    (mine,) = [p for p in view["processes"] if p["pid"] == os.getpid()]
    assert mine[M.process_gpu_memory_bytes] == 2 * GIB and mine[M.process_cpu_utilization_ratio] is not None
    assert BLACK_GLYPH * 5 in screen


# --- latency over a sliding window ------------------------------------------------------------

STORM_RUNNING = 70


def _request(engine: str, finish_s: float, ttft_s: float, itl_s: float) -> dict:
    return {"engine": engine, "sim_t": finish_s, "finish_s": finish_s, "output_tokens": 100,
            M.time_to_first_token_seconds: ttft_s, M.inter_token_latency_seconds: itl_s}


def test_latency_covers_the_last_minute_not_only_the_last_second():
    from gpudiag.commands.top import LatencyWindow

    window = LatencyWindow(60.0)
    # 100 requests finished over the storm's first 50 s, then none for 9 s
    window.add_requests([_request("e", t * 0.5, ttft_s=0.1 + t / 1000, itl_s=0.02) for t in range(100)], now=0)
    lat = window.summary({"engine": "e", "sim_t": 59.0, M.num_requests_running: STORM_RUNNING}, now=0)
    assert lat["finished"] == 100
    assert lat[M.time_to_first_token_seconds]["p99"] == pytest.approx(0.198, abs=0.002)
    assert lat[M.inter_token_latency_seconds]["p50"] == pytest.approx(0.02)
    # a minute later the window has moved past every one of them
    later = window.summary({"engine": "e", "sim_t": 120.0}, now=0)
    assert later["finished"] == 0 and later[M.time_to_first_token_seconds]["p99"] is None


def test_an_empty_window_says_no_request_finished_and_how_many_run():
    from rich.console import Console

    from gpudiag.commands.top import render

    engine = {"engine": "gpudiag-engine", M.num_requests_running: STORM_RUNNING, M.num_requests_waiting: 12,
              M.kv_cache_usage_perc: 0.99, M.num_preemptions_total: 4200,
              "latency_window": {"window_s": 60.0, "covered_s": 60.0, "finished": 0,
                                 M.time_to_first_token_seconds: {"p50": None, "p99": None},
                                 M.inter_token_latency_seconds: {"p50": None, "p99": None}}}
    view = {"t": 0.0, "node": "n", "sim": None, "host": {}, "gpus": [], "processes": [], "engines": [engine],
            "probes": {"sim": {"available": True}}, "errors": {}}
    console = Console(width=80, record=True, file=open(os.devnull, "w"))
    console.print(render(view, 80))
    screen = console.export_text()
    assert f"no request finished in the last 60 s ({STORM_RUNNING} running)" in screen
    assert "n/a" not in screen.split("Engines")[1]


HISTOGRAM_PAGE = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0"}} 60.0
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{{engine="0",le="0.1"}} {fast}
vllm:time_to_first_token_seconds_bucket{{engine="0",le="1.0"}} {fast}
vllm:time_to_first_token_seconds_bucket{{engine="0",le="10.0"}} {total}
vllm:time_to_first_token_seconds_bucket{{engine="0",le="+Inf"}} {total}
vllm:time_to_first_token_seconds_sum{{engine="0"}} {total}
vllm:time_to_first_token_seconds_count{{engine="0"}} {total}
"""


def test_an_engine_endpoints_histograms_give_the_windows_quantiles_and_forget_what_left_it():
    """Cumulative histograms scraped each second are subtracted across the window, as rate() does."""
    from gpudiag.commands.top import TopModel
    from gpudiag.probes.engine_scrape import EngineScrapeProbe

    counts = {"fast": 0, "total": 0}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            page = HISTOGRAM_PAGE.format(**counts).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(page)))
            self.end_headers()
            self.wfile.write(page)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        model = TopModel([EngineScrapeProbe(f"http://127.0.0.1:{server.server_address[1]}/metrics")],
                         latency_window_s=60.0, node="n")
        model.tick(now=1000.0)
        counts.update(fast=100, total=100)  # 100 fast requests in the first 10 s
        model.tick(now=1010.0)
        for t in range(1011, 1075):  # then only slow ones, one a second
            counts["total"] += 1
            view = model.tick(now=float(t))
        (engine,) = view["engines"]
        lat = engine["latency_window"]
        assert lat["finished"] == 60  # the fast ones have left the window
        assert lat[M.time_to_first_token_seconds]["p50"] > 1.0
        for t in range(1075, 1140):  # the engine goes quiet: nothing finishes
            view = model.tick(now=float(t))
        assert view["engines"][0]["latency_window"]["finished"] == 0
        model.close()
    finally:
        server.shutdown()
        server.server_close()


def test_a_latency_window_is_a_duration():
    from gpudiag.commands.top import parse_duration

    assert parse_duration("60s") == 60 and parse_duration("2m") == 120 and parse_duration("90") == 90


def test_a_latency_window_that_is_not_a_duration_is_one_error_line(cli):
    proc = cli("top", "--once", "--latency-window", "soon")
    assert proc.returncode == 2 and proc.stderr.startswith("gpudiag: error: a duration")


# --- one simulated frame: names, threads, no interactive hint, 80 columns ---------------------


def test_sim_once_at_80_columns_names_the_gpu_and_the_busiest_thread_without_hints_or_cut_labels(cli):
    env = dict(os.environ, COLUMNS="80", LINES="40")
    proc = cli("top", "--sim", "--once", "--speed", "20", env=env, timeout=180)
    assert proc.returncode == 0, proc.stderr
    screen = proc.stdout
    assert "q quits" not in screen  # --once is not interactive
    assert "A100" in screen and "engine-loop" in screen  # the GPU's name and the engine's busiest thread
    assert "gpudiag-engine" in screen and "…" not in screen
    assert max(len(line) for line in screen.splitlines()) <= 80
    assert "requests finished in the" in screen  # latency says over what it was taken


def test_sim_once_json_carries_the_latency_window_the_gpu_name_and_the_thread(cli):
    proc = cli("top", "--sim", "--once", "--json", "--speed", "20", "--latency-window", "2m", timeout=180)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)  # JSON only: a pipe gets nothing else
    assert doc["gpus"][0]["name"]
    (engine,) = doc["engines"]
    lat = engine["latency_window"]
    assert lat["window_s"] == 120 and lat["finished"] > 0
    assert lat[M.time_to_first_token_seconds]["p50"] <= lat[M.time_to_first_token_seconds]["p99"]
    assert doc["processes"][0]["top_threads"][0]["name"] == "engine-loop"


# --- findings open in the agent ---------------------------------------------------------------


def test_top_names_the_findings_open_in_the_agents_store_and_not_the_resolved_ones(cli, tmp_path, engine_url):
    from gpudiag.agent.store import Store

    path = str(tmp_path / "agent.db")
    store = Store.open(path)
    store.upsert_finding({"id": "kv_eviction_storm-gpu0-100", "kind": "kv_eviction_storm", "severity": "critical",
                          "start_s": 100.0, "end_s": None, "gpu": 0, "summary": "evictions", "evidence": []})
    store.upsert_finding({"id": "memory_leak-gpu0-50", "kind": "memory_leak", "severity": "warning",
                          "start_s": 50.0, "end_s": 90.0, "gpu": 0, "summary": "leak", "evidence": []})
    store.flush()
    store.close()
    proc = cli("top", "--once", "--json", "--engine", engine_url, "--store", path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert [f["kind"] for f in doc["findings"]] == ["kv_eviction_storm"]
    proc = cli("top", "--once", "--engine", engine_url, "--store", path, env=dict(os.environ, COLUMNS="80"),
               timeout=120)
    assert "agent: 1 open: kv_eviction_storm critical gpu 0" in proc.stdout


@pytest.fixture
def running_agent():
    """The agent's real exporter serving one open finding and one GPU's figures."""
    from gpudiag.agent.prom_exporter import serve
    from gpudiag.exposition import LatestFrames, registry_for

    latest = LatestFrames(node="node-a")
    latest.set_findings([{"id": "kv_eviction_storm-gpu0-100", "kind": "kv_eviction_storm", "severity": "warning",
                          "gpu": 0, "start_s": 100.0, "end_s": None, "summary": "evictions", "evidence": []}])
    server = serve(registry_for(latest), "127.0.0.1", 0)
    yield server.url
    server.close()


def test_top_names_the_findings_open_in_a_running_agent_with_their_severity(cli, engine_url, running_agent):
    proc = cli("top", "--once", "--json", "--engine", engine_url, "--agent", running_agent, timeout=120)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)  # JSON only: a pipe gets nothing else
    assert doc["agent"]["reachable"] is True
    assert [(f["kind"], f["severity"], f["gpu"]) for f in doc["findings"]] == [("kv_eviction_storm", "warning", 0)]
    assert "detected_here" not in doc  # the agent judges; top does not judge again
    base = running_agent.removesuffix("/metrics")
    proc = cli("top", "--once", "--engine", engine_url, "--agent", base, env=dict(os.environ, COLUMNS="80"),
               timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "agent: 1 open: kv_eviction_storm warning gpu 0" in proc.stdout


def test_an_agent_that_does_not_answer_is_named_on_its_line_and_the_view_goes_on(cli, engine_url):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = cli("top", "--once", "--engine", engine_url, "--agent", f"127.0.0.1:{port}",
               env=dict(os.environ, COLUMNS="80"), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert f"agent: http://127.0.0.1:{port}/metrics not answering" in proc.stdout
    assert "Engines" in proc.stdout  # the rest of the view is drawn
    doc = json.loads(cli("top", "--once", "--json", "--engine", engine_url, "--agent", f"127.0.0.1:{port}",
                         timeout=120).stdout)
    assert doc["agent"]["reachable"] is False and doc["agent"]["error"] and doc["findings"] == []


def test_the_agents_findings_are_read_in_the_background_so_the_view_never_waits():
    from gpudiag.commands.top import Refreshing

    release, calls = threading.Event(), []

    def slow_agent():
        calls.append(1)
        release.wait(10)
        return {"answer": len(calls)}

    reader = Refreshing(slow_agent, every_s=5.0, name="test-slow-agent")
    started = time.monotonic()
    assert reader.poll(0.0) is None  # the first read is under way; the view draws without it
    assert reader.poll(1.0) is None and len(calls) == 1  # one read at a time, none before it is due
    assert time.monotonic() - started < 1.0
    release.set()
    reader.join(5)
    assert reader.poll(2.0) == {"answer": 1} and len(calls) == 1  # not due again before 5 s
    reader.poll(5.0)
    reader.join(5)
    assert reader.poll(6.0) == {"answer": 2}


# --- findings detected by top itself ----------------------------------------------------------

T0 = 1_700_000_000.0  # the wall clock a live top would stamp the scenario's second 0 with


@pytest.fixture(scope="module")
def storm_frames():
    """The kv-eviction-storm scenario's frames up to simulated second 3500 (its storm starts near 3100),
    stamped as top stamps its samples."""
    from gpudiag.frames import Frame
    from gpudiag.reference_engine import scenarios
    from gpudiag.reference_engine.sim.engine import SimEngine

    cfg, workload = scenarios.get("kv-eviction-storm").build(None)
    frames = []
    for fr in SimEngine(cfg, workload, seed=0).frames():
        if fr.t > 3500:
            break  # the engine generates lazily: stopping here saves the rest of the two-hour run
        frames.append(Frame(fr.kind, T0 + fr.t, fr.rows))
    return frames


def test_top_without_an_agent_detects_the_eviction_storm_in_the_window_it_holds(storm_frames):
    from gpudiag.commands.top import LOCAL_WINDOW_S, LocalFindings, detected_line

    local = LocalFindings()
    by_t: dict[float, list] = {}
    for fr in storm_frames:
        by_t.setdefault(fr.t, []).append(fr)
    for t, frames in by_t.items():  # one tick a second, as top samples
        local.add(frames, t)
    assert local.frames[0].t >= storm_frames[-1].t - LOCAL_WINDOW_S  # only the window is kept
    doc = local.read(storm_frames[-1].t, wait=True)
    storm = [f for f in doc["findings"] if f["kind"] == "kv_eviction_storm"]
    assert storm and storm[0]["open"] and storm[0]["gpu"] == 0
    since = time.strftime("%H:%M:%S", time.localtime(storm[0]["start_s"]))
    assert 3000 <= storm[0]["start_s"] - T0 <= 3200
    assert f"kv_eviction_storm {storm[0]['severity']} gpu 0 since {since}" in detected_line(doc).plain


def test_a_healthy_window_says_nothing_was_found_and_how_many_analyzers_could_judge(storm_frames):
    from gpudiag.commands.top import detect_locally, detected_line

    healthy = [fr for fr in storm_frames if fr.t <= T0 + 600]
    doc = detect_locally(healthy)
    assert doc["findings"] == [] and 0 < doc["judged"] < doc["analyzers"] == 12
    assert detected_line(doc).plain == (f"detected here: nothing in the 10 min seen so far "
                                        f"({doc['judged']} of 12 analyzers could judge)")
    assert detected_line(detect_locally([])).plain.startswith("detected here: nothing")


def test_sim_once_json_says_what_top_detected_itself(cli):
    proc = cli("top", "--sim", "--once", "--json", "--speed", "20", timeout=180)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    here = doc["detected_here"]
    assert here["analyzers"] == 12 and here["error"] is None and isinstance(here["findings"], list)


def test_a_store_that_is_not_there_is_one_error_line(cli, tmp_path):
    proc = cli("top", "--once", "--store", str(tmp_path / "none.db"))
    assert proc.returncode == 2 and proc.stderr.startswith("gpudiag: error:")


# --- the first frame --------------------------------------------------------------------------


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (scripts/system-deps.d/30-tmux.sh)")
def test_the_first_frame_is_drawn_while_the_simulator_is_still_starting():
    """Ordering, not a stopwatch: the header shows before the first sample does, whatever the load."""
    session = f"gpudiag-top-first-{os.getpid()}"
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "80", "-y", "30",
                    f"cd {repo} && env -u COLUMNS -u LINES {sys.executable} -m gpudiag top --sim; sleep 60"],
                   check=True)
    try:
        started = time.monotonic()
        first = _wait_screen(session, lambda s: "gpudiag top" in s)
        first_s = time.monotonic() - started
        assert "starting:" in first and "waiting for the first sample" in first, first
        assert "q quits" in first
        filled = _wait_screen(session, lambda s: "GPU  name" in s, timeout_s=60)
        filled_s = time.monotonic() - started
        assert "starting:" not in filled
        assert first_s < filled_s
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True, check=False)
