"""The agent benchmark refuses a load it cannot make, in one line, before it starts anything."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench" / "bench_agent.py"


@pytest.mark.parametrize("args", [["--engine-interval-s", "0"], ["--requests-per-s", "-1"]])
def test_the_agent_benchmark_refuses_a_load_it_cannot_make(args):
    got = subprocess.run([sys.executable, str(BENCH), "--minutes", "0.01", *args],
                         capture_output=True, text=True, timeout=120)
    assert got.returncode == 2
    assert "Traceback" not in got.stderr
    assert "--engine-interval-s must be at least 1" in got.stderr.strip().splitlines()[-1]
