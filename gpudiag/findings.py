"""Findings: what an analyzer concludes, with the evidence behind it.

A Finding has a stable ``kind``, a severity, a time span, the entity it is
about, a one-line summary, evidence rows (metric, observed, baseline,
threshold), ``caused_by`` links to upstream findings, the runbook to read and
the fixes that ``gpudiag repro --fix`` understands.

A finding's span lies within its window's samples: ``end_s`` is never after
the last one. ``open`` says it was still going at the window's last sample,
so ``end_s`` is where the data ends, not where the problem did.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class Severity(str, Enum):
    """How urgent a finding is; ordered critical > warning > info."""

    CRITICAL = "critical"
    WARNING = "warning"
    INFO = "info"

    @property
    def rank(self) -> int:
        """2 for critical, 1 for warning, 0 for info."""
        return {"critical": 2, "warning": 1, "info": 0}[self.value]


@dataclass
class Evidence:
    """One measured fact behind a finding: what was observed against what is normal."""

    metric: str
    observed: float | None
    baseline: float | None = None
    threshold: float | None = None
    unit: str = ""

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Evidence:
        """The inverse of :meth:`to_dict`."""
        return cls(str(d.get("metric", "")), d.get("observed"), d.get("baseline"), d.get("threshold"),
                   str(d.get("unit", "")))

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (keys metric, observed, baseline, threshold, unit)."""
        return {
            "metric": self.metric,
            "observed": _clean(self.observed),
            "baseline": _clean(self.baseline),
            "threshold": _clean(self.threshold),
            "unit": self.unit,
        }


@dataclass
class Finding:
    """A diagnosis over a window, about one node/GPU (and optionally one process)."""

    kind: str
    severity: Severity
    start_s: float
    end_s: float
    summary: str
    gpu: int | None = None
    node: str | None = None
    pid: int | None = None
    evidence: list[Evidence] = field(default_factory=list)
    caused_by: list[str] = field(default_factory=list)
    runbook: str = ""
    fixes: list[str] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)
    open: bool = False  # still going at the window's last sample: end_s is the data's end, not the problem's
    # Where the process (or the GPU's one tenant) runs on Kubernetes; None elsewhere or when unknown.
    pod: str | None = None
    namespace: str | None = None
    container: str | None = None
    # The MIG instance the process runs in; None without MIG.
    gpu_instance: int | None = None
    compute_instance: int | None = None

    @property
    def id(self) -> str:
        """Stable id: kind, entity and start second; the same run gives the same ids."""
        gpu = "x" if self.gpu is None else str(self.gpu)
        pid = "" if self.pid is None else f"-p{self.pid}"
        return f"{self.kind}-gpu{gpu}{pid}-{int(self.start_s)}"

    def to_dict(self) -> dict[str, Any]:
        """The JSON form documented in docs/investigate.md (the finding schema)."""
        d = {
            "id": self.id,
            "kind": self.kind,
            "severity": self.severity.value,
            "start_s": _clean(self.start_s),
            "end_s": _clean(self.end_s),
            "open": self.open,
            "node": self.node,
            "gpu": self.gpu,
            "pid": self.pid,
            "summary": self.summary,
            "evidence": [e.to_dict() for e in self.evidence],
            "caused_by": list(self.caused_by),
            "runbook": self.runbook,
            "fixes": list(self.fixes),
        }
        # Only on Kubernetes and under MIG: the schema elsewhere is unchanged.
        for label in ("pod", "namespace", "container", "gpu_instance", "compute_instance"):
            if getattr(self, label) is not None:
                d[label] = getattr(self, label)
        if self.details:
            d["details"] = {k: _clean(v) for k, v in self.details.items()}
        return d


def _clean(v):
    """JSON-safe numbers: NaN/inf become None; floats keep 6 decimals (µs for times, also Unix times)."""
    if isinstance(v, float):
        if math.isnan(v) or math.isinf(v):
            return None
        return round(v, 6)
    if hasattr(v, "item") and not isinstance(v, (str, bytes)):  # numpy scalars
        return _clean(v.item())
    return v


def deep_clean(v):
    """:func:`_clean` applied through nested dicts and lists: a document ready for json.dumps."""
    if isinstance(v, dict):
        return {k: deep_clean(x) for k, x in v.items()}
    if isinstance(v, list):
        return [deep_clean(x) for x in v]
    return _clean(v)


def json_ready(value: Any) -> Any:
    """``value`` as JSON takes it: NaN and infinities become null, numpy scalars numbers, keys strings,
    anything else its text. Every ``--json`` writer applies it before ``json.dumps`` (unlike
    :func:`deep_clean`, floats keep every digit)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_ready(v) for v in value]
    if isinstance(value, (str, int, bool)) or value is None:
        return value
    if hasattr(value, "item"):  # a numpy scalar
        return json_ready(value.item())
    return str(value)


def worst_severity(findings: list[Finding]) -> Severity | None:
    """The highest severity among findings, or None for an empty list."""
    if not findings:
        return None
    return max((f.severity for f in findings), key=lambda s: s.rank)


ALERT_PREFIX = "Gpudiag"


def alert_name(kind: str) -> str:
    """The alert (and runbook) name of a finding kind: kv_eviction_storm -> GpudiagKvEvictionStorm."""
    return ALERT_PREFIX + "".join(part.capitalize() for part in kind.split("_"))
