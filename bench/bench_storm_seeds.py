"""The kv-eviction-storm's shape on every seed: one row per seed, then the median and spread.

For each seed the scenario runs unfixed and with paged-kv (two hours simulated
each); the row holds what SCENARIOS.md §1 asks of the reproduction (see
gpudiag/storm_shape.py for the bounds and their reasons) and a verdict per
criterion. Before printing, every run is checked to be whole: each request that
arrived is a request row or counted unfinished.

    .venv/bin/python bench/bench_storm_seeds.py [--seeds 0-9] [--jobs 2] [--json]

A variant of the scenario is measured the same way: --long-share (the long class's share of the
long phase's requests), --preempt and --requeue (the scheduler's rules), --recompute-watermark-gib,
--alloc-retry-ms (the host time of one allocation retry, which bench/alloc_gpu.py measures on a
GPU) and --cut-s (end both runs there: a shorter table, the same criteria). docs/storm-seeds.md gives the
command line of each variant it reports.
"""

from __future__ import annotations

import argparse
import json
import sys
from multiprocessing import Pool


def _variant(v: dict):
    """The overrides a variant asks for, applied to the engine and the workload of both runs."""
    import dataclasses

    def apply(cfg, workload) -> None:
        sched = cfg.scheduler
        if v.get("preempt"):
            sched.policy = v["preempt"]
        if v.get("requeue"):
            sched.requeue = v["requeue"]
        if v.get("recompute_watermark_gib") is not None:
            sched.recompute_watermark_bytes = int(v["recompute_watermark_gib"] * 2**30)
        sched.validate()
        if v.get("alloc_retry_ms") is not None:
            cfg.cost.alloc_retry_s = v["alloc_retry_ms"] / 1e3
        cut = v.get("cut_s")
        if cut is not None:
            workload.duration_s = min(workload.duration_s, cut)
        phases = []
        for p in workload.phases:
            mix = tuple(dataclasses.replace(c, weight=v["long_share"]) if c.name == "long" and
                        v.get("long_share") is not None else c for c in p.mix)
            phases.append(dataclasses.replace(p, end_s=min(p.end_s, workload.duration_s), mix=mix))
        workload.phases = phases

    return apply


def _run(job: tuple[int, str | None, dict]) -> tuple[int, str | None, dict]:
    from gpudiag import repro, storm_shape
    from gpudiag.reference_engine import scenarios

    seed, fix, variant = job
    res = repro.run(scenarios.get("kv-eviction-storm"), fix, seed, overrides=_variant(variant) if variant else None)
    storm_shape.check_complete(res)
    return seed, fix, storm_shape.measure_fixed(res) if fix else storm_shape.measure(res)


def _seeds(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        a, _, b = part.partition("-")
        out.extend(range(int(a), int(b or a) + 1))
    return out


COLUMNS = [  # (key, header, format)
    ("seed", "seed", "{:>4d}"),
    ("ttft_p50_ratio", "TTFT50 x", "{:>8.1f}"),
    ("queue_max", "queue max", "{:>9.0f}"),
    ("queue_drain_s", "drain s", "{:>7.0f}"),
    ("tpot_p99_ratio", "TPOT99 x", "{:>8.2f}"),
    ("long_tpot_p99_ratio", "long99 x", "{:>8.2f}"),
    ("long_requests", "long n", "{:>6d}"),
    ("util_mean_before", "util bef", "{:>8.3f}"),
    ("util_mean_during", "util dur", "{:>8.3f}"),
    ("util_min_during", "util min", "{:>8.2f}"),
    ("util_max_during", "util max", "{:>8.3f}"),
    ("evictions_during", "evict", "{:>6d}"),
    ("alloc_retries_max_per_s", "retry/s", "{:>7.0f}"),
    ("paged_tpot_p999_ratio", "paged999 x", "{:>10.2f}"),
]


def _cell(row: dict, key: str, fmt: str, width: int) -> str:
    v = row.get(key)
    return f"{'-':>{width}}" if v is None else fmt.format(v)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0-9", help="seeds, e.g. 0-9 or 0,3,7")
    ap.add_argument("--jobs", type=int, default=2, help="runs at once, one process each")
    ap.add_argument("--json", action="store_true", help="print the rows and the summary as JSON")
    ap.add_argument("--long-share", type=float, help="the long class's weight against the short one's 1.0")
    ap.add_argument("--preempt", help="the scheduler's preemption policy (lru, self, newest, priority)")
    ap.add_argument("--requeue", help="where a preempted request goes back in the queue (head, fifo)")
    ap.add_argument("--recompute-watermark-gib", type=float, help="KV memory a recompute must leave free")
    ap.add_argument("--cut-s", type=float, help="end both runs at this simulated second")
    ap.add_argument("--alloc-retry-ms", type=float,
                    help="host time of one allocation retry (CostModel.alloc_retry_s, in milliseconds)")
    args = ap.parse_args()
    variant = {k: getattr(args, k) for k in ("long_share", "preempt", "requeue", "recompute_watermark_gib", "cut_s",
                                                "alloc_retry_ms")
               if getattr(args, k) is not None}
    if (args.long_share is not None and not 0 < args.long_share < 1) or \
            (args.recompute_watermark_gib is not None and args.recompute_watermark_gib < 0) or \
            (args.cut_s is not None and not args.cut_s > 4500) or \
            (args.alloc_retry_ms is not None and not args.alloc_retry_ms >= 0):
        print("--long-share must be in (0, 1), --recompute-watermark-gib >= 0, --cut-s after the long phase "
              "(4500 s), --alloc-retry-ms >= 0", file=sys.stderr)
        return 2
    from gpudiag.errors import GpudiagError

    try:
        if variant:
            from gpudiag.reference_engine import scenarios

            _variant(variant)(*scenarios.get("kv-eviction-storm").build(None))
    except GpudiagError as exc:  # an unknown policy or requeue: the scheduler's own message
        print(f"bad variant: {exc}", file=sys.stderr)
        return 2
    try:
        seeds = _seeds(args.seeds)
    except ValueError:
        print(f"bad --seeds {args.seeds!r}: give numbers and ranges, e.g. 0-9 or 0,3,7", file=sys.stderr)
        return 2
    if args.jobs < 1:
        print("--jobs must be at least 1", file=sys.stderr)
        return 2
    from gpudiag import storm_shape

    jobs = [(s, fix, variant) for s in seeds for fix in (None, "paged-kv")]
    rows = {s: {} for s in seeds}
    with Pool(args.jobs) as pool:
        for seed, _fix, got in pool.imap_unordered(_run, jobs):
            rows[seed].update(got)
    table = [rows[s] for s in seeds]
    missing = [s for s, r in rows.items() if "ttft_p50_ratio" not in r or "paged_tpot_p999_ratio" not in r]
    if missing:
        raise SystemExit(f"runs missing for seeds {missing}")
    for r in table:
        r["verdicts"] = storm_shape.verdicts(r)
    keys = [k for k, _, _ in COLUMNS if k != "seed"]
    summary = {k: storm_shape.summary(table, k) for k in keys}
    held = {c: sum(r["verdicts"][c] for r in table) for c in table[0]["verdicts"]}
    if args.json:
        print(json.dumps({"variant": variant, "rows": table, "summary": summary, "seeds_holding": held}, indent=1))
        return 0
    if variant:
        print("variant: " + ", ".join(f"{k} {v}" for k, v in variant.items()))
    print(" ".join(f"{h:>{max(len(h), 4)}}" for _, h, _ in COLUMNS) + "  failed")
    for r in table:
        failed = [c for c, ok in r["verdicts"].items() if not ok]
        print(" ".join(_cell(r, k, f, max(len(h), 4)) for k, h, f in COLUMNS) + "  " + (",".join(failed) or "-"))
    print()
    print(f"{'quantity':<24} {'median':>9} {'min':>9} {'max':>9}")
    for k in keys:
        s = summary[k]
        if s["median"] is None:
            print(f"{k:<24} {'-':>9} {'-':>9} {'-':>9}")
        else:
            print(f"{k:<24} {s['median']:>9.2f} {s['min']:>9.2f} {s['max']:>9.2f}")
    print()
    print("seeds holding each criterion: " + ", ".join(f"{c} {n}/{len(table)}" for c, n in held.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
