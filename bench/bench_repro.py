"""Speed of the simulated reference engine: the 2-hour kv-eviction-storm run, unfixed and with paged KV,
and a fitted window replayed (``gpudiag repro --from-store``).

Prints simulated seconds per wall second, wall time and peak RSS for each,
as the median of several runs (each in a fresh process, so peak RSS is the
run's own). Goal: >= 100x real time on one core.

Before a figure: each run's window holds GPU, process, engine and request rows over the whole
two hours, the unfixed run finds the scenario's findings and the fixed one none that the fix
removes; otherwise exit 3 with the reason.

The fitted case: the two-hour kv-eviction-storm window (its request rows, engine and GPU series, as a
store holds them) fitted as ``repro --from-store`` fits a window, then the fitted scenario replayed; only
the replay is timed. The child checks its input first: every second of the window has its engine row,
every finished request its row, and the fit's arrivals account for every request of the window. With
../shared/data/real present, also the real vLLM run tp1_bs256_offloadoff (20 minutes at a full KV cache).

    .venv/bin/python bench/bench_repro.py [--runs 3] [--only fitted]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
REAL = Path(os.environ.get("GPUDIAG_REAL_DATA", REPO / ".." / "shared" / "data" / "real"))
REAL_VLLM = REAL / "series" / "inferencex"

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


FITTED_CHILD = r"""
import json, resource, sys, time
from pathlib import Path
import numpy as np
from gpudiag import repro, repro_fit
from gpudiag.catalog import M
from gpudiag.reference_engine import scenarios
case = sys.argv[1]
if case == "fitted-storm-2h":
    src = repro.run(scenarios.get("kv-eviction-storm"), None, seed=0)
    w = src.window
    eng, req = w.table("engine"), w.table("request")
    # The input is what it claims: a two-hour window, an engine row a second, a row per finished request.
    assert w.end_s - w.start_s == 7200, w.end_s
    assert len(eng) == 7200 and np.all(np.diff(eng["t"].to_numpy()) == 1.0), "engine seconds missing"
    assert len(req) == int(eng[M.engine_requests_finished_total].iloc[-1]), "request rows dropped"
    f = repro_fit.fit(w, gpu="A100-80GB", model="mistral-7b", serve_args="vllm serve m --max-num-seqs 256",
                      source="kv-eviction-storm window")
    arrived = sum(b.qps * (b.end_s - b.start_s) for b in f.bins)
    assert abs(arrived - len(req)) <= 0.01 * len(req) + src.engine.unfinished(), (arrived, len(req))
else:
    sys.path.insert(0, str(Path("tests").resolve()))
    import real_vllm
    from gpudiag import file_source
    run = {r.node: r for r in real_vllm.runs()}["tp1_bs256_offloadoff"]
    path = Path(f"/tmp/bench-repro-{run.node}.om")
    with open(path, "w") as fh:
        real_vllm.write_openmetrics([run], fh, 1.77e9)
    w, reads = file_source.load_window([str(path)])
    path.unlink()
    assert reads[0].skipped_lines == 0, "scrape lines skipped"
    assert len(w.table("engine")) == len(real_vllm.rows(run)), "scrape rows dropped"
    f = repro_fit.fit(w, gpu="B200", model=run.model, serve_args=run.command, source=run.node)
sc = repro_fit.scenario(f)
t0 = time.perf_counter()
res = repro.run(sc, None, seed=0)
wall = time.perf_counter() - t0
print(json.dumps({"wall_s": wall, "sim_s": res.window.end_s,
                  "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "requests": len(res.window.table("request"))}))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--only", choices=("canned", "fitted"), default=None)
    args = ap.parse_args()
    print(f"{'run':<22} {'sim s/wall s':>13} {'wall s':>8} {'peak RSS':>10} {'requests':>9}")
    cases = []
    if args.only != "fitted":
        cases += [("none", CHILD), ("paged-kv", CHILD)]
    if args.only != "canned":
        cases.append(("fitted-storm-2h", FITTED_CHILD))
        if REAL_VLLM.is_dir():
            cases.append(("fitted-vllm-tp1-bs256", FITTED_CHILD))
        else:
            print(f"fitted-vllm-tp1-bs256: skipped, no real runs at {REAL_VLLM}")
    for fix, child in cases:
        results = []
        for _ in range(args.runs):
            # taskset pins the child to one core: the goal is stated for one core.
            cmd = ["taskset", "-c", "0", sys.executable, "-c", child, fix]
            p = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
            expect(p.returncode == 0, f"the {fix} run failed (its input is not what it claims, or it broke): "
                                      f"{p.stderr.strip()[-2000:]}")
            r = json.loads(p.stdout.strip().splitlines()[-1])
            if child is CHILD:  # the fitted child checks its own input before it replays
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
        print(f"{fix:<22} {speed:>12.0f}x {wall:>8.1f} {rss / 2**20:>8.0f} MiB {results[0]['requests']:>9}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
