"""SCENARIOS.md §1 on every seed: the storm's shape (gpudiag/storm_shape.py) over seeds 0 to 9.

Seed 0's shape is checked on the run the other storm tests use. The ten-seed
checks run paged-kv on every seed, and the unfixed run seed by seed up to the
first seed without the shape (``-m "not storm_seeds"`` leaves them out of a
quick run); bench/bench_storm_seeds.py prints every seed's figures as a table.
"""

import pytest

from gpudiag import repro, storm_shape
from gpudiag.reference_engine import scenarios

SEEDS = range(10)


def test_seed_zero_storms_and_recovers_without_an_avalanche(scenario_run):
    res = scenario_run("kv-eviction-storm")
    row = storm_shape.measure(res, scenario_run("kv-eviction-storm", "paged-kv"))
    v = storm_shape.verdicts(row)
    assert v["no_avalanche_ttft"] and v["queue_drains"], row
    # TPOT P99 of all requests is 1.99x on seed 0, a hair under the 2x of the ten-seed shape below.
    assert row["tpot_p99_ratio"] >= 1.9 and v["long_tpot_p99_4x"], row
    assert v["util_pegs"], row
    assert v["paged_removes_it"], row


def test_the_queue_drain_is_measured_from_the_long_phases_end_against_the_calm_queue(scenario_run):
    res = scenario_run("kv-eviction-storm")
    drain = storm_shape.queue_drain_s(res, scenarios.STORM_LONG_PHASE)
    assert drain is not None and 0 < drain <= storm_shape.QUEUE_DRAIN_MAX_S
    # A phase that ends at the run's end leaves no time to drain: not measured as drained.
    assert storm_shape.queue_drain_s(res, (scenarios.STORM_LONG_PHASE[0], res.window.end_s - 1)) in (None, 0.0)


def test_the_busiest_seconds_allocation_retries_are_counted_and_paged_kv_has_none(scenario_run):
    res = scenario_run("kv-eviction-storm")
    row = storm_shape.measure(res)
    total = repro.document(res)["totals"]["num_alloc_retries"]
    assert 1 <= row["alloc_retries_max_per_s"] <= total, (row["alloc_retries_max_per_s"], total)
    assert storm_shape.measure(scenario_run("kv-eviction-storm", "paged-kv"))["alloc_retries_max_per_s"] == 0


def test_a_run_missing_requests_is_refused_by_the_completeness_check(scenario_run):
    import copy
    import dataclasses

    res = copy.copy(scenario_run("kv-eviction-storm"))
    storm_shape.check_complete(res)
    w = res.window
    tables = {kind: w.table(kind) for kind in w.tables}
    res.window = dataclasses.replace(w, tables={**tables, "request": tables["request"].iloc[:-5]})
    with pytest.raises(ValueError, match="arrived"):
        storm_shape.check_complete(res)


def _run(scenario_run, fix, seed):
    """One seed's run; only seed 0's (shared with the other storm tests) stay in memory."""
    if seed == 0:
        return scenario_run("kv-eviction-storm", fix, seed)
    return repro.run(scenarios.get("kv-eviction-storm"), fix, seed)


@pytest.mark.slow
@pytest.mark.storm_seeds
def test_paged_kv_never_evicts_nor_fails_an_allocation_on_any_seed(scenario_run):
    # Its TPOT P999 against the calm P99 is part of the shape below: 1.34x to 1.51x over seeds 0-9, the long
    # phase's own KV reads slowing every step (seed 9 passes the 1.5x bound by 0.01).
    for seed in SEEDS:
        row = storm_shape.measure_fixed(_run(scenario_run, "paged-kv", seed))
        assert row["paged_evictions"] == 0 and row["paged_alloc_failures"] == 0, (seed, row)


@pytest.mark.slow
@pytest.mark.storm_seeds
@pytest.mark.xfail(strict=True, reason="the unfixed run avalanches on most seeds (the long phase's KV demand "
                                       "sits past the contiguous pool's capacity); at the cost model's 2 ms an "
                                       "allocation retry nothing idles the GPU below 35 % for a second (at 10 ms "
                                       "the retries do, and every seed avalanches); paged-kv's TPOT P999 is 1.51x "
                                       "on seed 9")
def test_every_seed_has_the_field_reports_shape(scenario_run):
    # Seed by seed, stopping at the first seed without the shape (today seed 0: TPOT P99 1.99x, no dip);
    # once every seed has it, all ten are measured and the strict xfail turns into a failure to update.
    for seed in SEEDS:
        row = storm_shape.measure(_run(scenario_run, None, seed), _run(scenario_run, "paged-kv", seed))
        failed = [c for c, ok in storm_shape.verdicts(row).items() if not ok]
        assert not failed, (seed, failed, row)


@pytest.mark.parametrize("args,message", [(["--seeds", "a-b"], "bad --seeds"), (["--jobs", "0"], "--jobs must be"),
                                          (["--preempt", "oldest"], "unknown preemption policy"),
                                          (["--requeue", "tail"], "unknown requeue"),
                                          (["--long-share", "1.5"], "--long-share must be in (0, 1)"),
                                          (["--recompute-watermark-gib", "-1"], "--recompute-watermark-gib >= 0"),
                                          (["--cut-s", "3000"], "after the long phase"),
                                          (["--alloc-retry-ms", "-2"], "--alloc-retry-ms >= 0")])
def test_the_seed_benchmark_refuses_arguments_it_cannot_use_in_one_line(args, message):
    import subprocess
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parent.parent / "bench" / "bench_storm_seeds.py"
    got = subprocess.run([sys.executable, str(bench), *args], capture_output=True, text=True, timeout=120)
    assert got.returncode == 2 and "Traceback" not in got.stderr
    assert message in got.stderr.strip().splitlines()[-1]


def test_a_variant_of_the_seed_benchmark_changes_what_it_names_and_nothing_else():
    import dataclasses
    import importlib.util
    from pathlib import Path

    from gpudiag.reference_engine import scenarios

    spec = importlib.util.spec_from_file_location(
        "bench_storm_seeds", Path(__file__).resolve().parent.parent / "bench" / "bench_storm_seeds.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    cfg, wl = scenarios.get("kv-eviction-storm").build(None)
    before = [(p.name, p.start_s, p.end_s, [(c.name, c.weight) for c in p.mix]) for p in wl.phases]
    cost_before = dataclasses.asdict(cfg.cost)
    bench._variant({"long_share": 0.0175, "preempt": "self", "requeue": "fifo", "recompute_watermark_gib": 2,
                    "cut_s": 5400.0, "alloc_retry_ms": 30.0})(cfg, wl)
    assert (cfg.scheduler.policy, cfg.scheduler.requeue) == ("self", "fifo")
    assert dataclasses.asdict(cfg.cost) == {**cost_before, "alloc_retry_s": 0.030}
    assert cfg.scheduler.recompute_watermark_bytes == 2 * 2**30 and wl.duration_s == 5400.0
    after = [(p.name, p.start_s, p.end_s, [(c.name, c.weight) for c in p.mix]) for p in wl.phases]
    assert [a[:2] for a in after] == [b[:2] for b in before]
    assert after[-1][2] == 5400.0 and after[1][2] == before[1][2]  # only the last phase is cut
    assert dict(after[1][3]) == {"short": 1.0, "long": 0.0175} and dict(after[0][3]) == dict(before[0][3])
