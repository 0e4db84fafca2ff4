"""The kubelet pod-resources client against a real gRPC server of the v1 proto on a unix socket.

The failure modes are the real ones: no socket, a socket the agent may not
open (a forked child that dropped root), a socket nobody listens on, a
kubelet that does not answer in time, and a kubelet without ``Get``. Each
gives one line.
"""

from __future__ import annotations

import os
import socket

import pytest

grpc = pytest.importorskip("grpc", reason="grpcio (the kubernetes extra) is not installed")

from kubelet_support import KubeletPodResources  # noqa: E402

from gpudiag.probes.pod_resources import PodResourcesClient, PodResourcesError  # noqa: E402

GPU0 = "GPU-5a1a3c7e-0b0e-6f1d-2c3b-4a5d6e7f8091"
GPU1 = "GPU-6b2b4d8f-1c1f-7a2e-3d4c-5b6e7f809102"
MIG = "MIG-0c1d2e3f-4a5b-5c6d-8e9f-a0b1c2d3e4f5"

PODS = [
    ("vllm-llama-0", "serving", [("vllm", "nvidia.com/gpu", [GPU0])]),
    # GPU 1 time-sliced by the NVIDIA device plugin: two pods get replicas of one GPU.
    ("notebook-ana", "research", [("jupyter", "nvidia.com/gpu", [f"{GPU1}::0"])]),
    ("batch-embed-7f9c", "batch", [("embedder", "nvidia.com/gpu", [f"{GPU1}::3"]),
                                   ("sidecar", "cpu", [])]),
    ("mig-job", "research", [("train", "nvidia.com/mig-1g.10gb", [MIG])]),
    ("nic-user", "net", [("app", "example.com/sriov", ["0000:3b:00.1"])]),
]


@pytest.fixture
def kubelet(tmp_path):
    path = str(tmp_path / "kubelet.sock")
    server = KubeletPodResources(PODS, allocatable=[("nvidia.com/gpu", GPU0), ("nvidia.com/gpu", GPU1)]).start(path)
    yield server, path
    server.stop()


def test_list_gives_pod_namespace_container_per_device(kubelet):
    server, path = kubelet
    with PodResourcesClient(path) as client:
        devices = client.list()
        holders = client.gpu_holders()
    assert {(d.pod, d.namespace, d.container, d.device_id) for d in devices} >= {
        ("vllm-llama-0", "serving", "vllm", GPU0), ("mig-job", "research", "train", MIG)}
    assert [(d.pod, d.container) for d in holders[GPU0]] == [("vllm-llama-0", "vllm")]
    # A time-sliced GPU's replicas fold onto the physical GPU: both pods hold it.
    assert sorted(d.pod for d in holders[GPU1]) == ["batch-embed-7f9c", "notebook-ana"]
    assert holders[MIG][0].resource == "nvidia.com/mig-1g.10gb"
    assert "0000:3b:00.1" not in holders  # not a GPU resource


def test_get_and_allocatable(kubelet):
    server, path = kubelet
    client = PodResourcesClient(path)
    assert [(d.container, d.device_id) for d in client.get("vllm-llama-0", "serving")] == [("vllm", GPU0)]
    assert client.allocatable() == [("nvidia.com/gpu", GPU0), ("nvidia.com/gpu", GPU1)]
    with pytest.raises(PodResourcesError, match="NOT_FOUND: pod nope not found in serving"):
        client.get("nope", "serving")
    client.close()
    assert server.calls == ["Get", "GetAllocatableResources", "Get"]


def test_get_on_a_kubelet_without_it(tmp_path):
    path = str(tmp_path / "kubelet.sock")
    server = KubeletPodResources(PODS, serve_get=False).start(path)
    try:
        with pytest.raises(PodResourcesError, match="does not serve pod-resources Get"):
            PodResourcesClient(path).get("vllm-llama-0", "serving")
    finally:
        server.stop()


def _one_line(excinfo) -> str:
    text = str(excinfo.value)
    assert "\n" not in text and "Traceback" not in text
    return text


def test_socket_missing(tmp_path):
    with pytest.raises(PodResourcesError) as e:
        PodResourcesClient(str(tmp_path / "kubelet.sock")).list()
    assert "not found" in _one_line(e) and "not a Kubernetes node" in _one_line(e)


def test_nothing_listening(tmp_path):
    path = str(tmp_path / "kubelet.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)  # a socket file left behind by a kubelet that is gone: bound, never listening
    try:
        with pytest.raises(PodResourcesError) as e:
            PodResourcesClient(path).list()
        assert "nothing listens" in _one_line(e) and "kubelet running" in _one_line(e)
    finally:
        s.close()


def test_a_plain_file_is_not_a_socket(tmp_path):
    path = tmp_path / "kubelet.sock"
    path.write_text("")
    with pytest.raises(PodResourcesError) as e:
        PodResourcesClient(str(path)).list()
    assert str(path) in _one_line(e)


def test_kubelet_that_does_not_answer_in_time(tmp_path):
    path = str(tmp_path / "kubelet.sock")
    server = KubeletPodResources(PODS, delay_s=2.0).start(path)
    try:
        with pytest.raises(PodResourcesError) as e:
            PodResourcesClient(path, timeout_s=0.3).list()
        assert "did not answer within 0.3 s" in _one_line(e)
    finally:
        server.stop()


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping to another user needs root")
def test_permission_denied_for_an_unprivileged_agent(kubelet, tmp_path):
    """The kubelet's socket is root's; an agent running as another user is told so."""
    server, path = kubelet
    os.chmod(path, 0o600)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop to nobody, then try; only the socket check runs before it fails
        try:
            os.close(read)
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            try:
                PodResourcesClient(path).list()
                msg = "no error"
            except PodResourcesError as e:
                msg = str(e)
            os.write(write, msg.encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        msg = f.read()
    os.waitpid(pid, 0)
    assert msg.startswith("permission denied on kubelet pod-resources socket") and "root" in msg
