"""Prometheus alert rules generated from the analyzers' finding kinds and the golden signals.

Conventions of the monitoring mixins: CamelCase names with the common
prefix ``Gpudiag``; a ``severity`` label (critical | warning | info); the
annotations ``summary``, ``description`` and ``runbook_url`` (BASE/runbooks/
<AlertName>.md, BASE chosen at export).

- One alert per finding kind fires on the agent's
  ``gpudiag_finding_active{kind=...}`` series. The analyzer already decided
  severity and duration, so the alert keeps the series' ``severity`` label
  and its ``for`` only rides out one missed scrape or a flapping episode.
- Five golden-signal alerts (SCENARIOS.md) fire on raw metrics, with the
  thresholds and windows below.

The YAML is written by a small emitter (double-quoted scalars), not PyYAML,
so that ``gpudiag dashboards export`` needs nothing beyond the package's own
dependencies. :func:`render_tests` writes the matching ``promtool test
rules`` file: per alert, a scenario series that fires it and healthy series
that do not.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from gpudiag import catalog
from gpudiag.analyzers import throttling
from gpudiag.analyzers.registry import ANALYZERS
from gpudiag.findings import ALERT_PREFIX, alert_name

from . import DEFAULT_RUNBOOK_BASE_URL  # noqa: F401 - re-exported: dashboards and tests read it here
from . import external_metrics as ext

M = catalog.M
RULES_FILE = "alerts.yaml"
# The recording rules the engine alerts read (dashboards/engine_rules.py writes them).
ENGINE_RULES_FILE = "engine_rules.yaml"

# --- golden-signal thresholds (SCENARIOS.md, "Other signals from the reports") ---
# Saturated for 5 minutes: past this the circuit breaker sheds load; the alert asks to scale out first.
GPU_UTILIZATION_SATURATED_RATIO = 0.95
GPU_UTILIZATION_FOR = "5m"
# Below 0.7 the prefix cache saves too little prefill for the memory it holds (or a restart emptied it).
KV_HIT_RATIO_LOW = 0.7
KV_HIT_RATIO_FOR = "10m"
# Same bar as the throttling analyzer's "hot" (NVIDIA parts start slowing down in the high 80s).
GPU_TEMPERATURE_HIGH_C = throttling.TEMPERATURE_THRESHOLD_C
GPU_TEMPERATURE_FOR = "5m"
# A tenth of all CPU time idle on disk waits: weight loads or checkpoints starve everything else on the node.
DISK_IOWAIT_HIGH_RATIO = 0.1
DISK_IOWAIT_FOR = "10m"
# kube-state-metrics' KubePodNotReady also waits 15 minutes: image pulls and scale-ups take minutes.
PODS_PENDING_FOR = "15m"
RATE_WINDOW = "5m"

# --- finding kinds: what each alert says, and how long the series must hold ---
FINDING_TEXT: dict[str, tuple[str, str, str]] = {
    "memory_fragmentation": (
        "1m",
        "GPU memory is fragmented: allocations fail with free memory on {{ $labels.node }} GPU {{ $labels.gpu }}.",
        "The caching allocator holds enough free memory for a request but no hole large enough; KV allocations "
        "fail and the engine evicts. Run `gpudiag top` on the node and read the runbook."),
    "kv_eviction_storm": (
        "1m", "KV eviction storm on {{ $labels.node }} GPU {{ $labels.gpu }}: sustained preemptions at a full "
        "KV cache.",
        "The engine keeps evicting running requests' KV and recomputing it: wasted work, a growing queue, falling "
        "throughput or rising decode latency. The finding's cause says whether demand exceeded the KV capacity "
        "(engine knobs) or the pool fragmented or shrank (a co-tenant)."),
    "oom_forecast": (
        "5m", "GPU {{ $labels.gpu }} on {{ $labels.node }} is forecast to run out of memory.",
        "The memory a process holds (reserved, or driver-charged) grows steadily towards the device capacity; "
        "at this rate it runs out within hours (critical: within 30 minutes)."),
    "memory_leak": (
        "5m", "Device memory leak on {{ $labels.node }} GPU {{ $labels.gpu }}.",
        "A process's device memory grows while its load is flat. The finding names the leaking layer: tensors, "
        "the caching-allocator pool, or the driver layer outside PyTorch."),
    "cpu_starved_gpu": (
        "2m", "GPU {{ $labels.gpu }} on {{ $labels.node }} is starved by its host CPU.",
        "Utilization is low with real traffic: a host thread is saturated (tokenize, pad, launch) or starved of "
        "cores, and the device queue is empty. The GPU waits for its host."),
    "gpu_cotenant": (
        "1m", "Another process holds memory on {{ $labels.node }} GPU {{ $labels.gpu }}; the KV pool shrank.",
        "A second process (often a leftover training job) holds device memory on the engine's GPU, so the "
        "engine's KV capacity is far below nominal and it pages constantly."),
    "degenerate_kernel_launch": (
        "1m", "Kernels launched with a degenerate grid on {{ $labels.node }} GPU {{ $labels.gpu }}.",
        "A kernel is launched with far too few blocks (grid (1,1,1)) and runs many times slower than usual; "
        "typically after a library or framework upgrade."),
    "throttling": (
        "2m", "GPU {{ $labels.gpu }} on {{ $labels.node }} is throttled by heat or power.",
        "The SM clock is held below its maximum by a thermal or power reason, or the GPU runs above 85 °C. "
        "Critical when a hardware protection cut the clocks."),
    "hardware_errors": (
        "0m", "Hardware errors on {{ $labels.node }} GPU {{ $labels.gpu }} (XID, ECC, NVLink or PCIe).",
        "The GPU, its memory or its links keep reporting errors. Critical for uncorrected ECC, a lost GPU, an "
        "uncorrectable row remap or a fatal XID: drain the node."),
    "queue_avalanche": (
        "1m", "Queue avalanche on {{ $labels.node }} GPU {{ $labels.gpu }}: clients time out, the instance restarts.",
        "Load above capacity is queued instead of refused: queue wait climbs past the clients' timeouts and the "
        "liveness probe, the instance restarts and retries land on it. Bound the queue and refuse the excess (429)."),
    "prefix_cache_thrash": (
        "5m", "Prefix cache on {{ $labels.node }} GPU {{ $labels.gpu }} evicts KV that requests come back for.",
        "A fifth or more of the prompt tokens looked up had been cached and were evicted before they were needed, "
        "so they are prefilled again: long prefills stall decoding and inter-token latency jitters."),
    "latency_regression": (
        "2m", "Request latency P99 regressed on {{ $labels.node }} GPU {{ $labels.gpu }}.",
        "TTFT, inter-token or end-to-end latency P99 is at least twice its baseline. P99 up with P50 normal "
        "points at stragglers or communication; everything slower at load, throttling or memory pressure."),
}


@dataclass
class Case:
    """One promtool input: series -> values, and the labels of the alerts expected at ``eval_time``."""

    series: dict[str, str]
    expected: list[dict[str, str]] = field(default_factory=list)
    eval_time: str = "30m"
    early_time: str | None = None  # an evaluation before ``for`` has elapsed: nothing may fire yet


@dataclass
class Alert:
    """One alert rule with its promtool cases."""

    name: str
    expr: str
    for_: str
    summary: str
    description: str
    severity: str | None  # None: the series' own severity label (finding alerts)
    firing: Case
    healthy: Case

    def rule(self, runbook_base_url: str) -> dict:
        """The rule as the rules file holds it."""
        r = {"alert": self.name, "expr": self.expr, "for": self.for_}
        if self.severity:
            r["labels"] = {"severity": self.severity}
        r["annotations"] = self.annotations(runbook_base_url)
        return r

    def annotations(self, runbook_base_url: str) -> dict[str, str]:
        """summary, description and runbook_url (templates unexpanded)."""
        return {"summary": self.summary, "description": self.description,
                "runbook_url": runbook_url(self.name, runbook_base_url)}


def runbook_url(alert: str, base_url: str = DEFAULT_RUNBOOK_BASE_URL) -> str:
    """BASE/runbooks/<AlertName>.md."""
    return f"{base_url.rstrip('/')}/runbooks/{alert}.md"


def _series(name: str, **labels: str) -> str:
    inner = ", ".join(f"{k}={json.dumps(v)}" for k, v in labels.items())
    return f"{name}{{{inner}}}"


def finding_alerts() -> list[Alert]:
    """One alert per finding kind, firing on gpudiag_finding_active."""
    active = catalog.get(M.finding_active).name
    out = []
    for kind in ANALYZERS:
        for_, summary, description = FINDING_TEXT[kind]
        expr = f'max by (node, gpu, severity) ({active}{{kind="{kind}"}}) == 1'
        firing = Case(
            series={
                _series(active, node="node-a", kind=kind, severity="critical", gpu="0"): "1x40",
                # the same kind closed on another GPU, and another kind open: neither may fire this alert
                _series(active, node="node-a", kind=kind, severity="warning", gpu="1"): "1x2 0x38",
                _series(active, node="node-b", kind=_other_kind(kind), severity="warning", gpu="0"): "1x40",
            },
            expected=[{"node": "node-a", "gpu": "0", "severity": "critical"}],
            early_time=None if for_ == "0m" else "0m")
        healthy = Case(series={_series(active, node="node-a", kind=kind, severity="warning", gpu="0"): "0x40",
                               _series(active, node="node-a", kind=_other_kind(kind), severity="critical",
                                       gpu="0"): "1x40"})
        out.append(Alert(alert_name(kind), expr, for_, summary, description, None, firing, healthy))
    return out


def _other_kind(kind: str) -> str:
    kinds = list(ANALYZERS)
    return kinds[(kinds.index(kind) + 1) % len(kinds)]


def golden_signal_alerts() -> list[Alert]:
    """The five golden signals of an infra-health board."""
    util = catalog.get(M.gpu_utilization_ratio).name
    temp = catalog.get(M.gpu_temperature_celsius).name
    # The recorded names (engine_rules.yaml): every engine dialect's prefix-cache counters.
    hits = catalog.normalised(M.prefix_cache_hits_total)
    queries = catalog.normalised(M.prefix_cache_queries_total)
    vllm_hits = catalog.get(M.prefix_cache_hits_total).name
    vllm_queries = catalog.get(M.prefix_cache_queries_total).name
    gpu = {"node": "node-a", "gpu": "0", "uuid": "GPU-0"}
    gpu_b = {"node": "node-b", "gpu": "0", "uuid": "GPU-1"}
    eng = {"node": "node-a", "gpu": "0", "engine": "vllm"}
    # An engine that names neither node nor GPU (SGLang, TensorRT-LLM...) is its scrape target.
    hit_ratio = (f"sum by (node, gpu, instance) (rate({hits}[{RATE_WINDOW}])) / "
                 f"sum by (node, gpu, instance) (rate({queries}[{RATE_WINDOW}]))")
    sglang = {"instance": "serve-b:30000", "model_name": "qwen3-8b"}
    iowait = f'avg by (instance) (rate({ext.NODE_CPU_SECONDS_TOTAL}{{mode="iowait"}}[{RATE_WINDOW}]))'
    pending = f'sum by (namespace) ({ext.KUBE_POD_STATUS_PHASE}{{phase="Pending"}})'
    return [
        Alert(f"{ALERT_PREFIX}GpuUtilizationSaturated",
              f"max by (node, gpu) ({util}) > {GPU_UTILIZATION_SATURATED_RATIO}", GPU_UTILIZATION_FOR,
              "GPU {{ $labels.gpu }} on {{ $labels.node }} is above 95 % utilization for 5 minutes.",
              "The GPU has no headroom: queues grow and latency follows. Scale out or shed load before the "
              "circuit breaker does.", "warning",
              Case({_series(util, **gpu): "0.99x40", _series(util, **gpu_b): "0.65x40"},
                   [{"node": "node-a", "gpu": "0"}], "10m", "3m"),
              Case({_series(util, **gpu): "0.65x20 0.99x3 0.65x17"})),
        Alert(f"{ALERT_PREFIX}KvCacheHitRatioLow", f"({hit_ratio}) < {KV_HIT_RATIO_LOW}", KV_HIT_RATIO_FOR,
              "Prefix-cache hit ratio below 0.7 on {{ $labels.node }} GPU {{ $labels.gpu }}.",
              "Fewer prompt tokens than usual are found in the prefix cache, so more prefill is recomputed. "
              "Evictions, a restart that emptied the cache, or a change of the traffic mix.", "warning",
              # vLLM on node-a and SGLang on serve-b fall below the bar; vLLM on node-b does not.
              Case({_series(vllm_hits, **eng): "0+30x40", _series(vllm_queries, **eng): "0+100x40",
                    _series(vllm_hits, **{**eng, "node": "node-b"}): "0+90x40",
                    _series(vllm_queries, **{**eng, "node": "node-b"}): "0+100x40",
                    _series("sglang:cached_tokens_total", **sglang): "0+40x40",
                    _series("sglang:prompt_tokens_total", **sglang): "0+100x40"},
                   [{"node": "node-a", "gpu": "0"}, {"instance": "serve-b:30000"}], "25m", "8m"),
              Case({_series(vllm_hits, **eng): "0+90x40", _series(vllm_queries, **eng): "0+100x40",
                    _series("sglang:cached_tokens_total", **sglang): "0+90x40",
                    _series("sglang:prompt_tokens_total", **sglang): "0+100x40"})),
        Alert(f"{ALERT_PREFIX}GpuTemperatureHigh", f"max by (node, gpu) ({temp}) > {GPU_TEMPERATURE_HIGH_C:g}",
              GPU_TEMPERATURE_FOR,
              "GPU {{ $labels.gpu }} on {{ $labels.node }} is above 85 °C.",
              "Above this the GPU lowers its clocks to protect itself, and sustained heat shortens its life. Check "
              "cooling, fans and the power limit.", "critical",
              Case({_series(temp, **gpu): "91x40", _series(temp, **gpu_b): "70x40"},
                   [{"node": "node-a", "gpu": "0"}], "10m", "3m"),
              Case({_series(temp, **gpu): "70x40"})),
        Alert(f"{ALERT_PREFIX}NodeDiskIoWaitHigh", f"{iowait} > {DISK_IOWAIT_HIGH_RATIO}", DISK_IOWAIT_FOR,
              "CPUs on {{ $labels.instance }} spend over 10 % of their time waiting on disk IO.",
              "Weight loads, checkpoints or swap saturate the disk; processes that feed the GPUs block on IO. "
              "Check what reads and writes (iotop) and the disk's health.", "warning",
              Case({_series(ext.NODE_CPU_SECONDS_TOTAL, instance="node-a:9100", cpu="0", mode="iowait"): "0+30x40",
                    _series(ext.NODE_CPU_SECONDS_TOTAL, instance="node-b:9100", cpu="0", mode="iowait"): "0+1x40"},
                   [{"instance": "node-a:9100"}], "25m", "8m"),
              Case({_series(ext.NODE_CPU_SECONDS_TOTAL, instance="node-a:9100", cpu="0", mode="iowait"): "0+1x40",
                    _series(ext.NODE_CPU_SECONDS_TOTAL, instance="node-a:9100", cpu="0", mode="idle"): "0+50x40"})),
        Alert(f"{ALERT_PREFIX}PodsPending", f"{pending} > 0", PODS_PENDING_FOR,
              "Pods in namespace {{ $labels.namespace }} have been Pending for 15 minutes.",
              "No node can take them: GPU requests that no node satisfies, a node pool at its limit, or images "
              "that cannot be pulled.", "warning",
              Case({_series(ext.KUBE_POD_STATUS_PHASE, namespace="inference", pod="llm-0", phase="Pending"): "1x40",
                    _series(ext.KUBE_POD_STATUS_PHASE, namespace="batch", pod="job-0", phase="Pending"): "1x5 0x35"},
                   [{"namespace": "inference"}], "25m", "10m"),
              Case({_series(ext.KUBE_POD_STATUS_PHASE, namespace="inference", pod="llm-0", phase="Pending"): "0x40",
                    _series(ext.KUBE_POD_STATUS_PHASE, namespace="inference", pod="llm-0", phase="Running"): "1x40"})),
    ]


def all_alerts() -> list[Alert]:
    """Every alert, finding kinds first."""
    return finding_alerts() + golden_signal_alerts()


def rule_groups(runbook_base_url: str = DEFAULT_RUNBOOK_BASE_URL) -> dict:
    """The rules file as a document: two groups, findings and golden signals."""
    return {"groups": [
        {"name": "gpudiag-findings", "rules": [a.rule(runbook_base_url) for a in finding_alerts()]},
        {"name": "gpudiag-golden-signals", "rules": [a.rule(runbook_base_url) for a in golden_signal_alerts()]},
    ]}


_TEMPLATE = re.compile(r"\{\{\s*\$labels\.(\w+)\s*\}\}")


def _expand(text: str, labels: dict[str, str]) -> str:
    """Expand ``{{ $labels.x }}`` the way Prometheus does (the only template the annotations use)."""
    return _TEMPLATE.sub(lambda m: labels.get(m.group(1), ""), text)


def test_document(runbook_base_url: str = DEFAULT_RUNBOOK_BASE_URL) -> dict:
    """The ``promtool test rules`` document: per alert, one firing and one healthy test."""
    tests = []
    for a in all_alerts():
        sev = {"severity": a.severity} if a.severity else {}
        firing_checks = []
        if a.firing.early_time:
            firing_checks.append({"eval_time": a.firing.early_time, "alertname": a.name, "exp_alerts": []})
        firing_checks.append({"eval_time": a.firing.eval_time, "alertname": a.name, "exp_alerts": [
            {"exp_labels": {**sev, **labels},
             "exp_annotations": {k: _expand(v, labels) for k, v in a.annotations(runbook_base_url).items()}}
            for labels in a.firing.expected]})
        tests.append({"name": f"{a.name} fires on its scenario", "interval": "1m",
                      "input_series": [{"series": s, "values": v} for s, v in a.firing.series.items()],
                      "alert_rule_test": firing_checks})
        tests.append({"name": f"{a.name} stays silent when healthy", "interval": "1m",
                      "input_series": [{"series": s, "values": v} for s, v in a.healthy.series.items()],
                      "alert_rule_test": [{"eval_time": t, "alertname": a.name, "exp_alerts": []}
                                          for t in ("5m", a.healthy.eval_time)]})
    return {"rule_files": [RULES_FILE, ENGINE_RULES_FILE], "evaluation_interval": "1m", "tests": tests}


# --- a small YAML emitter: mappings, sequences and double-quoted scalars ---

def _scalar(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if v == [] or v == {}:
        return json.dumps(v)
    return json.dumps(str(v), ensure_ascii=False)


def _emit(obj, indent: int):
    pad = " " * indent
    if isinstance(obj, dict):
        for k, v in obj.items():
            if isinstance(v, (dict, list)) and v:
                yield f"{pad}{k}:"
                yield from _emit(v, indent + 2)
            else:
                yield f"{pad}{k}: {_scalar(v)}"
        return
    for item in obj:
        if isinstance(item, (dict, list)) and item:
            lines = list(_emit(item, indent + 2))
            lines[0] = f"{pad}- {lines[0][indent + 2:]}"
            yield from lines
        else:
            yield f"{pad}- {_scalar(item)}"


def to_yaml(doc: dict, header: str = "") -> str:
    """YAML text of a document of dicts, lists and scalars (strings double-quoted, JSON-escaped)."""
    lines = [f"# {line}" if line else "#" for line in header.splitlines()]
    return "\n".join(lines + list(_emit(doc, 0))) + "\n"


_HEADER = "Generated by dashboards/alerts.py (gpudiag dashboards generate); do not edit by hand."


def render_rules(runbook_base_url: str = DEFAULT_RUNBOOK_BASE_URL) -> str:
    """Text of alerts.yaml."""
    return to_yaml(rule_groups(runbook_base_url), _HEADER)


def render_tests(runbook_base_url: str = DEFAULT_RUNBOOK_BASE_URL) -> str:
    """Text of alerts_test.yaml (promtool test rules alerts_test.yaml, run from this folder)."""
    return to_yaml(test_document(runbook_base_url), _HEADER)
