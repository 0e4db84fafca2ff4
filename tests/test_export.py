"""`gpudiag export`: a store written through the real Store API comes back value for value from Parquet and CSV."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gpudiag.agent.store import Store
from gpudiag.catalog import CATALOG, M
from gpudiag.cli import main
from gpudiag.frames import Frame

T0 = 1767225600.0  # a whole hour: with --interval 4s the ticks fall in [T0, T0+4) and [T0+4, T0+7]
TICKS = 8
LABELS = {"gpu": ("node", "gpu"), "process": ("node", "pid"), "engine": ("node", "engine"),
          "request": ("request_id",), "node": ("node",)}


def _frames(tick: int) -> list[Frame]:
    t = T0 + tick
    gpus = [{"node": "node-a", "gpu": g, "uuid": f"GPU-{g}", M.gpu_utilization_ratio: round(0.1 * tick + 0.05 * g, 3),
             M.gpu_memory_used_bytes: (70 + g) * 2**30 + tick, M.gpu_power_watts: 250.5 + tick,
             M.gpu_temperature_celsius: None if tick % 3 == 0 else 60.0 + g} for g in range(2)]
    procs = [{"node": "node-a", "gpu": j % 2, "uuid": f"GPU-{j % 2}", "pid": 1000 + j,
              "process": ["vllm", "python3"][j % 2],
              M.process_torch_allocated_bytes: None if j == 2 else float(2**33 + 4096 * tick + j),
              M.process_context_switches_total: {"voluntary": 10 * tick + j, "involuntary": j},
              M.process_cpu_utilization_ratio: (tick * 7 + j) % 100 / 100,
              **({"missing_reasons": {M.process_torch_allocated_bytes: "no in-process reporter"}} if j == 2 else {})}
             for j in range(3)]
    engines = [{"node": "node-a", "gpu": g, "engine": f"engine-{g}", M.num_requests_running: 30 + tick + g,
                M.kv_cache_usage_perc: round(0.5 + 0.01 * tick, 2), "draining": tick >= 6} for g in range(2)]
    requests = [{"node": "node-a", "gpu": k % 2, "request_id": f"req-{tick}-{k}-{'abcdef'[k]}",
                 M.time_to_first_token_seconds: 0.125 + 0.001 * k, M.e2e_request_latency_seconds: 1.5 + tick / 8,
                 "output_tokens": 100 + k} for k in range(tick % 4)]
    frames = [Frame("gpu", t, gpus), Frame("process", t, procs), Frame("engine", t, engines),
              Frame("node", t, [{"node": "node-a", M.node_cpu_utilization_ratio: 0.25}])]
    if requests:
        frames.append(Frame("request", t + 0.5, requests))
    return frames


def _flat(row: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in row.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat(v, name + "."))
        elif v is not None:
            # A catalog metric is a float column, whatever Python type the probe gave it.
            out[name] = float(v) if name.split(".")[0] in CATALOG and not isinstance(v, str) else v
    return out


def expected() -> dict[str, dict[tuple, dict]]:
    """What the export must hold: every input row, flattened, keyed by (t, its labels)."""
    out: dict[str, dict[tuple, dict]] = {}
    for tick in range(TICKS):
        for fr in _frames(tick):
            for row in fr.rows:
                flat = {"t": fr.t, **_flat(row)}
                out.setdefault(fr.kind, {})[(fr.t, *(row[k] for k in LABELS[fr.kind]))] = flat
    return out


@pytest.fixture(scope="module")
def store_path(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("export") / "s.db")
    with Store.open(path) as store:
        for tick in range(TICKS):
            store.append(_frames(tick))
            store.flush()
        assert store.health()["dropped_rows_total"] == 0
    return path


def _rows_back(records: list[dict], kind: str) -> dict[tuple, dict]:
    out = {}
    for r in records:
        row = {k: v for k, v in r.items() if v is not None and not (isinstance(v, float) and np.isnan(v))}
        out[(row["t"], *(row[k] for k in LABELS[kind]))] = row
    return out


def test_a_parquet_export_holds_every_value_of_every_kind(store_path, tmp_path, capsys):
    pq = pytest.importorskip("pyarrow.parquet", reason="pyarrow is the export extra (scripts/setup --test installs it)")
    assert main(["export", "--store", store_path, "--parquet", str(tmp_path), "--interval", "4s", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    want = expected()
    assert summary["rows"] == {k: len(want.get(k, {})) for k in summary["rows"]}
    by_kind: dict[str, list[str]] = {}
    for f in summary["files"]:
        by_kind.setdefault(f["kind"], []).append(f["path"])
    assert sorted(by_kind) == sorted(want)
    assert all(len(paths) == 2 for paths in by_kind.values())  # one file per kind and interval
    for kind, paths in by_kind.items():
        tables = [pq.read_table(p) for p in paths]
        for t in tables:  # labels are plain strings, never dictionary codes
            for field in t.schema:
                assert not str(field.type).startswith("dictionary"), (kind, field)
        got = _rows_back([r for t in tables for r in t.to_pylist()], kind)
        assert got == want[kind], kind
    gpu = pq.read_table(by_kind["gpu"][0]).schema
    assert str(gpu.field("node").type) == "string" and str(gpu.field("gpu").type) == "int64"
    assert str(gpu.field(M.gpu_memory_used_bytes).type) == "double"
    assert str(pq.read_table(by_kind["engine"][1]).schema.field("draining").type) == "bool"


def test_a_csv_export_reads_back_in_pandas_with_every_value(store_path, tmp_path, capsys):
    import pandas as pd

    assert main(["export", "--store", store_path, "--csv", str(tmp_path), "--interval", "4s", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    want = expected()
    for kind in want:
        paths = [f["path"] for f in summary["files"] if f["kind"] == kind]
        assert len(paths) == 2
        records = [r for p in paths for r in pd.read_csv(p).to_dict("records")]
        got = _rows_back(records, kind)
        assert got.keys() == want[kind].keys(), kind
        for key, row in want[kind].items():
            back = got[key]
            assert back.keys() == row.keys(), (kind, key)
            for name, v in row.items():
                # pandas reads an int column with a gap as float: equal numbers are the same value.
                assert back[name] == v and type(back[name] == v) in (bool, np.bool_), (kind, name, back[name], v)
                if isinstance(v, bool):
                    assert isinstance(back[name], (bool, np.bool_)), (kind, name)


def test_duckdb_queries_an_export_as_it_is(store_path, tmp_path):
    duckdb = pytest.importorskip("duckdb", reason="duckdb is in the dev extra (scripts/setup --test installs it)")
    pytest.importorskip("pyarrow", reason="pyarrow is the export extra (scripts/setup --test installs it)")
    assert main(["export", "--store", store_path, "--parquet", str(tmp_path / "pq"),
                 "--interval", "4s"]) == 0
    assert main(["export", "--store", store_path, "--csv", str(tmp_path / "csv"), "--interval", "4s"]) == 0
    want = {}
    for row in expected()["gpu"].values():
        want.setdefault(row["gpu"], []).append(row)
    # The query docs/export.md shows, as it is written there.
    doc = (Path(__file__).resolve().parent.parent / "docs" / "export.md").read_text()
    query = doc.split("```sql\n", 1)[1].split("```", 1)[0].replace("'export/", f"'{tmp_path}/pq/")
    got = duckdb.sql(query).fetchall()
    assert [r[:2] for r in got] == [(g, len(rows)) for g, rows in sorted(want.items())]
    for (_, _, mean, peak_gib, last), (_, rows) in zip(got, sorted(want.items())):
        assert mean == pytest.approx(np.mean([r[M.gpu_utilization_ratio] for r in rows]), rel=1e-12)
        assert peak_gib == max(r[M.gpu_memory_used_bytes] for r in rows) / 2**30
        assert last.timestamp() == T0 + TICKS - 1
    want = {g: [r[M.gpu_utilization_ratio] for r in rows] for g, rows in want.items()}
    for source in (f"read_parquet('{tmp_path}/pq/gpu-*.parquet', union_by_name = true)",
                   f"read_csv('{tmp_path}/csv/gpu-*.csv', union_by_name = true)"):
        got = duckdb.sql(f"SELECT gpu, count(*), avg({M.gpu_utilization_ratio}), max(to_timestamp(t)) "
                         f"FROM {source} GROUP BY gpu ORDER BY gpu").fetchall()
        assert [(g, n) for g, n, _, _ in got] == [(g, len(v)) for g, v in sorted(want.items())]
        for (_, _, mean, last), (_, values) in zip(got, sorted(want.items())):
            assert mean == pytest.approx(np.mean(values), rel=1e-12)
            assert last.timestamp() == T0 + TICKS - 1


def test_from_to_and_kind_select_rows_and_files(store_path, tmp_path, capsys):
    assert main(["export", "--store", store_path, "--csv", str(tmp_path), "--kind", "gpu,request",
                 "--from", str(T0 + 2), "--to", str(T0 + 5), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert set(summary["rows"]) == {"gpu", "request"}
    assert summary["rows"]["gpu"] == 2 * 4  # t = T0+2 .. T0+5, both ends included
    assert summary["rows"]["request"] == sum(t % 4 for t in range(2, 5))  # requests at t + 0.5 <= T0+5
    assert {f["kind"] for f in summary["files"]} == {"gpu", "request"}
    units = {c["name"]: c["unit"] for c in summary["columns"]["gpu"]}
    assert units[M.gpu_memory_used_bytes] == "bytes" and units["node"] is None


@pytest.mark.parametrize("args, message", [
    (["--store", "{tmp}/nope.db", "--csv", "{tmp}/out"], "does not exist"),
    (["--store", "{store}", "--csv", "{tmp}/out", "--kind", "gpu,nope"], "unknown frame kind 'nope'"),
    (["--store", "{store}", "--csv", "{tmp}/out", "--from", "yesterday"], "malformed time for --from"),
    (["--store", "{store}", "--csv", "{tmp}/out", "--from", str(T0 + 5), "--to", str(T0 + 1)], "must be before"),
    (["--store", "{store}", "--csv", "{tmp}/out", "--from", "1000", "--to", "2000"], "no data between"),
    (["--store", "{store}", "--csv", "{tmp}/out", "--parquet", "{tmp}/pq"], "give one output"),
    (["--store", "{store}"], "give one output"),
    (["--csv", "{tmp}/out"], "--store"),
    (["--store", "{store}", "--csv", "{tmp}/out", "--interval", "soon"], "malformed duration"),
    (["--store", "{store}", "--csv", "{store}"], "not a directory"),
], ids=["missing-store", "unknown-kind", "bad-time", "reversed-range", "range-off-the-data", "two-outputs",
        "no-output", "no-store", "bad-interval", "output-is-a-file"])
def test_bad_input_is_one_line_and_exit_2(cli, store_path, tmp_path, args, message):
    proc = cli("export", *(a.format(tmp=tmp_path, store=store_path) for a in args), timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_without_pyarrow_parquet_says_how_to_install_it_and_csv_still_works(store_path, tmp_path, monkeypatch,
                                                                            capsys):
    for name in ("pyarrow", "pyarrow.parquet"):
        monkeypatch.setitem(sys.modules, name, None)  # import pyarrow raises ImportError, as when not installed
    assert main(["export", "--store", store_path, "--parquet", str(tmp_path / "pq")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["gpudiag: error: --parquet needs pyarrow: pip install 'gpudiag[export]' "
                   "(or write CSV with --csv DIR)"]
    assert not (tmp_path / "pq").exists()
    assert main(["export", "--store", store_path, "--csv", str(tmp_path / "csv")]) == 0
    assert len(list((tmp_path / "csv").glob("*.csv"))) == 5


def test_progress_is_a_line_per_interval_on_stderr(store_path, tmp_path, capsys):
    assert main(["export", "--store", store_path, "--csv", str(tmp_path), "--interval", "2s", "--progress"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"exporting: interval 4/4, {sum(len(v) for v in expected().values())} rows"
    assert len(err) == 4


AGENT_CHILD = r"""
import json, sys, time
from gpudiag.agent.config import AgentConfig
from gpudiag.agent.daemon import Agent

path = sys.argv[1]
agent = Agent(AgentConfig().with_overrides({"store.path": path, "exporter.listen": "127.0.0.1:0"}),
              sim="healthy", speed=120.0, seed=0).start()
try:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        time.sleep(0.5)
        agent.flush()
        lo_hi = agent.store.time_range() if agent.store is not None else None
        if lo_hi and lo_hi[1] - lo_hi[0] >= 60:
            break
finally:
    agent.stop()
print(json.dumps({"pyarrow": sorted(m for m in sys.modules if m.split(".")[0] == "pyarrow"),
                  "span_s": lo_hi and lo_hi[1] - lo_hi[0]}))
"""


def test_the_agent_never_imports_pyarrow(tmp_path):
    pytest.importorskip("pyarrow", reason="without pyarrow installed an import of it could not be seen")
    p = subprocess.run([sys.executable, "-c", AGENT_CHILD, str(tmp_path / "s.db")], capture_output=True, text=True,
                       timeout=180)
    assert p.returncode == 0, p.stderr[-2000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["span_s"] and got["span_s"] >= 60, got  # the agent ran: probes, store, analyses
    assert got["pyarrow"] == [], got
