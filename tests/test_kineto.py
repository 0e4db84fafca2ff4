"""`gpudiag analyze trace`: GPU time in PyTorch profiler traces, as Holistic Trace Analysis defines it."""

from __future__ import annotations

import gzip
import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from gpudiag.analyzers import trace_reader
from gpudiag.analyzers.kineto import (
    COMPUTE,
    MEMORY,
    analyze_trace,
    idle_breakdown,
    kernel_category,
    merged_intervals,
    select_profiled_iterations,
)
from gpudiag.analyzers.trace_reader import iter_trace_events, read_kineto_trace
from gpudiag.cli import main
from gpudiag.errors import GpudiagError
from gpudiag.findings import alert_name

REPO = Path(__file__).resolve().parents[1]
KINETO_DATA = REPO / ".." / "shared" / "data" / "kineto"


def _real_trace(name: str) -> Path:
    path = KINETO_DATA / name
    if not path.exists():
        pytest.skip(f"HTA's test trace {name} is not in {KINETO_DATA.resolve()} (shared data not mounted)")
    return path


def _analyze_json(cli, path) -> dict:
    r = cli("analyze", "trace", path, "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def _stream(doc: dict, stream: int) -> dict:
    return next(s for s in doc["streams"] if s["stream"] == stream)


# --- HTA's own figures on HTA's test traces --------------------------------------------

def test_a100_simple_add_is_idle_waiting_for_the_host_as_hta_reports(cli):
    doc = _analyze_json(cli, _real_trace("a100_simple_add.json.gz"))
    assert doc["idle_pct"] == pytest.approx(99.70, abs=0.1)
    assert doc["idle_pct"] + doc["compute_pct"] + doc["non_compute_pct"] == pytest.approx(100.0)
    s7 = _stream(doc, 7)
    assert s7["idle_breakdown"]["host_wait_ratio"] == pytest.approx(1.00, abs=0.01)
    assert doc["busiest_stream"] == 7
    starved = [f for f in doc["findings"] if f["kind"] == "cpu_starved_gpu"]
    assert len(starved) == 1
    f = starved[0]
    assert f["severity"] == "warning"
    assert f["runbook"] == alert_name("cpu_starved_gpu")
    assert f["fixes"] == ["preprocess-workers"]
    assert f["gpu"] == 0 and f["details"]["stream"] == 7


def test_v100_resnet_is_gpu_bound_as_hta_reports(cli):
    doc = _analyze_json(cli, _real_trace("v100_resnet_rank0.json.gz"))
    assert doc["idle_pct"] == pytest.approx(2.63, abs=0.1)
    s7 = _stream(doc, 7)
    assert s7["idle_breakdown"]["host_wait_ratio"] == pytest.approx(0.17, abs=0.01)
    ratios = s7["idle_breakdown"]
    assert ratios["host_wait_ratio"] + ratios["kernel_wait_ratio"] + ratios["other_ratio"] == pytest.approx(1.0)
    # five profiler steps: the last one is cut off by the end of profiling and left out
    assert doc["profiler_steps"] == 5 and doc["last_step_excluded"] is True
    # the launch queue is full (CUDA allows ~1024 outstanding launches): the host is ahead
    assert s7["queue_length"]["max"] > 1000
    assert s7["queue_length"]["empty_time_ratio"] < 0.01
    assert doc["findings"] == []


# --- the definitions, on traces whose answers are known ------------------------------

def _x(name, cat, ts, dur, **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": 4242 if cat == "cuda_runtime" else 0,
            "tid": 1 if cat == "cuda_runtime" else 7, "ts": ts, "dur": dur, "args": args}


def _launch(ts, corr, name="cudaLaunchKernel", dur=5):
    return _x(name, "cuda_runtime", ts, dur, correlation=corr)


def _kernel(ts, dur, corr, name="void gemm_kernel<float>()", stream=7):
    cat = "gpu_memcpy" if "Memcpy" in name else "kernel"
    return _x(name, cat, ts, dur, stream=stream, correlation=corr, device=0)


def _host_starved_events(late_launch_us=1400):
    """Stream 7, times in µs:

    A [1000,1100) launched at 990; B [1110,1200) queued at 1000 -> 10 µs kernel wait;
    C [1500,1600) launched at ``late_launch_us`` (after B ended -> 300 µs host wait);
    a memcpy [1650,1700) queued at 1000 -> 50 µs other.
    Span 700, busy 340, idle 360, compute 290, non-compute 50.
    """
    return [
        _launch(990, 1), _launch(1000, 2), _launch(1000, 4, name="cudaMemcpyAsync", dur=6),
        _launch(late_launch_us, 3),
        _kernel(1000, 100, 1), _kernel(1110, 90, 2), _kernel(1500, 100, 3),
        _kernel(1650, 50, 4, name="Memcpy HtoD (Pinned -> Device)"),
        {"ph": "M", "name": "thread_name", "pid": 0, "tid": 7, "args": {"name": "stream 7"}},
        {"ph": "f", "cat": "ac2g", "id": 1, "pid": 0, "tid": 7, "ts": 1000, "bp": "e"},
    ]


def _write_trace(path: Path, events, **meta) -> Path:
    doc = {"schemaVersion": 1, **meta, "traceEvents": events, "traceName": str(path)}
    text = json.dumps(doc)
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text)
    return path


def test_a_gap_after_the_stream_went_idle_before_the_launch_is_host_wait(tmp_path, cli):
    doc = _analyze_json(cli, _write_trace(tmp_path / "starved.json", _host_starved_events()))
    assert doc["span_s"] == pytest.approx(700e-6)
    assert doc["idle_pct"] == pytest.approx(100 * 360 / 700)
    assert doc["compute_pct"] == pytest.approx(100 * 290 / 700)
    assert doc["non_compute_pct"] == pytest.approx(100 * 50 / 700)
    s = _stream(doc, 7)
    assert s["idle_breakdown"] == pytest.approx(
        {"host_wait_ratio": 300 / 360, "kernel_wait_ratio": 10 / 360, "other_ratio": 50 / 360})
    # queue: +1 at 990, 1000, 1000, 1400; -1 at 1000, 1110, 1500, 1650 (a launch first on a tie)
    q = s["queue_length"]
    assert (q["count"], q["max"], q["mean"], q["min"]) == (8, 3.0, 1.5, 0.0)
    # launch delay = kernel start - end of its launch call: 5, 105, 95, 644 µs
    d = s["launch_delay"]
    assert d["count"] == 4
    assert d["p50_s"] == pytest.approx(100e-6)
    assert d["max_s"] == pytest.approx(644e-6)
    kinds = [f["kind"] for f in doc["findings"]]
    assert kinds == ["cpu_starved_gpu"]
    assert doc["findings"][0]["pid"] == 4242


def test_the_same_gap_with_the_launch_already_queued_is_not_host_wait(tmp_path, cli_here):
    doc = _analyze_json(cli_here, _write_trace(tmp_path / "waiting.json.gz", _host_starved_events(late_launch_us=1010)))
    s = _stream(doc, 7)
    assert s["idle_breakdown"]["host_wait_ratio"] == 0.0
    assert s["idle_breakdown"]["other_ratio"] == pytest.approx(350 / 360)
    assert doc["findings"] == []


def test_a_trace_without_host_events_still_has_a_temporal_breakdown(tmp_path, cli_here):
    events = [e for e in _host_starved_events() if e.get("cat") != "cuda_runtime"]
    doc = _analyze_json(cli_here, _write_trace(tmp_path / "gpu_only.json", events))
    assert doc["idle_pct"] == pytest.approx(100 * 360 / 700)
    s = _stream(doc, 7)
    assert s["idle_breakdown"]["host_wait_ratio"] == 0.0  # no launch seen, no host wait claimed
    assert s["queue_length"]["count"] == 0 and s["launch_delay"]["count"] == 0
    assert doc["findings"] == []


def test_kernel_categories_follow_hta_names():
    assert kernel_category("ncclKernel_AllReduce_RING_LL_Sum_float") == 2
    assert kernel_category("Memcpy DtoD (Device -> Device)") == MEMORY
    assert kernel_category("Memset (Device)") == MEMORY
    assert kernel_category("void at::native::vectorized_elementwise_kernel<4>") == COMPUTE


def test_merged_intervals_union_overlaps_and_touching_ends():
    s, e = merged_intervals(np.array([10, 0, 5, 30, 20]), np.array([15, 5, 8, 40, 30]))
    assert s.tolist() == [0, 10, 20] and e.tolist() == [8, 15, 40]


def test_idle_breakdown_parts_sum_to_the_gaps_even_when_activities_overlap():
    # [0,100) and an overlapping [50,60), then [130,140) issued at 120 (after idle since 100)
    b = idle_breakdown(np.array([0, 50, 130]), np.array([100, 60, 140]), np.array([np.nan, np.nan, 120.0]))
    assert b.total_s == pytest.approx(30e-6)
    assert b.host_wait_s == pytest.approx(30e-6)


def test_profiler_steps_keep_only_work_launched_before_the_last_step(tmp_path):
    events = _host_starved_events() + [
        _x("ProfilerStep#1", "user_annotation", 980, 400),
        _x("ProfilerStep#2", "user_annotation", 1380, 400),
    ]
    trace = read_kineto_trace(_write_trace(tmp_path / "steps.json", events))
    kept = select_profiled_iterations(trace)
    # the launch at 1400 belongs to the last step: kernel C goes, the rest stays
    assert sorted(kept.gpu_start_us.tolist()) == [1000, 1110, 1650]
    report = analyze_trace(trace)
    assert report.iterations_filtered and report.profiler_steps == 2


def test_fractional_timestamps_round_inward_to_whole_microseconds(tmp_path):
    events = [_launch(1.5, 1), _kernel(10.2, 5.5, 1), _kernel(20.4, 0.3, 2)]
    trace = read_kineto_trace(_write_trace(tmp_path / "ns.json", events))
    assert trace.gpu_start_us.tolist() == [11, 21]
    assert trace.gpu_end_us.tolist() == [15, 21]  # 20.7 rounds down below its start: empty, not negative


# --- iterative reading ----------------------------------------------------------------

@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 64, 4096])
def test_streaming_reader_yields_exactly_the_events_json_load_sees(tmp_path, monkeypatch, chunk):
    events = _host_starved_events() + [
        _kernel(2000, 1, 9, name="ядро_κ_核 \u2603 \"quoted\" \\ back"),
        {"ph": "i", "name": "x", "ts": 12345678901234, "s": "g", "args": {"big": 1e300, "neg": -0.5e-7}},
    ]
    path = _write_trace(tmp_path / "t.json.gz", events, deviceProperties=[{"id": 0, "name": "GPU"}])
    monkeypatch.setattr(trace_reader, "CHUNK_BYTES", chunk)
    stream = trace_reader.TraceEventStream(path)
    assert list(stream) == events
    assert stream.metadata["deviceProperties"] == [{"id": 0, "name": "GPU"}]
    assert stream.metadata["traceName"] == str(path)
    assert stream.bytes_read == len(gzip.decompress(path.read_bytes()))


def test_trace_events_before_metadata_and_empty_lists_are_read(tmp_path):
    p = tmp_path / "order.json"
    p.write_text('  {"traceEvents": [ ] , "schemaVersion": 1}  \n')
    assert list(iter_trace_events(p)) == []
    p.write_text('{"traceEvents":[{"a":1},{"b":[1,2]}],"x":{"y":null}}')
    assert list(iter_trace_events(p)) == [{"a": 1}, {"b": [1, 2]}]


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


def test_a_truncated_trace_is_one_error_line(tmp_path, cli):
    good = json.dumps({"traceEvents": _host_starved_events()})
    p = tmp_path / "cut.json"
    p.write_text(good[: len(good) // 2])
    assert "truncated" in _one_error_line(cli("analyze", "trace", p))


def test_a_truncated_gzip_trace_is_one_error_line(tmp_path, cli_here):
    data = gzip.compress(json.dumps({"traceEvents": _host_starved_events()}).encode())
    p = tmp_path / "cut.json.gz"
    p.write_bytes(data[: len(data) // 2])
    assert "truncated" in _one_error_line(cli_here("analyze", "trace", p))


@pytest.mark.parametrize("text, says", [
    ('{"traceEvents": [{"ph": "X"} {"ph": "X"}]}', "not valid trace JSON"),
    ('{"traceEvents": [{"ph": "X", "ts": 1,, "dur": 2}]}', "not valid trace JSON"),
    ('{"traceEvents": [1, 2]}', "must be a JSON object"),
    ('[{"ph": "X"}]', "not a PyTorch profiler trace"),
    ('{"schemaVersion": 1}', "not a PyTorch profiler trace"),
    ("", "not a PyTorch profiler trace"),
    ('{"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "aten::add", "ts": 1, "dur": 2}]}',
     "no GPU activity"),
])
def test_malformed_or_foreign_files_are_one_error_line(tmp_path, cli_here, text, says):
    p = tmp_path / "bad.json"
    p.write_text(text)
    assert says in _one_error_line(cli_here("analyze", "trace", p))


def test_binary_garbage_and_missing_files_are_one_error_line(tmp_path, cli_here):
    p = tmp_path / "garbage.json"
    p.write_bytes(b"\xff\xfe\x00\x81" * 100)
    assert "not UTF-8" in _one_error_line(cli_here("analyze", "trace", p))
    assert "not found" in _one_error_line(cli_here("analyze", "trace", tmp_path / "absent.json"))


def test_reader_errors_are_gpudiag_errors(tmp_path):
    p = tmp_path / "bad.json"
    p.write_text('{"traceEvents": [{"ts": 1}, ')
    with pytest.raises(GpudiagError, match="truncated"):
        list(iter_trace_events(p))


def test_terminal_report_shows_the_streams_and_the_finding(tmp_path, cli_here):
    r = cli_here("analyze", "trace", _write_trace(tmp_path / "starved.json", _host_starved_events()))
    assert r.returncode == 0, r.stderr
    assert "Per CUDA stream" in r.stdout
    assert "cpu_starved_gpu" in r.stdout and "preprocess-workers" in r.stdout
