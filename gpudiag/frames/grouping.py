"""Entity groups: the rows of each (gpu, pid, ...) key of a table in group order, and the copies of a column
in that order shared by every reader (one copy per column, made block by block)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .columns import NAN, _readonly

if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

    from .table import Table



def _dense(codes: np.ndarray) -> tuple[np.ndarray, int]:
    """Renumber non-negative codes 0..k-1 keeping their order; (codes, k)."""
    if not len(codes):
        return codes.astype(np.int64), 0
    top = int(codes.max())
    if top < 8 * len(codes) + 65536:
        seen = np.zeros(top + 1, dtype=bool)
        seen[codes] = True
        lut = np.cumsum(seen) - 1
        return lut[codes], int(lut[-1]) + 1
    uniq, dense = np.unique(codes, return_inverse=True)
    return dense.astype(np.int64), len(uniq)


def _group(table: Table, idx: np.ndarray | None, keys: tuple[str, ...]):
    """Group rows (all, or ``idx``) of ``table`` by ``keys``: (keys, order, starts, group code per row).

    ``order`` holds table positions; groups are numbered in key order (sorted
    values, the missing label last per key).
    """
    levels = []
    combined = None
    for name in keys:
        codes, uniques = table.codes(name)
        if idx is not None:
            codes = codes[idx]
        # The missing label sorts last: code len(uniques). A column without one is used as it is.
        c = np.where(codes < 0, len(uniques), codes) if len(codes) and codes.min() < 0 else codes
        levels.append((c, uniques))
        width = len(uniques) + 1
        if combined is None:
            combined = np.asarray(c, dtype=np.int64)
        else:
            if len(combined) and int(combined.max()) >= (2**62) // width:
                combined, _ = _dense(combined)
            combined = combined * width + c
    n = table.n if idx is None else len(idx)
    if combined is None:
        combined = np.zeros(n, dtype=np.int64)
    dense, n_groups = _dense(combined)
    small = dense.astype(np.uint16) if n_groups < 65536 else dense
    local = np.argsort(small, kind="stable")  # radix sort on 16-bit codes: linear, and keeps t order
    counts = np.bincount(dense, minlength=n_groups)
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    first = local[starts[:-1]]
    columns = [[uniques[j] if j < len(uniques) else NAN for j in c[first].tolist()] for c, uniques in levels]
    group_keys = list(zip(*columns)) if columns else [() for _ in range(n_groups)]
    order = local if idx is None else idx[local]
    return group_keys, order, starts, dense


# --- DataFrame-like views ------------------------------------------------------------------------


def _even_step(idx: np.ndarray) -> int:
    """The step between positions ``idx`` when they are evenly spaced (an entity sampled every tick), else 0."""
    n = len(idx)
    if n < 2:
        return 0
    step = int(idx[1] - idx[0])
    if step > 0 and int(idx[-1]) == int(idx[0]) + step * (n - 1) and (np.diff(idx) == step).all():
        return step
    return 0


def _even_slice(idx: np.ndarray, step: int | None = None) -> slice | bool:
    """``idx`` as a slice when it is long and evenly spaced, else False (``step``: its :func:`_even_step`)."""
    if len(idx) > 1024:  # a slice reads such an entity twice as fast as an index array
        step = _even_step(idx) if step is None else step
        if step:
            return slice(int(idx[0]), int(idx[-1]) + 1, step)
    return False


class BufferPool:
    """Memory for one analysis' entity-order copies (:class:`_GroupLayout`), handed on to the next.

    A streaming analysis reads a window of the same entities and seconds every few seconds, so it
    makes the same copies as the one before: on the benchmark's node (8 GPUs x 16 processes,
    15 minutes) about 8 MB in some thirty arrays. Made afresh, every page of them is a page fault
    the kernel zero-fills, half of an analysis' faults. A buffer is handed out again only once
    nothing made from it is alive: a bytearray refuses to change size while any array or view
    holds its memory, so a trial resize is the test (whatever the interpreter's reference counts).
    What one analysis did not take is let go at the next :meth:`settle`, so the pool holds at
    most one analysis' copies.
    """

    SLACK = 1 / 16  # room for a window's rows to grow between analyses (it fills 10 s of 900 at a time)

    def __init__(self):
        self._kept: list[bytearray] = []  # taken by the last analysis
        self._taken: list[bytearray] = []  # by this one

    def array(self, n: int, dtype) -> np.ndarray:
        """A writable array of ``n`` values of ``dtype`` (contents undefined), from a free kept buffer if one fits."""
        dtype = np.dtype(dtype)
        need = n * dtype.itemsize
        if dtype.hasobject or not need:
            return np.empty(n, dtype=dtype)
        best = None
        for i, buf in enumerate(self._kept):
            if need <= len(buf) <= need + 2 * self.SLACK * need + 4096 \
                    and (best is None or len(buf) < len(self._kept[best])) and _unexported(buf):
                best = i
        buf = bytearray(need + int(self.SLACK * need)) if best is None else self._kept.pop(best)
        self._taken.append(buf)
        return np.frombuffer(buf, dtype=dtype, count=n)

    def settle(self) -> None:
        """An analysis is over: what it took is kept for the next, what it left is let go."""
        self._kept, self._taken = self._taken, []

    @property
    def nbytes(self) -> int:
        """Bytes the pool holds."""
        return sum(map(len, self._kept)) + sum(map(len, self._taken))


def _unexported(buf: bytearray) -> bool:
    """Whether no array or memoryview holds ``buf``'s memory (it can change size; left as it was)."""
    if not buf:
        return True
    try:
        last = buf.pop()
    except BufferError:
        return False
    buf.append(last)
    return True


class _GroupLayout:
    """A table's rows in entity-major order, column by column, for the entity groups that read them all.

    A window holds each entity's rows interleaved with every other entity's
    (one row per entity per tick), so copying one entity's column reads a
    cache line for every value it keeps. Once a good share of the groups has
    read a column (``SHARE``), the whole column is copied into group order in
    cache-sized blocks of time, every group's piece of a block together, which
    reads each line once; each group then reads its own slice of that copy.
    """

    SHARE = 8  # one group in eight: below that, the groups asking copy their own rows
    BLOCK_ROWS = 1 << 18  # table rows per block: 2 MiB of float64, within a core's cache
    # Values per transposed block of a matrix: 64 KiB of float64, within a core's L2, where a
    # transpose (which reads rows and writes columns) runs about twice as fast as from L3.
    TRANSPOSE_VALUES = 1 << 13

    def __init__(self, parts: list[np.ndarray], pool: BufferPool | None = None):
        self.parts = parts
        self.pool = pool
        sizes = np.fromiter((len(p) for p in parts), dtype=np.int64, count=len(parts))
        self.starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.threshold = max(2, len(parts) // self.SHARE)
        self.asks: dict[int, int] = {}
        self.copies: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # id(column): (column, its copy)
        self.steps: list[slice | bool] | None = None  # and the rest of the plan, made on the first copy
        # A column in group order made straight from where it is kept (a store window's chunks,
        # stored grouped by entity), without the table's own column; None: copy from that.
        self.direct: Callable[[str], np.ndarray | None] | None = None
        self.made: dict[str, np.ndarray | None] = {}

    def _direct_whole(self, name: str) -> np.ndarray | None:
        """The column ``name`` in group order made from its source, once; None: not so."""
        if self.direct is None:
            return None
        got = self.made.get(name, False)
        if got is False:
            got = self.direct(name)
            self.made[name] = got = None if got is None else _readonly(got)
        return got

    def _copy_of(self, col: np.ndarray) -> np.ndarray:
        """``col`` in group order, copied once."""
        got = self.copies.get(id(col))
        if got is None:
            got = self.copies[id(col)] = (col, self._copy(col))
        return got[1]

    def gathered_directly(self, name: str, g: int) -> np.ndarray | None:
        """Group ``g``'s rows of the table's column ``name``, made in group order from its source; None: not so."""
        got = self._direct_whole(name)
        return None if got is None else got[self.starts[g]:self.starts[g + 1]]

    def ordered(self, name: str, col: Callable[[], Any], direct_first: bool) -> np.ndarray | None:
        """The whole column ``name`` in group order (group ``g`` at ``starts[g]:starts[g+1]``), read-only.

        Made from where it is kept when ``direct_first`` (a column not made yet), else
        copied from ``col()``, once; the groups' own reads then slice the same copy.
        None for a column that is not a numpy array.
        """
        got = self._direct_whole(name) if direct_first else None
        if got is not None:
            return got
        c = col()
        return self._copy_of(c) if isinstance(c, np.ndarray) else None

    def gathered(self, col: np.ndarray, g: int) -> np.ndarray | None:
        """Group ``g``'s rows of ``col`` as a read-only slice of the column in group order; None: copy them."""
        key = id(col)
        if key not in self.copies:
            asks = self.asks[key] = self.asks.get(key, 0) + 1
            if asks < self.threshold:
                return None
        return self._copy_of(col)[self.starts[g]:self.starts[g + 1]]

    def _copy(self, col: np.ndarray) -> np.ndarray:
        if self.steps is None:
            self._plan()
        n = int(self.starts[-1])
        out = np.empty(n, dtype=col.dtype) if self.pool is None else self.pool.array(n, col.dtype)
        starts = self.starts
        for first, base, stride, n, picks in self.matrices:
            # Groups sampled once every ``stride`` rows: columns of the (n x stride) matrix those rows
            # make, transposed a block of rows at a time; a last row the column ends within is picked.
            dest = out[first:first + len(picks) * n].reshape(len(picks), n)
            full = min(n, (len(col) - base) // stride)
            # Every column of the matrix, in order, is one group's: transposed as it is.
            every = len(picks) == stride and bool((picks == np.arange(stride)).all())
            rows = max(1, self.TRANSPOSE_VALUES // stride)
            for a in range(0, full, rows):
                e = min(a + rows, full)
                block = col[base + a * stride:base + e * stride].reshape(e - a, stride)
                dest[:, a:e] = (block if every else block[:, picks]).T
            for a in range(full, n):
                dest[:, a] = col[base + a * stride + picks]
        for g in self.whole:
            np.take(col, self.parts[g], out=out[starts[g]:starts[g + 1]])
        for j in range(self.blocks):  # block j of every group together: rows j*BLOCK_ROWS onwards
            for at, first, step, n, k in self.strided:
                a = j * k
                if a < n:
                    e = min(a + k, n)
                    out[at + a:at + e] = col[first + a * step:first + (e - 1) * step + 1:step]
            for at, part, cuts in self.scattered:
                a, e = int(cuts[j]), int(cuts[j + 1])
                if e > a:
                    np.take(col, part[a:e], out=out[at + a:at + e])
        return _readonly(out)

    def _plan(self) -> None:
        """How each group is copied: evenly spaced ones as slices, long uneven ones cut at the block
        edges (their rows of one block read together), short ones at once."""
        even = [_even_step(p) for p in self.parts]
        self.matrices, in_matrix = self._matrices(even)
        self.steps = [_even_slice(p, step) for p, step in zip(self.parts, even)]
        rows = max((int(p[-1]) + 1 for p in self.parts if len(p)), default=0)
        pieces = {g: max(self.BLOCK_ROWS // step.step, 1) for g, step in enumerate(self.steps)
                  if step is not False and g not in in_matrix}
        # Blocks enough for the table's rows and for every slice's pieces (k per block, the last may start later).
        self.blocks = max([-(-rows // self.BLOCK_ROWS), 1] + [-(-len(self.parts[g]) // k) for g, k in pieces.items()])
        edges = np.arange(self.blocks + 1, dtype=np.int64) * self.BLOCK_ROWS
        self.whole, self.strided, self.scattered = [], [], []
        for g, (part, step) in enumerate(zip(self.parts, self.steps)):
            at = int(self.starts[g])
            if g in in_matrix:
                continue
            if step is not False:
                self.strided.append((at, step.start, step.step, len(part), pieces[g]))
            elif len(part) > 4096:
                self.scattered.append((at, part, np.searchsorted(part, edges, side="left")))
            else:
                self.whole.append(g)

    def _matrices(self, even: list[int]) -> tuple[list[tuple], set[int]]:
        """Runs of consecutive groups read as one matrix: each group evenly spaced (``even``: the steps of
        :func:`_even_step`) with the same step and length, all starting within one step of the first
        (one entity per row of every tick)."""
        spacing = [(step, len(part)) if step else None for part, step in zip(self.parts, even)]
        runs: list[tuple] = []
        taken: set[int] = set()
        g, count = 0, len(self.parts)
        while g < count:
            if spacing[g] is None:
                g += 1
                continue
            stride, _ = spacing[g]
            e = g + 1
            while e < count and e - g < stride and spacing[e] == spacing[g]:
                e += 1
            firsts = np.array([int(self.parts[j][0]) for j in range(g, e)], dtype=np.int64)
            base = int(firsts.min())
            if e - g > 1 and int(firsts.max()) - base < stride:
                runs.append((int(self.starts[g]), base, stride, spacing[g][1], firsts - base))
                taken.update(range(g, e))
            g = e
        return runs, taken
