"""Pod, namespace and container of each GPU process: the node's own records, joined per PID and GPU.

Sources, each optional, in the order they are asked:

1. ``/proc/PID/cgroup`` (:mod:`gpudiag.probes.kube_cgroup`): the pod UID and
   container ID of the process. Needs the host PID namespace (``hostPID``).
2. The kubelet's container log links, ``/var/log/containers/<pod>_<namespace>_<container>-<container
   ID>.log`` (kuberuntime's ``logSymlink``, made for every container whatever
   the runtime): container ID -> pod, namespace and container name.
3. The kubelet's pod log folders, ``/var/log/pods/<namespace>_<pod>_<pod UID>/``:
   pod UID -> pod and namespace (a container the link does not name yet).
4. The kubelet's pod-resources API (:mod:`gpudiag.probes.pod_resources`): GPU
   UUID -> the containers it is allocated to. Alone it attributes a process
   on a GPU held by one container (as dcgm-exporter does); on a shared GPU
   (time-slicing, MPS) it lists every pod sharing it, and the cgroup's pod
   UID with sources 2-3 picks the process's own.
5. The API server (``api``, :mod:`gpudiag.probes.kube_api`, from a kubeconfig):
   the node's pods by UID and container ID, where the log names cannot be read.
6. ``static``: pid -> labels given by the caller (the simulated node).

A label no source gives stays absent (never a guess). The lists and the
PIDs' cgroups are re-read every ``refresh_s``.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Iterable
from typing import Any

from gpudiag.frames import Frame
from gpudiag.probes.kube_cgroup import CgroupIdentity, parse_cgroup
from gpudiag.probes.pod_resources import DEFAULT_SOCKET, PodResourcesClient, PodResourcesError

log = logging.getLogger(__name__)

POD_LABELS = ("pod", "namespace", "container")
ID_KEYS = ("pod_uid", "container_id")
CONTAINER_LOGS_DIR = "/var/log/containers"
POD_LOGS_DIR = "/var/log/pods"
# The kubelet lists are re-read at this pace: pods start in seconds, and a List costs the
# kubelet a walk of its pod manager.
REFRESH_S = 10.0
# Frame kinds whose rows name a process by pid.
PROCESS_KINDS = ("process", "cuda_api")

_LOG_LINK = re.compile(r"^(?P<pod>[^_/]+)_(?P<ns>[^_/]+)_(?P<container>[^/]+)-(?P<id>[0-9a-f]{64})\.log$")
_POD_DIR = re.compile(r"^(?P<ns>[^_/]+)_(?P<pod>[^_/]+)_(?P<uid>[0-9a-f-]{32,36})$")


def container_log_names(names: Iterable[str]) -> dict[str, tuple[str, str, str]]:
    """``/var/log/containers`` entries -> ``{container ID: (pod, namespace, container)}``."""
    out = {}
    for n in names:
        m = _LOG_LINK.match(n)
        if m:
            out[m.group("id")] = (m.group("pod"), m.group("ns"), m.group("container"))
    return out


def pod_log_dirs(names: Iterable[str]) -> dict[str, tuple[str, str]]:
    """``/var/log/pods`` entries -> ``{pod UID: (pod, namespace)}``."""
    out = {}
    for n in names:
        m = _POD_DIR.match(n)
        if m:
            out[m.group("uid")] = (m.group("pod"), m.group("ns"))
    return out


def _listdir(path: str) -> list[str] | None:
    try:
        return os.listdir(path)
    except OSError:
        return None


class PodResolver:
    """Adds ``pod``, ``namespace``, ``container`` (and ``pod_uid``, ``container_id``) to process rows."""

    def __init__(self, *, proc_root: str = "/proc", pod_resources_socket: str | None = DEFAULT_SOCKET,
                 container_logs_dir: str | None = CONTAINER_LOGS_DIR, pod_logs_dir: str | None = POD_LOGS_DIR,
                 static: dict[int, dict[str, str]] | None = None, refresh_s: float = REFRESH_S,
                 clock=time.monotonic, api=None, node: str | None = None):
        self.proc_root = proc_root
        self.client = PodResourcesClient(pod_resources_socket) if pod_resources_socket else None
        self.container_logs_dir = container_logs_dir
        self.pod_logs_dir = pod_logs_dir
        self.static = {int(k): dict(v) for k, v in (static or {}).items()}
        self.api, self.node = api, node
        self.refresh_s = refresh_s
        self._clock = clock
        self._lock = threading.Lock()
        self._refreshed_at: float | None = None
        self._by_container: dict[str, tuple[str, str, str]] = {}
        self._by_pod_uid: dict[str, tuple[str, str]] = {}
        self._gpu_holders: dict[str, list] = {}
        self._identity: dict[int, CgroupIdentity | None] = {}
        self.errors: dict[str, str] = {}  # source -> why it gave nothing at the last refresh

    # -- the node's lists -----------------------------------------------------------------------
    def refresh(self, force: bool = False) -> None:
        now = self._clock()
        if not force and self._refreshed_at is not None and now - self._refreshed_at < self.refresh_s:
            return
        self._refreshed_at = now
        self._identity = {}  # PIDs are read anew: a PID reused since is not taken for its predecessor
        errors = {}
        if self.container_logs_dir:
            names = _listdir(self.container_logs_dir)
            if names is None:
                errors["container_logs"] = f"{self.container_logs_dir} not readable (not mounted?)"
            self._by_container = container_log_names(names or ())
        if self.pod_logs_dir:
            names = _listdir(self.pod_logs_dir)
            if names is None:
                errors["pod_logs"] = f"{self.pod_logs_dir} not readable (not mounted?)"
            self._by_pod_uid = pod_log_dirs(names or ())
        if self.api is not None:
            from gpudiag.probes.kube_api import KubeApiError

            try:
                names = self.api.node_pods(self.node or os.uname().nodename)
                # The node's own records win; the API server names what they do not.
                self._by_container = {**names.by_container, **self._by_container}
                self._by_pod_uid = {**names.by_uid, **self._by_pod_uid}
            except KubeApiError as e:
                errors["api_server"] = str(e)
        if self.client is not None:
            try:
                self._gpu_holders = self.client.gpu_holders()
            except PodResourcesError as e:
                self._gpu_holders = {}
                errors["pod_resources"] = str(e)
        for source, why in errors.items():
            if self.errors.get(source) != why:
                log.warning("kubernetes attribution: %s", why)
        self.errors = errors

    def identity(self, pid: int) -> CgroupIdentity | None:
        """The cgroup identity of ``pid`` (read once per refresh); None when it cannot be read."""
        got = self._identity.get(pid, False)
        if got is False:
            try:
                with open(f"{self.proc_root}/{pid}/cgroup", encoding="utf-8", errors="replace") as f:
                    got = parse_cgroup(f.read())
            except OSError:
                got = None
            self._identity[pid] = got
        return got

    # -- one process ----------------------------------------------------------------------------
    def resolve(self, pid: int, uuid: str | None = None) -> dict[str, str]:
        """The labels known for process ``pid`` on GPU ``uuid``; absent keys are unknown."""
        out: dict[str, str] = dict(self.static.get(pid, {}))
        ident = self.identity(pid) if pid not in self.static else None
        if ident is not None:
            if ident.pod_uid:
                out["pod_uid"] = ident.pod_uid
            if ident.container_id:
                out["container_id"] = ident.container_id
            named = self._by_container.get(ident.container_id or "")
            if named:
                out.update(pod=named[0], namespace=named[1], container=named[2])
            elif ident.pod_uid and ident.pod_uid in self._by_pod_uid:
                pod, ns = self._by_pod_uid[ident.pod_uid]
                out.update(pod=pod, namespace=ns)
        if "pod" not in out and uuid:
            holders = self._gpu_holders.get(uuid) or []
            pods = {(h.pod, h.namespace) for h in holders}
            # The GPU's one holder is the process's pod unless the cgroup says it is in no pod
            # (a host process using a GPU the kubelet gave to a pod).
            if len(pods) == 1 and not (ident is not None and ident.path and not ident.pod_uid):
                h = holders[0]
                out.update(pod=h.pod, namespace=h.namespace)
                containers = {x.container for x in holders}
                if len(containers) == 1:
                    out["container"] = h.container
        return out

    def sharing(self, uuid: str) -> list[tuple[str, str, str]]:
        """``(namespace, pod, container)`` of every container the kubelet gave GPU ``uuid`` to."""
        return sorted({(h.namespace, h.pod, h.container) for h in self._gpu_holders.get(uuid) or []})

    # -- frames ---------------------------------------------------------------------------------
    def annotate(self, frames: list[Frame]) -> list[Frame]:
        """The frames with pod labels on every row of a process kind that names a pid."""
        if not any(fr.kind in PROCESS_KINDS and fr.rows for fr in frames):
            return frames
        with self._lock:
            self.refresh()
            out = []
            for fr in frames:
                if fr.kind not in PROCESS_KINDS:
                    out.append(fr)
                    continue
                rows = []
                for r in fr.rows:
                    pid = r.get("pid")  # in the agent's PID namespace: the one its /proc shows
                    if pid is None:
                        rows.append(r)
                        continue
                    try:
                        pid = int(pid)
                    except (TypeError, ValueError):
                        rows.append(r)
                        continue
                    # Under MIG the kubelet hands pods MIG devices: their UUID first, then the GPU's.
                    labels = self.resolve(pid, r.get("mig_uuid") or r.get("uuid"))
                    if "pod" not in labels and r.get("mig_uuid"):
                        labels = self.resolve(pid, r.get("uuid"))
                    rows.append({**r, **labels} if labels else r)
                out.append(Frame(fr.kind, fr.t, rows))
        return out

    def status(self) -> dict[str, Any]:
        sources = {
            "cgroup": True,
            "container_logs": bool(self.container_logs_dir) and "container_logs" not in self.errors,
            "pod_logs": bool(self.pod_logs_dir) and "pod_logs" not in self.errors,
            "pod_resources": self.client is not None and "pod_resources" not in self.errors,
            "api_server": self.api is not None and "api_server" not in self.errors,
        }
        return {"name": "kubernetes", "available": True, "sources": sources, "errors": dict(self.errors),
                "reason": "; ".join(self.errors.values())}

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
        if self.api is not None:
            self.api.close()


def on_kubernetes(socket_path: str = DEFAULT_SOCKET, container_logs_dir: str = CONTAINER_LOGS_DIR) -> bool:
    """Whether this looks like a Kubernetes node the agent can see into (socket or container log links)."""
    return os.path.exists(socket_path) or os.path.isdir(container_logs_dir) \
        or bool(os.environ.get("KUBERNETES_SERVICE_HOST"))


class PodLabelled:
    """A probe whose process rows carry pod labels (wraps any probe: NVML, torch, the simulated node).

    Everything else is the inner probe's: the class forwards attributes it does
    not define, so ``drain``, ``hold_after`` and the like keep working.
    """

    def __init__(self, inner, resolver: PodResolver):
        self.inner = inner
        self.resolver = resolver

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def sample(self, now: float) -> list[Frame]:
        return self.resolver.annotate(self.inner.sample(now))

    def drain(self) -> list[Frame]:
        return self.resolver.annotate(self.inner.drain())

    def status(self) -> dict[str, Any]:
        st = dict(self.inner.status())
        st["kubernetes"] = self.resolver.status()
        return st

    def close(self) -> None:
        try:
            self.inner.close()
        finally:
            self.resolver.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def sim_pods() -> dict[int, dict[str, str]]:
    """The simulated node's processes as pods: the engine a vLLM serving pod, the co-tenant a notebook's
    fine-tuning job that landed on the same (time-sliced) GPU."""
    from gpudiag.reference_engine.sim.engine import COTENANT_PID, ENGINE_PID

    return {
        ENGINE_PID: {"pod": "vllm-llama-8b-7d9f6c-x2k4q", "namespace": "serving", "container": "vllm",
                     "pod_uid": "5d0c8a1e-3b7f-4e2a-9c61-0f4b2d8e7a13"},
        COTENANT_PID: {"pod": "finetune-lora-0", "namespace": "research", "container": "trainer",
                       "pod_uid": "a3e9f270-6c1d-4b58-8e2f-71d0c5b94a66"},
    }


def sim_resolver() -> PodResolver:
    """A resolver that names only the simulated processes (reads nothing of this machine)."""
    return PodResolver(pod_resources_socket=None, container_logs_dir=None, pod_logs_dir=None,
                       static=sim_pods(), proc_root="/nonexistent")
