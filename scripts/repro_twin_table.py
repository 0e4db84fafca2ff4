"""The fidelity table of ``gpudiag repro --file`` on the InferenceX vLLM runs (docs/repro-twin.md).

Each run of ../shared/data/real/series/inferencex is written back as the vLLM series it was scraped
from (tests/real_vllm.py), read as ``--file`` reads it, fitted with the run's own ``vllm serve``
command line, GPU (B200) and model, and replayed on the simulator (seed 0). Prints one Markdown row
a run; with --json, one JSON document.

    .venv/bin/python scripts/repro_twin_table.py [--runs NODE ...] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import real_vllm  # noqa: E402

from gpudiag import file_source, repro, repro_fit  # noqa: E402

GPU = "B200"  # every InferenceX run (MANIFEST.md)


def twin(run, tmp: Path, seed: int = 0, logged_pool: bool = False) -> dict:
    """Fit and replay one run: its figures, observed and simulated, or why it cannot be described.
    ``logged_pool``: the scrapes carry vllm:cache_config_info with the pool the run's vLLM logged."""
    path = tmp / f"{run.node}.om"
    with open(path, "w") as fh:
        real_vllm.write_openmetrics([run], fh, 1.77e9, cache_config=logged_pool)
    window, _ = file_source.load_window([str(path)])
    out = {"run": run.node, "model": run.model, "index_preemptions": run.preemptions}
    try:
        f = repro_fit.fit(window, gpu=GPU, model=run.model, serve_args=run.command or None, source=run.node)
    except repro_fit.NotDescribable as exc:
        return {**out, "not_described": str(exc)}
    finally:
        path.unlink()
    t0 = time.perf_counter()
    res = repro.run(repro_fit.scenario(f), None, seed)
    wall = time.perf_counter() - t0
    sim = repro_fit.summarize_run(res)
    return {**out, "duration_s": f.duration_s, "speed_factor": f.speed_factor, "sigma_output": f.sigma_output,
            "max_num_seqs": f.knobs.max_num_seqs, "tp": f.knobs.tensor_parallel_size, "clients": f.clients,
            "pool_tokens": f.pool_tokens, "pool_stated": bool(f.knobs.kv_cache_tokens),
            "fidelity": repro_fit.fidelity(f.observed, sim, f.duration_s), "observed": f.observed,
            "simulated": sim, "wall_s": wall}


def preemption_ratio(d: dict) -> float | None:
    """Twin over observed preemptions, where the window preempted."""
    o = d["observed"]["preemptions"]
    return d["simulated"]["preemptions"] / o if o else None


def summary(docs: list[dict]) -> str:
    """Regime kept, and preemptions within 2x of observed on the runs that preempted."""
    described = [d for d in docs if "not_described" not in d]
    same = sum(d["fidelity"]["same_regime"] for d in described)
    storms = [d for d in described if d["observed"]["preemptions"] > 0]
    within = [d["run"] for d in storms if 0.5 <= preemption_ratio(d) <= 2.0]
    return (f"{len(described)} runs described: the twin keeps the regime in {same}; preemptions within 2x of "
            f"observed in {len(within)} of the {len(storms)} that preempted ({', '.join(within) or 'none'})")


def row(d: dict) -> str:
    if "not_described" in d:
        return f"| {d['run']} | — | — | — | — | — | — | not described: {d['not_described']} |"
    o, s, fid = d["observed"], d["simulated"], d["fidelity"]

    def pct(v):
        return f"{v:.0%}" if v is not None else "n/a"

    verdict = "same regime" if fid["same_regime"] else "DIFFERENT regime"
    loop = f", closed loop of {d['clients']}" if d.get("clients") else ""
    return (f"| {d['run']} | {fid['observed_regime']} / {fid['simulated_regime']} "
            f"| {pct(o['kv_max'])} / {pct(s['kv_max'])} "
            f"| {pct(o['kv_full_share'])} / {pct(s['kv_full_share'])} | {o['preemptions']} / {s['preemptions']}"
            f"{f' ({ratio:.2f}x)' if (ratio := preemption_ratio(d)) is not None else ''} "
            f"| {o['running_mean']:.0f} / {s['running_mean']:.0f} | {o['waiting_mean']:.0f} / {s['waiting_mean']:.0f} "
            f"| {o['generation_tokens_per_s']:.0f} / {s['generation_tokens_per_s']:.0f} "
            f"| {d['speed_factor']:.2f}x, σ {d['sigma_output']:.2f}{loop}; {verdict} |")


HEADER = ("| run | regime (observed / twin) | KV max | time at full KV | preemptions | running mean | waiting mean "
          "| generation tok/s | fit; verdict |\n|---|---|---|---|---|---|---|---|---|")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", nargs="*", help="node names (tp1_bs256_offloadoff, ...); default: every run")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--logged-pools", action="store_true",
                    help="give each run the KV pool its vLLM logged (tests/real_vllm.py LOGGED_KV_TOKENS), as "
                         "vllm:cache_config_info in its scrapes; runs without a logged pool keep the estimate")
    args = ap.parse_args()
    if not real_vllm.INFERENCEX.is_dir():
        print(f"no InferenceX runs at {real_vllm.INFERENCEX} (set GPUDIAG_REAL_DATA)", file=sys.stderr)
        return 2
    runs = real_vllm.runs()
    if len(runs) != 72:
        print(f"index.csv lists {len(runs)} runs, not 72", file=sys.stderr)
        return 2
    if args.runs:
        runs = [r for r in runs if r.node in set(args.runs)]
    docs = []
    if not args.json:
        print(HEADER, flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for r in runs:
            d = twin(r, Path(tmp), logged_pool=args.logged_pools)
            docs.append(d)
            if not args.json:
                print(row(d), flush=True)
    if args.json:
        print(json.dumps(docs, indent=1, default=float))
    else:
        print(f"\n{summary(docs)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
