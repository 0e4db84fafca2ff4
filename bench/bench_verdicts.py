#!/usr/bin/env python3
"""Verdicts on the real corpus: expected against got, per finding kind, and the figures
against their references.

Every artifact of ``../shared/data/real`` (MANIFEST.md) goes through the command a user
would run on it, as a subprocess with ``--json``:

- Kineto traces: ``gpudiag analyze trace``; idle / compute / non-compute against HTA's;
- memory snapshots: ``gpudiag analyze snapshot``; reserved / allocated / largest free /
  releasable against MANIFEST's;
- the 72 InferenceX vLLM runs: turned back into vLLM's series, backfilled into a real
  Prometheus (``promtool tsdb create-blocks-from openmetrics``), then ``gpudiag investigate
  --prometheus --node RUN`` over each run's span (``--vllm-via file``: ``investigate --file``
  over the same OpenMetrics text instead);
- nvidia-smi logs, the dcgm-exporter scrape, the Alibaba pod trace and the co-tenant incident:
  ``gpudiag investigate --file``, where this gpudiag has it.

The verdict each deserves is :data:`real_corpus.EXPECTED`-style (``tests/real_corpus.py``):
named kinds at least at a severity, nothing else at warning or above. The confusion table
counts, per kind, hits (expected and found at warning or above), misses, and false alarms
(found at warning or above, not expected). An artifact whose command could not judge it
(no such command, an internal error) counts as a miss where something was expected and is
listed as unjudged.

Before it prints a figure, the benchmark checks its input: the corpus' files are all there
(12 traces, 6 snapshots, 72 runs with their rows), and every backfilled run's series are
queryable in Prometheus. Otherwise it exits non-zero with the reason.

    .venv/bin/python bench/bench_verdicts.py [--only traces,snapshots,vllm,files] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

import real_corpus as rc  # noqa: E402  (the corpus' one description, shared with the tests)

SEVERITY_RANK = {"info": 0, "warning": 1, "critical": 2}
COMMAND_TIMEOUT_S = 300


class SetupError(Exception):
    """The benchmark's input is not what it claims: no figure is printed."""


@dataclass
class Judged:
    """One artifact: what it deserves and what gpudiag said."""

    group: str
    name: str
    expect: rc.Expect
    findings: list[dict] = field(default_factory=list)
    unjudged: str | None = None  # why gpudiag could not judge it
    figures: dict = field(default_factory=dict)  # observed against reference
    exit_code: int | None = None

    def alarms(self) -> dict[str, str]:
        """kind -> worst severity among findings at warning or above."""
        out: dict[str, str] = {}
        for f in self.findings:
            sev = f.get("severity", "info")
            if SEVERITY_RANK.get(sev, 0) >= 1 and SEVERITY_RANK[sev] > SEVERITY_RANK.get(out.get(f["kind"], "info"), 0):
                out[f["kind"]] = sev
        return out

    def outcome(self) -> dict[str, str]:
        """kind -> hit | miss | false_alarm."""
        got = self.alarms()
        out = {}
        for kind, lowest in self.expect.required.items():
            ok = kind in got and SEVERITY_RANK[got[kind]] >= SEVERITY_RANK[lowest]
            out[kind] = "hit" if ok else "miss"
        for kind in got:
            if kind not in self.expect.required:
                out[kind] = "false_alarm"
        return out


def gpudiag(*args: str, timeout: float = COMMAND_TIMEOUT_S) -> subprocess.CompletedProcess:
    """``python -m gpudiag ARGS`` with this interpreter."""
    env = dict(os.environ, COLUMNS="200")
    return subprocess.run([sys.executable, "-m", "gpudiag", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def _json_or_unjudged(p: subprocess.CompletedProcess, judged: Judged) -> dict | None:
    judged.exit_code = p.returncode
    try:
        return json.loads(p.stdout)
    except json.JSONDecodeError:
        last = (p.stderr.strip().splitlines() or ["no output"])[-1]
        judged.unjudged = f"exit {p.returncode}: {last[:160]}"
        return None


# ---------------------------------------------------------------------------------------- traces
def trace_verdicts() -> list[Judged]:
    """Every real trace through ``analyze trace``."""
    out = []
    folder = rc.real("traces")
    for name, hta in rc.HTA_FIGURES.items():
        j = Judged("trace", name, rc.TRACE_EXPECT[name])
        doc = _json_or_unjudged(gpudiag("analyze", "trace", str(folder / name), "--json"), j)
        if doc is not None:
            j.findings = doc.get("findings", [])
            got = (doc["idle_pct"], doc["compute_pct"], doc["non_compute_pct"])
            j.figures = {"hta": hta, "got": tuple(round(x, 2) for x in got),
                         "max_diff_pp": round(max(abs(a - b) for a, b in zip(got, hta)), 2)}
        out.append(j)
    j = Judged("trace", rc.NO_GPU_TRACE, rc.Expect("no GPU activity: one line, exit 2"))
    p = gpudiag("analyze", "trace", str(folder / rc.NO_GPU_TRACE), "--json")
    j.exit_code = p.returncode
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    j.figures = {"exit": p.returncode, "stderr_lines": len(lines)}
    if p.returncode != 2 or len(lines) != 1:
        j.unjudged = f"expected one line and exit 2, got exit {p.returncode} and {len(lines)} lines"
    out.append(j)
    return out


# ------------------------------------------------------------------------------------- snapshots
def snapshot_verdicts() -> list[Judged]:
    """Every real snapshot through ``analyze snapshot``."""
    out = []
    for name, written in rc.SNAPSHOT_MANIFEST.items():
        j = Judged("snapshot", name, rc.SNAPSHOT_EXPECT[name])
        doc = _json_or_unjudged(gpudiag("analyze", "snapshot", str(rc.real("snapshots", name)), "--json"), j)
        if doc is not None:
            j.findings = doc.get("findings", [])
            keys = ("reserved_bytes", "allocated_bytes", "largest_free_block_bytes", "releasable_bytes")
            got = [rc.as_manifest_rounds(doc[k], w) if k in doc else None for k, w in zip(keys, written)]
            j.figures = {"MiB": "/".join("?" if g is None else f"{g:g}" for g in got),
                         "manifest": "/".join(written),
                         "match": all(g == float(w) for g, w in zip(got, written))}
        out.append(j)
    return out


# ------------------------------------------------------------------------------------------ vLLM
# promtool writes two-hour blocks: the runs are moved to start together in one, ending before now.
BLOCK_S = 7200
MARGIN_S = 600
# A range query's last step falls up to a step before --to: each window runs past its last scrape.
END_SLACK_S = 2.0


def vllm_verdicts(via: str, workdir: Path) -> list[Judged]:
    """The InferenceX runs through a real Prometheus (or ``investigate --file`` over the same text)."""
    import prometheus_support as ps
    import real_vllm

    runs = real_vllm.runs()
    if len(runs) != 72:
        raise SetupError(f"inferencex/index.csv lists {len(runs)} runs, not 72")
    t0 = (int(time.time() - max(r.duration_s for r in runs) - MARGIN_S) // BLOCK_S) * BLOCK_S
    om = workdir / "inferencex.om"
    with open(om, "w") as fh:
        spans = real_vllm.write_openmetrics(runs, fh, t0)
    prom = url = log = None
    try:
        if via == "prometheus":
            try:
                ps.backfill(om, workdir / "tsdb")
                prom, url, log = ps.start_prometheus(workdir, [])
            except BaseException as e:  # the support module fails the way a test fails
                raise SetupError(f"no backfilled Prometheus: {e}") from None
        out = []
        for run in runs:
            first, last = spans[run.node]
            rows = len(real_vllm.rows(run))
            if prom is not None:
                # Input check: every scrape of the run landed (its running-requests gauge).
                q = urllib.parse.urlencode({"query": f'count_over_time(vllm:num_requests_running'
                                                     f'{{instance="{run.node}:{real_vllm.PORT}"}}'
                                                     f'[{int(last - first) + 2}s])', "time": f"{last:.3f}"})
                res = ps.get_json(f"{url}/api/v1/query?{q}")["data"]["result"]
                landed = float(res[0]["value"][1]) if res else 0.0
                if landed < rows:
                    raise SetupError(f"{run.node}: {landed:.0f} of {rows} scrapes queryable in Prometheus")
                args = ["investigate", "--prometheus", url, "--node", run.node]
            else:
                single = workdir / f"{run.node}.om"
                with open(single, "w") as fh:
                    real_vllm.write_openmetrics([run], fh, t0)
                args = ["investigate", "--file", str(single)]
            j = Judged("vllm", run.node, rc.inferencex_expect(run))
            p = gpudiag(*args, "--from", f"{first:.3f}", "--to", f"{last + END_SLACK_S:.3f}", "--json")
            doc = _json_or_unjudged(p, j)
            if doc is not None:
                j.findings = doc.get("findings", [])
            j.figures = {"preemptions": run.preemptions, "kv_max": run.kv_max_ratio, "waiting_max": run.waiting_max}
            out.append(j)
            print(f"  {run.node:40s} {_verdict_text(j)}", file=sys.stderr, flush=True)
        return out
    finally:
        if prom is not None:
            ps.stop(prom)
            log.close()


# ----------------------------------------------------------------------------------------- files
def file_verdicts() -> list[Judged]:
    """Recorded telemetry through ``investigate --file``, where this gpudiag has it."""
    has_file = "--file" in gpudiag("investigate", "--help").stdout
    out = []
    for parts, expect in rc.FILE_EXPECT.items():
        j = Judged("file", "/".join(parts[1:]), expect)
        if not has_file:
            j.unjudged = "this gpudiag has no `investigate --file`"
        else:
            doc = _json_or_unjudged(gpudiag("investigate", "--file", str(rc.real(*parts)), "--json"), j)
            if doc is not None:
                j.findings = doc.get("findings", [])
        out.append(j)
    # Alibaba's production pod trace, as dcgm-exporter would export it (tests/recorded_telemetry.py).
    j = Judged("file", "alibaba/pods (as dcgm OpenMetrics)",
               rc.Expect("production serving; memory drops over 10 GB are routine model swaps"))
    if not has_file:
        j.unjudged = "this gpudiag has no `investigate --file`"
    else:
        from recorded_telemetry import alibaba_openmetrics

        with tempfile.TemporaryDirectory(prefix="bench-verdicts-") as tmp:
            path = Path(tmp) / "alibaba_pods.om"
            alibaba_openmetrics(path)
            doc = _json_or_unjudged(gpudiag("investigate", "--file", str(path), "--json"), j)
        if doc is not None:
            j.findings = doc.get("findings", [])
    out.append(j)
    return out


# ---------------------------------------------------------------------------------------- report
def _verdict_text(j: Judged) -> str:
    if j.unjudged:
        return f"UNJUDGED ({j.unjudged})"
    got = j.alarms()
    said = ", ".join(f"{k} {v}" for k, v in sorted(got.items())) or "nothing at warning or above"
    bad = [f"{k}: {o}" for k, o in j.outcome().items() if o != "hit"]
    return said + ("" if not bad else "   <-- " + "; ".join(bad))


def confusion(judged: list[Judged]) -> dict[str, dict[str, int]]:
    """kind -> {hit, miss, false_alarm}; plus '(unjudged)' for artifacts nobody judged."""
    table: dict[str, dict[str, int]] = {}
    for j in judged:
        if j.unjudged:
            row = table.setdefault("(unjudged)", {"hit": 0, "miss": 0, "false_alarm": 0})
            row["miss" if j.expect.required else "hit"] += 0
            for kind in j.expect.required:
                table.setdefault(kind, {"hit": 0, "miss": 0, "false_alarm": 0})["miss"] += 1
            table["(unjudged)"]["miss"] += 1
            continue
        for kind, outcome in j.outcome().items():
            table.setdefault(kind, {"hit": 0, "miss": 0, "false_alarm": 0})[outcome] += 1
    return table


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="traces,snapshots,vllm,files",
                    help="comma-separated groups: traces, snapshots, vllm, files")
    ap.add_argument("--vllm-via", choices=("prometheus", "file"), default="prometheus")
    ap.add_argument("--json", action="store_true", help="one JSON document on stdout")
    args = ap.parse_args(argv)
    groups = {g.strip() for g in args.only.split(",") if g.strip()}
    unknown = groups - {"traces", "snapshots", "vllm", "files"}
    if unknown:
        print(f"bench_verdicts: unknown group(s) {', '.join(sorted(unknown))}", file=sys.stderr)
        return 2
    why = rc.missing()
    if why:
        print(f"bench_verdicts: {why}", file=sys.stderr)
        return 2
    judged: list[Judged] = []
    started = time.monotonic()
    try:
        rc.check_corpus()
    except AssertionError as e:
        print(f"bench_verdicts: input check failed: {e}", file=sys.stderr)
        return 1
    try:
        if "traces" in groups:
            judged += trace_verdicts()
        if "snapshots" in groups:
            judged += snapshot_verdicts()
        if "vllm" in groups:
            with tempfile.TemporaryDirectory(prefix="bench-verdicts-") as tmp:
                judged += vllm_verdicts(args.vllm_via, Path(tmp))
        if "files" in groups:
            judged += file_verdicts()
    except SetupError as e:
        print(f"bench_verdicts: input check failed: {e}", file=sys.stderr)
        return 1
    table = confusion(judged)
    if args.json:
        print(json.dumps({"artifacts": [{"group": j.group, "name": j.name, "why": j.expect.why,
                                         "expected": j.expect.required, "got": j.alarms(),
                                         "outcome": j.outcome(), "unjudged": j.unjudged,
                                         "figures": j.figures} for j in judged],
                          "confusion": table}, indent=2, default=str))
    else:
        for group in ("trace", "snapshot", "vllm", "file"):
            rows = [j for j in judged if j.group == group]
            if not rows:
                continue
            print(f"\n== {group}s ({len(rows)})")
            for j in rows:
                fig = f"  [{j.figures}]" if j.figures and group in ("trace", "snapshot") else ""
                print(f"  {j.name[:52]:52s} {_verdict_text(j)}{fig}")
        print("\n== confusion (per kind: expected at warning or above vs got at warning or above)")
        print(f"  {'kind':24s} {'hit':>5s} {'miss':>5s} {'false':>6s}")
        for kind in sorted(table):
            r = table[kind]
            print(f"  {kind:24s} {r['hit']:5d} {r['miss']:5d} {r['false_alarm']:6d}")
        false = sum(r["false_alarm"] for k, r in table.items() if k != "(unjudged)")
        missed = sum(r["miss"] for k, r in table.items() if k != "(unjudged)")
        print(f"\n  artifacts {len(judged)}; false warnings or criticals {false}; missed {missed}; "
              f"unjudged {sum(1 for j in judged if j.unjudged)}; {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
