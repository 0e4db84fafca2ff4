"""Which container and Kubernetes pod a process runs in, read from ``/proc/PID/cgroup``.

Pure parsing: :func:`parse_cgroup` takes the file's text and returns a
:class:`CgroupIdentity`; :func:`read_identity` reads the file of one PID.

The forms it knows come from the kubelet and the runtimes that name the cgroups:

* The kubelet names a pod's cgroup ``kubepods[/QOS]/pod<UID>`` (Guaranteed pods
  have no QoS level). With the **systemd** driver each component becomes a
  slice whose name repeats its parents and whose dashes in the UID become
  underscores (systemd reserves ``-`` for nesting)::

      /kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1f2e..._...slice/
      /kubepods.slice/kubepods-pod1f2e..._....slice/                         (Guaranteed)

  With the **cgroupfs** driver the path is plain: ``/kubepods/burstable/pod1f2e-...``.
  A static pod's UID is a 32-hex hash of its manifest, not a UUID.
* The runtime names the container's cgroup inside the pod's: containerd
  ``cri-containerd-<64 hex>.scope`` (systemd) or ``<64 hex>`` (cgroupfs);
  CRI-O ``crio-<64 hex>.scope`` / ``crio-<64 hex>`` (its monitor process sits in
  ``crio-conmon-<id>.scope``, in the pod but in no container); docker and cri-dockerd ``docker-<64 hex>.scope``
  or ``<64 hex>``; podman ``libpod-<64 hex>.scope``. Outside Kubernetes docker
  uses ``/system.slice/docker-<id>.scope`` or ``/docker/<id>``.
* cgroup v2 has one line ``0::PATH``; v1 has one line per hierarchy
  ``N:controllers:PATH`` (``name=systemd`` among them); a hybrid host has both.
  A reader inside a cgroup namespace sees paths relative to its own root, which
  may start with ``/..``; only the path's components matter here.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

__all__ = ["CgroupIdentity", "parse_cgroup", "parse_cgroup_path", "read_identity"]

_HEX64 = r"[0-9a-f]{64}"
# A pod UID: a UUID (dashes, or underscores after systemd escaping) or a static pod's 32-hex hash.
_UID = r"[0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12}|[0-9a-f]{32}"
_POD_COMPONENT = re.compile(
    rf"^(?:[a-z0-9_.-]*?-)?(?:(?P<qos>besteffort|burstable)-)?pod(?P<uid>{_UID})(?:\.slice)?$")
_QOS_COMPONENT = re.compile(
    r"^(?:[a-z0-9_-]*?-)?kubepods-(?P<qos>besteffort|burstable)(?:\.slice)?$|^(?P<plain>besteffort|burstable)$")
_KUBEPODS = re.compile(r"^(?:[a-z0-9_-]*?-)?kubepods(?:\.slice)?$")
# (component regex, runtime name). Order matters: crio-conmon before crio.
_CONTAINER_FORMS = (
    (re.compile(rf"^cri-containerd-(?P<id>{_HEX64})\.scope$"), "containerd"),
    # CRI-O's and podman's monitor processes (conmon) sit beside the container, not in it: the pod is
    # theirs, the container is not (cAdvisor and the kubelet's stats skip these cgroups too).
    (re.compile(rf"^crio-conmon-(?P<id>{_HEX64})\.scope$"), "cri-o-conmon"),
    (re.compile(rf"^libpod-conmon-(?P<id>{_HEX64})\.scope$"), "podman-conmon"),
    (re.compile(rf"^crio-(?P<id>{_HEX64})(?:\.scope)?$"), "cri-o"),
    (re.compile(rf"^docker-(?P<id>{_HEX64})\.scope$"), "docker"),
    (re.compile(rf"^libpod-(?P<id>{_HEX64})\.scope$"), "podman"),
    (re.compile(rf"^(?P<id>{_HEX64})$"), ""),
)


@dataclass(frozen=True)
class CgroupIdentity:
    """Who a process belongs to; a field the cgroup path does not carry is None.

    ``runtime`` is ``containerd``, ``cri-o``, ``docker`` or ``podman`` where the
    path names it; a bare 64-hex ID (the cgroupfs driver of containerd or
    docker) leaves it None. ``qos`` is ``guaranteed``, ``burstable`` or
    ``besteffort`` for a pod. ``path`` is the cgroup path it was read from.
    """

    pod_uid: str | None = None
    container_id: str | None = None
    qos: str | None = None
    runtime: str | None = None
    path: str = ""

    @property
    def in_pod(self) -> bool:
        return self.pod_uid is not None

    def as_dict(self) -> dict:
        return asdict(self)


def parse_cgroup_path(path: str) -> CgroupIdentity:
    """The identity one cgroup path names (``/kubepods.slice/.../cri-containerd-<id>.scope``)."""
    parts = [p for p in path.strip().split("/") if p and p not in (".", "..")]
    pod_uid = container_id = qos = runtime = None
    kube_seen = False
    pod_index = -1
    for i, part in enumerate(parts):
        if _KUBEPODS.match(part):
            kube_seen = True
            continue
        m = _QOS_COMPONENT.match(part)
        if m and (kube_seen or m.group("qos")):
            qos = m.group("qos") or m.group("plain")
            kube_seen = True
            continue
        m = _POD_COMPONENT.match(part)
        if m and (kube_seen or part.endswith(".slice") or "kubepods" in part):
            pod_uid = m.group("uid").replace("_", "-")
            qos = m.group("qos") or qos  # the systemd slice name repeats the QoS level
            pod_index = i
            kube_seen = True
            continue
    # The container is the deepest component that names one (a process may sit in a
    # sub-cgroup the container made for itself, e.g. ``.../cri-containerd-<id>.scope/init.scope``).
    for part in reversed(parts[pod_index + 1:] if pod_index >= 0 else parts):
        for rx, name in _CONTAINER_FORMS:
            m = rx.match(part)
            if m:
                container_id, runtime = m.group("id"), (name or None)
                if name.endswith("-conmon"):
                    container_id = None  # the monitor, not the container it watches
                break
        if runtime is not None and container_id is None:
            break  # a conmon cgroup: no container
        if container_id:
            if runtime is None and "docker" in parts[:-1]:
                runtime = "docker"  # docker's cgroupfs driver outside Kubernetes: /docker/<id>
            break
    if pod_uid is not None and qos is None:
        qos = "guaranteed"
    return CgroupIdentity(pod_uid=pod_uid, container_id=container_id, qos=qos, runtime=runtime,
                          path=path.strip())


def parse_cgroup(text: str) -> CgroupIdentity:
    """The identity in a ``/proc/PID/cgroup`` file (v2, v1 or hybrid); empty when it names none.

    Each line is ``hierarchy-ID:controllers:path``; the path may itself contain
    ``:`` (only the first two colons split). The line naming the most (pod and
    container) wins; on a v1 host all hierarchies normally agree. Lines that
    are not of that form are ignored.
    """
    best = CgroupIdentity()
    best_score = -1
    for line in text.splitlines():
        fields = line.split(":", 2)
        if len(fields) != 3 or not fields[2].startswith("/"):
            continue
        ident = parse_cgroup_path(fields[2])
        score = (2 if ident.pod_uid else 0) + (1 if ident.container_id else 0)
        # Prefer the unified (v2) line and then name=systemd on ties: they exist on every host.
        if score > best_score or (score == best_score and fields[0] == "0"):
            best, best_score = ident, score
    return best if best_score > 0 else CgroupIdentity(path=best.path)


def read_identity(pid: int, proc_root: str = "/proc") -> CgroupIdentity | None:
    """The identity of process ``pid``; None when its cgroup file cannot be read (gone, no permission)."""
    try:
        with open(f"{proc_root}/{int(pid)}/cgroup", encoding="utf-8", errors="replace") as f:
            return parse_cgroup(f.read())
    except (OSError, ValueError):
        return None
