"""The analyzers on windows of 1 s rows shaped like the incidents of SCENARIOS.md, and on healthy ones."""

import json

import numpy as np
import pytest

from gpudiag.analyzers import (
    cpu_starved_gpu,
    degenerate_kernel_launch,
    gpu_cotenant,
    hardware_errors,
    kv_eviction_storm,
    latency_regression,
    memory_fragmentation,
    memory_leak,
    oom_forecast,
    throttling,
)
from gpudiag.analyzers.common import per_entity
from gpudiag.analyzers.registry import ANALYZERS, run_all
from gpudiag.catalog import M
from gpudiag.findings import Severity, alert_name
from gpudiag.frames import Rows, Table, Window

GiB, MiB = 1024**3, 1024**2
NODE, GPU, UUID = "node-a", 0, "GPU-0000"
ENGINE_PID, ENGINE = 4100, "gpudiag-engine"
HOUR = 3600


def window(**tables):
    """A window from per-kind row lists (each row has its own t)."""
    ts = [r["t"] for rows in tables.values() for r in rows]
    return Window.from_rows(tables, start_s=min(ts, default=0.0), end_s=max(ts, default=0.0), node=NODE)


def gpu_rows(n, **columns):
    """One GPU's rows for seconds 1..n; a column value may be a callable of t."""
    return [{"t": float(t), "node": NODE, "gpu": GPU, "uuid": UUID,
             **{c: (v(t) if callable(v) else v) for c, v in columns.items()}} for t in range(1, n + 1)]


def process_rows(n, pid=ENGINE_PID, process=ENGINE, **columns):
    return [{**r, "pid": pid, "process": process} for r in gpu_rows(n, **columns)]


def engine_rows(n, **columns):
    return [{**r, "engine": ENGINE} for r in gpu_rows(n, **columns)]


def noise(seed, scale):
    rng = np.random.default_rng(seed)
    table = rng.normal(0.0, scale, 100_000)
    return lambda t: float(table[int(t) % table.size])


def only(findings, kind):
    found = [f for f in findings if f.kind == kind]
    assert len(found) == 1, [f.summary for f in findings]
    return found[0]


def evidence(f):
    return {e.metric: e for e in f.evidence}


# --- memory: leaks by layer, and the OOM forecast ------------------------------------------

def leak_window(white, grey, black, n=HOUR, load=lambda t: 32.0, used_extra=0.0, outstanding=None):
    """A process whose three colours follow the given functions of t; GPU used = black + extra."""
    proc = process_rows(n, **{M.process_torch_allocated_bytes: white, M.process_torch_reserved_bytes: grey,
                              M.process_gpu_memory_bytes: black})
    for r in proc:
        for col in (M.process_torch_allocated_bytes, M.process_torch_reserved_bytes):
            if r[col] is None:
                del r[col]
    gpu = gpu_rows(n, **{M.gpu_memory_total_bytes: 80 * GiB,
                         M.gpu_memory_used_bytes: lambda t: black(t) + used_extra})
    eng = engine_rows(n, **{M.num_requests_running: load})
    tables = {"process": proc, "gpu": gpu, "engine": eng}
    if outstanding is not None:
        tables["cuda_api"] = [{"t": float(t), "node": NODE, "pid": ENGINE_PID, "process": ENGINE,
                               M.cuda_outstanding_allocation_bytes: outstanding(t)} for t in range(1, n + 1)]
    return window(**tables)


jitter = noise(1, 8 * MiB)


def test_a_tensor_leak_is_found_in_the_allocated_layer_hours_before_the_oom():
    w = leak_window(white=lambda t: 20 * GiB + 4 * MiB * t + jitter(t),
                    grey=lambda t: 22 * GiB + 4 * MiB * t + jitter(t),
                    black=lambda t: 23 * GiB + 4 * MiB * t + jitter(t))
    f = only(memory_leak.analyze(w), "memory_leak")
    assert f.details["layer"] == "allocated"
    assert f.severity is Severity.WARNING
    assert f.pid == ENGINE_PID and f.gpu == GPU
    assert f.details["time_to_oom_s"] >= 2 * HOUR
    assert f.details["growth_bytes_per_second"] == pytest.approx(4 * MiB, rel=0.05)
    assert (f.start_s, f.end_s) == (1.0, float(HOUR))
    assert f.runbook == alert_name("memory_leak") and f.fixes == ["no-leak"]
    assert evidence(f)["time_to_oom_seconds"].observed == f.details["time_to_oom_s"]


def test_a_leak_among_many_still_processes_is_found_and_only_the_still_ones_are_passed_over():
    # The still processes are told apart for all of them at once; the verdict must be the
    # one each process would get on its own: constant, all missing, or a column absent.
    n = 1800
    procs = process_rows(n, **{M.process_torch_allocated_bytes: lambda t: 10 * GiB + 4 * MiB * t,
                               M.process_torch_reserved_bytes: lambda t: 12 * GiB + 4 * MiB * t,
                               M.process_gpu_memory_bytes: lambda t: 13 * GiB + 4 * MiB * t})
    procs += process_rows(n, pid=5001, process="still", **{M.process_gpu_memory_bytes: 2 * GiB})
    procs += process_rows(n, pid=5002, process="blank", **{M.process_gpu_memory_bytes: None})
    procs += process_rows(n, pid=5003, process="moving-a-little",
                          **{M.process_gpu_memory_bytes: lambda t: 3 * GiB + (MiB if t == n // 2 else 0)})
    w = window(process=procs, gpu=gpu_rows(n, **{M.gpu_memory_total_bytes: 80 * GiB,
                                                M.gpu_memory_used_bytes: lambda t: 20 * GiB + 4 * MiB * t}),
               engine=engine_rows(n, **{M.num_requests_running: 32.0}))
    proc = w.rows("process")
    still = memory_leak.still_per_entity(proc, ("node", "gpu", "pid"), memory_leak._LAYERS)
    pids = [key["pid"] for key, _ in per_entity(proc, ["node", "gpu", "pid"])]
    assert dict(zip(pids, still.tolist())) == {ENGINE_PID: False, 5001: True, 5002: True, 5003: False}
    f = only(memory_leak.analyze(w), "memory_leak")
    assert f.pid == ENGINE_PID and f.details["layer"] == "allocated"


def test_a_label_columns_values_are_the_same_read_from_its_rows_or_from_the_tables_codes(monkeypatch):
    # One entity's label is read from its own values; a long column from the table's codes. Both
    # leave out None and NaN and give the values as strings.
    from gpudiag.agent.daemon import SlidingWindow
    from gpudiag.analyzers import common
    from gpudiag.frames import Frame

    win = SlidingWindow(900.0)
    names = ["python3", None, float("nan"), "vllm", 7]
    for t in range(1, 301):
        win.add([Frame("process", float(t), [{"node": "n", "gpu": 0, "pid": 100 + j, "process": names[(t + j) % 5],
                                             M.process_gpu_memory_bytes: GiB} for j in range(20)])])
    proc = win.window("n").rows("process")
    per_pid = {key["pid"]: p for key, p in per_entity(proc, ["node", "gpu", "pid"])}
    assert len(proc) > common.SHORT_LABEL_ROWS >= len(per_pid[100])
    want = {"python3", "vllm", "7"}
    assert common.label_values(proc["process"]) == want
    assert all(common.label_values(p["process"]) == want for p in per_pid.values())
    monkeypatch.setattr(common, "SHORT_LABEL_ROWS", 0)  # every column from the codes
    assert common.label_values(proc["process"]) == want
    assert all(common.label_values(p["process"]) == want for p in per_pid.values())
    monkeypatch.setattr(common, "SHORT_LABEL_ROWS", 10**9)  # every column from its values
    assert common.label_values(proc["process"]) == want
    odd = np.empty(4, dtype=object)
    odd[:] = [["a"], "b", None, ["a"]]  # an unhashable label: read as the codes read it
    rows = Rows(Table(4, {"t": np.arange(4.0), "process": odd}))
    assert common.label_values(rows["process"]) == {"['a']", "b"}
    monkeypatch.setattr(common, "SHORT_LABEL_ROWS", 0)
    assert common.label_values(rows["process"]) == {"['a']", "b"}
    # One entity's codes are cut from the table's, with all of its uniques: only the values its rows hold count.
    two = SlidingWindow(900.0)
    for t in range(1, 11):
        two.add([Frame("process", float(t), [{"node": "n", "gpu": 0, "pid": pid, "process": name}
                                             for pid, name in ((1, "a"), (2, "b"))])])
    per_pid = {key["pid"]: common.label_values(p["process"])
               for key, p in per_entity(two.window("n").rows("process"), ["node", "gpu", "pid"])}
    assert per_pid == {1: {"a"}, 2: {"b"}}


def kv_window(kv, leak=lambda t: 0.0, n=900, process=ENGINE, engine_pid=None):
    """The engine's process: allocated = weights + its KV (+ a leak); the running count wanders, flat.

    ``process``: the name its process rows carry; ``engine_pid``: the pid its engine rows state."""
    white = lambda t: 14 * GiB + kv(t) + leak(t)  # noqa: E731
    proc = process_rows(n, process=process, **{M.process_torch_allocated_bytes: lambda t: white(t) + jitter(t),
                              M.process_torch_reserved_bytes: lambda t: white(t) + 2 * GiB + jitter(t),
                              M.process_gpu_memory_bytes: lambda t: white(t) + 3 * GiB + jitter(t)})
    gpu = gpu_rows(n, **{M.gpu_memory_total_bytes: 80 * GiB,
                         M.gpu_memory_used_bytes: lambda t: white(t) + 3 * GiB})
    eng = engine_rows(n, **{M.num_requests_running: noise(3, 6.0), M.engine_kv_reserved_bytes: kv})
    for r in eng:
        r[M.num_requests_running] = 100.0 + r[M.num_requests_running]
        if engine_pid is not None:
            r["pid"] = engine_pid
    return window(process=proc, gpu=gpu, engine=eng)


def test_kv_growing_with_the_tokens_held_at_a_flat_running_count_is_not_a_leak():
    # Long sequences arrive: as many requests run, but each holds more KV (SCENARIOS.md §1's long phase).
    w = kv_window(kv=lambda t: 10 * GiB + 3 * MiB * t)
    assert not [f for f in memory_leak.analyze(w) if f.kind == "memory_leak"]


def test_the_engine_process_is_the_pid_its_engine_rows_state_whatever_nvml_names_it():
    # NVML names a vLLM server "python3": its KV growing is still the engine's KV, by pid.
    growing = lambda t: 10 * GiB + 3 * MiB * t  # noqa: E731
    assert not [f for f in memory_leak.analyze(kv_window(growing, process="python3", engine_pid=ENGINE_PID))
                if f.kind == "memory_leak"]
    f = only(memory_leak.analyze(kv_window(growing, leak=lambda t: 2 * MiB * t, process="python3",
                                           engine_pid=ENGINE_PID)), "memory_leak")
    assert f.details["engine_kv_excluded"]
    assert f.details["growth_bytes_per_second"] == pytest.approx(2 * MiB, rel=0.1)
    # Engine rows that name another pid: this process' growth is its own.
    assert only(memory_leak.analyze(kv_window(growing, engine_pid=ENGINE_PID + 1)), "memory_leak")


def test_a_tensor_leak_on_top_of_growing_kv_is_still_found_outside_the_kv():
    w = kv_window(kv=lambda t: 10 * GiB + 3 * MiB * t, leak=lambda t: 2 * MiB * t)
    f = only(memory_leak.analyze(w), "memory_leak")
    assert f.details["layer"] == "allocated" and f.details["engine_kv_excluded"]
    assert f.details["growth_bytes_per_second"] == pytest.approx(2 * MiB, rel=0.1)


def test_allocated_growing_with_the_load_is_not_a_leak():
    w = leak_window(white=lambda t: 20 * GiB + 4 * MiB * t, grey=lambda t: 22 * GiB + 4 * MiB * t,
                    black=lambda t: 23 * GiB + 4 * MiB * t, load=lambda t: 8 + 48 * t / HOUR)
    assert memory_leak.analyze(w) == []


def test_a_pool_leak_grows_reserved_while_allocated_stays_flat():
    w = leak_window(white=lambda t: 20 * GiB + jitter(t), grey=lambda t: 22 * GiB + 2 * MiB * t,
                    black=lambda t: 23 * GiB + 2 * MiB * t)
    f = only(memory_leak.analyze(w), "memory_leak")
    assert f.details["layer"] == "pool"
    assert evidence(f)[M.process_reserved_minus_allocated_bytes].observed == pytest.approx(2 * MiB, rel=0.05)


def test_cache_the_allocator_keeps_after_a_burst_of_load_is_not_a_pool_leak():
    # SCENARIOS.md §1 over two hours, shaped like a run of the reference engine: a long-sequence phase
    # lifts the running batch from 24 to 60 and each request's KV from 0.28 to 0.59 GiB; the queue it
    # left drains 700 s after the phase. The caching allocator keeps the segments it reserved at the
    # peak, so reserved sits above allocated from then on: a high-water mark, not a growing pool.
    n = 2 * HOUR
    t = np.arange(1, n + 1, dtype=float)
    burst = (t >= 2700) & (t < 5200)
    load = np.where(burst, 60.0, 24.0)
    kv = load * np.where(burst, 0.59, 0.28) * GiB
    white = 20.5 * GiB + kv + np.array([jitter(x) for x in t])
    # The cache fills in the first minutes (warm-up), then holds what the peak needed.
    grey = np.maximum(36 * GiB + 2.6 * GiB * np.minimum(t / 600, 1), np.maximum.accumulate(white) + 0.5 * GiB)
    at = lambda a: (lambda x: float(a[int(x) - 1]))  # noqa: E731
    proc = process_rows(n, **{M.process_torch_allocated_bytes: at(white), M.process_torch_reserved_bytes: at(grey),
                              M.process_gpu_memory_bytes: at(grey + 0.5 * GiB)})
    gpu = gpu_rows(n, **{M.gpu_memory_total_bytes: 80 * GiB, M.gpu_memory_used_bytes: at(grey + 0.5 * GiB)})
    eng = engine_rows(n, **{M.num_requests_running: at(load), M.engine_kv_reserved_bytes: at(kv)})
    assert memory_leak.analyze(window(process=proc, gpu=gpu, engine=eng)) == []


def test_a_driver_leak_outside_pytorch_is_confirmed_by_ebpf_outstanding_allocations():
    w = leak_window(white=lambda t: 20 * GiB + jitter(t), grey=lambda t: 22 * GiB,
                    black=lambda t: 23 * GiB + 2 * MiB * t, outstanding=lambda t: 22 * GiB + 2 * MiB * t)
    f = only(memory_leak.analyze(w), "memory_leak")
    assert f.details["layer"] == "driver"
    assert f.details["ebpf"].startswith("confirmed")
    row = evidence(f)["cuda_outstanding_allocation_growth_bytes_per_second"]
    assert row.observed == pytest.approx(2 * MiB, rel=0.01)


def test_a_driver_leak_without_ebpf_says_it_was_not_cross_checked():
    w = leak_window(white=lambda t: 20 * GiB, grey=lambda t: 22 * GiB, black=lambda t: 23 * GiB + 2 * MiB * t)
    f = only(memory_leak.analyze(w), "memory_leak")
    assert f.details["layer"] == "driver"
    assert "not cross-checked" in f.details["ebpf"]
    assert evidence(f)["cuda_outstanding_allocation_growth_bytes_per_second"].observed is None


def test_without_an_in_process_reporter_the_leak_is_judged_on_the_driver_layer_alone():
    w = leak_window(white=lambda t: None, grey=lambda t: None, black=lambda t: 23 * GiB + 2 * MiB * t)
    f = only(memory_leak.analyze(w), "memory_leak")
    assert f.details["layer"] == "unknown"
    assert f.details["layers_observed"] == ["black"]
    assert "black" in f.details["note"] and "alone" in f.details["note"]


def test_steady_memory_and_a_warm_up_plateau_are_not_leaks_nor_an_oom_coming():
    flat = leak_window(white=lambda t: 20 * GiB + jitter(t), grey=lambda t: 22 * GiB + jitter(t),
                       black=lambda t: 23 * GiB + jitter(t))
    warm = leak_window(white=lambda t: min(t, 300) * 60 * MiB, grey=lambda t: min(t, 300) * 64 * MiB,
                       black=lambda t: GiB + min(t, 300) * 64 * MiB)
    for w in (flat, warm):
        assert memory_leak.analyze(w) == []
        assert oom_forecast.analyze(w) == []


def test_reserved_growing_towards_capacity_is_forecast_with_its_time_to_oom():
    w = leak_window(white=lambda t: 30 * GiB, grey=lambda t: 40 * GiB + 4 * MiB * t + jitter(t),
                    black=lambda t: 41 * GiB + 4 * MiB * t, used_extra=GiB)
    f = only(oom_forecast.analyze(w), "oom_forecast")
    free = 80 * GiB - (41 * GiB + 4 * MiB * HOUR + GiB)
    assert f.details["time_to_oom_s"] == pytest.approx(free / (4 * MiB), rel=0.05)
    assert f.details["layer"] == "reserved"
    assert f.severity is Severity.WARNING
    assert f.details["oom_at_s"] == pytest.approx(HOUR + f.details["time_to_oom_s"])
    assert set(f.fixes) == {"expandable-segments", "paged-kv"}


def test_reserved_minutes_from_the_limit_is_critical():
    w = leak_window(white=lambda t: 30 * GiB, grey=lambda t: 40 * GiB + 10 * MiB * t,
                    black=lambda t: 41 * GiB + 10 * MiB * t, used_extra=2 * GiB)
    f = only(oom_forecast.analyze(w), "oom_forecast")
    assert f.details["time_to_oom_s"] < oom_forecast.TIME_TO_OOM_CRITICAL_S
    assert f.severity is Severity.CRITICAL


def test_a_process_without_a_reporter_is_forecast_on_its_driver_memory_beside_one_that_has_it():
    # The engine reports its allocator (flat); a second process on the GPU has no reporter and its
    # driver-charged memory grows towards the capacity.
    engine = process_rows(HOUR, **{M.process_torch_allocated_bytes: lambda t: 20 * GiB + jitter(t),
                                   M.process_torch_reserved_bytes: lambda t: 22 * GiB + jitter(t),
                                   M.process_torch_inactive_split_bytes: 0.0,
                                   M.process_gpu_memory_bytes: 23 * GiB})
    other = process_rows(HOUR, pid=5200, process="python",
                         **{M.process_gpu_memory_bytes: lambda t: 10 * GiB + 6 * MiB * t + jitter(t)})
    gpu = gpu_rows(HOUR, **{M.gpu_memory_total_bytes: 80 * GiB,
                            M.gpu_memory_used_bytes: lambda t: 33 * GiB + 6 * MiB * t})
    f = only(oom_forecast.analyze(window(process=engine + other, gpu=gpu)), "oom_forecast")
    assert f.pid == 5200 and f.details["layer"] == "driver"
    free = 80 * GiB - (33 * GiB + 6 * MiB * HOUR)
    assert f.details["time_to_oom_s"] == pytest.approx(free / (6 * MiB), rel=0.05)


def engine_filling_kv(kv_capacity, leak=lambda t: 0.0, n=900):
    """Fifteen minutes of an engine that grows its KV on demand from 8 to 30 GiB (a long-sequence phase
    starting, SCENARIOS.md §1) on an 80 GiB GPU; its KV pool stops at ``kv_capacity``."""
    kv = lambda t: 8 * GiB + 22 * GiB * t / n  # noqa: E731
    white = lambda t: 22 * GiB + kv(t) + leak(t) + jitter(t)  # noqa: E731 (weights and activations: 22 GiB)
    proc = process_rows(n, **{M.process_torch_allocated_bytes: white,
                              M.process_torch_inactive_split_bytes: 0.0,
                              M.process_torch_reserved_bytes: lambda t: white(t) + GiB,
                              M.process_gpu_memory_bytes: lambda t: white(t) + 1.5 * GiB})
    gpu = gpu_rows(n, **{M.gpu_memory_total_bytes: 80 * GiB, M.gpu_memory_used_bytes: lambda t: white(t) + 1.5 * GiB})
    eng = engine_rows(n, **{M.num_requests_running: 60.0, M.engine_kv_reserved_bytes: kv,
                            M.engine_kv_capacity_bytes: kv_capacity})
    return window(process=proc, gpu=gpu, engine=eng)


def test_an_engine_filling_its_own_kv_pool_is_no_oom_coming():
    # 8.5 GiB of the pool left, 26.5 GiB free on the device: the engine stops at its capacity and
    # evicts (an eviction storm, another finding) long before the device runs out.
    assert oom_forecast.analyze(engine_filling_kv(38.5 * GiB)) == []


def test_a_kv_pool_larger_than_the_free_device_memory_is_still_forecast():
    # 40 GiB of the pool left, 26.5 GiB free: the KV can fill the device before it reaches its cap.
    f = only(oom_forecast.analyze(engine_filling_kv(70 * GiB)), "oom_forecast")
    assert f.severity is Severity.CRITICAL
    assert not f.details["engine_kv_excluded"]
    assert f.details["growth_bytes_per_second"] == pytest.approx(22 * GiB / 900, rel=0.05)


def test_a_leak_beside_an_engine_filling_its_kv_is_forecast_on_the_leak_with_the_kv_room_taken():
    f = only(oom_forecast.analyze(engine_filling_kv(38.5 * GiB, leak=lambda t: 8 * MiB * t)), "oom_forecast")
    assert f.details["engine_kv_excluded"]
    assert f.details["growth_bytes_per_second"] == pytest.approx(8 * MiB, rel=0.05)
    # Free at the end: 80 - (22 + 30 + 7.03 leaked + 1.5) GiB, less the 8.5 GiB the KV pool may still take.
    free = 80 * GiB - (22 * GiB + 30 * GiB + 8 * MiB * 900 + 1.5 * GiB) + GiB - 8.5 * GiB
    assert f.details["headroom_bytes"] == pytest.approx(free, rel=0.02)
    assert "outside its KV pool" in f.summary


def test_a_leak_finding_precedes_the_oom_forecast_it_causes():
    w = leak_window(white=lambda t: 20 * GiB + 4 * MiB * t + jitter(t),
                    grey=lambda t: 22 * GiB + 4 * MiB * t + jitter(t),
                    black=lambda t: 25.6 * GiB + 4 * MiB * t)
    findings = run_all(w)
    kinds = [f.kind for f in findings]
    assert kinds[:2] == ["memory_leak", "oom_forecast"], kinds
    leak, oom = findings[0], findings[1]
    assert leak.id in oom.caused_by
    assert leak.details["time_to_oom_s"] >= 2 * HOUR


# --- KV eviction storm on vLLM's metrics alone -----------------------------------------------

def vllm_engine_rows(n, storm=None):
    """Engine rows as engine_scrape produces them from a vLLM endpoint: counters and histogram summaries."""
    rows, preempt = [], 0.0
    jit = noise(3, 0.002)
    for t in range(1, n + 1):
        in_storm = storm is not None and storm[0] <= t < storm[1]
        if in_storm and t % 5 == 0:
            preempt += 1
        p99 = (0.40 if in_storm else 0.05) + jit(t)
        rows.append({"t": float(t), "node": NODE, "gpu": GPU, "engine": "vllm:8000",
                     M.num_preemptions_total: preempt,
                     M.kv_cache_usage_perc: 0.99 if in_storm else 0.7,
                     M.num_requests_running: 48,
                     M.inter_token_latency_seconds: {
                         "count": 1000.0 * t, "sum": 40.0 * t, "mean": 0.04, "p50": 0.04, "p90": 0.045, "p99": 0.05,
                         "window": {"count": 1000.0, "sum": 40.0, "mean": 0.04, "p50": 0.04, "p90": 0.045,
                                    "p99": p99}}})
    return rows


def test_an_eviction_storm_is_found_on_vllm_metrics_alone():
    w = window(engine=vllm_engine_rows(HOUR, storm=(1200, 2400)))
    f = only(kv_eviction_storm.analyze(w), "kv_eviction_storm")
    assert f.severity is Severity.CRITICAL
    # Rates look back one RATE_WINDOW_S: the episode may extend that far past the last preemption.
    lag = kv_eviction_storm.RATE_WINDOW_S
    assert 1200 - lag <= f.start_s <= 1300 and 2350 <= f.end_s <= 2400 + lag
    ev = evidence(f)
    assert ev["tpot_p99_seconds"].observed == pytest.approx(0.40, abs=0.02)
    assert ev["tpot_p99_seconds"].baseline == pytest.approx(0.05, abs=0.01)
    assert ev[M.kv_cache_usage_perc].observed == pytest.approx(0.99)
    assert ev["kv_evictions_per_second"].observed >= kv_eviction_storm.EVICTION_RATE_THRESHOLD


def test_a_calm_vllm_engine_has_no_storm():
    assert kv_eviction_storm.analyze(window(engine=vllm_engine_rows(HOUR))) == []


# --- CPU-starved GPU --------------------------------------------------------------------------

def starved_window(util, thread, waiting=0.0, arrivals_per_s=20.0, n=900):
    return window(
        gpu=gpu_rows(n, **{M.gpu_utilization_ratio: util}),
        process=process_rows(n, **{M.process_thread_cpu_max_ratio: thread,
                                   "top_threads": [{"tid": 4101, "name": "tokenizer", "cpu_ratio": 0.99}]}),
        engine=engine_rows(n, **{M.num_requests_waiting: waiting, M.engine_batch_size: 2,
                                 M.engine_requests_arrived_total: lambda t: arrivals_per_s * t}))


def test_a_gpu_at_ten_percent_with_a_host_thread_at_a_full_core_is_cpu_starved():
    f = only(cpu_starved_gpu.analyze(starved_window(util=0.10, thread=0.99)), "cpu_starved_gpu")
    assert f.severity is Severity.CRITICAL
    assert f.pid == ENGINE_PID and f.details["top_thread"] == "tokenizer"
    assert f.fixes == ["preprocess-workers"] and f.runbook == alert_name("cpu_starved_gpu")
    ev = evidence(f)
    assert ev[M.gpu_utilization_ratio].observed == pytest.approx(0.10)
    assert ev[M.process_thread_cpu_max_ratio].observed == pytest.approx(0.99)
    assert f.start_s <= 2.0 and f.end_s == 900.0  # arrival rates need two samples


def test_run_queue_wait_from_sched_switch_also_starves_the_gpu():
    w = starved_window(util=0.3, thread=0.5)
    w.tables["cuda_api"] = window(cuda_api=[
        {"t": float(t), "node": NODE, "pid": ENGINE_PID, M.host_runqueue_wait_seconds_total: 0.6 * t,
         M.host_offcpu_seconds_total: 0.1 * t} for t in range(1, 901)]).tables["cuda_api"]
    f = only(cpu_starved_gpu.analyze(w), "cpu_starved_gpu")
    assert f.severity is Severity.WARNING
    assert evidence(f)["host_runqueue_wait_ratio"].observed == pytest.approx(0.6, abs=0.01)


def test_a_busy_gpu_an_idle_engine_or_a_full_queue_is_not_cpu_starvation():
    assert cpu_starved_gpu.analyze(starved_window(util=0.7, thread=0.4)) == []
    assert cpu_starved_gpu.analyze(starved_window(util=0.05, thread=0.99, arrivals_per_s=0.0)) == []
    assert cpu_starved_gpu.analyze(starved_window(util=0.1, thread=0.99, waiting=40.0)) == []


# --- fragmentation ------------------------------------------------------------------------------

def test_a_fragmentation_finding_tells_one_moment_in_its_summary_and_its_evidence():
    # Failures of a 1 GiB request from 300 s to 400 s with 1.5 GiB free in holes of 256 MiB; between
    # failures the holes shrink further (95 % fragmented) with nothing failing.
    n = 900
    failing = lambda t: 300 <= t <= 400 and t % 10 == 0  # noqa: E731
    largest = lambda t: 256 * MiB if failing(t) else 80 * MiB  # noqa: E731
    proc = process_rows(n, **{M.process_torch_reserved_bytes: 40 * GiB,
                              M.process_torch_allocated_bytes: 40 * GiB - 1.5 * GiB,
                              M.process_torch_largest_free_block_bytes: largest,
                              M.process_torch_alloc_retries_total: lambda t: float(t)})
    count = lambda t: float(sum(1 for x in range(1, int(t) + 1) if failing(x)))  # noqa: E731
    eng = engine_rows(n, **{M.engine_kv_alloc_failures_total: count,
                            M.engine_kv_failed_request_bytes: lambda t: float(GiB) if failing(t) else 0.0})
    f = only(memory_fragmentation.analyze(window(process=proc, engine=eng)), "memory_fragmentation")
    ev = evidence(f)
    frag = ev[M.process_torch_external_fragmentation_ratio].observed
    assert frag == pytest.approx(1 - 256 / 1536)
    assert f"external fragmentation {frag:.0%}" in f.summary
    assert ev[M.process_torch_largest_free_block_bytes].observed == 256 * MiB


# --- co-tenant ---------------------------------------------------------------------------------

def cotenant_window(n=900, cotenant=True, engine_extra=None):
    proc = process_rows(n, **{M.process_gpu_memory_bytes: 30 * GiB})
    if cotenant:
        proc += process_rows(n, pid=777, process="python train.py", **{M.process_gpu_memory_bytes: 38 * GiB})
    eng = engine_rows(n, **{M.engine_kv_capacity_bytes: 9 * GiB if cotenant else 45 * GiB})
    if engine_extra:
        for r, extra in zip(eng, engine_extra):
            r.update(extra)
    return window(process=proc, engine=eng, gpu=gpu_rows(n, **{M.gpu_memory_total_bytes: 80 * GiB}))


def test_a_leftover_training_process_on_the_engines_gpu_is_a_cotenant():
    f = only(gpu_cotenant.analyze(cotenant_window()), "gpu_cotenant")
    assert f.pid == 777 and f.gpu == GPU
    assert f.severity is Severity.CRITICAL
    assert f.details["engine_pid"] == ENGINE_PID
    ev = evidence(f)
    assert ev["cotenant_gpu_memory_bytes"].observed == 38 * GiB
    assert ev["kv_capacity_of_nominal_ratio"].observed == pytest.approx(9 / 47)
    assert f.fixes == ["dedicated-gpu"]
    assert "python train.py" in f.summary


def test_an_engine_alone_on_its_gpu_has_no_cotenant():
    assert gpu_cotenant.analyze(cotenant_window(cotenant=False)) == []


def test_an_engine_that_restarted_in_the_window_is_not_its_own_cotenant():
    # The engine restarted with a smaller pool: its old process (pid 4100, stated by its rows) held
    # 40 GiB until it exited at 400 s, its new one (pid 4200) runs from 300 s.
    n = 900
    old = [r for r in process_rows(n, **{M.process_gpu_memory_bytes: 40 * GiB}) if r["t"] <= 400]
    new = [r for r in process_rows(n, pid=4200, **{M.process_gpu_memory_bytes: 30 * GiB}) if r["t"] >= 300]
    eng = engine_rows(n, **{M.engine_kv_capacity_bytes: 9 * GiB, M.engine_kv_capacity_nominal_bytes: 45 * GiB})
    for r in eng:
        r["pid"] = ENGINE_PID if r["t"] < 300 else 4200
    w = window(process=old + new, engine=eng, gpu=gpu_rows(n, **{M.gpu_memory_total_bytes: 80 * GiB}))
    assert gpu_cotenant.analyze(w) == []


def test_a_cotenant_finding_heads_the_eviction_storm_it_caused():
    n = HOUR
    storm_rows = vllm_engine_rows(n, storm=(1200, 2400))
    extra = [{k: v for k, v in r.items() if k not in ("t", "node", "gpu", "engine")} for r in storm_rows]
    findings = run_all(cotenant_window(n=n, engine_extra=extra))
    kinds = [f.kind for f in findings]
    assert kinds.index("gpu_cotenant") < kinds.index("kv_eviction_storm")
    cot = only(findings, "gpu_cotenant")
    storm = only(findings, "kv_eviction_storm")
    assert cot.id in storm.caused_by
    assert not cot.caused_by
    assert findings[0].kind == "gpu_cotenant"


# --- degenerate kernel launch -------------------------------------------------------------

def kernel_rows(n, blocks, duration, function="flash_attn_bwd", launches_per_s=50):
    return [{"t": float(t), "node": NODE, "pid": ENGINE_PID, "process": ENGINE, "function": function,
             M.cuda_function_launches_total: launches_per_s * t, M.cuda_function_grid_blocks: blocks(t),
             M.cuda_function_duration_seconds: duration(t)} for t in range(1, n + 1)]


def test_flash_attention_launched_with_grid_one_after_an_upgrade_is_found():
    rows = kernel_rows(1800, blocks=lambda t: 1024 if t < 900 else 1, duration=lambda t: 2e-3 if t < 900 else 80e-3)
    rows += kernel_rows(1800, blocks=lambda t: 1, duration=lambda t: 4e-6, function="scalar_bookkeeping")
    w = window(cuda_api=rows, process=process_rows(10, **{M.process_gpu_memory_bytes: GiB}))
    f = only(degenerate_kernel_launch.analyze(w), "degenerate_kernel_launch")
    assert f.severity is Severity.CRITICAL and f.gpu == GPU and f.pid == ENGINE_PID
    assert f.details["function"] == "flash_attn_bwd"
    assert f.details["slowdown_ratio"] == pytest.approx(40)
    assert (f.start_s, f.end_s) == (900.0, 1800.0)
    assert evidence(f)[M.cuda_function_grid_blocks].baseline == 1024
    assert f.fixes == ["correct-grid"]


def test_a_single_block_kernel_that_runs_for_milliseconds_is_degenerate_without_history():
    w = window(cuda_api=kernel_rows(600, blocks=lambda t: 1, duration=lambda t: 80e-3))
    f = only(degenerate_kernel_launch.analyze(w), "degenerate_kernel_launch")
    assert f.gpu is None  # no process rows: the pid's GPU is unknown


def test_grid_one_launches_seen_only_as_a_counter_give_a_warning_without_durations():
    rows = [{"t": float(t), "node": NODE, "pid": ENGINE_PID, M.cuda_kernel_launches_total: 100 * t,
             M.cuda_degenerate_launches_total: 10 * t} for t in range(1, 601)]
    f = only(degenerate_kernel_launch.analyze(window(cuda_api=rows)), "degenerate_kernel_launch")
    assert f.severity is Severity.WARNING
    assert f.details["durations"] == "not measured"
    assert evidence(f)["degenerate_launch_share_ratio"].observed == pytest.approx(0.1)


def test_healthy_launches_and_fast_bookkeeping_kernels_are_not_degenerate():
    rows = kernel_rows(600, blocks=lambda t: 1024, duration=lambda t: 2e-3)
    rows += kernel_rows(600, blocks=lambda t: 1, duration=lambda t: 4e-6, function="scalar_bookkeeping")
    rows += [{"t": float(t), "node": NODE, "pid": 9, M.cuda_kernel_launches_total: 100 * t,
              M.cuda_degenerate_launches_total: t} for t in range(1, 601)]
    assert degenerate_kernel_launch.analyze(window(cuda_api=rows)) == []


# --- throttling and hardware errors -------------------------------------------------------------

REASONS_OFF = {r: 0 for r in ("gpu_idle", "sw_power_cap", "hw_slowdown", "sw_thermal_slowdown",
                              "hw_thermal_slowdown", "hw_power_brake_slowdown")}


def clocks(n, reason_at, clock_ratio_at, temp_at):
    return gpu_rows(n, **{
        M.gpu_clock_throttle_active: lambda t: {**REASONS_OFF, **reason_at(t)},
        M.gpu_sm_clock_hertz: lambda t: 1.41e9 * clock_ratio_at(t), M.gpu_sm_clock_max_hertz: 1.41e9,
        M.gpu_temperature_celsius: temp_at, M.gpu_power_watts: 300.0, M.gpu_power_limit_watts: 400.0})


def test_a_hot_gpu_slowed_by_hardware_thermal_slowdown_is_critical():
    hot = (600, 900)
    w = window(gpu=clocks(1200, reason_at=lambda t: {"hw_thermal_slowdown": int(hot[0] <= t < hot[1])},
                          clock_ratio_at=lambda t: 0.6 if hot[0] <= t < hot[1] else 1.0,
                          temp_at=lambda t: 91.0 if hot[0] <= t < hot[1] else 70.0))
    f = only(throttling.analyze(w), "throttling")
    assert f.severity is Severity.CRITICAL
    assert (f.start_s, f.end_s) == (600.0, 899.0)
    assert f.details["reasons"] == ["hw_thermal_slowdown"]
    ev = evidence(f)
    assert ev["gpu_sm_clock_ratio"].observed == pytest.approx(0.6)
    assert ev[M.gpu_temperature_celsius].observed == 91.0


def test_above_85_celsius_alone_is_a_warning():
    w = window(gpu=clocks(600, reason_at=lambda t: {}, clock_ratio_at=lambda t: 1.0,
                          temp_at=lambda t: 87.0 if t > 300 else 80.0))
    f = only(throttling.analyze(w), "throttling")
    assert f.severity is Severity.WARNING and f.details["reasons"] == []


def test_idle_clocks_and_a_brief_power_cap_are_not_throttling():
    w = window(gpu=clocks(600, reason_at=lambda t: {"gpu_idle": 1, "sw_power_cap": int(100 <= t < 120)},
                          clock_ratio_at=lambda t: 0.3, temp_at=lambda t: 45.0))
    assert throttling.analyze(w) == []


def test_a_power_cap_without_the_maximum_clock_says_the_ratio_is_unknown():
    # dcgm-exporter's default field list has the SM clock but not its maximum: the flag is taken at its
    # word, and the finding does not claim the clock fell to 0 % of a maximum nobody exported.
    rows = clocks(900, reason_at=lambda t: {"sw_power_cap": int(300 <= t < 600)},
                  clock_ratio_at=lambda t: 0.7 if 300 <= t < 600 else 1.0, temp_at=lambda t: 70.0)
    for r in rows:
        del r[M.gpu_sm_clock_max_hertz]
    f = only(throttling.analyze(window(gpu=rows)), "throttling")
    assert f.severity is Severity.WARNING and f.details["reasons"] == ["sw_power_cap"]
    assert evidence(f)["gpu_sm_clock_ratio"].observed is None
    assert "0 %" not in f.summary and "not exported" in f.summary, f.summary


def hw_rows(n, xid=lambda t: {}, corrected=lambda t: 0, nvlink=lambda t: 0, replay=lambda t: 0):
    return gpu_rows(n, **{
        M.gpu_xid_errors_total: xid,
        M.gpu_ecc_errors_total: lambda t: {"volatile": {"corrected": corrected(t), "uncorrected": 0},
                                           "aggregate": {"corrected": 5000 + corrected(t), "uncorrected": 2}},
        M.gpu_nvlink_errors_total: lambda t: {"dl_replay": nvlink(t), "dl_recovery": 0, "dl_crc_flit": 0},
        M.gpu_pcie_replay_total: replay, M.gpu_lost: 0})


def test_a_gpu_fallen_off_the_bus_xid_79_is_critical():
    f = only(hardware_errors.analyze(window(gpu=hw_rows(600, xid=lambda t: {"79": 1} if t >= 400 else {}))),
             "hardware_errors")
    assert f.severity is Severity.CRITICAL
    assert f.start_s == 400.0
    assert f.details["counters"] == {"gpu_xid_errors_total{xid=79}": 1.0}


def test_corrected_ecc_and_pcie_replays_rising_are_warnings():
    w = window(gpu=hw_rows(600, corrected=lambda t: t // 4, replay=lambda t: t // 30))
    f = only(hardware_errors.analyze(w), "hardware_errors")
    assert f.severity is Severity.WARNING
    ev = evidence(f)
    assert ev["gpu_ecc_errors_total{kind=corrected}"].observed == 150
    assert ev[M.gpu_pcie_replay_total].observed == 20


def test_steady_counters_and_a_few_link_retrains_are_healthy():
    w = window(gpu=hw_rows(600, nvlink=lambda t: 3 if t > 100 else 0, replay=lambda t: 7))
    assert hardware_errors.analyze(w) == []


# --- latency regression ----------------------------------------------------------------------

def request_rows(n_s, slow_from=None, stragglers=0.0, factor=1.0, qps=10, seed=5):
    rng = np.random.default_rng(seed)
    rows = []
    for t in range(1, n_s + 1):
        for _ in range(qps):
            ttft, tpot = rng.lognormal(np.log(0.08), 0.2), rng.lognormal(np.log(0.05), 0.15)
            if slow_from is not None and t >= slow_from:
                tpot *= factor
                if rng.random() < stragglers:
                    tpot *= 12
            rows.append({"t": float(t), "node": NODE, "gpu": GPU, "engine": ENGINE,
                         M.time_to_first_token_seconds: ttft, M.inter_token_latency_seconds: tpot,
                         M.e2e_request_latency_seconds: ttft + 200 * tpot})
    return rows


def ttft_rows(n_s, grow_from, queue_factor=1.0, prefill_factor=1.0, parts=True, qps=10, seed=7):
    """Requests whose TTFT is a queue time plus a prefill time; from ``grow_from`` one or both grow."""
    rng = np.random.default_rng(seed)
    rows = []
    for t in range(1, n_s + 1):
        for _ in range(qps):
            queue, prefill = rng.lognormal(np.log(0.02), 0.3), rng.lognormal(np.log(0.06), 0.2)
            if t >= grow_from:
                queue, prefill = queue * queue_factor, prefill * prefill_factor
            row = {"t": float(t), "node": NODE, "gpu": GPU, "engine": ENGINE,
                   M.time_to_first_token_seconds: queue + prefill, M.inter_token_latency_seconds: 0.05,
                   M.e2e_request_latency_seconds: queue + prefill + 10.0}
            if parts:
                row |= {M.request_queue_time_seconds: queue, M.request_prefill_time_seconds: prefill}
            rows.append(row)
    return rows


@pytest.mark.parametrize("queue_factor, prefill_factor, cause", [(60.0, 1.0, "queue"), (1.0, 5.0, "prefill"),
                                                                 (8.0, 3.0, "queue")])
def test_a_ttft_regression_says_whether_it_grew_in_the_queue_or_in_the_prefill(queue_factor, prefill_factor, cause):
    w = window(request=ttft_rows(HOUR, 2400, queue_factor, prefill_factor))
    f = only(latency_regression.analyze(w), "latency_regression")
    assert f.details["metrics"] == [M.time_to_first_token_seconds]
    assert f.details["ttft_cause"] == cause
    assert f.details["ttft_hint"] == latency_regression.TTFT_HINTS[cause]
    assert f"TTFT grew in the {cause}" in f.summary
    ev = evidence(f)
    grown = M.request_queue_time_seconds if cause == "queue" else M.request_prefill_time_seconds
    e = ev[grown.replace("_seconds", "_p99_seconds")]
    assert e.observed >= 2.5 * e.baseline


def test_a_few_requests_waiting_in_the_queue_is_not_blamed_on_links_or_clocks():
    # From 40 min on, one request in twenty waits 2 s for room: TTFT P99 up, P50 flat, all in the queue.
    rows = ttft_rows(HOUR, HOUR + 1)
    rng = np.random.default_rng(3)
    for r in rows:
        if r["t"] >= 2400 and rng.random() < 0.05:
            r[M.request_queue_time_seconds] += 2.0
            r[M.time_to_first_token_seconds] += 2.0
    f = only(latency_regression.analyze(window(request=rows)), "latency_regression")
    assert f.details["pattern"] == latency_regression.STRAGGLERS and f.details["ttft_cause"] == "queue"
    assert "hint" not in f.details and "communication" not in f.summary
    assert "P50 flat, a few requests waited" in f.summary


def test_without_queue_and_prefill_columns_a_ttft_regression_names_no_part():
    f = only(latency_regression.analyze(window(request=ttft_rows(HOUR, 2400, 60.0, parts=False))),
             "latency_regression")
    assert f.details["metrics"] == [M.time_to_first_token_seconds]
    assert "ttft_cause" not in f.details and "TTFT grew" not in f.summary


def test_p99_up_with_p50_flat_points_at_stragglers_or_communication():
    w = window(request=request_rows(HOUR, slow_from=2400, stragglers=0.03))
    f = only(latency_regression.analyze(w), "latency_regression")
    assert f.details["pattern"] == "stragglers_or_communication"
    assert "NVLink" in f.details["hint"] and "PCIe" in f.details["hint"]
    assert M.inter_token_latency_seconds in f.details["metrics"]
    assert M.time_to_first_token_seconds not in f.details["metrics"]
    assert abs(f.start_s - 2400) <= latency_regression.BUCKET_S and f.end_s >= 3300
    ev = evidence(f)
    assert ev["inter_token_latency_p99_seconds"].observed >= 2 * ev["inter_token_latency_p99_seconds"].baseline
    assert ev["inter_token_latency_p50_seconds"].observed <= 1.2 * ev["inter_token_latency_p50_seconds"].baseline


def test_everything_slower_is_a_broad_regression_and_critical_at_three_times():
    w = window(request=request_rows(HOUR, slow_from=1800, factor=4.0))
    f = only(latency_regression.analyze(w), "latency_regression")
    assert f.details["pattern"] == "broad" and "hint" not in f.details
    assert f.severity is Severity.CRITICAL


def test_a_given_baseline_replaces_the_windows_first_part():
    w = window(request=request_rows(1800))
    base = {M.inter_token_latency_seconds: {"p50": 0.02, "p99": 0.025}}
    f = only(latency_regression.analyze(w, baseline=base), "latency_regression")
    assert f.details["metrics"] == [M.inter_token_latency_seconds]


@pytest.mark.parametrize("slow, found", [(2, False), (5, True)])
def test_a_p99_made_by_one_or_two_slow_requests_is_no_regression(slow, found):
    # 1.3 requests/s: a five-minute bucket holds a few hundred requests, the last (cut by the
    # window's end) under a hundred, whose P99 is its slowest one or two.
    rng = np.random.default_rng(11)
    rows = []
    for t in np.arange(1.0, 900.0, 0.75):
        rows.append({"t": float(t), "node": NODE, "gpu": GPU, "engine": ENGINE,
                     M.time_to_first_token_seconds: rng.lognormal(np.log(0.05), 0.4),
                     M.inter_token_latency_seconds: 0.05, M.e2e_request_latency_seconds: 10.0})
    late = [r for r in rows if r["t"] >= 830]
    for r in late[:slow]:
        r[M.time_to_first_token_seconds] = 0.6
    got = [f for f in latency_regression.analyze(window(request=rows)) if f.kind == "latency_regression"]
    assert bool(got) is found, [f.summary for f in got]


def test_steady_latency_is_no_regression():
    assert latency_regression.analyze(window(request=request_rows(HOUR))) == []


def test_a_regression_starts_when_its_bucket_showed_its_tail_not_at_the_buckets_edge():
    # The baseline ends at 900 s; buckets start there every 300 s. TPOT quadruples from 1370 s,
    # in the last 130 s of the bucket [1200, 1500).
    f = only(latency_regression.analyze(window(request=request_rows(HOUR, slow_from=1370, factor=4.0))),
             "latency_regression")
    assert 1370 <= f.start_s <= 1371


def test_a_window_that_starts_unhealthy_is_judged_against_the_slo_not_its_own_slow_start():
    # TTFT around 40 s from the first second (a queue that never drains): its first quarter is no
    # healthy baseline, and "twice 40 s" would hide it. TPOT is healthy and steady.
    rows = request_rows(1800)
    for r in rows:
        r[M.time_to_first_token_seconds] *= 500
    f = only(latency_regression.analyze(window(request=rows)), "latency_regression")
    assert f.details["metrics"] == [M.time_to_first_token_seconds]
    assert f.details["baseline_source"] == {M.time_to_first_token_seconds: "slo"}
    assert f.details["no_healthy_baseline"] is True and f.details["pattern"] is None
    # An SLO is not handed back as a measured baseline; TPOT's healthy one is, and e2e (which holds
    # the unhealthy TTFT) has none.
    assert set(f.details["baseline"]) == {M.inter_token_latency_seconds}
    ev = evidence(f)["time_to_first_token_p99_seconds"]
    assert ev.baseline is None and ev.threshold == latency_regression.TTFT_SLO_P99_S
    assert "SLO" in f.summary and "no healthy baseline" in f.summary and " vs " not in f.summary
    # Judged from the window's start: the unhealthy stretch is part of the problem.
    assert f.start_s < 0.25 * 1800 and f.severity is Severity.CRITICAL


def test_a_slow_but_steady_window_within_its_slo_is_no_regression():
    rows = request_rows(1800)
    for r in rows:
        r[M.time_to_first_token_seconds] *= 10  # about 0.8 s: slower than usual, within the 2 s SLO
    assert latency_regression.analyze(window(request=rows)) == []


def test_a_healthy_baseline_is_within_its_slo():
    rows = request_rows(HOUR, slow_from=2400, factor=4.0)
    f = only(latency_regression.analyze(window(request=rows)), "latency_regression")
    assert f.details["baseline_source"][M.inter_token_latency_seconds] == "window"
    base = evidence(f)["inter_token_latency_p99_seconds"].baseline
    assert base <= latency_regression.TPOT_SLO_P99_S and f.details["no_healthy_baseline"] is False


def test_cpu_starved_reports_no_regression_against_its_unhealthy_start(cli):
    # The starved engine's TTFT P99 is already 1m33s in its first 2m30s: never a baseline.
    out = cli("repro", "cpu-starved", "--json")
    assert out.returncode in (0, 1), out.stderr
    doc = json.loads(out.stdout)
    (lat,) = [f for f in doc["findings"] if f["kind"] == "latency_regression"]
    assert lat["details"]["no_healthy_baseline"] is True
    assert set(lat["details"]["baseline_source"].values()) == {"slo"}
    assert "vs 1m33s" not in lat["summary"] and "no healthy baseline" in lat["summary"]
    assert all(e["baseline"] is None for e in lat["evidence"])
    assert any(c.startswith("cpu_starved_gpu-") for c in lat["caused_by"])


def test_the_healthy_scenarios_baseline_is_healthy_and_nothing_regresses():
    from gpudiag import repro
    from gpudiag.reference_engine import scenarios

    w = repro.run(scenarios.get("healthy"), None, 0).window
    req = w.table("request")
    first = req[req["t"] < req["t"].min() + latency_regression.BASELINE_SHARE * (req["t"].max() - req["t"].min())]
    for metric, slo in latency_regression.SLO_P99_S.items():
        assert np.percentile(first[metric], 99) <= slo, metric
    assert latency_regression.analyze(w) == []


def test_latency_regression_reads_vllm_histogram_summaries_without_request_rows():
    f = only(latency_regression.analyze(window(engine=vllm_engine_rows(HOUR, storm=(2400, 3600)))),
             "latency_regression")
    assert f.details["metrics"] == [M.inter_token_latency_seconds]
    assert f.details["pattern"] == "stragglers_or_communication"


# --- robustness ----------------------------------------------------------------------------------

def sparse_window():
    """Rows with labels and unrelated columns only: every analyzer must find nothing and not fail."""
    return window(gpu=gpu_rows(120, **{M.gpu_power_watts: 100.0}),
                  process=process_rows(120, **{M.process_resident_memory_bytes: GiB}),
                  engine=engine_rows(120, **{M.prompt_tokens_total: lambda t: t}),
                  request=[{"t": 5.0, "node": NODE, "gpu": GPU, "request_id": 1}],
                  cuda_api=[{"t": 5.0, "node": NODE, "pid": ENGINE_PID, "api": "cudaMalloc",
                             M.cuda_api_calls_total: 3}])


@pytest.mark.parametrize("kind", sorted(ANALYZERS))
def test_missing_columns_give_no_finding_and_no_error(kind):
    assert ANALYZERS[kind](sparse_window()) == []
    assert ANALYZERS[kind](Window({}, 0.0, 0.0)) == []


def test_a_healthy_node_produces_no_finding_from_any_analyzer():
    n = 1800
    w = window(
        gpu=gpu_rows(n, **{M.gpu_utilization_ratio: lambda t: 0.65 + noise(7, 0.03)(t),
                           M.gpu_memory_total_bytes: 80 * GiB, M.gpu_memory_used_bytes: 62 * GiB,
                           M.gpu_temperature_celsius: 68.0, M.gpu_sm_clock_hertz: 1.41e9,
                           M.gpu_sm_clock_max_hertz: 1.41e9, M.gpu_clock_throttle_active: REASONS_OFF,
                           M.gpu_xid_errors_total: {}, M.gpu_pcie_replay_total: 0}),
        process=process_rows(n, **{M.process_torch_allocated_bytes: lambda t: 55 * GiB + jitter(t),
                                   M.process_torch_reserved_bytes: 60 * GiB, M.process_gpu_memory_bytes: 61 * GiB,
                                   M.process_thread_cpu_max_ratio: 0.35}),
        engine=engine_rows(n, **{M.num_requests_running: 48, M.num_requests_waiting: 2,
                                 M.engine_kv_capacity_bytes: 40 * GiB, M.engine_kv_evictions_total: 0,
                                 M.engine_requests_arrived_total: lambda t: 80 * t}),
        request=request_rows(n, qps=5))
    assert run_all(w) == []


def test_cotenant_memory_summed_per_tick_is_the_sort_and_bincount_sum_to_the_bit():
    """Samples on the longest process' ticks are found by search; anything else is sorted; both sum the same."""
    from gpudiag.analyzers.gpu_cotenant import _held_by_t

    def reference(times, held):
        uniq, inverse = np.unique(np.concatenate(times), return_inverse=True)
        return uniq, np.bincount(inverse, weights=np.concatenate(held), minlength=len(uniq))

    rng = np.random.default_rng(7)
    grid = np.cumsum(rng.uniform(0.5, 1.5, 500))
    subsets = [grid, grid[rng.random(500) < 0.3], grid[100:200], grid[:0], grid[rng.random(500) < 0.9]]
    held = [rng.uniform(0, 2**40, len(x)) if i % 2 else rng.integers(0, 2**40, len(x)) for i, x in enumerate(subsets)]
    off_grid = [*subsets[:-1], np.sort(np.append(subsets[-1], grid[3] + 0.125))]
    off_held = [*held[:-1], rng.uniform(0, 1e9, len(off_grid[-1]))]
    for times, values in ((subsets, held), (subsets[1:], held[1:]), (off_grid, off_held)):
        got_t, got = _held_by_t(times, values)
        want_t, want = reference(times, values)
        assert np.array_equal(got_t, want_t) and np.array_equal(got, want)
