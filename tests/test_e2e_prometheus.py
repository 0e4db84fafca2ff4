"""End to end with real parts: the agent in --sim mode scraped by a real Prometheus with the alert rules loaded.

One agent runs the kv-eviction-storm scenario on loopback; one Prometheus (the
Debian package) scrapes it every second and evaluates a copy of
dashboards/alerts.yaml. The run's first simulated ~40 minutes are the
scenario's healthy phase: no alert may fire there. Then the storm finding is
exported and its alert must fire within its ``for`` window. Afterwards every
panel query of every dashboard is run against what Prometheus stored; the
queries that cannot have data on a simulated node are named below, with the
reason, and must be exactly the ones that come back empty. The latency-by-
context-length panels must split the storm's long requests from the short
ones, and the simulated GPU's link and error counters must read as a healthy
device's. A second pair runs the tensor-leak scenario: its leak alert must fire
and keep firing while the leak goes on.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml
from prometheus_support import free_port, stop, wait

from gpudiag.catalog import CONTEXT_BUCKETS
from gpudiag.findings import alert_name
from gpudiag.reference_engine.scenarios import STORM_LONG_PHASE

ROOT = Path(__file__).resolve().parents[1]
DASH_DIR = ROOT / "dashboards"
PROMETHEUS = "/usr/bin/prometheus"
SCENARIO = "kv-eviction-storm"
STORM_KIND = "kv_eviction_storm"
# Simulated seconds per wall second. The storm finding opens at simulated ~4100-4700 s,
# so at 100x it is exported about 45 s after the start, and the phase before it (27 s
# of wall time) is long enough for every shortened `for:` to elapse several times.
SIM_SPEED = 100.0
SCRAPE_INTERVAL_S = 1
EVALUATION_INTERVAL_S = 1
# The healthy observation ends well before the long-sequence phase (2700 s): the
# analyzers see at most a minute of simulated time ahead of the last analysis, so
# nothing they report before this point can stem from the long phase.
HEALTHY_END_SIM_S = STORM_LONG_PHASE[0] - 300.0
# Deadlines (wall seconds). Generous: the machine is shared, and the sim's pace is a
# ceiling, not a promise.
PROMETHEUS_READY_S = 30.0
AGENT_READY_S = 30.0
STORM_FIRING_S = 120.0
# Grafana's interval macros: a few scrape intervals, so rate() sees several samples.
GRAFANA_MACROS = {"$__rate_interval": "5s", "${__rate_interval}": "5s", "$__interval": "5s",
                  "${__interval}": "5s", "$__range": "1h", "${__range}": "1h"}

# Panel queries that return nothing against the simulated node, by why. Checked both
# ways: each of these must be empty, and every other query must return data.
NO_DATA_ON_SIM: dict[str, tuple[str, ...]] = {
    # NVML fields the simulated GPU does not model: its thermal model has one temperature
    # (the core's), and page retirement is what row remapping replaced on the Ampere and
    # later boards it simulates.
    "not-modelled": (
        "gpudiag_gpu_memory_temperature_celsius",
        "gpudiag_gpu_retired_pages_total",
    ),
    # True readings of a healthy device that a panel shows as nothing: the throttle panel
    # draws only active reasons (the simulated GPU reports every reason, all 0: it stays
    # cool and under its power limit), and an XID counter exists per code once that XID
    # has happened (as with the NVML probe; none has). The raw series are checked below.
    "healthy-device": (
        "gpudiag_gpu_clock_throttle_active",
        "gpudiag_gpu_xid_errors_total",
    ),
    # The eBPF probe (uprobes on libcudart, sched tracepoints): not used with --sim,
    # which has no real CUDA processes.
    "ebpf": (
        "gpudiag_cuda_api_calls_total",
        "gpudiag_cuda_api_errors_total",
        "gpudiag_cuda_api_bytes_total",
        "gpudiag_cuda_outstanding_allocation_bytes",
        "gpudiag_cuda_api_latency_seconds_bucket",
        "gpudiag_cuda_kernel_launches_total",
        "gpudiag_cuda_degenerate_launches_total",
        "gpudiag_host_runqueue_wait_seconds_total",
    ),
    # vLLM's prefix cache (read through its recorded name): the reference engine has none, so it exports
    # no hit/query counters.
    "vllm-prefix-cache": ("gpudiag:prefix_cache_hits_total",),
    # The reference engine has no admission control, so nothing is ever rejected.
    "engine-admission": ("gpudiag_engine_requests_rejected_total",),
    # Catalogued and drawn, but no probe exports it: the memory_fragmentation analyzer
    # computes the ratio for its evidence only.
    "not-exported": ("gpudiag_process_torch_external_fragmentation_ratio",),
    # Golden signals measured by exporters every Kubernetes node runs; not in this setup.
    "external-exporters": ("node_cpu_seconds_total", "kube_pod_status_phase"),
}



def _duration_s(text: str) -> float:
    """Seconds in a Prometheus duration such as 90s, 5m, 1h30m."""
    parts = re.findall(r"(\d+)(ms|s|m|h|d)", text)
    assert parts and "".join(n + u for n, u in parts) == text, f"unparsed duration {text!r}"
    scale = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}
    return sum(int(n) * scale[u] for n, u in parts)


def shortened_rules(text: str, speed: float) -> tuple[str, dict[str, int]]:
    """The rules with every ``for:`` divided by the sim's speed (rounded up to whole seconds).

    The alerts' windows are meant in the engine's time; the sim runs ``speed`` times
    faster than the wall clock Prometheus measures ``for`` on, so a 1 m window is
    0.6 s of wall time at 100x. Returns the new YAML and the wall ``for`` per alert.
    """
    doc = yaml.safe_load(text)
    windows = {}
    for group in doc["groups"]:
        group["interval"] = f"{EVALUATION_INTERVAL_S}s"
        for rule in group["rules"]:
            wall = math.ceil(_duration_s(rule.get("for", "0s")) / speed)
            rule["for"] = f"{wall}s"
            windows[rule["alert"]] = wall
    return yaml.safe_dump(doc, sort_keys=False), windows


class Prom:
    """The HTTP API of the Prometheus under test."""

    def __init__(self, base: str):
        self.base = base

    def get(self, path: str, **params) -> dict:
        """GET ``path`` with ``params``; the decoded JSON body."""
        url = f"{self.base}{path}?{urllib.parse.urlencode(params, doseq=True)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                body = json.load(r)
        except urllib.error.HTTPError as exc:
            pytest.fail(f"{path} {params}: HTTP {exc.code}: {exc.read().decode(errors='replace')}")
        assert body["status"] == "success", body
        return body["data"]

    def instant(self, expr: str, at: float | None = None) -> list[dict]:
        """The result of an instant query."""
        params = {"query": expr} if at is None else {"query": expr, "time": f"{at:.3f}"}
        return self.get("/api/v1/query", **params)["result"]

    def over(self, expr: str, start: float, end: float) -> list[dict]:
        """The result of a range query at 1 s steps, as a dashboard panel over that span asks it."""
        return self.get("/api/v1/query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}",
                        step="1")["result"]

    def first_sample_s(self, selector: str, at: float) -> float | None:
        """Timestamp of the oldest raw sample of ``selector`` in the 10 minutes before ``at``."""
        stamps = [float(v[0]) for s in self.instant(f"{selector}[10m]", at) for v in s["values"]]
        return min(stamps) if stamps else None




def _http_ok(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=2) as r:
        return r.status == 200


def _agent_sim_seconds(url: str) -> float | None:
    with urllib.request.urlopen(url, timeout=2) as r:
        text = r.read().decode()
    m = re.search(r"^gpudiag_agent_sim_seconds\{[^}]*\} (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


@contextlib.contextmanager
def agent_and_prometheus(tmp: Path, scenario: str):
    """A real Prometheus with the (shortened) alert rules, scraping ``gpudiag agent --sim scenario``.

    Yields (Prom, the agent's /metrics URL, the wall ``for`` per alert, wall time of the first
    scrape, the processes); both are stopped on exit.
    """
    if not os.path.exists(PROMETHEUS):
        pytest.fail(f"{PROMETHEUS} not found: install Debian's prometheus package "
                    "(scripts/system-deps.d/20-prometheus.sh; CI runs it)")
    agent_port, prom_port = free_port(), free_port()
    rules, windows = shortened_rules((DASH_DIR / "alerts.yaml").read_text(), SIM_SPEED)
    (tmp / "alerts.yaml").write_text(rules)
    (tmp / "prometheus.yml").write_text(yaml.safe_dump({
        "global": {"scrape_interval": f"{SCRAPE_INTERVAL_S}s", "scrape_timeout": f"{SCRAPE_INTERVAL_S}s",
                   "evaluation_interval": f"{EVALUATION_INTERVAL_S}s"},
        # The boards read the engine's series through the recording rules, loaded as they ship beside
        # the alerts (docs/dashboards.md); only the alerts' windows are shortened for the sped-up run.
        "rule_files": [str(tmp / "alerts.yaml"), str(DASH_DIR / "engine_rules.yaml")],
        "scrape_configs": [{"job_name": "gpudiag", "static_configs": [{"targets": [f"127.0.0.1:{agent_port}"]}]}],
    }))
    prom_log, agent_log = open(tmp / "prometheus.log", "wb"), open(tmp / "agent.log", "wb")
    procs: list[subprocess.Popen] = []
    try:
        prom_proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{prom_port}"], stdout=prom_log, stderr=subprocess.STDOUT)
        procs.append(prom_proc)
        base = f"http://127.0.0.1:{prom_port}"
        wait("prometheus /-/ready", PROMETHEUS_READY_S, lambda: _http_ok(f"{base}/-/ready"), prom_proc)
        prom = Prom(base)
        groups = prom.get("/api/v1/rules")["groups"]
        loaded = {r["name"] for g in groups for r in g["rules"] if r["type"] == "alerting"}
        assert loaded == set(windows), "Prometheus did not load every rule of alerts.yaml"
        assert any(r["type"] == "recording" for g in groups for r in g["rules"]), "engine_rules.yaml not loaded"

        agent_proc = subprocess.Popen(
            [sys.executable, "-m", "gpudiag", "agent", "--sim", scenario, "--speed", str(SIM_SPEED), "--seed", "0",
             "--store", str(tmp / "store.db"), "--listen", f"127.0.0.1:{agent_port}"],
            stdout=agent_log, stderr=subprocess.STDOUT)
        procs.append(agent_proc)
        metrics = f"http://127.0.0.1:{agent_port}/metrics"
        wait("agent /metrics", AGENT_READY_S, lambda: _http_ok(metrics), agent_proc)
        wait("the agent's first scrape", AGENT_READY_S,
              lambda: prom.instant('up{job="gpudiag"} == 1'), agent_proc, prom_proc)
        yield prom, metrics, windows, time.time(), (agent_proc, prom_proc)
    finally:
        for p in reversed(procs):
            stop(p)
        prom_log.close()
        agent_log.close()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Agent + Prometheus through the healthy phase and until the storm alert fires; the run's timings."""
    tmp = tmp_path_factory.mktemp("e2e")
    with agent_and_prometheus(tmp, SCENARIO) as (prom, metrics, windows, started, procs):
        wait(f"simulated time {HEALTHY_END_SIM_S:g} s", STORM_FIRING_S,
              lambda: (_agent_sim_seconds(metrics) or 0) >= HEALTHY_END_SIM_S, *procs)
        healthy_end = time.time()

        storm = alert_name(STORM_KIND)
        firing_sel = f'ALERTS{{alertname="{storm}", alertstate="firing"}}'
        wait(f"{storm} firing", STORM_FIRING_S, lambda: prom.instant(firing_sel), *procs)
        fired_seen = time.time()
        # A few more scrapes, so every rate() window at the end of the span holds samples.
        time.sleep(3 * SCRAPE_INTERVAL_S)
        yield {"prom": prom, "tmp": tmp, "windows": windows, "started": started, "healthy_end": healthy_end,
               "fired_seen": fired_seen, "end": time.time(), "storm": storm}


def test_healthy_phase_fires_no_alert(run):
    prom = run["prom"]
    firing = prom.over('ALERTS{alertstate="firing"}', run["started"], run["healthy_end"])
    names = {s["metric"]["alertname"] for s in firing}
    whole_run = {s["metric"]["alertname"] for s in prom.over('ALERTS{alertstate="firing"}', run["started"], run["end"])}
    opened = {s["metric"]["kind"]: (min(float(v[0]) for v in s["values"]) - run["started"],
                                    max(float(v[0]) for v in s["values"]) - run["started"])
              for s in prom.over("gpudiag_finding_active == 1", run["started"], run["healthy_end"])}
    print(f"\nfiring in the healthy phase: {sorted(names)}; over the whole run: {sorted(whole_run)}; "
          f"findings open in the healthy phase (wall s after start): {opened}")
    assert not names, f"alerts fired during the healthy phase: {firing}; findings open then: {opened}"


def test_storm_alert_fires_within_its_for_window(run):
    prom, storm = run["prom"], run["storm"]
    at = run["end"]
    finding = prom.first_sample_s(f'gpudiag_finding_active{{kind="{STORM_KIND}"}}', at)
    fired = prom.first_sample_s(f'ALERTS{{alertname="{storm}", alertstate="firing"}}', at)
    assert finding is not None and fired is not None
    # Pending at the first evaluation after the scrape that carried the finding, firing
    # once `for` has passed: at most one evaluation interval more, plus one of slack for
    # the scrape and the evaluation not sharing a clock.
    bound = run["windows"][storm] + 2 * EVALUATION_INTERVAL_S
    print(f"\n{storm}: finding exported at +{finding - run['started']:.1f} s, firing {fired - finding:.1f} s later "
          f"(for {run['windows'][storm]} s)")
    assert finding <= fired <= finding + bound
    labels = prom.instant(f'ALERTS{{alertname="{storm}", alertstate="firing"}}', fired)[0]["metric"]
    assert labels["severity"] in {"warning", "critical"} and labels["gpu"] == "0"


def _dashboard_queries():
    for path in sorted(DASH_DIR.glob("*.json")):
        d = json.loads(path.read_text())
        for p in d["panels"]:
            for t in p.get("targets", []):
                yield f"{path.name} / {p['title']} / {t['refId']}", t["expr"]


def _substitute(expr: str, values: dict[str, list[str]]) -> str:
    for macro, value in GRAFANA_MACROS.items():
        expr = expr.replace(macro, value)
    for var, vals in values.items():
        # Grafana's multi-value form: alternatives, regex-escaped, inside a PromQL string.
        regex = "|".join(re.escape(v).replace("\\", "\\\\") for v in vals)
        expr = expr.replace(f"${{{var}}}", regex).replace(f"${var}", regex)
    assert "$" not in expr, f"unsubstituted Grafana variable in {expr}"
    return expr


def _expected_empty(expr: str) -> str | None:
    for reason, names in NO_DATA_ON_SIM.items():
        if any(re.search(rf"(?<![\w:]){re.escape(n)}(?![\w:])", expr) for n in names):
            return reason
    return None


def _template_values(prom: Prom) -> dict[str, list[str]]:
    """The dashboards' template variables set to every value Prometheus knows (Grafana's "All")."""
    labels = {
        "node": prom.get("/api/v1/label/node/values", **{"match[]": "gpudiag_gpu_utilization_ratio"}),
        "gpu": prom.get("/api/v1/label/gpu/values", **{"match[]": "gpudiag_gpu_utilization_ratio"}),
        "process": prom.get("/api/v1/label/process/values", **{"match[]": "gpudiag_process_gpu_memory_bytes"}),
        "datasource": ["prometheus"],
    }
    for var in ("node", "gpu", "process"):
        assert labels[var], f"template variable ${var} has no values"
    return labels


def test_every_panel_query_returns_data_except_the_listed_ones(run):
    prom, start, end = run["prom"], run["started"], run["end"]
    labels = _template_values(prom)
    unexpected_empty, unexpected_data, listed_names_seen = [], [], set()
    with_data = []
    for where, raw in _dashboard_queries():
        expr = _substitute(raw, labels)
        result = prom.over(expr, start, end)
        reason = _expected_empty(raw)
        if reason is not None:
            listed_names_seen.add(reason)
            if result:
                unexpected_data.append(f"{where} [{reason}]")
        elif not result:
            unexpected_empty.append(f"{where}: {expr}")
        else:
            with_data.append(where)
    print(f"\n{len(with_data)} panel queries returned data")
    assert not unexpected_empty, "panel queries with no data:\n" + "\n".join(unexpected_empty)
    assert not unexpected_data, "listed as no-data on the sim, but returned data:\n" + "\n".join(unexpected_data)
    assert listed_names_seen == set(NO_DATA_ON_SIM), "a NO_DATA_ON_SIM group matches no panel query"


def _by_context_panels() -> list[dict]:
    d = json.loads((DASH_DIR / "service.json").read_text())
    return [p for p in d["panels"] if "by context length" in p["title"]]


def test_latency_by_context_length_panels_split_the_storms_long_requests_from_the_short(run):
    prom, start, end = run["prom"], run["started"], run["end"]
    labels = _template_values(prom)
    panels = _by_context_panels()
    assert len(panels) == 4  # TTFT, inter-token, e2e quantiles and the per-bucket request rate
    for p in panels:
        for t in p["targets"]:
            expr = _substitute(t["expr"], labels)
            buckets = {s["metric"].get("context_bucket") for s in prom.over(expr, start, end)}
            print(f"\n{p['title']} / {t['refId']}: {sorted(buckets)}")
            # Chat turns fill the two lowest buckets; the storm's long generations (prompt
            # ~1.5k + output ~3k tokens) the <=8k one.
            assert {"<=512", "<=2k", "<=8k"} <= buckets <= set(CONTEXT_BUCKETS), f"{p['title']}: {buckets}"
    # Over the run, decode is slowest per token for the long requests (SCENARIOS.md §1: the
    # bad requests are long ones in decode). The mean, not a tail quantile: the run ends when
    # the storm alert fires, when only a few hundred long requests have finished.
    itl = "gpudiag_request_inter_token_latency_seconds"
    mean = {s["metric"]["context_bucket"]: float(s["value"][1]) for s in prom.instant(
        f"sum by (context_bucket) (increase({itl}_sum[1h])) / sum by (context_bucket) (increase({itl}_count[1h]))",
        end)}
    print(f"mean inter-token latency by context bucket over the run: "
          f"{ {k: round(v, 4) for k, v in sorted(mean.items())} }")
    assert mean["<=8k"] > max(mean["<=512"], mean["<=2k"])
    # Each finished request is counted once in its bucket: the buckets add up to vLLM's histogram.
    total = prom.instant("sum(vllm:e2e_request_latency_seconds_count)", end)
    by_bucket = prom.instant("sum(gpudiag_request_e2e_latency_seconds_count)", end)
    assert total and by_bucket and float(total[0]["value"][1]) == float(by_bucket[0]["value"][1]) > 0


def test_simulated_gpu_exports_the_counters_of_a_healthy_device(run):
    prom, end = run["prom"], run["end"]

    def over_run(fn: str, name: str) -> dict[str, float]:
        return {json.dumps(s["metric"], sort_keys=True): float(s["value"][1])
                for s in prom.instant(f"{fn}({name}[1h])", end)}

    for name, series in (("gpudiag_gpu_ecc_errors_total", 4), ("gpudiag_gpu_nvlink_errors_total", 5),
                         ("gpudiag_gpu_pcie_replay_total", 1), ("gpudiag_gpu_remapped_rows_total", 2),
                         ("gpudiag_gpu_clock_throttle_active", 9)):
        highest = over_run("max_over_time", name)
        assert len(highest) == series and set(highest.values()) == {0.0}, f"{name}: {highest}"
    assert not prom.instant("gpudiag_gpu_xid_errors_total", end)
    # Host<->device traffic of the engine's steps: inputs in (rx) every second, sampled tokens out (tx).
    for name in ("gpudiag_gpu_pcie_rx_bytes_per_second", "gpudiag_gpu_pcie_tx_bytes_per_second"):
        mean = over_run("avg_over_time", name)
        print(f"\n{name} mean over the run: {list(mean.values())}")
        assert len(mean) == 1 and list(mean.values())[0] > 0
    rx = list(over_run("avg_over_time", "gpudiag_gpu_pcie_rx_bytes_per_second").values())[0]
    tx = list(over_run("avg_over_time", "gpudiag_gpu_pcie_tx_bytes_per_second").values())[0]
    assert rx > tx  # prompts go in whole; one id per generated token comes back


def test_rules_are_shortened_in_proportion_to_the_speed():
    text, windows = shortened_rules("groups:\n- name: g\n  rules:\n  - alert: A\n    expr: up\n    for: 5m\n"
                                    "  - alert: B\n    expr: up\n    for: 0m\n  - alert: C\n    expr: up\n", 100.0)
    assert windows == {"A": 3, "B": 0, "C": 0}
    assert yaml.safe_load(text)["groups"][0]["interval"] == f"{EVALUATION_INTERVAL_S}s"


# The tensor-leak scenario's leak is found by the agent's streaming analysis at simulated ~840 s
# and goes on until the OOM at ~11 100 s; watched through simulated LEAK_WATCH_END_SIM_S.
LEAK_SCENARIO = "tensor-leak"
LEAK_WATCH_END_SIM_S = 3600.0
LEAK_FIRING_S = 60.0


def test_a_leak_alert_fires_and_keeps_firing_while_the_leak_goes_on(tmp_path):
    # A busy process's memory swings more within a 15-minute window than the leak adds, so only
    # some analyses confirm it; its finding must stay open between them, long enough for the
    # alert's `for: 5m` and without resolving and firing again.
    leak = alert_name("memory_leak")
    firing_sel = f'ALERTS{{alertname="{leak}", alertstate="firing"}}'
    with agent_and_prometheus(tmp_path, LEAK_SCENARIO) as (prom, metrics, windows, started, procs):
        wait(f"{leak} firing", LEAK_FIRING_S, lambda: prom.instant(firing_sel), *procs)
        fired = time.time()
        wait(f"simulated time {LEAK_WATCH_END_SIM_S:g} s", LEAK_FIRING_S,
              lambda: (_agent_sim_seconds(metrics) or 0) >= LEAK_WATCH_END_SIM_S, *procs)
        end = time.time()
        series = prom.over(firing_sel, fired, end)
        stamps = sorted(float(v[0]) for s in series for v in s["values"])
        opened = prom.over('gpudiag_finding_active{kind="memory_leak"} == 1', started, end)
    print(f"\n{leak}: firing from +{fired - started:.1f} s to +{end - started:.1f} s (wall), "
          f"{len(stamps)} evaluations, finding series {len(opened)}")
    assert len(opened) == 1, "one finding, open all along"
    # Firing at every evaluation from the first until the end of the watch (1 s steps, a second of slack).
    assert stamps and stamps[-1] >= end - 2 * EVALUATION_INTERVAL_S
    assert max(b - a for a, b in zip(stamps, stamps[1:] + [stamps[-1]])) <= 2 * EVALUATION_INTERVAL_S, \
        "the alert stopped firing while the leak went on"
