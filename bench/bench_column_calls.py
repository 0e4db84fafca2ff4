"""Benchmark: the analyzers' Column calls against the same expression written in numpy, side by side.

Over bench_analyzers' window (``--hours`` of a busy node, 8 GPUs x 16 processes), each case
times the call as an analyzer writes it on a Column (``rows[c].isna().all()``, ``rows[c].max()``,
a ``notna()`` mask, ``tolist()``) and the same answer from numpy on ``to_numpy``, alternating
the two, each repetition on fresh Rows (nothing gathered yet, as each analysis starts).
Before a figure: the window holds each kind's rows, and both forms give the same answer;
otherwise exit 3. Prints each form's median and the ratio numpy / Column (above 1: the
Column call is faster). Run it pinned: ``taskset -c 1``.

    .venv/bin/python bench/bench_column_calls.py [--hours 2] [--reps 31]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_analyzers import HOUR_S, day_window  # noqa: E402
from checks import expect, expect_rows  # noqa: E402

from gpudiag.catalog import M  # noqa: E402
from gpudiag.frames import Rows  # noqa: E402

GPUS, PROCESSES_PER_GPU = 8, 16


def cases(tables):
    """name -> (table, row positions or None, column, Column form, numpy form)."""
    gpu, eng, proc = tables["gpu"], tables["engine"], tables["process"]
    one_gpu = np.flatnonzero(np.asarray(gpu.columns["gpu"]) == gpu.columns["gpu"][0])
    one_engine = np.flatnonzero(np.asarray(eng.columns["engine"]) == eng.columns["engine"][0]) \
        if "engine" in eng.columns else np.arange(eng.n // GPUS)
    mem = M.gpu_memory_total_bytes
    waiting = M.num_requests_waiting
    return {
        "isna().all(), one GPU": (gpu, one_gpu, mem, lambda r, c: bool(r[c].isna().all()),
                                  lambda r, c: bool(np.isnan(r[c].to_numpy(float)).all())),
        "max(), one GPU": (gpu, one_gpu, mem, lambda r, c: float(r[c].max()),
                           lambda r, c: float(np.nanmax(r[c].to_numpy(float)))),
        "isna().all() + notna() mask, one engine": (
            eng, one_engine, waiting,
            lambda r, c: (bool(r[c].isna().all()), len(r[r[c].notna()])),
            lambda r, c: (bool(np.isnan(r[c].to_numpy(float)).all()), len(r[~np.isnan(r[c].to_numpy(float))]))),
        "tolist(), every process row": (proc, None, "pid", lambda r, c: r[c].tolist(),
                                        lambda r, c: r[c].to_numpy().tolist()),
    }


def main(argv: list[str] | None = None) -> int:
    """Build the window, time each case and print the figures."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hours", type=int, default=2)
    ap.add_argument("--reps", type=int, default=31)
    args = ap.parse_args(argv)
    buffers = day_window(args.hours, GPUS, PROCESSES_PER_GPU, False)
    hour_s = HOUR_S * args.hours
    expect_rows({k: len(b) for k, b in buffers.items()},
                {"gpu": GPUS * hour_s, "engine": GPUS * hour_s, "process": GPUS * PROCESSES_PER_GPU * hour_s},
                "the window")
    tables = {kind: buf.table() for kind, buf in buffers.items()}
    print(f"window: {args.hours} h, {GPUS} GPUs x {PROCESSES_PER_GPU} processes; median of {args.reps}, "
          "fresh rows each")
    for name, (table, idx, col, column_form, numpy_form) in cases(tables).items():
        expect(len(Rows(table, idx)) > 0, f"{name}: no rows")
        expect(column_form(Rows(table, idx), col) == numpy_form(Rows(table, idx), col),
               f"{name}: the Column and numpy forms disagree")
        reps = args.reps if idx is not None else max(3, args.reps // 4)
        took: dict[str, list[float]] = {"column": [], "numpy": []}
        for i in range(reps):
            order = (("column", column_form), ("numpy", numpy_form))
            for form, fn in (order if i % 2 else order[::-1]):
                rows = Rows(table, idx)
                t0 = time.perf_counter()
                fn(rows, col)
                took[form].append(time.perf_counter() - t0)
        a, b = statistics.median(took["column"]), statistics.median(took["numpy"])
        print(f"  {name:42s} Column {a * 1e6:9.1f} us   numpy {b * 1e6:9.1f} us   numpy/Column {b / a:4.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
