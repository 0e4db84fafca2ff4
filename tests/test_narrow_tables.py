"""Tables at 80 columns: the label that names a row is never cut with "…"; JSON in a pipe stays JSON."""

from __future__ import annotations

import json
import os


def test_repro_list_at_80_columns_names_every_scenario_whole(cli):
    from gpudiag.reference_engine import scenarios

    proc = cli("repro", "--list", env=dict(os.environ, COLUMNS="80"))
    assert proc.returncode == 0, proc.stderr
    assert "…" not in proc.stdout
    assert all(len(line) <= 80 for line in proc.stdout.splitlines())
    for name in scenarios.SCENARIOS:
        assert f" {name} " in proc.stdout
    doc = json.loads(cli("repro", "--list", "--json", env=dict(os.environ, COLUMNS="80")).stdout)
    assert [s["name"] for s in doc["scenarios"]] == list(scenarios.SCENARIOS)


def _assert_reads_at_80_columns(text: str) -> None:
    assert text.strip()
    assert "…" not in text  # no label or figure is cut
    wide = [line for line in text.splitlines() if len(line) > 80]
    assert not wide, wide


def test_doctor_at_80_columns_names_every_check_whole_and_its_json_is_json_only(cli):
    env = dict(os.environ, COLUMNS="80")
    proc = cli("doctor", env=env)
    _assert_reads_at_80_columns(proc.stdout)
    result = json.loads(cli("doctor", "--json", env=env).stdout)
    for check in result["checks"]:
        assert f"{check['feature']}: {check['name']}" in proc.stdout
        if check["status"] != "ok" and check["fix"]:
            assert "fix: " + check["fix"].split()[0] in proc.stdout


def test_a_scenarios_result_tables_at_80_columns_keep_every_signal_and_figure(cli):
    env = dict(os.environ, COLUMNS="80")
    proc = cli("repro", "kv-eviction-storm", "--duration", "3600", env=env, timeout=600)  # the storm, not the rest
    assert proc.returncode == 0, proc.stderr
    _assert_reads_at_80_columns(proc.stdout)
    for signal in ("QPS", "TTFT P99", "evictions / alloc", "allocator OOMs", "(45m00s–1h00m)"):
        assert signal in proc.stdout
    doc = json.loads(cli("repro", "kv-eviction-storm", "--duration", "3600", "--json", env=env, timeout=600).stdout)
    assert doc["scenario"] == "kv-eviction-storm" and doc["findings"]
