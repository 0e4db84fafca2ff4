"""Speed of the simulated reference engine: the 2-hour kv-eviction-storm run, unfixed and with paged KV.

Prints simulated seconds per wall second, wall time and peak RSS for each,
as the median of several runs (each in a fresh process, so peak RSS is the
run's own). Goal: >= 100x real time on one core.

Before a figure: each run's window holds GPU, process, engine and request rows over the whole
two hours, the unfixed run finds the scenario's findings and the fixed one none that the fix
removes; otherwise exit 3 with the reason.

    .venv/bin/python bench/bench_repro.py [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checks import expect, expect_findings  # noqa: E402

CHILD = r"""
import json, resource, sys, time
from gpudiag import repro
from gpudiag.reference_engine import scenarios
sc = scenarios.get("kv-eviction-storm")
fix = sys.argv[1] if sys.argv[1] != "none" else None
t0 = time.perf_counter()
res = repro.run(sc, fix, seed=0)
wall = time.perf_counter() - t0
removes = sc.fixes[fix].removes if fix else ()
print(json.dumps({"wall_s": wall, "sim_s": res.window.end_s,
                  "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "requests": len(res.window.columns("request")),
                  "rows": {k: len(res.window.columns(k)) for k in ("gpu", "process", "engine", "request")},
                  "found": sorted({f.kind for f in res.findings}), "expected": list(sc.expected_findings),
                  "removes": list(sc.expected_findings if removes is None else removes)}))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    print(f"{'run':<12} {'sim s/wall s':>13} {'wall s':>8} {'peak RSS':>10} {'requests':>9}")
    for fix in ("none", "paged-kv"):
        results = []
        for _ in range(args.runs):
            # taskset pins the child to one core: the goal is stated for one core.
            cmd = ["taskset", "-c", "0", sys.executable, "-c", CHILD, fix]
            p = subprocess.run(cmd, capture_output=True, text=True)
            expect(p.returncode == 0, f"the {fix} run failed: {p.stderr.strip()[-2000:]}")
            r = json.loads(p.stdout.strip().splitlines()[-1])
            empty = [k for k, n in r["rows"].items() if not n]
            expect(not empty, f"the {fix} run's window holds no {', '.join(empty)} rows")
            expect(r["sim_s"] >= 7000, f"the {fix} run simulated {r['sim_s']:.0f} s, not two hours")
            if fix == "none":
                expect_findings(r["found"], r["expected"], (), "the unfixed run")
            else:
                expect_findings(r["found"], (), r["removes"], f"the {fix} run")
            results.append(r)
        wall = statistics.median(r["wall_s"] for r in results)
        rss = statistics.median(r["peak_rss_bytes"] for r in results)
        speed = results[0]["sim_s"] / wall
        print(f"{fix:<12} {speed:>12.0f}x {wall:>8.1f} {rss / 2**20:>8.0f} MiB {results[0]['requests']:>9}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
