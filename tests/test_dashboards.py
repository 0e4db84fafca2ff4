"""Dashboards, alert rules and runbooks: generated files current, structure, names, promtool, CLI."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gpudiag import catalog
from gpudiag.analyzers.registry import ANALYZERS
from gpudiag.dashboards import alerts, engine_rules, generate
from gpudiag.dashboards.external_metrics import EXTERNAL_METRICS
from gpudiag.findings import alert_name

ROOT = Path(__file__).resolve().parents[1]
DASH_DIR = ROOT / "dashboards"
RUNBOOK_DIR = ROOT / "runbooks"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed "
                                    "(scripts/system-deps.d/20-prometheus.sh installs the Debian package)")

PROMQL_WORDS = {
    "sum", "max", "min", "avg", "count", "rate", "increase", "irate", "by", "without", "on", "ignoring",
    "group_left", "group_right", "histogram_quantile", "label_replace", "label_values", "or", "and", "unless",
    "clamp_min", "clamp_max", "abs", "topk", "bottomk", "delta", "deriv", "time", "vector", "bool",
}


def dashboards() -> dict[str, dict]:
    """The committed dashboards."""
    return {p.name: json.loads(p.read_text()) for p in sorted(DASH_DIR.glob("*.json"))}


def panel_exprs():
    for fname, d in dashboards().items():
        for p in d["panels"]:
            for t in p.get("targets", []):
                yield fname, p["title"], t["expr"]


def metric_names(expr: str) -> set[str]:
    """Metric names an expression reads: identifiers left after strings, selectors, ranges and label lists."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    s = re.sub(r"\{[^}]*\}", "", s)
    s = re.sub(r"\[[^\]]*\]", "", s)
    s = re.sub(r"label_values\(([^,()]*),\s*\w+\)", r"label_values(\1)", s)  # Grafana's: the last is a label
    s = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", r"\1", s)
    names = set()
    for tok in re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", s):
        if tok in PROMQL_WORDS or re.fullmatch(r"\d+(e\d+)?", tok):
            continue
        names.add(re.sub(r"_(bucket|sum|count)$", "", tok) if tok.endswith(("_bucket", "_sum", "_count"))
                  and tok not in catalog.BY_NAME else tok)
    return names


def test_regenerating_gives_the_committed_files():
    assert generate.stale_files(DASH_DIR) == []


def test_generate_check_cli_reports_up_to_date(cli):
    r = cli("dashboards", "generate", "--check")
    assert r.returncode == 0, r.stderr
    assert "up to date" in r.stdout


def test_stale_file_is_detected(tmp_path):
    generate.write_all(tmp_path)
    (tmp_path / "memory.json").write_text("{}\n")
    (tmp_path / "alerts.yaml").unlink()
    assert sorted(generate.stale_files(tmp_path)) == ["alerts.yaml", "memory.json"]


def test_every_dashboard_of_the_generator_is_committed():
    assert set(dashboards()) == {f"{k}.json" for k in generate.DASHBOARDS}


@pytest.mark.parametrize("fname", sorted(f"{k}.json" for k in generate.DASHBOARDS))
def test_dashboard_structure(fname):
    d = dashboards()[fname]
    assert isinstance(d["schemaVersion"], int) and d["schemaVersion"] >= 39
    assert d["uid"] and d["title"] and d["description"]
    variables = {v["name"]: v for v in d["templating"]["list"]}
    for var in ("datasource", "node", "gpu", "process"):
        assert var in variables, f"{fname}: template variable {var} missing"
    assert variables["datasource"]["type"] == "datasource"
    for var in ("node", "gpu", "process"):
        v = variables[var]
        assert v["type"] == "query" and v["includeAll"] and v["multi"]
        assert metric_names(v["query"]["query"]) <= set(catalog.BY_NAME)
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    panels = [p for p in d["panels"] if p["type"] != "row"]
    assert panels
    for p in panels:
        where = f"{fname} / {p['title']}"
        assert p["type"] in {"timeseries", "heatmap", "table", "stat", "gauge"}, where
        g = p["gridPos"]
        assert set(g) == {"h", "w", "x", "y"} and 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, where
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, where
        assert p["description"].strip(), f"{where}: no description"
        assert p["fieldConfig"]["defaults"]["unit"], f"{where}: no unit"
        assert p["targets"], where
        for t in p["targets"]:
            assert t["expr"].strip() and t["refId"], where
        assert len({t["refId"] for t in p["targets"]}) == len(p["targets"]), where


def test_panel_units_come_from_the_catalog():
    util = next(p for p in dashboards()["node-gpu-wall.json"]["panels"] if p["title"] == "GPU utilization")
    assert util["fieldConfig"]["defaults"]["unit"] == "percentunit"
    mem = next(p for p in dashboards()["memory.json"]["panels"] if p["title"].startswith("White / grey / black"))
    assert mem["fieldConfig"]["defaults"]["unit"] == "bytes"


def test_the_expression_checker_catches_a_foreign_name():
    assert metric_names('sum by (node) (rate(gpudiag_bogus_total{node=~"$node"}[5m]))') == {"gpudiag_bogus_total"}
    assert metric_names('histogram_quantile(0.99, sum by (le) (rate(vllm:e2e_request_latency_seconds_bucket[5m])))') \
        == {"vllm:e2e_request_latency_seconds"}


def test_every_metric_in_every_expression_is_known():
    known = set(catalog.BY_NAME) | set(EXTERNAL_METRICS)
    recorded = engine_rules.recorded_names()  # the engine dialects, normalised
    known |= recorded | {re.sub(r"_(bucket|sum|count)$", "", n) for n in recorded}
    exprs = list(panel_exprs()) + [("alerts.yaml", a.name, a.expr) for a in alerts.all_alerts()]
    for fname, title, expr in exprs:
        unknown = metric_names(expr) - known
        assert not unknown, f"{fname} / {title}: {sorted(unknown)} in {expr}"


def test_service_board_shows_ttft_inter_token_and_e2e_quantiles_by_context_bucket():
    panels = {p["title"]: p for p in dashboards()["service.json"]["panels"] if p["type"] != "row"}
    for title, column in (("Time to first token", catalog.M.request_time_to_first_token_seconds),
                          ("Inter-token latency", catalog.M.request_inter_token_latency_seconds),
                          ("End-to-end latency", catalog.M.request_e2e_latency_seconds)):
        p = panels[f"{title} by context length P50 / P99 / P99.9"]
        exprs = [t["expr"] for t in p["targets"]]
        assert [re.match(r"histogram_quantile\(([\d.]+),", e).group(1) for e in exprs] == ["0.5", "0.99", "0.999"]
        name = catalog.get(column).name
        assert all(f"sum by (le, context_bucket) (rate({name}_bucket{{" in e for e in exprs), exprs
        assert all(t["legendFormat"].startswith("{{context_bucket}} P") for t in p["targets"])
        assert p["fieldConfig"]["defaults"]["unit"] == "s"
    # every bucket is named in the board's description, from the catalog's one definition
    description = dashboards()["service.json"]["description"]
    assert all(b in description for b in catalog.CONTEXT_BUCKETS)


def test_context_bucket_is_gpudiags_label_and_vllm_histograms_stay_as_vllm_defines_them():
    for m in catalog.METRICS:
        if m.dialect == "vllm":
            assert "context_bucket" not in m.labels, m.name
    for source, by_context in catalog.BY_CONTEXT.items():
        src, dst = catalog.get(source), catalog.get(by_context)
        assert src.dialect == "vllm" and dst.dialect == "gpudiag" and dst.name.startswith("gpudiag_request_")
        assert dst.type == src.type == catalog.HISTOGRAM and dst.unit == src.unit
        assert dst.labels == src.labels + ("context_bucket",)


def test_dashboards_cover_the_issue_boards():
    titles = {d["title"] for d in dashboards().values()}
    for word in ("Node GPU wall", "Memory", "Engine", "Service", "Infra health", "CUDA API", "Findings"):
        assert any(word in t for t in titles), word


def test_findings_board_links_every_kind_to_its_runbook():
    d = dashboards()["findings.json"]
    active = next(p for p in d["panels"] if p["title"] == "Active findings")
    expr = active["targets"][0]["expr"]
    for kind in ANALYZERS:
        assert f'"{alert_name(kind)}"' in expr
    assert "${runbook_base}/runbooks/${__data.fields.alertname}.md" in json.dumps(active["fieldConfig"])


# --- alert rules ----------------------------------------------------------------


def rules() -> list[dict]:
    doc = yaml.safe_load((DASH_DIR / "alerts.yaml").read_text())
    return [r for g in doc["groups"] for r in g["rules"]]


def test_alert_rules_follow_the_mixin_conventions():
    rs = rules()
    names = [r["alert"] for r in rs]
    assert len(names) == len(set(names))
    for kind in ANALYZERS:
        assert alert_name(kind) in names
    assert len(rs) == len(ANALYZERS) + 5  # plus the five golden signals
    for r in rs:
        assert re.fullmatch(r"Gpudiag(?:[A-Z][a-z0-9]*)+", r["alert"]), r["alert"]
        ann = r["annotations"]
        assert ann["summary"] and ann["description"]
        assert ann["runbook_url"] == f"{alerts.DEFAULT_RUNBOOK_BASE_URL}/runbooks/{r['alert']}.md"
        sev = r.get("labels", {}).get("severity")
        if sev is None:  # finding alerts keep the analyzer's severity label from the series
            assert "by (node, gpu, severity)" in r["expr"], r["alert"]
        else:
            assert sev in {"critical", "warning", "info"}
        assert re.fullmatch(r"\d+[smh]", r["for"])


@needs_promtool
def test_promtool_check_rules_is_clean():
    r = subprocess.run([PROMTOOL, "check", "rules", str(DASH_DIR / "alerts.yaml")], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(rules())} rules found" in r.stdout


@needs_promtool
def test_promtool_unit_tests_pass_for_every_alert():
    doc = yaml.safe_load((DASH_DIR / "alerts_test.yaml").read_text())
    tested = {c["alertname"] for t in doc["tests"] for c in t["alert_rule_test"]}
    assert tested == {r["alert"] for r in rules()}
    firing = {c["alertname"] for t in doc["tests"] for c in t["alert_rule_test"] if c["exp_alerts"]}
    assert firing == tested  # every alert has a case where it fires, besides the silent ones
    r = subprocess.run([PROMTOOL, "test", "rules", "alerts_test.yaml"], cwd=DASH_DIR, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


@needs_promtool
def test_promtool_tests_fail_when_a_rule_breaks(tmp_path):
    """The unit tests are not vacuous: a golden-signal threshold moved out of reach fails them."""
    text = (DASH_DIR / "alerts.yaml").read_text()
    broken = text.replace(f"> {alerts.GPU_TEMPERATURE_HIGH_C:g}", "> 120")
    assert broken != text
    (tmp_path / "alerts.yaml").write_text(broken)
    shutil.copy(DASH_DIR / "alerts_test.yaml", tmp_path)
    r = subprocess.run([PROMTOOL, "test", "rules", "alerts_test.yaml"], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode != 0
    assert "GpudiagGpuTemperatureHigh" in r.stdout + r.stderr


# --- runbooks ---------------------------------------------------------------------


SECTIONS = ("## Meaning", "## Impact", "## Diagnosis", "## Mitigation", "## Verify the fix")


def test_every_alert_has_a_runbook_and_every_runbook_an_alert():
    assert {p.stem for p in RUNBOOK_DIR.glob("*.md")} == {r["alert"] for r in rules()}


@pytest.mark.parametrize("path", sorted(RUNBOOK_DIR.glob("*.md")), ids=lambda p: p.stem)
def test_runbook_structure(path):
    text = path.read_text()
    assert text.startswith(f"# {path.stem}\n")
    positions = [text.find(s) for s in SECTIONS]
    assert all(p >= 0 for p in positions), f"{path.name}: missing {[s for s, p in zip(SECTIONS, positions) if p < 0]}"
    assert positions == sorted(positions), f"{path.name}: sections out of order"
    for link in re.findall(r"\]\(([^)]+\.md)\)", text):
        assert (RUNBOOK_DIR / link).is_file(), f"{path.name}: broken link {link}"


def runbook_commands() -> list[tuple[str, list[str]]]:
    """(runbook, argv after ``gpudiag``) for every command line in a runbook's code blocks."""
    out = []
    for path in sorted(RUNBOOK_DIR.glob("*.md")):
        for block in re.findall(r"```[a-z]*\n(.*?)```", path.read_text(), re.S):
            for line in block.splitlines():
                if line.strip().startswith("gpudiag "):
                    out.append((path.stem, line.split()[1:]))
    return out


CHECK_HELP = r"""
import contextlib, io, json, sys
from gpudiag.cli import main
out = {}
for path in json.loads(sys.argv[1]):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(io.StringIO()):
        code = main(path.split() + ["--help"])
    out[path] = [code, buf.getvalue()]
print(json.dumps(out))
"""


def test_every_command_a_runbook_shows_exists():
    import typer.main

    from gpudiag.cli import app

    root = typer.main.get_command(app)
    commands = runbook_commands()
    assert len(commands) > 15
    paths, options = {}, {}
    for book, argv in commands:
        group, path = root, []
        for tok in argv:
            sub = getattr(group, "commands", {}).get(tok) if not tok.startswith("-") else None
            if sub is None:
                break
            group, path = sub, path + [tok]
        # a token where a subcommand is expected must be one: `gpudiag analyze bogus` is caught here
        nxt = argv[len(path)] if len(path) < len(argv) else None
        if hasattr(group, "commands") and nxt is not None and not nxt.startswith("-"):
            pytest.fail(f"{book}: `gpudiag {' '.join(argv)}`: no command {nxt!r} under `gpudiag {' '.join(path)}`")
        assert path, f"{book}: `gpudiag {' '.join(argv)}` names no command"
        key = " ".join(path)
        paths[key] = book
        options.setdefault(key, set()).update(t.split("=")[0] for t in argv if t.startswith("--"))
    r = subprocess.run([sys.executable, "-c", CHECK_HELP, json.dumps(sorted(paths))], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    helps = json.loads(r.stdout)
    for key, (code, text) in helps.items():
        assert code == 0, f"{paths[key]}: `gpudiag {key} --help` exited {code}"
        for opt in options[key]:
            assert re.search(rf"(?<![\w-]){re.escape(opt)}(?![\w-])", text), f"{paths[key]}: {key} has no {opt}"


def test_repro_commands_in_runbooks_name_real_scenarios_and_fixes(cli):
    r = cli("repro", "--list", "--json")
    assert r.returncode == 0, r.stderr
    scenarios = {s["name"]: set(s["fixes"]) for s in json.loads(r.stdout)["scenarios"]}
    seen = 0
    for book, argv in runbook_commands():
        if argv[0] != "repro" or "--list" in argv:
            continue
        seen += 1
        assert argv[1] in scenarios, f"{book}: unknown scenario {argv[1]}"
        if "--fix" in argv:
            assert argv[argv.index("--fix") + 1] in scenarios[argv[1]], f"{book}: {argv}"
    assert seen


# A sentence that says no scenario exists or applies: "There is no `gpudiag repro` scenario for ...",
# "No `gpudiag repro` scenario applies".
NO_SCENARIO = re.compile(r"\bno\b[^.\n]{0,40}\bscenario\b", re.IGNORECASE)


def test_a_runbook_names_every_scenario_that_reproduces_its_kind_and_claims_none_is_missing_only_where_so(cli):
    r = cli("repro", "--list", "--json")
    assert r.returncode == 0, r.stderr
    listed = json.loads(r.stdout)["scenarios"]
    reproducing: dict[str, set[str]] = {}
    for sc in listed:
        for kind in sc["expected_findings"]:
            reproducing.setdefault(alert_name(kind), set()).add(sc["name"])
    assert set(reproducing) <= {p.stem for p in RUNBOOK_DIR.glob("*.md")}
    named: dict[str, set[str]] = {}
    for book, argv in runbook_commands():
        if argv[0] == "repro" and "--list" not in argv:
            named.setdefault(book, set()).add(argv[1])
    for path in sorted(RUNBOOK_DIR.glob("*.md")):
        book, text = path.stem, path.read_text()
        assert named.get(book, set()) <= {sc["name"] for sc in listed}, f"{book}: names an unknown scenario"
        want = reproducing.get(book, set())
        if want:
            assert not NO_SCENARIO.search(text), f"{book}: says no scenario exists, but {sorted(want)} reproduce it"
            missing = want - named.get(book, set())
            assert not missing, f"{book}: does not show `gpudiag repro` of {sorted(missing)}, which reproduce it"


# --- CLI ----------------------------------------------------------------------------


def test_runbook_lists_renders_and_rejects(cli):
    listed = cli("runbook", "--json")
    assert listed.returncode == 0, listed.stderr
    names = [b["name"] for b in json.loads(listed.stdout)["runbooks"]]
    assert set(names) == {p.stem for p in RUNBOOK_DIR.glob("*.md")}
    assert all(b["summary"] for b in json.loads(listed.stdout)["runbooks"])

    table = cli("runbook")
    assert table.returncode == 0 and "GpudiagKvEvictionStorm" in table.stdout

    shown = cli("runbook", "GpudiagKvEvictionStorm")
    assert shown.returncode == 0, shown.stderr
    # In a pipe a runbook is its Markdown source (a terminal gets it rendered: tests/test_runbook_cli.py).
    assert shown.stdout == (RUNBOOK_DIR / "GpudiagKvEvictionStorm.md").read_text()

    by_kind = cli("runbook", "kv_eviction_storm", "--json")
    assert json.loads(by_kind.stdout)["name"] == "GpudiagKvEvictionStorm"
    assert json.loads(by_kind.stdout)["markdown"] == (RUNBOOK_DIR / "GpudiagKvEvictionStorm.md").read_text()

    unknown = cli("runbook", "GpudiagNoSuchThing")
    assert unknown.returncode == 2
    assert unknown.stderr.count("\n") == 1 and "GpudiagNoSuchThing" in unknown.stderr
    assert "Traceback" not in unknown.stderr


def test_export_writes_dashboards_rules_and_runbooks_with_the_base_url(cli, tmp_path):
    base = "https://ops.example.net/gpudiag/"
    r = cli("dashboards", "export", "--out", tmp_path / "out", "--runbook-base-url", base, "--json")
    assert r.returncode == 0, r.stderr
    written = json.loads(r.stdout)
    out = tmp_path / "out"
    assert len(written["dashboards"]) == len(generate.DASHBOARDS)
    for path in written["dashboards"]:
        d = json.loads(Path(path).read_text())
        rb = next(v for v in d["templating"]["list"] if v["name"] == "runbook_base")
        assert rb["query"] == base
    doc = yaml.safe_load((out / "alerts.yaml").read_text())
    urls = [r["annotations"]["runbook_url"] for g in doc["groups"] for r in g["rules"]]
    assert urls and all(u == f"https://ops.example.net/gpudiag/runbooks/{u.rsplit('/', 1)[1]}" for u in urls)
    assert {p.stem for p in (out / "runbooks").glob("*.md")} == {u.rsplit("/", 1)[1][:-3] for u in urls}
    if PROMTOOL:
        chk = subprocess.run([PROMTOOL, "check", "rules", str(out / "alerts.yaml")], capture_output=True, text=True)
        assert chk.returncode == 0, chk.stdout + chk.stderr


def test_export_rejects_a_bad_base_url_and_an_unwritable_folder(cli, tmp_path):
    bad = cli("dashboards", "export", "--out", tmp_path, "--runbook-base-url", "javascript:alert(1)")
    assert bad.returncode == 2 and "runbook-base-url" in bad.stderr and "Traceback" not in bad.stderr
    blocker = tmp_path / "file"
    blocker.write_text("")
    blocked = cli("dashboards", "export", "--out", blocker / "sub")
    assert blocked.returncode == 2 and "cannot write" in blocked.stderr and "Traceback" not in blocked.stderr
