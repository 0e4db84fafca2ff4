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
    COMMUNICATION,
    COMPUTE,
    MEMORY,
    SYNC,
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
    # the device is idle 99.7 % over 51 host-wait gaps; one 15.6 s pause holds most of it, but without it
    # the device is still idle 94 % of the rest, waiting on the host: a warning
    assert f["severity"] == "warning"
    assert f["runbook"] == alert_name("cpu_starved_gpu")
    assert f["gpu"] == 0 and f["details"]["stream"] == 7
    # forward operators only: an inference loop gets preprocessing workers, never DataLoader workers; its
    # 16 pageable copies and 21 blocking syncs put those two fixes first
    assert f["details"]["workload"] == "inference"
    assert "preprocessing in worker processes" in f["fixes"]
    assert not any("DataLoader" in fix for fix in f["fixes"])
    assert f["fixes"][:2] == ["pin_memory=True with non_blocking copies", "fewer host syncs (.item(), .cpu())"]


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


def _starved_loop(n=30, kernel_us=50, gap_us=200, launch="cudaLaunchKernel", kernel_cat="kernel",
                  runtime_cat="cuda_runtime", stream=7, host_op="aten::mm", first_corr=100):
    """``n`` kernels on ``stream``, each launched ``gap_us`` after the previous one ended.

    Launch i starts at 1000 + i * (kernel_us + gap_us) and lasts 5 µs; its kernel starts 10 µs after the
    launch began. Every gap between kernels is host wait (``n - 1`` gaps of ``gap_us``), and the device is
    idle gap / (kernel + gap) of the span. ``host_op`` names the operator around each launch.
    """
    events = []
    for i in range(n):
        t, corr = 1000 + i * (kernel_us + gap_us), first_corr + i
        if host_op:
            events.append(_x(host_op, "cpu_op", t - 2, 9))
        events.append(_x(launch, runtime_cat, t, 5, correlation=corr))
        events.append(_x(f"gemm_kernel_{i % 3}", kernel_cat, t + 10, kernel_us, stream=stream, correlation=corr,
                         device=0))
    return events


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
    # launch delay = kernel start - start of its launch call, for launches onto an idle stream: A (launched
    # at 990, nothing before it) 10 µs, C (launched at 1400, after B ended) 100 µs; B and the memcpy were
    # launched while A ran: queued, not delayed
    d = s["launch_delay"]
    assert (d["count"], d["queued"], d["clock_skew"]) == (2, 2, 0)
    assert d["p50_s"] == pytest.approx(55e-6)
    assert d["max_s"] == pytest.approx(100e-6)
    # one host-wait gap is a handful of kernels, not a loop: the figures, as info
    assert [(f["kind"], f["severity"]) for f in doc["findings"]] == [("cpu_starved_gpu", "info")]
    assert doc["findings"][0]["pid"] == 4242
    assert doc["findings"][0]["fixes"] == []


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
    assert kernel_category("ncclKernel_AllReduce_RING_LL_Sum_float") == COMMUNICATION
    # NCCL >= 2.19 names its kernels ncclDevKernel_*: still communication
    assert kernel_category("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)") \
        == COMMUNICATION
    assert kernel_category("Memcpy DtoD (Device -> Device)") == MEMORY
    assert kernel_category("Memset (Device)") == MEMORY
    assert kernel_category("dma_request", "mtia_ccp_events") == MEMORY
    assert kernel_category("void at::native::vectorized_elementwise_kernel<4>") == COMPUTE
    for sync in ("Stream Sync", "Stream Wait Event", "Context Sync", "Event Sync"):
        assert kernel_category(sync, "cuda_sync") == SYNC
        assert kernel_category(sync) == SYNC


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
    r = cli_here("analyze", "trace", _write_trace(tmp_path / "starved.json", _starved_loop()))
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())  # the console wraps long lines
    assert "Per stream" in text
    assert "[warning] cpu_starved_gpu" in text
    assert "preprocessing in worker processes" in text and "workload: inference" in text


# --- what is device work, and how it is counted ------------------------------------------

def _sync(name, ts, dur, stream, corr=None):
    args = {"cuda_sync_kind": name, "stream": stream, "device": 0}
    if corr is not None:
        args["correlation"] = corr
    return {"ph": "X", "cat": "cuda_sync", "name": name, "pid": 0, "tid": stream, "ts": ts, "dur": dur, "args": args}


def test_sync_records_are_non_compute_and_left_out_of_the_stream_idle_breakdown(tmp_path, cli_here):
    # kernels [1000,1100) and [1300,1400) on stream 7; a Stream Sync [1150,1250) on stream 7 between them,
    # a Context Sync [1500,1520) on "stream" 4294967295 (CUPTI's -1 as unsigned: no stream at all)
    events = [_launch(990, 1), _launch(1280, 2), _kernel(1000, 100, 1), _kernel(1300, 100, 2),
              _sync("Stream Sync", 1150, 100, 7, corr=3), _sync("Context Sync", 1500, 20, 4294967295, corr=4),
              _x("cudaStreamSynchronize", "cuda_runtime", 1149, 102, correlation=3)]
    doc = _analyze_json(cli_here, _write_trace(tmp_path / "sync.json", events))
    # device: span 400 µs (the Context Sync is on no stream), busy 300, compute 200, the sync 100 non-compute
    assert doc["span_s"] == pytest.approx(400e-6)
    assert doc["idle_pct"] == pytest.approx(25.0)
    assert doc["compute_pct"] == pytest.approx(50.0)
    assert doc["non_compute_pct"] == pytest.approx(25.0)
    assert [s["stream"] for s in doc["streams"]] == [7]
    s7 = _stream(doc, 7)
    # the stream without its sync record: one 200 µs gap, host wait (the launch at 1280 came after 1100)
    assert s7["activities"] == 2
    assert s7["idle_breakdown_s"]["host_wait_s"] == pytest.approx(200e-6)
    assert s7["idle_pct"] == pytest.approx(50.0)


def test_a_cpu_op_with_a_stream_argument_is_not_gpu_work(tmp_path, cli_here):
    # Inductor's launcher op carries "stream": 0; only the kernel it launched is device work
    events = [_x("triton_poi_fused_add_0", "cpu_op", 900, 100, stream=0), _launch(950, 1, name="cuLaunchKernel"),
              _kernel(1000, 2, 1, name="triton_poi_fused_add_0")]
    doc = _analyze_json(cli_here, _write_trace(tmp_path / "triton.json", events))
    assert [s["stream"] for s in doc["streams"]] == [7]
    assert (doc["idle_pct"], doc["compute_pct"]) == (0.0, 100.0)


def test_rocm_launches_give_queue_length_and_launch_delay(tmp_path, cli_here):
    # ROCm's runtime calls carry "stream": "0x0": host calls, not device work
    events = []
    for i, name in enumerate(["hipLaunchKernel", "hipExtLaunchKernel", "hipModuleLaunchKernel"]):
        launch = _launch(1000 + 100 * i, i + 1, name=name)
        launch["args"]["stream"] = "0x0"
        events += [launch, _kernel(1020 + 100 * i, 10, i + 1, stream=0)]
    doc = _analyze_json(cli_here, _write_trace(tmp_path / "rocm.json", events))
    assert [s["stream"] for s in doc["streams"]] == [0]
    s0 = _stream(doc, 0)
    assert s0["queue_length"]["count"] == 6
    assert s0["launch_delay"]["count"] == 3 and s0["launch_delay"]["p50_s"] == pytest.approx(20e-6)


def test_mtia_job_submissions_are_launches_and_the_device_is_named_mtia(tmp_path, cli_here):
    events = _starved_loop(launch="runFunction - job_prep_and_submit_for_execution", kernel_cat="mtia_ccp_events",
                           runtime_cat="mtia_runtime")
    doc = _analyze_json(cli_here, _write_trace(tmp_path / "mtia.json", events))
    assert doc["device_kind"] == "MTIA"
    s7 = _stream(doc, 7)
    assert s7["launch_delay"]["count"] == 30 and s7["launch_delay"]["p50_s"] == pytest.approx(10e-6)
    f = doc["findings"][0]
    assert f["severity"] == "warning"
    assert f["summary"].startswith("MTIA device 0 idle") and "GPU" not in f["summary"]


# --- malformed input ---------------------------------------------------------------------

def test_a_kernel_with_a_malformed_stream_is_one_line_naming_the_stream(tmp_path, cli_here):
    # the only kernel says "stream": "seven": the trace has GPU activity, just none we can place
    events = [_launch(990, 1), _kernel(1000, 100, 1, stream="seven")]
    line = _one_error_line(cli_here("analyze", "trace", _write_trace(tmp_path / "seven.json", events)))
    assert "no usable GPU activity" in line and "'seven'" in line and "args.stream" in line
    assert "no GPU activity (kernels" not in line


def test_a_kernel_with_a_malformed_stream_among_good_ones_is_skipped_and_counted(tmp_path, cli_here):
    events = _host_starved_events() + [_kernel(1800, 10, 9, stream="seven"), _kernel(1820, 10, 10, stream=True)]
    path = _write_trace(tmp_path / "some_seven.json", events)
    doc = _analyze_json(cli_here, path)
    assert doc["skipped_activities"] == {"malformed_stream": 2}
    assert doc["skipped_example"] == "seven"
    assert doc["idle_pct"] == pytest.approx(100 * 360 / 700)  # the good kernels, as before
    r = cli_here("analyze", "trace", path)
    text = " ".join(r.stdout.split())  # the console wraps long lines
    assert "skipped device activities: 2 with an args.stream that is not an integer stream id" in text


def test_a_decimal_string_stream_is_a_stream(tmp_path, cli_here):
    events = [_launch(990, 1), _kernel(1000, 10, 1, stream="7")]
    doc = _analyze_json(cli_here, _write_trace(tmp_path / "s.json", events))
    assert [s["stream"] for s in doc["streams"]] == [7] and doc["skipped_activities"] == {}


# --- kernel launch delay -----------------------------------------------------------------

def test_launch_delay_is_never_negative_when_the_kernel_starts_before_its_launch_call_returns(tmp_path, cli_here):
    # The first launch of a module loads it: cudaLaunchKernel lasts 1414 µs and its kernel starts 12 µs
    # after the call began. Measured from the end of the call it was -1402 µs (a negative mean beside a
    # P50 of a few µs); from the start of the call it is 12 µs.
    events = [_launch(1000, 1, dur=1414), _kernel(1012, 4, 1),
              _launch(2500, 2, dur=14), _kernel(2515, 6, 2),
              _launch(2600, 3, dur=12), _kernel(2613, 15, 3)]
    d = _stream(_analyze_json(cli_here, _write_trace(tmp_path / "first.json", events)), 7)["launch_delay"]
    assert d["count"] == 3
    assert d["mean_s"] >= 0 and d["p50_s"] == pytest.approx(13e-6)
    assert d["max_s"] == pytest.approx(15e-6)


def test_launch_delay_leaves_out_queued_kernels_and_clock_skew(tmp_path, cli_here):
    events = [
        _launch(1000, 1), _kernel(1010, 500, 1),   # onto an idle stream: 10 µs
        _launch(1020, 2), _kernel(1510, 10, 2),    # launched while kernel 1 ran: queued, not a 490 µs delay
        _launch(2000, 3), _kernel(1995, 10, 3),    # starts 5 µs before its launch began: clocks disagree
    ]
    d = _stream(_analyze_json(cli_here, _write_trace(tmp_path / "queued.json", events)), 7)["launch_delay"]
    assert (d["count"], d["queued"], d["clock_skew"]) == (1, 1, 1)
    assert d["p50_s"] == pytest.approx(10e-6) and d["max_s"] == pytest.approx(10e-6)


def test_a_kernel_is_matched_to_its_launch_not_to_another_host_event_with_the_same_correlation(tmp_path, cli_here):
    # a non-launch host event shares the kernel's correlation id and started before it
    events = [_x("cudaStreamGetCaptureInfo", "cuda_runtime", 1000, 2, correlation=1), _launch(1030, 1),
              _kernel(1040, 10, 1)]
    d = _stream(_analyze_json(cli_here, _write_trace(tmp_path / "dup.json", events)), 7)["launch_delay"]
    assert d["count"] == 1 and d["p50_s"] == pytest.approx(10e-6)


# --- cpu_starved_gpu is judged on the device ---------------------------------------------

def test_a_host_bound_loop_is_cpu_starved(tmp_path, cli_here):
    doc = _analyze_json(cli_here, _write_trace(tmp_path / "loop.json", _starved_loop()))
    assert doc["idle_pct"] == pytest.approx(100 * 29 * 200 / (30 * 250 - 200))
    [f] = doc["findings"]
    assert (f["kind"], f["severity"]) == ("cpu_starved_gpu", "warning")
    assert f["summary"].startswith("GPU 0 idle")
    assert f["details"]["host_wait_gaps"] == 29
    metrics = {e["metric"] for e in f["evidence"]}
    assert {"trace_device_idle_ratio", "trace_stream_host_wait_ratio"} <= metrics


def test_a_stream_waiting_on_the_host_while_other_streams_keep_the_device_busy_is_not_starved(tmp_path, cli_here):
    # stream 7 is the host-bound loop above; stream 9 copies device to device under all of it
    events = _starved_loop() + [_kernel(1000, 7500, 999, name="Memcpy DtoD (Device -> Device)", stream=9)]
    doc = _analyze_json(cli_here, _write_trace(tmp_path / "busy.json", events))
    assert doc["idle_pct"] == pytest.approx(0.0)
    [f] = doc["findings"]
    assert f["severity"] == "info" and f["fixes"] == []
    assert "not starved" in f["summary"]


def test_an_nccl_stream_is_never_the_busiest_stream(tmp_path, cli_here):
    # stream 9 runs one NCCL all-reduce for longer than stream 7 computes, and idles waiting on its peers
    events = _starved_loop() + [
        _launch(1000, 999), _kernel(1010, 3000, 999, name="ncclDevKernel_AllReduce_Sum_f32_RING_LL(x)", stream=9),
    ]
    doc = _analyze_json(cli_here, _write_trace(tmp_path / "nccl.json", events))
    assert doc["busiest_stream"] == 7
    assert _stream(doc, 9)["role"] == "communication"
    assert doc["findings"][0]["details"]["stream"] == 7


def test_one_long_host_pause_is_not_a_starved_loop(tmp_path, cli_here):
    # 25 kernels nearly back to back (15 µs host-wait gaps: the device 93 % busy), then one 50 ms pause of the
    # host before the last kernel: the device is idle 90 % of the trace, all of it host wait, in 25 gaps
    events = _starved_loop(n=25, kernel_us=200, gap_us=15)
    last = 1000 + 25 * 215 + 50_000
    events += [_launch(last, 500), _kernel(last + 10, 200, 500)]
    doc = _analyze_json(cli_here, _write_trace(tmp_path / "pause.json", events))
    [f] = doc["findings"]
    assert f["severity"] == "info"
    assert "without its longest gap" in f["summary"]


def test_a_training_step_gets_dataloader_fixes_and_never_preprocessing_workers(tmp_path, cli_here):
    events = _starved_loop(host_op="autograd::engine::evaluate_function: AddmmBackward0") + [
        _x("enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", "user_annotation", 900, 50),
        _x("Optimizer.step#AdamW.step", "user_annotation", 8000, 50),
    ]
    [f] = _analyze_json(cli_here, _write_trace(tmp_path / "train.json", events))["findings"]
    assert f["details"]["workload"] == "training"
    assert f["fixes"][0] == "DataLoader num_workers > 0"
    assert "_SingleProcessDataLoaderIter" in f["details"]["fix_evidence"]["DataLoader num_workers > 0"]
    assert "pin_memory=True with non_blocking copies" in f["fixes"]
    assert "preprocessing in worker processes" not in f["fixes"]


def test_an_inference_loop_gets_preprocessing_workers_and_never_dataloader_workers(tmp_path, cli_here):
    [f] = _analyze_json(cli_here, _write_trace(tmp_path / "infer.json", _starved_loop()))["findings"]
    assert f["details"]["workload"] == "inference"
    assert f["fixes"][0] == "preprocessing in worker processes"
    assert not any("DataLoader" in fix for fix in f["fixes"])


def test_a_trace_without_host_operators_gets_only_the_fixes_that_fit_any_loop(tmp_path, cli_here):
    [f] = _analyze_json(cli_here, _write_trace(tmp_path / "bare.json", _starved_loop(host_op=None)))["findings"]
    assert f["details"]["workload"] == "unknown"
    assert f["fixes"] == ["fewer host syncs (.item(), .cpu())", "CUDA graphs (torch.compile mode='reduce-overhead')"]
