"""SCENARIOS.md §2 and §7 on the simulated GPU: a GPU starved by preprocessing on the engine thread, and an
attention kernel launched with grid (1,1,1) after an upgrade; each found from the run's frames and fixed."""

import json

import numpy as np
import pytest

from gpudiag import repro
from gpudiag.analyzers import degenerate_kernel_launch
from gpudiag.catalog import CATALOG, M
from gpudiag.findings import Severity
from gpudiag.frames import Window
from gpudiag.reference_engine import scenarios
from gpudiag.reference_engine.core.sequence import Sequence
from gpudiag.reference_engine.scenarios import host as scenarios_host
from gpudiag.reference_engine.sim.engine import ENGINE_PID, ENGINE_THREAD, SimEngine
from gpudiag.reference_engine.sim.gpu_specs import spec as gpu_spec
from gpudiag.reference_engine.sim.launches import ATTENTION, step_kernels
from gpudiag.reference_engine.sim.preprocess import PreprocessConfig, Preprocessing
from gpudiag.reference_engine.sim.sim_gpu import MODELS

STEADY = scenarios_host.STARVED_RAMP_S
UPGRADE = scenarios_host.GRID_UPGRADE_S


def run(name, fix=None, seed=0, overrides=None):
    return repro.run(scenarios.get(name), fix, seed, overrides=overrides)


@pytest.fixture(scope="module")
def starved():
    return run("cpu-starved")


@pytest.fixture(scope="module")
def fed():
    return run("cpu-starved", "preprocess-workers")


@pytest.fixture(scope="module")
def degenerate():
    return run("degenerate-grid")


@pytest.fixture(scope="module")
def corrected():
    return run("degenerate-grid", "correct-grid")


def table(res, kind, start=0.0, end=None):
    df = res.window.table(kind)
    end = res.window.end_s if end is None else end
    return df[(df["t"] > start) & (df["t"] <= end)]


def steady_throughput(res):
    """Completed requests per second in the steady phase (finish times, whatever the arrival)."""
    req = res.window.table("request")
    done = req[(req["finish_s"] > STEADY) & (req["finish_s"] <= res.window.end_s)]
    return len(done) / (res.window.end_s - STEADY)


def phases(res):
    return {p["name"]: p for p in repro.phase_stats(res)}


def kinds(res):
    return [f.kind for f in res.findings]


def assert_every_other_critical_finding_is_caused_by(res, root_kind):
    root_ids = {f.id for f in res.findings if f.kind == root_kind}
    for f in res.findings:
        if f.kind != root_kind and f.severity is Severity.CRITICAL:
            assert set(f.caused_by) & root_ids, f"{f.kind} is critical and not explained by {root_kind}"


# --- cpu-starved --------------------------------------------------------------------------------

def test_preprocessing_on_the_engine_thread_leaves_the_gpu_near_ten_percent_under_real_traffic(starved):
    gpu, proc, eng = table(starved, "gpu", STEADY), table(starved, "process", STEADY), table(starved, "engine", STEADY)
    assert 0.05 <= gpu[M.gpu_utilization_ratio].mean() <= 0.12
    # The one host thread is saturated, the engine's own queue stays empty, the backlog sits in front of it.
    assert proc[M.process_thread_cpu_max_ratio].mean() >= 0.9
    assert eng[M.num_requests_waiting].mean() <= 0.5
    arrived = eng[M.engine_requests_arrived_total].to_numpy(float)
    assert (arrived[-1] - arrived[0]) / (len(arrived) - 1) == pytest.approx(scenarios_host.STARVED_QPS, rel=0.15)
    backlog = eng[M.engine_preprocess_backlog_requests].to_numpy(float)
    assert backlog[-1] > backlog[0] + 1000
    # Long host gaps between steps: a token every preprocessing, not every few tens of milliseconds.
    assert repro.slo(starved.window.table("request"))["tpot_p50_s"] >= scenarios_host.STARVED_PREPROCESS_S


def test_preprocessing_is_most_of_the_engine_threads_time(starved):
    cost = starved.engine.cfg.cost
    # A request is scheduled right after the thread has preprocessed it.
    prepared = [s for s in starved.engine.requests
                if s.first_scheduled_s is not None and STEADY < s.first_scheduled_s <= starved.window.end_s]
    share = sum(cost.preprocess_cost_s(s.prompt_tokens) for s in prepared) / (starved.window.end_s - STEADY)
    assert share >= 0.7


def test_the_finding_is_a_cpu_starved_gpu_naming_the_engine_thread_and_heading_the_chain(starved):
    found = [f for f in starved.findings if f.kind == "cpu_starved_gpu"]
    assert len(found) == 1
    f = found[0]
    assert f.severity is Severity.CRITICAL and f.pid == ENGINE_PID and f.gpu == 0
    assert f.details["top_thread"] == ENGINE_THREAD
    assert f.start_s <= STEADY and f.end_s >= starved.window.end_s - 1
    assert f.fixes == ["preprocess-workers"]
    assert starved.findings[0] is f
    assert_every_other_critical_finding_is_caused_by(starved, "cpu_starved_gpu")


def test_preprocess_workers_feed_the_gpu_and_serve_four_times_the_requests(starved, fed):
    assert "cpu_starved_gpu" not in kinds(fed)
    assert not [f for f in fed.findings if f.severity is Severity.CRITICAL]
    assert table(fed, "gpu", STEADY)[M.gpu_utilization_ratio].mean() >= 0.7
    assert steady_throughput(fed) >= 4.0 * steady_throughput(starved)
    # The fixed engine keeps up with the offered load; the starved one served a fraction of it.
    assert fed.engine.unfinished() < 0.05 * len(fed.window.table("request"))
    before, after = repro.slo(starved.window.table("request")), repro.slo(fed.window.table("request"))
    assert after["ttft_p99_s"] <= before["ttft_p99_s"] / 50
    assert after["tpot_p99_s"] <= before["tpot_p99_s"] / 10
    assert table(fed, "process", STEADY)[M.process_thread_cpu_max_ratio].mean() < 0.5


def test_the_workers_run_ahead_of_the_engine_with_room_in_the_bounded_queue(fed):
    eng = table(fed, "engine", STEADY)
    depth = scenarios_host.STARVED_QUEUE_DEPTH
    assert (eng[M.engine_prefetch_queue_capacity_requests] == depth).all()
    assert eng[M.engine_prefetch_queue_requests].max() <= depth
    assert eng[M.engine_preprocess_workers_blocked_ratio].mean() < 0.01
    assert 0.1 < eng[M.engine_preprocess_workers_busy_ratio].mean() < 0.8
    assert eng[M.engine_preprocess_backlog_requests].mean() < 5


def test_too_few_workers_are_the_bottleneck_and_leave_the_queue_empty():
    def two_workers(cfg, wl):
        cfg.preprocess.workers = 2

    res = run("cpu-starved", "preprocess-workers", overrides=two_workers)
    eng = table(res, "engine", STEADY)
    assert eng[M.engine_preprocess_workers_busy_ratio].mean() >= 0.97
    assert eng[M.engine_prefetch_queue_requests].mean() < 0.5
    assert eng[M.engine_preprocess_backlog_requests].iloc[-1] > 1000
    cost = res.engine.cfg.cost
    mean_cost = np.mean([cost.preprocess_cost_s(s.prompt_tokens) for s in res.engine.requests])
    assert steady_throughput(res) == pytest.approx(2 / mean_cost, rel=0.1)


def test_an_engine_that_cannot_keep_up_fills_the_bounded_queue_and_blocks_the_workers():
    def overload(cfg, wl):
        cfg.preprocess.workers = 48  # ~70 requests/s of preprocessing, beyond what the GPU serves
        wl.qps = 30.0

    res = run("cpu-starved", "preprocess-workers", overrides=overload)
    eng = table(res, "engine", STEADY)
    depth = scenarios_host.STARVED_QUEUE_DEPTH
    assert eng[M.engine_prefetch_queue_requests].max() == depth
    assert eng[M.engine_prefetch_queue_requests].mean() >= 0.9 * depth
    assert eng[M.engine_preprocess_workers_blocked_ratio].mean() >= 0.1
    assert eng[M.engine_preprocess_backlog_requests].iloc[-1] > 1000
    # The GPU is the limit now, not the host.
    assert table(res, "gpu", STEADY)[M.gpu_utilization_ratio].mean() >= 0.7
    assert "cpu_starved_gpu" not in kinds(res)


def test_a_worker_whose_result_finds_the_queue_full_holds_it_until_the_engine_makes_room():
    pre = Preprocessing(PreprocessConfig(workers=2, queue_depth=1), lambda s: 1.0)
    for i in range(4):
        pre.arrive(Sequence(i, 0.0, 100, 10))
    pre.advance(3.0)
    # At t=1 worker 0's result fills the queue and it takes the next request; worker 1 holds its result.
    # At t=2 worker 0 holds one too: both wait on the queue, nobody takes the last request.
    assert [s.seq_id for s in pre.ready] == [0] and [s.seq_id for s in pre.backlog] == [3]
    assert pre.next_ready_s() is None
    sample = [pre.sample(s) for s in range(3)]
    assert [x["busy_ratio"] for x in sample] == [1.0, 0.5, 0.0]
    assert [x["blocked_ratio"] for x in sample] == [0.0, 0.5, 1.0]
    taken = pre.take_ready(3.0, room=8)
    # The engine takes one at t=3; the result held longest moves in, and its worker starts the last request.
    assert [s.seq_id for s in taken] == [0] and [s.seq_id for s in pre.ready] == [1]
    assert not pre.backlog and pre.next_ready_s() == 4.0
    pre.advance(4.0)
    assert pre.sample(3) == {"backlog": 0.0, "ready": 1.0, "busy_ratio": 0.5, "blocked_ratio": 0.5}


# --- degenerate-grid ----------------------------------------------------------------------------

def attention_rows(res):
    api = res.window.table("cuda_api")
    return api[api["function"] == ATTENTION]


def test_after_the_upgrade_attention_is_launched_with_grid_one_and_found_at_the_head_of_the_chain(degenerate):
    found = [f for f in degenerate.findings if f.kind == "degenerate_kernel_launch"]
    assert len(found) == 1
    f = found[0]
    assert degenerate.findings[0] is f
    assert f.severity is Severity.CRITICAL and f.pid == ENGINE_PID and f.gpu == 0
    assert f.details["function"] == ATTENTION
    assert UPGRADE <= f.start_s <= UPGRADE + 2
    ev = {e.metric: e for e in f.evidence}
    assert ev[M.cuda_function_grid_blocks].observed == 1
    # Usually one block per sequence and query head: a batch of several sequences times 32 heads.
    usual = ev[M.cuda_function_grid_blocks].baseline
    assert usual >= 4 * 32 and usual % 32 == 0
    assert f.details["slowdown_ratio"] >= 30
    assert f.fixes == ["correct-grid"]
    assert_every_other_critical_finding_is_caused_by(degenerate, "degenerate_kernel_launch")
    assert {"memory_fragmentation", "kv_eviction_storm", "cpu_starved_gpu"}.isdisjoint(kinds(degenerate))


def test_one_block_runs_the_attention_kernel_about_forty_times_slower_at_the_same_shape(degenerate):
    cfg = degenerate.engine.cfg
    spec, model = gpu_spec(cfg.gpu), MODELS[cfg.model]
    for batch, context in ((1, 450), (16, 16 * 600), (64, 64 * 2000)):
        blocks, nbytes, flops = step_kernels(model, [1] * batch, context, decode=True)[ATTENTION]
        assert blocks == batch * model.hidden_size // model.head_dim
        slow = cfg.cost.kernel_s(spec, nbytes, flops, blocks=1) / cfg.cost.kernel_s(spec, nbytes, flops)
        assert slow == pytest.approx(scenarios_host.GRID_KERNEL_SLOWDOWN)  # one figure whatever the batch
    assert 30 <= scenarios_host.GRID_KERNEL_SLOWDOWN <= 45


def test_the_scenario_states_the_slowdown_for_the_same_work_and_the_finding_names_its_time_per_launch(degenerate):
    same_work = scenarios_host.GRID_KERNEL_SLOWDOWN
    summary = scenarios.get("degenerate-grid").summary
    assert f"a decode launch takes {same_work:.0f}x as long for the same work" in summary
    (f,) = [f for f in degenerate.findings if f.kind == "degenerate_kernel_launch"]
    ratio = f.details["slowdown_ratio"]
    assert "per launch against" in f.summary and "per normal launch in this window" in f.summary
    assert f"({ratio:.0f}x the time per launch, more work per launch included)" in f.summary
    # The slow kernel slows every step, batches grow, and each launch reads more KV: its time per
    # launch over the incident grows past the slowdown for the same work.
    assert ratio > same_work


def test_the_launch_rows_have_the_shape_the_ebpf_probe_gives(degenerate):
    api = degenerate.window.table("cuda_api")
    per_pid = api[api["function"].isna()]
    assert set(per_pid["pid"]) == {ENGINE_PID}
    launches = per_pid[M.cuda_kernel_launches_total].to_numpy(float)
    single = per_pid[M.cuda_degenerate_launches_total].to_numpy(float)
    assert (np.diff(launches) >= 0).all() and (np.diff(single) >= 0).all()
    t = per_pid["t"].to_numpy(float)
    after = t > UPGRADE + 60
    share = (single[-1] - single[after][0]) / (launches[-1] - launches[after][0])
    assert share >= 0.05  # one launch in ten per layer is attention
    # Over a window after the upgrade, the probe's per-process counters alone give the warning
    # (durations unknown); before it, the few single-block launches of one-sequence steps do not.
    for start, end, expected in ((UPGRADE, degenerate.window.end_s, [Severity.WARNING]), (0.0, UPGRADE, [])):
        w = Window({"cuda_api": per_pid[(per_pid["t"] > start) & (per_pid["t"] <= end)],
                    "process": degenerate.window.table("process")}, start, end)
        assert [f.severity for f in degenerate_kernel_launch.analyze(w)] == expected
    for col in (M.cuda_function_launches_total, M.cuda_function_grid_blocks, M.cuda_function_duration_seconds):
        assert CATALOG[col].entity == "cuda_api" and "function" in CATALOG[col].labels


def test_decode_slows_down_after_the_upgrade_while_time_to_first_token_stays(degenerate):
    ph = phases(degenerate)
    before, after = ph["before"]["slo"], ph["after-upgrade"]["slo"]
    assert after["tpot_p50_s"] >= 2.5 * before["tpot_p50_s"]
    assert after["tpot_p99_s"] >= 3.0 * before["tpot_p99_s"]
    # A new request still waits for the decode step in flight, which is now slower: TTFT moves
    # a little, not like decode.
    assert after["ttft_p50_s"] <= 2.0 * before["ttft_p50_s"]
    assert after["ttft_p50_s"] / before["ttft_p50_s"] < 0.8 * after["tpot_p50_s"] / before["tpot_p50_s"]
    # The GPU is busier, not idler: it spends the time in the one-block kernel.
    assert ph["after-upgrade"]["gpu_util_mean"] > ph["before"]["gpu_util_mean"] + 0.1
    rows = attention_rows(degenerate)
    assert (rows[rows["t"] > UPGRADE + 1][M.cuda_function_grid_blocks] == 1).all()
    assert (rows[rows["t"] <= UPGRADE][M.cuda_function_grid_blocks] > 16).all()


def test_correct_grid_removes_the_finding_and_restores_decode_latency(degenerate, corrected):
    assert "degenerate_kernel_launch" not in kinds(corrected)
    assert not [f for f in corrected.findings if f.severity is Severity.CRITICAL]
    ph = phases(corrected)
    assert ph["after-upgrade"]["slo"]["tpot_p99_s"] <= 1.2 * ph["before"]["slo"]["tpot_p99_s"]
    assert ph["after-upgrade"]["slo"]["tpot_p99_s"] <= phases(degenerate)["after-upgrade"]["slo"]["tpot_p99_s"] / 3
    # The probe still watches: the launches are there, with their usual grids.
    rows = attention_rows(corrected)
    assert len(rows) > 0.9 * scenarios_host.GRID_DURATION_S
    assert (rows[M.cuda_function_grid_blocks] > 16).all()


# --- both -----------------------------------------------------------------------------------------

def test_every_column_the_host_scenarios_emit_is_in_the_catalog():
    labels = {"node", "gpu", "uuid", "pid", "process", "engine", "t", "function", "top_threads"}
    request = {"request_id", "kind", "tier", "arrival_s", "finish_s", "prompt_tokens", "output_tokens", "preemptions"}
    for name, fix in (("cpu-starved", None), ("cpu-starved", "preprocess-workers"), ("degenerate-grid", None)):
        cfg, wl = scenarios.get(name).build(fix)
        wl.duration_s = 40
        seen = set()
        for fr in SimEngine(cfg, wl, seed=0).frames():
            for row in fr.rows:
                seen |= set(row)
        assert not seen - set(CATALOG) - labels - request, (name, fix)


def test_an_engine_without_preprocessing_or_launch_rows_emits_what_it_did_before():
    cfg, wl = scenarios.get("kv-eviction-storm").build()
    wl.duration_s = 30
    frames = list(SimEngine(cfg, wl, seed=0).frames())
    assert "cuda_api" not in {fr.kind for fr in frames}
    cols = {c for fr in frames for row in fr.rows for c in row}
    assert M.engine_preprocess_backlog_requests not in cols and "top_threads" not in cols


@pytest.mark.parametrize("name,fix,root", [("cpu-starved", "preprocess-workers", "cpu_starved_gpu"),
                                           ("degenerate-grid", "correct-grid", "degenerate_kernel_launch")])
def test_repro_on_the_command_line_finds_the_incident_and_checks_the_fix(cli, name, fix, root):
    r = cli("repro", name, "--fix", fix, "--json", "--seed", "1")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["scenario"] == name and doc["fix"] == fix and doc["seed"] == 1
    assert doc["baseline_run"]["findings"][0]["kind"] == root
    assert root not in {f["kind"] for f in doc["findings"]}
    assert doc["slo"]["tpot_p99_s"] < doc["baseline_run"]["slo"]["tpot_p99_s"] / 2
