"""The reference engine speaking other engines' dialects, scraped by a real Prometheus, read by investigate.

* Two agents run the kv-eviction-storm scenario in ``--sim`` mode at 100x, one writing the engine's
  series as SGLang names them, one as trtllm-serve does; one Prometheus scrapes both. Once the
  simulated runs are past the storm, ``investigate --prometheus`` reads each node's engine from its
  own dialect and finds SGLang's storm from its retractions.
* A mixed node: one agent, two simulated engines, vLLM's names on GPU 0 and SGLang's on GPU 1.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path

import pytest
from prometheus_support import free_port, get_json, start_prometheus, stop, wait

from gpudiag import promql_source as P
from gpudiag.catalog import CATALOG, M
from gpudiag.frames import Frame

SIM_SPEED = 100
STORM_OVER_SIM_S = 4800.0
SCRAPE_INTERVAL = "250ms"
SIM_DEADLINE_S = 240.0
NODES = {"sglang": "node-sglang", "trtllm": "node-trtllm"}


def _query(url: str, expr: str, at: float | None = None) -> list:
    when = f"&time={at:.3f}" if at is not None else ""
    return get_json(f"{url}/api/v1/query?query={urllib.parse.quote(expr)}{when}")["data"]["result"]


@pytest.fixture(scope="module")
def two_dialects(tmp_path_factory):
    """Prometheus scraping an agent --sim in SGLang's and one in trtllm-serve's dialect past the storm."""
    tmp: Path = tmp_path_factory.mktemp("prom-dialects-e2e")
    ports = {d: free_port() for d in NODES}
    prom, url, prom_log = start_prometheus(
        # The simulated engines both call their node sim-node: the scrape names each node, as a fleet's
        # relabelling does.
        tmp, [{"job_name": d, "static_configs": [{"targets": [f"127.0.0.1:{p}"]}],
               "metric_relabel_configs": [{"target_label": "node", "replacement": NODES[d]}]}
              for d, p in ports.items()],
        {"scrape_interval": SCRAPE_INTERVAL, "scrape_timeout": SCRAPE_INTERVAL})
    agents, logs = [], []
    try:
        started = time.time()
        for d, node in NODES.items():
            log = open(tmp / f"agent-{d}.log", "wb")
            logs.append(log)
            agents.append(subprocess.Popen(
                [sys.executable, "-m", "gpudiag", "agent", "--sim", "kv-eviction-storm", "--speed", str(SIM_SPEED),
                 "--seed", "0", "--store", str(tmp / f"{d}.db"), "--listen", f"127.0.0.1:{ports[d]}",
                 "--node", node, "--dialect", d], stdout=log, stderr=subprocess.STDOUT))

        def past_storm():
            result = _query(url, "gpudiag_agent_sim_seconds")
            return len(result) == 2 and all(float(r["value"][1]) >= STORM_OVER_SIM_S for r in result)

        wait(f"simulated time {STORM_OVER_SIM_S:g} s on both agents", SIM_DEADLINE_S, past_storm, *agents, prom)
        ended = time.time()
        for a in agents:
            stop(a)
        yield url, started, ended
    finally:
        for a in agents:
            stop(a)
        stop(prom)
        prom_log.close()
        for log in logs:
            log.close()


def test_each_agent_writes_its_engine_in_its_dialect(two_dialects):
    url, _, ended = two_dialects
    at = ended - 1
    assert _query(url, "sglang:num_running_reqs", at) and _query(url, "trtllm_num_requests_running", at)
    assert float(_query(url, "sglang:num_retracted_requests_total", at)[0]["value"][1]) > 0
    # No engine series in vLLM's names: each engine speaks only its own.
    assert not _query(url, CATALOG[M.num_requests_running].name, at)
    assert not _query(url, CATALOG[M.num_preemptions_total].name, at)
    # trtllm-serve has no preemption counter, so its agent writes none; gpudiag's own series stay.
    assert _query(url, CATALOG[M.engine_kv_evictions_total].name + '{node="node-trtllm"}', at)


def test_investigate_reads_both_dialects_and_finds_sglangs_storm(cli, two_dialects):
    url, first, last = two_dialects
    window = P.load_window(url, start=str(first), end=str(last))
    engine = window.table("engine")
    by_node = {n: df for n, df in engine.groupby("node")}
    assert set(NODES.values()) <= set(by_node)
    for node in NODES.values():
        rows = by_node[node]
        assert rows[M.num_requests_running].max() > 0, node
        assert rows[M.kv_cache_usage_perc].max() > 0.9, node  # the storm fills the KV cache
    assert by_node[NODES["sglang"]][M.num_preemptions_total].max() > 0  # its retractions
    p = cli("investigate", "--prometheus", url, "--from", str(first), "--to", str(last), "--node",
            NODES["sglang"], "--json")
    assert p.returncode == 1, p.stderr
    kinds = {f["kind"] for f in json.loads(p.stdout)["findings"]}
    assert "kv_eviction_storm" in kinds, kinds


class _Node:
    """Two simulated engines of one node as one probe: each tick's frames of both GPUs together."""

    name = "sim"

    def __init__(self, engines):
        self.engines = engines
        self.latest = {}  # (engine, kind) -> its last frame: a tick's rows of a kind replace the previous ones

    def sample(self, now):
        fresh = []
        for i, e in enumerate(self.engines):
            for fr in e.sample(now):
                if fr.kind == "request":
                    fresh.append(fr)  # observations: each handed over once
                else:
                    self.latest[(i, fr.kind)] = fr
        by_kind: dict[str, list] = {}
        for fr in self.latest.values():
            by_kind.setdefault(fr.kind, []).append(fr)
        # One frame per kind, both GPUs' rows in it (the agent keeps a tick's newest frame of a kind).
        joined = [Frame(kind, max(f.t for f in frs), [r for f in frs for r in f.rows]) for kind, frs in by_kind.items()]
        return joined + fresh

    def status(self):
        return {"name": self.name, "available": True, "reason": "", "missing_fields": {}}

    def close(self):
        for e in self.engines:
            e.close()


def test_a_mixed_node_speaks_vllm_on_gpu0_and_sglang_on_gpu1(tmp_path):
    from gpudiag.agent.config import AgentConfig
    from gpudiag.agent.daemon import Agent
    from gpudiag.probes.sim import SimProbe

    port = free_port()
    prom, url, prom_log = start_prometheus(
        tmp_path, [{"job_name": "mixed", "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]}],
        {"scrape_interval": SCRAPE_INTERVAL, "scrape_timeout": SCRAPE_INTERVAL})
    cfg = AgentConfig().with_overrides({"store.path": str(tmp_path / "s.db"), "exporter.listen": f"127.0.0.1:{port}"})
    node = _Node([SimProbe("kv-eviction-storm", speed=SIM_SPEED, seed=g, gpu_index=g) for g in (0, 1)])
    agent = Agent(cfg, probes=[("sim", node, 0.25)], node="mixed-node", dialect={"0": "vllm", "1": "sglang"})
    try:
        agent.start()
        start = time.time()
        wait("both GPUs' engines in Prometheus", 60.0,
             lambda: _query(url, 'sglang:num_running_reqs{gpu="1"}')
             and _query(url, CATALOG[M.num_requests_running].name + '{gpu="0"}'), prom)
        time.sleep(3.0)  # a few more scrapes
        # Each GPU's engine in its own names only.
        assert not _query(url, 'sglang:num_running_reqs{gpu="0"}')
        assert not _query(url, CATALOG[M.num_requests_running].name + '{gpu="1"}')
        window = P.load_window(url, start=str(start - 5), end=str(time.time()))
        engine = window.table("engine")
        gpus = {int(g): df for g, df in engine.groupby("gpu")}
        assert set(gpus) == {0, 1}
        for g, df in gpus.items():
            assert df[M.num_requests_running].notna().any(), g
            assert df[M.kv_cache_usage_perc].notna().any(), g
            assert df[M.engine_kv_evictions_total].notna().any(), g  # gpudiag's own series joins the same engine
    finally:
        agent.stop()
        node.close()
        stop(prom)
        prom_log.close()
