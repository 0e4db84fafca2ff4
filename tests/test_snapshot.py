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

from gpudiag.analyzers.snapshot import fragmentation_report, pool_at
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
    # both segments hold an active block (the small one only a pending free): nothing is releasable
    assert (doc["stranded_bytes"], doc["releasable_bytes"]) == (15 * MIB, 0)
    assert doc["segment_count"] == 2 and doc["block_count"] == 7
    assert doc["blocks_by_state"] == {"active_allocated": 2, "active_pending_free": 2, "inactive": 3}
    seg0, seg1 = doc["segments"]
    assert (seg0["free_bytes"], seg0["largest_free_block_bytes"]) == (14 * MIB, 12 * MIB)
    assert seg0["external_fragmentation_ratio"] == pytest.approx(1 - 12 / 14)
    assert (seg1["pending_free_bytes"], seg1["segment_type"]) == (MIB, "small")
    assert doc["findings"] == []  # one big hole: not fragmented


def _swiss_cheese(oom=False, frames=None, **extra):
    """Ten 20 MiB segments of 2 MiB blocks, every other one free: 100 MiB free, no hole over 2 MiB."""
    segments = []
    for s in range(10):
        base = 0x7F0000000000 + s * 64 * MIB
        segments.append(_segment([
            _block(2 * MIB, "active_allocated" if i % 2 == 0 else "inactive", address=base + i * 2 * MIB)
            for i in range(10)
        ], address=base))
    if frames is not None:
        for seg in segments:
            for b in seg["blocks"]:
                b["frames"] = frames
    trace = [{"action": "alloc", "addr": 0x7F0000000000, "size": 2 * MIB, "stream": 0, "time_us": 5_000_000,
              "frames": frames or []}]
    if oom:
        trace.append({"action": "oom", "size": 6 * MIB, "device_free": 0, "stream": 0, "time_us": 9_000_000,
                      "frames": frames or []})
    return {"segments": segments, "device_traces": [trace], **extra}


def test_holes_without_a_failed_allocation_or_a_known_capacity_are_info_not_a_warning(tmp_path, cli):
    doc = _analyze(cli, _write(tmp_path / "frag.pickle", _swiss_cheese()))
    assert doc["free_bytes"] == 100 * MIB and doc["largest_free_block_bytes"] == 2 * MIB
    assert doc["external_fragmentation_ratio"] == pytest.approx(0.98)
    assert (doc["stranded_bytes"], doc["releasable_bytes"]) == (100 * MIB, 0)
    [f] = doc["findings"]
    assert f["kind"] == "memory_fragmentation" and f["severity"] == "info"
    assert f["runbook"] == alert_name("memory_fragmentation") and f["gpu"] == 0
    assert "no failed allocation" in f["summary"] and "capacity is unknown" in f["summary"]
    assert f["fixes"] == ["expandable-segments"]  # no KV cache in these frames: no paged-kv
    assert f["start_s"] == 5.0


def test_an_oom_whose_request_exceeded_the_largest_hole_while_enough_was_free_is_critical_fragmentation(
        tmp_path, cli_here):
    doc = _analyze(cli_here, _write(tmp_path / "oom.pickle", _swiss_cheese(oom=True)))
    [f] = doc["findings"]
    assert f["kind"] == "memory_fragmentation" and f["severity"] == "critical" and doc["oom_events"] == 1
    [oom] = doc["ooms"]
    assert oom["verdict"] == "fragmentation"
    assert (oom["requested_bytes"], oom["largest_free_block_bytes"], oom["pool_free_bytes"]) == \
        (6 * MIB, 2 * MIB, 100 * MIB)
    assert "6 MiB request found at most a 2 MiB free block while 100 MiB was free" in f["summary"]
    assert (f["start_s"], f["end_s"]) == (9.0, 9.0)  # the moment of the failure
    # harm shown: the split and reclaim settings join expandable segments
    assert f["fixes"] == ["expandable-segments", "max-split-size", "garbage-collection-threshold"]


def test_stranded_memory_near_the_devices_capacity_is_a_warning(tmp_path, cli_here):
    # 200 MiB reserved, half of it stranded in 2 MiB holes, on a device of 210 MiB
    doc = _analyze(cli_here, _write(tmp_path / "near.pickle", _swiss_cheese(device_total_bytes=210 * MIB)))
    [f] = doc["findings"]
    assert f["kind"] == "memory_fragmentation" and f["severity"] == "warning"
    assert "stranded memory near capacity" in f["summary"] and "95% of the device" in f["summary"]
    assert doc["devices"][0]["device_total_bytes"] == 210 * MIB
    # the same snapshot on a device given on the command line, far from full: info
    far = _analyze(cli_here, _write(tmp_path / "far.pickle", _swiss_cheese()), "--device-total-gib", "80")
    [g] = far["findings"]
    assert g["severity"] == "info" and "reserved is 0% of the device's 81920 MiB" in g["summary"]
    near = _analyze(cli_here, _write(tmp_path / "given.pickle", _swiss_cheese()), "--device-total-gib", "0.2")
    assert near["findings"][0]["severity"] == "warning"


def test_whole_free_segments_are_releasable_cache_not_holes(tmp_path, cli_here):
    # eight whole free 20 MiB segments and one in use: 160 MiB free, no hole in use
    whole = [_segment([_block(20 * MIB, "inactive", address=0x7F0000000000 + i * 64 * MIB)],
                      address=0x7F0000000000 + i * 64 * MIB) for i in range(8)]
    used = _segment([_block(19 * MIB, "active_allocated", address=0x7F1000000000),
                     _block(MIB, "inactive", address=0x7F1000000000 + 19 * MIB)], address=0x7F1000000000)
    doc = _analyze(cli_here, _write(tmp_path / "cache.pickle", {"segments": whole + [used], "device_traces": [[]]}))
    assert doc["external_fragmentation_ratio"] == pytest.approx(1 - 20 / 161)  # the old reading: 88 % "holes"
    assert (doc["releasable_bytes"], doc["stranded_bytes"]) == (160 * MIB, MIB)
    assert doc["findings"] == []
    assert [s["releasable"] for s in doc["segments"]] == [True] * 8 + [False]
    text = cli_here("analyze", "snapshot", tmp_path / "cache.pickle").stdout
    assert "releasable (whole free segments)" in text and "stranded (in partly used segments)" in text
    assert "* a whole free segment: releasable cache" in text


def _capacity_snapshot(frames=None, **extra):
    """A step filled four 20 MiB segments, asked for 30 MiB more with 4 MiB left on the device, and
    unwound before the dump: at the dump 78 MiB are free, at the OOM none was."""
    base = 0x7F0000000000
    frames = frames or []
    segments = [_segment([_block(2 * MIB, "active_allocated", address=base), _block(18 * MIB, "inactive",
                                                                                   address=base + 2 * MIB)],
                         address=base)]
    segments += [_segment([_block(20 * MIB, "inactive", address=base + i * 64 * MIB)], address=base + i * 64 * MIB)
                 for i in (1, 2, 3)]
    step = [(base + 2 * MIB, 18 * MIB)] + [(base + i * 64 * MIB, 20 * MIB) for i in (1, 2, 3)]
    trace = [{"action": "alloc", "addr": a, "size": n, "stream": 0, "time_us": 1_000_000, "frames": frames}
             for a, n in step]
    trace.append({"action": "oom", "size": 30 * MIB, "device_free": 4 * MIB, "stream": 0, "time_us": 2_000_000,
                  "frames": frames})
    for a, n in step:
        trace += [{"action": act, "addr": a, "size": n, "stream": 0, "time_us": 3_000_000, "frames": frames}
                  for act in ("free_requested", "free_completed")]
    return {"segments": segments, "device_traces": [trace], **extra}


def test_an_oom_at_capacity_is_capacity_told_at_its_moment_not_from_the_unwound_pool(tmp_path, cli_here):
    doc = _analyze(cli_here, _write(tmp_path / "cap.pickle", _capacity_snapshot()))
    assert doc["free_bytes"] == 78 * MIB and doc["largest_free_block_bytes"] == 20 * MIB  # after unwinding
    [oom] = doc["ooms"]
    assert oom["verdict"] == "capacity" and oom["replay_error"] is None
    assert (oom["pool_reserved_bytes"], oom["pool_free_bytes"], oom["largest_free_block_bytes"]) == (80 * MIB, 0, 0)
    assert (oom["requested_bytes"], oom["device_free_bytes"]) == (30 * MIB, 4 * MIB)
    [f] = doc["findings"]  # no fragmentation finding beside it, at any severity
    assert f["kind"] == "oom_forecast" and f["severity"] == "critical"
    assert f["runbook"] == alert_name("oom_forecast") and f["details"]["time_to_oom_s"] == 0.0
    assert "30 MiB request met 0 MiB free in the pool" in f["summary"] and "4 MiB free on the device" in f["summary"]
    assert "78 MiB free at the dump came only after the failed step unwound" in f["summary"]
    assert f["fixes"] == ["smaller-batches"]  # no frames: not known to be training


def test_capacity_fixes_follow_the_workload_the_frames_show(tmp_path):
    backward = [{"filename": "/site-packages/torch/_tensor.py", "line": 626, "name": "backward"},
                {"filename": "train.py", "line": 40, "name": "train_step"}]
    training = fragmentation_report(_capacity_snapshot(frames=backward))
    assert training.workload.kind == "training"
    assert training.findings[0].fixes == ["activation-checkpointing", "smaller-micro-batches"]
    annotated = fragmentation_report(_capacity_snapshot(
        frames=[{"filename": "infer.py", "line": 3, "name": "forward"}],
        external_annotations=[{"stage": "START", "name": "Optimizer.step#AdamW.step", "device": 0}]))
    assert annotated.workload.kind == "training"
    forward = fragmentation_report(_capacity_snapshot(frames=[{"filename": "infer.py", "line": 3, "name": "forward"}]))
    assert forward.workload.kind == "inference" and forward.findings[0].fixes == ["smaller-batches"]


def test_kv_cache_fixes_only_when_the_frames_show_a_serving_engine_with_a_kv_cache(tmp_path):
    engine = [{"filename": "/site-packages/vllm/worker/cache_engine.py", "line": 80, "name": "_allocate_kv_cache"}]
    served = fragmentation_report(_swiss_cheese(oom=True, frames=engine))
    assert served.workload.kind == "serving" and served.workload.kv_cache
    assert served.findings[0].fixes[-2:] == ["paged-kv", "chunked-kv"]
    plain = fragmentation_report(_swiss_cheese(oom=True, frames=[{"filename": "model.py", "line": 1,
                                                                  "name": "forward"}]))
    assert "paged-kv" not in plain.findings[0].fixes and "chunked-kv" not in plain.findings[0].fixes


def test_expandable_segments_are_noted_and_never_proposed_when_already_on(tmp_path, cli_here):
    settings = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "expandable_segments": True,
                "max_split_size": -1, "garbage_collection_threshold": 0.0}
    doc = _analyze(cli_here, _write(tmp_path / "exp.pickle", _swiss_cheese(oom=True, allocator_settings=settings)))
    assert doc["allocator_settings"]["expandable_segments"] is True
    assert doc["allocator_settings"]["expandable_segments_source"] == "allocator_settings"
    [f] = doc["findings"]
    assert "expandable segments on" in f["summary"]
    assert f["fixes"] == ["garbage-collection-threshold"]  # max_split_size_mb is ignored under expandable segments
    # older snapshots say it only per segment
    snap = _swiss_cheese()
    for seg in snap["segments"]:
        seg["is_expandable"] = True
    report = fragmentation_report(snap)
    assert (report.settings.expandable_segments, report.settings.expandable_segments_source) == (True, "segments")
    assert report.findings[0].fixes == []
    text = cli_here("analyze", "snapshot", _write(tmp_path / "seg.pickle", snap)).stdout
    assert "Expandable segments: on (from segments)" in text


def test_mapped_and_unmapped_ranges_of_expandable_segments_replay_to_the_oom():
    base = 0x7F0000000000
    seg = _segment([_block(20 * MIB, "active_allocated", address=base),
                    _block(20 * MIB, "inactive", address=base + 20 * MIB)], address=base, expandable=True)
    ev = [("segment_map", base, 60 * MIB), ("alloc", base, 20 * MIB), ("alloc", base + 20 * MIB, 40 * MIB),
          ("oom", 2 * MIB, 30 * MIB), ("free_requested", base + 20 * MIB, 40 * MIB),
          ("free_completed", base + 20 * MIB, 40 * MIB), ("segment_unmap", base + 40 * MIB, 20 * MIB)]
    trace = [{"action": a, "addr": x, "size": n, "stream": 0} for a, x, n in ev]
    trace[3] = {"action": "oom", "addr": 2 * MIB, "size": 30 * MIB, "stream": 0}  # the C++ spelling: addr = free
    at_oom = pool_at([seg], 0, trace, 3)
    assert (at_oom["reserved_bytes"], at_oom["active_bytes"], at_oom["free_bytes"]) == (60 * MIB, 60 * MIB, 0)
    before_all = pool_at([seg], 0, trace, -1)
    assert before_all["reserved_bytes"] == 0
    [oom] = fragmentation_report({"segments": [seg], "device_traces": [trace]}).ooms
    assert (oom.device_free_bytes, oom.verdict) == (2 * MIB, "capacity")


def test_a_trace_that_does_not_replay_onto_the_segments_leaves_the_oom_undetermined(tmp_path, cli_here):
    snap = _swiss_cheese(oom=True)
    # an allocation after the OOM that the segments do not hold: the trace was cut or edited
    snap["device_traces"][0].append({"action": "alloc", "addr": 0x7E0000000000, "size": MIB, "stream": 0,
                                     "time_us": 9_500_000})
    doc = _analyze(cli_here, _write(tmp_path / "cut.pickle", snap))
    [oom] = doc["ooms"]
    assert oom["verdict"] == "undetermined" and "does not replay" in oom["replay_error"]
    [f] = doc["findings"]
    assert f["severity"] == "critical" and "cannot be told apart" in f["summary"]


def test_a_device_capacity_that_is_not_a_positive_number_is_one_error_line(tmp_path, cli_here):
    path = _write(tmp_path / "s.pickle", _swiss_cheese())
    for bad in ("0", "-1", "nan", "inf"):
        assert "--device-total-gib" in _one_error_line(cli_here("analyze", "snapshot", path,
                                                                "--device-total-gib", bad))


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
    assert "Plotly" in html and "active_allocated" in html and "inactive: stranded" in html
    assert "MiB stranded" in html and "MiB releasable" in html
    script_srcs = re.findall(r"<script[^>]*\bsrc\s*=\s*[\"']([^\"']*)", html, flags=re.IGNORECASE)
    assert not [s for s in script_srcs if "cdn" in s.lower() or s.startswith("http")], script_srcs


def test_terminal_report_lists_devices_segments_and_findings(tmp_path, cli_here):
    r = cli_here("analyze", "snapshot", _write(tmp_path / "frag.pickle", _swiss_cheese()))
    assert r.returncode == 0, r.stderr
    assert "Caching allocator" in r.stdout and "memory_fragmentation" in r.stdout


@pytest.mark.parametrize("expandable", [False, True], ids=["classic-segments", "expandable-segments"])
def test_the_reference_engine_allocator_snapshot_reads_like_torchs(tmp_path, cli_here, expandable):
    from gpudiag.reference_engine.core.allocator import CachingAllocator, DeviceMemory

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
    # half of a 200 MiB pool in 2 MiB holes on a 4 GiB device, nothing failed: worth a line, no more
    assert [(f["kind"], f["severity"]) for f in doc["findings"]] == [("memory_fragmentation", "info")]
