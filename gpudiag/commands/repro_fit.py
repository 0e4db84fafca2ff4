"""``gpudiag repro --from-store/--from-prometheus/--file``: the user's own window, fitted and replayed.

The window is fitted (gpudiag/repro_fit.py), optionally saved as TOML, replayed on the simulator, and
set beside what was observed; each ``--fix`` runs on the same workload beside the unfixed twin.
``gpudiag repro scenario.toml`` replays a saved fit (with its observed figures) again.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from rich.console import Console

from gpudiag.errors import GpudiagError
from gpudiag.render import figure_column, identity_column, terminal_table
from gpudiag.units import fmt_ratio, fmt_seconds


def load_source_window(*, store: str | None, prometheus: str | None, files: list[str], since: str | None,
                       start: str | None, end: str | None, node: str | None):
    """The window the source options name (GpudiagError on bad input), and a name for it."""
    given = [o for o, v in (("--from-store", store), ("--from-prometheus", prometheus), ("--file", files or None))
             if v]
    if len(given) > 1:
        raise GpudiagError(f"{' and '.join(given)} exclude each other: give one source of the window")
    if prometheus is not None:
        from gpudiag import promql_source

        return promql_source.load_window(prometheus, since=since, start=start, end=end, node=node), prometheus
    if files:
        from gpudiag import file_source

        window, _ = file_source.load_window(files, since=since, start=start, end=end, node=node)
        return window, ",".join(files)
    from gpudiag import investigate as I

    return I.load_store_window(store, since=since, start=start, end=end, node=node, gpu=None), store


def run_fitted(fitted, *, fixes: list[str], seed: int, as_json: bool, save: str | None) -> int:
    """Replay ``fitted`` (and each fix), print fidelity and the fixes side by side."""
    from gpudiag import repro as R
    from gpudiag import repro_fit as F

    sc = F.scenario(fitted)
    auto = fixes in ([], ["auto"])  # the fixes the unfixed twin's findings propose
    if fixes == ["none"]:
        fixes = []
    elif "auto" in fixes or "none" in fixes:
        raise GpudiagError("--fix auto and --fix none stand alone: give them without other fixes")
    if auto:
        fixes = []
    for fx in fixes:  # refuse a fix the twin cannot judge before minutes of simulation
        F.parse_fix(fx, fitted)
    if save is not None:
        try:
            F.save(fitted, save)
        except OSError as exc:
            raise GpudiagError(f"cannot write {save}: {exc.strerror}") from None
    runs = []
    proposed: list = []
    todo = [None, *fixes]
    while todo:
        fx = todo.pop(0)
        res = R.run(sc, fx, seed)
        runs.append({"fix": fx, "summary": F.summarize_run(res),
                     "findings": [f.to_dict() for f in res.findings]})
        if fx is None and auto:
            proposed = F.candidate_fixes(fitted, res)
            todo += [c.fix for c in proposed]
    base = runs[0]["summary"]
    doc: dict[str, Any] = {
        "scenario": fitted.name,
        "source": fitted.source,
        "seed": seed,
        "duration_s": fitted.duration_s,
        "fit": {"gpu": fitted.gpu, "gpu_name": fitted.gpu_name, "model": fitted.model,
                "model_name": fitted.model_name, "knobs": {k: v for k, v in vars(fitted.knobs).items()},
                "speed_factor": fitted.speed_factor, "sigma_prompt": fitted.sigma_prompt,
                "sigma_output": fitted.sigma_output, "lengths_from": fitted.lengths_from,
                "arrivals_from": fitted.arrivals_from, "initial_requests": fitted.initial_requests,
                "mean_qps": sum(b.qps * (b.end_s - b.start_s) for b in fitted.bins) / fitted.duration_s,
                "notes": fitted.notes},
        "saved_to": save,
        "fidelity": F.fidelity(fitted.observed, base, fitted.duration_s),
        "observed": fitted.observed,
        "simulated": base,
        "findings": runs[0]["findings"],
        "fixes_from": "findings" if auto else "--fix",
        "proposed": [{"fix": c.fix, "reason": c.reason} for c in proposed],
        "fixes": [{"fix": r["fix"], "simulated": r["summary"],
                   "regime": F.regime(r["summary"], fitted.duration_s),
                   "findings": r["findings"]} for r in runs[1:]],
    }
    from gpudiag.findings import deep_clean

    doc = deep_clean(doc)
    if as_json:
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
        return 0
    _print(Console(file=sys.stdout, highlight=False), doc)
    return 0


def _fmt(v, unit: str) -> str:
    if v is None:
        return "n/a"
    if unit == "ratio":
        return fmt_ratio(v)
    if unit == "seconds":
        return fmt_seconds(v)
    return f"{v:,.0f}" if abs(v) >= 10 else f"{v:.1f}"


def _print(out: Console, doc: dict) -> None:
    fit = doc["fit"]
    k = fit["knobs"]
    out.print(f"[bold]{doc['scenario']}[/bold]: {fit['model_name']} ({fit['model']}) on {fit['gpu_name']}"
              f"{' x' + str(k['tensor_parallel_size']) if k['tensor_parallel_size'] > 1 else ''}, "
              f"{fmt_seconds(doc['duration_s'])}, {fit['mean_qps']:.2f} requests/s on average")
    out.print(f"knobs: max-num-seqs {k['max_num_seqs']}, max-num-batched-tokens {k['max_num_batched_tokens']}, "
              f"gpu-memory-utilization {k['gpu_memory_utilization']:g}, block size {k['block_size']}, prefix "
              f"caching {'on' if k['prefix_caching'] else 'off'}, chunked prefill "
              f"{'on' if k['chunked_prefill'] else 'off'}, KV offload {'on' if k['kv_offload'] else 'off'}")
    for n in fit["notes"]:
        out.print(f"  - {n}", markup=False)
    if doc["saved_to"]:
        out.print(f"fitted scenario written to {doc['saved_to']} (gpudiag repro {doc['saved_to']} replays it)")
    fid = doc["fidelity"]
    t = terminal_table("Fidelity: the window against its twin")
    identity_column(t, "signal", [r["signal"] for r in fid["rows"]], style="bold")
    figure_column(t, "observed", justify="right")
    figure_column(t, "simulated", justify="right")
    figure_column(t, "simulated / observed", justify="right")
    for r in fid["rows"]:
        t.add_row(r["signal"], _fmt(r["observed"], r["unit"]), _fmt(r["simulated"], r["unit"]),
                  f"{r['ratio']:.2f}x" if r["ratio"] is not None else "n/a")
    out.print(t)
    same = "the same regime" if fid["same_regime"] else "[bold]a different regime[/bold]"
    out.print(f"regime: observed {fid['observed_regime']}, twin {fid['simulated_regime']}: {same}")
    if doc["fixes_from"] == "findings":
        if doc["proposed"]:
            out.print("fixes the twin's findings propose (--fix none skips them, --fix NAME=VALUE picks others):")
            for c in doc["proposed"]:
                out.print(f"  - {c['fix']}: {c['reason']}", markup=False)
        else:
            out.print("no fix proposed: the twin's findings show no engine at capacity and no queue avalanche")
    if doc["fixes"]:
        _print_fixes(out, doc)


FIX_ROWS = (("KV usage max", "kv_max", "ratio"), ("time at a full KV cache", "kv_full_share", "ratio"),
            ("preemptions", "preemptions", "count"), ("waiting mean", "waiting_mean", "count"),
            ("waiting max", "waiting_max", "count"), ("requests finished", "finished", "count"),
            ("generation tokens/s", "generation_tokens_per_s", "count"),
            ("TTFT P99", "ttft_p99_s", "seconds"), ("TPOT P99", "tpot_p99_s", "seconds"),
            ("unfinished at the end", "unfinished", "count"))


def _print_fixes(out: Console, doc: dict) -> None:
    t = terminal_table("Fixes on the fitted workload (per replica where replicas=N)")
    identity_column(t, "signal", [label for label, _, _ in FIX_ROWS] + ["regime"], style="bold")
    figure_column(t, "unfixed twin", justify="right")
    for fx in doc["fixes"]:
        figure_column(t, fx["fix"], justify="right")
    for label, key, unit in FIX_ROWS:
        t.add_row(label, _fmt(doc["simulated"].get(key), unit),
                  *[_fmt(fx["simulated"].get(key), unit) for fx in doc["fixes"]])
    t.add_row("regime", doc["fidelity"]["simulated_regime"], *[fx["regime"] for fx in doc["fixes"]])
    out.print(t)
