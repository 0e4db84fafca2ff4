"""`gpudiag investigate` over a real store holding the kv-eviction-storm scenario's timeline.

The store is written the way the agent writes it in --sim mode: the scenario's
frames, stamped start time + simulated seconds, appended and flushed into a
real Store; the command then runs as a subprocess against that file.
"""

import json
import math
import os
import re

import pytest

from gpudiag import repro as R
from gpudiag.agent.store import Store
from gpudiag.catalog import M
from gpudiag.frames import Frame
from gpudiag.investigate import CHART_TITLES, parse_duration, parse_time
from gpudiag.reference_engine import scenarios

# The agent's simulated time base: its start wall time plus simulated seconds.
T0 = 1_700_000_000.0
HEALTHY_END_S = 2400.0  # the first 40 minutes: short requests only, before the long-sequence phase


@pytest.fixture(scope="module")
def storm_store(tmp_path_factory):
    """A store holding the full two-hour kv-eviction-storm run (seed 0)."""
    res = R.run(scenarios.get("kv-eviction-storm"), None, 0)
    path = str(tmp_path_factory.mktemp("investigate") / "storm.db")
    store = Store.open(path)
    for kind, df in res.window.tables.items():
        by_t: dict[float, list[dict]] = {}
        for row in df.to_dict("records"):
            t = row.pop("t")
            by_t.setdefault(t, []).append({k: v for k, v in row.items()
                                           if not (isinstance(v, float) and math.isnan(v))})
        store.append(Frame(kind, T0 + t, rows) for t, rows in by_t.items())
        store.flush()
    store.close()
    return path


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
    for f in doc["findings"]:  # the finding schema of `gpudiag repro`
        assert set(f) >= {"id", "kind", "severity", "start_s", "end_s", "node", "gpu", "pid", "summary",
                          "evidence", "caused_by", "runbook", "fixes"}
        assert all(set(e) == {"metric", "observed", "baseline", "threshold", "unit"} for e in f["evidence"])
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
    for title in CHART_TITLES:
        assert title in text


def test_a_healthy_window_exits_0(cli, storm_store):
    p = cli(*_window(storm_store, 0, HEALTHY_END_S), "--json")
    assert p.returncode == 0, p.stderr + p.stdout
    doc = json.loads(p.stdout)
    assert doc["findings"] == [] and doc["worst_severity"] is None
    assert [m["implicated"] for m in doc["memory"]] == [False]


def test_a_reader_that_stops_early_gets_no_traceback_and_the_exit_code_still_says_what_was_found(storm_store):
    # The command exits without freeing its window; the output is flushed first, and a closed
    # pipe (`| head`) is not an error.
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "gpudiag", *_window(storm_store, 0, 7200), "--json"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()  # before a byte is written: the document's final flush meets a closed pipe
    err = p.stderr.read().decode()
    assert p.wait(timeout=600) in (0, 1) and "Traceback" not in err, err
    whole = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert whole.returncode == 1 and json.loads(whole.stdout)["worst_severity"] == "critical", whole.stderr


def test_since_counts_back_from_the_stores_latest_sample(cli, storm_store):
    p = cli("investigate", "--store", storm_store, "--since", "30m", "--json")
    assert p.returncode in (0, 1), p.stderr
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
    assert p.returncode in (0, 1), p.stderr
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
