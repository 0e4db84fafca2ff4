"""The agent's columnar windows (Table, TableBuffer, Rows) give the analyzers what DataFrames give them."""

import json
import math

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpudiag.agent.daemon import _NOT_IN_WINDOW, SlidingWindow
from gpudiag.analyzers import common
from gpudiag.analyzers.common import dict_flag, dict_keys, dict_total, labelled_total, per_entity, subset
from gpudiag.analyzers.registry import ANALYZERS, run_all
from gpudiag.catalog import M
from gpudiag.frames import (
    BufferPool,
    DictColumn,
    Frame,
    FrameColumns,
    Rows,
    Table,
    TableBuffer,
    Window,
)
from gpudiag.frames.grouping import _GroupLayout, _unexported

GiB, MiB = 1024**3, 1024**2
NODE = "node-a"
N = 1500


def incident_frames(n: int = N) -> list[Frame]:
    """A node of three GPUs with one incident each, plus a healthy engine, as 1 s frames.

    GPU 0: an eviction storm with TPOT tripling; GPU 1: a driver-memory leak in a
    process without a reporter, and a co-tenant next to the engine; GPU 2: power
    capped at low clocks and hot, ECC errors and an XID coming up. Rows differ in
    their keys, carry None, ints and floats in one column, dicts and lists, so the
    columns are built the hard way.
    """
    rng = np.random.default_rng(7)
    frames = []
    evictions = [0, 0, 0]
    tokens = [0, 0, 0]
    for t in range(1, n + 1):
        storm = 600 <= t < 1100
        gpu_rows, proc_rows, eng_rows, req_rows, api_rows = [], [], [], [], []
        for g in range(3):
            hot = g == 2 and t > 300
            gpu_rows.append({
                "node": NODE, "gpu": g, "uuid": f"GPU-{g}",
                M.gpu_utilization_ratio: float(np.clip(0.7 + (0.25 if storm and g == 0 and t % 20 < 10 else 0)
                                                       + rng.normal(0, 0.03), 0, 1)),
                M.gpu_memory_total_bytes: 80 * GiB,
                M.gpu_memory_used_bytes: (60 + (t / 100 if g == 1 else 0)) * GiB,
                M.gpu_sm_clock_hertz: 1.2e9 if hot else 1.98e9, M.gpu_sm_clock_max_hertz: 1.98e9,
                M.gpu_temperature_celsius: 88 if hot else 60,
                M.gpu_clock_throttle_active: {"gpu_idle": 0, "sw_power_cap": int(hot), "hw_slowdown": 0},
                M.gpu_ecc_errors_total: {"volatile": {"corrected": (t // 5 if g == 2 else 0), "uncorrected": 0},
                                         "aggregate": {"corrected": 3, "uncorrected": 0}},
                M.gpu_xid_errors_total: ({"13": 1} if g == 2 and t > 900 else {}),
                M.gpu_nvlink_errors_total: {"crc_flit": 0, "replay": (t // 50 if g == 2 else 0)},
                M.gpu_pcie_replay_total: 0 if t % 7 else None,
            })
            for j in range(3):
                pid = 1000 + 10 * g + j
                row = {"node": NODE, "gpu": g, "uuid": f"GPU-{g}", "pid": pid,
                       "process": "engine" if j == 0 else f"worker-{j}",
                       M.process_cpu_utilization_ratio: round(float(rng.uniform(0.1, 0.5)), 2),
                       M.process_thread_cpu_max_ratio: 0.3,
                       M.process_context_switches_total: {"voluntary": 100 * t, "involuntary": t}}
                if j == 0:
                    row[M.process_torch_allocated_bytes] = 30 * GiB + int(rng.integers(0, 64)) * MiB
                    row[M.process_torch_reserved_bytes] = 34 * GiB
                    row[M.process_gpu_memory_bytes] = 35 * GiB
                elif g == 1 and j == 1:
                    row[M.process_gpu_memory_bytes] = 2 * GiB + 2 * MiB * t + float(rng.normal(0, MiB))
                elif g == 1 and j == 2:
                    row[M.process_gpu_memory_bytes] = 12 * GiB  # a co-tenant
                else:
                    row[M.process_gpu_memory_bytes] = 600 * MiB if t % 11 else None
                if j == 2 and t % 13 == 0:
                    row["top_threads"] = [{"name": "python3", "cpu_ratio": 0.4}]
                proc_rows.append(row)
            if storm and g == 0 and rng.random() < 0.3:
                evictions[g] += 1
            tokens[g] += 900
            eng_rows.append({"node": NODE, "gpu": g, "engine": "engine",
                             M.num_requests_running: 24, M.num_requests_waiting: 2,
                             M.engine_kv_evictions_total: evictions[g], M.prompt_tokens_total: tokens[g],
                             M.engine_recomputed_tokens_total: evictions[g] * 300,
                             M.engine_kv_capacity_bytes: (20 if g == 1 else 30) * GiB,
                             M.engine_kv_capacity_nominal_bytes: 30 * GiB,
                             M.kv_cache_usage_perc: 0.8})
            for _ in range(2):
                tpot = float(rng.lognormal(-3.4, 0.2)) * (3 if storm and g == 0 else 1)
                req_rows.append({"node": NODE, "gpu": g, "engine": "engine",
                                 M.time_to_first_token_seconds: float(rng.lognormal(-2.5, 0.3)),
                                 M.inter_token_latency_seconds: tpot,
                                 M.e2e_request_latency_seconds: 200 * tpot})
        api_rows.append({"node": NODE, "pid": 1000, M.cuda_kernel_launches_total: 1000 * t,
                         M.cuda_degenerate_launches_total: (100 * (t - 500) if t > 500 else 0)})
        frames += [Frame("gpu", float(t), gpu_rows), Frame("process", float(t), proc_rows),
                   Frame("engine", float(t), eng_rows), Frame("request", float(t), req_rows),
                   Frame("cuda_api", float(t), api_rows)]
    return frames


def findings_of(window: Window, old: bool = False) -> dict[str, list]:
    """Every analyzer's findings as plain documents (``old``: on DataFrames, as before the columns)."""
    def doc(f):
        return json.loads(json.dumps(f.to_dict(), default=str).replace("NaN", '"nan"'))
    saved = Window.rows
    if old:
        Window.rows = lambda self, kind: self.table(kind)
    try:
        return {kind: [doc(f) for f in analyze(window)] for kind, analyze in ANALYZERS.items()}
    finally:
        Window.rows = saved


def columnar_window(frames: list[Frame], chunk_s: int = 10) -> Window:
    """The frames the way the agent keeps them: 10 s chunks in TableBuffers (nothing dropped)."""
    win = SlidingWindow(10 * len(frames))
    for fr in frames:
        win.add([fr])
        if fr.kind == "cuda_api" and int(fr.t) % chunk_s == 0:
            win.window(NODE)
    return win.window(NODE)


@pytest.fixture(scope="module")
def frames():
    return incident_frames()


def test_every_analyzer_finds_the_same_on_the_agents_columns_as_on_dataframes(frames):
    dataframes = Window.from_frames(frames, node=NODE)
    before = findings_of(dataframes, old=True)
    found = {kind for kind, fs in before.items() if fs}
    # The incidents are there, so the comparison is not of empty lists.
    assert {"kv_eviction_storm", "memory_leak", "gpu_cotenant", "throttling", "hardware_errors",
            "degenerate_kernel_launch"} <= found
    assert findings_of(dataframes) == before  # Rows over the DataFrames
    assert findings_of(columnar_window(frames)) == before  # the agent's sliding columns


def test_a_sliding_window_of_columns_equals_the_same_rows_as_dataframes(frames):
    win = SlidingWindow(600)
    for fr in frames:
        win.add([fr])
        if fr.kind == "cuda_api" and int(fr.t) % 10 == 0:
            win.window(NODE)
    w = win.window(NODE)
    kept = [fr for fr in frames if fr.t > w.end_s - 600]
    want = Window.from_frames(kept, node=NODE)
    assert findings_of(w) == findings_of(want, old=True)
    for kind in ("gpu", "process", "engine", "request", "cuda_api"):
        got, exp = w.rows(kind), want.table(kind)
        assert len(got) == len(exp) and got["t"].min() == exp["t"].min()
        assert not set(got.columns) & set(_NOT_IN_WINDOW), kind
        for col in exp.columns:
            if col in _NOT_IN_WINDOW:
                continue
            a, b = got[col].tolist(), exp[col].tolist()
            assert [_norm(x) for x in a] == [_norm(x) for x in b], (kind, col)


def test_no_analyzer_names_a_column_the_agents_window_leaves_out():
    import pathlib
    import re

    from gpudiag import analyzers

    sources = {p.name: p.read_text() for p in pathlib.Path(analyzers.__path__[0]).glob("*.py")}
    for name in _NOT_IN_WINDOW:
        spelled = re.compile(rf"""(["']){re.escape(name)}\1|\bM\.{re.escape(name)}\b""")
        users = [f for f, text in sources.items() if spelled.search(text)]
        assert not users, f"{name} is left out of the agent's window but {users} read it"


def _norm(v):
    """None and NaN both read as missing (pandas' string columns hold NaN for None)."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "missing"
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return v


def test_columns_are_typed_as_pandas_types_them():
    rows = [{"i": 1, "f": 1.5, "mix": 1, "b": True, "s": "a", "gap": 2, "d": {"x": 1}, "l": [1]},
            {"i": 2, "f": None, "mix": 2.5, "b": False, "s": None, "d": None, "l": None},
            {"i": 3, "f": 3.0, "mix": None, "b": True, "s": "c", "gap": 4, "d": {"x": 2, "y": {"z": 3}}}]
    table = Table.from_frames([(float(k), [r]) for k, r in enumerate(rows)])
    df = pd.DataFrame.from_records([{"t": float(k), **r} for k, r in enumerate(rows)])
    for name in ("i", "f", "mix", "b", "gap"):
        assert table.columns[name].dtype == df[name].dtype, name
    assert table.columns["s"].dtype == object and table.frame()["s"].isna().tolist() == [False, True, False]
    assert table.frame()["d"].tolist()[0] == {"x": 1} and table.frame()["d"].tolist()[2] == {"x": 2, "y": {"z": 3}}
    assert table.frame()["l"].tolist()[0] == [1]


def test_rows_answer_the_dataframe_operations_the_analyzers_use(frames):
    df = Window.from_frames(frames, node=NODE).table("process")
    rows = Rows(Table.from_frames([(fr.t, fr.rows) for fr in frames if fr.kind == "process"]))
    col = M.process_gpu_memory_bytes
    assert rows[col].isna().sum() == df[col].isna().sum()
    assert rows[col].max() == df[col].max() and rows[col].min() == df[col].min()
    assert rows[col].sum() == pytest.approx(df[col].sum()) and rows[col].mean() == pytest.approx(df[col].mean())
    assert rows[col].dropna().iloc[-1] == df[col].dropna().iloc[-1]
    assert rows[col].fillna(0).sum() == pytest.approx(df[col].fillna(0).sum())
    hit = rows[rows["process"].astype(str).isin({"engine"})]
    assert len(hit) == len(df[df["process"].astype(str).isin({"engine"})])
    assert (rows["process"] == "worker-1").sum() == (df["process"] == "worker-1").sum()
    assert (rows["pid"] != 1000).sum() == (df["pid"] != 1000).sum()
    sel = rows[(rows["t"] >= 100) & (rows["t"] <= 200)]
    assert len(sel) == len(df[(df["t"] >= 100) & (df["t"] <= 200)])
    got = rows.groupby("pid")[col].max()
    pd.testing.assert_series_equal(got, df.groupby("pid")[col].max(), check_index_type=False)
    got = rows.groupby("t")[col].sum()
    pd.testing.assert_series_equal(got, df.groupby("t")[col].sum(), check_index_type=False)
    dedup = rows[["pid", "gpu"]].dropna(subset=["pid", "gpu"]).drop_duplicates()
    assert list(dedup.itertuples(index=False)) == list(df[["pid", "gpu"]].dropna().drop_duplicates()
                                                        .itertuples(index=False))
    for (key, sub), (dkey, dsub) in zip(per_entity(rows, ["gpu", "pid"]), per_entity(df, ["gpu", "pid"])):
        assert key == dkey and sub["t"].tolist() == dsub["t"].tolist()
    assert len(subset(rows, {"node": NODE, "gpu": 1})) == len(subset(df, {"node": NODE, "gpu": 1}))
    assert rows["top_threads"].dropna().iloc[0] == df["top_threads"].dropna().iloc[0]
    assert rows.frame().shape == df.shape  # anything else is answered by pandas itself


def test_dict_columns_read_per_leaf_give_the_totals_of_the_dicts(frames):
    gpu = [(fr.t, fr.rows) for fr in frames if fr.kind == "gpu"]
    rows, df = Rows(Table.from_frames(gpu)), Window.from_frames([fr for fr in frames if fr.kind == "gpu"]).table("gpu")
    for col in (M.gpu_ecc_errors_total, M.gpu_nvlink_errors_total, M.gpu_xid_errors_total):
        assert np.array_equal(labelled_total(rows[col]), labelled_total(df[col]), equal_nan=True), col
        assert dict_keys(rows[col]) == dict_keys(df[col])
    for args in (("volatile", "corrected"), ("aggregate", "uncorrected"), ("volatile", "missing")):
        assert np.array_equal(dict_total(rows[M.gpu_ecc_errors_total], *args),
                              dict_total(df[M.gpu_ecc_errors_total], *args), equal_nan=True)
    assert np.array_equal(dict_total(rows[M.gpu_xid_errors_total], "13", default=0.0),
                          dict_total(df[M.gpu_xid_errors_total], "13", default=0.0), equal_nan=True)
    assert np.array_equal(dict_flag(rows[M.gpu_clock_throttle_active], "sw_power_cap"),
                          dict_flag(df[M.gpu_clock_throttle_active], "sw_power_cap"))


def test_a_buffer_that_slides_keeps_the_types_a_fresh_join_of_its_chunks_has():
    def chunk(t0, rows):
        return Table.from_frames([(t0 + k, [r]) for k, r in enumerate(rows)])
    buf = TableBuffer()
    ints = chunk(0, [{"gpu": 0, "n": 1}, {"gpu": 1, "n": 2}])
    gap = chunk(10, [{"gpu": 0}, {"gpu": 1, "s": "x"}])  # "n" absent: float for a while; "s" appears
    later = chunk(20, [{"gpu": 0, "n": 3}, {"gpu": 1, "n": 4, "s": "y"}])
    for c in (ints, gap, later):
        buf.append(c)
    joined = Table.concat([ints, gap, later])
    assert buf.table().columns["n"].dtype == joined.columns["n"].dtype == np.float64
    buf.drop_until(15)  # the chunk without "n" has left: ints again, as a join of what is kept
    assert buf.table().columns["n"].dtype == chunk(20, [{"n": 3}]).columns["n"].dtype == np.int64
    assert [_norm(v) for v in buf.table().columns["s"].tolist()] == ["missing", "y"]
    groups = Rows(buf.table()).groups(("gpu",))
    assert [(k, sub["n"].tolist()) for k, sub in groups] == [((0,), [3]), ((1,), [4])]


def test_a_buffers_distinct_labels_are_the_ones_its_kept_rows_hold_as_it_slides_and_moves():
    # A window's distinct labels come from its chunks' codes, not the codes of all its rows; the
    # oldest chunk's codes were made before it lost rows (to the window's start, or to a move of
    # the buffer's arrays), so a name only its lost rows held must not be reported.
    rng = np.random.default_rng(11)
    buf = TableBuffer()
    t = 0
    cap = None
    for c in range(60):
        n = int(rng.integers(1, 400)) if c % 7 else 3000  # now and then a long chunk: the buffer moves
        names = [None if r % 13 == 5 else float("nan") if r % 17 == 3 else f"p{(t + r) // 500}-{r % 3}"
                 for r in range(n)]
        buf.append(Table(n, {"t": t + np.arange(n, dtype=np.float64), "process": np.array(names, dtype=object)}))
        t += n
        buf.drop_until(t - int(rng.integers(200, 2500)) + 0.5)  # cuts into a chunk most times
        cap = cap or buf.capacity
        table = buf.table()
        if c % 3 == 0:
            table.codes("process")  # the chunks' codes made now, before their rows are cut
        want = {v for v in table.columns["process"].tolist() if isinstance(v, str)}
        got = table.distinct("process")
        assert len(got) == len(set(got)) and set(got) == want, c
        got.append("changed by its reader")
        assert set(table.distinct("process")) == want  # asked again: kept, and not the reader's list
        assert set(Table(table.n, dict(table.columns)).distinct("process")) == want
        half = table.slice(table.n // 2, table.n)  # its codes cut from the table's, uniques and all
        assert set(half.distinct("process")) == {v for v in half.columns["process"].tolist() if isinstance(v, str)}
    assert buf.capacity > cap, "the buffer never moved its rows"


def test_a_buffer_that_moves_its_rows_never_holds_its_old_and_new_arrays_whole_at_once():
    """Each old column is let go as its new one takes its place: moving the rows to new arrays
    holds one old column beside the new ones at a time, not every old one (the agent's process
    buffer, 19 columns of 115,000 rows, held 18.6 MB more for the moment of a move)."""
    import tracemalloc

    columns, rows = 10, 100_000

    def chunk(t0, n):
        t = t0 + np.arange(n, dtype=np.float64)
        return Table(n, {"t": t, **{f"c{j}": np.full(n, float(j)) for j in range(columns)}})

    tracemalloc.start()  # before the old arrays are made: only what it saw made it sees freed
    try:
        buf = TableBuffer()
        buf.append(chunk(0, rows))
        cap = buf.capacity
        old_bytes = (columns + 1) * cap * 8
        buf.append(chunk(rows, cap - rows))  # full: the next append moves every row to new arrays
        nxt = chunk(cap, 1000)
        before = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        buf.append(nxt)
        peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    assert buf.capacity > cap, "the append did not move the rows"
    new_bytes = (columns + 1) * buf.capacity * 8
    # New arrays, plus the old ones not yet let go: at most one old column beside them.
    assert peak <= new_bytes - old_bytes + 2 * cap * 8 + 64 * 1024, (peak, new_bytes, old_bytes)
    assert buf.table().columns["c3"][-1] == 3.0 and len(buf) == cap + 1000


def test_entity_groups_kept_by_the_buffer_match_a_sort_of_the_window():
    rng = np.random.default_rng(3)
    buf = TableBuffer()
    kept = []
    for c in range(30):
        ticks = [(c * 10 + k, [{"gpu": int(g), "pid": int(p), "v": float(rng.random())}
                               for g, p in rng.integers(0, 4, size=(int(rng.integers(1, 6)), 2))])
                 for k in range(10)]
        buf.append(Table.from_frames(ticks))
        kept.append(ticks)
        if c >= 5:
            buf.drop_until((c - 5) * 10 + 4.5)
        table = buf.table()
        fresh = Table(table.n, dict(table.columns))
        got, want = table.groups(("gpu", "pid")), fresh.groups(("gpu", "pid"))
        assert got[0] == want[0]
        assert all(np.array_equal(a, b) for a, b in zip(got[1], want[1]))


def test_table_groups_are_pandas_groups_with_missing_labels_last():
    """Row positions per group, in the order groupby(sort=True, dropna=False) gives, for int, float and object keys."""
    rng = np.random.default_rng(5)
    n = 4000
    gpu = rng.integers(0, 4, n)  # never missing
    pid = rng.choice([101.0, 7.0, np.nan, 55.0], n)  # missing sorts last
    name = np.array(rng.choice(["b", "a", None], n), dtype=object)
    big = rng.integers(10**12, 10**12 + 3, n)  # a dense lookup far from zero
    table = Table(n, {"gpu": gpu, "pid": pid, "name": name, "big": big})
    df = pd.DataFrame({"gpu": gpu, "pid": pid, "name": name, "big": big})
    for keys in (("gpu",), ("pid",), ("name",), ("gpu", "pid"), ("pid", "name", "gpu"), ("big", "gpu")):
        got_keys, got_rows = table.groups(keys)
        want = df.groupby(list(keys), sort=True, dropna=False).indices
        want_keys = list(want)
        assert len(got_keys) == len(want_keys), keys
        for gk, wk, rows in zip(got_keys, want_keys, got_rows):
            wk = wk if isinstance(wk, tuple) else (wk,)
            assert all((isinstance(a, float) and math.isnan(a) and (b is None or b != b)) or a == b
                       or (a is None and b != b) for a, b in zip(gk, wk)), (keys, gk, wk)
            assert np.array_equal(rows, want[wk if len(keys) > 1 else wk[0]]), (keys, gk)


def test_the_fast_percentile_is_numpys_linear_percentile_to_the_last_bit():
    rng = np.random.default_rng(11)
    for trial in range(3000):
        n = int(rng.integers(1, 400))
        x = rng.lognormal(-3, 1, n) if trial % 2 else rng.integers(0, 4, n).astype(float)
        x[rng.random(n) < 0.1] = np.nan
        clean = x[~np.isnan(x)]
        qs = (0, 1, 50, 90, 99, 99.9, 100, float(rng.uniform(0, 100)))
        together = common.percentiles(x, qs)  # one partition for all of them
        for q, got_together in zip(qs, together):
            want = float(np.percentile(clean, q)) if clean.size else float("nan")
            for got in (common.percentile(x, q), got_together):
                assert got == want or (math.isnan(got) and math.isnan(want)), (n, q)


def test_the_tail_percentile_is_the_fast_percentile_to_the_last_bit():
    rng = np.random.default_rng(12)
    used_tail = 0
    for trial in range(3000):
        n = int(rng.integers(200, 9000))
        shape = trial % 6
        if shape == 0:
            x = rng.lognormal(-3, 1, n)  # request latencies
        elif shape == 1:
            x = rng.integers(0, 4, n).astype(float)  # ties, the bound among them
        elif shape == 2:
            x = np.sort(rng.normal(0, 1, n))  # sorted, with signed values
        elif shape == 3:
            x = rng.choice([0.0, -0.0, 1e-9, 5.0, np.inf, -np.inf], n)  # signed zeros and infinities
        elif shape == 4:
            x = rng.lognormal(-3, 1, n)
            x[rng.random(n) < 0.05] = np.nan  # missing values: left to the full percentile
        else:
            x = np.concatenate([np.zeros(n - 3), rng.lognormal(0, 1, 3)])  # a tail of three
        for q in (51, 90, 99, 99.9, float(rng.uniform(50.01, 99.99))):
            want, got = common.percentile(x, q), common.tail_percentile(x, q)
            assert got == want or (math.isnan(got) and math.isnan(want)), (trial, n, q)
            assert math.copysign(1, got) == math.copysign(1, want) or math.isnan(want), (trial, n, q)
            used_tail += n >= common.TAIL_MIN_VALUES and shape != 4
    assert used_tail > 8000  # the partition of the tail was taken, not only the fallback
    # A bound that leaves one value too few above it: n=1000, P99 needs the 11 largest; the strided
    # sample (every 7th) has six large values, its bound is their least, and four more lie between.
    x = np.linspace(0, 1, 1000)
    x[0:42:7] = 100 + np.arange(6)
    x[[1, 2, 3, 4]] = 200.0
    assert common.tail_percentile(x, 99) == common.percentile(x, 99)


def test_entities_read_from_the_group_ordered_copy_get_exactly_their_own_rows(monkeypatch):
    # Twelve entities with one row each per tick for 5000 ticks (evenly spaced: copied as slices,
    # block by block), then two that come and go (index arrays, cut at the block edges), with labels
    # of two kinds; every entity asks for every column, twice.
    monkeypatch.setattr(_GroupLayout, "BLOCK_ROWS", 1000)
    rng = np.random.default_rng(5)
    gpus, pids, ts, vs, names = [], [], [], [], []
    for tick in range(16000):  # the two that come and go: ~6000 rows each, copied block by block too
        present = range(12) if tick < 5000 else [e for e in (12, 13) if rng.random() < 0.6]
        for e in present:
            gpus.append(e % 3), pids.append(e), ts.append(float(tick)), names.append(f"p{e}" if e < 12 else None)
            vs.append(float(rng.random()) if e < 12 else float("nan"))
    table = Table(len(ts), {"t": np.array(ts), "gpu": np.array(gpus), "pid": np.array(pids),
                            "v": np.array(vs), "name": np.array(names, dtype=object)})
    plain = Table(table.n, dict(table.columns))
    entities = table.entity_rows(("gpu", "pid"))
    assert len(entities) == 14
    for _ in range(2):  # the second pass reads the copies the first one made
        for (key, rows), part in zip(entities, plain.groups(("gpu", "pid"))[1]):
            for name in ("t", "v", "name"):
                got = rows[name].to_numpy()
                assert np.array_equal(got, table.columns[name][part], equal_nan=name == "v"), (key, name)
                assert not got.flags.writeable
    layout = entities[0][1]._layout[0]
    assert len(layout.copies) == 3  # every column copied once in group order
    assert sum(step is not False for step in layout.steps) == 12
    assert len(layout.scattered) == 2 and layout.blocks > 1


def test_a_released_window_frees_its_copies_without_the_cycle_collector(frames):
    import gc
    import weakref

    win = columnar_window(frames)
    run_all(win)
    process = win.columns("process")
    copied = [weakref.ref(rows[M.process_gpu_memory_bytes].to_numpy())
              for _, rows in process.entity_rows(("node", "gpu", "pid"))]
    assert copied and all(ref() is not None for ref in copied)
    gc.disable()
    try:
        win.release()
        assert all(ref() is None for ref in copied)
        assert not process._entities and not process._groups and process._group_source is None
    finally:
        gc.enable()


def test_an_analysis_copies_into_the_memory_the_last_one_let_go_never_into_memory_still_held(frames):
    win = SlidingWindow(600)
    ends = iter(range(1000, 1041, 10))
    end = next(ends)

    def analysis():
        nonlocal end
        for fr in frames:
            if end - 10 < fr.t <= end:
                win.add([fr])
        end = next(ends, end)
        w = win.window(NODE)
        return w, findings_of(w)

    def backing(a):  # the pool's buffer an array (or a view of one) lives in, if any
        while isinstance(a, np.ndarray):
            a = a.base
        return a.obj if isinstance(a, memoryview) else None

    for fr in frames:
        if fr.t <= 990:
            win.add([fr])
    first, _ = analysis()
    pool = win._pool
    made = list(pool._taken)
    assert len(made) > 5 and all(isinstance(b, bytearray) for b in made)
    # An analysis (or a bug) that keeps a column past its window: that memory must never be reused.
    process = first.columns("process")
    held = process.entity_column(("node", "gpu", "pid"), "t")[0][:50]  # moves as the window slides
    assert any(backing(held) is b for b in made)
    seen = held.copy()
    first.release()
    del first, process

    second, found = analysis()
    kept = [fr for fr in frames if fr.t > second.end_s - 600 and fr.t <= second.end_s]
    assert found == findings_of(Window.from_frames(kept, node=NODE), old=True)
    assert np.array_equal(held, seen, equal_nan=True)  # not overwritten
    taken = pool._taken
    assert not any(backing(held) is b for b in taken)
    reused = [b for b in made if any(b is t for t in taken)]
    assert len(reused) == len(made) - 1  # every other buffer went round again
    second.release()
    del second
    analysis()[0].release()
    assert not any(backing(held) is b for b in pool._kept + pool._taken)  # left out twice: let go
    del held
    assert pool.nbytes <= 1.2 * sum(map(len, made))


def test_a_pool_buffer_counts_as_held_while_any_array_view_or_memoryview_of_it_lives():
    pool = BufferPool()
    a = pool.array(1000, np.float64)
    a[:] = 1.5
    buf = a.base.obj  # frombuffer: a memoryview of the pool's bytearray
    view = a[::3].reshape(-1, 1).T
    mv = memoryview(buf)
    del a
    for holder in ("view", "mv"):
        assert not _unexported(buf)
        if holder == "view":
            del view
        else:
            mv.release()
    assert _unexported(buf) and bytes(buf[:8]) == np.float64(1.5).tobytes()  # left as it was
    pool.settle()
    assert pool.array(1000, np.float64).base.obj is buf  # free: handed out again
    assert pool.array(1000, np.float64).base.obj is not buf  # taken this time
    assert pool.array(10, object).dtype == object  # object arrays never share memory


@pytest.mark.parametrize("shape", ["steady", "jittered", "gap", "random", "repeated"])
def test_trailing_window_starts_are_the_exact_sorted_search(shape):
    rng = np.random.default_rng(len(shape))
    n = 20_000
    t = np.arange(n, dtype=float) + 1.7e9
    if shape == "jittered":
        t = np.sort(t + rng.normal(0, 0.05, n))
    elif shape == "gap":
        t[n // 3:] += 5000.0
    elif shape == "random":
        t = np.sort(rng.random(n) * n)
    elif shape == "repeated":
        t = np.repeat(t[: n // 2], 2)
    for w in (0.0, 0.5, 1.0, 30.0, 60.0, 300.0, float(t[-1] - t[0]), 1e9, -1.0):
        assert np.array_equal(common.trailing_start(t, w), np.searchsorted(t, t - w, side="left")), w


@pytest.mark.parametrize("as_matrix", [False, True])
def test_a_group_copy_reaches_the_last_piece_of_every_slice_whatever_order_the_groups_come_in(monkeypatch,
                                                                                             as_matrix):
    # Eleven entities every tick and one slot that either of two others takes: 12 rows a tick, so
    # the eleven are slices of step 12, and 83 of their rows fill a 1000-row block, not 83.3: the
    # slices need one block more than the table's rows, and the two uneven groups sort before some.
    # As a matrix, the eleven slices are columns of (ticks x 12) rows; with the shared slot first in
    # each tick they start at row 1, so the matrix's last row ends past the column's.
    monkeypatch.setattr(_GroupLayout, "BLOCK_ROWS", 1000)
    if not as_matrix:
        monkeypatch.setattr(_GroupLayout, "_matrices", lambda self, even: ([], set()))
    rng = np.random.default_rng(7)
    gpus, pids, vs = [], [], []
    for _ in range(10_000):
        slot = [11 + int(rng.integers(0, 2))]
        for e in (slot + list(range(11)) if as_matrix else list(range(11)) + slot):
            gpus.append(0 if e >= 11 else 1 + e % 2), pids.append(e), vs.append(float(rng.random()))
    table = Table(len(vs), {"t": np.repeat(np.arange(10_000.0), 12), "gpu": np.array(gpus), "pid": np.array(pids),
                            "v": np.array(vs)})
    plain = Table(table.n, dict(table.columns))
    entities = table.entity_rows(("gpu", "pid"))
    for (key, rows), part in zip(entities, plain.groups(("gpu", "pid"))[1]):
        assert np.array_equal(rows["v"].to_numpy(), table.columns["v"][part]), key
    layout = entities[0][1]._layout[0]
    if as_matrix:
        assert len(layout.scattered) == 2 and not layout.strided
        assert [len(picks) for *_, picks in layout.matrices] == [11]
        assert any(base + stride * n > table.n for _, base, stride, n, _ in layout.matrices)
    else:
        assert len(layout.scattered) == 2 and len(layout.strided) == 11
        assert layout.blocks > -(-table.n // 1000)


@pytest.mark.parametrize("tick_order", ["sorted", "reversed"])
def test_a_matrix_of_every_entity_each_tick_is_transposed_block_by_block_into_its_groups(monkeypatch, tick_order):
    # Nine entities, each once a tick for 1000 ticks: one (1000 x 9) matrix. Rows of a tick in the
    # groups' own order are transposed as they are; in reverse order they are picked first. 50
    # values a block: 5 ticks, so 200 blocks, the last one full; 1000 ticks of 9 end mid-block too.
    monkeypatch.setattr(_GroupLayout, "TRANSPOSE_VALUES", 50)
    rng = np.random.default_rng(11)
    order = list(range(9)) if tick_order == "sorted" else list(range(8, -1, -1))
    for ticks in (1000, 1003):
        gpus, pids, vs = [], [], []
        for _ in range(ticks):
            for e in order:
                gpus.append(e // 3), pids.append(e), vs.append(float(rng.random()))
        table = Table(len(vs), {"t": np.repeat(np.arange(float(ticks)), 9), "gpu": np.array(gpus),
                                "pid": np.array(pids), "v": np.array(vs)})
        plain = Table(table.n, dict(table.columns))
        entities = table.entity_rows(("gpu", "pid"))
        got, starts = table.entity_column(("gpu", "pid"), "v")
        for g, ((key, rows), part) in enumerate(zip(entities, plain.groups(("gpu", "pid"))[1])):
            assert np.array_equal(got[starts[g]:starts[g + 1]], table.columns["v"][part]), key
            assert np.array_equal(rows["v"].to_numpy(), table.columns["v"][part]), key
        layout = entities[0][1]._layout[0]
        assert [len(picks) for *_, picks in layout.matrices] == [9]


_CHUNK_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-5, 5), st.integers(2**63, 2**70), st.floats(allow_nan=True),
    st.sampled_from(["a", "b", ""]), st.dictionaries(st.sampled_from("xy"), st.integers(0, 3), max_size=2),
    st.just({"x": {"y": 1.5}}), st.just([1, 2]))
_CHUNK_ROW = st.dictionaries(st.sampled_from(["pid", "k0", "k1", "k2"]), _CHUNK_VALUES, max_size=4)


def _same_column(a, b) -> bool:
    if isinstance(a, DictColumn) or isinstance(b, DictColumn):
        return isinstance(a, DictColumn) and isinstance(b, DictColumn) \
            and [_norm_exact(x) for x in a.to_objects().tolist()] == [_norm_exact(x) for x in b.to_objects().tolist()]
    if a.dtype != b.dtype:
        return False
    if a.dtype != object:
        return np.array_equal(a, b, equal_nan=a.dtype.kind == "f")
    return [_norm_exact(x) for x in a.tolist()] == [_norm_exact(x) for x in b.tolist()]


def _norm_exact(v):
    """A value with its type, NaN as one value (NaN != NaN)."""
    return ("nan",) if isinstance(v, float) and math.isnan(v) else (type(v), repr(v))


@settings(max_examples=400, deadline=None)
@given(st.lists(st.lists(_CHUNK_ROW, max_size=4), min_size=1, max_size=4))
def test_a_table_of_frames_made_columns_once_is_the_table_of_their_rows(ticks):
    # The agent makes each frame's rows columns once (FrameColumns) for the store and the window; the
    # window's table of them must be the one Table.from_frames makes of the rows themselves.
    ticks = [(100.0 + k, rows) for k, rows in enumerate(ticks)]
    chunks = [FrameColumns.of("process", [Frame("process", t, rows)]) for t, rows in ticks if rows]
    want = Table.from_frames(ticks)
    got = Table.from_columns(chunks)
    assert got.n == want.n and set(got.columns) == set(want.columns)
    for name, col in want.columns.items():
        if (isinstance(col, DictColumn) or col.dtype == object) and any(
                FrameColumns.of("process", [Frame("process", t, rows)]).columns[name].dtype.kind == "f"
                and any(name in r and type(r[name]) is not float for r in rows)
                for t, rows in ticks if any(name in r for r in rows)):
            continue  # the one difference, by design: a frame's numbers with gaps, as floats, among other values
        assert _same_column(got.columns[name], col), name
    for c in chunks:
        assert not any(a.flags.writeable for a in c.columns.values())  # the store and the window share them


def test_a_rows_own_time_counts_in_a_table_of_columns_as_in_the_store():
    rows = [{"gpu": 0, "t": 99.5}, {"gpu": 1}]
    table = Table.from_columns([FrameColumns.of("gpu", [Frame("gpu", 100.0, rows)])])
    assert table.columns["t"].tolist() == [99.5, 100.0]
