"""How SI values read at the edges: reports and tables."""

import math

import pytest

from gpudiag.units import fmt_bytes, fmt_ratio, fmt_seconds


@pytest.mark.parametrize("s, text", [
    (0, "0 s"), (0.0, "0 s"), (4e-6, "4 µs"), (0.0123, "12.3 ms"), (2.5, "2.50 s"), (95, "1m35s"),
    (2700, "45m00s"), (4500, "1h15m"), (-2.5, "-2.50 s"), (-0.0123, "-12.3 ms"), (None, "n/a"), (math.nan, "n/a"),
])
def test_seconds_read_in_the_unit_that_fits_and_zero_is_zero_seconds(s, text):
    assert fmt_seconds(s) == text


def test_bytes_and_ratios_read_in_binary_units_and_percent():
    assert fmt_bytes(1536) == "1.5 KiB" and fmt_bytes(-3 * 1024**3) == "-3.0 GiB" and fmt_bytes(None) == "n/a"
    assert fmt_ratio(0.653) == "65.3 %" and fmt_ratio(None) == "n/a"
