"""Label codes: a column's values as int codes into its sorted distinct values (-1: missing), made once and
merged, cut and renumbered without factorizing the values again."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    pass



def factorize(values: np.ndarray) -> tuple[np.ndarray, list]:
    """(codes, uniques): codes index the sorted uniques, -1 for NaN/None; ints by a dense lookup when they allow."""
    n = len(values)
    if values.dtype.kind in "iub":
        # uint64 stays unsigned: as int64, values from 2**63 up would wrap to negatives.
        v = values.astype(np.uint64 if values.dtype.kind == "u" else np.int64, copy=False)
        if n == 0:
            return np.zeros(0, dtype=np.int64), []
        lo, hi = int(v.min()), int(v.max())
        if hi - lo <= 4 * n + 4096:
            offset = v - v.dtype.type(lo) if lo else v
            seen = np.zeros(hi - lo + 1, dtype=bool)
            seen[offset] = True
            lut = np.cumsum(seen, dtype=np.int64)
            lut -= 1
            uniq = np.flatnonzero(seen).astype(v.dtype) + v.dtype.type(lo)
            uniques = uniq.astype(bool).tolist() if values.dtype.kind == "b" else uniq.tolist()
            return lut[offset], uniques
        uniq, codes = np.unique(v, return_inverse=True)
        return codes.astype(np.int64), uniq.tolist()
    if values.dtype.kind == "f":
        ok = ~np.isnan(values)
        codes = np.full(n, -1, dtype=np.int64)
        if not ok.any():
            return codes, []
        finite = values[ok]
        whole = finite == np.round(finite)
        if whole.all() and np.abs(finite).max() < 2**52:
            sub, uniq = factorize(finite.astype(np.int64))
            codes[ok] = sub
            return codes, [float(u) for u in uniq]
        uniq, sub = np.unique(finite, return_inverse=True)
        codes[ok] = sub
        return codes, uniq.tolist()
    return _factorize_objects(values)


def _factorize_objects(values: np.ndarray) -> tuple[np.ndarray, list]:
    if len(values) > 50_000 and "pandas" in sys.modules:  # already loaded: its hash table is ten times faster
        import pandas as pd

        try:
            codes, uniques = pd.factorize(values, use_na_sentinel=True)
        except TypeError:  # unhashable values (lists): below, by their repr
            pass
        else:
            return sorted_codes(codes.astype(np.int64), list(uniques))
    lookup: dict = {}
    codes = np.empty(len(values), dtype=np.int64)
    na = []
    for i, v in enumerate(values.tolist()):
        if v is None or v != v:
            na.append(i)
            continue
        try:
            codes[i] = lookup.setdefault(v, len(lookup))
        except TypeError:  # unhashable (a list): equal lists share a code
            codes[i] = lookup.setdefault(repr(v), len(lookup))
    uniques = list(lookup)
    codes[na] = -1
    return sorted_codes(codes, uniques)


def sorted_codes(codes: np.ndarray, uniques: list) -> tuple[np.ndarray, list]:
    """Renumber codes so that they index ``uniques`` sorted (as groupby orders keys); unsortable ones keep order."""
    try:
        order = sorted(range(len(uniques)), key=uniques.__getitem__)
    except TypeError:
        return codes, uniques
    rank = np.empty(len(uniques) + 1, dtype=np.int64)
    rank[np.asarray(order, dtype=np.int64)] = np.arange(len(uniques))
    rank[-1] = -1
    return rank[codes], [uniques[i] for i in order]


def cut_codes(got: tuple[np.ndarray, list], where) -> tuple[np.ndarray, list]:
    codes, uniques = got
    return codes[where], uniques


def held_uniques(codes: np.ndarray, uniques: list) -> list:
    """The values of ``uniques`` that ``codes`` hold (-1: none), in their order there.

    Codes cut from longer ones (a chunk that lost rows, a subset) keep the uniques of all the
    rows they were made from.
    """
    return [uniques[k] for k in np.flatnonzero(np.bincount(codes[codes >= 0], minlength=len(uniques))).tolist()]


def merge_codes(parts: list[tuple[np.ndarray, list]]) -> tuple[np.ndarray, list]:
    lookup: dict = {}
    remaps = []
    for _, uniques in parts:
        remaps.append(np.array([lookup.setdefault(u, len(lookup)) for u in uniques] + [-1], dtype=np.int64))
    uniques = list(lookup)
    try:  # renumber the small remaps to the sorted order, so the long codes are written once
        order = sorted(range(len(uniques)), key=uniques.__getitem__)
    except TypeError:
        order = None
    if order is not None:
        rank = np.empty(len(uniques) + 1, dtype=np.int64)
        rank[np.asarray(order, dtype=np.int64)] = np.arange(len(uniques))
        rank[-1] = -1
        remaps = [rank[remap] for remap in remaps]
        uniques = [uniques[i] for i in order]
    codes = np.empty(sum(len(c) for c, _ in parts), dtype=np.int64)
    at = 0
    for (c, _), remap in zip(parts, remaps):
        np.take(remap, c, out=codes[at:at + len(c)])
        at += len(c)
    return codes, uniques
