"""The serving engine's view: its Prometheus endpoint, in any engine's dialect, as engine frames.

The page's dialect (vLLM, SGLang, trtllm-serve, Triton, NIM, llama.cpp, TGI) is recognised from
its names and mapped onto the catalog's (:mod:`gpudiag.probes.engine_dialects`); what follows is
said of vLLM's names, which every other dialect is rewritten into first.

One GET of ``/metrics`` per tick, parsed with ``prometheus_client.parser``.
Series are matched to the catalog by their exported name (``vllm:*`` for
vLLM's metrics, ``gpudiag_engine_*`` for the reference engine's own), plus the
older names vLLM used for the same things (``vllm:gpu_cache_usage_perc`` before
``vllm:kv_cache_usage_perc``...). A real vLLM and the reference engine are read
by the same code.

Each engine on the endpoint (vLLM's ``engine`` label; one row when absent)
becomes one row. Histograms are summarised: count, sum, mean and the 50th,
90th and 99th percentiles (interpolated inside the bucket, as PromQL's
``histogram_quantile`` does), over everything so far and over the interval
since the previous scrape (``window``).

Metrics the endpoint has that the catalog does not know, and catalog metrics
the endpoint lacks, are tolerated and listed in ``status()``.
"""

from __future__ import annotations

import math
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from gpudiag.catalog import CATALOG, ENGINE_LABELS, HISTOGRAM, INFO, METRICS, PREFIX, M, Metric
from gpudiag.errors import GpudiagError
from gpudiag.frames import Frame
from gpudiag.probes import engine_dialects
from gpudiag.probes.base import Probe, ProbeError

# Older vLLM names for catalog metrics (the V0 dialect's renames); used only when the current name is absent.
VLLM_ALIASES: dict[str, str] = engine_dialects.vllm_renames()

QUANTILES = (0.5, 0.9, 0.99)

# A metrics page is tens of kilobytes; anything near this is not one.
MAX_RESPONSE_BYTES = 16 << 20

_ENGINE_ENTITIES = ("engine", "request")


def _expected() -> dict[str, Metric]:
    return {m.name: m for m in METRICS if m.entity in _ENGINE_ENTITIES}


_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*\Z")
_SAMPLE_SUFFIXES = ("_bucket", "_count", "_sum", "_created", "_total", "_info")


def _family_name(sample_name: str) -> str:
    """A sample's family as prometheus_client names it (suffixes of histograms and counters removed)."""
    for suffix in _SAMPLE_SUFFIXES:
        if sample_name.endswith(suffix):
            return sample_name[: -len(suffix)]
    return sample_name


def _known_names() -> frozenset[str]:
    names = set(_expected()) | set(VLLM_ALIASES) | set(engine_dialects.known_names())
    return frozenset(names | {_family_name(n) for n in names})


_KNOWN: frozenset[str] = frozenset()


def _family_known(name: str) -> bool:
    """True when a sample or family name belongs to a metric this probe maps to the catalog."""
    global _KNOWN
    if not _KNOWN:
        _KNOWN = _known_names()
    return name in _KNOWN or _family_name(name) in _KNOWN


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """The q-quantile of cumulative ``(upper_bound, count)`` buckets (sorted, ending at +Inf).

    Linear interpolation inside the bucket that holds the rank; a rank in the
    +Inf bucket gives the highest finite bound. None for an empty histogram.
    """
    if not buckets:
        return None
    total = buckets[-1][1]
    if total <= 0:
        return None
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for upper, count in buckets:
        if count >= rank:
            if math.isinf(upper):
                return lower_bound
            if count == lower_count:
                return upper
            return lower_bound + (upper - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = upper, count
    return lower_bound


def summarise_histogram(buckets: list[tuple[float, float]], total: float, count: float) -> dict[str, Any]:
    """``{"count", "sum", "mean", "p50", "p90", "p99"}`` of one histogram (None where empty)."""
    out: dict[str, Any] = {"count": count, "sum": total, "mean": (total / count) if count else None}
    for q in QUANTILES:
        out[f"p{round(q * 100)}"] = histogram_quantile(q, buckets)
    return out


class EngineScrapeProbe(Probe):
    """Engine frames from a serving engine's Prometheus text endpoint."""

    name = "engine"

    def __init__(self, url: str, *, engine: str | None = None, gpu: int | None = None, interval_s: float = 1.0,
                 timeout_s: float = 2.0, node: str | None = None):
        parsed = urllib.parse.urlparse(url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise GpudiagError(f"engine metrics URL must be http:// or https:// with a host, not {url!r}")
        self.url = url
        self.engine = engine or parsed.netloc
        self.gpu = gpu
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.node = node
        self._expected = _expected()
        self._previous: dict[tuple[str, str], tuple[list[tuple[float, float]], float, float]] = {}
        self._unknown: set[str] = set()
        self._seen: set[str] = set()
        self._last_error = ""
        self._ok = False
        self.dialect: str | None = None  # the engine dialect of the last page (engine_dialects.detect)
        self._own_page = False
        self._slots_error = ""  # llama.cpp's /slots could not be read (its KV occupancy is then missing)

    def _fetch(self) -> str:
        request = urllib.request.Request(self.url, headers={"Accept": "text/plain;version=0.0.4"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                body = response.read(MAX_RESPONSE_BYTES + 1)
        except (urllib.error.URLError, OSError, ValueError) as exc:
            reason = getattr(exc, "reason", exc)
            raise ProbeError(f"cannot scrape {self.url}: {reason}") from None
        if len(body) > MAX_RESPONSE_BYTES:
            raise ProbeError(f"{self.url} answered more than {MAX_RESPONSE_BYTES} bytes: not a metrics page")
        return body.decode("utf-8", "replace")

    def _relevant(self, text: str) -> str:
        """The lines of families this probe understands; the names of the others go to ``unknown``.

        Parsing is most of a scrape's cost, and an engine's page is mostly
        families no analyzer reads (process and Python collectors, speculative
        decoding...), so those are named, not parsed.
        """
        kept: list[str] = []
        pending: list[str] = []  # comment lines of the family that follows
        for line in text.splitlines():
            if not line or line.isspace():
                continue
            if line.startswith("#"):
                parts = line.split(None, 3)
                if len(parts) >= 3 and parts[1] in ("TYPE", "HELP"):
                    if _family_known(parts[2]):
                        pending.append(line)
                    else:
                        self._unknown.add(_family_name(parts[2]))
                continue
            end = len(line)
            for sep in ("{", " ", "\t"):
                i = line.find(sep)
                if 0 <= i < end:
                    end = i
            name = line[:end]
            if not _METRIC_NAME.match(name) or end == len(line):
                raise ValueError(f"not a Prometheus sample line: {line[:80]!r}")
            if _family_known(name):
                kept.extend(pending)
                kept.append(line)
            else:
                self._unknown.add(_family_name(name))
            pending = []
        return "\n".join(kept) + "\n"

    def sample(self, now: float) -> list[Frame]:
        """One "engine" frame with a row per engine on the endpoint; ProbeError when the scrape fails."""
        try:
            text = self._fetch()
            families = list(text_string_to_metric_families(self._relevant(text)))
        except ProbeError as exc:
            self._ok, self._last_error = False, str(exc)
            raise
        except (ValueError, TypeError, KeyError, IndexError) as exc:  # the parser's answers to a non-Prometheus page
            self._ok = False
            self._last_error = f"{self.url} did not answer Prometheus text: {type(exc).__name__}: {exc}"
            raise ProbeError(self._last_error) from None
        self._ok, self._last_error = True, ""
        # The reference engine writes gpudiag's own engine series beside the dialect's.
        self._own_page = any(f.name.startswith("gpudiag_engine_") for f in families)
        self.dialect = engine_dialects.detect(s.name for f in families for s in f.samples) or self.dialect
        if self.dialect is not None and self.dialect not in ("vllm", "vllm-v0"):
            # The engine's series in the catalog's names; gpudiag's own (the reference engine's) as they are.
            own = [f for f in families if f.name.startswith(PREFIX)]
            families = engine_dialects.to_catalog(families, engine_dialects.get(self.dialect)) + own
        elif self.dialect == "vllm":
            families += engine_dialects.to_catalog(
                [f for f in families if f.name == "vllm:cache_config_info"], engine_dialects.VLLM)
        rows: dict[str, dict[str, Any]] = {}
        aliased: list[tuple[str, dict[str, Any], Any]] = []
        self._seen = set()
        for family in families:
            if family.type == "histogram":
                self._histogram(family, rows, aliased)
                continue
            matched = False
            for s in family.samples:
                if s.name.endswith("_created"):
                    matched = True  # the creation time prometheus_client adds to counters
                    continue
                name = s.name
                if name not in self._expected and name in VLLM_ALIASES:
                    aliased.append((VLLM_ALIASES[name], s.labels, s.value))
                    matched = True
                    continue
                metric = self._expected.get(name)
                if metric is None:
                    continue
                matched = True
                self._put(rows, metric, s.labels, s.value)
            if not matched:
                self._unknown.add(family.name)
        for name, labels, value in aliased:  # an old name fills in only what the current one did not
            metric = self._expected[name]
            if name in self._seen:
                continue
            if metric.type == HISTOGRAM:
                self._put_histogram(rows, metric, labels, *value)
            else:
                self._put(rows, metric, labels, value, mark_seen=False)
        for name, _, _ in aliased:
            self._seen.add(name)
        if self.dialect == "llamacpp":
            self._llamacpp_slots(rows)
        return [Frame("engine", now, list(rows.values()))]

    def _llamacpp_slots(self, rows: dict[str, dict[str, Any]]) -> None:
        """llama.cpp builds without a KV gauge: its occupancy from GET /slots (next to /metrics)."""
        import json

        if not rows or all(M.kv_cache_usage_perc in row for row in rows.values()):
            return
        base = self.url[: -len("/metrics")] if self.url.endswith("/metrics") else self.url.rstrip("/")
        request = urllib.request.Request(base + "/slots", headers={"Accept": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                got = engine_dialects.slots_kv_usage(json.loads(response.read(MAX_RESPONSE_BYTES)))
        except (urllib.error.URLError, OSError, ValueError) as exc:
            self._slots_error = f"{base}/slots: {getattr(exc, 'reason', exc)}"  # --slots off, or an API key
            return
        if got is None:
            self._slots_error = f"{base}/slots: not llama.cpp's slot list"
            return
        self._slots_error = ""
        held, capacity, usage = got
        for row in rows.values():
            row.setdefault(M.kv_cache_usage_perc, usage)
            row.setdefault(M.engine_kv_capacity_tokens, capacity)
            row.setdefault(M.engine_kv_used_tokens, held)

    def _row(self, rows: dict[str, dict[str, Any]], labels: dict[str, str]) -> dict[str, Any]:
        index = labels.get("engine", "")
        row = rows.get(index)
        if row is None:
            row = {"engine": self.engine if not index else f"{self.engine}/{index}", "gpu": self.gpu}
            if self.node:
                row["node"] = self.node
            rows[index] = row
        if "model_name" in labels:
            row["model"] = labels["model_name"]
        return row

    def _put(self, rows, metric: Metric, labels: dict[str, str], value: float, mark_seen: bool = True) -> None:
        if mark_seen:
            self._seen.add(metric.name)
        row = self._row(rows, labels)
        extra = [k for k in metric.labels if k not in ENGINE_LABELS]
        if metric.type == INFO:
            row[metric.column] = 1
            for k in extra:
                if k in labels:
                    row[k] = labels[k]
            return
        if not extra:
            row[metric.column] = value
            return
        node = row.setdefault(metric.column, {})
        for k in extra[:-1]:
            node = node.setdefault(labels.get(k, ""), {})
        node[labels.get(extra[-1], "")] = value

    def _histogram(self, family, rows, aliased) -> None:
        name = family.name
        alias = None
        if name not in self._expected:
            alias = VLLM_ALIASES.get(name)
            if alias is None:
                self._unknown.add(name)
                return
        groups: dict[tuple, dict[str, Any]] = {}
        for s in family.samples:
            key_labels = {k: v for k, v in s.labels.items() if k != "le"}
            key = tuple(sorted(key_labels.items()))
            g = groups.setdefault(key, {"labels": key_labels, "buckets": [], "sum": 0.0, "count": 0.0})
            if s.name.endswith("_bucket"):
                g["buckets"].append((float(s.labels["le"]), float(s.value)))
            elif s.name.endswith("_sum"):
                g["sum"] = float(s.value)
            elif s.name.endswith("_count"):
                g["count"] = float(s.value)
        for g in groups.values():
            buckets = sorted(g["buckets"])
            if alias is not None:
                aliased.append((alias, g["labels"], (buckets, g["sum"], g["count"])))
            else:
                self._seen.add(name)
                self._put_histogram(rows, self._expected[name], g["labels"], buckets, g["sum"], g["count"])

    def _put_histogram(self, rows, metric: Metric, labels, buckets, total, count) -> None:
        summary = summarise_histogram(buckets, total, count)
        key = (metric.column, labels.get("engine", ""))
        previous = self._previous.get(key)
        if previous is not None and count >= previous[2]:
            prev_buckets = dict(previous[0])
            window = [(ub, c - prev_buckets.get(ub, 0.0)) for ub, c in buckets]
            summary["window"] = summarise_histogram(window, total - previous[1], count - previous[2])
        self._previous[key] = (buckets, total, count)
        self._row(rows, labels)[metric.column] = summary

    def cumulative_histograms(self) -> dict[tuple[str, str], tuple[list[tuple[float, float]], float, float]]:
        """The last scrape's histograms as the endpoint counts them since it started.

        ``{(column, engine row name): (cumulative (upper bound, count) buckets, sum, count)}``;
        a reader that wants quantiles over its own window (``top``'s last minute) keeps
        these and subtracts, as Prometheus' ``rate()`` does.
        """
        return {(column, self.engine if not index else f"{self.engine}/{index}"): value
                for (column, index), value in self._previous.items()}

    def status(self) -> dict[str, Any]:
        """Scrape health, metrics the endpoint has that are not in the catalog, and catalog metrics it lacks."""
        lacks: dict[str, str] = {}
        if self.dialect not in (None, "vllm", "vllm-v0"):
            # Another engine: the vocabulary is what is expected, and what it cannot export is said with why.
            dialect = engine_dialects.get(self.dialect)
            lacks = {CATALOG[c].name: why for c, why in engine_dialects.missing(dialect).items()}
            missing = sorted(CATALOG[c].name for c in engine_dialects.VOCABULARY
                             if CATALOG[c].name not in self._seen and CATALOG[c].name not in lacks)
        else:
            missing = sorted(n for n, m in self._expected.items() if n not in self._seen and m.dialect == "vllm")
        if self._own_page:  # the reference engine: its own metrics are expected too
            missing += sorted(n for n, m in self._expected.items() if n not in self._seen and m.dialect == "gpudiag")
        return {"name": self.name, "available": self._ok, "reason": self._last_error, "url": self.url,
                "dialect": self.dialect, "missing_fields": {},
                "missing_metrics": sorted(set(missing)) if self._ok else [],
                "lacks": lacks if self._ok else {}, "slots_error": self._slots_error,
                "unknown_metrics": sorted(self._unknown)[:200]}


def scrape_once(url: str, timeout_s: float = 2.0) -> list[dict[str, Any]]:
    """Engine rows of one scrape of ``url`` (raises GpudiagError when the endpoint cannot be read)."""
    probe = EngineScrapeProbe(url, timeout_s=timeout_s)
    try:
        return probe.sample(time.time())[0].rows
    except ProbeError as exc:
        raise GpudiagError(str(exc)) from None


def understood_names() -> list[str]:
    """Every exported name this probe maps to the catalog: vLLM's (current and older) and the other engines'."""
    return sorted(set(_expected()) | set(VLLM_ALIASES) | set(engine_dialects.known_names()))
