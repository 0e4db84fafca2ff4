"""The catalog is the one place metric names are spelled: every frame column the engine emits is in it."""

import re

import pytest

from gpudiag import catalog
from gpudiag.catalog import CATALOG, M
from gpudiag.reference_engine import scenarios
from gpudiag.reference_engine.sim.engine import SimEngine

LABELS = {"node", "gpu", "uuid", "pid", "process", "engine", "t", "sim_t"}
REQUEST_ATTRS = {"request_id", "kind", "tier", "arrival_s", "finish_s", "prompt_tokens", "output_tokens",
                 "preemptions"}


def test_names_follow_prometheus_conventions():
    for m in catalog.METRICS:
        assert re.fullmatch(r"[a-z_][a-z0-9_]*", m.column), m.column
        if m.type == catalog.COUNTER:
            assert m.column.endswith("_total"), m.column
        if m.dialect == "gpudiag" and m.unit in ("bytes", "seconds", "ratio", "celsius", "watts", "hertz"):
            assert m.unit in m.column, f"{m.column} lacks its unit {m.unit}"
        assert m.help.strip()


def test_a_misspelt_column_fails_at_once():
    with pytest.raises(AttributeError, match="not in the metric catalog"):
        M.gpu_utilisation_ratio  # noqa: B018


def test_every_column_the_simulated_engine_emits_is_in_the_catalog():
    cfg, wl = scenarios.get("kv-eviction-storm").build()
    wl.duration_s = 30
    seen = set()
    for fr in SimEngine(cfg, wl, seed=0).frames():
        for row in fr.rows:
            seen |= set(row)
    unknown = seen - set(CATALOG) - LABELS - REQUEST_ATTRS
    assert not unknown, f"columns outside the catalog: {sorted(unknown)}"
