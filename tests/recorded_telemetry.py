"""Test support for recorded telemetry: where the real files are, and conversions into formats --file reads."""

from __future__ import annotations

import csv
import gzip
import re
from collections import defaultdict
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
REAL = REPO / ".." / "shared" / "data" / "real"
SERIES = REAL / "series"
MIB = 1 << 20


def real(*parts: str) -> Path:
    """A file of the real data, or a skip that says why it is missing."""
    path = SERIES.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"real telemetry {path} is absent (the shared data folder ../shared/data/real is not here)")
    return path


def alibaba_openmetrics(dest: Path) -> dict[str, int]:
    """Alibaba's per-pod GPU trace as dcgm-exporter would export it, in OpenMetrics with timestamps.

    ``pod_gpu_duty_cycle_anon.csv.gz`` (percent) becomes DCGM_FI_DEV_GPU_UTIL
    (percent, as dcgm-exporter reports it); ``pod_gpu_memory_used_bytes_anon``
    (bytes) becomes DCGM_FI_DEV_FB_USED, which dcgm-exporter reports in MiB.
    The pod label is the trace's container_ip. Returns the pods and samples written.
    """
    sources = (("pod_gpu_duty_cycle_anon.csv.gz", "DCGM_FI_DEV_GPU_UTIL", 1.0),
               ("pod_gpu_memory_used_bytes_anon.csv.gz", "DCGM_FI_DEV_FB_USED", 1.0 / MIB))
    pods: set[str] = set()
    samples = 0
    with open(dest, "w") as out:
        for name, metric, scale in sources:
            series: dict[str, list[tuple[float, float]]] = defaultdict(list)
            with gzip.open(real("alibaba", name), "rt", newline="") as f:
                for row in csv.DictReader(f):
                    series[row["container_ip"]].append((float(row["timestamp_anon"]), float(row["value"]) * scale))
            out.write(f"# TYPE {metric} gauge\n")
            for pod in sorted(series):
                pods.add(pod)
                for t, v in sorted(series[pod]):  # promtool wants each series in time order
                    out.write(f'{metric}{{pod="{pod}"}} {v:.6f} {t:.3f}\n')
                    samples += 1
        out.write("# EOF\n")
    return {"pods": len(pods), "samples": samples}


def dcgm_exposition(long_csv: Path, dest: Path, *, scrapes: int = 1, timestamps_ms: float | None = None,
                    step_s: float = 30.0) -> int:
    """dcgm-exporter's own text exposition of the series of a long-CSV dump (its real label sets).

    ``scrapes`` copies are concatenated; with ``timestamps_ms`` each sample
    carries its scrape's time (Prometheus text format: milliseconds). Returns
    the sample lines written.
    """
    rows = list(csv.DictReader(open(long_csv, newline="")))
    by_metric: dict[str, list[dict[str, str]]] = defaultdict(list)
    for r in rows:
        by_metric[r["metric_name"]].append(r)
    written = 0
    with open(dest, "w") as out:
        for k in range(scrapes):
            for metric, rs in by_metric.items():
                out.write(f"# HELP {metric} {metric}\n# TYPE {metric} gauge\n")
                for r in rs:
                    pairs = re.findall(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"', r["labels_raw"])
                    labels = ",".join(f'{k}="{v}"' for k, v in pairs if k != "__name__")
                    stamp = "" if timestamps_ms is None else f" {int(timestamps_ms + k * step_s * 1000)}"
                    out.write(f"{metric}{{{labels}}} {r['value']}{stamp}\n")
                    written += 1
    return written
