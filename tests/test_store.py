"""The timeline store: frames and findings survive, in order, through crashes and full disks."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import sqlite3
import struct
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from test_store_window import as_zlib_block

from gpudiag.agent.store import SCHEMA_VERSION, SIZE_RETENTION_TARGET_RATIO, Store, decode_block, encode_block
from gpudiag.catalog import M
from gpudiag.errors import GpudiagError
from gpudiag.findings import Evidence, Finding, Severity
from gpudiag.frames import Frame, FrameColumns, Window, column_array

MIB = 1024**2
T0 = 1_767_225_600.0  # a multiple of every chunk span used below


def _columns_of(frames):
    """(rows, columns) of frames of one kind, as the store takes them (FrameColumns.of)."""
    c = FrameColumns.of(frames[0].kind, frames)
    return c.n, dict(c.columns)


def node_frames(tick: int, *, gpus: int = 2, processes: int = 3, t0: float = T0, seed: int = 0) -> list[Frame]:
    """One second of a small node: NVML-like GPU rows, three-colour process rows, an engine row."""
    rng = np.random.default_rng(seed * 1_000_003 + tick)
    t = t0 + tick + float(rng.uniform(0, 0.003))
    gpu_rows, proc_rows, engine_rows = [], [], []
    for g in range(gpus):
        labels = {"node": "node-a", "gpu": g, "uuid": f"GPU-{g:08x}-aaaa-bbbb-cccc-{g:012x}"}
        util = int(rng.integers(20, 100))
        gpu_rows.append({
            **labels,
            M.gpu_utilization_ratio: util / 100,
            M.gpu_memory_used_bytes: (60_000 + int(rng.integers(0, 50))) * MIB,
            M.gpu_memory_total_bytes: 81_559 * MIB,
            M.gpu_sm_clock_hertz: 1980e6,
            M.gpu_power_watts: int(rng.integers(150_000, 650_000)) / 1000,
            M.gpu_temperature_celsius: int(rng.integers(40, 80)),
            M.gpu_clock_throttle_active: {"sw_power_cap": int(util > 90), "hw_slowdown": 0},
            M.gpu_ecc_errors_total: {"volatile": {"corrected": tick // 100, "uncorrected": 0}},
        })
        for j in range(processes):
            allocated = 30 * 1024 * MIB + int(rng.integers(0, 1 << 20)) * 512
            row = {**labels, "pid": 4000 + g * 10 + j, "process": "python3" if j == 0 else f"worker{j}",
                   M.process_gpu_memory_bytes: 40 * 1024 * MIB + j * MIB,
                   M.process_cpu_utilization_ratio: round(float(rng.uniform(0, 100)), 1) / 100,
                   M.process_context_switches_total: {"voluntary": tick * 300 + j, "involuntary": tick}}
            if j == 0:  # only the instrumented process reports the allocator
                row[M.process_torch_allocated_bytes] = allocated
                row[M.process_torch_reserved_bytes] = 36 * 1024 * MIB
            proc_rows.append(row)
        engine_rows.append({"node": "node-a", "gpu": g, "engine": "vllm",
                            M.num_requests_running: int(rng.integers(0, 64)),
                            M.kv_cache_usage_perc: float(rng.uniform(0, 1)),
                            M.engine_kv_evictions_total: tick // 7})
    return [Frame("gpu", t, gpu_rows), Frame("process", t, proc_rows), Frame("engine", t, engine_rows)]


def assert_same_tables(expected: Window, got: Window) -> None:
    """The store gives back the rows it was given: same columns, values and dtypes (absent == None)."""
    assert set(got.tables) == set(expected.tables)
    for kind, want in expected.tables.items():
        have = got.table(kind)
        assert list(have.columns) == list(want.columns), kind
        pd.testing.assert_frame_equal(have.reset_index(drop=True), want.reset_index(drop=True), obj=kind)


def fresh_and_sealed(path: str) -> dict[str, tuple[int, int]]:
    conn = sqlite3.connect(path)
    try:
        return {k: conn.execute(f"SELECT count(*) - sum(sealed), sum(sealed) FROM frames_{k}").fetchone()
                for k in ("gpu", "process", "engine")}
    finally:
        conn.close()


# --- layout and reading back ----------------------------------------------------------


def test_a_new_store_runs_in_wal_mode_at_the_current_schema(tmp_path):
    path = str(tmp_path / "node.db")
    with Store.open(path) as store:
        meta = store.meta()
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    conn.close()
    assert meta["schema_version"] == SCHEMA_VERSION
    assert [m["name"] for m in meta["migrations"]] == ["initial", "findings_entity", "zstd_chunks", "zigzag_ints",
                                                   "reference_ints", "dictionary_fields", "ttft_of_parts"]


def test_frames_read_back_exactly_as_appended_before_and_after_sealing(tmp_path):
    path = str(tmp_path / "node.db")
    frames = []
    with Store.open(path, chunk_s=60) as store:
        for tick in range(150):
            fr = node_frames(tick)
            frames += fr
            store.append(fr)
            store.flush()
        # Two intervals are sealed, the third is still fresh chunks: both read back the same.
        fresh, sealed = fresh_and_sealed(path)["gpu"]
        assert sealed == 2 and fresh > 1
        assert_same_tables(Window.from_frames(frames), store.window(-math.inf, math.inf))
    with Store.open(path, readonly=True) as reader:
        got = reader.window(-math.inf, math.inf)
    assert_same_tables(Window.from_frames(frames), got)
    assert got.node == "node-a"


def test_a_window_is_the_node_its_rows_name_though_its_chunks_also_hold_another_nodes(tmp_path):
    # Node a wrote the first minute of the interval, node b the second; closing seals both into
    # one chunk. A window over the second minute reads that chunk's labels, but only node b's rows.
    path = str(tmp_path / "handover.db")
    with Store.open(path, chunk_s=300) as store:
        for s in range(120):
            store.append([Frame("gpu", T0 + s, [{"node": "a" if s < 60 else "b", "gpu": 0,
                                                  M.gpu_utilization_ratio: 0.5}])])
            store.flush()
    assert fresh_and_sealed(path)["gpu"] == (0, 1)
    with Store.open(path, readonly=True) as reader:
        assert reader.window(T0 + 90, T0 + 119).node == "b"
        assert reader.window(T0, T0 + 119).node is None  # both nodes: the window names neither


def test_a_seal_keeps_every_value_and_type_of_fresh_chunks_that_differ_in_their_columns(tmp_path):
    # Fresh chunks are flattened and their labels shared one by one before they are joined.
    def row(tick: int) -> dict:
        r = {"pid": tick % 3, "process": ["python3", "1", "vllm"][tick % 3], "mixed": [1, True, 1.0, "1"][tick % 4],
             "reasons": [{"a": "no reporter"}, {"a": "no reporter", "b": "1"}, {"x": 1}, {"x": True}, {"x": 1.0},
                         {"x": -0.0}, {"x": 0.0}][tick % 7]}
        if tick % 5:  # some chunks lack the counters, some rows hold None, one holds a string
            r[M.process_context_switches_total] = (None if tick % 7 == 0 else {"voluntary": tick, "x": "y"}
                                                   if tick == 11 else {"voluntary": tick, "involuntary": 2 * tick})
        return r

    path = str(tmp_path / "node.db")
    want = [row(tick) for tick in range(40)]
    with Store.open(path, chunk_s=60) as store:
        for tick, r in enumerate(want):
            store.append([Frame("process", T0 + tick, [dict(r)])])
            store.flush()
        store.append([Frame("process", T0 + 61, [row(61)])])
        store.flush()  # the first minute is sealed
    conn = sqlite3.connect(path)
    (data,) = conn.execute("SELECT data FROM frames_process WHERE sealed = 1").fetchone()
    conn.close()
    n, got = decode_block(data)
    assert n == len(want)
    for name in ("pid", "process", "mixed", "reasons", M.process_context_switches_total):
        have = got[name].tolist()
        expected = [r.get(name) for r in want]
        assert have == expected, name
        assert [type(v) for v in have] == [type(v) for v in expected], name
    reasons = [d["x"] for d in got["reasons"].tolist() if "x" in d]
    assert [(type(x), math.copysign(1, x)) for x in reasons] == \
        [(type(r["reasons"]["x"]), math.copysign(1, r["reasons"]["x"])) for r in want if "x" in r["reasons"]]


class _NoTwins(dict):
    """A store's twins that are never kept: every seal decodes the fresh chunks it merges."""

    def setdefault(self, key, default=None):
        return {}


def _varied_frames(tick: int) -> list[Frame]:
    shared = {M.process_torch_allocated_bytes: "no in-process reporter", "b": "grey layer missing"}
    rows = []
    for j in range(6):
        rows.append({
            "node": "node-a", "gpu": j % 2, "pid": 100 + j, "process": ["python3", "vllm", "1"][j % 3],
            "missing_reasons": shared if j % 3 else {"a": f"{tick} of 3 samples"},
            M.process_context_switches_total: {"voluntary": tick * j, "involuntary": j},
            "odd": [None, (1, 2), {1: "int key"}, np.int64(7), float("nan"), "x", True, 2**70][(tick + j) % 8],
            "labels": {"nested": {"a": 1.5, "b": 2}} if j else None,
            "by_xid": {79: tick, 48: 0},  # numbers under int keys: JSON makes the keys strings
            "np_leaf": {"a": np.int64(tick)},  # a numpy integer: JSON (default=str) makes it a string
            M.process_torch_allocated_bytes: None if j % 2 else 2**40 + tick,
            M.process_cpu_utilization_ratio: (tick * 7 + j) % 100 / 100,
        })
    requests = [{"node": "node-a", "gpu": 0, "request_id": f"req-{tick}-{k}",
                 M.time_to_first_token_seconds: 0.1234567891 + tick / 1e7 + k,
                 M.e2e_request_latency_seconds: 1.000000049 * (k + 1)} for k in range(tick % 3)]
    frames = [Frame("process", T0 + tick, rows)]
    if requests:
        frames.append(Frame("request", T0 + tick + 0.5, requests))
    return frames


def _write_varied(store: Store, ticks: range) -> None:
    for tick in ticks:
        store.append(_varied_frames(tick))
        store.flush()


def test_a_seal_from_the_flushes_kept_columns_writes_the_very_blocks_a_seal_from_the_stored_chunks_does(tmp_path):
    # A seal takes each fresh chunk's twin (what decoding it gives back) from the flush that wrote it
    # instead of reading the chunk back: the sealed blocks must not differ by a byte, whatever the values.
    def sealed_blocks(path: str, keep: bool) -> dict:
        with Store.open(path, chunk_s=30) as store:
            if not keep:
                store._twins = _NoTwins()
            _write_varied(store, range(75))
            kept = {k: len(v) for k, v in store._twins.items()}
        conn = sqlite3.connect(path)
        out = {t: conn.execute(f"SELECT t_start, data FROM {t} WHERE sealed = 1 ORDER BY t_start").fetchall()
               for t in ("frames_process", "frames_request")}
        conn.close()
        return out, kept

    with_twins, kept = sealed_blocks(str(tmp_path / "a.db"), keep=True)
    decoded, _ = sealed_blocks(str(tmp_path / "b.db"), keep=False)
    assert [len(v) for v in with_twins.values()] == [3, 3]  # two whole intervals, then the last one at close
    assert with_twins == decoded
    # Before the close, only the open interval's chunks still had twins: the sealed ones' went with them.
    assert kept == {"process": 15, "request": 10}


def test_the_twins_kept_for_a_seal_hold_no_number_columns_values(tmp_path):
    # A busy node's fresh numbers, held as small arrays until the seal, were ~10 MB at the end of
    # each interval, in heap pages the seal's frees left pinned. The twins now leave them in the
    # blocks: a minute of 128 processes x 12 number columns (1.5 MB of values) must cost the twins
    # well under half of that (the string columns and the references stay), and the seal must still
    # give back every value.
    import gc
    import tracemalloc

    numbers = [M.process_cpu_utilization_ratio, M.process_gpu_memory_bytes, M.process_resident_memory_bytes,
               M.process_torch_allocated_bytes, M.process_torch_reserved_bytes, M.process_torch_active_bytes,
               M.process_torch_inactive_split_bytes, M.process_torch_requested_bytes,
               M.process_torch_largest_free_block_bytes, M.process_torch_segments]

    def second(tick: int) -> Frame:
        return Frame("process", T0 + tick, [
            {"node": "node-a", "gpu": j // 16, "pid": 1000 + j, "process": "python3",
             **{name: (tick * 128 + j) * 1.5 + k for k, name in enumerate(numbers)}} for j in range(128)])

    path = str(tmp_path / "node.db")
    with Store.open(path, chunk_s=120) as store:
        store.append([second(0)])
        store.flush()
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for tick in range(1, 61):
                store.append([second(tick)])
                store.flush()
            gc.collect()
            held = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        assert sum(len(v) for v in store._twins.values()) == 61  # no seal yet: every second's twin is kept
        values = 60 * 128 * (len(numbers) + 2) * 8  # the numbers, gpu and pid
        assert held < values / 2, (held, values)
    table = Store.open(path, readonly=True).window(T0, T0 + 61).table("process")
    assert len(table) == 61 * 128
    got = table[M.process_torch_segments].to_numpy()
    want = np.array([(tick * 128 + j) * 1.5 + len(numbers) - 1 for tick in range(61) for j in range(128)])
    assert np.array_equal(np.sort(got), np.sort(want))
    assert sorted(set(table["pid"].tolist())) == list(range(1000, 1128))


def test_a_fresh_chunk_damaged_on_disk_is_kept_as_it_is_and_the_rest_of_its_interval_is_sealed(tmp_path, caplog):
    # The seal reads the number columns of every fresh chunk back from the file. A chunk damaged
    # there (a torn write, a disk error) must neither stop the seal, again every second, nor be
    # deleted: its interval is sealed without it, it stays as it was, logged and counted once.
    from gpudiag.agent.store import codecs as store_codecs

    path = str(tmp_path / "node.db")
    with Store.open(path, chunk_s=30) as store:
        _write_varied(store, range(10))
        conn = sqlite3.connect(path)
        rowid, data = conn.execute("SELECT rowid, data FROM frames_process WHERE t_start = ?", (T0 + 5,)).fetchone()
        header, frames = store_codecs._zstd_frames(data)
        names = [m["name"] for m in header["columns"]]
        at, _ = frames[len(frames) - len(names) + names.index(M.process_cpu_utilization_ratio)]
        broken = data[:at] + b"\0\0\0\0" + data[at + 4:]  # that number column's frame is no zstd frame
        conn.execute("UPDATE frames_process SET data = ? WHERE rowid = ?", (broken, rowid))
        conn.commit()
        with caplog.at_level("WARNING", logger="gpudiag.agent.store"):
            _write_varied(store, range(10, 75))  # seals [0, 30) and [30, 60)
        assert store.health()["store_errors_total"] == {"damaged": 1}
    damaged = [r for r in caplog.records if "damaged" in r.getMessage()]
    assert len(damaged) == 1 and f"fresh chunk {rowid} of frames_process" in damaged[0].getMessage()
    rows = conn.execute("SELECT rowid, t_start, n_rows, sealed, data FROM frames_process ORDER BY t_start").fetchall()
    conn.close()
    assert [(r[1] - T0, r[2], r[3]) for r in rows] == [(0, 29 * 6, 1), (5, 6, 1), (30, 180, 1), (60, 90, 1)]
    assert rows[1][0] == rowid and rows[1][4] == broken  # kept byte for byte
    _, first = decode_block(rows[0][4])
    assert sorted(set(first["t"].tolist())) == [T0 + k for k in range(30) if k != 5]
    assert first["pid"].tolist().count(100) == 29
    with pytest.raises(GpudiagError, match="damaged chunk"):
        Store.open(path, readonly=True).window(T0, T0 + 29.9).table("process")
    assert len(Store.open(path, readonly=True).window(T0 + 30, T0 + 59.9).table("process")) == 180


def test_a_flush_that_fails_keeps_no_twins_and_its_chunks_are_sealed_from_the_store(tmp_path):
    path = str(tmp_path / "node.db")
    with Store.open(path, chunk_s=30) as store:
        _write_varied(store, range(10))
        os.chmod(path, 0o444)
        conn = store._conn
        store._conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)  # the disk turned read-only
        for tick in range(10, 20):
            store.append(_varied_frames(tick))
            assert store.flush() == 0
        assert all(c.twin is None for c in store._backlog)
        store._conn.close()
        store._conn = conn
        os.chmod(path, 0o644)
        _write_varied(store, range(20, 40))
        assert store.window(T0, T0 + 29.9).table("process")["pid"].tolist() == [100 + j for j in range(6)] * 30


def test_a_fresh_chunk_decodes_equal_dicts_of_strings_as_one_object():

    why = {M.process_torch_allocated_bytes: "no in-process reporter", M.process_torch_reserved_bytes: "no reporter"}
    frames = [Frame("process", T0 + i, [{"pid": j, "missing_reasons": dict(why)} for j in range(50)]) for i in range(4)]
    n, columns = _columns_of(frames)
    got = decode_block(encode_block(columns, n, sealed=False))[1]["missing_reasons"].tolist()
    assert got == [why] * 200
    assert len({id(d) for d in got}) == 1  # 200 rows, one dict: a seal of a busy node holds ~40 000 of them


def _fresh_and_anew(encoded: list, columns: dict, n: int, repeats: dict):
    """A fresh block and twin with ``repeats``, the same encoded anew, and what the first encoded
    itself (``encoded``: what the test's spies on the encoder appended)."""
    from gpudiag.agent.store import encode_fresh

    encoded.clear()
    block, twin = encode_fresh(columns, n, repeats)
    anew = list(encoded)
    return (block, twin, *encode_fresh(columns, n), anew)


def test_a_string_column_repeated_from_the_last_fresh_block_is_written_byte_for_byte_as_anew(monkeypatch):
    # A node's names and uuids are the same every second: a fresh block takes a string column equal to
    # the kind's last one from it instead of writing its JSON again. The blocks and their twins must be
    # what encoding each anew gives, whatever the columns turn into from one second to the next.
    from gpudiag.agent.store import blocks as store_blocks

    class Name(str):
        pass

    names = ["python3", "worker", None, "python3"]
    seconds = [
        names,
        list(names),  # equal, another list
        [Name(v) if v else v for v in names],  # str subclasses: the same JSON
        ["python3", "worker", "late", "python3"],  # a value changes
        ["python3", "worker", float("nan"), "python3"],  # NaN where a string was: numbers are not strings
        ["python3", "worker", "late", "python3"],
        ["python3", "worker", 7, "python3"],  # an int among strings
        ["python3", "worker", 7.0, "python3"],  # equal to the int, but JSON writes it otherwise
        ["python3", "worker", "late", "python3"],
        ["python3", "worker", "late", "python3"],
        ["python3", "worker", "late"],  # a row fewer
        ["python3", "worker", "late"],
    ]
    encoded: list[str] = []
    real = store_blocks._encode_column
    monkeypatch.setattr(store_blocks, "_encode_column",
                        lambda a, **kw: encoded.append(a.tolist()) or real(a, **kw))
    repeats: dict = {}
    for i, values in enumerate(seconds):
        rows = [{"pid": j, "process": v, "uuid": "GPU-1"} for j, v in enumerate(values)]
        n, columns = _columns_of([Frame("process", T0 + i, rows)])
        block, twin, want_block, want_twin, anew = _fresh_and_anew(encoded, columns, n, repeats)
        assert block == want_block, i
        assert decode_block(block)[1]["process"].tolist() == decode_block(want_block)[1]["process"].tolist()
        assert twin["process"].tolist() == want_twin["process"].tolist()
        assert twin.keys() == want_twin.keys()
        # Written anew only when it differs from the second before (or that one was not all strings).
        fresh = i == 0 or not (values == seconds[i - 1] and set(map(type, seconds[i - 1])) <= {str, Name, type(None)})
        assert (values in anew) == fresh, (i, anew)
        assert (["GPU-1"] * len(values) in anew) == (i == 0 or len(values) != len(seconds[i - 1])), i


def test_a_column_whose_comparison_or_repr_fails_is_encoded_anew():
    from gpudiag.agent.store import encode_fresh
    from gpudiag.agent.store.blocks import _repeated

    class Hostile:
        def __eq__(self, other):
            raise RuntimeError("no comparing me")

        def __repr__(self):
            raise RuntimeError("no printing me")

        def __str__(self):
            return "hostile"

    entry = ("strings", ["a", "b"], {"codec": "jsonlist"}, b"frame")
    values = ["a", Hostile()]
    assert _repeated(entry, values, np.array(values, dtype=object)) is None
    same = ["a", "b"]
    assert _repeated(entry, same, np.array(same, dtype=object)) == ({"codec": "jsonlist"}, b"frame", None)
    assert _repeated(None, ["a", "b"], np.array(["a", "b"], dtype=object)) is None
    # A column of such values in a block: written (as text) every second, never compared by its repr.
    repeats: dict = {}
    for k in range(2):
        n, columns = _columns_of([Frame("gpu", T0 + k, [{"gpu": 0, "odd": [Hostile()]}])])
        block, _ = encode_fresh(columns, n, repeats)
        assert decode_block(block)[1]["odd"].tolist() == [["hostile"]]


def test_a_time_range_window_holds_exactly_the_rows_inside_it(tmp_path):
    path = str(tmp_path / "node.db")
    with Store.open(path, chunk_s=30) as store:
        for tick in range(200):
            store.append(node_frames(tick))
            store.flush()
        first, last = store.time_range()
    assert first == pytest.approx(T0, abs=0.01) and last == pytest.approx(T0 + 199, abs=0.01)
    with Store.open(path, readonly=True) as reader:
        w = reader.window(T0 + 50, T0 + 120.5, kinds=["gpu", "engine"])
    assert set(w.tables) == {"gpu", "engine"}
    ticks = sorted({int(t - T0) for t in w.table("gpu")["t"]})
    assert ticks == list(range(50, 121))
    assert (w.table("gpu")["t"].diff().dropna() >= 0).all()
    assert len(w.table("gpu")) == 2 * len(ticks)


def test_writes_are_batched_one_transaction_and_one_chunk_per_kind_per_flush(tmp_path):
    path = str(tmp_path / "node.db")
    writer = Store.open(path)
    reader = Store.open(path, readonly=True)
    for tick in range(5):
        writer.append(node_frames(tick))
    assert reader.window(-math.inf, math.inf).tables == {}  # appended is not written
    assert writer.flush() == 5 * (2 + 6 + 2)
    assert fresh_and_sealed(path)["process"] == (1, 0)  # five ticks, one chunk
    assert len(reader.window(-math.inf, math.inf).table("process")) == 5 * 6
    assert writer.flush() == 0  # nothing new, nothing written
    reader.close()
    writer.close()


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_every_column_codec_is_lossless(data):
    n = data.draw(st.integers(1, 40))
    finite = st.floats(allow_nan=False, allow_infinity=True, width=64)
    columns_of = {
        "ints": st.lists(st.integers(-2**63, 2**63 - 1), min_size=n, max_size=n),  # steps that wrap in int64
        "floats": st.lists(st.one_of(finite, st.just(math.nan), st.just(-0.0)), min_size=n, max_size=n),
        "decimals": st.lists(st.integers(0, 10_000).map(lambda k: k / 100), min_size=n, max_size=n),
        "labels": st.lists(st.one_of(st.none(), st.sampled_from(["python3", "vllm", "ü-worker", ""])),
                           min_size=n, max_size=n),
        "flags": st.lists(st.booleans(), min_size=n, max_size=n),
        "counters": st.lists(st.one_of(st.none(), st.fixed_dictionaries(
            {"voluntary": st.integers(0, 2**40)}, optional={"involuntary": st.integers(0, 9),
                                                           "nested": st.fixed_dictionaries({"x": finite}),
                                                           "odd": st.one_of(st.booleans(), st.none(), st.integers(),
                                                                            finite)})),
            min_size=n, max_size=n),
        "anything": st.lists(st.one_of(st.none(), st.text(max_size=4), st.lists(st.integers(), max_size=2)),
                             min_size=n, max_size=n),
    }
    values = {name: data.draw(strategy) for name, strategy in columns_of.items()}
    frames = [Frame("process", float(i), [{"pid": i % 3, **{k: v[i] for k, v in values.items()}}]) for i in range(n)]

    rows, columns = _columns_of(frames)
    for sealed in (False, True):
        got_n, got = decode_block(encode_block(columns, rows, sealed=sealed))
        assert got_n == n
        for name, want in values.items():
            have = got[name].tolist()
            for a, b in zip(have, want):
                if isinstance(b, float) and math.isnan(b):
                    assert isinstance(a, float) and math.isnan(a)
                else:
                    assert a == b and type(a) is type(b), (name, sealed, a, b)
                    if isinstance(b, (dict, list)):  # and inside: True, 1 and 1.0 are equal, their JSON is not
                        assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True), (name, sealed, a, b)
                    if isinstance(b, float):
                        assert math.copysign(1, a) == math.copysign(1, b)  # -0.0 stays -0.0


def _column_bytes(block: bytes, name: str) -> int:
    """Compressed bytes of one column of a sealed block (its frame size in the block header)."""
    import struct

    from gpudiag.agent.store.codecs import _decompress

    (head_z,) = struct.unpack("<I", block[4:8])
    header = json.loads(_decompress(memoryview(block)[8:8 + head_z]))
    return next(m["z"] for m in header["columns"] if m["name"] == name)


def test_a_gauge_that_goes_up_and_down_costs_about_a_bit_per_value_more_than_a_counter():
    # Steps of both signs are zigzag-coded; in two's complement every step down would fill the
    # high bytes with 0xff and the gauge would cost 1.6x the counter here.
    rng = np.random.default_rng(1)
    n = 3000
    steps = rng.integers(1, 60, n)
    gauge = 10**9 + np.cumsum(steps * rng.choice([-1, 1], n))
    counter = 10**9 + np.cumsum(steps)
    t = T0 + np.arange(n, dtype=float)
    sizes = {}
    for name, col in (("gauge", gauge), ("counter", counter)):
        block = encode_block({"t": t, M.gpu_memory_used_bytes: col}, n)
        assert np.array_equal(decode_block(block)[1][M.gpu_memory_used_bytes], col)
        sizes[name] = _column_bytes(block, M.gpu_memory_used_bytes)
    assert sizes["gauge"] <= sizes["counter"] + 1.1 * n / 8  # the sign of each step: one bit


def test_each_byte_plane_of_a_sealed_column_is_coded_with_a_huffman_table_of_its_own():
    # Token counts of unrelated requests, uniform in 50..4000: a uniform low byte plane and a high one of
    # 16 values. In one zstd block both share a Huffman table and cost 1.72 bytes a value; each in a block
    # of its own, within 3 % of their entropy.
    rng = np.random.default_rng(7)
    n = 5000
    tokens = rng.integers(50, 4001, n)
    columns = {"t": T0 + np.arange(n, dtype=float), "request_id": np.array([f"r{i}" for i in range(n)], dtype=object),
               "prompt_tokens": tokens}  # one request a row: stored as appended
    block = encode_block(columns, n)
    assert np.array_equal(decode_block(block)[1]["prompt_tokens"], tokens)
    assert _column_bytes(block, "prompt_tokens") <= 1.03 * n * math.log2(4001 - 50) / 8


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(-2**63, 2**63 - 1), min_size=1, max_size=300), st.integers(0, 3))
def test_a_sealed_column_split_into_byte_planes_is_one_plain_zstd_frame_never_larger_than_one_block(values, repeat):
    import zstandard

    from gpudiag.agent.store.codecs import _compress, _compress_parts, _encode_plain

    a = np.repeat(np.array(values, dtype=np.int64), repeat + 1)  # runs of equal values too
    _, parts = _encode_plain(a)
    frame = _compress_parts(parts, len(a), 3, True)
    assert zstandard.ZstdDecompressor().decompress(frame) == b"".join(parts)  # as any zstd reader reads it
    assert len(frame) <= len(_compress(b"".join(parts), 3))


def test_values_that_do_not_follow_each_other_are_stored_as_themselves_not_as_steps(monkeypatch):
    # One row per request: token counts and latencies of unrelated requests. As steps they take a
    # sign and about a bit more per value than as values less their minimum.
    from gpudiag.agent.store import codecs as store_codecs

    rng = np.random.default_rng(7)
    n = 5000
    columns = {"t": T0 + np.arange(n, dtype=float), "gpu": np.zeros(n, dtype=np.int64),
               "request_id": np.array([f"req-{i}" for i in range(n)], dtype=object),
               "prompt_tokens": rng.integers(50, 4000, n),
               M.request_queue_time_seconds: np.round(rng.exponential(0.02, n), 6)}
    block = encode_block(columns, n)
    got = decode_block(block)[1]
    for name in ("prompt_tokens", M.request_queue_time_seconds):
        assert np.array_equal(got[name], columns[name])
    header = _header(block)
    assert all("ref" in m for m in header["columns"] if m["name"] in ("prompt_tokens", M.request_queue_time_seconds))
    assert "ref" not in next(m for m in header["columns"] if m["name"] == "t")  # time keeps its steps
    monkeypatch.setattr(store_codecs, "REFERENCE_GAIN", 0.0)  # steps only, as before
    as_steps = encode_block(columns, n)
    for name in ("prompt_tokens", M.request_queue_time_seconds):
        assert _column_bytes(block, name) <= 0.97 * _column_bytes(as_steps, name)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.text(max_size=12), min_size=70, max_size=200, unique=True), st.data())
def test_a_long_dictionary_of_strings_is_front_coded_and_reads_back_exactly(values, data):
    from gpudiag.agent.store.reader import _window_table

    n = len(values) + 5
    picks = values + data.draw(st.lists(st.sampled_from(values), min_size=5, max_size=5))
    ids = [None if i % 17 == 3 else v for i, v in enumerate(picks)]
    columns = {"t": T0 + np.arange(n, dtype=float), "gpu": np.arange(n, dtype=np.int64) % 2,
               "request_id": np.array(ids, dtype=object)}
    block = encode_block(columns, n)
    meta = next(m for m in _header(block, expand=False)["columns"] if m["name"] == "request_id")
    assert "front" in meta and "values" not in meta
    assert decode_block(block)[1]["request_id"].tolist() == ids
    table = _window_table([block], T0 - 1, T0 + n, None)
    codes, uniques = table.codes("request_id")  # as the window's readers see a label column
    assert [uniques[c] if c >= 0 else None for c in codes.tolist()] == ids


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(alphabet=st.sampled_from(["a", "b", "-", "\x00", "é", "\U0001f600"]), max_size=9), max_size=40),
       st.booleans())
@example(["a\x00", "a\x00\x00"], False)  # NUL is also what pads the shorter: the prefix stops where it ends
@example(["", "", "a"], False)
def test_front_coding_finds_each_shared_prefix_as_comparing_pairs_does(values, in_order):
    from gpudiag.agent.store import codecs as store_codecs

    if in_order:
        values = sorted(values)
    coded = store_codecs._front_code(values)
    assert coded == store_codecs._front_code_by_pairs(values)
    assert store_codecs._front_decode(coded) == values


def test_front_coding_past_the_array_limit_compares_pairs(monkeypatch):
    from gpudiag.agent.store import codecs as store_codecs

    values = sorted(_request_ids("req", 300, seed=3))
    array_coded = store_codecs._front_code(values)
    monkeypatch.setattr(store_codecs, "FRONT_CODE_ARRAY_MAX_CHARS", 10)
    assert store_codecs._front_code(values) == array_coded == store_codecs._front_code_by_pairs(values)


def _factorized_by_a_hash_table(a: np.ndarray):
    """Codes in order of appearance (-1 for None and NaN) and the values they stand for; None when one is unhashable."""
    lookup: dict = {}
    codes = []
    for v in a.tolist():
        if v is None or v != v:
            codes.append(-1)
            continue
        try:
            codes.append(lookup.setdefault(v, len(lookup)))
        except TypeError:
            return None
    return codes, list(lookup)


_NUMBER_COLUMNS = st.one_of(
    st.lists(st.integers(-3, 3), min_size=1, max_size=200).map(lambda v: np.array(v, dtype=np.int64)),
    st.lists(st.integers(-2**63, 2**63 - 1), min_size=1, max_size=50).map(lambda v: np.array(v, dtype=np.int64)),
    st.lists(st.integers(2**64 - 4, 2**64 - 1) | st.integers(0, 2**64 - 1), min_size=1, max_size=50)
    .map(lambda v: np.array(v, dtype=np.uint64)),
    st.lists(st.integers(-128, 127), min_size=1, max_size=50).map(lambda v: np.array(v, dtype=np.int8)),
    st.lists(st.booleans(), min_size=1, max_size=50).map(lambda v: np.array(v, dtype=bool)),
)
class _RefusesComparison:
    """A label equal only to itself, whose comparison with anything else raises (hashed by identity)."""

    def __eq__(self, other):
        if other is self:
            return True
        raise TypeError("not comparable")

    __hash__ = object.__hash__


_ODD_VALUES = st.sampled_from([None, float("nan"), "other", 1, b"node-a", ["node-a"], ("node-a",), {"a": 1},
                               _RefusesComparison()])


def _one_string_column(args) -> np.ndarray:
    n, odd = args
    a = np.empty(n, dtype=object)
    a[:] = ["node-a"] * n
    for at, v in odd:
        a[at % n] = v
    return a


@settings(max_examples=300, deadline=None)
@given(st.one_of(_NUMBER_COLUMNS,
                 st.tuples(st.integers(1, 60), st.lists(st.tuples(st.integers(0, 59), _ODD_VALUES), max_size=2))
                 .map(_one_string_column)))
def test_the_store_factorizes_numbers_and_one_valued_strings_as_a_hash_table_does(a):
    # Integer and bool labels are factorized by numpy and a column of one string by one comparison;
    # the codes, the values and their Python types are a hash table's, so sealed blocks are unchanged.
    from gpudiag.agent.store import codecs as store_codecs

    want = _factorized_by_a_hash_table(a)
    got = store_codecs._factorize(a)
    if want is None:
        assert got is None
        return
    codes, uniques = got
    assert codes.dtype == np.int64 and codes.tolist() == want[0]
    assert uniques == want[1] and [type(u) for u in uniques] == [type(u) for u in want[1]]


def _request_ids(style: str, n: int, seed: int) -> list[str]:
    """Request ids as engines make them: the bench's req-GPU-COUNTER-HEX, vLLM's cmpl-<uuid4 hex>,
    chatcmpl-<uuid4 with dashes>."""
    import uuid

    rng = np.random.default_rng(seed)
    if style == "req":
        counters = [0] * 8
        ids = []
        for g in rng.integers(0, 8, n).tolist():
            counters[g] += 1
            ids.append(f"req-{g}-{counters[g]}-{int(rng.integers(2**32)):08x}")
        return ids
    uuids = [uuid.UUID(bytes=rng.bytes(16), version=4) for _ in range(n)]
    return [f"cmpl-{u.hex}" for u in uuids] if style == "cmpl" else [f"chatcmpl-{u}" for u in uuids]


@pytest.mark.parametrize("style, factor", [("req", 0.8), ("cmpl", 0.85), ("chatcmpl", 0.8)])
def test_a_dictionary_of_request_ids_is_stored_as_fields_in_a_fraction_of_front_codings_bytes(style, factor,
                                                                                           monkeypatch):
    from gpudiag.agent.store import codecs as store_codecs

    n = 5000
    ids = _request_ids(style, n, 11)
    columns = {"t": T0 + np.arange(n) / 80, "request_id": np.array(ids, dtype=object)}
    block = encode_block(columns, n)
    meta = next(m for m in _header(block, expand=False)["columns"] if m["name"] == "request_id")
    assert "fields" in meta and "front" not in meta and "values" not in meta
    assert [f["codec"] for f in meta["fields"]] == {"req": ["str", "int", "str", "int", "str", "hex"],
                                                    "cmpl": ["str", "hex"],
                                                    "chatcmpl": ["str"] + ["hex", "str"] * 4 + ["hex"]}[style]
    assert decode_block(block)[1]["request_id"].tolist() == ids
    if style == "cmpl":
        assert len(block) < 16.5 * n  # a uuid4 costs its 16 bytes, not its 32 hex digits
    monkeypatch.setattr(store_codecs, "FIELDS_GAIN", 0.0)  # front coding only, as before
    front = encode_block(columns, n)
    assert len(block) <= factor * len(front)


def _assert_every_reader_gives_back(columns: dict, n: int, block: bytes) -> None:
    """decode_block, decode_table and a window read (of the block and of its zlib twin) give back ``request_id``."""
    from gpudiag.agent.store import decode_table
    from gpudiag.agent.store.reader import _window_table

    ids = columns["request_id"].tolist()
    for data in (block, as_zlib_block(block)):
        assert decode_block(data)[1]["request_id"].tolist() == ids
        assert [_none_for_nan(v) for v in decode_table(data).columns["request_id"].tolist()] == ids
        table = _window_table([data], T0 - 1, T0 + n, None)
        codes, uniques = table.codes("request_id")  # as the window's readers see a label column
        assert [uniques[c] if c >= 0 else None for c in codes.tolist()] == ids
        assert [_none_for_nan(v) for v in table.columns["request_id"].tolist()] == ids


def _none_for_nan(v):
    return None if isinstance(v, float) and math.isnan(v) else v


def _with_fields_forced(values: list[str], data) -> tuple[dict, int, bytes, dict]:
    """A block of ``values`` (then a few again, and missing ones) with fields wherever the strings split into them."""
    from gpudiag.agent.store import codecs as store_codecs

    picks = values + data.draw(st.lists(st.sampled_from(values), min_size=5, max_size=5))
    ids: list = []
    for i, v in enumerate(picks):
        ids += [None, v] if i % 17 == 3 else [v]
    n = len(ids)
    columns = {"t": T0 + np.arange(n, dtype=float), "gpu": np.arange(n, dtype=np.int64) % 2,
               "request_id": np.array(ids, dtype=object)}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(store_codecs, "FIELDS_GAIN", math.inf)  # fields wherever the strings have them
        block = encode_block(columns, n)
    meta = next(m for m in _header(block, expand=False)["columns"] if m["name"] == "request_id")
    return columns, n, block, meta


_NOT_ALNUM = st.characters(exclude_characters="0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
_ID_PIECES = st.one_of(
    st.tuples(st.just("text"), st.text(min_size=1, max_size=4)),  # the same in every id: any characters
    st.tuples(st.just("sep"), st.text(_NOT_ALNUM, min_size=1, max_size=3)),
    st.tuples(st.just("number"), st.integers(0, 10**19)),
    st.tuples(st.just("padded"), st.integers(1, 20)),  # zero-padded to a width
    st.tuples(st.just("hex"), st.integers(1, 33), st.booleans()),  # a length, upper case
    st.tuples(st.just("word"), st.lists(st.text("gkxyzGKXYZ", min_size=1, max_size=5), min_size=1, max_size=4)),
    st.tuples(st.just("word"), st.lists(st.text(_NOT_ALNUM, min_size=1, max_size=3), min_size=1, max_size=4)),
)


def _id_of(piece: tuple, counter: int, rng) -> str:
    kind = piece[0]
    if kind in ("text", "sep"):
        return piece[1]
    if kind == "number":
        return str(rng.randint(0, piece[1]))
    if kind == "padded":
        return str(rng.randint(0, 10 ** piece[1] - 1)).zfill(piece[1])
    if kind == "hex":
        digits = "".join(rng.choice("0123456789abcdef") for _ in range(piece[1]))
        return digits.upper() if piece[2] else digits
    if kind == "word":
        return rng.choice(piece[1])
    return str(counter)


@st.composite
def _id_shaped(draw) -> list[str]:
    """64 to 150 distinct strings of one shape: pieces (the same text, numbers, zero-padded numbers, hex digits
    of one length, words, separators) around a counter between two separators, neighbouring pieces running
    together."""
    import random

    template = draw(st.lists(_ID_PIECES, max_size=4)) + [("sep", draw(st.text(_NOT_ALNUM, min_size=1, max_size=2))),
                                                         ("counter",),
                                                         ("sep", draw(st.text(_NOT_ALNUM, min_size=1, max_size=2)))]
    template += draw(st.lists(_ID_PIECES, max_size=4))
    rng = random.Random(draw(st.integers(0, 2**32)))
    start = draw(st.integers(0, 10**6))
    values = ["".join(_id_of(p, start + i, rng) for p in template) for i in range(draw(st.integers(64, 150)))]
    return list(dict.fromkeys(values))


@settings(max_examples=60, deadline=None)
@given(_id_shaped(), st.data())
def test_id_shaped_strings_are_stored_as_fields_and_read_back_exactly(values, data):
    columns, n, block, meta = _with_fields_forced(values, data)
    assert "fields" in meta and "int" in [f["codec"] for f in meta["fields"]]  # the counter, at least
    _assert_every_reader_gives_back(columns, n, block)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.text(), min_size=64, max_size=120, unique=True), st.data())
def test_any_long_dictionary_of_strings_reads_back_exactly_as_fields_or_front_coded(values, data):
    from gpudiag.agent.store.codecs import _split_fields

    columns, n, block, meta = _with_fields_forced(values, data)
    assert ("fields" in meta) == (_split_fields(values) is not None)
    assert ("front" in meta) == ("fields" not in meta)
    _assert_every_reader_gives_back(columns, n, block)


@pytest.mark.parametrize("values, fields", [
    (["007", "010", "123"], [("int", {"pad": 3})]),
    (["7", "10", "0"], [("int", {})]),
    (["07", "100"], None),  # a leading zero in runs of different widths: text
    (["1234abcd", "12345678"], [("hex", {"len": 8, "upper": False})]),  # hex digits that happen to be decimal
    (["ABCDEF01", "12345678"], [("hex", {"upper": True})]),
    (["AbCd", "abcd"], None),  # both cases in one run position: text
    (["a1f", "0b2", "123"], [("hex", {"len": 3})]),  # an odd number of hex digits
    (["12345678901234567890", "98765432109876543210"], [("hex", {"len": 20})]),  # past int64
    (["ü-1", "ü-22", "ü-3"], [("str", {"values": ["ü-"]}), ("int", {})]),
    (["", "a-1"], None),  # the empty string has no runs
    (["x1y", "x2y"], None),  # letters and digits in one run
    (["g\n1", "h\n2"], [("str", {"values": ["g\n", "h\n"]}), ("int", {})]),
    (["-5", "-6"], [("str", {"values": ["-"]}), ("int", {})]),
])
def test_a_dictionary_splits_into_fields_exactly_where_every_string_has_the_same_runs(values, fields):
    from gpudiag.agent.store.codecs import _join_fields, _split_fields

    split = _split_fields(values)
    if fields is None:
        assert split is None
        return
    metas = json.loads(json.dumps(split[0]))  # as a block header holds them
    assert [(m["codec"], {k: m[k] for k in want}) for m, (_, want) in zip(metas, fields)] == fields
    assert _join_fields(metas, split[1], len(values)) == values


def _request_rows(n: int, seed: int, e2e_of) -> dict:
    rng = np.random.default_rng(seed)
    ttft, tpot = rng.lognormal(-2.5, 0.6, n), rng.lognormal(-3.2, 0.3, n)
    tokens = rng.integers(1, 800, n)
    return {"t": T0 + np.arange(n, dtype=float) // 10, "gpu": rng.integers(0, 8, n),
            "request_id": np.array([f"req-{i}-{rng.integers(2**32):08x}" for i in range(n)], dtype=object),
            "output_tokens": tokens, M.time_to_first_token_seconds: ttft, M.inter_token_latency_seconds: tpot,
            M.e2e_request_latency_seconds: e2e_of(ttft, tpot, tokens, rng)}


@pytest.mark.parametrize("e2e_of, small", [
    (lambda ttft, tpot, n, rng: ttft + tpot * (n - 1), True),  # the sum itself
    (lambda ttft, tpot, n, rng: ttft + tpot * (n - 1) + rng.normal(0, 2e-3, len(n)), False),  # an engine's clocks
    (lambda ttft, tpot, n, rng: rng.lognormal(0, 1, len(n)), False),  # unrelated
], ids=["sum", "clocks", "unrelated"])
def test_a_requests_e2e_latency_is_stored_as_what_is_left_of_ttft_plus_tpot_per_token(e2e_of, small):
    from gpudiag.agent.store import decode_table
    from gpudiag.agent.store.reader import _window_table

    n = 4000
    columns = _request_rows(n, 5, e2e_of)
    want = {k: np.round(v, 6) if k in (M.time_to_first_token_seconds, M.inter_token_latency_seconds,
                                         M.e2e_request_latency_seconds) else v for k, v in columns.items()}
    block = encode_block(columns, n)
    got = decode_block(block)[1]
    table = decode_table(block)
    window = _window_table([block], T0 - 1, T0 + n, None)
    order = np.argsort(want["t"], kind="stable")  # a window is sorted by t
    for name in (M.e2e_request_latency_seconds, M.time_to_first_token_seconds, "output_tokens"):
        assert np.array_equal(got[name], want[name]), name
        assert np.array_equal(table.columns[name], want[name]), name
        assert np.array_equal(window.columns[name], want[name][order]), name
    e2e = next(m for m in _header(block)["columns"] if m["name"] == M.e2e_request_latency_seconds)
    assert e2e.get("of") == [M.time_to_first_token_seconds, M.inter_token_latency_seconds, "output_tokens"]
    if small:
        # The sum costs what rounding TPOT to the microsecond leaves (up to half a microsecond a token):
        # about half of a latency of its own, where alone it costs more than TTFT.
        assert _column_bytes(block, M.e2e_request_latency_seconds) < 0.6 * _column_bytes(
            block, M.time_to_first_token_seconds)


def test_a_column_stored_against_columns_the_block_lacks_is_a_damaged_block_not_wrong_numbers():
    import struct

    from gpudiag.agent.store.codecs import _BLOCK_MAGIC, _compress, _decompress

    n = 500
    block = encode_block(_request_rows(n, 9, lambda ttft, tpot, k, rng: ttft + tpot * (k - 1)), n)
    (head_z,) = struct.unpack("<I", block[4:8])
    header = json.loads(_decompress(memoryview(block)[8:8 + head_z]))
    e2e = next(m for m in header["columns"] if m["name"] == M.e2e_request_latency_seconds)
    e2e["of"][2] = "no_such_tokens"  # a header that names a column the block does not hold
    head = _compress(json.dumps(header, separators=(",", ":")).encode(), 3)
    tampered = _BLOCK_MAGIC + struct.pack("<I", len(head)) + head + block[8 + head_z:]
    with pytest.raises(ValueError, match="do not add up"):
        decode_block(tampered)


def _ttft_rows(n: int, seed: int) -> dict:
    """Requests whose TTFT is their queue time plus their prefill time, and whose e2e adds TPOT per token."""
    rng = np.random.default_rng(seed)
    queue, prefill = rng.exponential(0.02, n), rng.lognormal(-2.5, 0.6, n)
    ttft, tpot, tokens = queue + prefill, rng.lognormal(-3.2, 0.3, n), rng.integers(1, 800, n)
    return {"t": T0 + np.arange(n, dtype=float) // 10, "gpu": rng.integers(0, 8, n),
            "request_id": np.array([f"req-{i}-{rng.integers(2**32):08x}" for i in range(n)], dtype=object),
            "output_tokens": tokens, M.time_to_first_token_seconds: ttft, M.inter_token_latency_seconds: tpot,
            M.e2e_request_latency_seconds: ttft + tpot * (tokens - 1),
            M.request_queue_time_seconds: queue, M.request_prefill_time_seconds: prefill}


def test_ttft_is_stored_as_what_is_left_of_queue_plus_prefill_and_e2e_reads_back_through_it():
    from gpudiag.agent.store import decode_table
    from gpudiag.agent.store.reader import _window_table

    n = 4000
    columns = _ttft_rows(n, 11)
    want = {k: np.round(v, 6) if v.dtype.kind == "f" and k != "t" else v for k, v in columns.items()}
    block = encode_block(columns, n)
    got, table = decode_block(block)[1], decode_table(block)
    window = _window_table([block], T0 - 1, T0 + n, None)
    order = np.argsort(want["t"], kind="stable")
    for name in (M.time_to_first_token_seconds, M.e2e_request_latency_seconds, M.request_queue_time_seconds,
                 M.request_prefill_time_seconds):
        assert np.array_equal(got[name], want[name]), name
        assert np.array_equal(table.columns[name], want[name]), name
        assert np.array_equal(window.columns[name], want[name][order]), name
    ttft = next(m for m in _header(block)["columns"] if m["name"] == M.time_to_first_token_seconds)
    assert ttft.get("of") == [M.request_queue_time_seconds, M.request_prefill_time_seconds]
    # what is left is rounding each part to the microsecond: a fraction of a latency of its own
    assert _column_bytes(block, M.time_to_first_token_seconds) < 0.3 * _column_bytes(
        block, M.request_prefill_time_seconds)


def test_columns_stored_against_each_other_are_a_damaged_block_not_a_hang():
    import struct

    from gpudiag.agent.store.codecs import _BLOCK_MAGIC, _compress, _decompress
    from gpudiag.agent.store.reader import _window_table

    n = 500
    block = encode_block(_ttft_rows(n, 13), n)
    (head_z,) = struct.unpack("<I", block[4:8])
    header = json.loads(_decompress(memoryview(block)[8:8 + head_z]))
    ttft = next(m for m in header["columns"] if m["name"] == M.time_to_first_token_seconds)
    ttft["of"] = [M.e2e_request_latency_seconds, M.request_prefill_time_seconds]  # e2e is of TTFT: a loop
    head = _compress(json.dumps(header, separators=(",", ":")).encode(), 3)
    tampered = _BLOCK_MAGIC + struct.pack("<I", len(head)) + head + block[8 + head_z:]
    with pytest.raises(ValueError, match="do not add up"):
        decode_block(tampered)
    with pytest.raises(ValueError, match="stored against itself|do not add up"):
        _window_table([tampered], T0 - 1, T0 + n, None).columns[M.e2e_request_latency_seconds]


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_a_column_stored_against_others_reads_back_exactly_whatever_they_hold(data):
    n = data.draw(st.integers(1, 30))
    anything = st.one_of(st.floats(width=64), st.integers(-10**6, 10**6).map(lambda k: k / 1000))
    columns = {"t": T0 + np.arange(n, dtype=float), "request_id": np.array([f"r{i}" for i in range(n)], dtype=object)}
    for name in (M.time_to_first_token_seconds, M.inter_token_latency_seconds, M.e2e_request_latency_seconds,
                 M.request_queue_time_seconds, M.request_prefill_time_seconds):
        columns[name] = np.array(data.draw(st.lists(anything, min_size=n, max_size=n)), dtype=np.float64)
    columns["output_tokens"] = np.array(data.draw(st.lists(st.integers(-2**62, 2**62), min_size=n, max_size=n)))
    with np.errstate(over="ignore", invalid="ignore"):  # rounding 1e308 to the microsecond
        block = encode_block(columns, n)
        got = decode_block(block)[1]
        rounded = {k: np.round(v, 6) if v.dtype.kind == "f" and k != "t" else v for k, v in columns.items()}
    for name, want in rounded.items():
        assert np.array_equal(got[name], want, equal_nan=want.dtype.kind == "f"), name


def _header(block: bytes, expand: bool = True) -> dict:
    """A zstd block's header as stored (``expand=False``) or as readers see it."""
    import struct

    from gpudiag.agent.store.codecs import _decompress, _zstd_frames

    if expand:
        return _zstd_frames(block)[0]
    (head_z,) = struct.unpack("<I", block[4:8])
    return json.loads(_decompress(memoryview(block)[8:8 + head_z]))


# A sealed block as schema 3 wrote it: integer steps in two's complement (gauges 40, 38, 41 MiB
# on GPU 0 and 10, 12, 9 MiB on GPU 1; watts with steps down), no "zz" in its header.
_SCHEMA_3_BLOCK = (
    "R0RCMsUAAAAotS/9YK0A3QUA0goiHWBHqwMQ471uoj1NiqQ1s5FbFKWA7unYXw8wCAK7tSLDX/ixWYTfQTVnTqWk2ApMEk2OY85BZzWTPQkDibWk"
    "iRCha5cMABRQDIbP1oEMTQ7DzNe2EgR/+X6e325QnF6aZE12/LZEFAH/qfcd+I2oJb8Fv2CypnzPX83gekGAL5+jCFxfg/9eCBMAKfZ9d8gKbBgI"
    "65sWWCgYiKELOizBocC3robbagtX+8IewLBLqY0kWPKY9UhQnCi1L/0gBjEAAAACAv0CAii1L/0gGMEAAAACAv0CAvEAAP8AAFMAAP8AAGUAAP8A"
    "ACi1L/0gBjEAAAAAAAEAACi1L/0gBjEAACj+A+EC/Si1L/0gDGEAAOr6C1IF9gP/AP0A/w==")


def test_a_block_of_schema_3_with_steps_down_still_reads_exactly():
    import base64

    n, got = decode_block(base64.b64decode(_SCHEMA_3_BLOCK))
    assert n == 6
    assert got["gpu"].tolist() == [0, 1] * 3
    assert (got[M.gpu_memory_used_bytes] // MIB).tolist() == [40, 10, 38, 12, 41, 9]
    assert got[M.gpu_power_watts].tolist() == [250.5, 80.25, 249.0, 81.5, 251.75, 79.0]


# --- findings --------------------------------------------------------------------------


def test_request_latencies_are_kept_to_the_microsecond_and_everything_else_exactly():

    rng = np.random.default_rng(3)
    ttft = rng.lognormal(-2.5, 0.6, 500)
    ratio = rng.random(500)
    frames = [Frame("request", 100.0 + i, [{"gpu": 0, "request_id": f"r{i}", M.time_to_first_token_seconds: ttft[i],
                                            "ratio": ratio[i]}]) for i in range(500)]
    rows, columns = _columns_of(frames)
    for sealed in (False, True):
        _, got = decode_block(encode_block(columns, rows, sealed=sealed))
        assert np.abs(got[M.time_to_first_token_seconds] - ttft).max() <= 0.5e-6
        assert np.array_equal(got[M.time_to_first_token_seconds], np.round(ttft, 6))
        assert np.array_equal(got["ratio"], ratio)  # not a latency: bit for bit
        assert got["request_id"].tolist() == [f"r{i}" for i in range(500)]


def test_findings_are_upserted_by_id_and_found_by_overlap_and_gpu(tmp_path):
    path = str(tmp_path / "node.db")
    storm = Finding("kv_eviction_storm", Severity.CRITICAL, T0 + 100, T0 + 110, "KV evictions 40/s", gpu=3,
                    node="node-a", evidence=[Evidence(M.engine_kv_evictions_total, 40.0, 0.1, 5.0, "1/s")])
    with Store.open(path) as store:
        store.upsert_finding(storm)
        assert [f["id"] for f in store.findings(T0, T0 + 200)] == [storm.id]  # visible before the flush
        store.flush()
        storm.end_s = T0 + 900  # still open ten minutes later: same id, longer span
        store.upsert_finding(storm)
        store.upsert_finding(Finding("cpu_starved", Severity.WARNING, T0 + 2000, T0 + 2100, "host-bound", gpu=1))
        store.flush()
    with Store.open(path, readonly=True) as reader:
        assert [f["end_s"] for f in reader.findings(T0 + 500, T0 + 600)] == [T0 + 900]
        assert reader.findings(T0 + 901, T0 + 1999) == []
        assert [f["kind"] for f in reader.findings(T0, T0 + 3000)] == ["kv_eviction_storm", "cpu_starved"]
        assert [f["kind"] for f in reader.findings(T0, T0 + 3000, gpu=1)] == ["cpu_starved"]
        assert reader.findings(T0, T0 + 3000, kinds=["kv_eviction_storm"])[0]["evidence"][0]["observed"] == 40.0


# --- retention and schema -----------------------------------------------------------------


def test_retention_by_age_drops_chunks_and_findings_older_than_the_retention(tmp_path):
    path = str(tmp_path / "node.db")
    with Store.open(path, retention_s=120, chunk_s=30) as store:
        store.upsert_finding(Finding("old", Severity.INFO, T0, T0 + 10, "long ago"))
        store.upsert_finding(Finding("recent", Severity.INFO, T0 + 590, T0 + 599, "just now"))
        for tick in range(600):
            store.append(node_frames(tick))
            store.flush()
        assert store.enforce_retention() > 0
        first, last = store.time_range()
        kinds = [f["kind"] for f in store.findings(-math.inf, math.inf)]
    assert last == pytest.approx(T0 + 599, abs=0.01)
    # Whole chunks go: what ends before newest - 120 s; what is left starts at most one 30 s
    # chunk earlier (1 s of slack for the sampling jitter of the chunk's last tick).
    cutoff = last - 120
    assert cutoff - 31 <= first <= cutoff + 1.01
    assert kinds == ["recent"]


def test_retention_by_size_keeps_the_file_under_max_bytes_and_the_newest_frames(tmp_path):
    path = str(tmp_path / "node.db")
    max_bytes = 200 * 1024
    with Store.open(path, max_bytes=max_bytes, chunk_s=60) as store:
        for tick in range(900):
            store.append(node_frames(tick, gpus=4, processes=8))
            store.flush()
        store.enforce_retention()
        health = store.health()
        first, last = store.time_range()
    assert health["db_bytes"] <= max_bytes
    assert os.path.getsize(path) <= max_bytes * 1.1  # pages are handed back (incremental vacuum)
    assert last == pytest.approx(T0 + 899, abs=0.01)
    assert first > T0 + 120  # the oldest went first
    # ... and no more than needed: what is left fills most of the target (the schema's own pages
    # take half of it here; counting chunks at their length left the last 4 of 900 seconds).
    assert health["db_bytes"] >= 0.8 * max_bytes * SIZE_RETENTION_TARGET_RATIO


def test_the_used_bytes_reported_every_second_are_the_databases_after_flushes_seals_and_retention(tmp_path):
    # health() reports the used bytes every second; they are read inside the flush's own write
    # transaction, and read again after a seal or retention: always what the database holds.
    def truth(path: str) -> int:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            pages, free, size = (conn.execute(f"PRAGMA {p}").fetchone()[0]
                                 for p in ("page_count", "freelist_count", "page_size"))
            return (pages - free) * size
        finally:
            conn.close()

    path = str(tmp_path / "node.db")
    seen = set()
    with Store.open(path, retention_s=60, chunk_s=30) as store:
        assert store.health()["db_bytes"] == truth(path)
        for tick in range(200):
            store.append(node_frames(tick))
            if tick % 50 == 7:
                store.upsert_finding(Finding(f"f{tick}", Severity.INFO, T0 + tick, T0 + tick + 1, "x"))
            store.flush()
            got = store.health()["db_bytes"]
            assert got == truth(path), tick
            seen.add(got)
        assert store.enforce_retention() > 0
        assert store.health()["db_bytes"] == truth(path)
    assert len(seen) > 10  # it moved with the writes


def _write_schema_1(path: str) -> None:
    """A store as schema 1 laid it out: no node/gpu columns on findings, zlib chunks."""
    conn = sqlite3.connect(path)
    conn.executescript("""
        PRAGMA journal_mode = WAL;
        CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
        INSERT INTO meta VALUES ('schema_version', '1');
        INSERT INTO meta VALUES ('migrations', '[{"version": 1, "name": "initial", "applied_s": 0}]');
        CREATE TABLE frames_gpu (t_start REAL NOT NULL, t_end REAL NOT NULL, node TEXT,
                                 n_rows INTEGER NOT NULL, sealed INTEGER NOT NULL, data BLOB NOT NULL);
        CREATE TABLE findings (id TEXT PRIMARY KEY, kind TEXT NOT NULL, severity TEXT NOT NULL,
                               start_s REAL NOT NULL, end_s REAL, json TEXT NOT NULL);
    """)

    frames = [fr for tick in range(10) for fr in node_frames(tick) if fr.kind == "gpu"]
    n, columns = _columns_of(frames)
    conn.execute("INSERT INTO frames_gpu VALUES (?, ?, 'node-a', ?, 1, ?)",
                 (T0, T0 + 9.01, n, as_zlib_block(encode_block(columns, n))))
    finding = Finding("cpu_starved", Severity.WARNING, T0, T0 + 9, "host-bound", gpu=1, node="node-a")
    d = finding.to_dict()
    conn.execute("INSERT INTO findings VALUES (?, ?, ?, ?, ?, ?)",
                 (d["id"], d["kind"], d["severity"], d["start_s"], d["end_s"], json.dumps(d)))
    conn.commit()
    conn.close()


def test_a_schema_1_store_is_readable_and_migrated_on_the_first_write_open(tmp_path):
    path = str(tmp_path / "old.db")
    _write_schema_1(path)
    with Store.open(path, readonly=True) as reader:  # readers do not migrate, and need not
        assert reader.meta()["schema_version"] == 1
        assert [f["kind"] for f in reader.findings(-math.inf, math.inf, gpu=1)] == ["cpu_starved"]
    with Store.open(path) as store:
        meta = store.meta()
        assert meta["schema_version"] == SCHEMA_VERSION
        assert [m["name"] for m in meta["migrations"]] == ["initial", "findings_entity", "zstd_chunks", "zigzag_ints",
                                                   "reference_ints", "dictionary_fields", "ttft_of_parts"]
        assert len(store.window(-math.inf, math.inf).table("gpu")) == 20
        old = store.window(-math.inf, math.inf).table("gpu")
        assert [f["kind"] for f in store.findings(-math.inf, math.inf, gpu=1)] == ["cpu_starved"]
        store.append(node_frames(10))
        store.flush()
    with Store.open(path, readonly=True) as reader:  # the zlib chunk and the new zstd chunks read side by side
        both = reader.window(-math.inf, math.inf).table("gpu")
    assert len(both) == 20 + 2
    pd.testing.assert_frame_equal(both.iloc[:20].reset_index(drop=True), old.reset_index(drop=True))
    conn = sqlite3.connect(path)
    assert sorted(bytes(r[0][:4]) for r in conn.execute("SELECT data FROM frames_gpu")) == [b"GDB1", b"GDB2"]
    assert conn.execute("SELECT gpu, node FROM findings").fetchall() == [(1, "node-a")]  # backfilled
    assert conn.execute("SELECT count(*) FROM frames_process").fetchone()[0] == 1  # new kinds get tables
    conn.close()


def test_a_store_from_a_newer_gpudiag_is_refused_and_left_alone(tmp_path):
    path = str(tmp_path / "future.db")
    with Store.open(path):
        pass
    conn = sqlite3.connect(path)
    conn.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    conn.commit()
    conn.close()
    before = Path(path).read_bytes()
    for readonly in (True, False):
        with pytest.raises(GpudiagError, match="schema 99, newer"):
            Store.open(path, readonly=readonly)
    assert Path(path).read_bytes() == before


@pytest.mark.parametrize("content", ["missing", "empty", "garbage", "foreign"])
def test_a_missing_empty_or_foreign_store_read_only_fails_in_one_line(tmp_path, content):
    path = str(tmp_path / "x.db")
    if content == "empty":
        open(path, "wb").close()
    elif content == "garbage":
        with open(path, "wb") as fh:
            fh.write(os.urandom(8192))
    elif content == "foreign":
        conn = sqlite3.connect(path)
        conn.execute("CREATE TABLE invoices (id INTEGER)")
        conn.commit()
        conn.close()
    with pytest.raises(GpudiagError) as err:
        Store.open(path, readonly=True)
    assert path in str(err.value) and "\n" not in str(err.value)
    if content in ("garbage", "foreign"):  # a writer refuses too, and writes nothing
        before = Path(path).read_bytes()
        with pytest.raises(GpudiagError):
            Store.open(path)
        assert Path(path).read_bytes() == before


def _store_with_a_damaged_chunk(tmp_path, damage) -> str:
    """A small node's store (30 s in 10 s chunks) whose first sealed process chunk is ``damage(data)``."""
    path = str(tmp_path / "node.db")
    with Store.open(path, chunk_s=10) as store:
        for tick in range(30):
            store.append(node_frames(tick))
            store.flush()
    conn = sqlite3.connect(path)
    rowid, data = conn.execute("SELECT rowid, data FROM frames_process WHERE sealed = 1 LIMIT 1").fetchone()
    conn.execute("UPDATE frames_process SET data = ? WHERE rowid = ?", (damage(data), rowid))
    conn.commit()
    conn.close()
    return path


def _short_dictionaries(data: bytes) -> bytes:
    """A frame block whose string columns' dictionaries each lost their last value: codes point past them."""
    import zstandard

    (head_z,) = struct.unpack("<I", data[4:8])
    header = json.loads(zstandard.ZstdDecompressor().decompress(data[8:8 + head_z]))
    for meta in header["columns"]:
        if meta["codec"] == "str" and meta.get("values"):
            meta["values"] = meta["values"][:-1]
    head = zstandard.ZstdCompressor().compress(json.dumps(header).encode())
    return data[:4] + struct.pack("<I", len(head)) + head + data[8 + head_z:]


@pytest.mark.parametrize("damage", ["truncated", "scribbled", "unknown magic", "truncated zlib",
                                    "short dictionary"])
def test_a_damaged_chunk_is_one_error_line_and_the_store_keeps_its_other_chunks(tmp_path, damage):
    path = _store_with_a_damaged_chunk(tmp_path, {
        "truncated": lambda data: data[:len(data) // 2],
        "scribbled": lambda data: data[:8] + bytes(b ^ 0x5A for b in data[8:]),
        "unknown magic": lambda data: b"GDB9" + data[4:],
        "truncated zlib": lambda data: as_zlib_block(data)[:-40],
        "short dictionary": _short_dictionaries,
    }[damage])
    with Store.open(path, readonly=True) as reader:
        with pytest.raises(GpudiagError, match="damaged chunk") as err:
            reader.window(-math.inf, math.inf, kinds=["process"])
        assert "\n" not in str(err.value)
        assert len(reader.window(-math.inf, math.inf, kinds=["gpu"]).table("gpu")) == 60  # the rest still reads


def test_a_damaged_column_read_on_demand_is_one_error_line_and_the_other_columns_read(tmp_path):
    # A chunk's columns are decompressed when first read: damage inside one column's frame
    # surfaces when that column is read, as the same one line, and every other column reads.
    from gpudiag.agent.store.codecs import _zstd_frames

    def scribble_one_column(data: bytes) -> bytes:
        header, frames = _zstd_frames(data)
        names = [m["name"] for m in header["columns"]]
        at, size = frames[len(frames) - len(names) + names.index(M.process_gpu_memory_bytes)]
        return data[:at + 4] + bytes(b ^ 0xFF for b in data[at + 4:at + size]) + data[at + size:]

    path = _store_with_a_damaged_chunk(tmp_path, scribble_one_column)
    with Store.open(path, readonly=True) as reader:
        table = reader.window(-math.inf, math.inf, kinds=["process"]).columns("process")
        assert len(table.columns["t"]) == 180 and len(table.columns[M.process_cpu_utilization_ratio]) == 180
        for _ in range(2):  # and again: a failed column is not taken for a made one
            with pytest.raises(GpudiagError, match="damaged chunk") as err:
                table.columns[M.process_gpu_memory_bytes]
            assert "\n" not in str(err.value)


def test_a_damaged_store_read_only_fails_in_one_line(tmp_path):
    path = str(tmp_path / "node.db")
    with Store.open(path, chunk_s=10) as store:
        for tick in range(300):
            store.append(node_frames(tick, gpus=4, processes=6))
            store.flush()
    size = os.path.getsize(path)
    with open(path, "r+b") as fh:  # a disk error scribbles over the middle of the file
        fh.seek(size // 2)
        fh.write(os.urandom(size // 4))
    with pytest.raises(GpudiagError) as err, Store.open(path, readonly=True) as reader:
        reader.window(-math.inf, math.inf)
    assert "\n" not in str(err.value)


# --- one writer, many readers ---------------------------------------------------------------


def test_a_second_writer_is_refused_with_the_first_ones_pid(tmp_path):
    path = str(tmp_path / "node.db")
    first = Store.open(path)
    with pytest.raises(GpudiagError, match=rf"store .*node.db is in use by another agent \(pid {os.getpid()}\)"):
        Store.open(path)
    reader = Store.open(path, readonly=True)  # readers take no lock
    reader.close()
    first.close()
    Store.open(path).close()  # free again once the first one is gone


def test_a_planted_symbolic_link_at_the_lock_path_is_refused(tmp_path):
    target = tmp_path / "precious"
    target.write_text("do not overwrite\n")
    os.symlink(target, tmp_path / "node.db.lock")
    with pytest.raises(GpudiagError, match="symbolic link"):
        Store.open(str(tmp_path / "node.db"))
    assert target.read_text() == "do not overwrite\n"


WRITER = textwrap.dedent("""
    import sys
    from gpudiag.agent.store import Store
    from gpudiag.frames import Frame

    path, start = sys.argv[1], int(sys.argv[2])
    store = Store.open(path, chunk_s=5)
    tick = start
    while True:
        t = 1000.0 + tick
        store.append([
            Frame("gpu", t, [{"node": "n", "gpu": g, "uuid": f"GPU-{g}",
                              "gpu_utilization_ratio": (tick + g) % 101 / 100,
                              "gpu_memory_used_bytes": (tick * 7919 + g) * 4096} for g in range(4)]),
            Frame("process", t, [{"node": "n", "gpu": g, "pid": 100 + g, "process": "python3",
                                  "process_gpu_memory_bytes": tick * 2097152} for g in range(4)]),
        ])
        store.flush()
        print(tick, flush=True)  # only after flush() returned: this tick is committed
        tick += 1
""")


def _start_writer(path: str, start: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", WRITER, path, str(start)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _read_ticks(proc: subprocess.Popen, count: int) -> int:
    """Wait for ``count`` more committed ticks from the writer; the last one."""
    last = None
    for _ in range(count):
        line = proc.stdout.readline()
        if not line:
            raise AssertionError(f"writer died: {proc.stderr.read()}")
        last = int(line)
    return last


def test_a_kill_9_during_writes_loses_at_most_the_unflushed_second_and_never_corrupts(tmp_path):
    path = str(tmp_path / "node.db")
    start = 0
    for kill_after in (35, 48, 61):  # three crashes at different points, each mid-write
        proc = _start_writer(path, start)
        try:
            last_committed = _read_ticks(proc, kill_after)
            proc.send_signal(signal.SIGKILL)
        finally:
            proc.wait(timeout=30)
        # The writer runs ahead of this reader: every tick it reported before the kill is committed.
        last_committed = max([last_committed] + [int(line) for line in proc.stdout.read().split()])
        conn = sqlite3.connect(path)
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        conn.close()
        with Store.open(path, readonly=True) as reader:
            gpu = reader.window(-math.inf, math.inf).table("gpu")
            proc_rows = reader.window(-math.inf, math.inf).table("process")
        ticks = (gpu["t"] - 1000).astype(int)
        per_tick = ticks.value_counts()
        assert (per_tick == 4).all()  # no half-written tick, no duplicate
        stored = sorted(per_tick.index)
        assert stored[0] == 0 and stored == list(range(stored[-1] + 1))  # nothing lost before the crash
        assert last_committed <= stored[-1] <= last_committed + 1  # at most the unreported flush
        assert len(proc_rows) == len(gpu)
        start = stored[-1] + 1  # the next agent takes over the store (the dead one's lock is free)


def test_readers_never_block_the_writer_and_read_a_consistent_snapshot(tmp_path):
    path = str(tmp_path / "node.db")
    proc = _start_writer(path, 0)
    try:
        _read_ticks(proc, 3)
        with Store.open(path, readonly=True) as reader:
            with reader.snapshot():
                before = len(reader.window(-math.inf, math.inf).table("gpu"))
                # The writer keeps committing while this read transaction is open ...
                _read_ticks(proc, 25)
                assert len(reader.window(-math.inf, math.inf).table("gpu")) == before  # ... unseen here
            _read_ticks(proc, 1)
            after = len(reader.window(-math.inf, math.inf).table("gpu"))
            assert after > before and after >= 4 * (3 + 25 + 1)  # every reported tick, 4 GPUs each
    finally:
        proc.kill()
        proc.wait(timeout=30)


# --- full disk, read-only store ---------------------------------------------------------------


def test_frames_handed_over_while_a_write_waits_never_wait_and_stay_bounded(tmp_path, monkeypatch):
    """Another process holds the write lock: the flush waits for it (busy timeout), while append
    takes frames at once; past MAX_WAITING_ROWS the oldest are dropped and counted; after the lock
    is let go, the newest rows are written."""
    import threading

    from gpudiag.agent.store import container as store_container

    monkeypatch.setattr(store_container, "MAX_UNENCODED_ROWS", 100)
    monkeypatch.setattr(store_container, "MAX_WAITING_ROWS", 400)
    path = str(tmp_path / "node.db")
    store = Store.open(path)

    def one(tick):
        return [Frame("gpu", T0 + tick, [{"gpu": g, M.gpu_utilization_ratio: 0.5} for g in range(50)])]

    store.append(one(0))
    assert store.flush() == 50
    other = sqlite3.connect(path, isolation_level=None, timeout=0)
    other.execute("BEGIN IMMEDIATE")
    store.append(one(1))
    flusher = threading.Thread(target=store.flush, daemon=True)
    flusher.start()
    flusher.join(0.3)
    assert flusher.is_alive(), "the flush did not wait for the lock"
    for tick in range(2, 22):  # 1000 rows while the writer waits
        store.append(one(tick))
    assert flusher.is_alive(), "append waited for the writer"
    other.execute("ROLLBACK")
    other.close()
    flusher.join(10)
    health = store.health()
    assert health["dropped_rows_total"] == 1000 - 400
    assert store.flush() == 400
    store.close()
    with Store.open(path, readonly=True) as reader:
        ticks = sorted({int(t - T0) for t in reader.window(-math.inf, math.inf).table("gpu")["t"]})
    assert ticks == [0, 1] + list(range(14, 22))  # the flush that waited wrote tick 1; the newest 400 rows kept


def test_a_full_disk_is_logged_once_counted_buffered_and_written_after_recovery(tmp_path, caplog):
    path = str(tmp_path / "node.db")
    store = Store.open(path, max_pending_bytes=60_000)
    store.append(node_frames(0))
    store.flush()
    # SQLite's own "database or disk is full" (SQLITE_FULL), raised by capping the file at
    # its current size: the same error a full file system gives.
    pages = store._conn.execute("PRAGMA page_count").fetchone()[0]
    store._conn.execute(f"PRAGMA max_page_count = {pages}")
    caplog.set_level("ERROR", logger="gpudiag.agent.store")
    tick, written = 0, 0
    while True:  # the pages already there take a few more ticks
        tick += 1
        store.append(node_frames(tick, gpus=4, processes=8))
        if store.flush() == 0:
            break
        written = tick
        assert tick < 50, "the capped store never filled up"
    first_failed = tick
    for tick in range(first_failed + 1, first_failed + 80):
        store.append(node_frames(tick, gpus=4, processes=8))
        assert store.flush() == 0
    health = store.health()
    assert health["store_errors_total"] == {"disk_full": 80}
    assert not health["writable"]
    assert health["dropped_rows_total"] > 0 and health["buffered_rows"] > 0  # bounded: oldest dropped
    assert len([r for r in caplog.records if "disk_full" in r.getMessage()]) == 1
    rows = store.metric_rows()  # what the agent exports as agent_store_errors_total{kind} and friends
    assert {"kind": "disk_full", M.agent_store_errors_total: 80} in rows
    assert {"probe": "store", M.agent_dropped_events_total: health["dropped_rows_total"]} in rows
    live = store.window(-math.inf, math.inf).table("gpu")  # analyzers still see the buffered frames
    assert live["t"].max() == pytest.approx(T0 + tick, abs=0.01)
    store._conn.execute("PRAGMA max_page_count = 1073741823")  # space again
    assert store.flush() == health["buffered_rows"]
    assert store.health()["writable"]
    store.close()
    with Store.open(path, readonly=True) as reader:
        ticks = sorted({int(t - T0) for t in reader.window(-math.inf, math.inf).table("gpu")["t"]})
    assert ticks[:written + 1] == list(range(written + 1)) and ticks[-1] == tick
    assert first_failed not in ticks  # the oldest buffered ticks were the ones dropped


READ_ONLY_WRITER = textwrap.dedent("""
    import json, logging, math, sys
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(message)s")
    from gpudiag.agent.store import Store
    from gpudiag.frames import Frame

    store = Store.open(sys.argv[1], max_pending_bytes=3_000)
    for tick in range(40):
        store.append([Frame("gpu", 1000.0 + tick, [{"gpu": g, "gpu_power_watts": tick * 1.5 + g,
                                                    "uuid": f"GPU-{g}-" + "x" * 60}
                                                   for g in range(8)])])
        store.flush()
    live = store.window(-math.inf, math.inf).table("gpu")
    print(json.dumps({"health": store.health(), "live_last_t": float(live["t"].max())}))
    store.close()
""")


def _drop_file_capabilities() -> None:
    """In the child, before exec: give up root's power to ignore file permissions.

    Root would write into a 0555 directory anyway (CAP_DAC_OVERRIDE); dropping the
    capabilities from the bounding set makes the exec'd writer an ordinary process
    that the mode bits stop, while it can still read the interpreter under /root.
    """
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    pr_capbset_drop = 24
    for cap in (1, 2, 3):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER
        if libc.prctl(pr_capbset_drop, cap, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def _run_without_write_permission(script: str, directory: str, path: str) -> subprocess.CompletedProcess:
    """Run ``script`` so that ``directory`` (mode 0555) is read-only to it, root or not."""
    os.chmod(directory, 0o555)
    preexec = _drop_file_capabilities if os.geteuid() == 0 else None
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    try:
        return subprocess.run([sys.executable, "-c", script, path], check=False, capture_output=True, text=True,
                              timeout=120, env=env, preexec_fn=preexec)
    except subprocess.SubprocessError as exc:  # prctl refused: no CAP_SETPCAP in this container
        pytest.skip(f"cannot make a directory read-only to root here (dropping CAP_DAC_OVERRIDE failed: {exc})")


@pytest.mark.parametrize("existing", [False, True], ids=["new-store", "existing-store"])
def test_a_read_only_store_is_logged_once_counted_and_never_raises(existing):
    directory = tempfile.mkdtemp(prefix="gpudiag-ro-")
    try:
        path = os.path.join(directory, "node.db")
        if existing:
            with Store.open(path) as store:
                store.append(node_frames(0))
        result = _run_without_write_permission(READ_ONLY_WRITER, directory, path)
        assert result.returncode == 0, result.stderr
        report = json.loads(result.stdout)
        health = report["health"]
        # One failure for the open, one for each of the 40 flushes.
        assert health["store_errors_total"] == {"read_only": 41} and not health["writable"]
        assert health["dropped_rows_total"] > 0  # the buffer stayed bounded
        assert report["live_last_t"] == 1039.0  # the newest frames are still served from memory
        assert result.stderr.count("ERROR store") == 2  # once while running, once at close for the loss
        assert "Traceback" not in result.stderr
    finally:
        os.chmod(directory, 0o755)
        shutil.rmtree(directory, ignore_errors=True)


# A seal flattens ~300 x 128 dicts of one shape per column (a counter by kind per process):
# one leaf at a time, which must give exactly what flattening row by row gives, for any column.
_leaf = st.one_of(st.integers(-10, 10), st.integers(2**53 - 2, 2**53 + 2), st.floats(allow_nan=True),
                  st.booleans(), st.none(), st.just("x"), st.just({"n": 1}), st.just({}),
                  st.builds(np.int64, st.integers(-5, 5)), st.builds(np.float32, st.floats(-1, 1)))
_row = st.one_of(st.none(), st.integers(0, 3),
                 st.fixed_dictionaries({"a": _leaf}), st.fixed_dictionaries({"a": _leaf, "b": _leaf}),
                 st.fixed_dictionaries({"b": st.integers(0, 9), "a": st.integers(0, 9)}),
                 st.fixed_dictionaries({"a": st.integers(0, 9), "b": st.integers(0, 9)}),
                 st.fixed_dictionaries({"a": st.floats(0, 9), "b": st.integers(0, 9)}),
                 st.fixed_dictionaries({"v": st.fixed_dictionaries({"c": _leaf, "u": _leaf})}),
                 st.fixed_dictionaries({"v": st.fixed_dictionaries({"c": st.integers(0, 9)})}))


@settings(max_examples=400, deadline=None)
@given(st.lists(_row, min_size=1, max_size=8))
def test_dicts_of_one_shape_flatten_as_row_by_row_flattening_does(values):
    from gpudiag.agent.store import codecs as store_codecs

    fast = store_codecs._DictColumn.from_values(values)
    general = store_codecs._DictColumn._from_one_shape
    try:
        store_codecs._DictColumn._from_one_shape = classmethod(lambda cls, v: store_codecs._NOT_ONE_SHAPE)
        slow = store_codecs._DictColumn.from_values(values)
    finally:
        store_codecs._DictColumn._from_one_shape = general
    assert (fast is None) == (slow is None)
    if fast is not None:
        assert fast.layouts == slow.layouts and fast.int_paths == slow.int_paths
        assert fast.codes.dtype == slow.codes.dtype and np.array_equal(fast.codes, slow.codes)
        assert list(fast.leaves) == list(slow.leaves)
        for path, leaf in fast.leaves.items():
            assert leaf.dtype == slow.leaves[path].dtype and np.array_equal(leaf, slow.leaves[path], equal_nan=True)


# A fresh block's twin is what decoding the block gives back (raw, flattened): dicts of numbers whose
# JSON text reads back unchanged are flattened from the values themselves, every other column is read
# back from the JSON text. Either way the twin must be the decoder's reading, bit for bit.
_json_leaf = st.one_of(st.integers(-10, 10), st.integers(2**53 - 2, 2**53 + 2), st.just(10**400),
                       st.floats(allow_nan=True), st.sampled_from([-0.0, math.inf, -math.nan, math.nan]),
                       st.booleans(), st.none(), st.just("x"), st.just({}),
                       st.builds(np.int64, st.integers(-5, 5)), st.builds(np.float64, st.floats(-1, 1)))
_json_pair = st.fixed_dictionaries({"corrected": _json_leaf, "uncorrected": _json_leaf})
_json_row = st.one_of(
    st.none(), st.integers(0, 3), st.just("s"), st.just([1, 2]), st.just({}), st.just({1: 2, 3: 4}),
    st.fixed_dictionaries({"a": _json_leaf}), st.fixed_dictionaries({"a": _json_leaf, "b": _json_leaf}),
    st.fixed_dictionaries({"a": st.integers(0, 9), "b": st.integers(0, 9)}),
    st.fixed_dictionaries({"b": st.integers(0, 9), "a": st.integers(0, 9)}),
    st.fixed_dictionaries({"a": st.floats(0, 9), "b": st.integers(0, 9)}),
    st.fixed_dictionaries({"volatile": _json_pair, "aggregate": _json_pair}),
    st.fixed_dictionaries({"volatile": st.fixed_dictionaries({"corrected": st.integers(0, 9)}),
                           "aggregate": st.fixed_dictionaries({"corrected": st.integers(0, 9)})}))


def _same_bits(a, b) -> bool:
    """Equal columns: the same class and dtype, flattened dicts leaf by leaf to the bit, objects by type and repr."""
    from gpudiag.agent.store import codecs as store_codecs

    if type(a) is not type(b):
        return False
    if isinstance(a, store_codecs._DictColumn):
        return (a.layouts == b.layouts and a.int_paths == b.int_paths and a.codes.dtype == b.codes.dtype
                and np.array_equal(a.codes, b.codes) and list(a.leaves) == list(b.leaves)
                and all(a.leaves[p].dtype == b.leaves[p].dtype
                        and np.array_equal(a.leaves[p].view(np.int64), b.leaves[p].view(np.int64)) for p in a.leaves))
    if a.dtype != b.dtype:
        return False
    if a.dtype != object:
        return np.array_equal(a.view(np.uint8), b.view(np.uint8))
    return [type(v) for v in a.tolist()] == [type(v) for v in b.tolist()] and repr(a.tolist()) == repr(b.tolist())


@settings(max_examples=500, deadline=None)
@given(st.lists(_json_row, min_size=1, max_size=8))
# The values JSON does not give back as they are, every run: a NaN's sign, ints past 2**53, bools,
# numpy numbers, int keys, an empty dict among full ones.
@example([{"a": -math.nan}, {"a": 1.5}])
@example([{"a": 2**53 + 1}, None])
@example([{"a": True}])
@example([{"a": np.int64(3)}])
@example([{1: 2, 3: 4}])
@example([{"a": 1}, {}])
def test_a_fresh_columns_twin_is_what_decoding_its_block_gives_back(values):
    from gpudiag.agent.store import blocks as store_blocks

    n = len(values)
    a = column_array(values)
    twin: dict = {}
    block = store_blocks.encode_block({"t": np.arange(n, dtype=np.float64), "c": a}, n, sealed=False, twin=twin)
    _, decoded = store_blocks._flattened(store_blocks.decode_block(block, raw=True))
    kept = twin["c"].read(block) if isinstance(twin["c"], store_blocks._InBlock) else twin["c"]
    assert _same_bits(kept, decoded["c"])


@given(st.lists(st.one_of(st.none(), st.integers(), st.floats(allow_nan=True), st.booleans(),
                          st.builds(np.int64, st.integers(-5, 5))), max_size=6),
       st.lists(st.sampled_from(["x", "", {}, {"a": 1}]), min_size=1, max_size=3), st.randoms())
def test_a_column_with_a_string_or_a_dict_is_kept_as_objects_as_it_is(others, objects, rnd):

    values = others + objects
    rnd.shuffle(values)
    got = column_array(values)
    assert got.dtype == object and len(got) == len(values) and all(x is v for x, v in zip(got.tolist(), values))


def test_a_column_becomes_the_numpy_array_its_python_types_make():

    cases = [([1.5, 2.0], np.float64), ([None, 1, 2.5], np.float64), ([1, 2], np.int64), ([True, False], bool),
             ([None, None], object), (["a", "b"], object), ([None, "a"], object), ([2**70, 1], object),
             ([[1], [2]], object), ([True, 1], object), ([1.5, False], object), ([np.True_, 2], object)]
    for values, dtype in cases:
        got = column_array(values)
        assert got.dtype == dtype and len(got) == len(values), values
        if dtype is object:
            assert all(x is v for x, v in zip(got.tolist(), values)), values
    assert np.isnan(column_array([None, 1])[0])


def test_a_column_of_shared_dicts_encodes_as_one_of_equal_separate_dicts():
    from gpudiag.agent.store import codecs as store_codecs

    reasons = [{"white": "no reporter", "grey": "no reporter"}, {"black": "NVML not found"}, {}]
    shared = np.empty(600, dtype=object)
    shared[:] = [reasons[i % 3] for i in range(600)]  # as decoding a fresh block shares equal dicts
    separate = np.empty(600, dtype=object)
    separate[:] = [dict(reasons[i % 3]) for i in range(600)]
    separate[7] = None
    shared[7] = None
    got_shared, got_separate = store_codecs._json_codes(shared), store_codecs._json_codes(separate)
    assert got_shared[1] == got_separate[1] and np.array_equal(got_shared[0], got_separate[0])
    assert encode_block({"missing_reasons": shared}, 600) == encode_block({"missing_reasons": separate}, 600)


def test_number_and_counter_columns_repeated_from_the_last_fresh_block_are_written_byte_for_byte_as_anew(monkeypatch):
    # Limits, clocks and error counters by label are the same second after second: a fresh block takes a
    # number column equal byte for byte, or a small column of other values with the same repr, from the
    # kind's last block. Every block and twin must be what encoding it anew gives.
    from gpudiag.agent.store import REPEAT_BY_TEXT_MAX_ROWS, encode_fresh
    from gpudiag.agent.store import blocks as store_blocks
    from gpudiag.agent.store import codecs as store_codecs
    from gpudiag.agent.store.blocks import _InBlock

    shared = {"corrected": 0}
    changed = {"corrected": 0}
    seconds = [
        ([300, 300], [{"corrected": 0}, {"corrected": 1}]),
        ([300, 300], [{"corrected": 0}, {"corrected": 1}]),  # equal: both repeat
        ([300.0, 300.0], [{"corrected": 0.0}, {"corrected": 1}]),  # equal values of other types
        ([300.0, 300.0], [{"corrected": 0.0}, {"corrected": 1}]),
        ([-0.0, 0.0], [{"corrected": 1}, {"corrected": 0}]),  # -0.0 == 0.0, but not byte for byte
        ([0.0, -0.0], [{"corrected": 1}, {"corrected": 0}]),
        ([float("nan"), 0.0], [shared, shared]),  # one dict in both rows: written once, with codes
        ([float("nan"), 0.0], [dict(shared), dict(shared)]),  # equal, not shared
        ([1.0, 0.0], [changed, {"corrected": 0}]),
        ([1.0, 0.0], [changed, {"corrected": 0}]),  # changed in place below, before this second
        ([1.0, 0.0], [{"corrected": 2}, {"corrected": 0}]),
        ([1.0, 0.0, 2.0], [{"corrected": 2}, {"corrected": 0}, None]),  # a row more
    ]
    encoded: list = []
    real = store_blocks._encode_column
    monkeypatch.setattr(store_blocks, "_encode_column", lambda a, **kw: encoded.append(a.tolist()) or real(a, **kw))
    real_compress = store_codecs._compress
    counting_compress = lambda data, level: encoded.append(data) or real_compress(data, level)  # noqa: E731
    monkeypatch.setattr(store_codecs, "_compress", counting_compress)
    monkeypatch.setattr(store_blocks, "_compress", counting_compress)
    repeats: dict = {}
    for i, (limits, ecc) in enumerate(seconds):
        if i == 9:
            changed["corrected"] = 5
        rows = [{"gpu": g, M.gpu_power_limit_watts: w, M.gpu_ecc_errors_total: e}
                for g, (w, e) in enumerate(zip(limits, ecc))]
        n, columns = _columns_of([Frame("gpu", T0 + i, rows)])
        block, twin, want_block, want_twin, anew = _fresh_and_anew(encoded, columns, n, repeats)
        assert block == want_block, i
        assert twin.keys() == want_twin.keys()
        got_limits = twin[M.gpu_power_limit_watts].read(block)
        assert isinstance(twin[M.gpu_power_limit_watts], _InBlock)
        assert got_limits.tobytes() == want_twin[M.gpu_power_limit_watts].read(want_block).tobytes()
        assert decode_block(block)[1][M.gpu_ecc_errors_total].tolist() == ecc
        assert store_codecs._DictColumn.concat([twin[M.gpu_ecc_errors_total]], [n]).to_objects().tolist() \
            == store_codecs._DictColumn.concat([want_twin[M.gpu_ecc_errors_total]], [n]).to_objects().tolist() \
            if isinstance(want_twin[M.gpu_ecc_errors_total], store_codecs._DictColumn) \
            else twin[M.gpu_ecc_errors_total].tolist() == want_twin[M.gpu_ecc_errors_total].tolist()
        raw = np.asarray(limits, dtype=columns[M.gpu_power_limit_watts].dtype).tobytes()
        before = seconds[i - 1] if i else None
        same_limits = i > 0 and raw == np.asarray(before[0], dtype=np.asarray(before[0]).dtype).tobytes() \
            and type(limits[0]) is type(before[0][0])
        assert (raw in anew) == (not same_limits), (i, "limits")
        same_ecc = i > 0 and repr(ecc) == repr(before[1]) and (ecc[0] is ecc[1]) == (before[1][0] is before[1][1]) \
            and i != 9
        assert (ecc in anew) == (not same_ecc), (i, "ecc")
    # A sealed block is never written from a fresh block's memory.
    with pytest.raises(ValueError, match="fresh blocks"):
        encode_block(columns, n, sealed=True, repeats=repeats)
    # A column of more rows than REPEAT_BY_TEXT_MAX_ROWS is not compared by its repr: written anew.
    rows = [{"gpu": g, M.gpu_ecc_errors_total: {"corrected": 0}} for g in range(REPEAT_BY_TEXT_MAX_ROWS + 1)]
    for k in range(2):
        n, columns = _columns_of([Frame("gpu", T0 + 100 + k, rows)])
        encoded.clear()
        block, _ = encode_fresh(columns, n, repeats)
        assert [r[M.gpu_ecc_errors_total] for r in rows] in encoded
        assert block == encode_fresh(columns, n)[0]
