"""Inter-token gaps of every generated token, as vLLM's inter-token latency histogram observes them.

A request's TPOT (its decode time over its tokens) averages a stall away: a
300 ms prefill of someone else's long prompt adds 3 ms to the TPOT of a
100-token answer that sat through it, but the user saw one token arrive
300 ms late. Jitter is a property of the gaps, so the engine records each
one: the time from a sequence's previous token to this one, long prefills
and evictions in between included.

Gaps go into 1 ms bins up to MAX_GAP_S (one overflow bin above), so
percentiles are exact to a millisecond at any token count.
"""

from __future__ import annotations

import numpy as np

BIN_S = 1e-3
MAX_GAP_S = 5.0


class TokenGaps:
    """A millisecond histogram of inter-token gaps, with weights (a run of k identical steps adds k-1 at once)."""

    def __init__(self):
        # A plain list: the engine adds a handful of gaps per step, and a list index is
        # cheaper than any array operation at that size.
        self._counts = [0] * (int(MAX_GAP_S / BIN_S) + 1)

    def add(self, gap_s: float, n: int = 1) -> None:
        """Record ``n`` gaps of ``gap_s`` seconds."""
        if n > 0:
            self._counts[min(len(self._counts) - 1, max(0, int(gap_s / BIN_S)))] += n

    @property
    def counts(self) -> np.ndarray:
        """Gaps per 1 ms bin (the last bin: MAX_GAP_S and above)."""
        return np.array(self._counts, dtype=np.int64)

    @property
    def total(self) -> int:
        """Gaps recorded."""
        return sum(self._counts)

    def percentile(self, q: float) -> float:
        """The ``q``-th percentile (0..100) in seconds, the upper edge of its bin; NaN when empty."""
        counts = self.counts
        total = int(counts.sum())
        if total == 0:
            return float("nan")
        rank = np.searchsorted(np.cumsum(counts), q / 100.0 * total, side="left")
        return float(min(rank + 1, len(counts)) * BIN_S)

    def jitter_s(self) -> float:
        """P99 minus P50 of the gaps (seconds): how much later than usual the slow tokens arrive."""
        return self.percentile(99) - self.percentile(50)

    def stdev_s(self) -> float:
        """Standard deviation of the gaps (seconds, bin centres): the "±" of inter-token jitter; NaN when empty."""
        counts = self.counts
        total = int(counts.sum())
        if total == 0:
            return float("nan")
        x = (np.arange(len(counts)) + 0.5) * BIN_S
        mean = float((counts * x).sum()) / total
        return float(np.sqrt((counts * (x - mean) ** 2).sum() / total))
