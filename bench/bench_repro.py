"""Speed of the simulated reference engine: the 2-hour kv-eviction-storm run, unfixed and with paged KV.

Prints simulated seconds per wall second, wall time and peak RSS for each,
as the median of several runs (each in a fresh process, so peak RSS is the
run's own). Goal: >= 100x real time on one core.

    .venv/bin/python bench/bench_repro.py [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

CHILD = r"""
import json, resource, sys, time
from gpudiag import repro
from gpudiag.reference_engine import scenarios
sc = scenarios.get("kv-eviction-storm")
fix = sys.argv[1] if sys.argv[1] != "none" else None
t0 = time.perf_counter()
res = repro.run(sc, fix, seed=0)
wall = time.perf_counter() - t0
print(json.dumps({"wall_s": wall, "sim_s": res.window.end_s,
                  "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "requests": len(res.window.table("request"))}))
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
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            results.append(json.loads(out.strip().splitlines()[-1]))
        wall = statistics.median(r["wall_s"] for r in results)
        rss = statistics.median(r["peak_rss_bytes"] for r in results)
        speed = results[0]["sim_s"] / wall
        print(f"{fix:<12} {speed:>12.0f}x {wall:>8.1f} {rss / 2**20:>8.0f} MiB {results[0]['requests']:>9}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
