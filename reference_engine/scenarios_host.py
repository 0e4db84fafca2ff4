"""Host and kernel incidents: a CPU-starved GPU, a kernel launched with a degenerate grid.

Registered into ``scenarios.SCENARIOS``; parameters live here and nowhere else.
"""

from __future__ import annotations

from gpudiag.reference_engine.scenarios import Scenario

SCENARIOS: dict[str, Scenario] = {}
