"""``gpudiag repro SCENARIO [--fix FIX]``: reproduce an incident on the simulated GPU and check a fix;
``--from-store/--from-prometheus/--file``: fit the user's own window (gpudiag/repro_fit.py), replay it beside what
was observed, and run each fix on the same workload; ``gpudiag repro scenario.toml`` replays a saved fit."""

from __future__ import annotations

import json
import sys
from typing import Any, Optional

import typer
from rich.console import Console
from rich.table import Table

from gpudiag.errors import GpudiagError
from gpudiag.render import figure_column, findings_panel, identity_column, terminal_table, text_column
from gpudiag.units import fmt_bytes, fmt_ratio, fmt_seconds


def register(app: typer.Typer) -> None:
    app.command("repro")(repro)


def repro(
    scenario: Optional[str] = typer.Argument(None, help="Scenario name (see --list), or a fitted scenario file "
                                             "(scenario.toml, written by --save)."),
    fix: Optional[str] = typer.Option(None, "--fix", help="Apply a fix and compare with the unfixed run. On a "
                                      "fitted window: one or more, comma-separated, with parameters "
                                      "(max-num-seqs=128,replicas=2); auto (the default there) runs the fixes the "
                                      "twin's findings propose, none runs no fix."),
    seed: int = typer.Option(0, "--seed", help="Random seed; the same seed gives the same run."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document on stdout."),
    list_: bool = typer.Option(False, "--list", help="List scenarios and their fixes."),
    qps: Optional[float] = typer.Option(None, "--qps", help="Override the request rate."),
    duration: Optional[float] = typer.Option(None, "--duration", help="Override the run length (seconds)."),
    block_size: Optional[int] = typer.Option(None, "--block-size", help="Override the paged-KV block size (tokens)."),
    gpu: Optional[str] = typer.Option(None, "--gpu", help="Override the simulated GPU (A100-80GB, H100-SXM, ...)."),
    model: Optional[str] = typer.Option(None, "--model", help="Override the model shape (llama-7b, mistral-7b, ...)."),
    from_store: Optional[str] = typer.Option(None, "--from-store", help="Fit a scenario to a window of this "
                                             "store (written by `gpudiag agent`) and replay it."),
    from_prometheus: Optional[str] = typer.Option(None, "--from-prometheus", help="Fit a scenario to a window "
                                                  "read from this Prometheus and replay it."),
    files: Optional[list[str]] = typer.Option(None, "--file", help="Fit a scenario to recorded telemetry "
                                              "(OpenMetrics, /metrics scrapes, ...) and replay it."),
    since: Optional[str] = typer.Option(None, "--since", help="With a window source: its length back from "
                                        "the latest sample (30m, 2h)."),
    start: Optional[str] = typer.Option(None, "--from", help="With a window source: the window's start "
                                        "(ISO-8601 or Unix seconds)."),
    end: Optional[str] = typer.Option(None, "--to", help="With a window source: the window's end."),
    node: Optional[str] = typer.Option(None, "--node", help="With a window source: the node whose engine to fit."),
    serve_args: Optional[str] = typer.Option(None, "--serve-args", help="With a window source: the engine's "
                                             "command line (vllm serve MODEL --max-num-seqs ...), for the knobs "
                                             "the window does not show."),
    save: Optional[str] = typer.Option(None, "--save", help="With a window source: write the fitted scenario "
                                       "to this TOML file."),
    kv_cache_tokens: Optional[str] = typer.Option(None, "--kv-cache-tokens", help="With a window source: the "
                                                  "tokens the engine's KV pool holds, where the window does not "
                                                  "say (vLLM logs \"GPU KV cache size: N tokens\" at start)."),
):
    """Reproduce a field incident on the simulated GPU, diagnose it, and check a fix."""
    from gpudiag import repro as R
    from gpudiag.reference_engine import scenarios

    out = Console(file=sys.stdout, highlight=False)
    if list_:
        return _list(out, as_json)
    if from_store or from_prometheus or files or (scenario or "").endswith(".toml"):
        return _fitted(scenario, fix, seed, as_json, from_store, from_prometheus, files or [], since, start, end,
                       node, gpu, model, serve_args, save, kv_cache_tokens,
                       ignored=[o for o, v in (("--qps", qps), ("--duration", duration),
                                               ("--block-size", block_size)) if v is not None])
    window_only = [o for o, v in (("--since", since), ("--from", start), ("--to", end), ("--node", node),
                                  ("--serve-args", serve_args), ("--save", save),
                                  ("--kv-cache-tokens", kv_cache_tokens)) if v is not None]
    if window_only:
        raise GpudiagError(f"{', '.join(window_only)} apply to a window source (--from-store, --from-prometheus, "
                           f"--file); a canned scenario has none")
    if scenario is None:
        raise GpudiagError(f"name a scenario; valid: {', '.join(scenarios.SCENARIOS)} (or use --list)")
    sc = scenarios.get(scenario)
    if fix is not None and not sc.fixes:
        raise GpudiagError(f"scenario {sc.name} has no fix to check; `gpudiag repro --list` shows each "
                           f"scenario's fixes")
    if fix is not None and fix not in sc.fixes:
        raise GpudiagError(f"unknown fix {fix!r} for {sc.name}; valid: {', '.join(sc.fixes)}")

    def overrides(cfg, workload):
        if qps is not None:
            workload.qps = qps
        if duration is not None:
            workload.duration_s = duration
        if block_size is not None:
            cfg.kv.block_size = block_size
        if gpu is not None:
            cfg.gpu = gpu
        if model is not None:
            cfg.model = model
        workload.validate()
        cfg.validate()

    runs = [None, fix] if fix is not None else [None]
    docs = []
    results = []
    for f in runs:
        res = _run_with_progress(sc, f, seed, overrides)
        results.append(res)
        docs.append(R.document(res))
    doc = docs[-1]
    if fix is not None:
        doc["baseline_run"] = docs[0]
    if as_json:
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
        return 0
    _print_report(out, sc, docs, results)
    return 0


def _fitted(scenario, fix, seed, as_json, from_store, from_prometheus, files, since, start, end, node, gpu, model,
            serve_args, save, kv_cache_tokens, ignored) -> int:
    from gpudiag import repro_fit

    pool = _positive_tokens(kv_cache_tokens)
    if ignored:
        raise GpudiagError(f"{', '.join(ignored)} apply to canned scenarios; a fitted window takes its rates and "
                           f"knobs from the window (use --fix to change a knob)")
    fixes = [f.strip() for f in (fix or "").split(",") if f.strip()]
    if scenario is not None:
        if from_store or from_prometheus or files:
            raise GpudiagError("give a fitted scenario file or a window source (--from-store, --from-prometheus, "
                               "--file), not both")
        if pool is not None:
            raise GpudiagError("--kv-cache-tokens applies to a window being fitted; a fitted scenario file keeps "
                               "the pool it was fitted with")
        fitted = repro_fit.load(scenario)
    else:
        window, source = load_source_window(store=from_store, prometheus=from_prometheus, files=files, since=since,
                                            start=start, end=end, node=node)
        fitted = repro_fit.fit(window, gpu=gpu, model=model, serve_args=serve_args, source=source,
                               kv_cache_tokens=pool)
    return run_fitted(fitted, fixes=fixes, seed=seed, as_json=as_json, save=save)


def _positive_tokens(text: str | None) -> int | None:
    """--kv-cache-tokens as a count (vLLM writes it with thousands separators: 1,234,567)."""
    if text is None:
        return None
    try:
        n = int(text.replace(",", "").replace("_", "").strip())
    except ValueError:
        n = 0
    if n <= 0:
        raise GpudiagError(f"--kv-cache-tokens {text!r}: give the pool's size as a positive whole number of tokens")
    return n


def _run_with_progress(sc, fix, seed, overrides):
    from gpudiag import repro as R

    if not sys.stderr.isatty():
        return R.run(sc, fix, seed, overrides=overrides)
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    cfg, workload = sc.build(fix)
    overrides(cfg, workload)
    total = workload.duration_s
    label = f"{sc.name}" + (f" --fix {fix}" if fix else "")
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
                  TextColumn("simulated {task.completed:.0f}/{task.total:.0f} s"), TimeRemainingColumn(),
                  console=Console(file=sys.stderr), transient=True) as progress:
        task = progress.add_task(label, total=total)
        return R.run(sc, fix, seed, overrides=overrides,
                     progress=lambda s: progress.update(task, completed=s) if int(s) % 30 == 0 else None)


def _list(out: Console, as_json: bool):
    from gpudiag.reference_engine import scenarios

    if as_json:
        sys.stdout.write(json.dumps({"scenarios": [
            {"name": s.name, "summary": s.summary, "fixes": {k: v.summary for k, v in s.fixes.items()},
             "expected_findings": list(s.expected_findings)} for s in scenarios.SCENARIOS.values()]}, indent=2) + "\n")
        return 0
    t = Table(title="Scenarios (gpudiag repro NAME [--fix FIX])")
    identity_column(t, "scenario", scenarios.SCENARIOS, style="bold")
    text_column(t, "what it reproduces")
    text_column(t, "fixes")  # an environment setting is one long word: it folds, whole
    for s in scenarios.SCENARIOS.values():
        t.add_row(s.name, s.summary, "\n".join(f"{k}: {v.summary}" for k, v in s.fixes.items()))
    out.print(t)
    return 0


def _range(p) -> str:
    if p["gpu_util_mean"] is None:
        return "n/a"
    return (f"{p['gpu_util_mean']:.0%} mean, {p['gpu_util_p5']:.0%}–{p['gpu_util_p95']:.0%} "
            f"(min {p['gpu_util_min']:.0%}, max {p['gpu_util_max']:.0%})")


def _trend(p) -> str:
    if p["reserved_mean_bytes"] is None:
        return "n/a"
    per_h = p["reserved_slope_bytes_per_s"] * 3600
    arrow = "rising" if per_h > 256 * 1024**2 else "falling" if per_h < -256 * 1024**2 else "stable"
    return f"{fmt_bytes(p['reserved_mean_bytes'])} reserved, {arrow} ({fmt_bytes(per_h)}/h)"


def _by_context(p) -> str:
    lines = [f"{b}: {fmt_seconds(v['tpot_p99_s']) if v['tpot_p99_s'] is not None else 'n/a'} ({v['requests']} req)"
             for b, v in p.get("by_context", {}).items()]
    return "\n".join(lines) or "n/a"


def _recovered(p, i: int) -> str:
    if i == 0:
        return "(the reference)"
    after = p.get("recovered_after_s")
    if after is None:
        return "not within the phase"
    return "throughout" if after == 0 else f"{fmt_seconds(after)} into the phase"


def _incident_table(doc) -> Table:
    from gpudiag.repro import RECOVERY_RATIO

    phases = doc["phases"]
    t = terminal_table(f"{doc['scenario']}" + (f" with --fix {doc['fix']}" if doc["fix"] else " (unfixed)"))
    rows = [
        ("QPS", [f"{p['qps']:.1f}" for p in phases]),
        ("GPU utilization", [_range(p) for p in phases]),
        ("TTFT P99", [fmt_seconds(p["slo"]["ttft_p99_s"]) for p in phases]),
        ("  queue / prefill P99", [f"{fmt_seconds(p['slo']['queue_p99_s'])} / {fmt_seconds(p['slo']['prefill_p99_s'])}"
                                   for p in phases]),
        ("TPOT P99", [fmt_seconds(p["slo"]["tpot_p99_s"]) for p in phases]),
        ("TPOT P999", [fmt_seconds(p["slo"]["tpot_p999_s"]) for p in phases]),
        ("TPOT P99 by context (prompt + output tokens)", [_by_context(p) for p in phases]),
        ("GPU memory (torch)", [_trend(p) for p in phases]),
        ("host CPU (engine)", [f"{fmt_ratio(p['host_cpu_mean'])} mean, {fmt_ratio(p['host_cpu_max'])} max"
                               for p in phases]),
        ("evictions / alloc failures", [f"{p['evictions']} / {p['alloc_failures']}" for p in phases]),
        (f"TTFT and TPOT P99 back within {RECOVERY_RATIO:g}x of {phases[0]['name']}",
         [_recovered(p, i) for i, p in enumerate(phases)]),
    ]
    identity_column(t, "signal", [name for name, _ in rows], style="bold")
    for p in phases:
        figure_column(t, f"{p['name']} ({fmt_seconds(p['start_s'])}–{fmt_seconds(p['end_s'])})")
    for name, cells in rows:
        t.add_row(name, *cells)
    return t


def _slo_table(docs) -> Table:
    t = terminal_table("Latency over the whole run")
    keys = [("TTFT P50", "ttft_p50_s"), ("TTFT P99", "ttft_p99_s"), ("queue time P99", "queue_p99_s"),
            ("prefill time P99", "prefill_p99_s"), ("TPOT P50", "tpot_p50_s"), ("TPOT P99", "tpot_p99_s"),
            ("TPOT P999", "tpot_p999_s"), ("e2e P99", "e2e_p99_s")]
    totals = [("requests finished", "requests"), ("evictions", "evictions"),
              ("recomputed tokens", "recomputed_tokens"), ("KV alloc failures", "alloc_failures"),
              ("allocator retries", "num_alloc_retries"), ("allocator OOMs", "num_ooms")]
    identity_column(t, "metric", [label for label, _ in keys + totals], style="bold")
    for d in docs:
        figure_column(t, d["fix"] or "unfixed", justify="right")
    if len(docs) == 2:
        figure_column(t, "change", justify="right")
    for label, k in keys:
        vals = [d["slo"][k] for d in docs]
        cells = [fmt_seconds(v) for v in vals]
        if len(docs) == 2:
            cells.append(f"{vals[1] / vals[0]:.2f}x" if vals[0] and vals[1] is not None else "n/a")
        t.add_row(label, *cells)
    for label, k in totals:
        vals = [d["totals"][k] for d in docs]
        cells = [str(v) for v in vals]
        if len(docs) == 2:
            cells.append(f"{vals[1] - vals[0]:+d}")
        t.add_row(label, *cells)
    return t


def _print_report(out: Console, sc, docs, results) -> None:
    out.print(f"[bold]{sc.name}[/bold]: {sc.summary}")
    for d in docs:
        out.print(_incident_table(d))
        if d["phases_not_reached"]:
            missed = [f"{p['name']} ({fmt_seconds(p['start_s'])}–{fmt_seconds(p['end_s'])})"
                      for p in d["phases_not_reached"]]
            out.print(f"not reached in this {fmt_seconds(d['duration_s'])} run: " + ", ".join(missed))
    out.print(_slo_table(docs))
    for d, res in zip(docs, results):
        title = "Findings" + (f" with --fix {d['fix']}" if d["fix"] else " (unfixed)")
        out.print(findings_panel(res.findings, title, res.scenario))
    if len(docs) == 2:
        before = {f.kind for f in results[0].findings}
        after = {f.kind for f in results[1].findings}
        gone = sorted(before - after)
        stays = sorted(before & after)
        verdict = []
        if gone:
            verdict.append(f"removed: {', '.join(gone)}")
        if stays:
            verdict.append(f"still present: {', '.join(stays)}")
        if not before:
            verdict.append("the unfixed run showed no diagnosis")
        out.print(f"[bold]Verdict for --fix {docs[1]['fix']}[/bold]: " + "; ".join(verdict))


# --- a fitted window (--from-store, --from-prometheus, --file, scenario.toml) -------------------


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
                "kv_pool_tokens": round(fitted.pool_tokens),
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
    _print_fitted(Console(file=sys.stdout, highlight=False), doc)
    return 0


def _fmt(v, unit: str) -> str:
    if v is None:
        return "n/a"
    if unit == "ratio":
        return fmt_ratio(v)
    if unit == "seconds":
        return fmt_seconds(v)
    # Whole numbers (a count of preemptions, of requests) print whole; means below 10 keep a decimal.
    return f"{v:,.0f}" if abs(v) >= 10 or float(v).is_integer() else f"{v:.1f}"


def _offload(knobs: dict) -> str:
    if not knobs["kv_offload"]:
        return "off"
    size = knobs.get("kv_offload_bytes") or 0
    return f"on ({fmt_bytes(size)} of host memory)" if size else "on"


def _print_fitted(out: Console, doc: dict) -> None:
    fit = doc["fit"]
    k = fit["knobs"]
    out.print(f"[bold]{doc['scenario']}[/bold]: {fit['model_name']} ({fit['model']}) on {fit['gpu_name']}"
              f"{' x' + str(k['tensor_parallel_size']) if k['tensor_parallel_size'] > 1 else ''}, "
              f"{fmt_seconds(doc['duration_s'])}, {fit['mean_qps']:.2f} requests/s on average")
    out.print(f"knobs: max-num-seqs {k['max_num_seqs']}, max-num-batched-tokens {k['max_num_batched_tokens']}, "
              f"gpu-memory-utilization {k['gpu_memory_utilization']:g}, block size {k['block_size']}, prefix "
              f"caching {'on' if k['prefix_caching'] else 'off'}, chunked prefill "
              f"{'on' if k['chunked_prefill'] else 'off'}, KV offload {_offload(k)}, KV pool "
              f"{fit['kv_pool_tokens']:,} tokens ({'stated' if k['kv_cache_tokens'] else 'estimated'})")
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


def _fix_groups(fixes: list[dict], width: int) -> list[list[dict]]:
    """The fixes in runs of columns that fit ``width`` beside the signal and the unfixed twin's columns.

    A column takes its header or its widest figure ("preempting"), and two spaces before it (the table
    draws one before its first column); at least one fix goes in each table however narrow the screen.
    """
    labels = [label for label, _, _ in FIX_ROWS] + ["regime"]
    used = 1 + max(len(x) for x in labels) + 2 + len("unfixed twin")
    groups: list[list[dict]] = [[]]
    room = width - used
    for fx in fixes:
        w = 2 + max(len(fx["fix"]), len("preempting"))
        if groups[-1] and w > room:
            groups.append([])
            room = width - used
        groups[-1].append(fx)
        room -= w
    return groups


def _print_fixes(out: Console, doc: dict) -> None:
    groups = _fix_groups(doc["fixes"], out.width)
    for i, group in enumerate(groups):
        title = "Fixes on the fitted workload (per replica where replicas=N)"
        if len(groups) > 1:
            title += f", {i + 1} of {len(groups)}"
        t = terminal_table(title)
        identity_column(t, "signal", [label for label, _, _ in FIX_ROWS] + ["regime"], style="bold")
        figure_column(t, "unfixed twin", justify="right")
        for fx in group:
            figure_column(t, fx["fix"], justify="right")
        for label, key, unit in FIX_ROWS:
            t.add_row(label, _fmt(doc["simulated"].get(key), unit),
                      *[_fmt(fx["simulated"].get(key), unit) for fx in group])
        t.add_row("regime", doc["fidelity"]["simulated_regime"], *[fx["regime"] for fx in group])
        out.print(t)
