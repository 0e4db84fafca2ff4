"""`gpudiag analyze snapshot`: fragmentation of the caching allocator from a pickled memory snapshot."""

from __future__ import annotations

import json
import os
import pickle
import re
import subprocess
import threading
from pathlib import Path

import pytest

from gpudiag.analyzers.snapshot import fragmentation_report
from gpudiag.cli import main
from gpudiag.errors import GpudiagError
from gpudiag.findings import alert_name
from gpudiag.safe_pickle import load_snapshot, loads_plain

MIB = 2**20
REPO = Path(__file__).resolve().parents[1]


def _block(size, state, address=0, requested=None):
    return {"address": address, "size": size, "requested_size": size if requested is None else requested,
            "state": state, "frames": [{"filename": "model.py", "line": 12, "name": "forward"}]}


def _segment(blocks, address=0x7F0000000000, device=0, segment_type="large", expandable=False):
    total = sum(b["size"] for b in blocks)
    return {"device": device, "address": address, "total_size": total,
            "allocated_size": sum(b["size"] for b in blocks if b["state"] == "active_allocated"),
            "active_size": sum(b["size"] for b in blocks if b["state"] != "inactive"),
            "requested_size": 0, "stream": 0, "segment_type": segment_type, "segment_pool_id": (0, 0),
            "is_expandable": expandable, "frames": [], "blocks": blocks}


def _write(path: Path, obj, protocol=pickle.DEFAULT_PROTOCOL) -> Path:
    path.write_bytes(pickle.dumps(obj, protocol=protocol))
    return path


def _analyze(cli, path, *extra) -> dict:
    r = cli("analyze", "snapshot", path, "--json", *extra)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def _one_error_line(r) -> str:
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpudiag: error: "), r.stderr
    return lines[0]


@pytest.fixture
def cli_here(capsys):
    """The same entry point as the `cli` fixture, run in this process (no interpreter start-up per call)."""

    def run(*args):
        code = main([str(a) for a in args])
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(list(args), code, out, err)

    return run


def _mixed_snapshot():
    """A 20 MiB large segment and a 2 MiB small one, with both names torch uses for pending frees."""
    large = _segment([
        _block(2 * MIB, "active_allocated", requested=2 * MIB - 100),
        _block(2 * MIB, "inactive"),
        _block(2 * MIB, "active_allocated"),
        _block(2 * MIB, "active_pending_free"),
        _block(12 * MIB, "inactive"),
    ])
    small = _segment([_block(MIB, "active_awaiting_free"), _block(MIB, "inactive")],
                     address=0x7F0001000000, segment_type="small")
    return {"segments": [large, small], "device_traces": [[]]}


def test_bytes_holes_and_pending_frees_are_counted_per_segment_and_overall(tmp_path, cli_here):
    doc = _analyze(cli_here, _write(tmp_path / "s.pickle", _mixed_snapshot()))
    assert doc["reserved_bytes"] == 22 * MIB
    assert doc["allocated_bytes"] == 4 * MIB
    assert doc["pending_free_bytes"] == 3 * MIB  # active_pending_free and active_awaiting_free alike
    assert doc["free_bytes"] == 15 * MIB
    assert doc["requested_bytes"] == 4 * MIB - 100
    assert doc["largest_free_block_bytes"] == 12 * MIB
    assert doc["external_fragmentation_ratio"] == pytest.approx(1 - 12 / 15)
    assert doc["inactive_split_bytes"] == 15 * MIB
    assert doc["segment_count"] == 2 and doc["block_count"] == 7
    assert doc["blocks_by_state"] == {"active_allocated": 2, "active_pending_free": 2, "inactive": 3}
    seg0, seg1 = doc["segments"]
    assert (seg0["free_bytes"], seg0["largest_free_block_bytes"]) == (14 * MIB, 12 * MIB)
    assert seg0["external_fragmentation_ratio"] == pytest.approx(1 - 12 / 14)
    assert (seg1["pending_free_bytes"], seg1["segment_type"]) == (MIB, "small")
    assert doc["findings"] == []  # one big hole: not fragmented


def _swiss_cheese(oom=False):
    """Ten 20 MiB segments of 2 MiB blocks, every other one free: 100 MiB free, no hole over 2 MiB."""
    segments = []
    for s in range(10):
        base = 0x7F0000000000 + s * 64 * MIB
        segments.append(_segment([
            _block(2 * MIB, "active_allocated" if i % 2 == 0 else "inactive", address=base + i * 2 * MIB)
            for i in range(10)
        ], address=base))
    trace = [{"action": "alloc", "addr": 1, "size": 2 * MIB, "stream": 0, "time_us": 5_000_000, "frames": []}]
    if oom:
        trace.append({"action": "oom", "size": 6 * MIB, "device_free": 0, "stream": 0, "time_us": 9_000_000,
                      "frames": []})
    return {"segments": segments, "device_traces": [trace]}


def test_memory_cut_into_small_holes_is_a_fragmentation_finding(tmp_path, cli):
    doc = _analyze(cli, _write(tmp_path / "frag.pickle", _swiss_cheese()))
    assert doc["free_bytes"] == 100 * MIB and doc["largest_free_block_bytes"] == 2 * MIB
    assert doc["external_fragmentation_ratio"] == pytest.approx(0.98)
    [f] = doc["findings"]
    assert f["kind"] == "memory_fragmentation" and f["severity"] == "warning"
    assert f["runbook"] == alert_name("memory_fragmentation")
    assert "paged-kv" in f["fixes"] and f["gpu"] == 0
    assert f["start_s"] == 5.0


def test_an_oom_recorded_with_that_memory_free_makes_it_critical(tmp_path, cli_here):
    doc = _analyze(cli_here, _write(tmp_path / "oom.pickle", _swiss_cheese(oom=True)))
    [f] = doc["findings"]
    assert f["severity"] == "critical" and doc["oom_events"] == 1
    assert (f["start_s"], f["end_s"]) == (5.0, 9.0)


def test_a_bare_segment_list_and_old_pickle_protocols_are_read(tmp_path):
    snap = _mixed_snapshot()
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        obj = load_snapshot(_write(tmp_path / f"p{protocol}.pickle", snap["segments"], protocol=protocol))
        assert fragmentation_report(obj).totals.free_bytes == 15 * MIB
    # sets and frozensets come through find_class under protocols 0-3 and are admitted
    plain = {"s": {1, 2}, "f": frozenset({3}), "t": (1.5, None, True), "n": [None, -7, "é"]}
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        assert loads_plain(pickle.dumps(plain, protocol=protocol)) == plain
    with_bytes = {"b": bytearray(b"xy"), "u": b"\x00"}
    for protocol in range(3, pickle.HIGHEST_PROTOCOL + 1):
        assert loads_plain(pickle.dumps(with_bytes, protocol=protocol)) == with_bytes
    with pytest.raises(GpudiagError, match="_codecs.encode"):  # how protocols 0-2 spell bytes: a call
        loads_plain(pickle.dumps(b"\x00", protocol=2))


class _RunsACommand:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class _Evaluates:
    def __reduce__(self):
        return (eval, ("__import__('os').getpid()",))


def test_a_pickle_that_would_run_a_command_is_refused_and_runs_nothing(tmp_path, cli):
    marker = tmp_path / "pwned"
    evil = _write(tmp_path / "evil.pickle", {"segments": [], "payload": _RunsACommand(marker)})
    line = _one_error_line(cli("analyze", "snapshot", evil))
    assert "refusing to load" in line and "system" in line  # os.system pickles as posix.system
    assert not marker.exists()
    with pytest.raises(GpudiagError, match="builtins.eval"):
        load_snapshot(_write(tmp_path / "eval.pickle", [_Evaluates()]))
    with pytest.raises(GpudiagError, match="collections.OrderedDict"):
        from collections import OrderedDict
        load_snapshot(_write(tmp_path / "od.pickle", OrderedDict(segments=[])))
    assert not marker.exists()


def test_a_stream_that_never_ends_is_refused_at_its_first_bad_byte_not_read_whole(tmp_path):
    # A named pipe fed zeros as fast as it is read (a device, or a pipe that carries no pickle): the
    # loader must stop reading where the pickle goes wrong, not take the stream in whole first.
    fifo = tmp_path / "endless.pickle"
    os.mkfifo(fifo)
    written = []

    def feed():
        try:
            with open(fifo, "wb") as f:
                for _ in range(1024):  # 64 MiB at most
                    f.write(bytes(65536))
                    written.append(65536)
        except BrokenPipeError:  # the reader closed it: what it had read was enough
            pass

    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()
    with pytest.raises(GpudiagError, match="invalid load key"):
        load_snapshot(fifo)
    feeder.join(30)
    assert not feeder.is_alive() and sum(written) < MIB, sum(written)


def test_damaged_or_foreign_pickles_are_one_error_line(tmp_path, cli_here):
    data = pickle.dumps(_mixed_snapshot())
    cut = tmp_path / "cut.pickle"
    cut.write_bytes(data[: len(data) // 2])
    assert "not a readable pickle" in _one_error_line(cli_here("analyze", "snapshot", cut))
    text = tmp_path / "text.pickle"
    text.write_text("segments: []\n")
    assert "not a readable pickle" in _one_error_line(cli_here("analyze", "snapshot", text))
    not_snap = _write(tmp_path / "dict.pickle", {"blocks": []})
    assert "not a PyTorch memory snapshot" in _one_error_line(cli_here("analyze", "snapshot", not_snap))
    bad_state = _mixed_snapshot()
    bad_state["segments"][0]["blocks"][0]["state"] = "exploded"
    line = _one_error_line(cli_here("analyze", "snapshot", _write(tmp_path / "state.pickle", bad_state)))
    assert "'exploded'" in line
    assert "not found" in _one_error_line(cli_here("analyze", "snapshot", tmp_path / "absent.pickle"))


def test_html_segment_map_is_self_contained(tmp_path, cli):
    out = tmp_path / "map.html"
    doc = _analyze(cli, _write(tmp_path / "frag.pickle", _swiss_cheese()), "--html", out)
    assert doc["html"] == str(out)
    html = out.read_text()
    assert len(html) > 1_000_000  # plotly.js itself is inlined
    assert "Plotly" in html and "active_allocated" in html and "inactive" in html
    script_srcs = re.findall(r"<script[^>]*\bsrc\s*=\s*[\"']([^\"']*)", html, flags=re.IGNORECASE)
    assert not [s for s in script_srcs if "cdn" in s.lower() or s.startswith("http")], script_srcs


def test_terminal_report_lists_devices_segments_and_findings(tmp_path, cli_here):
    r = cli_here("analyze", "snapshot", _write(tmp_path / "frag.pickle", _swiss_cheese()))
    assert r.returncode == 0, r.stderr
    assert "Caching allocator" in r.stdout and "memory_fragmentation" in r.stdout


@pytest.mark.parametrize("expandable", [False, True], ids=["classic-segments", "expandable-segments"])
def test_the_reference_engine_allocator_snapshot_reads_like_torchs(tmp_path, cli_here, expandable):
    if not (REPO / "reference_engine" / "allocator.py").exists():
        pytest.skip("reference_engine/allocator.py (the simulated caching allocator) is not in this tree yet")
    from gpudiag.reference_engine.allocator import CachingAllocator, DeviceMemory

    alloc = CachingAllocator(DeviceMemory(4 * 2**30), expandable_segments=expandable)
    addrs = [alloc.malloc(2 * MIB) for _ in range(100)]  # 20 MiB segments of ten 2 MiB blocks
    for a in addrs[1::2]:
        alloc.free(a)
    alloc.malloc(200)  # and a small-pool segment
    stats = alloc.stats()
    path = _write(tmp_path / "engine.pickle", {"segments": alloc.snapshot(), "device_traces": []})
    doc = _analyze(cli_here, path)
    assert doc["reserved_bytes"] == stats.reserved_bytes
    assert doc["allocated_bytes"] == stats.allocated_bytes
    assert doc["free_bytes"] == stats.free_reserved_bytes
    assert doc["largest_free_block_bytes"] == stats.largest_free_block_bytes
    assert doc["inactive_split_bytes"] == stats.inactive_split_bytes
    assert doc["segment_count"] == stats.segment_count
    assert [f["kind"] for f in doc["findings"]] == ["memory_fragmentation"]
