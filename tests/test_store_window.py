"""A window read decodes blocks straight into the window's columns: exactly what a block-by-block read gives.

The reference below is the plain way to read a window: decode every block into a
Table of its own (:func:`decode_table`), cut it to the window (and node), join the
pieces with ``Table.concat`` and sort by ``t``. The store's read must return the
same Table: the same columns in the same order, dtypes, values, row order and
label codes, for blocks that overlap, arrive out of order, lack columns, hold a
column with different types, NaN and None, labels, JSON values and dicts.
"""

from __future__ import annotations

import json
import math
import sqlite3
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import zstandard

from gpudiag.agent.store import Store, decode_table, encode_block
from gpudiag.agent.store.reader import _window_table
from gpudiag.catalog import M
from gpudiag.frames import DictColumn, Frame, FrameColumns, Table

T0 = 1_767_225_600.0


def as_zlib_block(block: bytes) -> bytes:
    """The same block as schemas 1 and 2 wrote it: magic GDB1, the header length, zlib of header and columns."""
    assert block[:4] == b"GDB2"
    (head_z,) = struct.unpack("<I", block[4:8])
    header = json.loads(zstandard.ZstdDecompressor().decompress(block[8:8 + head_z]))
    at, payload = 8 + head_z, []
    for meta in ([header["order"]] if "order" in header else []) + header["columns"]:
        size = meta.pop("z")
        payload.append(zstandard.ZstdDecompressor().decompress(block[at:at + size]))
        at += size
    head = json.dumps(header, separators=(",", ":")).encode()
    return b"GDB1" + struct.pack("<I", len(head)) + zlib.compress(head + b"".join(payload), 6)


def reference_table(blocks: list[bytes], start_s: float, end_s: float, node: str | None) -> Table | None:
    """Each block decoded on its own, cut to [start_s, end_s] (and ``node``), joined, sorted by ``t``."""
    parts = []
    for data in blocks:
        table = decode_table(data)
        t = table.columns["t"]
        keep = (t >= start_s) & (t <= end_s)
        if node is not None and "node" in table.columns:
            code = table.code_of("node", node)
            keep &= table.codes("node")[0] == (-2 if code is None else code)
        if keep.all():
            parts.append(table)
        elif keep.any():
            parts.append(table.take(np.flatnonzero(keep)))
    return Table.concat(parts).sorted() if parts else None


def assert_same_values(have: list, want: list, where) -> None:
    assert len(have) == len(want), where
    for i, (a, b) in enumerate(zip(have, want)):
        if isinstance(b, float) and math.isnan(b):
            assert isinstance(a, float) and math.isnan(a), (where, i, a, b)
        else:
            assert type(a) is type(b) and a == b, (where, i, a, b)


def assert_same_table(have: Table | None, want: Table | None) -> None:
    """Same rows, columns (order, dtype, values, types of objects) and label codes of every column."""
    if want is None:
        assert have is None
        return
    assert have is not None and have.n == want.n
    assert list(have.columns) == list(want.columns)
    for name, w in want.columns.items():
        h = have.columns[name]
        if isinstance(w, DictColumn):
            assert isinstance(h, DictColumn), name
            assert h.layouts == w.layouts and np.array_equal(h.layout, w.layout), name
            assert list(h.leaves) == list(w.leaves), name
            for path in w.leaves:
                assert np.array_equal(h.leaves[path], w.leaves[path], equal_nan=True), (name, path)
            assert h.objects == w.objects and h.other == w.other, name
            assert_same_values(h.to_objects().tolist(), w.to_objects().tolist(), name)
        else:
            assert h.dtype == w.dtype, (name, h.dtype, w.dtype)
            assert_same_values(h.tolist(), w.tolist(), name)
        hc, wc = have.codes(name), want.codes(name)
        assert np.array_equal(hc[0], wc[0]), (name, "codes")
        assert_same_values(list(hc[1]), list(wc[1]), (name, "uniques"))


GROUP_KEYS = [("gpu",), ("gpu", "pid"), ("node", "gpu", "pid"), ("process",), ("pid", "process"), ("process", "node"),
              (M.process_torch_segments,), ("gpu", M.process_cpu_utilization_ratio)]


def assert_same_groups(table: Table | None) -> None:
    """Entity groups of a read window are those a sort of its labels gives (positions in table order)."""
    if table is None:
        return
    for keys in GROUP_KEYS:
        if not all(k in table.columns for k in keys):
            continue
        fresh = Table(table.n, dict(table.columns))
        got, want = table.groups(keys), fresh.groups(keys)
        assert_same_values([v for k in got[0] for v in k], [v for k in want[0] for v in k], keys)
        assert len(got[1]) == len(want[1]), keys
        for a, b in zip(got[1], want[1]):
            assert np.array_equal(a, b), keys


def varied_blocks(seed: int) -> list[bytes]:
    """Blocks as a node's store holds them, and as it could: sealed and fresh, overlapping, out of order."""
    rng = np.random.default_rng(seed)
    blocks = []
    start = T0
    for _ in range(int(rng.integers(3, 8))):
        ticks = int(rng.integers(1, 12))
        # Blocks overlap their neighbours now and then, and one may start before the previous one.
        start += float(rng.choice([ticks, ticks - 3, -5, ticks + 2]))
        nodes = ["node-a"] if rng.random() < 0.5 else ["node-a", "node-b"]
        with_dict, with_json, with_maybe = rng.random(3) < 0.5
        mixed = rng.choice(["int", "float", "none", "bool", "absent"])
        frames = []
        for tick in range(ticks):
            rows = []
            for node in nodes:
                for j in range(int(rng.integers(1, 4))):
                    row = {"node": node, "gpu": j, "pid": 100 + j,
                           "process": None if rng.random() < 0.1 else f"worker-{j}",
                           M.process_gpu_memory_bytes: int(rng.integers(0, 1 << 40)),
                           M.process_cpu_utilization_ratio: (math.nan if rng.random() < 0.1
                                                             else round(float(rng.random()), 2)),
                           M.process_thread_cpu_max_ratio: None if rng.random() < 0.1 else float(rng.normal(60, 5)),
                           M.process_torch_segments: bool(rng.random() < 0.5)}
                    if rng.random() < 0.2:
                        row["t"] = start + tick - float(rng.uniform(0, 4))  # a row's own, earlier t
                    if with_dict:
                        row[M.process_context_switches_total] = None if rng.random() < 0.1 else {
                            "voluntary": int(rng.integers(0, 1000)), "nested": {"x": float(rng.random())}}
                    if with_json:
                        row[M.process_resident_memory_bytes] = [None, "x", [1, 2], "ü"][int(rng.integers(0, 4))]
                    if with_maybe:
                        row[M.process_torch_ooms_total] = int(rng.integers(0, 9))
                    if mixed != "absent":
                        row[M.process_torch_alloc_retries_total] = {
                            "int": int(rng.integers(0, 9)), "float": float(rng.random()), "none": None,
                            "bool": bool(rng.random() < 0.5)}[mixed]
                    rows.append(row)
            frames.append(Frame("process", start + tick + float(rng.uniform(0, 0.01)), rows))
        chunk = FrameColumns.of(frames[0].kind, frames)
        n, columns = chunk.n, dict(chunk.columns)
        block = encode_block(columns, n, sealed=bool(rng.random() < 0.7))
        blocks.append(as_zlib_block(block) if rng.random() < 0.25 else block)  # a store from before zstd
    return blocks


def windows_of(blocks: list[bytes]) -> list[tuple[float, float, str | None]]:
    ts = np.concatenate([decode_table(b).columns["t"] for b in blocks])
    lo, hi = float(ts.min()), float(ts.max())
    mid = (lo + hi) / 2
    return [(-math.inf, math.inf, None), (lo + 1.5, hi - 1.5, None), (lo + 1.5, hi - 1.5, "node-b"),
            (mid, mid + 2.25, "node-a"), (lo, lo, None), (hi + 1, hi + 2, None), (lo, hi, "node-z")]


@pytest.mark.parametrize("seed", range(40))
def test_a_window_read_gives_what_decoding_each_block_and_joining_them_gives(seed):
    blocks = varied_blocks(seed)
    for start_s, end_s, node in windows_of(blocks):
        want = reference_table(blocks, start_s, end_s, node)
        have = Store._table_of(blocks, start_s, end_s, node)
        assert_same_table(have, want)
        assert_same_groups(have)
        with ThreadPoolExecutor(4) as pool:
            assert_same_table(_window_table(blocks, start_s, end_s, node, pool.map), want)


@pytest.mark.parametrize("codec", ["zstd", "zlib"])
def test_a_long_block_is_read_in_two_steps_in_either_codec(codec):
    # Thousands of rows: the leading columns are inflated apart from the rest, over many compressed pieces.
    rng = np.random.default_rng(7)
    frames = [Frame("process", T0 + tick, [
        {"node": f"node-{j % 3}", "gpu": j % 8, "pid": 1000 + j, "process": f"worker-{j}",
         M.process_gpu_memory_bytes: int(rng.integers(0, 1 << 40)),
         M.process_cpu_utilization_ratio: float(rng.random()),
         M.process_resident_memory_bytes: int(rng.integers(0, 1 << 50))}
        for j in range(64)]) for tick in range(600)]
    chunk = FrameColumns.of(frames[0].kind, frames)
    n, columns = chunk.n, dict(chunk.columns)
    block = encode_block(columns, n)
    blocks = [as_zlib_block(block) if codec == "zlib" else block]
    assert len(blocks[0]) > 4 * (1 << 16)
    windows = [(-math.inf, math.inf, None), (T0 + 100.5, T0 + 400, "node-1"), (T0 + 599, T0 + 599, None)]
    for start_s, end_s, node in windows:
        assert_same_table(Store._table_of(blocks, start_s, end_s, node), reference_table(blocks, start_s, end_s, node))


def test_a_window_read_decodes_a_column_when_it_is_first_read_and_labels_group_without_their_values():
    blocks = []
    for b in range(3):
        frames = [Frame("process", T0 + 10 * b + i, [
            {"node": "node-a", "gpu": j % 2, "pid": 100 + j, "process": f"worker-{j}",
             M.process_gpu_memory_bytes: 1000 * b + 10 * i + j} for j in range(4)]) for i in range(10)]
        chunk = FrameColumns.of(frames[0].kind, frames)
        n, columns = chunk.n, dict(chunk.columns)
        blocks.append(encode_block(columns, n))
    table = Store._table_of(blocks, -math.inf, math.inf, None)
    cols = table.columns
    assert cols.made("t") and not cols.made(M.process_gpu_memory_bytes) and not cols.made("node")
    assert M.process_gpu_memory_bytes in cols and not cols.made(M.process_gpu_memory_bytes)  # asking costs nothing
    table.groups(("node", "gpu", "pid"))
    assert table.has_values("node")
    assert not cols.made("node")  # grouped and checked by its codes
    memory = cols[M.process_gpu_memory_bytes]
    assert cols.made(M.process_gpu_memory_bytes) and cols[M.process_gpu_memory_bytes] is memory
    assert_same_table(table, reference_table(blocks, -math.inf, math.inf, None))


def in_time_order_blocks(seed: int, *, legacy: bool = True) -> list[bytes]:
    """Blocks one after another in time whose entities come and go: labels missing, NaN, renamed, repeated."""
    rng = np.random.default_rng(seed)
    blocks, t = [], T0
    for _ in range(int(rng.integers(2, 7))):
        frames = []
        for _ in range(int(rng.integers(1, 15))):
            rows = []
            for j in rng.permutation(6)[:int(rng.integers(1, 7))]:
                j = int(j)
                rows.append({"node": "node-a" if j % 3 else "node-b", "gpu": j % 2,
                             "pid": 100 + j if j != 5 else math.nan,
                             "process": [f"worker-{j}", None, "x"][int(rng.integers(0, 3))] if j > 3 else f"w{j}",
                             M.process_torch_segments: bool(j % 2),
                             M.process_cpu_utilization_ratio: [0.5, math.nan, 0.25][j % 3],
                             M.process_gpu_memory_bytes: int(rng.integers(0, 1 << 30))})
            frames.append(Frame("process", t, rows))
            t += 1.0
        chunk = FrameColumns.of(frames[0].kind, frames)
        n, columns = chunk.n, dict(chunk.columns)
        block = encode_block(columns, n, sealed=bool(rng.random() < 0.7))
        blocks.append(as_zlib_block(block) if rng.random() < 0.25 and legacy else block)  # a store from before zstd
    return blocks


@pytest.mark.parametrize("seed", range(30))
def test_entity_groups_of_a_window_come_from_the_blocks_stored_order_and_match_a_sort(seed):
    blocks = in_time_order_blocks(seed)
    used = 0
    for start_s, end_s, node in windows_of(blocks):
        have = Store._table_of(blocks, start_s, end_s, node)
        assert_same_table(have, reference_table(blocks, start_s, end_s, node))
        assert_same_groups(have)
        used += have is not None and have._group_source is not None
    assert used, "no window was read with the blocks' entity runs: the test would check only the sort"


def test_a_steady_nodes_repeated_blocks_give_the_groups_a_sort_gives_when_one_label_changes(monkeypatch):
    # Blocks of the same entities in the same stored order repeat the block before's runs; a block in
    # which one row's label differs (a renamed process, a pid lost to NaN, a GPU label that moves)
    # must not be taken for a repeat.
    from gpudiag.agent.store import reader as store_reader

    def block(b: int, change: str | None) -> bytes:
        frames = []
        for i in range(5):
            rows = []
            for j in range(6):
                row = {"node": "node-a", "gpu": j % 3, "pid": 100 + j, "process": f"worker-{j}",
                       M.process_gpu_memory_bytes: 1000 * b + 10 * i + j}
                if j == 4 and change == "renamed":
                    row["process"] = "worker-x"
                if j == 4 and change == "pid lost":
                    row["pid"] = math.nan
                if j == 2 and change == "gpu moved":
                    row["gpu"] = 1
                rows.append(row)
            frames.append(Frame("process", T0 + 5 * b + i, rows))
        chunk = FrameColumns.of(frames[0].kind, frames)
        n, columns = chunk.n, dict(chunk.columns)
        return encode_block(columns, n)

    taken = []
    repeats = store_reader._EntityRuns._repeats
    monkeypatch.setattr(store_reader._EntityRuns, "_repeats",
                        staticmethod(lambda *a: taken.append(repeats(*a)) or taken[-1]))
    changes = [None, None, "renamed", None, None, "pid lost", "pid lost", "gpu moved", None]
    blocks = [block(b, c) for b, c in enumerate(changes)]
    have = Store._table_of(blocks, -math.inf, math.inf, None)
    assert have._group_source is not None
    assert_same_table(have, reference_table(blocks, -math.inf, math.inf, None))
    assert_same_groups(have)
    assert True in taken and False in taken


@pytest.mark.parametrize("seed", range(30))
def test_an_entitys_column_is_made_straight_from_the_stored_runs_and_equals_its_rows_of_the_column(seed):
    blocks = in_time_order_blocks(seed, legacy=False) + [b for b in varied_blocks(seed) if seed % 3 == 0]
    direct = 0
    for start_s, end_s, node in windows_of(blocks):
        have = Store._table_of(blocks, start_s, end_s, node)
        want = reference_table(blocks, start_s, end_s, node)
        if have is None:
            continue
        for keys in GROUP_KEYS:
            if not all(k in have.columns for k in keys):
                continue
            for name in list(have.columns):
                if name in keys or name == "t":
                    continue
                entities = have.entity_rows(keys)
                made = getattr(have.columns, "made", lambda _: True)  # a sorted window holds every column
                before = made(name)
                for key, rows in entities:
                    got = rows[name].values
                    ref = want.columns[name]
                    ref = ref.take(rows.positions) if isinstance(ref, DictColumn) else ref[rows.positions]
                    if isinstance(ref, DictColumn):
                        continue
                    assert got.dtype == ref.dtype, (keys, name)
                    assert_same_values(got.tolist(), ref.tolist(), (keys, name, key))
                if not before and not made(name):
                    direct += 1
            have.release()
    if seed % 3:  # the blocks of in_time_order_blocks alone: some numeric column is made from the runs
        assert direct, "no column was made from the stored runs: the test would check only the gather"


@pytest.mark.parametrize("seed", range(30))
def test_a_columns_values_at_some_rows_and_whether_it_holds_any_are_told_without_making_it(seed):
    rng = np.random.default_rng(seed)
    blocks = in_time_order_blocks(seed, legacy=False) + varied_blocks(seed)
    for start_s, end_s, node in windows_of(blocks):
        want = reference_table(blocks, start_s, end_s, node)
        if want is None:
            continue
        for name in want.columns:
            have = Store._table_of(blocks, start_s, end_s, node)  # afresh: nothing made by the column before
            assert have.has_values(name) == want.has_values(name), name
            at = np.sort(rng.choice(want.n, size=min(want.n, 5), replace=False))
            if hasattr(have.columns, "values_at"):
                got = have.columns.values_at(name, at)
            else:  # a window that needed a sort by t holds every column made
                got = have.columns[name]
                got = got.to_objects(at) if isinstance(got, DictColumn) else got[at]
            ref = want.columns[name]
            ref = ref.to_objects(at) if isinstance(ref, DictColumn) else ref[at]
            assert_same_values(list(got), list(ref), (name, at))


def test_a_steady_nodes_column_in_entity_order_is_made_block_by_block_and_equals_its_rows_of_the_column():
    blocks = []
    for b in range(5):
        frames = [Frame("process", T0 + 10 * b + i, [
            {"node": "node-a", "gpu": j % 3, "pid": 100 + j, "process": f"worker-{j}",
             M.process_gpu_memory_bytes: 1000 * b + 10 * i + j, M.process_cpu_utilization_ratio: (i + j) / 100}
            for j in range(6)]) for i in range(10)]
        chunk = FrameColumns.of(frames[0].kind, frames)
        n, columns = chunk.n, dict(chunk.columns)
        blocks.append(encode_block(columns, n))
    for start_s, end_s in [(-math.inf, math.inf), (T0 + 3, T0 + 44)]:  # whole blocks, and blocks cut at both ends
        have = Store._table_of(blocks, start_s, end_s, None)
        want = reference_table(blocks, start_s, end_s, None)
        for name in (M.process_gpu_memory_bytes, M.process_cpu_utilization_ratio):
            for key, rows in have.entity_rows(("node", "gpu", "pid")):
                assert_same_values(rows[name].values.tolist(), want.columns[name][rows.positions].tolist(), key)
            assert not have.columns.made(name)


def test_blocks_in_time_order_are_joined_without_a_sort_and_others_are_sorted():
    rng = np.random.default_rng(7)
    blocks = []
    for b in range(6):
        frames = [Frame("gpu", T0 + 10 * b + i, [{"node": "n", "gpu": g, "util": float(rng.random())}
                                                 for g in range(3)]) for i in range(10)]
        chunk = FrameColumns.of(frames[0].kind, frames)
        n, columns = chunk.n, dict(chunk.columns)
        blocks.append(encode_block(columns, n))
    in_order = Store._table_of(blocks, T0 + 5, T0 + 55, None)
    assert (np.diff(in_order.columns["t"]) >= 0).all() and in_order.n == 51 * 3
    assert_same_table(in_order, reference_table(blocks, T0 + 5, T0 + 55, None))
    shuffled = [blocks[i] for i in (3, 0, 5, 1, 4, 2)]
    got = Store._table_of(shuffled, T0 + 5, T0 + 55, None)
    assert (np.diff(got.columns["t"]) >= 0).all()
    assert_same_table(got, reference_table(shuffled, T0 + 5, T0 + 55, None))


def test_a_store_window_reads_chunks_in_start_order_with_ties_in_write_order(tmp_path):
    """Chunks come back ordered by (t_start, rowid), as ORDER BY t_start, rowid orders them."""
    path = str(tmp_path / "node.db")
    rng = np.random.default_rng(11)
    with Store.open(path, chunk_s=30) as store:
        for tick in range(100):
            t = T0 + tick
            store.append([Frame("gpu", t, [{"node": "node-a", "gpu": g, "util": float(rng.random())}
                                           for g in range(2)]),
                          Frame("process", t, [{"node": "node-a", "gpu": 0, "pid": p, "process": f"w{p}",
                                                "bytes": int(rng.integers(0, 1 << 30))} for p in range(3)])])
            store.flush()
    # A late chunk inside another one's span, with the same start and an earlier end: the
    # index on (t_end, t_start) lists it first, the order of writing last; rows of equal t
    # keep the order of their chunks.
    conn = sqlite3.connect(path)
    frames = [Frame("gpu", T0 + 30 + i, [{"node": "node-a", "gpu": 7, "util": 0.5}]) for i in range(11)]
    chunk = FrameColumns.of(frames[0].kind, frames)
    n, columns = chunk.n, dict(chunk.columns)
    conn.execute("INSERT INTO frames_gpu (t_start, t_end, node, n_rows, sealed, data) VALUES (?, ?, ?, ?, 1, ?)",
                 (T0 + 30, T0 + 40, "node-a", n, encode_block(columns, n)))
    conn.commit()
    ordered = {kind: [r[0] for r in conn.execute(f"SELECT data FROM frames_{kind} ORDER BY t_start, rowid")]
               for kind in ("gpu", "process")}
    conn.close()
    with Store.open(path, readonly=True) as reader:
        for start_s, end_s in ((-math.inf, math.inf), (T0 + 12.5, T0 + 64)):
            window = reader.window(start_s, end_s)
            for kind, blocks in ordered.items():
                assert_same_table(window.columns(kind), reference_table(blocks, start_s, end_s, None))
            gpu = window.columns("gpu")
            at = np.flatnonzero(gpu.columns["t"] == T0 + 30)
            assert gpu.columns["gpu"][at].tolist() == [0, 1, 7]


def test_the_comparison_catches_a_dropped_or_moved_row():
    blocks = varied_blocks(3)
    want = reference_table(blocks, -math.inf, math.inf, None)
    dropped = want.take(np.arange(1, want.n))
    with pytest.raises(AssertionError):
        assert_same_table(dropped, want)
    swapped = np.arange(want.n)
    swapped[[0, -1]] = swapped[[-1, 0]]
    with pytest.raises(AssertionError):
        assert_same_table(want.take(swapped), want)


def request_blocks(blocks: int = 3, per_block: int = 800) -> list[bytes]:
    """Sealed blocks of finished requests, each with an id of its own, as a serving engine reports them."""
    rng = np.random.default_rng(3)
    out, count = [], 0
    for b in range(blocks):
        frames = []
        for tick in range(per_block // 8):
            rows = []
            for g in range(8):
                count += 1
                rows.append({"node": "node-a", "gpu": g, "engine": "vllm",
                             "request_id": f"req-{g}-{count}-{int(rng.integers(0, 1 << 32)):08x}",
                             M.time_to_first_token_seconds: float(rng.random())})
            frames.append(Frame("request", T0 + 1000 * b + tick, rows))
        chunk = FrameColumns.of("request", frames)
        out.append(encode_block(dict(chunk.columns), chunk.n))
    return out


def test_ids_distinct_per_row_are_read_as_plain_values_when_first_read_and_labels_stay_labels():
    blocks = request_blocks()
    table = Store._table_of(blocks, -math.inf, math.inf, None)
    cols = table.columns
    # The read decodes the labels' codes at once; the ids (a value per row) only when first read.
    assert not cols.made("request_id") and cols.kind("request_id") == "object"
    table.codes("node")
    assert not cols.made("node")  # a label: its codes were read with the window
    ids = cols["request_id"]
    assert ids.dtype == object and len(set(ids.tolist())) == table.n == 2400
    assert ids[0].startswith("req-0-1-")
    # Grouping by them and their codes are still there on demand, equal to a block-by-block read's.
    assert_same_table(table, reference_table(blocks, -math.inf, math.inf, None))
    cut = Store._table_of(blocks, T0 + 1000, T0 + 1050, "node-a")
    assert_same_table(cut, reference_table(blocks, T0 + 1000, T0 + 1050, "node-a"))


def test_a_few_distinct_values_in_a_short_window_stay_labels():
    blocks = request_blocks(blocks=1, per_block=80)
    table = Store._table_of(blocks, -math.inf, math.inf, None)
    table.codes("request_id")
    assert not table.columns.made("request_id")  # labels: codes without their values
    assert_same_table(table, reference_table(blocks, -math.inf, math.inf, None))
