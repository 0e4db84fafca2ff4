"""Prometheus as the source of an investigation: range queries rebuilt into the frames the analyzers take.

``gpudiag investigate --prometheus URL`` reads the window through Prometheus'
HTTP API (``/api/v1/query_range``; Thanos and Mimir answer the same API)
instead of the agent's store, and hands the analyzers a
:class:`~gpudiag.frames.Window` of the same shape: one row per entity (GPU,
process, engine, node, CUDA API) per step, columns named after the catalog.

Four kinds of exporters are understood:

* gpudiag's agent: every catalog metric by its exported name (labels beyond
  the entity's, such as ``reason`` or ``xid``, become the nested dicts the
  probes write);
* vLLM: the catalog's ``vllm:*`` metrics and their older names
  (:data:`gpudiag.probes.engine_scrape.VLLM_ALIASES`); latency histograms
  become per-step interval summaries (count, P50, P90, P99 of the
  ``_bucket`` increase over the step, the quantiles computed as PromQL's
  ``histogram_quantile`` does), the form the analyzers read from a scraped
  engine;
* the other serving engines (SGLang, trtllm-serve, Triton with the TensorRT-LLM backend,
  NIM, llama.cpp, TGI): their names as :mod:`gpudiag.probes.engine_dialects` maps them
  (a label condition such as Triton's ``request_type="waiting"``, a unit factor such as
  Triton's milliseconds); an engine's series that name neither a GPU nor an engine are
  one engine per scrape target (``instance``);
* NVIDIA's dcgm-exporter: the ``DCGM_FI_*`` fields in :data:`FOREIGN`, the
  one table that maps foreign names to catalog columns, with the factor to
  SI units (percent -> ratio, MiB -> bytes, MHz -> hertz).

Where the agent and dcgm-exporter both report a GPU, the agent's values win.

Limits: Prometheus answers at most 11,000 points per series and query, so a
long window is read in several range queries (:func:`plan`); the step is the
spacing of the most often scraped exporter's samples, widened so that no
series holds more than :data:`MAX_POINTS_PER_SERIES` points in the window. A range
that fails (timeout, too many samples) and stretches without samples (a
target down) are listed as gaps; the analyzers run on the rest.

An agent in ``--sim`` mode exports ``gpudiag_agent_sim_seconds``: its
frames are put back on the simulated clock (the analyzers' minute-long
thresholds are engine minutes, and at ``--speed 100`` a simulated minute
passes in 0.6 wall seconds). Time then starts at the node's first sample and
runs at simulated seconds.
"""

from __future__ import annotations

import json
import math
import re
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from gpudiag.catalog import BY_NAME, CATALOG, COUNTER, HISTOGRAM, INFO, METRICS, M
from gpudiag.errors import GpudiagError
from gpudiag.frames import Window, forward_fill

# Prometheus refuses a range query whose result would exceed this many points per series.
PROMETHEUS_MAX_POINTS = 11_000
# The analyzers' shortest windows are a minute: twelve hours of 1 s samples per series,
# or the same count spread over a longer window, keeps every such window populated
# while a 24 h window of a full node stays within a few GB of frames.
MAX_POINTS_PER_SERIES = 43_200
# An explicit --step finer than this many points over the window is a typing error, not a plan.
MAX_POINTS_EXPLICIT = 1_000_000
# Where no exporter's samples show how often it is scraped, the step is the agent's tick.
DEFAULT_STEP_S = 1.0
# A histogram's interval summary spans this many steps (and at least two scrapes),
# so increase() has two samples to subtract even where the step equals the scrape interval.
HISTOGRAM_RANGE_STEPS = 4
# Stretches without samples shorter than this are scrape jitter, not a target down.
GAP_MIN_S = 30.0
GAP_MIN_STEPS = 3
HTTP_TIMEOUT_S = 30.0
MAX_RESPONSE_BYTES = 512 << 20
MIB = 1 << 20


# --- the mapping of foreign names ---------------------------------------------------------------


@dataclass(frozen=True)
class Foreign:
    """One series of another exporter and the catalog column it fills.

    ``scale`` converts to the catalog's SI unit; ``path`` places the value in a
    labelled column's nested dict (``("volatile", "corrected")``); ``decode``
    names a conversion that is more than a factor; ``sum`` adds the series
    into the column instead of replacing it (total memory = used + free + reserved);
    ``anchor`` marks the part without which the sum means nothing: total memory
    is known only at the steps where free memory was exported (used alone is
    not the total, and would make every GPU look full).
    """

    name: str
    column: str
    scale: float = 1.0
    path: tuple[str, ...] = ()
    decode: str | None = None  # "clock_event_bits" | "last_xid"
    sum: bool = False
    exporter: str = "dcgm-exporter"
    anchor: bool = False


_D = Foreign
FOREIGN: tuple[Foreign, ...] = (
    # dcgm-exporter (field names of DCGM; labels gpu, UUID, Hostname). Percent -> ratio,
    # MiB -> bytes, MHz -> hertz; temperatures are celsius and power watts already.
    _D("DCGM_FI_DEV_GPU_UTIL", M.gpu_utilization_ratio, 0.01),
    _D("DCGM_FI_DEV_MEM_COPY_UTIL", M.gpu_memory_utilization_ratio, 0.01),
    _D("DCGM_FI_DEV_FB_USED", M.gpu_memory_used_bytes, MIB),
    _D("DCGM_FI_DEV_FB_USED", M.gpu_memory_total_bytes, MIB, sum=True),
    _D("DCGM_FI_DEV_FB_FREE", M.gpu_memory_total_bytes, MIB, sum=True, anchor=True),
    _D("DCGM_FI_DEV_FB_RESERVED", M.gpu_memory_total_bytes, MIB, sum=True),
    _D("DCGM_FI_DEV_FB_RESERVED", M.gpu_memory_reserved_bytes, MIB),
    _D("DCGM_FI_DEV_SM_CLOCK", M.gpu_sm_clock_hertz, 1e6),
    _D("DCGM_FI_DEV_MAX_SM_CLOCK", M.gpu_sm_clock_max_hertz, 1e6),
    _D("DCGM_FI_DEV_MEM_CLOCK", M.gpu_memory_clock_hertz, 1e6),
    _D("DCGM_FI_DEV_MAX_MEM_CLOCK", M.gpu_memory_clock_max_hertz, 1e6),
    _D("DCGM_FI_DEV_GPU_TEMP", M.gpu_temperature_celsius),
    _D("DCGM_FI_DEV_MEMORY_TEMP", M.gpu_memory_temperature_celsius),
    _D("DCGM_FI_DEV_POWER_USAGE", M.gpu_power_watts),
    _D("DCGM_FI_DEV_POWER_MGMT_LIMIT", M.gpu_power_limit_watts),
    _D("DCGM_FI_DEV_PSTATE", M.gpu_performance_state),
    _D("DCGM_FI_PROF_PCIE_TX_BYTES", M.gpu_pcie_tx_bytes_per_second),
    _D("DCGM_FI_PROF_PCIE_RX_BYTES", M.gpu_pcie_rx_bytes_per_second),
    _D("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", M.gpu_pcie_replay_total),
    # The bitmask NVML calls clock event (formerly throttle) reasons; DCGM renamed the field.
    _D("DCGM_FI_DEV_CLOCKS_EVENT_REASONS", M.gpu_clock_throttle_active, decode="clock_event_bits"),
    _D("DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", M.gpu_clock_throttle_active, decode="clock_event_bits"),
    # A gauge of the last XID seen, not a counter: each change to a code counts one event of it.
    _D("DCGM_FI_DEV_XID_ERRORS", M.gpu_xid_errors_total, decode="last_xid"),
    _D("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", M.gpu_ecc_errors_total, path=("volatile", "corrected")),
    _D("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", M.gpu_ecc_errors_total, path=("volatile", "uncorrected")),
    _D("DCGM_FI_DEV_ECC_SBE_AGG_TOTAL", M.gpu_ecc_errors_total, path=("aggregate", "corrected")),
    _D("DCGM_FI_DEV_ECC_DBE_AGG_TOTAL", M.gpu_ecc_errors_total, path=("aggregate", "uncorrected")),
    _D("DCGM_FI_DEV_RETIRED_SBE", M.gpu_retired_pages_total, path=("multiple_single_bit_ecc",)),
    _D("DCGM_FI_DEV_RETIRED_DBE", M.gpu_retired_pages_total, path=("double_bit_ecc",)),
    _D("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", M.gpu_remapped_rows_total, path=("correctable",)),
    _D("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", M.gpu_remapped_rows_total, path=("uncorrectable",)),
    _D("DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL", M.gpu_nvlink_errors_total, path=("dl_replay",)),
    _D("DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL", M.gpu_nvlink_errors_total, path=("dl_recovery",)),
    _D("DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL", M.gpu_nvlink_errors_total, path=("dl_crc_flit",)),
    _D("DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL", M.gpu_nvlink_errors_total, path=("dl_crc_data",)),
)
# Foreign label names -> the frames' label names (dcgm-exporter spells them its own way).
FOREIGN_LABELS = {"UUID": "uuid", "Hostname": "node",
                  # dcgm-exporter's older pod label names (its --use-old-namespace)
                  "pod_name": "pod", "pod_namespace": "namespace", "container_name": "container"}
# Where a series names its node, in order: the agent's label, dcgm-exporter's, the scrape target's host.
NODE_LABELS = ("node", "Hostname", "instance")


def _vllm_aliases() -> dict[str, str]:
    from gpudiag.probes.engine_scrape import VLLM_ALIASES

    return dict(VLLM_ALIASES)


# Entity labels per frame kind: the key of a row, and labels carried along.
KEYS = {"gpu": ("node", "gpu"), "process": ("node", "gpu", "pid"), "engine": ("node", "gpu", "engine"),
        "node": ("node",), "cuda_api": ("node", "pid", "api")}
# pod, namespace, container: the agent's process series and dcgm-exporter's GPU series (the pod its
# pod-resources lookup gave the GPU) carry them on Kubernetes; attributes, not extra dimensions.
ATTRIBUTES = {"gpu": ("uuid", "pod", "namespace", "container"),
              "process": ("uuid", "process", "gpu_instance", "compute_instance", "pod", "namespace", "container"),
              "cuda_api": ("process",)}
_INT_LABELS = ("gpu", "pid")


@dataclass(frozen=True)
class Family:
    """One exporter's series: which names to select and how its series name their node."""

    name: str
    names: tuple[str, ...]
    node_matchers: tuple[str, ...]  # label matchers with {node} for --node, alternatives joined by `or`
    pace: tuple[str, ...] = ()  # few-series names whose sample spacing tells how often the exporter is scraped


def _catalog_names(dialect: str) -> list[str]:
    out = []
    for m in METRICS:
        if m.dialect == dialect and m.entity in KEYS and m.type not in (HISTOGRAM, INFO):
            out.append(m.name)
    return out


def families() -> tuple[Family, ...]:
    """The three dialects and their node matchers."""
    aliases = [a for a, current in _vllm_aliases().items() if BY_NAME[current].type != HISTOGRAM]
    return (
        Family("gpudiag", tuple(_catalog_names("gpudiag") + [CATALOG[M.agent_sim_seconds].name]),
               ('node="{node}"',), (CATALOG[M.node_cpu_utilization_ratio].name, CATALOG[M.gpu_utilization_ratio].name,
                                    CATALOG[M.engine_batch_size].name)),
        Family("vllm", tuple(_catalog_names("vllm") + aliases + [name for name, _, _ in _label_products()]),
               _VLLM_NODE_MATCHERS,
               (CATALOG[M.num_requests_running].name, CATALOG[M.kv_cache_usage_perc].name)),
        Family("dcgm-exporter", tuple(sorted({f.name for f in FOREIGN})), ('Hostname="{node}"', 'node="{node}"'),
               ("DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_GPU_UTIL")),
        *_engine_families(),
    )


def _engine_families() -> tuple[Family, ...]:
    """One family per other serving engine's dialect (SGLang, TensorRT-LLM, Triton, NIM, llama.cpp, TGI)."""
    from gpudiag.probes.engine_dialects import prom_series

    by_dialect: dict[str, list[str]] = {}
    for ps in prom_series():
        if ps.type != HISTOGRAM:
            names = by_dialect.setdefault(ps.dialect, [])
            if ps.name not in names:
                names.append(ps.name)
    return tuple(Family(d, tuple(names), _VLLM_NODE_MATCHERS, tuple(names[:2])) for d, names in by_dialect.items())


def engine_histograms() -> list[tuple[str, str, float]]:
    """(catalog column, exported name, factor to seconds) of the other engines' latency histograms."""
    from gpudiag.probes.engine_dialects import prom_series

    return [(ps.column, ps.name, ps.scale) for ps in prom_series() if ps.type == HISTOGRAM]


# vLLM's series name their node by the scrape target, unless relabelling added a node label.
_VLLM_NODE_MATCHERS = ('node="{node}"', 'instance=~"{node_re}(:[0-9]+)?"')


def histograms() -> list[tuple[str, tuple[str, ...]]]:
    """(catalog column, exported names to try in order) of the latency histograms read as interval summaries."""
    aliases = _vllm_aliases()
    out = []
    for m in METRICS:
        if m.type == HISTOGRAM and m.entity == "request" and m.dialect == "vllm":
            older = tuple(a for a, current in aliases.items() if current == m.name)
            out.append((m.column, (m.name,) + older))
    return out


# --- the HTTP API ----------------------------------------------------------------------------------


class QueryFailed(Exception):
    """Prometheus answered, but not with data: the error it gave."""


class PrometheusAPI:
    """A few endpoints of Prometheus' HTTP API (GpudiagError when it cannot be reached at all)."""

    def __init__(self, url: str, timeout_s: float = HTTP_TIMEOUT_S):
        parsed = urllib.parse.urlparse(url or "")
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise GpudiagError(f"--prometheus {url!r}: give the server's http:// or https:// URL "
                               f"(e.g. http://prometheus:9090)")
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.warnings: list[str] = []

    def call(self, path: str, params: dict[str, Any] | list[tuple[str, Any]], *, post: bool = False) -> Any:
        """The ``data`` of one API call; QueryFailed on an error answer, GpudiagError when unreachable."""
        self.warnings = []
        body = urllib.parse.urlencode(params, doseq=True)
        if post:
            req = urllib.request.Request(self.url + path, data=body.encode(), method="POST",
                                         headers={"Content-Type": "application/x-www-form-urlencoded"})
        else:
            req = urllib.request.Request(f"{self.url}{path}?{body}")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                raw = r.read(MAX_RESPONSE_BYTES)
        except urllib.error.HTTPError as exc:
            raw = exc.read(1 << 16)
            try:
                doc = json.loads(raw)
                message = f"{doc.get('errorType', exc.code)}: {doc.get('error', '')}"
            except ValueError:
                if exc.code == 404:
                    raise GpudiagError(f"{self.url} has no Prometheus HTTP API ({path}: HTTP 404); "
                                       f"check --prometheus") from None
                message = f"HTTP {exc.code} {exc.reason}"
            raise QueryFailed(message) from None
        except urllib.error.URLError as exc:
            reason = exc.reason.strerror if isinstance(exc.reason, OSError) and exc.reason.strerror else exc.reason
            raise GpudiagError(f"cannot reach Prometheus at {self.url}: {reason}; check --prometheus") from None
        except (TimeoutError, socket.timeout):
            raise GpudiagError(f"Prometheus at {self.url} did not answer within {self.timeout_s:g} s") from None
        except OSError as exc:
            raise GpudiagError(f"cannot read from Prometheus at {self.url}: {exc}") from None
        try:
            doc = json.loads(raw)
        except ValueError:
            raise GpudiagError(f"{self.url} did not answer as Prometheus' HTTP API (not JSON); "
                               f"check --prometheus") from None
        if not isinstance(doc, dict) or doc.get("status") != "success":
            raise QueryFailed(f"{doc.get('errorType', 'error')}: {doc.get('error', doc)}"
                              if isinstance(doc, dict) else str(doc))
        self.warnings = doc.get("warnings") or []
        return doc.get("data")

    def names(self, start: float, end: float) -> set[str]:
        """Metric names with samples between ``start`` and ``end``."""
        try:
            return set(self.call("/api/v1/label/__name__/values", {"start": _ts(start), "end": _ts(end)}) or [])
        except QueryFailed as exc:
            raise GpudiagError(f"Prometheus at {self.url} cannot list its metric names: {exc}") from None

    def label_values(self, label: str, match: str, start: float, end: float) -> list[str]:
        """Values of ``label`` on the series ``match`` selects (empty when the API refuses)."""
        try:
            return list(self.call(f"/api/v1/label/{label}/values",
                                  [("match[]", match), ("start", _ts(start)), ("end", _ts(end))]) or [])
        except QueryFailed:
            return []

    def sample_interval_s(self, selectors: list[str], times: Iterable[float]) -> float | None:
        """The median spacing of raw samples of ``selectors`` in the 5 minutes before one of ``times``."""
        for at in times:
            diffs: list[float] = []
            for selector in selectors:
                try:
                    data = self.call("/api/v1/query", {"query": f"{selector}[5m]", "time": _ts(at)})
                except QueryFailed:
                    return None
                for series in (data or {}).get("result", [])[:20]:
                    stamps = [float(v[0]) for v in series.get("values", [])]
                    diffs.extend(np.diff(stamps).tolist())
            if diffs:
                return float(np.median(diffs))
        return None

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        """The matrix of one range query (QueryFailed on an error answer)."""
        data = self.call("/api/v1/query_range", {"query": expr, "start": _ts(start), "end": _ts(end),
                                                 "step": f"{step:.3f}"}, post=True)
        if not isinstance(data, dict) or data.get("resultType") != "matrix":
            raise QueryFailed(f"unexpected answer to a range query: {str(data)[:200]}")
        return data.get("result") or []


def _ts(t: float) -> str:
    return f"{t:.3f}"


_PROM_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d|w|y)")
_PROM_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0, "y": 31536000.0}


def prom_duration_s(text: str) -> float | None:
    """Seconds in a Prometheus duration (``100ms``, ``15s``, ``1m30s``); None when it is not one."""
    parts = _PROM_DURATION.findall(text or "")
    if not parts or "".join(n + u for n, u in parts) != text:
        return None
    return sum(float(n) * _PROM_UNITS[u] for n, u in parts)


# --- the plan: step and ranges ---------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """Where Prometheus is asked: the step and the ranges of at most PROMETHEUS_MAX_POINTS steps each."""

    start_s: float
    end_s: float
    step_s: float
    n_steps: int
    chunks: tuple[tuple[int, int], ...]  # [first, last] step index of each range query

    def t(self) -> np.ndarray:
        """The evaluation times of every step."""
        return self.start_s + self.step_s * np.arange(self.n_steps)


def plan(start_s: float, end_s: float, *, step_s: float | None = None, scrape_interval_s: float | None = None,
         max_points: int = MAX_POINTS_PER_SERIES, chunk_points: int = PROMETHEUS_MAX_POINTS) -> Plan:
    """The step and the range queries for a window.

    An explicit ``step_s`` is taken as given; otherwise the step is the scrape
    interval (or DEFAULT_STEP_S), widened until the window holds at most
    ``max_points`` steps. Ranges hold at most ``chunk_points`` steps, the
    Prometheus limit per series.
    """
    span = end_s - start_s
    if step_s is None:
        step_s = max(scrape_interval_s or DEFAULT_STEP_S, span / max_points)
        step_s = math.ceil(step_s * 1000) / 1000  # Prometheus takes the step to the millisecond
    elif span / step_s > MAX_POINTS_EXPLICIT:
        raise GpudiagError(f"--step {step_s:g}s makes {span / step_s:,.0f} points per series over this window; "
                           f"use a step of at least {span / MAX_POINTS_EXPLICIT:.3g}s")
    n = int(math.floor(span / step_s + 1e-9)) + 1
    chunks = tuple((a, min(a + chunk_points, n) - 1) for a in range(0, n, chunk_points))
    return Plan(start_s, start_s + (n - 1) * step_s, step_s, n, chunks)


# --- rows per entity -------------------------------------------------------------------------------


@dataclass
class _Entity:
    kind: str
    key: dict[str, Any]
    attrs: dict[str, Any] = field(default_factory=dict)
    cols: dict[str, np.ndarray] = field(default_factory=dict)
    sums: dict[str, np.ndarray] = field(default_factory=dict)
    anchored: dict[str, np.ndarray] = field(default_factory=dict)  # steps at which a sum's anchor was seen
    nested: dict[str, dict[int, dict]] = field(default_factory=dict)


class _Frames:
    """Values on the step grid per entity, filled series by series."""

    def __init__(self, n: int):
        self.n = n
        self.entities: dict[tuple, _Entity] = {}
        self.coverage: dict[tuple[str, Any], np.ndarray] = {}

    def seen(self, family: str, series: dict[str, Any], plan_: Plan) -> None:
        """Mark the steps at which one of ``family``'s series of a node had a sample."""
        node = _labels(series.get("metric", {})).get("node")
        have = self.coverage.get((family, node))
        if have is None:
            have = self.coverage[(family, node)] = np.zeros(self.n, dtype=bool)
        have[_values(series, plan_)[0]] = True

    def entity(self, kind: str, labels: dict[str, Any]) -> _Entity:
        key = {k: labels.get(k) for k in KEYS[kind]}
        ident = (kind,) + tuple(key.values())
        ent = self.entities.get(ident)
        if ent is None:
            ent = self.entities[ident] = _Entity(kind, key)
        for a in ATTRIBUTES.get(kind, ()):
            if labels.get(a) is not None:
                ent.attrs[a] = labels[a]
        return ent

    def put(self, ent: _Entity, column: str, k: np.ndarray, v: np.ndarray) -> None:
        """Fill ``column`` at steps ``k`` where nothing (of a higher-priority series) is there yet."""
        arr = ent.cols.get(column)
        if arr is None:
            arr = ent.cols[column] = np.full(self.n, np.nan)
        free = np.isnan(arr[k])
        arr[k[free]] = v[free]

    def add(self, ent: _Entity, column: str, k: np.ndarray, v: np.ndarray, anchor: bool = False) -> None:
        """Add into ``column``'s running sum (NaN plus a value is the value); ``anchor``: this part makes it whole."""
        arr = ent.sums.get(column)
        if arr is None:
            arr = ent.sums[column] = np.full(self.n, np.nan)
            ent.anchored[column] = np.zeros(self.n, dtype=bool)
        arr[k] = np.where(np.isnan(arr[k]), v, arr[k] + v)
        if anchor:
            ent.anchored[column][k] = True

    def put_nested(self, ent: _Entity, column: str, k: np.ndarray, values: Iterable, path: tuple) -> None:
        """Place values at ``path`` inside the column's dict per step (a path already there is kept)."""
        per_step = ent.nested.setdefault(column, {})
        for ki, v in zip(k.tolist(), values):
            node = per_step.setdefault(ki, {})
            for p in path[:-1]:
                node = node.setdefault(p, {})
            node.setdefault(path[-1], v)

    def put_whole(self, ent: _Entity, column: str, k: np.ndarray, dicts: Iterable[dict]) -> None:
        """Take a decoded dict per step where the column holds none yet (the agent's own reading wins)."""
        per_step = ent.nested.setdefault(column, {})
        for ki, d in zip(k.tolist(), dicts):
            per_step.setdefault(ki, d)

    def tables(self, t: np.ndarray) -> dict[str, pd.DataFrame]:
        """One DataFrame per kind: a row per entity and step at which any column has a value."""
        parts: dict[str, list[pd.DataFrame]] = {}
        for ent in self.entities.values():
            for col, s in ent.sums.items():
                s = np.where(ent.anchored[col], s, np.nan)  # a sum without its anchor is not the whole
                if col in ent.cols:
                    self.put(ent, col, np.arange(self.n), s)
                else:
                    ent.cols[col] = s
            have = np.zeros(self.n, dtype=bool)
            for arr in ent.cols.values():
                have |= ~np.isnan(arr)
            if not have.any():  # an entity known only by its histograms or labelled metrics
                for per_step in ent.nested.values():
                    have[list(per_step)] = True
            idx = np.flatnonzero(have)
            if idx.size == 0:
                continue
            data: dict[str, Any] = {"t": t[idx]}
            for label, value in list(ent.key.items()) + list(ent.attrs.items()):
                if value is not None:
                    data[label] = [value] * idx.size
            for col, arr in ent.cols.items():
                data[col] = forward_fill(arr[idx]) if CATALOG[col].type == COUNTER else arr[idx]
            for col, per_step in ent.nested.items():
                data[col] = [per_step.get(int(i)) for i in idx]
            parts.setdefault(ent.kind, []).append(pd.DataFrame(data))
        return {kind: pd.concat(dfs, ignore_index=True).sort_values("t", kind="stable").reset_index(drop=True)
                for kind, dfs in parts.items()}


def _labels(metric: dict[str, str]) -> dict[str, Any]:
    """A series' labels in the frames' spelling: node resolved, gpu and pid as ints, foreign names renamed."""
    out: dict[str, Any] = {}
    for k, v in metric.items():
        if k == "__name__" or v == "":
            continue
        out[FOREIGN_LABELS.get(k, k)] = v
    node = next((metric[k] for k in NODE_LABELS if metric.get(k)), None)
    if node is not None and not metric.get("node") and not metric.get("Hostname"):
        node = _host(node)  # a scrape target "host:port" names its host
    out["node"] = node
    for k in _INT_LABELS:
        if k in out:
            try:
                out[k] = int(out[k])
            except ValueError:
                pass
    return out


def host_of(instance: str) -> str:
    """The host of a scrape target (``host:port``, ``[v6]:port``), as the node of its series."""
    return _host(instance)


def _host(instance: str) -> str:
    if instance.startswith("["):
        return instance[1:].split("]", 1)[0]
    return instance.rsplit(":", 1)[0] if instance.count(":") == 1 else instance


def _values(series: dict[str, Any], plan_: Plan) -> tuple[np.ndarray, np.ndarray]:
    """(step index, value) of one result series."""
    vals = series.get("values") or []
    if not vals:
        return np.array([], dtype=int), np.array([])
    ts = np.fromiter((float(p[0]) for p in vals), float, len(vals))
    vs = np.fromiter((float(p[1]) for p in vals), float, len(vals))
    k = np.rint((ts - plan_.start_s) / plan_.step_s).astype(int)
    ok = (k >= 0) & (k < plan_.n_steps)
    return k[ok], vs[ok]


@dataclass
class _Mapping:
    kind: str
    column: str
    scale: float = 1.0
    path: tuple[str, ...] = ()
    decode: str | None = None
    sum: bool = False
    anchor: bool = False
    extra: tuple[str, ...] = ()  # labels beyond the entity's, nested in that order
    priority: int = 0
    where: tuple[tuple[str, str], ...] = ()  # only the samples with these labels (Triton's request_type)
    # Another engine's series name no GPU or engine: the scrape target is the engine.
    instance_engine: bool = False
    # An info gauge whose figure is in its labels: the value is the product of these labels' numbers
    # (vLLM's cache_config_info: num_gpu_blocks x block_size).
    from_labels: tuple[str, ...] = ()


def mappings(more_foreign: Iterable[Foreign] = ()) -> dict[str, list[_Mapping]]:
    """Every exported name understood -> where its values go, in priority order.

    ``more_foreign`` adds another tool's names (a recorded file's fields) after :data:`FOREIGN`.
    """
    out: dict[str, list[_Mapping]] = {}
    for m in METRICS:
        if m.entity not in KEYS or m.type in (HISTOGRAM, INFO):
            continue
        keyed = set(KEYS[m.entity]) | set(ATTRIBUTES.get(m.entity, ()))
        extra = tuple(lab for lab in m.labels if lab not in keyed)
        out.setdefault(m.name, []).append(_Mapping(m.entity, m.column, extra=extra))
    for old, current in _vllm_aliases().items():
        m = BY_NAME[current]
        if m.type not in (HISTOGRAM, INFO):
            out.setdefault(old, []).append(_Mapping(m.entity, m.column, priority=1))
    for f in (*FOREIGN, *more_foreign):
        entity = CATALOG[f.column].entity
        out.setdefault(f.name, []).append(_Mapping(entity, f.column, f.scale, f.path, f.decode, f.sum, f.anchor,
                                                   priority=2))
    from gpudiag.probes.engine_dialects import prom_series

    for ps in prom_series():
        if ps.type != HISTOGRAM:
            out.setdefault(ps.name, []).append(_Mapping("engine", ps.column, ps.scale, priority=1, where=ps.where,
                                                        instance_engine=True))
    for name, column, factors in _label_products():
        out.setdefault(name, []).append(_Mapping("engine", column, from_labels=factors))
    return out


def _label_products() -> list[tuple[str, str, tuple[str, ...]]]:
    from gpudiag.probes.engine_dialects import label_products

    return label_products("vllm")


def _decode_clock_event_bits(v: np.ndarray) -> list[dict[str, int]]:
    from gpudiag.probes.nvml import THROTTLE_REASON_BITS

    bits = np.nan_to_num(v).astype(np.int64)
    return [{reason: int(b & bit != 0) for reason, bit in THROTTLE_REASON_BITS.items()} for b in bits.tolist()]


def _decode_last_xid(v: np.ndarray) -> list[dict[str, int]]:
    """Cumulative events per XID code from a gauge of the last XID: a change to a non-zero code is one event."""
    counts: dict[str, int] = {}
    out, previous = [], 0
    for x in np.nan_to_num(v).astype(np.int64).tolist():
        if x != previous and x != 0:
            counts[str(x)] = counts.get(str(x), 0) + 1
        previous = x
        out.append(dict(counts))
    return out


def _fill(frames: _Frames, series: dict[str, Any], plan_: Plan, maps: list[_Mapping]) -> None:
    k, v = _values(series, plan_)
    _fill_steps(frames, _labels(series.get("metric", {})), k, v, maps)


def _fill_steps(frames: _Frames, labels: dict[str, Any], k: np.ndarray, v: np.ndarray, maps: list[_Mapping]) -> None:
    if k.size == 0:
        return
    for mp in maps:
        if mp.where and any(labels.get(k) != v for k, v in mp.where):
            continue
        ent = frames.entity(mp.kind, _engine_of_target(labels) if mp.instance_engine else labels)
        vals = v * mp.scale if mp.scale != 1.0 else v
        if mp.from_labels:
            from gpudiag.probes.engine_dialects import label_product

            figure = label_product(labels, mp.from_labels)
            if figure is None:
                continue
            vals = np.full(v.shape, figure)
        if mp.decode == "clock_event_bits":
            frames.put_whole(ent, mp.column, k, _decode_clock_event_bits(vals))
        elif mp.decode == "last_xid":
            frames.put_whole(ent, mp.column, k, _decode_last_xid(vals))
        elif mp.path or mp.extra:
            path = mp.path or tuple(str(labels.get(lab, "")) for lab in mp.extra)
            frames.put_nested(ent, mp.column, k, vals.tolist(), path)
        elif mp.sum:
            frames.add(ent, mp.column, k, vals, mp.anchor)
        else:
            frames.put(ent, mp.column, k, vals)


def _engine_of_target(labels: dict[str, Any]) -> dict[str, Any]:
    """Labels of an engine's series that name neither a GPU nor an engine: the scrape target names it."""
    if labels.get("engine") is not None or labels.get("gpu") is not None or not labels.get("instance"):
        return labels
    return {**labels, "engine": labels["instance"]}


def tables_from_series(series: Iterable[tuple[dict[str, str], np.ndarray, np.ndarray]], plan_: Plan, *,
                       more_foreign: Iterable[Foreign] = (),
                       histograms: Iterable[tuple[str, dict[str, str], np.ndarray, np.ndarray]] = ()
                       ) -> dict[str, pd.DataFrame]:
    """The analyzer tables of series already placed on a plan's steps, as a range query would answer them.

    For sources other than Prometheus (recorded files). ``series``: per
    exported series its labels (``__name__`` included), the step indexes that
    hold a value and the values, in the exporter's units; names map to
    catalog columns as :func:`mappings` maps them (``more_foreign`` adds
    another tool's names), and the agent's own names win over aliases and foreign
    names where both fill a column. ``histograms``: per ``_bucket`` series of
    a latency histogram, its catalog column (see :func:`histograms`), its
    labels (``le`` included), step indexes and the increase of the bucket
    over the HISTOGRAM_RANGE_STEPS steps up to each.
    """
    frames = _Frames(plan_.n_steps)
    maps = mappings(more_foreign)
    known = [(labels, k, v, maps[labels.get("__name__")]) for labels, k, v in series if labels.get("__name__") in maps]
    known.sort(key=lambda s: min(m.priority for m in s[3]))
    for labels, k, v, got in known:
        _fill_steps(frames, _labels(labels), np.asarray(k, dtype=int), np.asarray(v, dtype=float), got)
    by_column: dict[str, list[dict[str, Any]]] = {}
    for column, labels, k, v in histograms:
        t = plan_.start_s + plan_.step_s * np.asarray(k, dtype=float)
        by_column.setdefault(column, []).append({"metric": labels, "values": list(zip(t.tolist(), v.tolist()))})
    for column, result in by_column.items():
        _put_histograms(frames, column, result, plan_)
    return frames.tables(plan_.t()) if frames.entities else {}


# --- the window ------------------------------------------------------------------------------------

ProgressFn = Callable[[str, int, int], None]


def resolve_window(*, since: str | None, start: str | None, end: str | None,
                   now_s: float | None = None) -> tuple[float, float]:
    """The [start, end] of a window over Prometheus: ``--since`` counts back from now, ``--to`` defaults to now."""
    from gpudiag.investigate import DEFAULT_SINCE_S, iso, parse_duration, parse_time

    now_s = time.time() if now_s is None else now_s
    if since is not None and (start is not None or end is not None):
        raise GpudiagError("give either --since or --from/--to, not both")
    if end is not None and start is None:
        raise GpudiagError("--to needs --from (or use --since)")
    if start is None:
        span = parse_duration(since) if since is not None else DEFAULT_SINCE_S
        return now_s - span, now_s
    lo = parse_time(start, "--from")
    hi = parse_time(end, "--to") if end is not None else now_s
    if lo > now_s:
        raise GpudiagError(f"the window starts at {iso(lo)}, in the future (now {iso(now_s)})")
    if lo >= hi:
        raise GpudiagError(f"--from ({iso(lo)}) must be before --to ({iso(hi)})")
    return lo, min(hi, now_s)


def _selector(names: Iterable[str], matcher: str | None = None) -> str:
    inner = '__name__=~"' + "|".join(sorted(names)) + '"'  # exported names need no regex escaping
    return "{" + inner + ("," + matcher if matcher else "") + "}"


def _promql_string(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')


def _selectors(names: Iterable[str], matchers: tuple[str, ...], node: str | None) -> list[str]:
    """One selector of ``names``, or one per node matcher when a node is asked for (joined by ``or``)."""
    names = list(names)
    if node is None:
        return [_selector(names)]
    fill = {"node": _promql_string(node), "node_re": _promql_string(re.escape(node))}
    return [_selector(names, m.format(**fill)) for m in matchers]


def _histogram_query(bucket_name: str, node: str | None, range_s: float) -> str:
    """The per-``le`` increase of one histogram over ``range_s`` per engine (and node, GPU)."""
    rng = f"{max(1, round(range_s * 1000))}ms"  # PromQL durations take no fractions
    return " or ".join(f"sum by (le, node, instance, gpu, engine) (increase({sel}[{rng}]))"
                       for sel in _selectors([bucket_name], _VLLM_NODE_MATCHERS, node))


def _put_histograms(frames: _Frames, column: str, result: list[dict[str, Any]], plan_: Plan,
                    scale: float = 1.0) -> None:
    """Interval summaries per engine and step from the ``le`` series of one histogram's increase
    (``scale``: the factor from the histogram's unit to seconds, applied to its bounds)."""
    from gpudiag.probes.engine_scrape import summarise_histogram

    groups: dict[tuple, list[tuple[float, np.ndarray, np.ndarray]]] = {}
    labels_of: dict[tuple, dict] = {}
    for s in result:
        metric = dict(s.get("metric", {}))
        le = metric.pop("le", None)
        if le is None:
            continue
        ident = tuple(sorted(metric.items()))
        labels_of[ident] = metric
        k, v = _values(s, plan_)
        groups.setdefault(ident, []).append((float(le) * scale, k, v))
    for ident, bounds in groups.items():
        bounds.sort(key=lambda b: b[0])
        grid = np.full((len(bounds), plan_.n_steps), np.nan)
        for i, (_, k, v) in enumerate(bounds):
            grid[i, k] = v
        steps = np.flatnonzero(~np.isnan(grid).all(axis=0))
        ent = frames.entity("engine", _engine_of_target(_labels(labels_of[ident])))
        les = [b[0] for b in bounds]
        per_step = ent.nested.setdefault(column, {})
        for ki in steps.tolist():
            counts = np.maximum.accumulate(np.nan_to_num(grid[:, ki]))  # increase() extrapolates: keep it monotone
            summary = summarise_histogram(list(zip(les, counts.tolist())), float("nan"), float(counts[-1]))
            summary["sum"] = summary["mean"] = None  # the _sum series is not read
            per_step.setdefault(ki, {"window": summary})


def _coverage_gaps(frames: _Frames, plan_: Plan, t: np.ndarray) -> list[str]:
    """Stretches of the window in which an exporter had no samples of a node (target down, not yet scraped)."""
    from gpudiag.investigate import iso

    out = []
    min_steps = max(GAP_MIN_STEPS, math.ceil(GAP_MIN_S / plan_.step_s))
    for (family, node), have in sorted(frames.coverage.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
        edges = np.flatnonzero(np.diff(np.concatenate([[0], (~have).astype(np.int8), [0]])))
        for a, b in zip(edges[::2], edges[1::2]):
            if b - a >= min_steps:
                out.append(f"prometheus: no {family} samples of node {node} from {iso(t[a])} to {iso(t[b - 1])} "
                           f"(target down or not yet scraped)")
    return out


def _sim_clock(frames_result: list[dict[str, Any]], plan_: Plan) -> dict[Any, tuple[np.ndarray, np.ndarray]]:
    """Per node of an agent in --sim mode: (wall time, simulated seconds) where its simulated clock moved."""
    out = {}
    for s in frames_result:
        k, v = _values(s, plan_)
        if k.size < 2:
            continue
        moved = np.concatenate([[True], np.diff(v) != 0])
        out[_labels(s.get("metric", {})).get("node")] = (plan_.start_s + plan_.step_s * k[moved], v[moved])
    return out


def _restamp(tables: dict[str, pd.DataFrame], clocks: dict[Any, tuple[np.ndarray, np.ndarray]]) -> None:
    for df in tables.values():
        if "node" not in df:
            continue
        for node, (wall, sim) in clocks.items():
            rows = df["node"] == node
            if rows.any():
                t = df.loc[rows, "t"].to_numpy(float)
                df.loc[rows, "t"] = wall[0] + (np.interp(t, wall, sim) - sim[0])
    for kind in list(tables):
        tables[kind] = tables[kind].sort_values("t", kind="stable").reset_index(drop=True)


def load_window(url: str, *, since: str | None = None, start: str | None = None, end: str | None = None,
                node: str | None = None, gpu: int | None = None, step: str | None = None,
                progress: ProgressFn | None = None, now_s: float | None = None) -> Window:
    """Read the window the options name from Prometheus at ``url`` as analyzer frames (GpudiagError on bad input)."""
    from gpudiag.investigate import iso, only_gpu, parse_duration

    lo, hi = resolve_window(since=since, start=start, end=end, now_s=now_s)
    api = PrometheusAPI(url)
    present = api.names(lo, hi)
    fams = [(f, [n for n in f.names if n in present]) for f in families()]
    fams = [(f, names) for f, names in fams if names]
    hists = []
    for column, candidates in histograms():
        name = next((c for c in candidates if c + "_bucket" in present), None)
        if name is not None:
            hists.append((column, name, 1.0))
    # Every other engine's histogram that is there: a mixed fleet has several for one column.
    hists += [(column, name, scale) for column, name, scale in engine_histograms() if name + "_bucket" in present]
    if not fams and not hists:
        raise GpudiagError(f"no gpudiag, dcgm-exporter or vLLM series, nor another serving engine's, in Prometheus "
                           f"at {api.url} between {iso(lo)} and {iso(hi)}: is it scraping the agent (or "
                           f"dcgm-exporter, an engine)?")
    step_s = parse_duration(step) if step is not None else None
    # How often each exporter is scraped, from its samples (the agent at 1 s, vLLM at 15 s, ...):
    # the step follows the most frequent one, a histogram's increase spans a few of its own.
    at = (hi, (lo + hi) / 2, min(hi, lo + 300.0))
    paces = {}
    for f, names in fams:
        probe = next((n for n in f.pace if n in names), names[0])
        paces[f.name] = api.sample_interval_s(_selectors([probe], f.node_matchers, node), at)
    for _, name, _ in hists:
        paces[name] = api.sample_interval_s(_selectors([name + "_count"], _VLLM_NODE_MATCHERS, node), at)
    known = [v for v in paces.values() if v]
    p = plan(lo, hi, step_s=step_s, scrape_interval_s=min(known) if known else None)
    frames = _Frames(p.n_steps)
    maps = mappings()
    sim_name = CATALOG[M.agent_sim_seconds].name
    sim_series: list[dict[str, Any]] = []
    gaps: list[str] = []
    total = len(p.chunks) * (len(fams) + len(hists))
    done = 0
    for a, b in p.chunks:
        t0, t1 = lo + a * p.step_s, lo + b * p.step_s
        queries = [(f.name, " or ".join(_selectors(names, f.node_matchers, node)), None) for f, names in fams]
        queries += [(name, _histogram_query(name + "_bucket", node, HISTOGRAM_RANGE_STEPS
                                            * max(p.step_s, paces[name] or 0.0)), (column, scale))
                    for column, name, scale in hists]
        for what, expr, hist_column in queries:
            if progress is not None:
                progress(f"Prometheus: {what}", done, total)
            try:
                result = api.query_range(expr, t0, t1, p.step_s)
            except QueryFailed as exc:
                gaps.append(f"prometheus: {what} from {iso(t0)} to {iso(t1)} could not be read ({exc}); "
                            f"analyzed without it")
                result = []
            gaps.extend(f"prometheus warning ({what}): {w}" for w in api.warnings)
            done += 1
            if hist_column is not None:
                _put_histograms(frames, hist_column[0], result, p, hist_column[1])
                continue
            for s in result:
                name = s.get("metric", {}).get("__name__")
                if name == sim_name:
                    sim_series.append(s)
                elif name in maps:
                    _fill(frames, s, p, maps[name])
                    frames.seen(what, s, p)
    if progress is not None:
        progress("Prometheus: frames", done, total)
    t = p.t()
    if not frames.entities:
        if node is not None:
            raise GpudiagError(f"no node {node!r} in Prometheus at {api.url} between {iso(lo)} and {iso(hi)}; "
                               f"nodes there: {', '.join(_nodes_seen(api, fams, lo, hi)) or 'none'}")
        raise GpudiagError(f"Prometheus at {api.url} holds no samples between {iso(lo)} and {iso(hi)} "
                           f"of the series it lists; every range query failed or came back empty")
    gaps = _coverage_gaps(frames, p, t) + gaps
    tables = frames.tables(t)
    clocks = _sim_clock(_merge_series(sim_series), p)
    start_s, end_s = lo, hi
    if clocks:
        _restamp(tables, clocks)
        start_s = min(start_s, min(float(df["t"].iloc[0]) for df in tables.values()))
        end_s = max(float(df["t"].iloc[-1]) for df in tables.values())
    nodes = sorted({str(v) for df in tables.values() if "node" in df for v in df["node"].dropna()})
    window = Window(tables, start_s, end_s, node if node is not None else (nodes[0] if len(nodes) == 1 else None),
                    [f"prometheus:{api.url}"], gaps)
    if gpu is not None:
        window = only_gpu(window, gpu)
    return window


def _merge_series(series: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One series per label set, the ranges of every chunk joined."""
    out: dict[tuple, dict[str, Any]] = {}
    for s in series:
        ident = tuple(sorted(s.get("metric", {}).items()))
        got = out.setdefault(ident, {"metric": s.get("metric", {}), "values": []})
        got["values"].extend(s.get("values") or [])
    return list(out.values())


def _nodes_seen(api: PrometheusAPI, fams: list[tuple[Family, list[str]]], lo: float, hi: float) -> list[str]:
    seen: set[str] = set()
    for _, names in fams:
        match = _selector(names, None)
        for label in NODE_LABELS:
            values = api.label_values(label, match, lo, hi)
            seen.update(_host(v) if label == "instance" else v for v in values)
            if values:
                break
    return sorted(seen)

