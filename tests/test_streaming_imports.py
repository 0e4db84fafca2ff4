"""The agent's streaming analysis runs on columns alone: pandas never enters the agent's process.

pandas costs the agent about 35 MB of resident memory (its import and the frames it
builds), a fifth of the 150 MB an agent on a busy node may use, and converting a
15-minute window to a DataFrame every 10 s costs CPU. Every scenario the reference
engine reproduces is fed second by second through the agent's SlidingWindow and
analyzed every 300 simulated seconds as the agent would; the scenario's expected
findings must appear (so the analyzers' paths did run), no memory leak may be reported
where none was made, and pandas must not be loaded.
"""

from __future__ import annotations

import json
import subprocess
import sys

CHILD = r"""
import json, sys
from gpudiag.agent.daemon import SlidingWindow
from gpudiag.analyzers.registry import run_all
from gpudiag.reference_engine import scenarios
from gpudiag.reference_engine.sim.engine import SimEngine

out = {}
for name, sc in scenarios.SCENARIOS.items():
    cfg, wl = sc.build(None)
    win = SlidingWindow(900.0)
    fired, seconds = set(), 0
    for fr in SimEngine(cfg, wl, seed=0).frames():
        win.add([fr])
        if fr.kind == "gpu":
            seconds += 1
            if seconds % 300 == 0:
                fired |= {f.kind for f in run_all(win.window("sim"))}
    out[name] = {"expected": list(sc.expected_findings), "fired": sorted(fired),
                 "pandas": "pandas" in sys.modules}
print(json.dumps(out))
"""


def test_streaming_analysis_of_every_scenario_finds_what_it_should_without_loading_pandas():
    p = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-2000:]
    got = json.loads(p.stdout.splitlines()[-1])
    assert len(got) >= 10
    for name, r in got.items():
        assert set(r["expected"]) <= set(r["fired"]), (name, r)
        # A leak only where one was made: KV that grows with the tokens held is the engine's working set.
        if "memory_leak" not in r["expected"]:
            assert "memory_leak" not in r["fired"], (name, r)
        assert not r["pandas"], f"pandas was loaded by the time {name} was analyzed"
    assert got["healthy"]["fired"] == []
