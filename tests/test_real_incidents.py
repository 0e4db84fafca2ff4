"""A real incident: a training job OOMed on a GPU that another process held (../shared/data/real).

qhy991_grpo's monitor log: GPU 1 (the job's GPU 0) had 4-754 MiB free when training started; PyTorch's
OOM message names process 3295240 holding 78.54 GiB of 79.15 GiB while the job held 414 MiB. The verdict
a senior engineer gives: a co-tenant took the GPU, and the OOM is the harm -- not fragmentation, not the
job's own capacity.
"""

from __future__ import annotations

import json

import pytest
import real_corpus as rc

from gpudiag.cli import main

LOG = ("series", "incidents", "qhy991_grpo__gpu_monitor__OOM.log.gz")


def test_the_oom_of_a_job_on_a_gpu_another_process_held_is_a_critical_cotenant(capsys):
    if rc.missing(*LOG):
        pytest.skip(rc.missing(*LOG))
    code = main(["investigate", "--file", str(rc.real(*LOG)), "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 1
    assert [f["kind"] for f in doc["findings"]] == ["gpu_cotenant"]
    (f,) = doc["findings"]
    assert f["severity"] == "critical" and f["details"]["other_pids"] == [3295240]
    assert f["details"]["oom_events"] == 2  # six messages: two OOMs, each logged by several handlers
    assert "78.5 GiB" in f["summary"] and "414.0 MiB" in f["summary"]
    assert doc["files"][0]["rows"] == 6
