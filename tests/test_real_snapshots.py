"""`gpudiag analyze snapshot` on six real PyTorch memory snapshots: the figures MANIFEST.md gives, and the
verdicts a careful engineer would give them.

Reserved, allocated, largest free block and releasable bytes are MANIFEST's (../shared/data/real/MANIFEST.md,
the snapshots table), in MiB as it rounds them. None of the five snapshots without a recorded OOM shows harm:
their free memory is mostly whole free segments (cache that empty_cache returns), and the device's capacity is
not in the snapshot, so stranded memory is at most worth an info line. Constructor-Sun failed a 5063 MiB request
with 133 MiB free in the pool and 91 MiB on the device: capacity, not fragmentation, whatever the unwound pool
showed at the dump.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import real_corpus as rc

from gpudiag.analyzers.snapshot import fragmentation_report
from gpudiag.cli import main
from gpudiag.safe_pickle import load_snapshot

# MANIFEST's figures and the corpus' place: one description, shared with bench/bench_verdicts.py.
MANIFEST = rc.SNAPSHOT_MANIFEST
SNAPSHOTS = rc.real("snapshots")
WITHOUT_OOM = [name for name in MANIFEST if name != rc.SNAPSHOT_WITH_OOM]


def _path(name: str) -> Path:
    path = SNAPSHOTS / name
    if not path.is_file():
        pytest.skip(f"the real snapshots are not here ({SNAPSHOTS.resolve()} lacks {name}); "
                    "they live in ../shared/data/real beside the repository")
    return path


_REPORTS: dict[str, object] = {}


def _report(name: str):
    """The report of one real snapshot, computed once per session (each takes a few tenths of a second)."""
    if name not in _REPORTS:
        _REPORTS[name] = fragmentation_report(load_snapshot(_path(name)))
    return _REPORTS[name]


@pytest.mark.parametrize("name", list(MANIFEST))
def test_reserved_allocated_largest_free_and_releasable_match_the_manifest(name):
    t = _report(name).totals
    figures = (t.reserved_bytes, t.allocated_bytes, t.largest_free_block_bytes, t.releasable_bytes)
    assert tuple(rc.as_manifest_rounds(v, w) for v, w in zip(figures, MANIFEST[name])) == \
        tuple(float(w) for w in MANIFEST[name])
    # free memory is either releasable or stranded, never both, never neither
    assert t.stranded_bytes + t.releasable_bytes == t.free_bytes


@pytest.mark.parametrize("name", WITHOUT_OOM)
def test_no_warning_without_a_failed_allocation_or_a_known_capacity(name):
    # No OOM recorded and torch's snapshot carries no device capacity: no evidence of harm.
    report = _report(name)
    assert report.ooms == []
    assert [f.severity.value for f in report.findings if f.severity.value != "info"] == []
    for f in report.findings:
        assert f.kind == "memory_fragmentation"
        assert "no failed allocation" in f.summary and "capacity is unknown" in f.summary
        assert "paged-kv" not in f.fixes and "chunked-kv" not in f.fixes  # training and plain inference, no KV engine


@pytest.mark.parametrize("name, expected", [
    # 35 MiB stranded of a 128 MiB process: the smallest case; 46 MiB of its free memory is whole segments
    ("real_snapshot_cnn.pickle", "info"),
    # 6.4 GiB stranded (27 %) beside 11 GiB of whole free segments: worth a line, and empty_cache applies
    ("Wedsonlin_medium_1024_training_memory_snapshot.pickle", "info"),
    # 58 MiB free of 1.6 GiB: nothing to say
    ("Wedsonlin_medium_128_inference_memory_snapshot.pickle", None),
    # 166 MiB stranded of 57 GiB; the 5.6 GiB free is whole segments: nothing to say
    ("kkaitlyn111_memory_files_memory_ctx128_fullstep.pickle", None),
    # 1.5 GiB stranded (25 %) beside 2.4 GiB releasable: worth a line
    ("cranberrii_ftcourse.pickle", "info"),
])
def test_each_snapshot_without_an_oom_gets_the_verdict_its_figures_earn(name, expected):
    assert [f.severity.value for f in _report(name).findings] == ([expected] if expected else [])


def test_the_workload_is_read_from_the_frames():
    kinds = {name: _report(name).workload.kind for name in MANIFEST}
    assert kinds == {
        "real_snapshot_cnn.pickle": "training",  # autograd's backward nodes, torch.optim.Adam
        "Wedsonlin_medium_1024_training_memory_snapshot.pickle": "training",
        "Wedsonlin_medium_128_inference_memory_snapshot.pickle": "inference",  # forward frames only
        "kkaitlyn111_memory_files_memory_ctx128_fullstep.pickle": "training",
        "cranberrii_ftcourse.pickle": "training",
        "Constructor-Sun.pickle": "training",  # the optimizer's annotations (the OOM struck in forward)
    }


def test_constructor_sun_is_a_capacity_oom_told_at_its_moment_not_fragmentation():
    report = _report("Constructor-Sun.pickle")
    [oom] = report.ooms
    # MANIFEST: 5063 MiB requested, 133 MiB free in the pool, 91 MiB free on the device
    assert (round(oom.requested_bytes / rc.MIB), round(oom.pool_free_bytes / rc.MIB),
            round(oom.device_free_bytes / rc.MIB)) == (rc.OOM_REQUEST_MIB, rc.OOM_POOL_FREE_MIB, rc.OOM_DEVICE_FREE_MIB)
    assert oom.device == 1 and oom.verdict == "capacity" and oom.replay_error is None
    assert oom.largest_free_block_bytes < oom.requested_bytes  # no hole fitted, but no sum of holes would have
    assert report.settings.expandable_segments is True
    [f] = report.findings  # one finding; nothing about fragmentation at any severity
    assert (f.kind, f.severity.value, f.gpu) == ("oom_forecast", "critical", 1)
    for words in ("5063 MiB request", "133 MiB free in the pool", "91 MiB free on the device",
                  "after the failed step unwound", "expandable segments on", "training workload"):
        assert words in f.summary, words
    assert f.fixes == ["activation-checkpointing", "smaller-micro-batches"]  # a lower peak; no KV, no allocator knob


def test_constructor_sun_through_the_command_line(capsys):
    path = _path("Constructor-Sun.pickle")
    code = main(["analyze", "snapshot", str(path), "--json"])
    out = capsys.readouterr().out
    assert code == 0
    doc = json.loads(out)
    assert [(f["kind"], f["severity"]) for f in doc["findings"]] == [("oom_forecast", "critical")]
    assert doc["allocator_settings"]["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert (doc["stranded_bytes"] + doc["releasable_bytes"], doc["releasable_bytes"] // rc.MIB) == \
        (doc["free_bytes"], 59640)
    code = main(["analyze", "snapshot", str(path)])
    text = capsys.readouterr().out
    assert code == 0
    assert "OOMs, with the pool replayed to their moment" in text and "capacity" in text
    assert "Expandable segments: on (from allocator settings)" in text

