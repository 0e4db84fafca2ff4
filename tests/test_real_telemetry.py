"""Real recorded telemetry through `gpudiag investigate --file`, judged as an on-call engineer would.

The files (../shared/data/real/series, MANIFEST.md there) come from healthy
single-job runs: nvidia-smi logs of six machines, one dcgm-exporter scrape of
247 H100s, and Alibaba's production per-pod GPU trace (model swaps drop
memory by more than 10 GB as a matter of routine). None of them holds a
fault, so none may earn a warning; what each lacks (no per-process memory,
no engine, no host) is said as a gap, not guessed.

Counts are measured here independently of gpudiag: lines per file, and for
the interleaved log the lines a strict pattern of nvidia-smi's own output
rejects.
"""

from __future__ import annotations

import csv
import json
import os
import re

import pytest
from recorded_telemetry import alibaba_openmetrics, real

UTC_ENV = {**os.environ, "TZ": "UTC"}
# Exactly what `nvidia-smi --query-gpu=timestamp,name,utilization.gpu,utilization.memory,temperature.gpu
# --format=csv` writes for this GPU: anything else in that log is two writers' bytes spliced together.
STRICT_A100_LINE = re.compile(r"\d{4}/\d{2}/\d{2} \d{2}:\d{2}:\d{2}\.\d{3}, NVIDIA A100-SXM4-80GB, "
                              r"\d{1,3} %, \d{1,3} %, \d{1,3}\Z")


def _investigate(cli, *paths) -> tuple[int, dict]:
    args = ["investigate"] + [a for p in paths for a in ("--file", str(p))] + ["--json"]
    p = cli(*args, env=UTC_ENV)
    assert p.returncode in (0, 1, 3), p.stderr  # 3: nothing found, some analyzers blind (no engine, no allocator)
    return p.returncode, json.loads(p.stdout)


def _data_lines(path) -> list[str]:
    lines = [ln.rstrip("\n") for ln in open(path, encoding="utf-8", errors="replace") if ln.strip()]
    return lines[1:] if lines[0].lower().startswith("timestamp") else lines


def _no_harm(rc: int, doc: dict) -> None:
    """A healthy run: nothing of warning level or above, and the blind spots named -- exit 3, inconclusive:
    a GPU log has no engine, allocator or process view, so nothing found is not everything checked."""
    serious = [(f["kind"], f["severity"], f["summary"]) for f in doc["findings"]
               if f["severity"] in ("warning", "critical")]
    assert not serious and rc == 3 and not doc["coverage"]["conclusive"], serious
    gaps = {g["check"] for g in doc["gaps"]}
    assert {"per-process driver memory (black)", "caching allocator (white, grey)", "serving engine"} <= gaps


# file, GPUs, their name (None: the log does not say), fields the log names
NVIDIA_SMI_LOGS = [
    ("akrammoustafa__V100S__gpu_usage_a.log", 1, "Tesla V100S-PCIE-32GB", "memory.total"),
    ("beam11221_plato__gpu_log.csv", 1, None, "memory.free"),
    ("eobo0530_vlm_optimization__RTX4090__gpu_log.csv", 1, "NVIDIA GeForce RTX 4090", "power.draw"),
    ("singroup_ters_gen__H200__gpu_usage.log", 1, "NVIDIA H200", "temperature.gpu"),
    ("xypp3_gpu_glasses__8x80GB__nvidia_smi.csv", 8, None, "memory.total"),
]


@pytest.mark.parametrize("name, gpus, gpu_name, field", NVIDIA_SMI_LOGS)
def test_a_healthy_nvidia_smi_log_earns_no_warning_and_every_line_is_read(cli, name, gpus, gpu_name, field):
    path = real("nvidia-smi", name)
    rc, doc = _investigate(cli, path)
    _no_harm(rc, doc)
    (read,) = doc["files"]
    assert read["format"] == "nvidia-smi" and read["skipped_lines"] == 0
    assert read["rows"] == len(_data_lines(path))
    assert len(read["gpus"]) == gpus and {g.get("name") for g in read["gpus"]} == {gpu_name}
    assert field in read["columns"]


def test_a_headerless_log_is_named_from_its_values(cli):
    rc, doc = _investigate(cli, real("nvidia-smi", "beam11221_plato__gpu_log.csv"))
    read = doc["files"][0]
    # Its MiB pair sums to ~20148 MiB on every line (used + free of a 20 GB card); % columns by which is busier.
    assert read["inferred_columns"] and read["columns"] == [
        "timestamp", "utilization.gpu", "utilization.memory", "memory.used", "memory.free", "temperature.gpu",
        "power.draw"]


def test_eight_gpus_are_told_apart_by_the_column_that_differs_within_a_timestamp(cli):
    rc, doc = _investigate(cli, real("nvidia-smi", "xypp3_gpu_glasses__8x80GB__nvidia_smi.csv"))
    read = doc["files"][0]
    assert sorted(g["gpu"] for g in read["gpus"]) == list(range(8))
    assert any(u.startswith("index (column 3)") for u in read["unread_columns"]), read["unread_columns"]


def test_the_interleaved_log_skips_exactly_the_spliced_lines_and_keeps_its_loggers_apart(cli):
    path = real("nvidia-smi", "singroup_ters_gen__A100__bash_gpu_usage__INTERLEAVED_CORRUPT.log")
    data = _data_lines(path)
    spliced = [ln for ln in data if not STRICT_A100_LINE.match(ln)]
    rc, doc = _investigate(cli, path)
    _no_harm(rc, doc)
    (read,) = doc["files"]
    assert read["skipped_lines"] == len(spliced) == 38
    assert read["rows"] == len(data) - len(spliced)
    assert read["first_skipped"].startswith(f"line {data.index(spliced[0]) + 2}: ")
    # The lines' time goes back: several loggers wrote at once; each is its own series, not a sawtooth.
    assert any("time went back" in n for n in read["notes"])
    assert len(read["gpus"]) >= 3 and {(g["gpu"], g["name"]) for g in read["gpus"]} == {(0, "NVIDIA A100-SXM4-80GB")}
    assert sum(g["rows"] for g in read["gpus"]) == read["rows"]


def test_the_dcgm_scrape_of_247_h100s_earns_no_warning(cli):
    path = real("dcgm", "dcgm_metrics_20250718_134233.csv")
    rows = list(csv.DictReader(open(path, newline="")))
    rc, doc = _investigate(cli, path)
    _no_harm(rc, doc)
    (read,) = doc["files"]
    assert read["format"] == "dcgm-csv" and read["rows"] == len(rows) == 2470 and read["skipped_lines"] == 0
    assert len(read["gpus"]) == len({(r["Hostname"], r["gpu_id"]) for r in rows}) == 247
    assert len({g["node"] for g in read["gpus"]}) == 31
    assert {(g["name"], g["driver_version"]) for g in read["gpus"]} == {("NVIDIA H100 80GB HBM3", "535.129.03")}
    assert set(read["unread_series"]) == {"DCGM_FI_DEV_DEC_UTIL", "DCGM_FI_DEV_ENC_UTIL"}  # no catalog column
    assert "driver view (NVML)" not in {g["check"] for g in doc["gaps"]}


def test_alibabas_model_swaps_are_no_leak_and_no_oom_forecast(cli, tmp_path):
    path = tmp_path / "alibaba_pods.om"
    wrote = alibaba_openmetrics(path)
    rc, doc = _investigate(cli, path)
    (read,) = doc["files"]
    assert read["format"] == "openmetrics" and read["rows"] == wrote["samples"] and read["skipped_lines"] == 0
    assert len(read["gpus"]) == wrote["pods"] == 65  # one GPU per pod: the pod is the only identity it has
    assert read["end_s"] - read["start_s"] == pytest.approx(22.8 * 3600, rel=0.01)
    memory = [f for f in doc["findings"] if f["kind"] in ("memory_leak", "oom_forecast")]
    assert not memory, memory
    _no_harm(rc, doc)
    # dcgm-exporter's device memory is no process's memory: the leak and OOM analyzers say they were blind.
    black = next(g for g in doc["gaps"] if g["check"] == "per-process driver memory (black)")
    assert "memory_leak" in black["analyzers"]
