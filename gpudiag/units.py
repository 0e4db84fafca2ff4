"""Humanizing SI values at the edges (CLI, reports). Inside the code everything is SI."""

from __future__ import annotations

import math

_BINARY = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"]


def fmt_bytes(n: float | None) -> str:
    """1536 -> '1.5 KiB'; None -> 'n/a'."""
    if n is None or (isinstance(n, float) and math.isnan(n)):
        return "n/a"
    sign = "-" if n < 0 else ""
    n = abs(float(n))
    i = 0
    while n >= 1024 and i < len(_BINARY) - 1:
        n /= 1024
        i += 1
    return f"{sign}{n:.0f} {_BINARY[i]}" if i == 0 else f"{sign}{n:.1f} {_BINARY[i]}"


def fmt_seconds(s: float | None) -> str:
    """0.0123 -> '12.3 ms'; 95 -> '1m35s'; 0 -> '0 s'; -2.5 -> '-2.50 s'."""
    if s is None or (isinstance(s, float) and math.isnan(s)):
        return "n/a"
    if s == 0:
        return "0 s"
    if s < 0:
        return "-" + fmt_seconds(-s)
    if s < 1e-3:
        return f"{s * 1e6:.0f} µs"
    if s < 1:
        return f"{s * 1e3:.1f} ms"
    if s < 60:
        return f"{s:.2f} s"
    m, sec = divmod(int(round(s)), 60)
    if m < 60:
        return f"{m}m{sec:02d}s"
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m"


def fmt_ratio(r: float | None) -> str:
    """0.653 -> '65.3 %'."""
    if r is None or (isinstance(r, float) and math.isnan(r)):
        return "n/a"
    return f"{r * 100:.1f} %"


def fmt_value(value: float | None, unit: str) -> str:
    """Format a value by its catalog unit."""
    if unit == "bytes":
        return fmt_bytes(value)
    if unit == "seconds":
        return fmt_seconds(value)
    if unit == "ratio":
        return fmt_ratio(value)
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)
