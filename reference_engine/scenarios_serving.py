"""Serving incidents: queue avalanche, LRU in multi-turn chat, shared prefixes.

Registered into ``scenarios.SCENARIOS``; parameters live here and nowhere else.
"""

from __future__ import annotations

from gpudiag.reference_engine.scenarios import Scenario

SCENARIOS: dict[str, Scenario] = {}
