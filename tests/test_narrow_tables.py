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
