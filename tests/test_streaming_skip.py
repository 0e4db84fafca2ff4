"""The agent's streaming analysis skips analyzers that cannot find anything, and finds exactly what run_all finds.

Every 10 s the agent analyzes its 15-minute window; an analyzer whose ``may_find`` test
rules out any finding (no allocation failure, no eviction, no low GPU, no launch grids in
the window) is left out, unless a finding of its kind is open. Over every scenario the
reference engine reproduces, fed second by second through the agent's SlidingWindow, the
streaming findings must equal run_all's, and no test may say "nothing" where its analyzer
finds something.
"""

from __future__ import annotations

import numpy as np
import pytest

from gpudiag.agent.daemon import FindingLog, SlidingWindow
from gpudiag.analyzers import registry
from gpudiag.analyzers.registry import ANALYZERS, MAY_FIND, run_all, run_streaming
from gpudiag.catalog import M
from gpudiag.findings import Finding, Severity
from gpudiag.frames import Frame
from gpudiag.reference_engine import scenarios
from gpudiag.reference_engine.sim.engine import SimEngine

ANALYZE_EVERY_S = 300


def _docs(findings: list[Finding]) -> list[dict]:
    return [f.to_dict() for f in findings]


@pytest.mark.parametrize("name", sorted(scenarios.SCENARIOS))
def test_streaming_findings_equal_run_alls_over_every_scenario(name):
    cfg, wl = scenarios.SCENARIOS[name].build(None)
    win = SlidingWindow(900.0)
    seconds, log, analyses = 0, FindingLog(), 0
    for fr in SimEngine(cfg, wl, seed=0).frames():
        win.add([fr])
        if fr.kind != "gpu":
            continue
        seconds += 1
        if seconds % ANALYZE_EVERY_S:
            continue
        w = win.window("sim")
        for kind, may_find in MAY_FIND.items():
            if ANALYZERS[kind](w):
                assert may_find(w), f"{kind}.may_find ruled out a finding it makes at {seconds} s"
        full = run_all(w)
        streamed = run_streaming(w, {rec.key[0] for rec in log.open.values()})
        assert _docs(streamed) == _docs(full), (name, seconds)
        log.reconcile(streamed, w.end_s, w.start_s)
        analyses += 1
    assert analyses >= 2


def _quiet_node(seconds: int) -> SlidingWindow:
    """A busy, healthy node: failure and eviction counters at 0, GPUs busy, no launch grids."""
    win = SlidingWindow(900.0)
    for t in range(1, seconds + 1):
        win.add([
            Frame("gpu", float(t), [{"node": "n", "gpu": 0, M.gpu_utilization_ratio: 0.9}]),
            Frame("process", float(t), [{"node": "n", "gpu": 0, "pid": 7, M.process_torch_reserved_bytes: 8e9,
                                         M.process_torch_allocated_bytes: 6e9,
                                         M.process_torch_largest_free_block_bytes: 1e9,
                                         M.process_torch_ooms_total: 0}]),
            Frame("engine", float(t), [{"node": "n", "gpu": 0, "pid": 7, M.engine_kv_evictions_total: 4,
                                        M.engine_kv_alloc_failures_total: 0,
                                        M.engine_kv_failed_request_bytes: 0}]),
            Frame("cuda_api", float(t), [{"node": "n", "pid": 7, "api": "cudaMalloc", M.cuda_api_calls_total: t}]),
        ])
    return win


def test_a_healthy_window_rules_out_what_cannot_happen_in_it():
    w = _quiet_node(120).window("n")
    assert {kind for kind, may_find in MAY_FIND.items() if may_find(w)} == set()
    assert run_streaming(w) == run_all(w) == []


def test_an_analyzer_with_an_open_finding_runs_even_when_its_test_rules_findings_out(monkeypatch):
    calls = []
    for kind in MAY_FIND:
        monkeypatch.setitem(registry.ANALYZERS, kind,
                            lambda window, kind=kind, analyze=ANALYZERS[kind]: calls.append(kind) or analyze(window))
    w = _quiet_node(120).window("n")
    run_streaming(w)
    assert calls == []  # every test said "nothing": no analyzer ran
    # A fragmentation episode left open (from an earlier window) is resolved by its analyzer's own answer.
    log = FindingLog()
    opened, _, _ = log.reconcile([Finding(kind="memory_fragmentation", severity=Severity.WARNING, start_s=10.0,
                                          end_s=60.0, summary="", node="n", gpu=0, pid=7)], 60.0, 0.0)
    assert opened
    found = run_streaming(w, {rec.key[0] for rec in log.open.values()})
    assert calls == ["memory_fragmentation"]
    _, _, resolved = log.reconcile(found, w.end_s, w.start_s)
    assert [r.finding.kind for r in resolved] == ["memory_fragmentation"] and not log.open


def test_processes_whose_memory_never_moves_are_told_apart_at_once_and_forecast_the_same(monkeypatch):
    from gpudiag.analyzers import common, oom_forecast

    win = SlidingWindow(900.0)
    gib, mib = 1024**3, 1024**2
    for t in range(1, 901):
        rows = [{"node": "n", "gpu": 0, "pid": 100 + j, M.process_gpu_memory_bytes: (900 + 2 * j) * mib}
                for j in range(20)]
        rows.append({"node": "n", "gpu": 0, "pid": 99, M.process_gpu_memory_bytes: 10 * gib + 40 * mib * t})
        win.add([Frame("process", float(t), rows),
                 Frame("gpu", float(t), [{"node": "n", "gpu": 0, M.gpu_memory_total_bytes: 80 * gib,
                                          M.gpu_memory_used_bytes: 30 * gib + 40 * mib * t}])])
    w = win.window("n")
    judged = []
    real = oom_forecast.rising_slope
    monkeypatch.setattr(oom_forecast, "rising_slope", lambda t, y: judged.append(float(y[0])) or real(t, y))
    found = oom_forecast.analyze(w)
    assert [f.pid for f in found] == [99]
    assert judged == [10 * gib + 40 * mib]  # the twenty flat processes were not read one by one
    judged.clear()
    monkeypatch.setattr(oom_forecast, "still_per_entity", lambda *a, **k: None)
    assert [f.to_dict() for f in oom_forecast.analyze(win.window("n"))] == [f.to_dict() for f in found]
    assert len(judged) == 21
    # What makes skipping them exact: a whole-number series that never moves has a trend of exactly 0.
    t = np.arange(900.0) + 1.767e9
    for value in (0.0, 900 * mib, 79 * gib + 7):
        assert common.linear_trend(t, np.full(900, value))[0] == 0.0


def _hardware_window(seconds: int, change=None) -> SlidingWindow:
    """Two GPUs whose error counters hold still (each at its own past counts) unless ``change(t, gpu, row)``
    moves one; fed through the agent's SlidingWindow."""
    win = SlidingWindow(900.0)
    for t in range(1, seconds + 1):
        rows = []
        for g in (0, 1):
            row = {"node": "n", "gpu": g, "uuid": f"GPU-{g}",
                   M.gpu_xid_errors_total: {"13": 2} if g else {},
                   M.gpu_ecc_errors_total: {"volatile": {"corrected": 0, "uncorrected": 0},
                                            "aggregate": {"corrected": 3 + 40 * g, "uncorrected": 0}},
                   M.gpu_retired_pages_total: {"single_bit_ecc": g, "double_bit_ecc": 0},
                   M.gpu_remapped_rows_total: {"correctable": 0, "uncorrectable": 0},
                   M.gpu_nvlink_errors_total: {"crc_flit": 5 * g, "replay": 0},
                   M.gpu_pcie_replay_total: 7, M.gpu_lost: 0}
            if change is not None:
                change(t, g, row)
            rows.append(row)
        win.add([Frame("gpu", float(t), rows)])
    return win


def _set(path, value):
    def change(t, g, row):
        if g == 1 and t >= 400:
            d = row
            for k in path[:-1]:
                d[k] = dict(d[k])
                d = d[k]
            d[path[-1]] = value(t) if callable(value) else value
    return change


@pytest.mark.parametrize("what, change", [
    ("an XID code that appears", _set((M.gpu_xid_errors_total, "79"), 1)),
    ("an XID count that rises", _set((M.gpu_xid_errors_total, "13"), 3)),
    ("uncorrected ECC", _set((M.gpu_ecc_errors_total, "volatile", "uncorrected"), 1)),
    ("corrected ECC by the hundred", _set((M.gpu_ecc_errors_total, "volatile", "corrected"), lambda t: t - 399)),
    ("a row remap that failed", _set((M.gpu_remapped_rows_total, "uncorrectable"), 1)),
    ("NVLink retrains", _set((M.gpu_nvlink_errors_total, "replay"), lambda t: t // 10)),
    ("PCIe replays", _set((M.gpu_pcie_replay_total,), lambda t: 7 + t // 10)),
    ("a GPU lost", _set((M.gpu_lost,), 1)),
])
def test_hardware_errors_runs_when_any_counter_moves_and_finds_what_moved(what, change):
    w = _hardware_window(600, change).window("n")
    found = ANALYZERS["hardware_errors"](w)
    assert [f.gpu for f in found] == [1], what
    assert MAY_FIND["hardware_errors"](w), what
    assert _docs(run_streaming(w)) == _docs(run_all(w))


def test_hardware_errors_is_left_out_when_every_gpus_counters_hold_still_at_their_own_counts(monkeypatch):
    w = _hardware_window(600).window("n")
    assert not MAY_FIND["hardware_errors"](w)
    assert ANALYZERS["hardware_errors"](w) == []
    calls = []
    monkeypatch.setitem(registry.ANALYZERS, "hardware_errors", lambda window: calls.append(1) or [])
    run_streaming(w)
    assert calls == []
    # Counters that differ between the GPUs but never within one are told apart per GPU: the
    # same counts with the GPUs' rows swapped halfway move within each (GPU 0's rise, GPU 1's
    # fall reads as a reset).
    from gpudiag.analyzers import hardware_errors

    swapped = _hardware_window(600, lambda t, g, row: row.update(gpu=1 - g) if t > 300 else None).window("n")
    assert MAY_FIND["hardware_errors"](swapped)
    assert [f.gpu for f in hardware_errors.analyze(swapped)] == [0]
