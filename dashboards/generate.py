"""Grafana dashboards generated from the metric catalog, one function per dashboard.

Every metric name in a query comes from gpudiag/catalog.py (``catalog.get``)
or, for the two golden signals other exporters measure, from
dashboards/external_metrics.py. Each panel's unit comes from its catalog
entry and its description from the catalog's help text plus what the panel
shows; each dashboard carries the template variables ``datasource``,
``node``, ``gpu``, ``process`` and ``runbook_base`` (where runbook links
point; set at export).

The output is plain dicts in Grafana's dashboard JSON model (schemaVersion
41, Grafana 12). grafana-foundation-sdk is on PyPI, but its builders would
become a runtime dependency of ``gpudiag dashboards export`` on every node
for what is a small, stable JSON model; plain dicts keep the generated files
byte-stable (the tests compare them with the committed ones) and need
nothing beyond the standard library.
"""

from __future__ import annotations

import json
from pathlib import Path

from gpudiag import catalog
from gpudiag.analyzers.registry import ANALYZERS
from gpudiag.findings import alert_name

from . import alerts, engine_rules
from . import external_metrics as ext
from .alerts import DEFAULT_RUNBOOK_BASE_URL

SCHEMA_VERSION = 41
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
RATE = "$__rate_interval"

# Catalog units -> Grafana unit ids.
_UNITS = {
    "bytes": "bytes",
    "ratio": "percentunit",
    "celsius": "celsius",
    "watts": "watt",
    "hertz": "hertz",
    "seconds": "s",
    "bytes_per_second": "Bps",
    "": "short",
}
# The template variable that filters each catalog label.
_FILTERS = (("node", "$node"), ("gpu", "$gpu"), ("process", "$process"))


def name(column: str) -> str:
    """The name a query reads for a catalog column: the recorded ``gpudiag:<column>`` where engine_rules.yaml
    normalises every engine dialect into it, the exported name otherwise (engine_rules.query_name)."""
    return engine_rules.query_name(column)


def unit(column: str, rate: bool = False) -> str:
    """The Grafana unit of a catalog column; a per-second rate of a unitless counter is ops/s."""
    u = catalog.get(column).unit
    if rate:
        return {"": "ops", "seconds": "percentunit", "bytes": "Bps"}.get(u, _UNITS.get(u, "short"))
    return _UNITS.get(u, "short")


def sel(column: str, extra: str = "", suffix: str = "") -> str:
    """``name{label filters}`` for a catalog column: filters for the labels the metric carries."""
    labels = catalog.get(column).labels
    matchers = [f'{label}=~"{var}"' for label, var in _FILTERS if label in labels]
    if extra:
        matchers.append(extra)
    return f"{name(column)}{suffix}{{{', '.join(matchers)}}}"


def help_of(column: str) -> str:
    """The catalog help text, with the name the panel reads (and, for a recorded name, vLLM's)."""
    m = catalog.get(column)
    if engine_rules.is_recorded(column):
        return f"{name(column)} ({m.name} or any engine's equivalent, recorded by {engine_rules.RULES_FILE}): {m.help}"
    return f"{m.name}: {m.help}"


def target(expr: str, legend: str = "", ref: str = "A", fmt: str = "time_series", instant: bool = False) -> dict:
    """One Prometheus query of a panel."""
    t = {"datasource": DATASOURCE, "expr": expr, "legendFormat": legend or "__auto", "refId": ref,
         "range": not instant, "instant": instant}
    if fmt != "time_series":
        t["format"] = fmt
    return t


class _Board:
    """Lays out panels 12 columns wide, two per row, and builds the dashboard dict."""

    def __init__(self, uid: str, title: str, description: str, tags: list[str]):
        self.uid, self.title, self.description, self.tags = uid, title, description, tags
        self.panels: list[dict] = []
        self._x = self._y = 0

    def row(self, title: str) -> None:
        """A collapsed=False row header across the full width."""
        if self._x:
            self._x, self._y = 0, self._y + 8
        self.panels.append({"type": "row", "title": title, "collapsed": False, "id": len(self.panels) + 1,
                            "gridPos": {"h": 1, "w": 24, "x": 0, "y": self._y}, "panels": []})
        self._y += 1

    def panel(self, title: str, description: str, unit_id: str, targets: list[dict], kind: str = "timeseries",
              width: int = 12, options: dict | None = None, field_config: dict | None = None) -> None:
        """Add one panel; ``targets`` get refIds A, B, C... in order."""
        if self._x + width > 24:
            self._x, self._y = 0, self._y + 8
        for i, t in enumerate(targets):
            t["refId"] = chr(ord("A") + i)
        defaults = {"unit": unit_id}
        defaults.update((field_config or {}).get("defaults", {}))
        p = {
            "id": len(self.panels) + 1,
            "type": kind,
            "title": title,
            "description": description,
            "datasource": DATASOURCE,
            "gridPos": {"h": 8, "w": width, "x": self._x, "y": self._y},
            "fieldConfig": {"defaults": defaults, "overrides": (field_config or {}).get("overrides", [])},
            "options": options or {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                                   "tooltip": {"mode": "multi", "sort": "desc"}},
            "targets": targets,
        }
        self.panels.append(p)
        self._x += width
        if self._x >= 24:
            self._x, self._y = 0, self._y + 8

    def build(self, runbook_base_url: str) -> dict:
        """The dashboard JSON model."""
        return {
            "uid": self.uid,
            "title": self.title,
            "description": self.description,
            "tags": ["gpudiag", *self.tags],
            "editable": True,
            "graphTooltip": 1,
            "refresh": "30s",
            "schemaVersion": SCHEMA_VERSION,
            "time": {"from": "now-3h", "to": "now"},
            "timepicker": {},
            "timezone": "browser",
            "version": 1,
            "fiscalYearStartMonth": 0,
            "liveNow": False,
            "weekStart": "",
            "annotations": {"list": [{
                "builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"}, "enable": True,
                "hide": True, "iconColor": "rgba(0, 211, 255, 1)", "name": "Annotations & Alerts",
                "type": "dashboard"}]},
            "links": [{"title": "gpudiag dashboards", "type": "dashboards", "tags": ["gpudiag"], "asDropdown": True,
                       "includeVars": True, "keepTime": True}],
            "templating": {"list": _variables(runbook_base_url)},
            "panels": self.panels,
        }


def _query_var(var: str, label: str, query: str, description: str) -> dict:
    return {"name": var, "label": label, "type": "query", "datasource": DATASOURCE, "description": description,
            "query": {"query": query, "refId": "PrometheusVariableQueryEditor-VariableQuery", "qryType": 1},
            "definition": query, "refresh": 2, "includeAll": True, "multi": True, "allValue": ".*",
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]}, "sort": 1, "regex": "",
            "hide": 0, "options": []}


def _variables(runbook_base_url: str) -> list[dict]:
    util = name(catalog.M.gpu_utilization_ratio)
    mem = name(catalog.M.process_gpu_memory_bytes)
    return [
        {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus",
         "current": {}, "hide": 0, "regex": "", "options": [], "refresh": 1},
        _query_var("node", "Node", f"label_values({util}, node)", "Nodes the gpudiag agent reports."),
        _query_var("gpu", "GPU", f'label_values({util}{{node=~"$node"}}, gpu)', "GPU indices on the nodes."),
        _query_var("process", "Process", f'label_values({mem}{{node=~"$node", gpu=~"$gpu"}}, process)',
                   "Processes holding memory on the GPUs."),
        {"name": "runbook_base", "label": "Runbook base URL", "type": "constant", "hide": 2,
         "query": runbook_base_url, "current": {"text": runbook_base_url, "value": runbook_base_url},
         "description": "Where runbooks/<AlertName>.md are served (set by gpudiag dashboards export)."},
    ]


def _by(*labels: str) -> str:
    return f"by ({', '.join(labels)})"


def _rate(column: str, by: str, extra: str = "") -> str:
    return f"sum {by} (rate({sel(column, extra)}[{RATE}]))"


def _increase(column: str, by: str, window: str = "5m") -> str:
    return f"sum {by} (increase({sel(column)}[{window}]))"


M = catalog.M
BY_GPU = _by("node", "gpu")
BY_PROC = _by("node", "gpu", "pid", "process")
# The recorded engine series: an engine that names neither node nor GPU (SGLang, TensorRT-LLM...) is its
# scrape target.
BY_ENGINE = _by("node", "gpu", "instance")
ENGINE_LEGEND = "{{node}} gpu{{gpu}} {{instance}}"


def _hit_ratio() -> str:
    """Prefix-cache hits over lookups per engine (the alert GpudiagKvCacheHitRatioLow's ratio)."""
    return f"{_rate(M.prefix_cache_hits_total, BY_ENGINE)} / {_rate(M.prefix_cache_queries_total, BY_ENGINE)}"


def node_gpu_wall(runbook_base_url: str = DEFAULT_RUNBOOK_BASE_URL) -> dict:
    """Per-GPU utilization, clocks, memory, power, temperature, PCIe, NVLink/ECC errors, throttling, XID."""
    b = _Board("gpudiag-node-gpu-wall", "gpudiag / Node GPU wall",
               "Every GPU of the selected nodes as NVML sees it. NVML counters can be wrong under MIG or vGPU "
               "(see gpudiag_gpu_info's mig_mode and virtualization_mode).", ["gpu"])
    b.row("Load")
    b.panel("GPU utilization", help_of(M.gpu_utilization_ratio), unit(M.gpu_utilization_ratio),
            [target(sel(M.gpu_utilization_ratio), "{{node}} gpu{{gpu}}")],
            field_config={"defaults": {"min": 0, "max": 1}})
    b.panel("Memory-controller utilization", help_of(M.gpu_memory_utilization_ratio),
            unit(M.gpu_memory_utilization_ratio),
            [target(sel(M.gpu_memory_utilization_ratio), "{{node}} gpu{{gpu}}")],
            field_config={"defaults": {"min": 0, "max": 1}})
    b.panel("SM clock vs max", "Current SM clock against the maximum; a gap under load means throttling. "
            + help_of(M.gpu_sm_clock_hertz), unit(M.gpu_sm_clock_hertz),
            [target(sel(M.gpu_sm_clock_hertz), "{{node}} gpu{{gpu}} sm"),
             target(sel(M.gpu_sm_clock_max_hertz), "{{node}} gpu{{gpu}} max")])
    b.panel("Device memory used / total", help_of(M.gpu_memory_used_bytes), unit(M.gpu_memory_used_bytes),
            [target(sel(M.gpu_memory_used_bytes), "{{node}} gpu{{gpu}} used"),
             target(sel(M.gpu_memory_total_bytes), "{{node}} gpu{{gpu}} total")])
    b.row("Power and heat")
    b.panel("Power vs limit", help_of(M.gpu_power_watts), unit(M.gpu_power_watts),
            [target(sel(M.gpu_power_watts), "{{node}} gpu{{gpu}}"),
             target(sel(M.gpu_power_limit_watts), "{{node}} gpu{{gpu}} limit")])
    b.panel("Temperature", "Core and HBM temperature; the infra golden signal alerts above 85 °C. "
            + help_of(M.gpu_temperature_celsius), unit(M.gpu_temperature_celsius),
            [target(sel(M.gpu_temperature_celsius), "{{node}} gpu{{gpu}} core"),
             target(sel(M.gpu_memory_temperature_celsius), "{{node}} gpu{{gpu}} hbm")])
    b.panel("Throttle reasons", "Active clock throttle reasons (1 = active). "
            + help_of(M.gpu_clock_throttle_active), unit(M.gpu_clock_throttle_active),
            [target(f"max {_by('node', 'gpu', 'reason')} ({sel(M.gpu_clock_throttle_active)}) == 1",
                    "{{node}} gpu{{gpu}} {{reason}}")])
    b.panel("Performance state", help_of(M.gpu_performance_state), unit(M.gpu_performance_state),
            [target(sel(M.gpu_performance_state), "{{node}} gpu{{gpu}}")])
    b.row("Links and errors")
    b.panel("PCIe throughput", help_of(M.gpu_pcie_tx_bytes_per_second), unit(M.gpu_pcie_tx_bytes_per_second),
            [target(sel(M.gpu_pcie_tx_bytes_per_second), "{{node}} gpu{{gpu}} tx"),
             target(sel(M.gpu_pcie_rx_bytes_per_second), "{{node}} gpu{{gpu}} rx")])
    b.panel("PCIe replays (5 min)", "Link-level retransmissions; rising replays with P99 up and P50 normal point "
            "at the link. " + help_of(M.gpu_pcie_replay_total), unit(M.gpu_pcie_replay_total),
            [target(_increase(M.gpu_pcie_replay_total, BY_GPU), "{{node}} gpu{{gpu}}")])
    b.panel("NVLink errors (5 min)", help_of(M.gpu_nvlink_errors_total), unit(M.gpu_nvlink_errors_total),
            [target(_increase(M.gpu_nvlink_errors_total, _by("node", "gpu", "kind")),
                    "{{node}} gpu{{gpu}} {{kind}}")])
    b.panel("ECC errors (5 min)", "Uncorrected errors are critical. " + help_of(M.gpu_ecc_errors_total),
            unit(M.gpu_ecc_errors_total),
            [target(_increase(M.gpu_ecc_errors_total, _by("node", "gpu", "scope", "kind")),
                    "{{node}} gpu{{gpu}} {{scope}} {{kind}}")])
    b.panel("XID errors (5 min)", help_of(M.gpu_xid_errors_total), unit(M.gpu_xid_errors_total),
            [target(_increase(M.gpu_xid_errors_total, _by("node", "gpu", "xid")), "{{node}} gpu{{gpu}} xid {{xid}}")])
    b.panel("Retired pages and remapped rows", help_of(M.gpu_remapped_rows_total), unit(M.gpu_remapped_rows_total),
            [target(f"sum {BY_GPU} ({sel(M.gpu_retired_pages_total)})", "{{node}} gpu{{gpu}} retired pages"),
             target(f"sum {BY_GPU} ({sel(M.gpu_remapped_rows_total)})", "{{node}} gpu{{gpu}} remapped rows")])
    return b.build(runbook_base_url)


def memory(runbook_base_url: str = DEFAULT_RUNBOOK_BASE_URL) -> dict:
    """The three colours per process, the gaps between them, fragmentation and the time-to-OOM forecast."""
    b = _Board("gpudiag-memory", "gpudiag / Memory",
               "Per process and GPU, nested layers: white = allocated (live tensors), grey = reserved (caching "
               "allocator), black = driver-charged. Gaps carry the diagnosis: grey - white growing with flat white "
               "is pool bloat or fragmentation; black - grey growing with flat grey is a leak outside PyTorch.",
               ["memory"])
    b.row("Three colours")
    colours = {"overrides": [
        {"matcher": {"id": "byFrameRefID", "options": "A"},
         "properties": [{"id": "color", "value": {"mode": "fixed", "fixedColor": "#f2f2f2"}}]},
        {"matcher": {"id": "byFrameRefID", "options": "B"},
         "properties": [{"id": "color", "value": {"mode": "fixed", "fixedColor": "#8c8c8c"}}]},
        {"matcher": {"id": "byFrameRefID", "options": "C"},
         "properties": [{"id": "color", "value": {"mode": "fixed", "fixedColor": "#262626"}}]}]}
    b.panel("White / grey / black per process",
            "White: " + help_of(M.process_torch_allocated_bytes) + " Grey: " + help_of(M.process_torch_reserved_bytes)
            + " Black: " + help_of(M.process_gpu_memory_bytes),
            unit(M.process_gpu_memory_bytes),
            [target(sel(M.process_torch_allocated_bytes), "{{process}} ({{pid}}) gpu{{gpu}} white"),
             target(sel(M.process_torch_reserved_bytes), "{{process}} ({{pid}}) gpu{{gpu}} grey"),
             target(sel(M.process_gpu_memory_bytes), "{{process}} ({{pid}}) gpu{{gpu}} black")],
            width=24, field_config=colours)
    b.panel("Gap: grey - white", help_of(M.process_reserved_minus_allocated_bytes),
            unit(M.process_reserved_minus_allocated_bytes),
            [target(sel(M.process_reserved_minus_allocated_bytes), "{{process}} ({{pid}}) gpu{{gpu}}")])
    b.panel("Gap: black - grey", help_of(M.process_driver_minus_reserved_bytes),
            unit(M.process_driver_minus_reserved_bytes),
            [target(sel(M.process_driver_minus_reserved_bytes), "{{process}} ({{pid}}) gpu{{gpu}}")])
    b.panel("Layer trends", "Least-squares slopes of each layer over the tracker's window. "
            + help_of(M.process_torch_reserved_growth_bytes_per_second),
            unit(M.process_torch_reserved_growth_bytes_per_second),
            [target(sel(M.process_torch_allocated_growth_bytes_per_second), "{{process}} gpu{{gpu}} white"),
             target(sel(M.process_torch_reserved_growth_bytes_per_second), "{{process}} gpu{{gpu}} grey"),
             target(sel(M.process_gpu_memory_growth_bytes_per_second), "{{process}} gpu{{gpu}} black")])
    b.row("Fragmentation and OOM")
    b.panel("External fragmentation", help_of(M.process_torch_external_fragmentation_ratio),
            unit(M.process_torch_external_fragmentation_ratio),
            [target(sel(M.process_torch_external_fragmentation_ratio), "{{process}} ({{pid}}) gpu{{gpu}}")],
            field_config={"defaults": {"min": 0, "max": 1}})
    b.panel("Largest free block vs inactive split", help_of(M.process_torch_largest_free_block_bytes),
            unit(M.process_torch_largest_free_block_bytes),
            [target(sel(M.process_torch_largest_free_block_bytes), "{{process}} gpu{{gpu}} largest free block"),
             target(sel(M.process_torch_inactive_split_bytes), "{{process}} gpu{{gpu}} inactive split")])
    headroom = (f"(max {_by('node', 'gpu', 'uuid')} ({sel(M.gpu_memory_total_bytes)}) - "
                f"max {_by('node', 'gpu', 'uuid')} ({sel(M.gpu_memory_used_bytes)}))")
    on_gpu = "on (node, gpu, uuid) group_right ()"  # "group_right (x)" would parse x as labels
    b.panel("Time to OOM (forecast)",
            "Device headroom (total - used) divided by the process's growth: the grey layer's slope where an "
            "in-process reporter gives it, the black layer's otherwise. Empty while nothing grows. "
            + help_of(M.process_gpu_memory_growth_bytes_per_second), _UNITS["seconds"],
            [target(f"{headroom} / {on_gpu} ({sel(M.process_torch_reserved_growth_bytes_per_second)} > 0)",
                    "{{process}} ({{pid}}) gpu{{gpu}} grey"),
             target(f"{headroom} / {on_gpu} ({sel(M.process_gpu_memory_growth_bytes_per_second)} > 0)",
                    "{{process}} ({{pid}}) gpu{{gpu}} black")])
    b.panel("Allocator retries and OOMs (5 min)", help_of(M.process_torch_alloc_retries_total),
            unit(M.process_torch_alloc_retries_total),
            [target(_increase(M.process_torch_alloc_retries_total, BY_PROC), "{{process}} gpu{{gpu}} retries"),
             target(_increase(M.process_torch_ooms_total, BY_PROC), "{{process}} gpu{{gpu}} OOMs")])
    return b.build(runbook_base_url)


def engine_kv(runbook_base_url: str = DEFAULT_RUNBOOK_BASE_URL) -> dict:
    """Queue, batch size, KV usage, evictions and preemptions, recompute share, prefix-cache hit rate."""
    b = _Board("gpudiag-engine-kv", "gpudiag / Engine and KV cache",
               "The serving engine's view: every engine dialect's series as engine_rules.yaml records them "
               "(gpudiag:*), and gpudiag's own engine metrics. Storm chain: "
               "fragmentation -> KV allocation failure -> eviction -> recompute -> utilization oscillation -> "
               "decode latency.", ["engine", "kv"])
    b.row("Scheduling")
    b.panel("Requests running / waiting", help_of(M.num_requests_waiting), unit(M.num_requests_waiting),
            [target(sel(M.num_requests_running), f"{ENGINE_LEGEND} running"),
             target(sel(M.num_requests_waiting), f"{ENGINE_LEGEND} waiting")])
    b.panel("Batch size", help_of(M.engine_batch_size), unit(M.engine_batch_size),
            [target(sel(M.engine_batch_size), "{{node}} gpu{{gpu}}")])
    b.row("KV cache")
    b.panel("KV cache usage", help_of(M.kv_cache_usage_perc), unit(M.kv_cache_usage_perc),
            [target(sel(M.kv_cache_usage_perc), ENGINE_LEGEND)],
            field_config={"defaults": {"min": 0, "max": 1}})
    b.panel("KV bytes used / reserved / capacity", help_of(M.engine_kv_reserved_bytes), unit(M.engine_kv_used_bytes),
            [target(sel(M.engine_kv_used_bytes), "{{node}} gpu{{gpu}} used"),
             target(sel(M.engine_kv_reserved_bytes), "{{node}} gpu{{gpu}} reserved"),
             target(sel(M.engine_kv_capacity_bytes), "{{node}} gpu{{gpu}} capacity")])
    b.panel("Evictions and preemptions per second", help_of(M.engine_kv_evictions_total),
            unit(M.engine_kv_evictions_total, rate=True),
            [target(_rate(M.engine_kv_evictions_total, BY_GPU), "{{node}} gpu{{gpu}} evictions"),
             target(_rate(M.num_preemptions_total, BY_ENGINE), f"{ENGINE_LEGEND} preemptions"),
             target(_rate(M.engine_kv_alloc_failures_total, BY_GPU), "{{node}} gpu{{gpu}} KV alloc failures")])
    b.panel("Recompute share", "Tokens prefilled again after an eviction over all prefilled tokens. "
            + help_of(M.engine_recomputed_tokens_total), unit(M.kv_cache_usage_perc),
            [target(f"{_rate(M.engine_recomputed_tokens_total, BY_GPU)} / {_rate(M.prompt_tokens_total, BY_GPU)}",
                    "{{node}} gpu{{gpu}}")], field_config={"defaults": {"min": 0, "max": 1}})
    b.panel("Prefix-cache hit rate", "Prompt tokens found in the prefix cache over those looked up; the infra "
            "golden signal alerts below 0.7. " + help_of(M.prefix_cache_hits_total), unit(M.kv_cache_usage_perc),
            [target(_hit_ratio(), ENGINE_LEGEND)], field_config={"defaults": {"min": 0, "max": 1}})
    b.panel("Largest failed KV allocation", help_of(M.engine_kv_failed_request_bytes),
            unit(M.engine_kv_failed_request_bytes),
            [target(sel(M.engine_kv_failed_request_bytes), "{{node}} gpu{{gpu}}")])
    b.row("Traffic")
    b.panel("Tokens per second", help_of(M.generation_tokens_total), unit(M.generation_tokens_total, rate=True),
            [target(_rate(M.prompt_tokens_total, BY_ENGINE), f"{ENGINE_LEGEND} prefill"),
             target(_rate(M.generation_tokens_total, BY_ENGINE), f"{ENGINE_LEGEND} generated")])
    b.panel("Requests per second", help_of(M.engine_requests_arrived_total),
            unit(M.engine_requests_arrived_total, rate=True),
            [target(_rate(M.engine_requests_arrived_total, BY_GPU), "{{node}} gpu{{gpu}} arrived"),
             target(_rate(M.engine_requests_finished_total, BY_GPU), "{{node}} gpu{{gpu}} finished"),
             target(_rate(M.engine_requests_rejected_total, BY_GPU), "{{node}} gpu{{gpu}} rejected (429)")])
    return b.build(runbook_base_url)


QUANTILES = (0.5, 0.99, 0.999)


def _quantile_targets(column: str, by: tuple[str, ...] = ("node", "gpu"),
                      legend: str = "{{node}} gpu{{gpu}}") -> list[dict]:
    bucket = f"sum {_by('le', *by)} (rate({sel(column, suffix='_bucket')}[{RATE}]))"
    return [target(f"histogram_quantile({q}, {bucket})", f"{legend} P{q * 100:g}") for q in QUANTILES]


def _context_buckets_text() -> str:
    return ", ".join(catalog.CONTEXT_BUCKETS)


def service(runbook_base_url: str = DEFAULT_RUNBOOK_BASE_URL) -> dict:
    """TTFT, inter-token and end-to-end latency at P50, P99 and P99.9, queue time, and latency by context length."""
    b = _Board("gpudiag-service", "gpudiag / Service latency",
               "What users feel. P99 up with P50 normal points at stragglers or communication (NVLink, PCIe, "
               "clocks, temperature); everything slower points at load, throttling or memory pressure. Latency by "
               "context length (prompt + output tokens, buckets " + _context_buckets_text() + ") comes from "
               "gpudiag's own request histograms, which the agent fills from every finished request it sees (the "
               "reference engine, --sim); vLLM's histograms carry no context length, so behind a vLLM those panels "
               "stay empty.", ["service", "latency"])
    b.row("All requests")
    for title, column in (("Time to first token", M.time_to_first_token_seconds),
                          ("Inter-token latency", M.inter_token_latency_seconds),
                          ("End-to-end latency", M.e2e_request_latency_seconds),
                          ("Queue time", M.request_queue_time_seconds),
                          ("Prefill time", M.request_prefill_time_seconds)):
        b.panel(f"{title} P50 / P99 / P99.9", help_of(column), unit(column),
                _quantile_targets(column, ("node", "gpu", "instance"), ENGINE_LEGEND))
    b.panel("Latency distribution (inter-token)", "Heatmap of the inter-token latency histogram. "
            + help_of(M.inter_token_latency_seconds), unit(M.inter_token_latency_seconds),
            [target(f"sum by (le) (rate({sel(M.inter_token_latency_seconds, suffix='_bucket')}[{RATE}]))",
                    "{{le}}", fmt="heatmap")],
            kind="heatmap", width=24, options=_heatmap_options())
    b.row("By context length (prompt + output tokens)")
    by_context = "Over the selected nodes and GPUs, one line per context bucket and quantile. "
    for title, column in (("Time to first token", M.request_time_to_first_token_seconds),
                          ("Inter-token latency", M.request_inter_token_latency_seconds),
                          ("End-to-end latency", M.request_e2e_latency_seconds)):
        b.panel(f"{title} by context length P50 / P99 / P99.9", by_context + help_of(column), unit(column),
                _quantile_targets(column, ("context_bucket",), "{{context_bucket}}"))
    b.panel("Finished requests per second by context length", "The traffic mix behind the latencies above: a "
            "slow bucket that carries a small share of the requests is a few long requests, not the whole service. "
            + help_of(M.request_e2e_latency_seconds),
            unit(M.engine_requests_finished_total, rate=True),
            [target(f"sum by (context_bucket) (rate({sel(M.request_e2e_latency_seconds, suffix='_count')}[{RATE}]))",
                    "{{context_bucket}}")])
    return b.build(runbook_base_url)


def _heatmap_options() -> dict:
    return {"calculate": False, "yAxis": {"unit": "s"}, "cellGap": 1, "color": {"mode": "scheme",
            "scheme": "Oranges", "exponent": 0.5, "steps": 64, "fill": "dark-orange", "reverse": False},
            "tooltip": {"mode": "single", "yHistogram": True}, "legend": {"show": True},
            "rowsFrame": {"layout": "auto"}}


def infra_health(runbook_base_url: str = DEFAULT_RUNBOOK_BASE_URL) -> dict:
    """The five golden signals: GPU utilization, KV hit ratio, GPU temperature, disk IO wait, pods Pending."""
    b = _Board("gpudiag-infra-health", "gpudiag / Infra health",
               "The five golden signals of an inference fleet, each with its alert threshold.", ["infra"])
    thresholds = {"mode": "absolute"}

    def steps(value: float, below: bool = False) -> dict:
        good, bad = ("red", "green") if below else ("green", "red")
        return {"defaults": {"thresholds": {**thresholds, "steps": [{"color": good, "value": None},
                                                                     {"color": bad, "value": value}]},
                             "custom": {"thresholdsStyle": {"mode": "line"}}}}

    b.panel("GPU utilization (alert > 95 % for 5 min)", help_of(M.gpu_utilization_ratio), unit(M.gpu_utilization_ratio),
            [target(sel(M.gpu_utilization_ratio), "{{node}} gpu{{gpu}}")], field_config=steps(0.95))
    b.panel("Prefix-cache hit ratio (alert < 0.7)", help_of(M.prefix_cache_hits_total), unit(M.kv_cache_usage_perc),
            [target(_hit_ratio(), ENGINE_LEGEND)], field_config=steps(0.7, below=True))
    b.panel("GPU temperature (alert > 85 °C)", help_of(M.gpu_temperature_celsius), unit(M.gpu_temperature_celsius),
            [target(sel(M.gpu_temperature_celsius), "{{node}} gpu{{gpu}}")], field_config=steps(85))
    b.panel("Disk IO wait", f"{ext.NODE_CPU_SECONDS_TOTAL}{{mode=\"iowait\"}} from node_exporter: share of CPU time "
            "idle while a disk request was pending, averaged over the node's CPUs (weights loading from a slow "
            "disk, a full page cache).", "percentunit",
            [target(f'avg by (instance) (rate({ext.NODE_CPU_SECONDS_TOTAL}{{mode="iowait"}}[{RATE}]))',
                    "{{instance}}")], field_config=steps(0.1))
    b.panel("Pods Pending", f"{ext.KUBE_POD_STATUS_PHASE}{{phase=\"Pending\"}} from kube-state-metrics: pods "
            "that no node can take (GPU requests unschedulable, images not pulled).", "short",
            [target(f'sum by (namespace) ({ext.KUBE_POD_STATUS_PHASE}{{phase="Pending"}})', "{{namespace}}")],
            field_config=steps(1))
    return b.build(runbook_base_url)


def cuda_api(runbook_base_url: str = DEFAULT_RUNBOOK_BASE_URL) -> dict:
    """CUDA API calls, errors and latency heatmaps from the eBPF probes' log2 histograms."""
    b = _Board("gpudiag-cuda-api", "gpudiag / CUDA API",
               "The CUDA runtime and driver API as eBPF uprobes see it (needs root or CAP_BPF+CAP_PERFMON; "
               "gpudiag doctor --feature ebpf says whether the node has it). Launch APIs are probed on demand "
               "or time-sliced.", ["cuda", "ebpf"])
    by_api = _by("node", "process", "api")
    b.panel("Calls per second", help_of(M.cuda_api_calls_total), unit(M.cuda_api_calls_total, rate=True),
            [target(_rate(M.cuda_api_calls_total, by_api), "{{process}} {{api}}")])
    b.panel("Errors per second", help_of(M.cuda_api_errors_total), unit(M.cuda_api_errors_total, rate=True),
            [target(_rate(M.cuda_api_errors_total, _by("node", "process", "api", "code")),
                    "{{process}} {{api}} code {{code}}")])
    b.panel("Bytes per second", help_of(M.cuda_api_bytes_total), unit(M.cuda_api_bytes_total, rate=True),
            [target(_rate(M.cuda_api_bytes_total, by_api), "{{process}} {{api}}")])
    b.panel("Outstanding device allocations", help_of(M.cuda_outstanding_allocation_bytes),
            unit(M.cuda_outstanding_allocation_bytes),
            [target(sel(M.cuda_outstanding_allocation_bytes), "{{process}} ({{pid}})")])
    b.panel("API latency heatmap", help_of(M.cuda_api_latency_seconds), unit(M.cuda_api_latency_seconds),
            [target(f"sum by (le) (rate({sel(M.cuda_api_latency_seconds, suffix='_bucket')}[{RATE}]))", "{{le}}",
                    fmt="heatmap")], kind="heatmap", width=24, options=_heatmap_options())
    b.panel("API latency P99 by API", help_of(M.cuda_api_latency_seconds), unit(M.cuda_api_latency_seconds),
            [target(f"histogram_quantile(0.99, sum by (le, api) "
                    f"(rate({sel(M.cuda_api_latency_seconds, suffix='_bucket')}[{RATE}])))", "{{api}}")])
    b.panel("Kernel launches and grid (1,1,1) launches", help_of(M.cuda_degenerate_launches_total),
            unit(M.cuda_kernel_launches_total, rate=True),
            [target(_rate(M.cuda_kernel_launches_total, _by("node", "process")), "{{process}} launches"),
             target(_rate(M.cuda_degenerate_launches_total, _by("node", "process")), "{{process}} grid (1,1,1)")])
    b.panel("Host run-queue wait", "Share of wall time a GPU process's threads were runnable but not running. "
            + help_of(M.host_runqueue_wait_seconds_total), unit(M.host_runqueue_wait_seconds_total, rate=True),
            [target(_rate(M.host_runqueue_wait_seconds_total, _by("node", "process")), "{{process}}")])
    return b.build(runbook_base_url)


def _finding_with_alertname() -> str:
    """Active findings with an ``alertname`` label naming their runbook (one label_replace per kind)."""
    parts = [f'label_replace({sel(M.finding_active, f"kind={json.dumps(kind)}")} == 1, "alertname", '
             f'"{alert_name(kind)}", "", "")' for kind in ANALYZERS]
    return " or ".join(parts)


def findings(runbook_base_url: str = DEFAULT_RUNBOOK_BASE_URL) -> dict:
    """Active findings and firing alerts, each row linking to its runbook."""
    b = _Board("gpudiag-findings", "gpudiag / Findings",
               "What the agent's streaming analyzers concluded. Each row links to the runbook; offline, "
               "`gpudiag runbook <AlertName>` prints the same page.", ["findings"])
    link = {"title": "Runbook ${__data.fields.alertname}",
            "url": "${runbook_base}/runbooks/${__data.fields.alertname}.md",
            "targetBlank": True}
    table_fc = {"defaults": {"links": [link]}, "overrides": [{"matcher": {"id": "byName", "options": "Value"},
                                                               "properties": [{"id": "custom.hidden", "value": True}]}]}
    table_opts = {"showHeader": True, "cellHeight": "sm", "footer": {"show": False}}
    b.panel("Active findings", help_of(M.finding_active), unit(M.finding_active),
            [target(_finding_with_alertname(), fmt="table", instant=True)], kind="table", width=24,
            options=table_opts, field_config=table_fc)
    b.panel("Firing gpudiag alerts", "Prometheus's ALERTS series for the gpudiag rules (dashboards/alerts.yaml).",
            "short", [target(f'{ext.PROMETHEUS_ALERTS}{{alertname=~"Gpudiag.*", alertstate="firing"}}', fmt="table",
                             instant=True)], kind="table", width=24, options=table_opts, field_config=table_fc)
    b.panel("Findings over time", help_of(M.finding_active), unit(M.finding_active),
            [target(f"sum {_by('kind', 'severity')} ({sel(M.finding_active)})", "{{kind}} ({{severity}})")])
    b.panel("Findings opened (1 h)", help_of(M.agent_findings_opened_total), unit(M.agent_findings_opened_total),
            [target(f"sum {_by('node', 'kind')} (increase({sel(M.agent_findings_opened_total)}[1h]))",
                    "{{node}} {{kind}}")])
    return b.build(runbook_base_url)


DASHBOARDS = {
    "node-gpu-wall": node_gpu_wall,
    "memory": memory,
    "engine-kv": engine_kv,
    "service": service,
    "infra-health": infra_health,
    "cuda-api": cuda_api,
    "findings": findings,
}


def dump_json(obj) -> str:
    """The committed text of a generated JSON document (sorted keys, two-space indent, final newline)."""
    return json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def render_all(runbook_base_url: str = DEFAULT_RUNBOOK_BASE_URL) -> dict[str, str]:
    """File name -> text of every generated file of this folder (dashboards, alert rules, their tests)."""
    out = {f"{key}.json": dump_json(fn(runbook_base_url)) for key, fn in DASHBOARDS.items()}
    out["alerts.yaml"] = alerts.render_rules(runbook_base_url)
    out["alerts_test.yaml"] = alerts.render_tests(runbook_base_url)
    out[engine_rules.RULES_FILE] = engine_rules.render_rules()
    out[engine_rules.TESTS_FILE] = engine_rules.render_tests()
    return out


def folder() -> Path:
    """The folder the generated files are committed in (this package's)."""
    return Path(__file__).resolve().parent


def stale_files(directory: Path | None = None) -> list[str]:
    """Generated files that differ from (or are missing in) ``directory``; empty when up to date."""
    directory = directory or folder()
    stale = []
    for fname, text in render_all().items():
        path = directory / fname
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            stale.append(fname)
    return stale


def write_all(directory: Path | None = None, runbook_base_url: str = DEFAULT_RUNBOOK_BASE_URL) -> list[Path]:
    """Write every generated file into ``directory``; returns the paths written."""
    directory = directory or folder()
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for fname, text in render_all(runbook_base_url).items():
        path = directory / fname
        path.write_text(text, encoding="utf-8")
        written.append(path)
    return written


if __name__ == "__main__":  # pragma: no cover
    for p in write_all():
        print(p)
