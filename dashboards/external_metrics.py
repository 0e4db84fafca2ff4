"""Metric names that other exporters own, used by the dashboards and alert rules.

gpudiag's own names (and the vLLM dialect) come from gpudiag/catalog.py; the
two golden signals below are measured by exporters that every Kubernetes
node runs already, so gpudiag does not export them itself. Their names are
spelled here, once, with the exporter that defines them.
"""

from __future__ import annotations

# node_exporter (prometheus/node_exporter, cpu collector): seconds each CPU
# spent per mode; mode="iowait" is time idle while a disk request was pending.
NODE_CPU_SECONDS_TOTAL = "node_cpu_seconds_total"

# kube-state-metrics (kubernetes/kube-state-metrics, pod metrics): 1 for the
# phase a pod is in (Pending, Running, Succeeded, Failed, Unknown).
KUBE_POD_STATUS_PHASE = "kube_pod_status_phase"

# Prometheus itself: one series per pending or firing alert.
PROMETHEUS_ALERTS = "ALERTS"

EXTERNAL_METRICS: dict[str, str] = {
    NODE_CPU_SECONDS_TOTAL: "node_exporter",
    KUBE_POD_STATUS_PHASE: "kube-state-metrics",
    PROMETHEUS_ALERTS: "prometheus",
}
