"""A real process in a real kubepods-style cgroup: the parser and the eBPF probe name its pod and container.

Only in a cgroup v2 hierarchy without controllers (on these machines the
``unified`` mount beside the v1 hierarchies): moving a process there changes
no limit or accounting. The memory, cpu and pids cgroups the machine gave the
process are checked to be the same before and after. The slice is created
for the test and removed afterwards.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from ebpf_support import EBPF_SKIP
from test_ebpf_probe import built, fresh_shim  # noqa: F401 - built is a fixture

from gpudiag.frames import Frame
from gpudiag.probes.kube import PodResolver
from gpudiag.probes.kube_cgroup import read_identity

KEEP_V1 = ("memory", "cpu", "pids")




def controllerless_v2_mount() -> str | None:
    """The mount point of a cgroup2 hierarchy that enables no controller below its root, or None.

    Its root may list a controller no v1 hierarchy took (hugetlb here) in
    ``cgroup.controllers``; with ``cgroup.subtree_control`` empty, no cgroup made
    under it has any, so a process moved there keeps every limit and count it had.
    """
    try:
        with open("/proc/self/mounts") as f:
            mounts = [line.split() for line in f]
    except OSError:
        return None
    for fields in mounts:
        if len(fields) >= 3 and fields[2] == "cgroup2":
            try:
                if Path(fields[1], "cgroup.subtree_control").read_text().split():
                    continue  # controllers on below the root: moving a process would change its limits
            except OSError:
                continue
            return fields[1]
    return None


MOUNT = controllerless_v2_mount()
SKIP = ("moving a process between cgroups needs root" if os.geteuid() != 0 else
        None if MOUNT else "no cgroup v2 hierarchy without controllers below its root here (a pure v2 host "
                           "has only the controlled one, where a moved process would change its limits)")


def _v1_lines(pid: int) -> dict[str, str]:
    out = {}
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for c in controllers.split(","):
            out[c] = path
    return {c: out.get(c) for c in KEEP_V1}


@pytest.fixture
def pod_slice():
    """A kubepods.slice/.../cri-containerd-<id>.scope tree under the controller-less mount; removed after."""
    if SKIP:
        pytest.skip(SKIP)
    uid, cid = str(uuid.uuid4()), secrets.token_hex(32)
    top = Path(MOUNT, "kubepods.slice")
    if top.exists():
        pytest.skip(f"{top} exists already (not ours to use)")
    leaf = (top / "kubepods-besteffort.slice" / f"kubepods-besteffort-pod{uid.replace('-', '_')}.slice"
            / f"cri-containerd-{cid}.scope")
    leaf.mkdir(parents=True)
    try:
        assert (leaf / "cgroup.controllers").read_text().split() == []
        yield uid, cid, leaf
    finally:
        for d in [leaf, *leaf.parents]:
            if d == Path(MOUNT):
                break
            for _ in range(50):  # a killed process leaves its cgroup when it is reaped
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.1)
        assert not top.exists()


def test_a_process_moved_into_a_pod_slice_is_named_by_its_cgroup(pod_slice, tmp_path):
    uid, cid, leaf = pod_slice
    child = subprocess.Popen(["sleep", "60"])
    try:
        before = _v1_lines(child.pid)
        (leaf / "cgroup.procs").write_text(str(child.pid))
        assert _v1_lines(child.pid) == before  # memory, cpu and pids untouched
        ident = read_identity(child.pid)
        assert (ident.pod_uid, ident.container_id, ident.qos, ident.runtime) == (uid, cid, "besteffort", "containerd")
        # With the kubelet's log link for that container, the agent names the pod.
        links = tmp_path / "containers"
        links.mkdir()
        (links / f"trainer-0_research_trainer-{cid}.log").write_text("")
        rows = PodResolver(pod_resources_socket=None, container_logs_dir=str(links), pod_logs_dir=None).annotate(
            [Frame("process", 1.0, [{"pid": child.pid, "gpu": 0}])])[0].rows
        assert (rows[0]["pod"], rows[0]["namespace"], rows[0]["container"], rows[0]["pod_uid"]) == (
            "trainer-0", "research", "trainer", uid)
    finally:
        child.kill()
        child.wait()


@pytest.mark.ebpf
@pytest.mark.skipif(EBPF_SKIP is not None, reason=str(EBPF_SKIP))
def test_probe_cuda_json_names_the_pod_and_container_of_a_process_in_a_pod_slice(built, pod_slice):  # noqa: F811
    """`probe cuda --json` over a command that moves itself into the slice, then execs a CUDA workload."""
    uid, cid, leaf = pod_slice
    lib = fresh_shim(built)
    script = 'echo $$ > "$2/cgroup.procs" && exec "$0" "$1" --late-ms 100 >/dev/null'
    argv = [sys.executable, "-m", "gpudiag", "probe", "cuda", "--json", "--", "sh", "-c", script,
            str(built / "driver_workload"), lib, str(leaf)]
    res = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    (entry,) = [p for p in doc["processes"] if p["apis"]]
    assert (entry["pod_uid"], entry["container_id"], entry["container_runtime"], entry["pod_qos"]) == (
        uid, cid, "containerd", "besteffort")
