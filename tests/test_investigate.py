"""`gpudiag investigate` over a real store holding the kv-eviction-storm scenario's timeline.

The store is written the way the agent writes it in --sim mode: the scenario's
frames, stamped start time + simulated seconds, appended and flushed into a
real Store; the command then runs as a subprocess against that file.
"""

import json
import os
import re

import numpy as np
import pytest
from store_support import write_window

from gpudiag import repro as R
from gpudiag.agent.store import Store
from gpudiag.analyzers import latency_regression, oom_forecast
from gpudiag.analyzers.registry import ANALYZERS
from gpudiag.catalog import M
from gpudiag.frames import Frame
from gpudiag.investigate import parse_duration, parse_time
from gpudiag.reference_engine import scenarios
from gpudiag.report_html import charts_for

# The agent's simulated time base: its start wall time plus simulated seconds.
T0 = 1_700_000_000.0
HEALTHY_END_S = 2400.0  # the first 40 minutes: short requests only, before the long-sequence phase


@pytest.fixture(scope="module")
def storm_store(tmp_path_factory):
    """A store holding the full two-hour kv-eviction-storm run (seed 0)."""
    res = R.run(scenarios.get("kv-eviction-storm"), None, 0)
    path = str(tmp_path_factory.mktemp("investigate") / "storm.db")
    return write_window(res.window, path, T0)


def _window(store, start, end):
    return ["investigate", "--store", store, "--from", str(T0 + start), "--to", str(T0 + end)]


def test_an_eviction_storm_is_traced_back_to_fragmentation_and_exits_1(cli, storm_store):
    p = cli(*_window(storm_store, 0, 7200), "--json")
    assert p.returncode == 1, p.stderr
    doc = json.loads(p.stdout)
    assert set(doc) >= {"window", "sources", "gaps", "findings", "memory", "next_steps"}
    assert doc["window"]["start_s"] == T0 and doc["window"]["end_s"] == T0 + 7200
    assert doc["sources"] == [f"store:{storm_store}"]
    kinds = [f["kind"] for f in doc["findings"]]
    assert kinds[0] == "memory_fragmentation", kinds
    storm = next(f for f in doc["findings"] if f["kind"] == "kv_eviction_storm")
    assert any(c.startswith("memory_fragmentation-") for c in storm["caused_by"])
    by_id = {f["id"]: f for f in doc["findings"]}
    for f in doc["findings"]:  # the finding schema of `gpudiag repro`
        assert set(f) >= {"id", "kind", "severity", "start_s", "end_s", "open", "node", "gpu", "pid", "summary",
                          "evidence", "caused_by", "runbook", "fixes"}
        assert all(set(e) == {"metric", "observed", "baseline", "threshold", "unit"} for e in f["evidence"])
        # Causes precede effects (within the store's 1 s step), and no finding outlives the data.
        assert all(by_id[c]["start_s"] <= f["start_s"] + 1.0 for c in f["caused_by"]), f["id"]
        assert f["end_s"] <= T0 + 7200
    # The first storm (from 3057 s) began before any allocation failed with memory free (3390 s):
    # only the second is the fragmentation's.
    storms = sorted((f for f in doc["findings"] if f["kind"] == "kv_eviction_storm"), key=lambda f: f["start_s"])
    assert [bool(f["caused_by"]) for f in storms] == [False, True]
    # The simulated engine reports all three colours; eBPF is not used with --sim.
    implicated = [m for m in doc["memory"] if m["implicated"]]
    assert implicated and implicated[0]["pid"] == storm_findings_pid(doc)
    m = implicated[0]
    assert m["white_bytes"] <= m["grey_bytes"] <= m["black_bytes"]
    assert m["grey_minus_white_bytes"] == m["grey_bytes"] - m["white_bytes"]
    assert [g["kind"] for g in doc["gaps"]] == ["cuda_api"]
    assert "eBPF" in doc["gaps"][0]["reason"]
    steps = {s["runbook"]: s for s in doc["next_steps"]}
    assert steps["GpudiagKvEvictionStorm"]["command"] == "gpudiag runbook GpudiagKvEvictionStorm"
    assert "gpudiag repro kv-eviction-storm --fix paged-kv" in steps["GpudiagKvEvictionStorm"]["repro"]
    # No scenario reproduces a latency regression on its own: no repro command is offered for it.
    assert steps["GpudiagLatencyRegression"]["repro"] == []


def storm_findings_pid(doc):
    return next(f["pid"] for f in doc["findings"] if f["kind"] == "memory_fragmentation")


def test_the_report_names_the_chain_the_runbook_and_writes_a_self_contained_html(cli, storm_store, tmp_path):
    html = tmp_path / "report.html"
    p = cli(*_window(storm_store, 0, 7200), "--html", html, env={**os.environ, "COLUMNS": "160"})
    assert p.returncode == 1, p.stderr
    out = p.stdout
    assert out.index("memory_fragmentation") < out.index("kv_eviction_storm")
    assert "gpudiag runbook GpudiagKvEvictionStorm" in out
    assert "gpudiag repro kv-eviction-storm --fix paged-kv" in out
    # paged-kv fixes the fragmentation and the storm alike: shown once, under the first.
    fixes = [line.split("check a fix:")[1].strip() for line in out.splitlines() if "check a fix:" in line]
    assert fixes and len(fixes) == len(set(fixes)), fixes
    assert "Could not be checked" in out and "eBPF" in out
    text = html.read_text(encoding="utf-8")
    assert not re.search(r"<script[^>]+src=", text), "the report must not load scripts from anywhere"
    assert "cdn.plot.ly/plotly" not in text
    assert "Plotly.newPlot" in text and len(text) > 3_000_000  # plotly.js (~3.5 MB) is inline
    # Each finding has its section, with the titles of its evidence charts.
    for kind in ("memory_fragmentation", "kv_eviction_storm"):
        assert f"data-kind='{kind}'" in text
        assert all(chart.title in text for chart in charts_for(kind))
    # The coverage section: every analyzer with what it ran on, or why it did not run.
    coverage = text[text.index("id='coverage'"):]
    assert "did not run" in coverage and "cuda_function_grid_blocks" in coverage
    assert "kv_eviction_storm</td><td>ran" in coverage
    assert "Coverage:" in out


def test_the_report_at_80_columns_names_every_metric_and_process_whole(cli, storm_store):
    p = cli(*_window(storm_store, 0, 7200), env={**os.environ, "COLUMNS": "80"})
    assert p.returncode == 1, p.stderr
    out = p.stdout
    assert "…" not in out  # no metric, process or figure cut
    assert max(len(line) for line in out.splitlines()) <= 80
    doc = json.loads(cli(*_window(storm_store, 0, 7200), "--json", env={**os.environ, "COLUMNS": "80"}).stdout)
    for f in doc["findings"]:
        for e in f["evidence"]:
            assert e["metric"] in out
    assert "Three-colour memory" in out and "largest" in out


def test_a_healthy_window_with_views_missing_is_inconclusive_and_exits_3(cli, storm_store):
    p = cli(*_window(storm_store, 0, HEALTHY_END_S), "--json")
    assert p.returncode == 3, p.stderr + p.stdout
    doc = json.loads(p.stdout)
    assert doc["findings"] == [] and doc["worst_severity"] is None
    assert [m["implicated"] for m in doc["memory"]] == [False]
    cov = doc["coverage"]
    assert cov["conclusive"] is False
    not_run = {r["analyzer"]: r for r in cov["not_run"]}
    # No eBPF with --sim: the launch shapes could not be looked at, and the report names the columns.
    assert not_run["degenerate_kernel_launch"]["reason"] == "missing_input"
    assert "cuda_function_grid_blocks" in not_run["degenerate_kernel_launch"]["detail"]
    assert "kernel launch shapes" in {u["symptom"] for u in cov["unjudged"]}
    ran = {r["analyzer"]: r for r in cov["ran"]}
    assert set(ran) | set(not_run) == set(ANALYZERS)
    storm_input = ran["kv_eviction_storm"]["inputs"][0]
    assert storm_input["kind"] == "engine" and storm_input["rows"] == storm_input["seconds"] + 1 >= HEALTHY_END_S
    text = cli(*_window(storm_store, 0, HEALTHY_END_S), env={**os.environ, "COLUMNS": "200"})
    assert text.returncode == 3
    assert "inconclusive: nothing found" in text.stdout and "did not run  degenerate_kernel_launch" in text.stdout


def test_a_window_too_short_for_a_trend_names_the_trend_analyzers_as_too_short(cli, storm_store):
    p = cli(*_window(storm_store, 0, 300), "--json")
    assert p.returncode == 3, p.stderr
    not_run = {r["analyzer"]: r for r in json.loads(p.stdout)["coverage"]["not_run"]}
    for kind in ("memory_leak", "oom_forecast", "latency_regression"):
        assert not_run[kind]["reason"] == "too_short", kind
    leak = not_run["memory_leak"]
    assert leak["needs_s"] == oom_forecast.MIN_TREND_SPAN_S and leak["held_s"] == 299  # samples 1..300 s
    assert "oom_forecast.MIN_TREND_SPAN_S" in leak["detail"]
    assert not_run["latency_regression"]["needs_s"] == latency_regression.MIN_SPAN_S


def test_a_finding_still_going_at_the_windows_end_is_open_and_ends_with_the_data(cli, storm_store):
    # The first storm runs from 3057 s to 3524 s: a window ending at 3500 s cuts it.
    p = cli(*_window(storm_store, 0, 3500), "--json")
    doc = json.loads(p.stdout)
    storm = next(f for f in doc["findings"] if f["kind"] == "kv_eviction_storm")
    assert storm["open"] is True and storm["end_s"] == T0 + 3500
    assert all(f["end_s"] <= T0 + 3500 for f in doc["findings"])
    text = cli(*_window(storm_store, 0, 3500), env={**os.environ, "COLUMNS": "200"}).stdout
    line = next(x for x in text.splitlines() if "kv_eviction_storm" in x and "→" in x)
    assert line.rstrip(" │").endswith("→ ongoing at the window's end")


def _healthy_node_with_every_view(path: str, seconds: int = 900) -> None:
    """A store of a calm serving node seen through every view gpudiag reads: NVML, the allocator, the
    engine with its request rows, the host, eBPF."""
    rng = np.random.default_rng(0)
    store = Store.open(path)
    node, pid = "n1", 4242
    for s in range(seconds + 1):
        t = T0 + s
        requests = [{"node": node, "gpu": 0, "engine": "e",
                     M.time_to_first_token_seconds: ttft, M.inter_token_latency_seconds: tpot,
                     M.e2e_request_latency_seconds: ttft + 200 * tpot}
                    for ttft, tpot in zip(rng.lognormal(np.log(0.1), 0.2, 2), rng.lognormal(np.log(0.03), 0.1, 2))]
        store.append([
            Frame("gpu", t, [{"node": node, "gpu": 0, M.gpu_utilization_ratio: 0.7, M.gpu_memory_total_bytes: 80e9,
                              M.gpu_memory_used_bytes: 50e9, M.gpu_temperature_celsius: 60.0,
                              M.gpu_pcie_replay_total: 0}]),
            Frame("node", t, [{"node": node, M.node_cpu_utilization_ratio: 0.3}]),
            Frame("process", t, [{"node": node, "gpu": 0, "pid": pid, "process": "e", M.process_gpu_memory_bytes: 49e9,
                                  M.process_torch_reserved_bytes: 48e9, M.process_torch_allocated_bytes: 40e9,
                                  M.process_torch_largest_free_block_bytes: 6e9, M.process_thread_cpu_max_ratio: 0.3}]),
            Frame("engine", t, [{"node": node, "gpu": 0, "engine": "e", "pid": pid, M.num_requests_running: 20,
                                 M.num_requests_waiting: 0, M.engine_kv_capacity_bytes: 30e9,
                                 M.engine_kv_evictions_total: 0, M.engine_kv_alloc_failures_total: 0,
                                 M.engine_kv_failed_request_bytes: 0, M.engine_requests_timed_out_total: 0,
                                 M.engine_restarts_total: 0, M.engine_prefix_cache_recomputed_tokens_total: 0,
                                 M.prefix_cache_queries_total: 100 * s, M.engine_requests_arrived_total: 2 * s}]),
            Frame("request", t, requests),
            Frame("cuda_api", t, [{"node": node, "pid": pid, M.cuda_degenerate_launches_total: 0,
                                   M.cuda_kernel_launches_total: 1000 * s}]),
        ])
        store.flush()
    store.close()


def test_nothing_wrong_in_what_could_be_checked_exits_0(cli, tmp_path):
    path = str(tmp_path / "calm.db")
    _healthy_node_with_every_view(path)
    p = cli("investigate", "--store", path, "--since", "15m", "--json")
    doc = json.loads(p.stdout)
    assert p.returncode == 0, (p.stderr, doc["findings"], doc["coverage"]["not_run"])
    assert doc["findings"] == [] and doc["coverage"]["conclusive"] is True
    assert {r["analyzer"] for r in doc["coverage"]["ran"]} == set(ANALYZERS)
    assert doc["coverage"]["unjudged"] == []
    text = cli("investigate", "--store", path, "--since", "15m", env={**os.environ, "COLUMNS": "200"})
    assert text.returncode == 0 and "nothing wrong in what could be checked" in text.stdout


def test_the_help_documents_every_exit_code(cli):
    out = cli("investigate", "--help", env={**os.environ, "COLUMNS": "200"}).stdout
    for code, meaning in ((0, "nothing of warning level found"), (1, "a warning or critical finding"),
                          (2, "bad input"), (3, "inconclusive")):
        assert re.search(rf"\b{code}\b[^.;]*{meaning}", " ".join(out.split())), (code, out)


def test_a_reader_that_stops_early_gets_no_traceback_and_the_exit_code_still_says_what_was_found(storm_store):
    # The command exits without freeing its window; the output is flushed first, and a closed
    # pipe (`| head`) is not an error.
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "gpudiag", *_window(storm_store, 0, 7200), "--json"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()  # before a byte is written: the document's final flush meets a closed pipe
    err = p.stderr.read().decode()
    assert p.wait(timeout=600) in (0, 1, 3) and "Traceback" not in err, err
    whole = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert whole.returncode == 1 and json.loads(whole.stdout)["worst_severity"] == "critical", whole.stderr


def test_since_counts_back_from_the_stores_latest_sample(cli, storm_store):
    p = cli("investigate", "--store", storm_store, "--since", "30m", "--json")
    assert p.returncode in (0, 1, 3), p.stderr
    w = json.loads(p.stdout)["window"]
    assert w["end_s"] == pytest.approx(T0 + 7199.0, abs=1.0)
    assert w["end_s"] - w["start_s"] == pytest.approx(1800.0)


@pytest.mark.parametrize("args, message", [
    (["--from", "2000000000"], "in the future"),
    (["--from", "yesterday"], "malformed time"),
    (["--from", "2023-13-45T99:00"], "malformed time"),
    (["--since", "30x"], "malformed duration"),
    (["--node", "no-such-node"], "no node 'no-such-node'"),
    (["--gpu", "7"], "no GPU 7"),
    (["--from", str(T0 + 3000), "--to", str(T0 + 1000)], "must be before --to"),
    (["--since", "30m", "--from", str(T0)], "either --since or --from"),
    (["--from", "1000", "--to", "2000"], "no data between"),
])
def test_bad_times_and_entities_give_one_line_and_exit_2(cli, storm_store, args, message):
    p = cli("investigate", "--store", storm_store, *args)
    assert p.returncode == 2, p.stdout + p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in p.stderr, p.stderr


def test_the_hint_names_only_the_nodes_and_gpus_with_rows_in_the_window(cli, tmp_path):
    # Node a (GPUs 0 and 1) wrote the first minute, node b (GPU 0) the second: a window over the
    # second minute holds no row of node a or of GPU 1, though the store keeps them beside it.
    path = str(tmp_path / "handover.db")
    store = Store.open(path)
    for s in range(120):
        node, gpus = ("a", (0, 1)) if s < 60 else ("b", (0,))
        store.append([Frame("gpu", T0 + s, [{"node": node, "gpu": g, M.gpu_utilization_ratio: 0.5} for g in gpus])])
        store.flush()
    store.close()
    window = ["investigate", "--store", path, "--from", str(T0 + 90), "--to", str(T0 + 119)]
    for extra, hint in ((["--node", "zz"], "nodes there: b"), (["--gpu", "7"], "GPUs there: 0")):
        p = cli(*window, *extra)
        lines = p.stderr.strip().splitlines()
        assert p.returncode == 2 and len(lines) == 1 and lines[0].endswith(hint), p.stderr


def test_a_missing_or_empty_store_gives_one_line_and_exit_2(cli, tmp_path):
    empty = tmp_path / "empty.db"
    empty.write_bytes(b"")
    fresh = tmp_path / "fresh.db"
    Store.open(str(fresh)).close()  # a store an agent created but has not written to
    for path in (tmp_path / "missing.db", empty, fresh):
        p = cli("investigate", "--store", path)
        assert p.returncode == 2, p.stdout + p.stderr
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and str(path) in lines[0] and "Traceback" not in p.stderr, p.stderr


def test_times_parse_as_durations_iso_and_unix_seconds():
    assert parse_duration("90s") == 90 and parse_duration("30m") == 1800 and parse_duration("2h") == 7200
    assert parse_time("2023-11-14T22:13:20Z", "--from") == T0
    assert parse_time("2023-11-14T23:13:20+01:00", "--from") == T0
    assert parse_time("1700000000", "--from") == T0


def test_one_gpu_of_a_node_shows_only_its_processes_with_their_last_observed_colours(cli, tmp_path):
    path = str(tmp_path / "two-gpus.db")
    store = Store.open(path)
    for s in range(300):
        t = T0 + s
        store.append([
            Frame("gpu", t, [{"node": "n1", "gpu": g, M.gpu_memory_total_bytes: 80e9, M.gpu_memory_used_bytes: 40e9,
                              M.gpu_utilization_ratio: 0.5} for g in (0, 1)]),
            Frame("node", t, [{"node": "n1", M.node_cpu_utilization_ratio: 0.3}]),
            Frame("process", t, [{"node": "n1", "gpu": g, "pid": 100 * g + p, "process": f"w{g}{p}",
                                  M.process_torch_allocated_bytes: 1e9 + s,
                                  M.process_torch_reserved_bytes: 2e9 + s,
                                  # The driver's view is missing from the last ten samples of pid 101.
                                  **({} if (g, p, s >= 290) == (1, 1, True) else {M.process_gpu_memory_bytes: 3e9 + s})}
                                 for g in (0, 1) for p in (0, 1)]),
        ])
        store.flush()
    store.close()
    p = cli("investigate", "--store", path, "--since", "5m", "--gpu", "1", "--json")
    assert p.returncode == 3, p.stderr  # nothing found, no engine rows: inconclusive
    memory = {m["pid"]: m for m in json.loads(p.stdout)["memory"]}
    assert set(memory) == {100, 101} and {m["gpu"] for m in memory.values()} == {1}
    assert memory[100]["white_bytes"] == 1e9 + 299 and memory[100]["black_bytes"] == 3e9 + 299
    assert memory[101]["black_bytes"] == 3e9 + 289  # the last sample that had it
    assert memory[101]["process"] == "w11"


def test_a_json_investigation_loads_neither_pandas_nor_the_repro_runner(storm_store):
    """An on-call `investigate --json` reads columns: pandas (charts only) and the repro runner cost it 0.4 s,
    and the other commands' modules another 0.3 s."""
    import subprocess
    import sys

    code = ("import sys, json\n"
            "from gpudiag.cli import main\n"
            "try:\n    rc = main(sys.argv[1:])\nexcept SystemExit as exc:\n    rc = exc.code\n"
            "loaded = [m for m in ('pandas', 'gpudiag.repro', 'gpudiag.commands.agent', 'gpudiag.commands.top')\n"
            "          if m in sys.modules]\n"
            "print('LOADED', json.dumps([rc, loaded]), file=sys.stderr)\n")
    p = subprocess.run([sys.executable, "-c", code, *_window(storm_store, 0, 7200), "--json"],
                       capture_output=True, text=True, timeout=600)
    assert json.loads(p.stdout)["findings"], "the investigation found nothing: the check would prove little"
    line = [x for x in p.stderr.splitlines() if x.startswith("LOADED ")][-1]
    rc, loaded = json.loads(line[len("LOADED "):])
    assert rc == 1, p.stderr
    assert loaded == []
