"""`gpudiag investigate --file`: recorded telemetry through the same window and analyzers.

Small logs written here in each format (nvidia-smi with and without header
and units, several GPUs, spliced lines; dcgm-exporter long CSV and text;
OpenMetrics; folders of vLLM scrapes), read in-process for their values and
through the real command line for its answers and exit codes. Timestamps
without an offset are local time: everything here runs with TZ=UTC.
"""

from __future__ import annotations

import gzip
import json
import os
import time
from pathlib import Path

import pytest

from gpudiag import file_source
from gpudiag.errors import GpudiagError

MIB = 1 << 20
T0 = 1_750_000_000  # 2025-06-15T15:06:40Z
UTC_ENV = {**os.environ, "TZ": "UTC"}


@pytest.fixture(autouse=True)
def utc(monkeypatch):
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def _stamp(t: float) -> str:
    """nvidia-smi's timestamp (local time: UTC here)."""
    return time.strftime("%Y/%m/%d %H:%M:%S", time.gmtime(t)) + f".{int(round((t % 1) * 1000)):03d}"


def _write(tmp: Path, name: str, text: str) -> Path:
    path = tmp / name
    path.write_text(text)
    return path


def _load(*paths: Path, **kw):
    return file_source.load_window([str(p) for p in paths], **kw)


def _investigate(cli, *args):
    p = cli("investigate", *map(str, args), env=UTC_ENV)
    return p


def _one_error_line(p, *needles: str) -> str:
    assert p.returncode == 2, p.stdout + p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


# --- nvidia-smi ------------------------------------------------------------------------------------------

HEADER = ("timestamp, index, name, utilization.gpu [%], utilization.memory [%], memory.used [MiB], "
          "memory.total [MiB], power.draw [W], temperature.gpu, clocks.sm [MHz], pstate, "
          "clocks_throttle_reasons.active")


def _full_log(n: int = 60, gpus: int = 2) -> str:
    lines = [HEADER]
    for i in range(n):
        for g in range(gpus):
            lines.append(f"{_stamp(T0 + i)}, {g}, NVIDIA A100-SXM4-80GB, {45 + g} %, 12 %, {1129 + g} MiB, 81920 MiB, "
                         f"33.09 W, {41 + g}, 1410 MHz, P0, 0x0000000000000004")
    return "\n".join(lines) + "\n"


def test_an_nvidia_smi_log_with_header_and_units_becomes_si_columns_per_gpu(tmp_path):
    window, reads = _load(_write(tmp_path, "node-a.log", _full_log()))
    gpu = window.table("gpu")
    assert set(gpu["gpu"]) == {0, 1} and set(gpu["node"]) == {"node-a"}  # node: the file's stem
    row = gpu[gpu["gpu"] == 1].iloc[10]
    assert row["gpu_utilization_ratio"] == pytest.approx(0.46)
    assert row["gpu_memory_utilization_ratio"] == pytest.approx(0.12)
    assert row["gpu_memory_used_bytes"] == 1130 * MIB and row["gpu_memory_total_bytes"] == 81920 * MIB
    assert row["gpu_power_watts"] == pytest.approx(33.09) and row["gpu_temperature_celsius"] == 42
    assert row["gpu_sm_clock_hertz"] == pytest.approx(1.41e9) and row["gpu_performance_state"] == 0
    assert row["gpu_clock_throttle_active"]["sw_power_cap"] == 1
    assert row["gpu_clock_throttle_active"]["hw_slowdown"] == 0
    assert row["name"] == "NVIDIA A100-SXM4-80GB"
    read = reads[0]
    assert (read.format, read.rows, read.skipped_lines) == ("nvidia-smi", 120, 0)
    assert [(g["gpu"], g["name"]) for g in read.gpus] == [(0, "NVIDIA A100-SXM4-80GB"), (1, "NVIDIA A100-SXM4-80GB")]
    assert window.start_s == T0 and window.end_s == T0 + 59


def test_the_same_samples_in_another_field_order_and_without_units_read_the_same(tmp_path):
    lines = ["timestamp, memory.used [MiB], index, utilization.gpu [%], power.draw [W]"]  # --format=csv,nounits
    for i in range(30):
        lines += [f"{_stamp(T0 + i)}, 1129, 0, 45, 33.09", f"{_stamp(T0 + i)}, 1130, 1, 46, 33.09"]
    window, _ = _load(_write(tmp_path, "nounits.csv", "\n".join(lines) + "\n"))
    gpu = window.table("gpu")
    row = gpu[gpu["gpu"] == 1].iloc[5]
    assert row["gpu_utilization_ratio"] == pytest.approx(0.46) and row["gpu_memory_used_bytes"] == 1130 * MIB
    assert row["gpu_power_watts"] == pytest.approx(33.09)
    assert "gpu_memory_total_bytes" not in gpu  # used alone says nothing of the capacity


def test_a_headerless_log_has_its_columns_named_from_their_values_and_the_rest_listed(tmp_path):
    # utilization.gpu, utilization.memory, memory.used, memory.free, temperature, power, an SM clock
    lines = []
    for i in range(40):
        used = 2 if i < 10 else 10245
        busy = 0 if i < 10 else 80
        lines.append(f"{_stamp(T0 + 5 * i)}, {busy} %, {busy // 2} %, {used} MiB, {20148 - used} MiB, "
                     f"{27 + i % 5}, 11.64 W, 1410 MHz")
    window, reads = _load(_write(tmp_path, "noheader.csv", "\n".join(lines) + "\n"))
    read = reads[0]
    assert read.inferred_columns
    assert read.columns == ["timestamp", "utilization.gpu", "utilization.memory", "memory.used", "memory.free",
                            "temperature.gpu", "power.draw", None]
    assert any(u.startswith("column 8") and "clock" in u for u in read.unread_columns), read.unread_columns
    row = window.table("gpu").iloc[-1]
    assert row["gpu_utilization_ratio"] == pytest.approx(0.8)
    assert row["gpu_memory_used_bytes"] == 10245 * MIB
    assert row["gpu_memory_total_bytes"] == 20148 * MIB  # used + free where the log has no total


def test_an_index_column_that_repeats_within_a_timestamp_is_not_taken_for_the_gpu(tmp_path):
    lines = ["timestamp,gpu,index,memory.used,memory.total,power.draw,temperature.gpu"]  # a hand-written header
    for i in range(5):
        for g in range(4):
            lines.append(f"2025-09-08T17:26:{50 + i}+08:00,{g}, 0, 4, 81559, {72 + g}.5, 33")
    window, reads = _load(_write(tmp_path, "eight.csv", "\n".join(lines) + "\n"))
    gpu = window.table("gpu")
    assert sorted(set(gpu["gpu"])) == [0, 1, 2, 3]
    assert gpu[gpu["gpu"] == 3]["gpu_power_watts"].iloc[0] == pytest.approx(75.5)
    assert gpu["gpu_memory_total_bytes"].iloc[0] == 81559 * MIB  # bare numbers in nvidia-smi's units (MiB)
    assert window.start_s == pytest.approx(1757323610.0)  # +08:00 honoured
    assert any(u.startswith("index") and "not the GPU index" in u for u in reads[0].unread_columns)


def test_na_and_not_supported_values_are_missing_not_corrupt(tmp_path):
    lines = ["timestamp, name, utilization.gpu [%], power.draw [W], fan.speed [%]"]
    for i in range(20):
        lines.append(f"{_stamp(T0 + i)}, Tesla V100S-PCIE-32GB, {i} %, [N/A], [Not Supported]")
    window, reads = _load(_write(tmp_path, "na.log", "\n".join(lines) + "\n"))
    assert reads[0].skipped_lines == 0 and reads[0].rows == 20
    gpu = window.table("gpu")
    assert "gpu_power_watts" not in gpu and gpu["gpu_utilization_ratio"].iloc[-1] == pytest.approx(0.19)


def _spliced_log() -> tuple[str, int]:
    """One logger, then two writing at once (their 4 KB blocks interleaved), with spliced lines between."""
    good = lambda t, u: f"{_stamp(t)}, NVIDIA A100-SXM4-80GB, {u} %, 0 %, 30"  # noqa: E731
    lines = ["timestamp, name, utilization.gpu [%], utilization.memory [%], temperature.gpu"]
    lines += [good(T0 + 2 * i, 0) for i in range(300)]  # 10 minutes of the first logger
    spliced = ["0 %, 35 %, 33",  # the tail of a line whose head another writer overwrote
               f"{_stamp(T0 + 100)}, NVIDIA A1028",
               f"{_stamp(T0 + 102)}, NVI{good(T0 + 230, 5)}",
               f"{_stamp(T0 + 104)}, NVIDIA A100-SXM4-80GB, 5 %,0 %, 28",  # a lone comma: two lines joined
               f"{_stamp(T0 + 106)}, NVIDIA A100-SXM4-880GB, 2 %, 0 %, 29",  # a name no GPU has
               "2025/06/4, NVIDIA A100-SXM4-80GB, 38 %, 13 %, 30"]
    for block in range(4):  # the other two loggers, 30 lines each turn, 2 minutes apart in time
        lines += [good(T0 + 240 + 2 * (30 * block + i), 50) for i in range(30)]
        lines.append(spliced[block])
        lines += [good(T0 + 120 + 2 * (30 * block + i) + 1, 20) for i in range(30)]
    lines += spliced[4:]
    return "\n".join(lines) + "\n", len(spliced)


def test_spliced_lines_are_skipped_and_counted_and_loggers_writing_at_once_kept_apart(tmp_path):
    text, n_spliced = _spliced_log()
    window, reads = _load(_write(tmp_path, "shared.log", text))
    read = reads[0]
    assert read.skipped_lines == n_spliced
    assert read.first_skipped.startswith("line 332: 3 fields where the log has 5")
    assert read.rows == 300 + 8 * 30
    nodes = sorted(g["node"] for g in read.gpus)
    assert nodes == ["shared", "shared#2", "shared#3"], read.gpus
    assert any("time went back" in n for n in read.notes)
    # Each logger's GPU holds its own values: no sawtooth of three GPUs in one series.
    by_node = window.table("gpu").groupby("node")["gpu_utilization_ratio"].agg(["min", "max"])
    assert by_node.loc["shared"].tolist() == [0.0, 0.0]
    assert sorted(map(tuple, by_node.loc[["shared#2", "shared#3"]].round(3).values.tolist())) == [(0.2, 0.2),
                                                                                                  (0.5, 0.5)]


def test_the_report_shows_each_file_with_its_skipped_lines(cli, tmp_path):
    path = _write(tmp_path, "shared.log", _spliced_log()[0])
    p = _investigate(cli, "--file", path)
    assert p.returncode == 3, p.stderr  # nothing found; the analyzers that need an engine could not judge
    # The console wraps long lines, inside a long path too: compare without whitespace.
    text = "".join(p.stdout.split())
    want = f"{path}: nvidia-smi, 540 rows, 3 GPUs on 3 nodes (NVIDIA A100-SXM4-80GB); 6 lines skipped " \
           f"(first: line 332: 3 fields where the log has 5"
    assert "".join(want.split()) in text, p.stdout
    p = _investigate(cli, "--file", path, "--json")
    doc = json.loads(p.stdout)
    assert doc["sources"] == [f"file:{path}"]
    (read,) = doc["files"]
    assert read["path"] == str(path) and read["format"] == "nvidia-smi"
    assert read["rows"] == 540 and read["skipped_lines"] == 6 and read["first_skipped"].startswith("line 332")


def test_a_gzipped_log_is_read_by_its_content(tmp_path):
    path = tmp_path / "gpu.log.gz"
    path.write_bytes(gzip.compress(_full_log(n=10, gpus=1).encode()))
    window, reads = _load(path)
    assert reads[0].format == "nvidia-smi" and reads[0].rows == 10
    assert set(window.table("gpu")["node"]) == {"gpu"}


def test_an_overlong_line_is_skipped_not_held(tmp_path):
    text = _full_log(n=10, gpus=1)
    head, rest = text.split("\n", 3)[:3], text.split("\n", 3)[3]
    path = _write(tmp_path, "long.log", "\n".join(head) + "\n" + "9" * (1 << 20) + "\n" + rest)
    _, reads = _load(path)
    assert reads[0].rows == 10 and reads[0].skipped_lines == 1
    assert reads[0].first_skipped.startswith("line 4: longer than")


def test_progress_is_reported_by_bytes_on_a_long_read(tmp_path):
    path = _write(tmp_path, "big.log", _full_log(n=40000, gpus=1))  # about 5 MB
    seen = []
    _load(path, progress=lambda what, done, total: seen.append((what, done, total)))
    size = path.stat().st_size
    assert seen and all(what == "reading big.log" and total == size for what, _, total in seen)
    assert [d for _, d, _ in seen] == sorted(d for _, d, _ in seen) and seen[-1][1] == size


# --- dcgm-exporter and OpenMetrics ----------------------------------------------------------------------

DCGM_LABELS = ('DCGM_FI_DRIVER_VERSION="535.129.03",Hostname="{host}",UUID="GPU-{host}-{g}",device="nvidia{g}",'
               'gpu="{g}",modelName="NVIDIA H100 80GB HBM3"')


def test_dcgm_long_csv_gives_each_host_its_gpus_with_names(tmp_path):
    rows = ["timestamp,metric_name,gpu_id,device,uuid,modelName,Hostname,container,pod,namespace,value,labels_raw"]
    for host in ("dgx-1", "dgx-2"):
        for g in range(2):
            labels = DCGM_LABELS.format(host=host, g=g).replace('"', '""')
            for metric, value in (("DCGM_FI_DEV_GPU_UTIL", 45), ("DCGM_FI_DEV_FB_USED", 1000),
                                  ("DCGM_FI_DEV_FB_FREE", 80000), ("DCGM_FI_DEV_DEC_UTIL", 0)):
                rows.append(f'"2025-07-18T20:42:3{g}Z","{metric}","{g}","nvidia{g}","GPU-{host}-{g}",'
                            f'"NVIDIA H100 80GB HBM3","{host}","","","","{value}","{labels}"')
    window, reads = _load(_write(tmp_path, "dump.csv", "\n".join(rows) + "\n"))
    read = reads[0]
    assert read.format == "dcgm-csv" and read.rows == 16 and read.unread_series == ["DCGM_FI_DEV_DEC_UTIL"]
    assert [(g["node"], g["gpu"], g["name"]) for g in read.gpus] == [
        (h, g, "NVIDIA H100 80GB HBM3") for h in ("dgx-1", "dgx-2") for g in (0, 1)]
    gpu = window.table("gpu")
    last = gpu[(gpu["node"] == "dgx-2") & (gpu["gpu"] == 1)].iloc[-1]
    assert last["gpu_utilization_ratio"] == pytest.approx(0.45)
    assert last["gpu_memory_used_bytes"] == 1000 * MIB and last["gpu_memory_total_bytes"] == 81000 * MIB
    assert last["driver_version"] == "535.129.03" and last["uuid"] == "GPU-dgx-2-1"


def _dcgm_text(scrapes: int, stamp_ms: int | None = None) -> str:
    out = []
    for k in range(scrapes):
        out.append("# HELP DCGM_FI_DEV_GPU_TEMP GPU temperature (in C).\n# TYPE DCGM_FI_DEV_GPU_TEMP gauge")
        for g in range(2):
            ts = "" if stamp_ms is None else f" {stamp_ms + 15000 * k}"
            out.append(f"DCGM_FI_DEV_GPU_TEMP{{{DCGM_LABELS.format(host='dgx-9', g=g)}}} {60 + k}{ts}")
        out.append("# TYPE DCGM_FI_DEV_POWER_USAGE gauge")
        for g in range(2):
            ts = "" if stamp_ms is None else f" {stamp_ms + 15000 * k}"
            out.append(f"DCGM_FI_DEV_POWER_USAGE{{{DCGM_LABELS.format(host='dgx-9', g=g)}}} 310.5{ts}")
    return "\n".join(out) + "\n"


def test_dcgm_text_exposition_one_scrape_without_timestamps_is_at_the_files_time(tmp_path):
    path = _write(tmp_path, "dcgm.txt", _dcgm_text(1))
    os.utime(path, (T0, T0))
    window, reads = _load(path)
    assert reads[0].format == "prometheus-text" and reads[0].rows == 4
    assert window.start_s == window.end_s == T0
    gpu = window.table("gpu")
    assert sorted(set(gpu["gpu"])) == [0, 1] and set(gpu["node"]) == {"dgx-9"}
    assert gpu["gpu_temperature_celsius"].iloc[0] == 60 and gpu["gpu_power_watts"].iloc[0] == pytest.approx(310.5)


def test_concatenated_scrapes_without_timestamps_are_placed_a_collection_interval_apart(tmp_path):
    path = _write(tmp_path, "dcgm.txt", _dcgm_text(3))
    os.utime(path, (T0, T0))
    window, reads = _load(path)
    assert reads[0].scrapes == 3 and any("no timestamps" in n for n in reads[0].notes)
    gap = file_source.exposition.DEFAULT_SCRAPE_INTERVAL_S
    assert (window.start_s, window.end_s) == (T0 - 2 * gap, T0)
    temps = window.table("gpu").sort_values("t")["gpu_temperature_celsius"].tolist()
    assert temps[0] == 60 and temps[-1] == 62


def test_scrapes_with_millisecond_timestamps_are_at_their_own_times(tmp_path):
    window, reads = _load(_write(tmp_path, "dcgm.prom", _dcgm_text(3, stamp_ms=T0 * 1000)))
    assert reads[0].format == "prometheus-text"
    assert (window.start_s, window.end_s) == (T0, T0 + 30)


def test_openmetrics_backfill_gives_the_storm_the_slowdown_and_the_xid_that_prometheus_gives(cli, tmp_path):
    from prometheus_support import openmetrics_text
    from test_investigate_prometheus import HEAT, NODE, STORM, XID_AT, _openmetrics

    path = _write(tmp_path, "series.om", openmetrics_text(_openmetrics(T0)))
    p = _investigate(cli, "--file", path, "--json")
    assert p.returncode == 1, p.stderr
    doc = json.loads(p.stdout)
    assert doc["files"][0]["format"] == "openmetrics"
    by_kind = {}
    for f in doc["findings"]:
        by_kind.setdefault(f["kind"], f)
    storm = by_kind["kv_eviction_storm"]
    assert storm["severity"] == "critical" and storm["node"] == NODE
    assert T0 + STORM[0] - 120 <= storm["start_s"] and storm["end_s"] <= T0 + STORM[1] + 120
    ev = {e["metric"]: e for e in storm["evidence"]}
    assert ev["tpot_p99_seconds"]["observed"] >= 3 * ev["tpot_p99_seconds"]["baseline"]
    heat = by_kind["throttling"]
    assert heat["severity"] == "critical" and heat["gpu"] == 0 and "hw_thermal_slowdown" in heat["summary"]
    assert T0 + HEAT[0] - 10 <= heat["start_s"] and heat["end_s"] <= T0 + HEAT[1] + 10
    xid = by_kind["hardware_errors"]
    assert any("xid=79" in e["metric"] for e in xid["evidence"]) and xid["start_s"] >= T0 + XID_AT - 10
    # The quarter hour without dcgm-exporter samples is a gap of the file.
    assert any(g["check"] == "source" and f"of node {NODE}" in g["reason"] for g in doc["gaps"]), doc["gaps"]


# --- folders of scrapes ---------------------------------------------------------------------------------


def _vllm_page(i: int) -> str:
    from test_engine_scrape import _v1

    return _v1(preemptions=float(i), b=(10.0 * i, 18.0 * i, 20.0 * i), ttft_sum=4.0 * i)


def test_a_folder_of_vllm_scrapes_is_read_at_the_times_in_their_names(tmp_path):
    folder = tmp_path / "vllm-node"
    folder.mkdir()
    for i in range(40):
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(T0 + 15 * i))
        (folder / f"metrics-{stamp}.txt").write_text(_vllm_page(i))
    (folder / "README").write_text("scraped every 15 s with curl\n")
    window, reads = _load(folder)
    read = reads[0]
    assert read.format == "scrape-folder" and read.scrapes == 40
    assert any("time in its file name" in n for n in read.notes) and any("no scrape" in n for n in read.notes)
    assert (window.start_s, window.end_s) == (T0, T0 + 15 * 39)
    engine = window.table("engine")
    assert set(engine["node"]) == {"vllm-node"} and engine["num_requests_running"].iloc[-1] == 12
    assert engine["kv_cache_usage_perc"].iloc[-1] == pytest.approx(0.93)
    assert engine["num_preemptions_total"].iloc[-1] == 39
    summary = engine["time_to_first_token_seconds"].dropna().iloc[-1]["window"]
    assert summary["count"] == pytest.approx(80.0) and 0.1 < summary["p99"] <= 2.5
    assert "python_gc_objects_collected_total" in read.unread_series


def test_a_folder_of_scrapes_without_times_in_their_names_is_read_at_their_modification_times(tmp_path):
    folder = tmp_path / "scrapes"
    folder.mkdir()
    for i in range(10):
        path = folder / f"scrape-{i:03d}.prom"
        path.write_text(_vllm_page(i))
        os.utime(path, (T0 + 15 * i, T0 + 15 * i))
    window, reads = _load(folder)
    assert (window.start_s, window.end_s) == (T0, T0 + 135)
    assert any("modification time" in n for n in reads[0].notes)


# --- the window and the command line --------------------------------------------------------------------


def test_from_and_to_select_within_the_file_and_since_counts_back_from_its_last_sample(cli, tmp_path):
    path = _write(tmp_path, "gpu.log", _full_log(n=600, gpus=1))
    window, _ = _load(path, start=str(T0 + 100), end=str(T0 + 200))
    assert (window.start_s, window.end_s) == (T0 + 100, T0 + 200)
    window, _ = _load(path, since="2m")
    assert (window.start_s, window.end_s) == (T0 + 599 - 120, T0 + 599)
    window, _ = _load(path)
    assert (window.start_s, window.end_s) == (T0, T0 + 599)  # the whole file, whenever it was recorded
    p = _investigate(cli, "--file", path, "--from", str(T0 + 7200), "--to", str(T0 + 7300))
    _one_error_line(p, "no data between", "the files hold")


def test_node_and_gpu_select_rows_and_unknown_ones_are_named(tmp_path):
    path = _write(tmp_path, "box.log", _full_log(n=20, gpus=2))
    window, _ = _load(path, node="box", gpu=1)
    assert set(window.table("gpu")["gpu"]) == {1} and window.node == "box"
    with pytest.raises(GpudiagError, match="no node 'other' in the files; nodes there: box"):
        _load(path, node="other")
    with pytest.raises(GpudiagError, match="no GPU 5"):
        _load(path, gpu=5)


def test_an_unknown_format_names_the_formats_it_reads_and_exits_2(cli, tmp_path):
    path = _write(tmp_path, "trace.csv", "value,timestamp_anon,container_ip\n0.0,1662858720.0,ae33\n")
    line = _one_error_line(_investigate(cli, "--file", path), "not a format gpudiag reads")
    for fmt in ("nvidia-smi", "dcgm-exporter", "Prometheus text", "OpenMetrics", "folder of /metrics scrapes"):
        assert fmt in line, line


@pytest.mark.parametrize("make, message", [
    (lambda tmp: tmp / "absent.log", "no such file"),
    (lambda tmp: _write(tmp, "empty.log", ""), "is empty"),
    (lambda tmp: _write(tmp, "blank.log", "\n\n  \n"), "no line of telemetry"),
    (lambda tmp: (tmp / "nothing").mkdir() or _write(tmp / "nothing", "notes.txt", "hello\n").parent,
     "a folder without /metrics scrapes"),
    (lambda tmp: _write(tmp, "torn.log", HEADER + "\n" + "2025/06/12 12:07:39.196, 0, NVIDIA A1028\n"),
     "no sample could be read as nvidia-smi (1 lines skipped, the first line 2"),
])
def test_paths_that_hold_nothing_to_read_give_one_line_and_exit_2(cli, tmp_path, make, message):
    _one_error_line(_investigate(cli, "--file", make(tmp_path)), message)


@pytest.mark.parametrize("args, message", [
    (["--store", "x.db"], "--store and --file were both given"),
    (["--prometheus", "http://127.0.0.1:9"], "--prometheus and --file were both given"),
])
def test_file_with_another_source_gives_one_line_and_exit_2(cli, tmp_path, args, message):
    path = _write(tmp_path, "gpu.log", _full_log(n=5, gpus=1))
    _one_error_line(_investigate(cli, "--file", path, *args), message)


def test_several_files_after_one_file_option_are_one_window(cli, tmp_path):
    a = _write(tmp_path, "node-a.log", _full_log(n=30, gpus=1))
    b = _write(tmp_path, "node-b.log", _full_log(n=30, gpus=2))
    p = _investigate(cli, "--file", a, b, "--json")
    assert p.returncode == 3, p.stderr  # nothing found; inconclusive for what a log lacks
    doc = json.loads(p.stdout)
    assert [f["path"] for f in doc["files"]] == [str(a), str(b)]
    assert sum(len(f["gpus"]) for f in doc["files"]) == 3 and doc["window"]["node"] is None
    _one_error_line(_investigate(cli, "--store", "x.db", str(a)), "paths of recorded files follow --file")


def test_files_far_apart_in_time_make_a_coarse_window_and_it_says_so(tmp_path):
    a = _write(tmp_path, "june.log", _full_log(n=30, gpus=1))
    month_later = _full_log(n=30, gpus=1).replace(_stamp(T0)[:10], _stamp(T0 + 30 * 86400)[:10])
    b = _write(tmp_path, "july.log", month_later)
    window, _ = _load(a, b)
    assert window.end_s - window.start_s > 29 * 86400
    assert any("select a shorter stretch with --from/--to" in g for g in window.gaps), window.gaps
    window, _ = _load(a)
    assert not window.gaps
