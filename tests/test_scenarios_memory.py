"""SCENARIOS.md §3, §4 and §6 on the simulated GPU, and the healthy baseline they depart from.

Each incident comes out of the mechanism (the caching-allocator model, the KV
managers, a co-tenant's memory, a leaking bug) and goes through the same
analyzers as live data; each fix is checked to remove the diagnosis and to give
back the service level the incident took.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from gpudiag.analyzers import memory_leak, oom_forecast
from gpudiag.analyzers.registry import run_all
from gpudiag.catalog import M
from gpudiag.frames import Window
from gpudiag.reference_engine import scenarios
from gpudiag.reference_engine.scenarios import memory as scenarios_memory
from gpudiag.reference_engine.sim.engine import COTENANT_PID, ENGINE_PID

GiB, MiB = 1024**3, 1024**2
# The agent analyses a trailing 15-minute window (agent/config.py, analyzers.window_s);
# the streaming checks below slide that window over a finished run.
AGENT_WINDOW_S = 900.0
STEP_S = 300.0


def trailing_windows(res, window_s=AGENT_WINDOW_S, step_s=STEP_S, until_s=None):
    """(end, Window) for the agent's trailing window ending every ``step_s`` seconds of the run."""
    w = res.window
    tables = {k: w.table(k) for k in ("gpu", "process", "engine", "request", "node")}
    end = window_s
    last = w.end_s if until_s is None else until_s
    while end <= last:
        start = end - window_s
        yield end, Window({k: df[(df["t"] > start) & (df["t"] <= end)] for k, df in tables.items() if not df.empty},
                          start, end, w.node)
        end += step_s


def engine_pid_rows(res):
    p = res.window.table("process")
    return p[p["pid"] == ENGINE_PID].sort_values("t")


def by_kind(res, kind):
    return [f for f in res.findings if f.kind == kind]


def evidence(f):
    return {e.metric: e for e in f.evidence}


def phases(doc):
    return {p["name"]: p for p in doc["phases"]}


def stray_critical(res, root_kind):
    """Critical findings neither of ``root_kind`` nor caused (transitively) by one."""
    by_id = {f.id: f for f in res.findings}

    def traced(f):
        seen, todo = set(), list(f.caused_by)
        while todo:
            c = by_id.get(todo.pop())
            if c is None or c.id in seen:
                continue
            seen.add(c.id)
            if c.kind == root_kind:
                return True
            todo.extend(c.caused_by)
        return False

    return [f.kind for f in res.findings if f.severity.value == "critical" and f.kind != root_kind and not traced(f)]


def slope(t, y):
    return float(np.polyfit(t, y, 1)[0])


# --- fragmentation-oom (§3) ------------------------------------------------------------

@pytest.fixture(scope="module")
def frag(scenario_run):
    from gpudiag import repro

    res = scenario_run("fragmentation-oom")
    return res, repro.document(res)


@pytest.fixture(scope="module", params=["paged-kv", "chunked-kv", "expandable-segments"])
def frag_fixed(request, scenario_run):
    from gpudiag import repro

    res = scenario_run("fragmentation-oom", request.param)
    return request.param, res, repro.document(res)


def test_a_16_gb_card_with_8_gb_of_weights_runs_out_of_memory_only_as_concurrency_rises(frag):
    res, doc = frag
    ph = phases(doc)
    assert res.engine.cfg.gpu == "T4" and res.engine.gpu.spec.memory_bytes == 15 * GiB
    assert 7e9 <= res.engine.gpu.model.weight_bytes <= 8.5e9
    e = res.window.table("engine")
    running = {name: e[(e["t"] > a) & (e["t"] <= b)][M.num_requests_running].mean()
               for name, a, b in res.scenario.phases}
    assert running["low"] < running["rising"] < running["peak"]
    assert ph["low"]["alloc_failures"] == 0 and ph["rising"]["alloc_failures"] == 0
    assert ph["peak"]["alloc_failures"] > 300
    assert doc["totals"]["num_ooms"] > 300  # torch's allocator raised CUDA out of memory, not a scheduler limit


def test_the_allocations_fail_while_free_memory_sits_in_holes_too_small_for_them(frag):
    res, _ = frag
    e = res.window.table("engine").sort_values("t")
    first = e[e[M.engine_kv_alloc_failures_total] > 0].iloc[0]
    # At the first OOM the tokens stored use well under the KV memory the card has.
    assert first[M.engine_kv_used_bytes] < 0.75 * first[M.engine_kv_capacity_bytes]
    worst = max(by_kind(res, "memory_fragmentation"), key=lambda f: f.details["failures_with_free_memory"])
    ev = evidence(worst)
    failed = ev[M.engine_kv_failed_request_bytes].observed
    assert ev[M.process_reserved_minus_allocated_bytes].observed >= failed
    assert ev[M.process_torch_largest_free_block_bytes].observed < failed / 2
    assert ev[M.process_torch_external_fragmentation_ratio].observed >= 0.7


def test_fragmentation_heads_the_chain_and_explains_every_other_critical_finding(frag):
    res, _ = frag
    frag_findings = by_kind(res, "memory_fragmentation")
    assert frag_findings and frag_findings[0].severity.value == "critical"
    assert frag_findings[0].details["failures_with_free_memory"] >= 300
    assert not frag_findings[0].caused_by
    frag_ids = {f.id for f in frag_findings}
    for f in by_kind(res, "kv_eviction_storm"):
        assert set(f.caused_by) & frag_ids
    # The OOM forecast is a trend from the run's start (memory growing with concurrency), older
    # than the first failure in a hole: a cause starts no later than its effect, so the forecast
    # is a root of its own; every other critical finding traces back to fragmentation.
    assert all(not f.caused_by for f in by_kind(res, "oom_forecast"))
    assert not [k for k in stray_critical(res, "memory_fragmentation") if k != "oom_forecast"]


def test_paged_or_chunked_kv_or_expandable_segments_remove_the_failures_and_give_back_the_tail(frag, frag_fixed):
    _, base = frag
    fix, res, doc = frag_fixed
    assert not by_kind(res, "memory_fragmentation")
    # Fixed 64 MiB chunks still round each request up to whole chunks: a rare failure from that waste
    # (capacity, not holes) may remain; holes are gone.
    t, bt = doc["totals"], base["totals"]
    assert t["alloc_failures"] <= bt["alloc_failures"] / 100 and t["num_ooms"] <= bt["num_ooms"] / 100
    assert t["evictions"] <= bt["evictions"] / 100 and bt["evictions"] > 0
    # Unfixed, the requests behind allocations that fail wait for memory; fixed, they do not.
    assert doc["slo"]["ttft_p99_s"] <= base["slo"]["ttft_p99_s"] / 3
    assert doc["slo"]["tpot_p99_s"] <= 0.5 * base["slo"]["tpot_p99_s"]
    assert doc["totals"]["unfinished"] < base["totals"]["unfinished"]
    assert not [f for f in res.findings if f.severity.value == "critical"], fix


def test_the_fixed_engine_holds_more_requests_at_once_than_the_unfixed_one_held_when_it_first_failed(frag, frag_fixed):
    base_res, _ = frag
    _, res, _ = frag_fixed
    e = base_res.window.table("engine").sort_values("t")
    at_first_oom = int(e[e[M.engine_kv_alloc_failures_total] > 0].iloc[0][M.num_requests_running])
    fixed_peak = int(res.window.table("engine")[M.num_requests_running].max())
    assert fixed_peak > at_first_oom


def test_expandable_segments_reclaims_the_holes_on_retry_instead_of_failing(scenario_run):
    from gpudiag import repro

    doc = repro.document(scenario_run("fragmentation-oom", "expandable-segments"))
    # The allocator hit the cap, unmapped the free pages inside holes and mapped them where
    # the region needed them: retries, no OOM.
    assert doc["totals"]["num_alloc_retries"] > 0
    assert doc["totals"]["num_ooms"] == 0


# --- cotenant (§4) ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cotenant(scenario_run):
    from gpudiag import repro

    res = scenario_run("cotenant")
    fixed = scenario_run("cotenant", "dedicated-gpu")
    return res, repro.document(res), fixed, repro.document(fixed)


def test_the_leftover_training_process_is_in_the_gpus_process_list_holding_half_the_memory(cotenant):
    res, *_ = cotenant
    p = res.window.table("process")
    other = p[p["pid"] == COTENANT_PID]
    assert len(other) == len(engine_pid_rows(res))  # seen every second, next to the engine
    assert other[M.process_gpu_memory_bytes].min() == scenarios_memory.COTENANT_BYTES
    assert (other["process"] == "python train.py").all()
    e = res.window.table("engine")
    ratio = e[M.engine_kv_capacity_bytes] / e[M.engine_kv_capacity_nominal_bytes]
    assert ratio.max() < 0.5


def test_the_small_kv_pool_pages_constantly_and_requests_wait_minutes(cotenant):
    res, doc, fixed, fixed_doc = cotenant
    minutes = res.window.end_s / 60
    assert doc["totals"]["evictions"] / minutes >= 15
    assert doc["totals"]["recomputed_tokens"] > 0.25 * res.engine.prompt_tokens_total
    r = res.window.table("request")
    early = r[r["arrival_s"] < 600][M.time_to_first_token_seconds]
    assert np.percentile(early, 99) > 60  # the first requests wait longer than a client's typical timeout
    assert doc["slo"]["ttft_p99_s"] > 60 * fixed_doc["slo"]["ttft_p99_s"]


def test_the_cotenant_finding_heads_the_chain_with_the_storm_it_causes(cotenant):
    res, *_ = cotenant
    assert res.findings[0].kind == "gpu_cotenant"
    cot = res.findings[0]
    assert cot.severity.value == "critical" and cot.pid == COTENANT_PID
    assert cot.details["engine_pid"] == ENGINE_PID
    assert evidence(cot)["kv_capacity_of_nominal_ratio"].observed < 0.5
    storms = by_kind(res, "kv_eviction_storm")
    assert storms and all(cot.id in s.caused_by for s in storms)
    assert not stray_critical(res, "gpu_cotenant")


def test_a_dedicated_gpu_gives_the_engine_its_nominal_pool_and_stops_the_paging(cotenant):
    _, doc, fixed, fixed_doc = cotenant
    assert not by_kind(fixed, "gpu_cotenant") and not by_kind(fixed, "kv_eviction_storm")
    assert fixed_doc["totals"]["evictions"] == 0
    e = fixed.window.table("engine")
    assert (e[M.engine_kv_capacity_bytes] >= 0.99 * e[M.engine_kv_capacity_nominal_bytes]).all()
    assert fixed_doc["slo"]["ttft_p99_s"] < 5.0
    assert fixed_doc["totals"]["unfinished"] < doc["totals"]["unfinished"] / 4
    assert COTENANT_PID not in set(fixed.window.table("process")["pid"])


# --- pool-leak, driver-leak, tensor-leak (§6) ------------------------------------------------

LEAK_LAYERS = {"tensor-leak": "allocated", "pool-leak": "pool", "driver-leak": "driver"}


@pytest.fixture(scope="module", params=sorted(LEAK_LAYERS))
def leak(request, scenario_run):
    from gpudiag import repro

    res = scenario_run(request.param)
    return request.param, res, repro.document(res)


def test_each_bug_grows_its_own_colour_and_leaves_the_inner_ones_flat(leak):
    name, res, _ = leak
    p = engine_pid_rows(res)
    p = p[p["t"] <= res.engine.leak.first_oom_s]
    t = p["t"].to_numpy(float)
    white, grey, black = (p[c].to_numpy(float) for c in (M.process_torch_allocated_bytes,
                                                          M.process_torch_reserved_bytes, M.process_gpu_memory_bytes))
    rate = 0.4 * MiB  # bytes per second a leak of the scenarios grows at, at least
    layer = LEAK_LAYERS[name]
    assert slope(t, black) > rate  # every leak ends up in what the driver charges the process
    if layer == "allocated":
        assert slope(t, white) > rate
    else:
        assert abs(slope(t, white)) < 0.01 * rate
    if layer == "driver":
        assert abs(slope(t, grey)) < 0.01 * rate
    else:
        assert slope(t, grey) > rate


def test_the_leak_ends_in_an_out_of_memory_that_fails_requests(leak):
    name, res, doc = leak
    first_oom = res.engine.leak.first_oom_s
    assert first_oom is not None and 2.5 * 3600 < first_oom < res.window.end_s
    e = res.window.table("engine").sort_values("t")
    failed = e[M.engine_requests_failed_total].to_numpy(float)
    assert failed[e["t"].to_numpy(float) < first_oom].max() == 0 and failed[-1] > 0
    assert doc["totals"]["unfinished"] >= failed[-1]
    torch_ooms = doc["totals"]["num_ooms"]
    assert (torch_ooms > 0) == (LEAK_LAYERS[name] != "driver")  # a cudaMalloc outside torch is not torch's OOM


def test_the_leak_is_found_in_the_right_layer_at_the_head_of_the_chain(leak):
    name, res, _ = leak
    leaks = by_kind(res, "memory_leak")
    assert len(leaks) == 1 and leaks[0].details["layer"] == LEAK_LAYERS[name]
    assert leaks[0].pid == ENGINE_PID and res.findings[0].kind == "memory_leak"
    for f in by_kind(res, "oom_forecast"):
        assert leaks[0].id in f.caused_by
    assert not stray_critical(res, "memory_leak")


def test_the_streaming_detector_warns_more_than_two_hours_before_the_oom(leak):
    name, res, _ = leak
    first_oom = res.engine.leak.first_oom_s
    detected = None
    for end, w in trailing_windows(res, until_s=first_oom):
        found = [f for f in memory_leak.analyze(w) if f.pid == ENGINE_PID]
        if found:
            assert found[0].details["layer"] == LEAK_LAYERS[name], (end, found[0].summary)
            if detected is None:
                detected = (end, found[0])
    assert detected is not None, "the leak was never found in a 15-minute window"
    end, f = detected
    assert first_oom - end >= 2 * 3600, f"found at {end:.0f} s, OOM at {first_oom:.0f} s"
    # Its forecast was honest: the OOM came within a third of the time it said.
    assert f.details["time_to_oom_s"] == pytest.approx(first_oom - end, rel=0.35)


def test_fixing_the_bug_keeps_memory_flat_and_every_request_served(leak, scenario_run):
    from gpudiag import repro

    name, _, doc = leak
    fixed = scenario_run(name, "no-leak")
    fixed_doc = repro.document(fixed)
    assert not by_kind(fixed, "memory_leak") and not by_kind(fixed, "oom_forecast")
    assert fixed.engine.failed_total == 0 and fixed_doc["totals"]["num_ooms"] == 0
    assert fixed_doc["totals"]["unfinished"] < doc["totals"]["unfinished"]
    p = engine_pid_rows(fixed)
    assert p[M.process_gpu_memory_bytes].max() - p[M.process_gpu_memory_bytes].min() < 64 * MiB


# --- healthy ---------------------------------------------------------------------------------

def test_a_healthy_engine_raises_nothing_over_the_run_nor_in_any_15_minute_window(scenario_run):
    res = scenario_run("healthy")
    assert not [f.summary for f in res.findings if f.severity.value in ("warning", "critical")]
    for end, w in trailing_windows(res):
        loud = [f.summary for f in run_all(w) if f.severity.value in ("warning", "critical")]
        assert not loud, (end, loud)


def test_the_storm_scenarios_calm_first_40_minutes_raise_no_memory_alarm_in_15_minute_windows():
    # The contiguous-KV engine's pool fills in steps over its first minutes and its
    # allocated bytes follow the running batch up and down: neither is a leak or a
    # coming OOM, in any window the agent would analyse.
    from gpudiag import repro

    calm_end = scenarios.STORM_LONG_PHASE[0] - 300.0
    res = repro.run(scenarios.get("kv-eviction-storm"), None, 0,
                    overrides=lambda cfg, wl: setattr(wl, "duration_s", calm_end))
    for end, w in trailing_windows(res, step_s=60.0):
        assert not memory_leak.analyze(w) + oom_forecast.analyze(w), end


# --- the command line -------------------------------------------------------------------------

# Leak runs are shortened to 1.5 h: the leak is found after 15 min, its OOM is hours away.
CLI_RUNS = [("fragmentation-oom", "expandable-segments", []),
            ("cotenant", "dedicated-gpu", []), ("healthy", None, []),
            *[(name, "no-leak", ["--duration", "5400"]) for name in sorted(LEAK_LAYERS)]]


@pytest.mark.parametrize(("name", "fix", "extra"), CLI_RUNS, ids=[f"{n}--{f}" for n, f, _ in CLI_RUNS])
def test_repro_runs_each_memory_scenario_and_fix_from_the_command_line(cli, name, fix, extra):
    args = ["repro", name, "--json", "--seed", "1", *extra] + (["--fix", fix] if fix else [])
    r = cli(*args)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["scenario"] == name and doc["fix"] == fix and doc["seed"] == 1
    sc = scenarios.get(name)
    kinds = {f["kind"] for f in doc["findings"]}
    if fix is None:
        assert not [f for f in doc["findings"] if f["severity"] in ("warning", "critical")]
        return
    base = {f["kind"] for f in doc["baseline_run"]["findings"]}
    assert sc.expected_findings[0] in base
    assert not kinds & set(sc.expected_findings)


# --- the analyzer rules these scenarios rely on, on synthetic 1 s rows -------------------------

def synthetic_window(n, white, grey, black, running, inactive=None):
    """One engine process on an 80 GiB GPU whose colours and batch follow the given functions of t."""
    proc, gpu, eng = [], [], []
    for t in range(1, n + 1):
        base = {"t": float(t), "node": "n", "gpu": 0}
        row = {**base, "pid": ENGINE_PID, "process": "engine", M.process_torch_allocated_bytes: white(t),
               M.process_torch_reserved_bytes: grey(t), M.process_gpu_memory_bytes: black(t)}
        if inactive is not None:
            row[M.process_torch_inactive_split_bytes] = inactive(t)
        proc.append(row)
        gpu.append({**base, M.gpu_memory_total_bytes: 80 * GiB, M.gpu_memory_used_bytes: black(t)})
        eng.append({**base, "engine": "engine", M.num_requests_running: running(t)})
    return Window.from_rows({"process": proc, "gpu": gpu, "engine": eng}, start_s=0.0, end_s=float(n), node="n")


def wandering(seed, mean, spread):
    """A running batch that wanders around ``mean`` by about ``spread`` for minutes at a time (AR(1), 1 s steps)."""
    rng = np.random.default_rng(seed)
    keep = 0.99  # a minute and a half of memory
    x = np.empty(4000)
    x[0] = mean
    for i in range(1, x.size):
        x[i] = mean + keep * (x[i - 1] - mean) + rng.normal(0.0, spread * np.sqrt(1 - keep**2))
    return lambda t: float(max(1, round(x[int(t) % x.size])))


def test_allocated_bytes_that_follow_a_drifting_batch_are_no_tensor_leak():
    # The running batch wanders and drifts up by 15 % over the window (flat by the analyzer's
    # rule); the KV of the running requests follows it, which alone is a significant rise.
    wander = wandering(0, 40, 4)
    load = lambda t: wander(t) + round(6 * t / 900)  # noqa: E731
    per_request = 256 * MiB  # KV of one running request
    white = lambda t: 20 * GiB + per_request * load(t)  # noqa: E731
    t = np.arange(1.0, 901.0)
    assert oom_forecast.rising_slope(t, np.array([white(x) for x in t])) is not None
    w = synthetic_window(900, white=white, grey=lambda t: 40 * GiB, black=lambda t: 41 * GiB, running=load)
    assert memory_leak.analyze(w) == []
    # The same batch with a real leak on top: found, at the leak's rate.
    leaky = synthetic_window(900, white=lambda t: white(t) + MiB * t, grey=lambda t: 40 * GiB + MiB * t,
                             black=lambda t: 41 * GiB + MiB * t, running=load)
    f = memory_leak.analyze(leaky)
    assert [x.details["layer"] for x in f] == ["allocated"]
    assert f[0].details["growth_bytes_per_second"] == pytest.approx(MiB, rel=0.1)


@pytest.mark.parametrize("fill", [
    lambda t: 12 * MiB * min(t, 700),  # climbs for 700 s of the 900 s window, then stays: its second half rises
    lambda t: 8 * GiB * (1 - np.exp(-t / 600)),  # fills ever more slowly towards the working set
], ids=["fill-then-plateau", "saturating-fill"])
def test_a_pool_that_fills_up_to_its_working_set_is_no_trend(fill):
    grey = lambda t: 30 * GiB + fill(t)  # noqa: E731
    w = synthetic_window(900, white=lambda t: 30 * GiB, grey=grey, black=lambda t: GiB + grey(t),
                         running=lambda t: 32.0)
    assert oom_forecast.rising_slope(np.arange(1.0, 901.0), np.array([grey(t) for t in range(1, 901)])) is None
    assert memory_leak.analyze(w) == [] and oom_forecast.analyze(w) == []


def test_reserved_growing_with_releasable_cache_is_no_coming_oom_but_holes_are():
    # Reserved climbs towards the device while allocated is flat: cached blocks a retry gives back...
    cache = synthetic_window(1800, white=lambda t: 40 * GiB, grey=lambda t: 50 * GiB + 10 * MiB * t,
                             black=lambda t: 51 * GiB + 10 * MiB * t, running=lambda t: 32.0,
                             inactive=lambda t: 0.0)
    assert oom_forecast.analyze(cache) == []
    # ...but when the free memory is holes in segments that hold live blocks, it is held.
    holes = synthetic_window(1800, white=lambda t: 40 * GiB, grey=lambda t: 50 * GiB + 10 * MiB * t,
                             black=lambda t: 51 * GiB + 10 * MiB * t, running=lambda t: 32.0,
                             inactive=lambda t: 10 * GiB + 10 * MiB * t)
    f = oom_forecast.analyze(holes)
    assert [x.details["layer"] for x in f] == [oom_forecast.NON_RELEASABLE]
    assert f[0].details["releasable_bytes"] == 0
