"""Every scenario reproduces its diagnosis, and every fix it offers removes that diagnosis.

For each scenario of ``gpudiag repro --list``: the findings it names appear,
the first of them heads the causal chain (nothing it names is caused by a
finding outside the scenario's own), no critical finding of another kind
appears unless the chain traces it back to them, and ``healthy`` shows nothing of warning level or above. For each
fix: the findings it claims to remove (by default all the scenario's) are
gone.
"""

from __future__ import annotations

import json

import pytest

from gpudiag.agent.daemon import _NOT_IN_WINDOW
from gpudiag.analyzers.registry import run_all
from gpudiag.frames import Window
from gpudiag.reference_engine import scenarios

SCENARIOS = sorted(scenarios.SCENARIOS)
FIXES = [(name, fix) for name in SCENARIOS for fix in scenarios.SCENARIOS[name].fixes]


def _traced_to(finding, kinds: set[str], by_id: dict) -> bool:
    """True when ``finding``'s causes lead (transitively) to a finding of one of ``kinds``."""
    seen, todo = set(), list(finding.caused_by)
    while todo:
        fid = todo.pop()
        if fid in seen or fid not in by_id:
            continue
        seen.add(fid)
        if by_id[fid].kind in kinds:
            return True
        todo.extend(by_id[fid].caused_by)
    return False


def _kinds(res) -> set[str]:
    return {f.kind for f in res.findings}


def test_the_catalogue_of_incidents_is_complete():
    expected = {"kv-eviction-storm", "fragmentation-oom", "cpu-starved", "cotenant", "pool-leak", "driver-leak",
                "tensor-leak", "degenerate-grid", "queue-avalanche", "lru-multiturn", "prefix-sharing", "healthy"}
    assert expected <= set(SCENARIOS)
    for name in expected - {"healthy"}:
        sc = scenarios.SCENARIOS[name]
        assert sc.fixes, f"{name} offers no fix"
        assert sc.expected_findings, f"{name} names no finding"


@pytest.mark.parametrize("name", SCENARIOS)
def test_a_scenario_shows_its_own_diagnosis_and_no_stray_critical_one(scenario_run, name):
    sc = scenarios.SCENARIOS[name]
    res = scenario_run(name)
    found = _kinds(res)
    if not sc.expected_findings:  # the healthy baseline
        loud = [f"{f.kind} ({f.severity.value})" for f in res.findings if f.severity.value in ("warning", "critical")]
        assert not loud, f"{name}: {loud}"
        return
    missing = set(sc.expected_findings) - found
    assert not missing, f"{name}: expected {missing}, found {sorted(found)}"
    by_id = {f.id: f for f in res.findings}
    head = [f for f in res.findings if f.kind == sc.expected_findings[0]]
    # The head of the chain is caused by nothing, or only by findings of its own kind on the same GPU.
    assert any(all(by_id[c].kind == f.kind for c in f.caused_by if c in by_id) for f in head), \
        f"{name}: {sc.expected_findings[0]} is not a root cause: {[(f.kind, f.caused_by) for f in head]}"
    # A critical symptom is part of the diagnosis when the chain traces it back to the scenario's findings.
    stray = {f.kind for f in res.findings if f.severity.value == "critical"
             and f.kind not in sc.expected_findings and not _traced_to(f, set(sc.expected_findings), by_id)}
    assert not stray, f"{name}: unexpected critical findings {stray}"


@pytest.mark.parametrize(("name", "fix"), FIXES, ids=[f"{n}--{f}" for n, f in FIXES])
def test_a_fix_removes_the_diagnosis(scenario_run, name, fix):
    sc = scenarios.SCENARIOS[name]
    removes = sc.fixes[fix].removes
    removes = set(sc.expected_findings if removes is None else removes)
    fixed = scenario_run(name, fix)
    left = _kinds(fixed) & removes
    assert not left, f"{name} --fix {fix}: {sorted(left)} still found"


def test_the_list_names_every_scenario_and_fix(cli):
    out = cli("repro", "--list", "--json")
    assert out.returncode == 0, out.stderr
    listed = json.loads(out.stdout)
    rows = listed if isinstance(listed, list) else listed.get("scenarios", [])
    names = {r["name"]: r for r in rows}
    assert set(names) == set(SCENARIOS)
    for name in SCENARIOS:
        fixes = names[name]["fixes"]
        fix_names = {f["name"] if isinstance(f, dict) else f for f in fixes}
        assert fix_names == set(scenarios.SCENARIOS[name].fixes)
        assert names[name].get("summary")


@pytest.mark.parametrize("name", SCENARIOS)
def test_the_agents_window_finds_the_same_without_the_columns_it_leaves_out(scenario_run, name):
    res = scenario_run(name)
    w = res.window
    tables = {}
    for kind in w.tables:
        table = w.columns(kind)
        tables[kind] = table.with_columns([c for c in table.columns if c not in _NOT_IN_WINDOW])
    left_out = {c for kind in w.tables for c in w.columns(kind).columns if c in _NOT_IN_WINDOW}
    pruned = Window.from_columns(tables, start_s=w.start_s, end_s=w.end_s, node=w.node)
    assert [f.to_dict() for f in run_all(pruned)] == [f.to_dict() for f in res.findings], left_out
