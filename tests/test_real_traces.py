"""`gpudiag analyze trace` on real profiler traces: HTA's figures, and the verdict a careful engineer gives.

The traces are Holistic Trace Analysis' own test data (../shared/data/real/traces, see its MANIFEST.md):
CUDA, ROCm and MTIA recordings of training and inference. Each test states why the verdict is right for
that trace; the idle / compute / non-compute figures must stay within 0.1 percentage point of HTA 0.6.1's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import real_corpus as rc

from gpudiag.cli import main

# HTA 0.6.1's idle / compute / non-compute (% of the span), from MANIFEST.md: one place, shared with
# bench/bench_verdicts.py.
TRACES = rc.real("traces")
HTA_PCT = rc.HTA_FIGURES
CPU_ONLY = rc.NO_GPU_TRACE
TRAINING_FIXES = {"DataLoader num_workers > 0", "pin_memory=True with non_blocking copies",
                  "fewer host syncs (.item(), .cpu())", "CUDA graphs (torch.compile mode='reduce-overhead')"}


def _trace(name: str) -> Path:
    path = TRACES / name
    if not path.exists():
        pytest.skip(f"real trace {name} is not in {TRACES.resolve()} (shared data not mounted)")
    return path


def _run(capsys, *args) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def _analyze(capsys, name: str) -> dict:
    code, out, err = _run(capsys, "analyze", "trace", _trace(name), "--json")
    assert code == 0, err
    doc = json.loads(out)
    idle, compute, non_compute = HTA_PCT[name]
    assert doc["idle_pct"] == pytest.approx(idle, abs=0.1)
    assert doc["compute_pct"] == pytest.approx(compute, abs=0.1)
    assert doc["non_compute_pct"] == pytest.approx(non_compute, abs=0.1)
    return doc


def _stream(doc: dict, stream: int) -> dict:
    return next(s for s in doc["streams"] if s["stream"] == stream)


def _starved(doc: dict) -> list[dict]:
    return [f for f in doc["findings"] if f["kind"] == "cpu_starved_gpu"]


def test_a_training_rank_whose_compute_stream_waits_on_its_host_is_cpu_starved(capsys):
    # The device idles 77.8 % of three steps; 99 % of the compute stream's idle time is host wait, over 1742
    # gaps: the host launches too slowly, every step. The NCCL stream (40) idles waiting on its peers and is
    # not the stream the verdict looks at.
    doc = _analyze(capsys, "nccl_parser_config_nccl_data.json.gz")
    assert doc["busiest_stream"] == 7 and _stream(doc, 40)["role"] == "communication"
    [f] = _starved(doc)
    assert f["severity"] == "warning"
    assert f["details"]["workload"] == "training"
    assert set(f["fixes"]) == TRAINING_FIXES
    # 24 cudaEventSynchronize calls in three steps: fewer host syncs is the first thing to try
    assert f["fixes"][0] == "fewer host syncs (.item(), .cpu())"


def test_nccl_kernels_under_their_current_names_are_communication_as_before(capsys):
    # The same rank with ncclKernel_ renamed ncclDevKernel_ (NCCL >= 2.19): same figures, same verdict.
    doc = _analyze(capsys, "nccl_data_ncclDevKernel.json.gz")
    assert doc["busiest_stream"] == 7 and _stream(doc, 40)["role"] == "communication"
    assert _stream(doc, 40)["compute_pct"] == 0.0
    [f] = _starved(doc)
    assert f["severity"] == "warning" and f["details"]["workload"] == "training"


def test_a_training_rank_idle_half_the_time_waiting_on_its_host_is_cpu_starved(capsys):
    # Five steps of backward and NCCL all-reduce; the device idles 46 % and 90 % of the compute stream's idle
    # time is host wait, spread over 8778 gaps: a host-bound training loop.
    doc = _analyze(capsys, "df_index_resolver_df_index_resolver.json.gz")
    assert doc["last_step_excluded"] is True
    [f] = _starved(doc)
    assert f["severity"] == "warning"
    assert f["details"]["workload"] == "training" and set(f["fixes"]) == TRAINING_FIXES
    assert f["details"]["host_wait_gaps"] > 1000


def test_a_training_step_whose_device_is_busy_is_not_cpu_starved(capsys):
    # The device is busy 92.5 % of six steps; the compute stream's idle time is kernel wait and waits on other
    # streams, 3 % host wait: nothing to blame on the host.
    doc = _analyze(capsys, "trace_diff_test_test.json.gz")
    assert _starved(doc) == []


def test_a_sampled_training_rank_waiting_on_other_streams_is_not_cpu_starved(capsys):
    # The device idles 55 %, but only 36 % of the compute stream's idle time is host wait; the rest is the
    # stream waiting on copies and NCCL send/recv on other streams. Feeding it faster would not help.
    doc = _analyze(capsys, "trace_filter_sampled_rank-1.json.gz")
    assert _stream(doc, 7)["idle_breakdown"]["host_wait_ratio"] < 0.5
    assert _starved(doc) == []


def test_an_mtia_accelerator_96_percent_busy_is_not_starved_and_is_not_called_a_gpu(capsys):
    # Each MTIA stream waits on the host between jobs, but twelve streams keep the device busy 95.7 % of the
    # trace: an info with the figures, no warning, and the device named for what it is.
    doc = _analyze(capsys, "mtia_inference_trace_mtia_inference_rank_0.json.gz")
    assert doc["device_kind"] == "MTIA"
    [f] = _starved(doc)
    assert f["severity"] == "info" and f["fixes"] == []
    assert f["summary"].startswith("MTIA device") and "GPU" not in f["summary"]
    # MTIA's job submissions are launches: launch delay and queue length are measured
    assert sum(s["launch_delay"]["count"] for s in doc["streams"]) > 0
    assert all(s["queue_length"]["count"] > 0 for s in doc["streams"])


def test_an_amd_toy_training_step_is_too_short_to_call_cpu_starved(capsys):
    # One profiled step of 14 tiny kernels on an MI250; the device idles 98.5 %, all host wait, but in only
    # 15 gaps, 76 % of it inside one 6.5 ms hipLaunchKernel (the first launch loading its kernel): a warm-up
    # of a toy model, not a loop the host cannot feed. The figures, as info.
    doc = _analyze(capsys, "amd_trace_mi250_minitoy_train_ROCm6_2_kineto.json.gz")
    assert doc["workload"]["kind"] == "training"
    s0 = _stream(doc, 0)
    # hipLaunchKernel and hipExtModuleLaunchKernel are launches; ROCm's "stream": "0x0" runtime calls are not
    # device work
    assert [s["stream"] for s in doc["streams"]] == [0]
    assert s0["launch_delay"]["count"] == 16 and s0["queue_length"]["count"] == 32
    [f] = _starved(doc)
    assert f["severity"] == "info" and "only 15 host-wait gaps" in f["summary"]


def test_a_cuda_event_sync_benchmark_of_four_kernels_is_not_a_verdict(capsys):
    # A synchronization micro-benchmark: four kernels and a copy, the host blocking on each sync by design.
    # Its Stream Sync record counts as non-compute, as HTA counts it; four kernels are no loop to judge.
    doc = _analyze(capsys, "critical_path_cuda_event_sync_event_sync_trace.json.gz")
    [f] = _starved(doc)
    assert f["severity"] == "info" and f["fixes"] == []


def test_a_stream_wait_event_does_not_count_as_stream_idle_time(capsys):
    # Stream 24 holds a 2 µs Stream Wait Event 350 µs before its memset and kernel. Counted as activity it
    # made stream 24 idle 74 % "waiting on the host"; without it the stream is idle 11 %, kernel wait.
    doc = _analyze(capsys, "critical_path_cuda_event_sync_multi_stream_event_sync_trace.json.gz")
    s24 = _stream(doc, 24)
    assert s24["activities"] == 2
    assert s24["idle_pct"] == pytest.approx(15 / 139 * 100, abs=0.1)
    assert s24["idle_breakdown"]["host_wait_ratio"] == 0.0
    # three kernels in 19 ms: too little to judge
    assert all(f["severity"] == "info" for f in _starved(doc))


def test_four_kernels_behind_a_slow_first_launch_are_not_a_verdict_and_no_delay_is_negative(capsys):
    # Four kernels in 1.6 ms; the first cudaLaunchKernel takes 1.4 ms (loading the module) while its kernel
    # ran 12 µs after the call began. Launch delays are all >= 0 (they were a negative mean before), and
    # three host-wait gaps are too few to call the host the bottleneck.
    doc = _analyze(capsys, "trace_file_list_inference_rank_1.json.gz")
    d = _stream(doc, 7)["launch_delay"]
    assert d["count"] == 4 and d["mean_s"] >= 0 and d["p50_s"] == pytest.approx(12.5e-6)
    [f] = _starved(doc)
    assert f["severity"] == "info"
    assert doc["workload"]["kind"] == "unknown"  # kernels and runtime calls only


def test_a_triton_launcher_op_with_a_stream_argument_is_not_gpu_work(capsys):
    # Inductor's launcher op carries "stream": 0; the only GPU work is its kernel on stream 7, busy all along.
    doc = _analyze(capsys, "triton_example_triton_example.json.gz")
    assert [s["stream"] for s in doc["streams"]] == [7]
    assert doc["findings"] == []


def test_a_cpu_only_trace_is_one_line_and_exit_2(capsys):
    code, out, err = _run(capsys, "analyze", "trace", _trace(CPU_ONLY))
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpudiag: error: the trace has no GPU activity")


@pytest.mark.parametrize("name", sorted(HTA_PCT))
def test_no_real_trace_gets_a_negative_launch_delay(capsys, name):
    for s in _analyze(capsys, name)["streams"]:
        d = s["launch_delay"]
        if d["count"]:
            assert d["mean_s"] >= 0 and d["p50_s"] >= 0, (s["stream"], d)
