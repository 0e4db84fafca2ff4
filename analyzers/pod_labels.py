"""Pod, namespace and container (and MIG instance) on findings, from the window's own process and GPU rows.

The agent puts ``pod``, ``namespace`` and ``container`` on process rows
(gpudiag.probes.kube); dcgm-exporter puts them on its GPU series, which
``investigate --prometheus`` reads into GPU rows. A finding about a process
takes that process's last labels; a finding about a GPU takes its pod when
exactly one pod ran on it in the window (a shared GPU names none: the finding
is about the device, not one tenant). A finding about a process in a MIG
instance takes its GPU and compute instance IDs. Nothing changes on a node
without them.
"""

from __future__ import annotations

from gpudiag.findings import Finding
from gpudiag.frames import Window

from .common import label_int, per_entity

POD_LABELS = ("pod", "namespace", "container")
MIG_LABELS = ("gpu_instance", "compute_instance")


def _last(sub, col):
    if col not in sub:
        return None
    for v in reversed(list(sub[col].to_numpy())):
        if isinstance(v, str) and v:
            return v
        if col in MIG_LABELS and v is not None and not isinstance(v, (str, bool)) and v == v:
            return int(v)
    return None


def _labels_of(sub, cols=POD_LABELS) -> dict:
    return {col: v for col in cols if (v := _last(sub, col)) is not None}


def pods_in(window: Window) -> tuple[dict[tuple, dict[str, str]], dict[tuple, list[dict[str, str]]]]:
    """``({(node, gpu, pid): pod and MIG labels}, {(node, gpu): [pod labels of each pod seen on it]})``."""
    by_pid: dict[tuple, dict[str, str]] = {}
    by_gpu: dict[tuple, list[dict[str, str]]] = {}
    proc = window.rows("process") if window.has("process") else None
    if proc is not None and not proc.empty and ("pod" in proc or "gpu_instance" in proc) and "pid" in proc:
        for key, sub in per_entity(proc, ["node", "gpu", "pid"]):
            labels = _labels_of(sub, POD_LABELS + MIG_LABELS)
            if labels:
                k = (key.get("node"), label_int(key.get("gpu")), label_int(key.get("pid")))
                by_pid[k] = labels
                if labels.get("pod"):
                    by_gpu.setdefault(k[:2], []).append({c: labels[c] for c in POD_LABELS if c in labels})
    gpu = window.rows("gpu") if window.has("gpu") else None
    if gpu is not None and not gpu.empty and "pod" in gpu:
        for key, sub in per_entity(gpu, ["node", "gpu"]):
            labels = _labels_of(sub)
            k = (key.get("node"), label_int(key.get("gpu")))
            if labels.get("pod") and k not in by_gpu:
                by_gpu[k] = [labels]
    return by_pid, by_gpu


def _same_pod(a: dict, b: dict) -> bool:
    return a.get("pod") == b.get("pod") and a.get("namespace") == b.get("namespace")


def attribute(window: Window, findings: list[Finding]) -> list[Finding]:
    """The findings with pod, namespace and container set where the window names them."""
    if not findings:
        return findings
    by_pid, by_gpu = pods_in(window)
    if not by_pid and not by_gpu:
        return findings
    for f in findings:
        if f.pod or f.gpu_instance is not None:
            continue
        labels = None
        if f.pid is not None:
            labels = by_pid.get((f.node, f.gpu, f.pid)) or next(
                (v for (n, _g, p), v in by_pid.items() if p == f.pid and (f.node is None or n == f.node)), None)
        if labels is None and f.gpu is not None:
            pods = by_gpu.get((f.node, f.gpu)) or next(
                (v for (n, g), v in by_gpu.items() if g == f.gpu and f.node is None), None) or []
            if pods and all(_same_pod(pods[0], p) for p in pods):
                labels = dict(pods[0])
                if any(p.get("container") != labels.get("container") for p in pods):
                    labels.pop("container", None)
        if labels:
            f.pod, f.namespace, f.container = labels.get("pod"), labels.get("namespace"), labels.get("container")
            f.gpu_instance, f.compute_instance = labels.get("gpu_instance"), labels.get("compute_instance")
    return findings
