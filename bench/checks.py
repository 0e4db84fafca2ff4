"""What every benchmark checks about its input before it prints a figure.

A figure measured on the wrong input (a store that lost its rows, a window without the kinds it
claims, an analysis that found nothing where the data holds a problem) is worse than none. Each
check either passes silently or ends the benchmark: one line on stderr naming what is wrong,
exit status 3, no figure printed.

    from checks import expect, expect_rows, expect_store_rows, expect_no_drops, expect_findings
"""

from __future__ import annotations

import math
import os
import sys
from typing import Iterable, Mapping, NoReturn

BROKEN_SETUP_EXIT = 3  # distinct from 1 (a figure missed its goal) and 2 (bad command line)


def fail(reason: str) -> NoReturn:
    """End the benchmark: its input is not what it claims, so no figure is printed."""
    name = os.path.basename(sys.argv[0]) or "benchmark"
    sys.stdout.flush()
    sys.stderr.write(f"{name}: broken setup, no figures: {reason}\n")
    sys.stderr.flush()
    sys.exit(BROKEN_SETUP_EXIT)


def expect(condition: bool, reason: str) -> None:
    """fail(reason) unless ``condition``."""
    if not condition:
        fail(reason)


def expect_rows(got: Mapping[str, int], want: Mapping[str, int | tuple[int, int]], what: str) -> None:
    """Each kind's row count equals ``want[kind]`` (an int, or an inclusive (low, high) range)."""
    for kind, need in want.items():
        n = int(got.get(kind, 0))
        lo, hi = need if isinstance(need, tuple) else (need, need)
        if not lo <= n <= hi:
            expected = f"{lo:,}" if lo == hi else f"{lo:,} to {hi:,}"
            fail(f"{what}: {n:,} {kind} rows, expected {expected}")


def store_rows(path: str, kinds: Iterable[str], start_s: float = -math.inf, end_s: float = math.inf) -> dict[str, int]:
    """Rows per kind that a reader of the store at ``path`` reads back in [start_s, end_s]."""
    from gpudiag.agent.store import Store

    kinds = list(kinds)
    with Store.open(path, readonly=True) as store:
        window = store.window(start_s, end_s, kinds)
        return {kind: len(window.columns(kind)) for kind in kinds}


def expect_store_rows(path: str, want: Mapping[str, int | tuple[int, int]], start_s: float = -math.inf,
                      end_s: float = math.inf) -> dict[str, int]:
    """The store at ``path`` reads back ``want`` rows per kind (see expect_rows); returns the counts."""
    got = store_rows(path, want, start_s, end_s)
    expect_rows(got, want, f"store {path} read back")
    return got


def expect_no_drops(health: Mapping) -> None:
    """A store's health() shows no dropped rows and no write errors."""
    dropped = health.get("dropped_rows_total", 0)
    expect(not dropped, f"the store dropped {dropped:,} rows (health()['dropped_rows_total'])")
    errors = health.get("store_errors_total") or {}
    expect(not errors, f"the store failed writes: {errors}")


def expect_findings(found: Iterable[str], required: Iterable[str] = (), forbidden: Iterable[str] = (),
                    what: str = "the analysis") -> None:
    """Every ``required`` finding kind was found, and no ``forbidden`` one."""
    found = set(found)
    missing = sorted(set(required) - found)
    expect(not missing, f"{what} did not find {', '.join(missing)} (found: {', '.join(sorted(found)) or 'nothing'})")
    wrong = sorted(set(forbidden) & found)
    expect(not wrong, f"{what} found {', '.join(wrong)}, which its data does not hold")
