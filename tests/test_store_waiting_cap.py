"""The store's waiting-rows cap (MAX_WAITING_ROWS) drops rows only while the writer is stuck.

A caller that hands over ten minutes of a node in one append and then flushes loses nothing;
rows that pile up behind a writer waiting on another process' lock are bounded, the oldest
dropped and counted in health().
"""

from __future__ import annotations

import math
import sqlite3
import threading

from gpudiag.agent import store as store_module
from gpudiag.agent.store import Store
from gpudiag.catalog import M
from gpudiag.frames import Frame

T0 = 1_700_000_000.0


def _seconds(first: int, count: int) -> list[Frame]:
    """``count`` seconds of a node: 8 GPUs, 64 processes, 4 requests a second (76 rows a second)."""
    frames = []
    for s in range(first, first + count):
        t = T0 + s
        frames.append(Frame("gpu", t, [{"node": "n", "gpu": g, M.gpu_utilization_ratio: 0.5} for g in range(8)]))
        frames.append(Frame("process", t, [{"node": "n", "gpu": p % 8, "pid": 100 + p,
                                            M.process_gpu_memory_bytes: float(2**30 + s)} for p in range(64)]))
        frames.append(Frame("request", t + 0.5, [{"node": "n", "gpu": 0, "request_id": f"r-{s}-{k}",
                                                  M.time_to_first_token_seconds: 0.25} for k in range(4)]))
    return frames


def _counts(path: str) -> dict[str, int]:
    with Store.open(path, readonly=True) as reader:
        window = reader.window(-math.inf, math.inf)
        return {kind: len(window.columns(kind)) for kind in ("gpu", "process", "request")}


def test_one_append_larger_than_the_cap_by_a_caller_that_then_flushes_is_encoded_not_dropped(tmp_path):
    seconds = store_module.MAX_WAITING_ROWS // 76 + 200  # over the cap in a single call
    assert seconds * 76 > store_module.MAX_WAITING_ROWS
    path = str(tmp_path / "s.db")
    with Store.open(path) as store:
        store.append(_seconds(0, seconds))
        assert store.health()["dropped_rows_total"] == 0
        assert store.flush() == seconds * 76
        assert store.health()["dropped_rows_total"] == 0
    assert _counts(path) == {"gpu": 8 * seconds, "process": 64 * seconds, "request": 4 * seconds}


def test_rows_behind_a_stuck_writer_are_capped_oldest_first_and_counted(tmp_path):
    path = str(tmp_path / "s.db")
    store = Store.open(path)
    store.append(_seconds(0, 1))
    assert store.flush() == 76
    seconds = store_module.MAX_WAITING_ROWS // 76 + 200
    # A minute at a time, made before the lock is taken: all of it arrives while the flush waits.
    batches = [_seconds(s, min(60, 2 + seconds - s)) for s in range(2, 2 + seconds, 60)]
    other = sqlite3.connect(path, isolation_level=None, timeout=0)
    other.execute("BEGIN IMMEDIATE")  # another process holds the write lock: the writer waits (busy timeout)
    store.append(_seconds(1, 1))
    flusher = threading.Thread(target=store.flush, daemon=True)
    flusher.start()
    flusher.join(0.3)
    assert flusher.is_alive(), "the flush did not wait for the lock"
    for batch in batches:
        store.append(batch)
    assert flusher.is_alive(), "append waited for the writer"
    dropped = store.health()["dropped_rows_total"]
    assert 0 < dropped <= seconds * 76 - store_module.MAX_WAITING_ROWS + 60 * 76
    other.execute("ROLLBACK")
    other.close()
    flusher.join(30)  # it wrote second 1, or gave up on the lock (busy) and left it buffered
    store.flush()
    store.close()
    assert store.health()["dropped_rows_total"] == dropped  # nothing more once the writer was free
    assert sum(_counts(path).values()) == 2 * 76 + seconds * 76 - dropped
    with Store.open(path, readonly=True) as reader:  # the newest were kept
        assert reader.time_range()[1] == T0 + 1 + seconds + 0.5
