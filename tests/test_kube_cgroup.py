"""/proc/PID/cgroup -> pod UID, container ID, QoS and runtime, in every form a node writes.

The texts below are whole /proc/PID/cgroup files in the forms the kubelet
(cgroup_manager_linux.go: ``kubepods[/QOS]/pod<UID>``, ``-`` -> ``_`` under
systemd), containerd (``cri-containerd-<id>.scope`` or ``<id>``), CRI-O
(``crio-<id>.scope``, ``crio-conmon-<id>.scope``) and docker
(``docker-<id>.scope``, ``/docker/<id>``) give them.
"""

from __future__ import annotations

import os

import pytest

from gpudiag.probes.kube_cgroup import parse_cgroup, parse_cgroup_path, read_identity

UID = "1f2e3d4c-5b6a-4987-a6b5-c4d3e2f1a0b9"
UID_ = UID.replace("-", "_")
CID = "9ec39b91f3d70e1beff50a308f77067065ea6be0d91a3378375056cd4422cf3d"
STATIC_UID = "3c1f0d5e2a9b4c7d8e6f1a2b3c4d5e6f"  # a static pod: the manifest's hash

V1_CONTROLLERS = ["12:hugetlb", "11:memory", "10:devices", "9:pids", "8:cpu,cpuacct", "7:blkio",
                  "6:freezer", "5:net_cls,net_prio", "4:perf_event", "3:cpuset", "2:rdma",
                  "1:name=systemd"]


def v1(path):
    """A cgroup v1 file: every hierarchy in the same path, as the kubelet creates them."""
    return "\n".join(f"{c}:{path}" for c in V1_CONTROLLERS) + "\n"


def hybrid(path):
    return v1(path) + f"0::{path}\n"


CASES = [
    # (name, file text, pod uid, container id, qos, runtime)
    ("v2 systemd containerd burstable",
     f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/cri-containerd-{CID}.scope\n",
     UID, CID, "burstable", "containerd"),
    ("v2 systemd containerd besteffort",
     f"0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID_}.slice/cri-containerd-{CID}.scope\n",
     UID, CID, "besteffort", "containerd"),
    ("v2 systemd containerd guaranteed",
     f"0::/kubepods.slice/kubepods-pod{UID_}.slice/cri-containerd-{CID}.scope\n",
     UID, CID, "guaranteed", "containerd"),
    ("v2 systemd cri-o",
     f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/crio-{CID}.scope\n",
     UID, CID, "burstable", "cri-o"),
    ("v2 systemd cri-o conmon",
     f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/crio-conmon-{CID}.scope\n",
     UID, None, "burstable", "cri-o-conmon"),  # the monitor: in the pod, in no container
    ("v2 systemd docker (cri-dockerd)",
     f"0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID_}.slice/docker-{CID}.scope\n",
     UID, CID, "besteffort", "docker"),
    ("v2 cgroupfs containerd",
     f"0::/kubepods/burstable/pod{UID}/{CID}\n", UID, CID, "burstable", None),
    ("v2 cgroupfs guaranteed",
     f"0::/kubepods/pod{UID}/{CID}\n", UID, CID, "guaranteed", None),
    ("v2 cgroupfs cri-o",
     f"0::/kubepods/besteffort/pod{UID}/crio-{CID}\n", UID, CID, "besteffort", "cri-o"),
    ("v2 static pod (hash UID)",
     f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{STATIC_UID}.slice/cri-containerd-{CID}.scope\n",
     STATIC_UID, CID, "burstable", "containerd"),
    ("v2 kind node (kubelet cgroup root)",
     f"0::/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-besteffort.slice/"
     f"kubelet-kubepods-besteffort-pod{UID_}.slice/cri-containerd-{CID}.scope\n",
     UID, CID, "besteffort", "containerd"),
    ("v2 seen from inside a cgroup namespace",
     f"0::/../../kubepods-besteffort-pod{UID_}.slice/cri-containerd-{CID}.scope\n",
     UID, CID, "besteffort", "containerd"),
    ("v2 nested cgroup inside the container",
     f"0::/kubepods.slice/kubepods-pod{UID_}.slice/cri-containerd-{CID}.scope/init.scope\n",
     UID, CID, "guaranteed", "containerd"),
    ("v1 systemd docker",
     v1(f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/docker-{CID}.scope"),
     UID, CID, "burstable", "docker"),
    ("v1 cgroupfs docker", v1(f"/kubepods/besteffort/pod{UID}/{CID}"), UID, CID, "besteffort", None),
    ("v1 systemd cri-o", v1(f"/kubepods.slice/kubepods-pod{UID_}.slice/crio-{CID}.scope"),
     UID, CID, "guaranteed", "cri-o"),
    ("hybrid systemd containerd",
     hybrid(f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/cri-containerd-{CID}.scope"),
     UID, CID, "burstable", "containerd"),
    ("docker outside kubernetes, systemd", f"0::/system.slice/docker-{CID}.scope\n", None, CID, None, "docker"),
    ("docker outside kubernetes, cgroupfs v1", v1(f"/docker/{CID}"), None, CID, None, "docker"),
    ("podman", f"0::/machine.slice/libpod-{CID}.scope/container\n", None, CID, None, "podman"),
    ("podman conmon", f"0::/machine.slice/libpod-conmon-{CID}.scope\n", None, None, None, None),  # names nothing
    ("pod cgroup itself (no container)",
     f"0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID_}.slice\n",
     UID, None, "besteffort", None),
]


@pytest.mark.parametrize("name,text,uid,cid,qos,runtime", CASES, ids=[c[0] for c in CASES])
def test_every_form(name, text, uid, cid, qos, runtime):
    ident = parse_cgroup(text)
    assert (ident.pod_uid, ident.container_id, ident.qos, ident.runtime) == (uid, cid, qos, runtime)


@pytest.mark.parametrize("text", [
    "0::/user.slice/user-1000.slice/session-3.scope\n",
    v1("/system.slice/sshd.service"),
    "0::/\n",
    "",
    "garbage without colons\n",
    "0::/system.slice/containerd.service\n",       # the runtime daemon is not a container
    "0::/kubepods.slice\n",                       # the kubepods root holds no pod
])
def test_host_processes_name_nothing(text):
    ident = parse_cgroup(text)
    assert ident.pod_uid is None and ident.container_id is None and not ident.in_pod


def test_a_short_or_upper_case_id_is_not_a_container():
    assert parse_cgroup_path("/system.slice/docker-abc123.scope").container_id is None
    assert parse_cgroup_path(f"/docker/{CID.upper()}").container_id is None


def test_v1_best_line_wins_when_hierarchies_disagree():
    # A process moved in one v1 hierarchy only (e.g. by a tool in the cpu controller): the
    # lines that still name the pod and container win over one that names neither.
    text = v1(f"/kubepods/burstable/pod{UID}/{CID}").replace(
        f"8:cpu,cpuacct:/kubepods/burstable/pod{UID}/{CID}", "8:cpu,cpuacct:/user.slice")
    assert parse_cgroup(text).container_id == CID


def test_read_identity_of_this_process_and_of_a_gone_one():
    own = read_identity(os.getpid())
    assert own is not None                  # readable; names no pod on a development machine
    assert read_identity(2**22 + 12345) is None  # beyond pid_max: no such process
