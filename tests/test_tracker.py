"""The three-colour tracker: layers joined per (GPU, pid), gaps, trends, and missing layers said out loud."""

from __future__ import annotations

import random

import numpy as np
import pytest

from gpudiag.agent import tracker as tracker_module
from gpudiag.agent.tracker import (
    NO_REPORTER,
    NVML_NO_VALUE,
    NVML_NOT_LISTED,
    ThreeColourTracker,
    _Trend,
    least_squares_slope,
)
from gpudiag.catalog import M
from gpudiag.frames import Frame

GIB = 1 << 30
MIB = 1 << 20
U0, U1 = "GPU-aaaa", "GPU-bbbb"


def nvml(pid, black, gpu=0, uuid=U0):
    row = {"gpu": gpu, "uuid": uuid, "pid": pid, "process": "python", "host_pid": pid, "pid_mapped": True}
    if black is not None:
        row[M.process_gpu_memory_bytes] = black
    return row


def torch_row(pid, white, grey, gpu=None, uuid=U0):
    return {"gpu": gpu, "uuid": uuid, "pid": pid, "process": "pt_main_thread", "torch_device": 0,
            M.process_torch_allocated_bytes: white, M.process_torch_reserved_bytes: grey}


def tick(tracker, t, *rows, notes=None):
    return tracker.update(t, [Frame("process", t, list(rows))], layer_notes=notes).rows


def test_the_three_layers_of_a_process_are_joined_with_their_gaps():
    (row,) = tick(ThreeColourTracker(), 0.0, nvml(10, 13 * GIB), torch_row(10, 8 * GIB, 12 * GIB))
    assert (row["gpu"], row["uuid"], row["pid"]) == (0, U0, 10)
    assert row[M.process_torch_allocated_bytes] == 8 * GIB
    assert row[M.process_torch_reserved_bytes] == 12 * GIB
    assert row[M.process_gpu_memory_bytes] == 13 * GIB
    assert row[M.process_reserved_minus_allocated_bytes] == 4 * GIB
    assert row[M.process_driver_minus_reserved_bytes] == 1 * GIB
    assert row["process"] == "python", "the driver/procfs name wins over the reporter's thread name"
    assert M.process_torch_allocated_bytes not in row["missing_reasons"]


def test_a_reporter_row_without_uuid_joins_by_nvml_index():
    (row,) = tick(ThreeColourTracker(), 0.0, nvml(10, 3 * GIB, gpu=2, uuid=U1), torch_row(10, GIB, 2 * GIB, gpu=2,
                                                                                          uuid=None))
    assert row["uuid"] == U1 and row[M.process_driver_minus_reserved_bytes] == GIB


def test_without_a_reporter_white_and_grey_are_missing_not_zero():
    (row,) = tick(ThreeColourTracker(), 0.0, nvml(10, 3 * GIB))
    for column in (M.process_torch_allocated_bytes, M.process_torch_reserved_bytes,
                   M.process_reserved_minus_allocated_bytes, M.process_driver_minus_reserved_bytes):
        assert row[column] is None
        assert row["missing_reasons"][column]
    assert row["missing_reasons"][M.process_torch_allocated_bytes] == NO_REPORTER
    assert row["missing_reasons"][M.process_driver_minus_reserved_bytes] == "grey layer missing"
    assert row[M.process_gpu_memory_bytes] == 3 * GIB


def test_without_nvml_black_is_missing_with_the_probe_reason():
    (row,) = tick(ThreeColourTracker(), 0.0, torch_row(10, GIB, 2 * GIB), notes={"black": "NVML unavailable: x"})
    assert row[M.process_gpu_memory_bytes] is None
    assert row["missing_reasons"][M.process_gpu_memory_bytes] == "NVML unavailable: x"
    assert row[M.process_reserved_minus_allocated_bytes] == GIB
    (row,) = tick(ThreeColourTracker(), 0.0, torch_row(10, GIB, 2 * GIB))
    assert row["missing_reasons"][M.process_gpu_memory_bytes] == NVML_NOT_LISTED


def test_nvml_listing_a_process_without_memory_says_so():
    (row,) = tick(ThreeColourTracker(), 0.0, nvml(10, None))
    assert row["missing_reasons"][M.process_gpu_memory_bytes] == NVML_NO_VALUE


def test_a_stale_reporter_passes_its_reason_through():
    stale = {"gpu": 0, "uuid": U0, "pid": 10, "torch_device": 0,
             "white_missing_reason": "the reporter of process 10 has not written for 120 s",
             "grey_missing_reason": "the reporter of process 10 has not written for 120 s"}
    (row,) = tick(ThreeColourTracker(), 0.0, nvml(10, GIB), stale)
    assert "has not written" in row["missing_reasons"][M.process_torch_reserved_bytes]
    assert "white_missing_reason" not in row


def _run(tracker, seconds, white, grey, black, noise_bytes=0, seed=0):
    rng = random.Random(seed)
    rows = None
    for t in range(seconds):
        def jitter():
            return rng.randint(-noise_bytes, noise_bytes)
        rows = tick(tracker, float(t), nvml(10, black(t) + jitter()), torch_row(10, white(t) + jitter(),
                                                                                 grey(t) + jitter()))
    return rows[0]


def test_a_pool_leak_grows_grey_and_black_while_white_stays_flat():
    row = _run(ThreeColourTracker(window_s=60), 60, white=lambda t: 8 * GIB, grey=lambda t: 9 * GIB + t * 10 * MIB,
               black=lambda t: 10 * GIB + t * 10 * MIB, noise_bytes=MIB, seed=1)
    assert row[M.process_torch_allocated_growth_bytes_per_second] == pytest.approx(0, abs=0.2 * MIB)
    assert row[M.process_torch_reserved_growth_bytes_per_second] == pytest.approx(10 * MIB, rel=0.03)
    assert row[M.process_gpu_memory_growth_bytes_per_second] == pytest.approx(10 * MIB, rel=0.03)


def test_a_leak_outside_pytorch_grows_black_alone():
    row = _run(ThreeColourTracker(window_s=60), 60, white=lambda t: 8 * GIB, grey=lambda t: 9 * GIB,
               black=lambda t: 10 * GIB + t * 4 * MIB)
    assert row[M.process_torch_reserved_growth_bytes_per_second] == pytest.approx(0)
    assert row[M.process_gpu_memory_growth_bytes_per_second] == pytest.approx(4 * MIB)
    assert row[M.process_driver_minus_reserved_bytes] == GIB + 59 * 4 * MIB


def test_the_trend_only_looks_at_the_window():
    tracker = ThreeColourTracker(window_s=30)
    row = _run(tracker, 100, white=lambda t: GIB, grey=lambda t: 2 * GIB,
               black=lambda t: 3 * GIB + min(t, 50) * MIB)  # grows for 50 s, then flat
    assert row[M.process_gpu_memory_growth_bytes_per_second] == pytest.approx(0)


def test_a_trend_needs_enough_samples_and_says_so():
    tracker = ThreeColourTracker(min_samples=3)
    tick(tracker, 0.0, nvml(10, GIB))
    (row,) = tick(tracker, 1.0, nvml(10, 2 * GIB))
    assert row[M.process_gpu_memory_growth_bytes_per_second] is None
    assert row["missing_reasons"][M.process_gpu_memory_growth_bytes_per_second] == "2 of 3 samples needed for a trend"
    assert row["missing_reasons"][M.process_torch_allocated_growth_bytes_per_second] == "white layer missing"
    (row,) = tick(tracker, 2.0, nvml(10, 3 * GIB))
    assert row[M.process_gpu_memory_growth_bytes_per_second] == pytest.approx(GIB)


def test_a_process_that_went_away_starts_a_fresh_trend_when_it_returns():
    tracker = ThreeColourTracker(window_s=10)
    for t in range(5):
        tick(tracker, float(t), nvml(10, GIB))
    tick(tracker, 100.0)  # nothing on the GPU
    (row,) = tick(tracker, 101.0, nvml(10, GIB))
    assert row[M.process_gpu_memory_growth_bytes_per_second] is None


def test_one_pid_on_two_gpus_is_two_rows_and_host_columns_join_both():
    host = [{"gpu": g, "uuid": u, "pid": 10, M.process_cpu_utilization_ratio: 0.97} for g, u in ((0, U0), (1, U1))]
    rows = tick(ThreeColourTracker(), 0.0, nvml(10, GIB), nvml(10, 2 * GIB, gpu=1, uuid=U1), *host)
    assert [(r["gpu"], r[M.process_gpu_memory_bytes]) for r in rows] == [(0, GIB), (1, 2 * GIB)]
    assert all(r[M.process_cpu_utilization_ratio] == 0.97 for r in rows)


def test_frames_of_other_kinds_are_ignored():
    tracker = ThreeColourTracker()
    out = tracker.update(0.0, [Frame("gpu", 0.0, [{"gpu": 0, "uuid": U0, M.gpu_utilization_ratio: 0.5}])])
    assert out.kind == "process" and out.rows == []


def test_the_running_trend_equals_a_full_least_squares_fit_over_days(monkeypatch):
    monkeypatch.setattr(tracker_module, "_REBASE_AFTER", 50)  # recompute often, as after days of samples
    rng = random.Random(7)
    tracker = ThreeColourTracker(window_s=40)
    samples = []
    for i in range(400):
        t = 1.7e9 + 86400 + i * 1.0
        black = int(70 * GIB + i * 3 * MIB + rng.randint(-50 * MIB, 50 * MIB))
        samples.append((t, black))
        (row,) = tick(tracker, t, nvml(10, black))
    window = [(t, y) for t, y in samples if t >= samples[-1][0] - 40]
    assert row[M.process_gpu_memory_growth_bytes_per_second] == pytest.approx(least_squares_slope(window), rel=1e-6)


def test_a_layer_trend_keeps_only_its_window_and_its_slope_matches_a_fit_of_those_samples():
    # Samples leave in bulk (the arrays are cut once half of them are out) and the sums are
    # rebased every few thousand removals: the slope must still be the window's own fit.
    rng = np.random.default_rng(0)
    trend, window = _Trend(), 1500.0
    ts = np.arange(10_000, dtype=float)
    ys = 3.0 * ts + 80e9 + rng.normal(0.0, 50.0, ts.size)
    for t, y in zip(ts, ys):
        trend.add(float(t), float(y))
        trend.drop_before(float(t) - window)
        if int(t) % 2500 == 2499:
            keep = ts[(ts >= t - window) & (ts <= t)]
            assert trend.n == keep.size
            assert len(trend.ts) <= 2 * keep.size + 1024  # cut in bulk, never the whole history
            fit = np.polyfit(keep, ys[keep.astype(int)], 1)[0]
            assert abs(trend.slope() - fit) < 1e-6 * abs(fit)
            assert trend.span_s == keep[-1] - keep[0]
