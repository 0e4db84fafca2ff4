"""The kubelet's pod-resources API (PodResourcesLister v1): which pod and container holds which device.

The kubelet serves it over gRPC on a unix socket, by default
``/var/lib/kubelet/pod-resources/kubelet.sock`` (dcgm-exporter reads the same).
``List`` gives every pod's containers with the device IDs the device plugins
allocated to them: for ``nvidia.com/gpu`` these are GPU UUIDs (``GPU-...``),
MIG device UUIDs (``MIG-...``) under MIG strategies, and ``<uuid>::<n>``
replicas when the NVIDIA device plugin time-slices a GPU. ``Get`` returns one
pod (beta, on by default since Kubernetes 1.34); ``GetAllocatableResources``
the devices the node offers.

The messages come from ``probes/proto/podresources_v1.proto`` (the kubelet's
v1 API); gRPC comes from ``grpcio`` (the ``kubernetes`` extra). Every failure
becomes a :class:`PodResourcesError` with one line saying what to do.
"""

from __future__ import annotations

import errno
import os
import socket
from dataclasses import dataclass

from gpudiag.errors import GpudiagError

DEFAULT_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"
SERVICE = "/v1.PodResourcesLister/"
# A kubelet answers List in milliseconds; two seconds leaves room for a loaded node
# without stalling the agent's tick for long when it hangs.
DEFAULT_TIMEOUT_S = 2.0
GPU_RESOURCE_PREFIX = "nvidia.com/"


class PodResourcesError(GpudiagError):
    """The pod-resources API could not be read; the message is one line saying why."""


@dataclass(frozen=True)
class ContainerDevice:
    """One device allocated to one container of one pod."""

    pod: str
    namespace: str
    container: str
    resource: str      # e.g. nvidia.com/gpu, nvidia.com/mig-1g.10gb
    device_id: str     # as the device plugin named it (may carry a ``::n`` replica suffix)

    @property
    def gpu_id(self) -> str:
        """The physical device's ID: a time-sliced replica ``GPU-x::3`` is ``GPU-x``."""
        return base_device_id(self.device_id)


def base_device_id(device_id: str) -> str:
    """``GPU-x::3`` (a time-sliced replica of the NVIDIA device plugin) -> ``GPU-x``; others unchanged."""
    return device_id.split("::", 1)[0]


def _messages():
    try:
        from gpudiag.probes.proto import podresources_v1_pb2 as pb
    except Exception as e:  # noqa: BLE001 - no protobuf, or one older than the generated code (VersionError)
        raise PodResourcesError(f"the pod-resources messages need protobuf >= 7.35 ({type(e).__name__}): "
                                "pip install 'gpudiag[kubernetes]'") from None
    return pb


def _grpc():
    try:
        import grpc
    except ImportError as e:
        raise PodResourcesError(
            "reading the kubelet's pod-resources API needs grpcio: pip install 'gpudiag[kubernetes]'") from e
    return grpc


def check_socket(path: str) -> None:
    """Fail with one clear line unless something accepts connections on the unix socket ``path``.

    gRPC retries a failed connect until its deadline and then says only
    "failed to connect"; a plain connect first tells missing, not-a-socket,
    permission denied and nobody-listening apart.
    """
    try:
        os.stat(path)
    except FileNotFoundError:
        raise PodResourcesError(
            f"kubelet pod-resources socket {path} not found: not a Kubernetes node, or "
            "/var/lib/kubelet/pod-resources is not mounted into the agent's pod") from None
    except PermissionError:
        raise PodResourcesError(
            f"permission denied on kubelet pod-resources socket {path}: the agent must run as root "
            "(the kubelet makes the socket root-only)") from None
    except OSError as e:
        raise PodResourcesError(f"cannot reach kubelet pod-resources socket {path}: {e.strerror or e}") from None
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(DEFAULT_TIMEOUT_S)
    try:
        s.connect(path)
    except PermissionError:
        raise PodResourcesError(
            f"permission denied on kubelet pod-resources socket {path}: the agent must run as root "
            "(the kubelet makes the socket root-only)") from None
    except ConnectionRefusedError:
        raise PodResourcesError(
            f"nothing listens on kubelet pod-resources socket {path}: is the kubelet running?") from None
    except OSError as e:
        if e.errno == errno.ENOTSOCK or e.errno == errno.ECONNREFUSED:
            raise PodResourcesError(f"{path} is not a listening unix socket: is the kubelet running?") from None
        raise PodResourcesError(f"cannot connect to kubelet pod-resources socket {path}: {e.strerror or e}") from None
    finally:
        s.close()


class PodResourcesClient:
    """A client of one kubelet's PodResourcesLister v1 service on its unix socket."""

    def __init__(self, socket_path: str = DEFAULT_SOCKET, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.socket_path = socket_path
        self.timeout_s = timeout_s
        self._channel = None
        self._calls: dict = {}

    def _call(self, method: str, request, response_type):
        grpc = _grpc()
        if self._channel is None:
            check_socket(self.socket_path)
            self._channel = grpc.insecure_channel("unix://" + os.path.abspath(self.socket_path))
        call = self._calls.get(method)
        if call is None:
            call = self._calls[method] = self._channel.unary_unary(
                SERVICE + method, request_serializer=type(request).SerializeToString,
                response_deserializer=response_type.FromString)
        try:
            return call(request, timeout=self.timeout_s)
        except grpc.RpcError as e:
            code = e.code() if hasattr(e, "code") else None
            self.close()  # a fresh channel (and socket check) next time
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise PodResourcesError(
                    f"kubelet pod-resources {method} on {self.socket_path} did not answer within "
                    f"{self.timeout_s:g} s") from None
            if code == grpc.StatusCode.UNIMPLEMENTED:
                raise PodResourcesError(
                    f"this kubelet does not serve pod-resources {method} (too old, or its feature gate is off)"
                ) from None
            if code == grpc.StatusCode.UNAVAILABLE:
                raise PodResourcesError(
                    f"kubelet pod-resources on {self.socket_path} unavailable: {_detail(e)}") from None
            raise PodResourcesError(
                f"kubelet pod-resources {method} failed: {code.name if code else 'error'}: {_detail(e)}") from None

    def list(self) -> list[ContainerDevice]:
        """Every device allocated to every container on the node (all resources)."""
        pb = _messages()
        resp = self._call("List", pb.ListPodResourcesRequest(), pb.ListPodResourcesResponse)
        return [d for pod in resp.pod_resources for d in _devices_of(pod)]

    def get(self, pod: str, namespace: str) -> list[ContainerDevice]:
        """The devices of one pod."""
        pb = _messages()
        resp = self._call("Get", pb.GetPodResourcesRequest(pod_name=pod, pod_namespace=namespace),
                          pb.GetPodResourcesResponse)
        return _devices_of(resp.pod_resources)

    def allocatable(self) -> list[tuple[str, str]]:
        """``(resource, device_id)`` of every device the node offers to pods."""
        pb = _messages()
        resp = self._call("GetAllocatableResources", pb.AllocatableResourcesRequest(),
                          pb.AllocatableResourcesResponse)
        return [(d.resource_name, i) for d in resp.devices for i in d.device_ids]

    def gpu_holders(self) -> dict[str, list[ContainerDevice]]:
        """GPU (or MIG device) ID -> the containers it is allocated to, several when it is shared."""
        out: dict[str, list[ContainerDevice]] = {}
        for d in self.list():
            if d.resource.startswith(GPU_RESOURCE_PREFIX):
                out.setdefault(d.gpu_id, []).append(d)
        return out

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
        self._channel = None
        self._calls = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def _devices_of(pod) -> list[ContainerDevice]:
    return [ContainerDevice(pod.name, pod.namespace, c.name, d.resource_name, i)
            for c in pod.containers for d in c.devices for i in d.device_ids]


def _detail(e) -> str:
    try:
        text = e.details() or ""
    except Exception:  # noqa: BLE001 - a grpc error without details
        text = ""
    return " ".join(str(text).split()) or "no detail"
