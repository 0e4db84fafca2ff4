"""A gRPC server of the kubelet's PodResourcesLister v1 on a unix socket, for tests.

It serves the real v1 messages (probes/proto/podresources_v1.proto) with
grpcio's own server, so the client meets the wire format, status codes and
socket behaviour of a kubelet. ``pods`` is a list of
``(pod, namespace, [(container, resource, [device ids])])``.
"""

from __future__ import annotations

import time
from concurrent import futures

import grpc

from gpudiag.probes.proto import podresources_v1_pb2 as pb


def pod_message(name, namespace, containers):
    return pb.PodResources(name=name, namespace=namespace, containers=[
        pb.ContainerResources(name=c, devices=[pb.ContainerDevices(resource_name=r, device_ids=list(ids))])
        for c, r, ids in containers])


class KubeletPodResources:
    """Start with ``start(path)``; ``stop()`` ends it. ``delay_s`` makes every answer late."""

    def __init__(self, pods, allocatable=(), *, serve_get=True, delay_s=0.0):
        self.pods = pods
        self.allocatable = allocatable
        self.serve_get = serve_get
        self.delay_s = delay_s
        self.calls: list[str] = []
        self.server = None

    def _list(self, request, context):
        self.calls.append("List")
        time.sleep(self.delay_s)
        return pb.ListPodResourcesResponse(pod_resources=[pod_message(*p) for p in self.pods])

    def _get(self, request, context):
        self.calls.append("Get")
        if not self.serve_get:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "Get is not enabled")
        for p in self.pods:
            if p[0] == request.pod_name and p[1] == request.pod_namespace:
                return pb.GetPodResourcesResponse(pod_resources=pod_message(*p))
        context.abort(grpc.StatusCode.NOT_FOUND,
                      f"pod {request.pod_name} not found in {request.pod_namespace}")

    def _allocatable(self, request, context):
        self.calls.append("GetAllocatableResources")
        by_resource: dict[str, list[str]] = {}
        for r, i in self.allocatable:
            by_resource.setdefault(r, []).append(i)
        return pb.AllocatableResourcesResponse(
            devices=[pb.ContainerDevices(resource_name=r, device_ids=ids) for r, ids in by_resource.items()])

    def start(self, path: str) -> KubeletPodResources:
        handler = grpc.method_handlers_generic_handler("v1.PodResourcesLister", {
            "List": grpc.unary_unary_rpc_method_handler(
                self._list, request_deserializer=pb.ListPodResourcesRequest.FromString,
                response_serializer=pb.ListPodResourcesResponse.SerializeToString),
            "Get": grpc.unary_unary_rpc_method_handler(
                self._get, request_deserializer=pb.GetPodResourcesRequest.FromString,
                response_serializer=pb.GetPodResourcesResponse.SerializeToString),
            "GetAllocatableResources": grpc.unary_unary_rpc_method_handler(
                self._allocatable, request_deserializer=pb.AllocatableResourcesRequest.FromString,
                response_serializer=pb.AllocatableResourcesResponse.SerializeToString),
        })
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        self.server.add_generic_rpc_handlers((handler,))
        self.server.add_insecure_port("unix://" + path)
        self.server.start()
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop(grace=None).wait()
            self.server = None
