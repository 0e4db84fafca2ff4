"""Workloads: Poisson phases are reproducible from the seed, and a trace file drives the engine as written."""

import json

import pytest

from gpudiag.errors import GpudiagError
from gpudiag.reference_engine import scenarios
from gpudiag.reference_engine.scenarios.workload import Workload, load_trace
from gpudiag.reference_engine.sim.engine import SimEngine


def test_the_same_seed_draws_the_same_requests():
    _, wl = scenarios.get("kv-eviction-storm").build()
    a, b = wl.generate(3), wl.generate(3)
    assert [(s.arrival_s, s.prompt_tokens, s.max_output_tokens, s.tier) for s in a] == \
           [(s.arrival_s, s.prompt_tokens, s.max_output_tokens, s.tier) for s in b]
    assert {s.kind for s in a if 2700 <= s.arrival_s < 4500} == {"short", "long"}
    assert {s.kind for s in a if s.arrival_s < 2700} == {"short"}


def test_a_trace_file_drives_the_engine_request_by_request(tmp_path):
    trace = tmp_path / "trace.jsonl"
    rows = [{"arrival_s": 0.5 * i, "prompt_tokens": 100 + i, "output_tokens": 20, "tier": "vip"} for i in range(40)]
    trace.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cfg, _ = scenarios.get("kv-eviction-storm").build("paged-kv")
    wl = Workload(qps=1.0, duration_s=60.0, trace_path=str(trace))
    eng = SimEngine(cfg, wl, seed=0)
    requests = [r for fr in eng.frames() if fr.kind == "request" for r in fr.rows]
    assert len(requests) == 40
    assert sorted(r["prompt_tokens"] for r in requests) == [100 + i for i in range(40)]
    assert all(r["output_tokens"] == 20 and r["tier"] == "vip" for r in requests)


@pytest.mark.parametrize("line,needle", [
    ('{"arrival_s": 1, "prompt_tokens": 10}', "not a trace record"),
    ('{"arrival_s": 1, "prompt_tokens": -5, "output_tokens": 3}', "must be positive"),
    ('{"arrival_s": 1, "prompt_tokens": 5, "output_tokens": 3, "tier": "gold"}', "not a trace record"),
    ("not json", "not a trace record"),
])
def test_a_bad_trace_line_is_named_with_its_line_number(tmp_path, line, needle):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"arrival_s": 0, "prompt_tokens": 5, "output_tokens": 3}\n' + line + "\n")
    with pytest.raises(GpudiagError, match=rf"t.jsonl:2: .*{needle}"):
        load_trace(str(trace), 100.0)


def test_a_missing_trace_file_is_a_clear_error(tmp_path):
    with pytest.raises(GpudiagError, match="does not exist"):
        load_trace(str(tmp_path / "nope.jsonl"), 10.0)
