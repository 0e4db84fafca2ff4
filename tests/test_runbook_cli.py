"""``gpudiag runbook``: a list that reads at 80 columns and in a pipe, a runbook as Markdown."""

from __future__ import annotations

import json
import os

from gpudiag.commands.runbook import runbooks


def test_the_list_is_plain_aligned_text_that_fits_80_columns_and_names_every_runbook_whole(cli):
    proc = cli("runbook", env=dict(os.environ, COLUMNS="80"))
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("Gpudiag")]
    names = list(runbooks())
    assert [line.split()[0] for line in lines] == names  # each name whole, in order
    assert all(len(line) <= 80 for line in proc.stdout.splitlines())
    starts = {line.index("  ") + len(line[line.index("  "):]) - len(line[line.index("  "):].lstrip())
              for line in lines}
    assert len(starts) == 1  # the meanings start in one column
    assert not any(mark in proc.stdout for mark in ("**", "`", "| ", "## "))  # not raw Markdown


def test_a_runbook_in_a_pipe_is_its_markdown_and_json_is_unchanged(cli):
    proc = cli("runbook", "kv_eviction_storm")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("# GpudiagKvEvictionStorm")
    doc = json.loads(cli("runbook", "GpudiagKvEvictionStorm", "--json").stdout)
    assert doc["name"] == "GpudiagKvEvictionStorm" and doc["markdown"].startswith("# GpudiagKvEvictionStorm")
    listing = json.loads(cli("runbook", "--json").stdout)
    assert [r["name"] for r in listing["runbooks"]] == list(runbooks())


def test_an_unknown_runbook_is_one_error_line(cli):
    proc = cli("runbook", "no_such_thing")
    assert proc.returncode == 2 and proc.stderr.startswith("gpudiag: error: no runbook named")
