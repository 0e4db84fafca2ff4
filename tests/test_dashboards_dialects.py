"""The generated boards and alerts work across engine dialects: promtool evaluates them on each engine's own series.

engine_rules.yaml records every dialect's series as ``gpudiag:<column>``; the engine and service boards and the
engine alerts read those names. Here promtool loads the committed rules, takes each engine's series as it exports
them (names and labels from gpudiag.probes.engine_dialects) and evaluates the committed panel expressions and
alerts on them, per dialect: vLLM and SGLang alike, and every other dialect that maps the columns a query reads.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from gpudiag import catalog
from gpudiag.dashboards import alerts, engine_rules
from gpudiag.probes.engine_dialects import DIALECTS, Dialect, Series

ROOT = Path(__file__).resolve().parents[1]
DASH_DIR = ROOT / "dashboards"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed "
                                    "(scripts/system-deps.d/20-prometheus.sh installs the Debian package)")

# Grafana's variables as a board with "All" selected sends them.
GRAFANA_VARS = {"$__rate_interval": "5m", "$node": ".*", "$gpu": ".*", "$process": ".*"}
RECORDED = re.compile(re.escape(catalog.NORMALISED_PREFIX) + r"[a-z0-9_]+")
# The panels the boards must show for every engine (board file, panel title).
MUST_EVALUATE = {
    ("engine-kv.json", "Requests running / waiting"),
    ("engine-kv.json", "KV cache usage"),
    ("engine-kv.json", "Evictions and preemptions per second"),
    ("engine-kv.json", "Prefix-cache hit rate"),
    ("engine-kv.json", "Tokens per second"),
    ("service.json", "Time to first token P50 / P99 / P99.9"),
    ("service.json", "End-to-end latency P50 / P99 / P99.9"),
}
# Per alert that reads recorded names: per-minute increase of each counter column that makes it fire.
FIRING_RATES = {
    "GpudiagKvCacheHitRatioLow": {catalog.M.prefix_cache_hits_total: 30, catalog.M.prefix_cache_queries_total: 100},
}


def column_of(recorded: str) -> str:
    """``gpudiag:time_to_first_token_seconds_bucket`` -> ``time_to_first_token_seconds``."""
    col = recorded[len(catalog.NORMALISED_PREFIX):]
    if col not in catalog.CATALOG:
        col = re.sub(r"_(bucket|sum|count)$", "", col)
    catalog.get(col)
    return col


def engine_targets() -> list[tuple[str, str, str, set[str]]]:
    """(board, panel, expression, columns) of every committed panel query that reads only recorded engine names."""
    out = []
    for path in sorted(DASH_DIR.glob("*.json")):
        for p in json.loads(path.read_text())["panels"]:
            for t in p.get("targets", []):
                names = set(RECORDED.findall(t["expr"]))
                if names and catalog.PREFIX not in t["expr"]:
                    out.append((path.name, p["title"], t["expr"], {column_of(n) for n in names}))
    return out


def recorded_series(d: Dialect) -> dict[str, Series]:
    """Column -> the dialect's series that a rule records into it."""
    out = {}
    for s in d.series:
        if s.column and not (s.type == catalog.HISTOGRAM and s.scale != 1.0):
            out.setdefault(s.column, s)
    return out


def instance(d: Dialect) -> str:
    return f"serve-{d.name}:9000"


def labels_of(d: Dialect, s: Series, **extra: str) -> str:
    labels = {"instance": instance(d), "job": "engine"}
    labels.update({lab: f"{lab}-a" for lab in s.labels})
    labels.update(dict(s.where))
    labels.update(extra)
    return "{" + ", ".join(f"{k}={json.dumps(v)}" for k, v in labels.items()) + "}"


def engine_input(d: Dialect, rates: dict[str, int] | None = None, samples: int = 20) -> dict[str, str]:
    """The dialect's series as its engine exports them: gauges constant, counters and histograms growing."""
    out: dict[str, str] = {}
    for column, s in recorded_series(d).items():
        if rates is not None and column not in rates:
            continue
        if s.type == catalog.HISTOGRAM:
            for le, per_min in (("0.1", 2), ("1", 8), ("+Inf", 10)):
                out[f"{s.name}_bucket{labels_of(d, s, le=le)}"] = f"0+{per_min}x{samples}"
            out[f"{s.name}_count{labels_of(d, s)}"] = f"0+10x{samples}"
            out[f"{s.name}_sum{labels_of(d, s)}"] = f"0+3x{samples}"
        elif s.type == catalog.COUNTER:
            out.setdefault(f"{s.name}{labels_of(d, s)}", f"0+{(rates or {}).get(column, 10)}x{samples}")
        else:
            out.setdefault(f"{s.name}{labels_of(d, s)}", f"5x{samples}")
    return out


def evaluates(expr: str) -> str:
    """1 when the expression gives at least one sample that is a number (a NaN quantile is no value)."""
    for var, value in GRAFANA_VARS.items():
        expr = expr.replace(var, value)
    return f"count(({expr}) >= 0) > bool 0"


def with_vllm_names(expr: str) -> str:
    """The expression as the boards wrote it before the recorded names: vLLM's exported names."""
    return RECORDED.sub(lambda m: m.group(0).replace(catalog.NORMALISED_PREFIX, catalog.VLLM_PREFIX), expr)


def run_promtool(tmp_path: Path, doc: dict) -> subprocess.CompletedProcess:
    for f in doc["rule_files"]:
        shutil.copy(DASH_DIR / f, tmp_path)
    (tmp_path / "dialects_test.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    return subprocess.run([PROMTOOL, "test", "rules", "dialects_test.yaml"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)


def test_the_engine_and_service_boards_read_the_recorded_names_for_every_recorded_engine_column():
    targets = engine_targets()
    assert MUST_EVALUATE <= {(board, title) for board, title, _, _ in targets}
    vllm_names = {catalog.get(column_of(r)).name for r in engine_rules.recorded_names()
                  if catalog.get(column_of(r)).dialect == "vllm"}
    for path in sorted(DASH_DIR.glob("*.json")):
        for p in json.loads(path.read_text())["panels"]:
            for t in p.get("targets", []):
                read = {re.sub(r"_(bucket|sum|count)$", "", n) for n in re.findall(r"vllm:[a-z0-9_]+", t["expr"])}
                assert not read & vllm_names, f"{path.name} / {p['title']} reads vLLM's names: {t['expr']}"
    for a in alerts.all_alerts():
        assert catalog.VLLM_PREFIX not in a.expr, f"{a.name} reads a vLLM name: {a.expr}"


@needs_promtool
def test_every_engine_panel_evaluates_on_each_dialects_own_series(tmp_path):
    targets = engine_targets()
    tests, checked = [], {}
    for d in DIALECTS.values():
        mapped = set(recorded_series(d))
        mine = [(board, title, expr) for board, title, expr, columns in targets if columns <= mapped]
        if not mine:
            continue
        checked[d.name] = {(board, title) for board, title, _ in mine}
        cases = [{"expr": evaluates(expr), "eval_time": "10m", "exp_samples": [{"labels": "{}", "value": 1}]}
                 for _, _, expr in mine]
        if not d.name.startswith("vllm"):  # not vacuous: vLLM's names show nothing for this engine
            cases += [{"expr": evaluates(with_vllm_names(expr)), "eval_time": "10m", "exp_samples": []}
                      for _, _, expr in mine]
        tests.append({"name": f"{d.name}: the boards' engine panels show a value", "interval": "1m",
                      "input_series": [{"series": k, "values": v} for k, v in engine_input(d).items()],
                      "promql_expr_test": cases})
    assert MUST_EVALUATE <= checked["vllm"] and MUST_EVALUATE <= checked["sglang"]
    r = run_promtool(tmp_path, {"rule_files": [engine_rules.RULES_FILE], "evaluation_interval": "1m",
                                "tests": tests})
    assert r.returncode == 0, r.stdout + r.stderr


def expand(text: str, labels: dict[str, str]) -> str:
    """``{{ $labels.x }}`` as Prometheus expands it (the only template the annotations use)."""
    return re.sub(r"\{\{\s*\$labels\.(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), text)


@needs_promtool
def test_every_engine_alert_fires_on_each_dialects_own_series(tmp_path):
    engine_alerts = [a for a in alerts.all_alerts() if RECORDED.search(a.expr)]
    assert {a.name for a in engine_alerts} == set(FIRING_RATES)  # a new engine alert adds its firing rates here
    tests, fired = [], {}
    for a in engine_alerts:
        rates = FIRING_RATES[a.name]
        for d in DIALECTS.values():
            if not set(rates) <= set(recorded_series(d)):
                continue
            fired.setdefault(a.name, set()).add(d.name)
            labels = {"instance": instance(d)}  # these engines name neither node nor GPU: the scrape target
            exp = {"exp_labels": {"severity": a.severity, **labels},
                   "exp_annotations": {k: expand(v, labels) for k, v in a.annotations(
                       alerts.DEFAULT_RUNBOOK_BASE_URL).items()}}
            tests.append({"name": f"{a.name} fires on {d.name}", "interval": "1m",
                          "input_series": [{"series": k, "values": v}
                                           for k, v in engine_input(d, rates, samples=40).items()],
                          "alert_rule_test": [{"eval_time": "25m", "alertname": a.name, "exp_alerts": [exp]}]})
    for name, dialects in fired.items():
        assert {"vllm", "sglang"} <= dialects, f"{name} fires only on {sorted(dialects)}"
    r = run_promtool(tmp_path, {"rule_files": [alerts.RULES_FILE, engine_rules.RULES_FILE],
                                "evaluation_interval": "1m", "tests": tests})
    assert r.returncode == 0, r.stdout + r.stderr
