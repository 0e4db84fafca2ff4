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

    from gpudiag.commands.top import TopModel, open_probes, render

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
