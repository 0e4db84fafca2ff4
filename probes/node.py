"""The probes of one node, opened together: NVML, the host, the in-process torch reporters and the engines.

``open_probes`` is what ``gpudiag top``, the MCP server and the agent read a
node through; ``--sim`` replaces the hardware probes with the simulated GPU's.
"""

from __future__ import annotations

from typing import Any

from gpudiag.catalog import M
from gpudiag.errors import GpudiagError
from gpudiag.frames import Frame
from gpudiag.probes.base import Probe


def open_probes(sim: str | None, *, speed: float = 1.0, seed: int = 0, engine_urls: list[str] = (),
                runtime_dirs: list[str] | None = None, sim_pods: bool = False, kubernetes: str = "auto",
                pod_resources_socket: str | None = None, kubeconfig: str | None = None,
                node: str | None = None) -> list[Probe]:
    """The probes ``top`` reads: the simulated GPU's, or NVML + host + torch reporters + engine endpoints.

    On a Kubernetes node NVML's processes carry their pod (gpudiag.probes.kube); ``sim_pods`` puts
    the simulated processes in pods.
    """
    from gpudiag.probes.engine_scrape import EngineScrapeProbe
    from gpudiag.probes.kube import PodLabelled, PodResolver, on_kubernetes, sim_resolver
    from gpudiag.probes.pod_resources import DEFAULT_SOCKET

    engines = [EngineScrapeProbe(url) for url in engine_urls]
    if sim is not None:
        try:
            from gpudiag.probes.sim import open_sim_probes
        except ImportError:
            raise GpudiagError("the simulated GPU backend is not available") from None
        return [SimNode(PodLabelled(p, sim_resolver()) if sim_pods else p)
                for p in open_sim_probes(sim, speed=speed, seed=seed)] + engines
    from gpudiag.probes.host import HostProbe
    from gpudiag.probes.nvml import NvmlProbe
    from gpudiag.probes.torch_probe import TorchProbe

    latest: dict[str, list[dict[str, Any]]] = {"gpu": [], "nvml": [], "torch": []}

    def uuid_index() -> dict[str, int]:
        return {r["uuid"]: r["gpu"] for r in latest["gpu"] if r.get("uuid")}

    def host_targets() -> list[dict[str, Any]]:
        """NVML's processes, plus those only an in-process reporter names (no NVML, or PID not mapped)."""
        targets = list(latest["nvml"])
        known = {(t.get("uuid"), t.get("pid")) for t in targets}
        targets += [{k: r.get(k) for k in ("gpu", "uuid", "pid", "process")} for r in latest["torch"]
                    if (r.get("uuid"), r.get("pid")) not in known]
        return targets

    nvml_probe = NvmlProbe()
    socket_path = pod_resources_socket or DEFAULT_SOCKET
    pods = kubernetes == "on" or (kubernetes == "auto" and on_kubernetes(socket_path))
    if pods:
        api = None
        if kubeconfig:
            from gpudiag.probes.kube_api import KubeApi

            api = KubeApi(kubeconfig)  # a bad kubeconfig is one line before any probe starts
        resolver = PodResolver(pod_resources_socket=socket_path, api=api, node=node)
    nvml = _Recording(PodLabelled(nvml_probe, resolver) if pods else nvml_probe, latest,
                      {"gpu": "gpu", "process": "nvml"})
    torch_probe = _Recording(TorchProbe(runtime_dirs, gpu_index_by_uuid=uuid_index), latest, {"process": "torch"})
    return [nvml, torch_probe, HostProbe(targets=host_targets)] + engines


class _Recording(Probe):
    """A probe whose last rows other probes follow (the host probe reads the processes NVML lists)."""

    def __init__(self, inner: Probe, latest: dict[str, list[dict[str, Any]]], slots: dict[str, str]):
        self.inner, self.latest, self.slots = inner, latest, slots
        self.name, self.interval_s = inner.name, inner.interval_s

    def sample(self, now: float) -> list[Frame]:
        """The inner probe's frames, remembered by kind."""
        frames = self.inner.sample(now)
        for kind, slot in self.slots.items():
            self.latest[slot] = [r for fr in frames if fr.kind == kind for r in fr.rows]
        return frames

    def status(self) -> dict[str, Any]:
        """The inner probe's status."""
        return self.inner.status()

    def close(self) -> None:
        """Close the inner probe."""
        self.inner.close()


class SimNode(Probe):
    """The simulated GPU's probe, completed with what a real node's probes would name.

    NVML names the GPU and the host probe names the busiest thread; the
    simulated engine reports the thread's CPU figure but not its name, and no
    GPU name. Both come from the engine itself (its GPU spec, its one engine
    loop), here, so that ``top`` reads the same with and without ``--sim``.
    """

    def __init__(self, inner: Probe):
        self.inner = inner
        self.name, self.interval_s = inner.name, inner.interval_s
        engine = getattr(inner, "engine", None)
        spec = getattr(getattr(engine, "gpu", None), "spec", None)
        self.gpu_name = spec.name if spec is not None else None  # the header says the GPU is simulated

    def sample(self, now: float) -> list[Frame]:
        """The inner probe's frames, with the GPU's name and the engine's busiest thread filled in."""
        from gpudiag.reference_engine.sim.engine import ENGINE_PID, ENGINE_THREAD

        frames = self.inner.sample(now)
        for fr in frames:
            for row in fr.rows:
                if fr.kind == "gpu" and self.gpu_name and not row.get("name"):
                    row["name"] = self.gpu_name
                elif (fr.kind == "process" and row.get("pid") == ENGINE_PID and not row.get("top_threads")
                      and row.get(M.process_thread_cpu_max_ratio) is not None):
                    row["top_threads"] = [{"tid": ENGINE_PID, "name": ENGINE_THREAD,
                                           "cpu_ratio": row[M.process_thread_cpu_max_ratio]}]
        return frames

    def status(self) -> dict[str, Any]:
        """The inner probe's status."""
        return self.inner.status()

    def close(self) -> None:
        """Close the inner probe."""
        self.inner.close()


def unique_names(probes: list[Probe]) -> list[str]:
    """Probe names, numbered where several share one (two engine endpoints: engine, engine2)."""
    seen: dict[str, int] = {}
    out = []
    for p in probes:
        seen[p.name] = seen.get(p.name, 0) + 1
        out.append(p.name if seen[p.name] == 1 else f"{p.name}{seen[p.name]}")
    return out
