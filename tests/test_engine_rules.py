"""Recording rules that normalise every engine dialect: generated, promtool-clean, tested per dialect."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import yaml

from gpudiag.catalog import NORMALISED_PREFIX
from gpudiag.dashboards import engine_rules
from gpudiag.dashboards.generate import folder
from gpudiag.probes.engine_dialects import DIALECTS

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed "
                                    "(scripts/system-deps.d/20-prometheus.sh installs the Debian package)")
DASH = folder()


def test_every_recorded_name_is_gpudiags_and_every_rule_names_its_dialect():
    rules = engine_rules.recording_rules()
    assert rules
    for r in rules:
        assert r["record"].startswith(NORMALISED_PREFIX)
        assert r["labels"]["dialect"] in DIALECTS
    # One test per dialect that has a series to record (vLLM V0's shared names are V1's).
    doc = yaml.safe_load((DASH / engine_rules.TESTS_FILE).read_text())
    named = {t["name"].rsplit("(", 1)[1].split(")")[0] for t in doc["tests"]}
    assert named == set(DIALECTS)


@needs_promtool
def test_promtool_checks_the_rules_and_runs_a_test_per_dialect():
    r = subprocess.run([PROMTOOL, "check", "rules", engine_rules.RULES_FILE], cwd=DASH, capture_output=True,
                       text=True)
    assert r.returncode == 0 and f"SUCCESS: {len(engine_rules.recording_rules())} rules found" in r.stdout, \
        r.stdout + r.stderr
    r = subprocess.run([PROMTOOL, "test", "rules", engine_rules.TESTS_FILE], cwd=DASH, capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stdout + r.stderr


@needs_promtool
def test_a_rule_that_reads_the_wrong_series_fails_its_dialects_test(tmp_path):
    text = (DASH / engine_rules.RULES_FILE).read_text()
    broken = text.replace('request_type=\\"waiting\\"', 'request_type=\\"active\\"')
    assert broken != text
    (tmp_path / engine_rules.RULES_FILE).write_text(broken)
    shutil.copy(DASH / engine_rules.TESTS_FILE, tmp_path)
    r = subprocess.run([PROMTOOL, "test", "rules", engine_rules.TESTS_FILE], cwd=tmp_path, capture_output=True,
                       text=True)
    assert r.returncode != 0
    assert "gpudiag:num_requests_waiting" in r.stdout + r.stderr
