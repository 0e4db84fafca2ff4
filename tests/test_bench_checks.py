"""A benchmark whose input is not what it claims prints no figure: one line naming what is wrong, exit 3."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench"


def _investigate(store: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCH / "bench_investigate.py"), "--hours", "0.05", "--runs", "1",
                           "--store", str(store), *extra], capture_output=True, text=True, timeout=600)


def test_bench_investigate_checks_its_store_and_fails_loudly_when_rows_are_gone(tmp_path):
    store = tmp_path / "day.db"
    ok = _investigate(store)
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert "whole command" in ok.stdout and "1 findings" in ok.stdout  # the planted XID, nothing else
    # The store loses its requests (as rows dropped by a writer would be): no figure, the reason, exit 3.
    with sqlite3.connect(store) as conn:
        conn.execute("DELETE FROM frames_request")
    broken = _investigate(store)
    assert broken.returncode == 3
    assert "whole command" not in broken.stdout and "Traceback" not in broken.stderr
    last = broken.stderr.strip().splitlines()[-1]
    assert last.startswith("bench_investigate.py: broken setup, no figures: ")
    assert "0 request rows, expected 14,400" in last


def test_a_check_that_fails_says_why_in_one_line_and_exits_3():
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from checks import expect_rows, expect_no_drops; "
            "expect_no_drops({'dropped_rows_total': 0, 'store_errors_total': {}}); "
            "expect_rows({'gpu': 8}, {'gpu': 8, 'process': (100, 200)}, 'the window'); print('figure')")
    p = subprocess.run([sys.executable, "-c", code, str(BENCH)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 3 and p.stdout == ""
    assert p.stderr.strip().splitlines() == [
        "-c: broken setup, no figures: the window: 0 process rows, expected 100 to 200"]
