"""Memory incidents: fragmentation OOM, co-tenant, leaks by layer, and the healthy baseline.

Registered into ``scenarios.SCENARIOS``; parameters live here and nowhere else.
"""

from __future__ import annotations

from gpudiag.reference_engine.scenarios import Scenario

SCENARIOS: dict[str, Scenario] = {}
