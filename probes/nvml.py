"""The driver's view: NVML counters per GPU and the memory the driver charges to each process.

Everything goes through ``pynvml`` (nvidia-ml-py), called as ``pynvml.fn(...)``
at each use, so the module's functions are the only boundary to the driver.

What the probe does when NVML cannot answer, following nvitop's "NA, not an
exception" rule:

* a field NVML answers ``NotSupported``, ``NoPermission`` or
  ``FunctionNotFound`` for is recorded once in ``status()["missing_fields"]``
  and never asked again (many such calls are slow on a busy driver);
* ``GPU_IS_LOST`` (or ``GPU_NOT_FOUND``) marks that GPU lost: its row keeps
  ``gpu_lost = 1`` and nothing else, the other GPUs go on;
* NVML absent (no driver, no library) or no GPU: ``status()`` says which and
  ``sample`` yields nothing; initialisation is tried again every
  ``reinit_interval_s``;
* XID errors come through the NVML event API, drained each tick with a
  timeout of 0 so the sampler never blocks.

NVML reports host PIDs. :class:`PidNamespaceMap` maps them to the agent's PID
namespace through ``/proc/*/status`` NSpid where that is possible and says so
where it is not (the agent in its own namespace without the host's /proc).

Under MIG or vGPU, utilization and per-process figures of the physical GPU do
not describe one tenant: the GPU row carries ``metrics_unreliable`` with why.
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gpudiag.catalog import M
from gpudiag.frames import Frame
from gpudiag.probes.base import (
    MissingFields,
    Probe,
    ProbeError,
    in_host_pid_namespace,
    proc_comm,
    proc_nspid,
    proc_start_ticks,
)

try:  # nvidia-ml-py is a dependency, but a broken install must degrade the probe, not the agent
    import pynvml
except Exception as _exc:  # noqa: BLE001 - a broken install can raise anything at import
    pynvml = None
    _PYNVML_IMPORT_ERROR = f"{type(_exc).__name__}: {_exc}"
else:
    _PYNVML_IMPORT_ERROR = ""

# What a pynvml call raises when the driver cannot answer: NVML's own errors, plus what an
# old pynvml or a missing symbol gives (AttributeError, ctypes argument errors).
NVML_FAILURES: tuple[type[BaseException], ...] = (
    (pynvml.NVMLError,) if pynvml is not None else ()) + (AttributeError, TypeError, ValueError, OSError,
                                                          ctypes.ArgumentError)

log = logging.getLogger(__name__)

# The NVML names of clock event (throttle) reasons, as bits of
# nvmlDeviceGetCurrentClocksEventReasons; the names are the reason label values.
THROTTLE_REASON_BITS: dict[str, int] = {
    "gpu_idle": 0x1,
    "applications_clocks_setting": 0x2,
    "sw_power_cap": 0x4,
    "hw_slowdown": 0x8,
    "sync_boost": 0x10,
    "sw_thermal_slowdown": 0x20,
    "hw_thermal_slowdown": 0x40,
    "hw_power_brake_slowdown": 0x80,
    "display_clock_setting": 0x100,
}

# nvmlNvLinkErrorCounter_t order; the names are the kind label values.
NVLINK_ERROR_KINDS = ("dl_replay", "dl_recovery", "dl_crc_flit", "dl_crc_data", "dl_ecc_data")

VIRTUALIZATION_MODES = {0: "none", 1: "passthrough", 2: "vgpu", 3: "host_vgpu", 4: "host_vsga"}

# nvmlDeviceGetPerformanceState answers 32 (NVML_PSTATE_UNKNOWN) when it does not know.
_PSTATE_UNKNOWN = 32

# NVML's PCIe throughput is in KiB/s (nvmlDeviceGetPcieThroughput, sampled over 20 ms).
_PCIE_UNIT_BYTES = 1024

# Events drained per tick at most, so an XID storm cannot stall the sampler.
_MAX_EVENTS_PER_TICK = 1000

_MHZ = 1e6
_MILLIWATT = 1e-3

HOST_PROC_ENV = "GPUDIAG_HOST_PROC"
DEFAULT_HOST_PROC = "/host/proc"


# NVML's instance ID of a process that runs in no MIG instance (NVML_VALUE_NOT_AVAILABLE as uint32).
_NO_INSTANCE = 0xFFFFFFFF


def _mig_columns(row: dict[str, Any], mig: list[dict[str, Any]]) -> None:
    """Per-MIG-device memory on the GPU row, nested by GPU instance then compute instance."""
    used: dict[str, dict[str, int]] = {}
    total: dict[str, dict[str, int]] = {}
    for d in mig:
        gi, ci = str(d["gpu_instance"]), str(d["compute_instance"])
        if "used_bytes" in d:
            used.setdefault(gi, {})[ci] = d["used_bytes"]
            total.setdefault(gi, {})[ci] = d["total_bytes"]
    if used:
        row[M.gpu_mig_memory_used_bytes] = used
        row[M.gpu_mig_memory_total_bytes] = total
    row["mig_devices"] = [{k: d[k] for k in ("uuid", "gpu_instance", "compute_instance")} for d in mig]


def _err(name: str):
    """The pynvml exception class ``NVMLError_<name>`` (a class that matches nothing if absent)."""
    if pynvml is None:
        return _Never
    return getattr(pynvml, f"NVMLError_{name}", _Never)


class _Never(Exception):
    """Matches no exception; stands in for an NVML error class an old pynvml lacks."""


class _GpuLost(Exception):
    pass


class _NvmlDown(Exception):
    pass


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _handle_key(handle: Any) -> Any:
    """A hashable identity of an NVML device handle (event data carries a fresh pointer object)."""
    try:
        return ctypes.cast(handle, ctypes.c_void_p).value
    except (TypeError, ctypes.ArgumentError):
        return id(handle)


def cuda_version_text(version: int | None) -> str | None:
    """NVML's integer CUDA version (12040) as text ("12.4")."""
    if not version:
        return None
    return f"{version // 1000}.{(version % 1000) // 10}"


def nvml_unavailable_reason(exc: BaseException) -> str:
    """Why NVML cannot be used, in words a user can act on."""
    if isinstance(exc, _err("LibraryNotFound")):
        return "NVML library (libnvidia-ml.so.1) not found: no NVIDIA driver is installed on this machine"
    if isinstance(exc, _err("DriverNotLoaded")):
        return "the NVIDIA kernel driver is not loaded (nvidia.ko): load it or reboot after installing"
    if isinstance(exc, _err("NoPermission")):
        return "no permission to open the NVIDIA devices (/dev/nvidia*): run as a user in the video group"
    if isinstance(exc, _err("LibRmVersionMismatch")):
        return "NVML library and kernel driver versions differ: reboot or reload the driver after an upgrade"
    return f"NVML initialisation failed: {type(exc).__name__}: {exc}"


# --- PID namespaces ------------------------------------------------------------------


class PidNamespaceMap:
    """Maps NVML's host PIDs to PIDs in the agent's namespace.

    * Agent in the host PID namespace: NVML's PID is ours; the PID inside the
      process's own container (the last NSpid entry) is reported too.
    * Agent in its own namespace with the host's /proc mounted (``host_proc``,
      default ``$GPUDIAG_HOST_PROC`` or /host/proc): the host view's NSpid lists
      the process's PID at every level; the one that names the same process in
      our /proc (same start time, same innermost PID) is ours.
    * Otherwise the mapping is impossible and ``status()`` says what to change.
    """

    def __init__(self, proc_root: str = "/proc", host_proc: str | None = None):
        self.proc_root = proc_root
        self.host_namespace = in_host_pid_namespace() if proc_root == "/proc" else None
        if host_proc is None and not self.host_namespace:
            candidate = os.environ.get(HOST_PROC_ENV) or DEFAULT_HOST_PROC
            host_proc = candidate if os.path.isdir(os.path.join(candidate, "1")) else None
        self.host_proc = host_proc

    @property
    def mode(self) -> str:
        """``host`` (same namespace), ``host-proc`` (mapped through the host's /proc) or ``unmappable``."""
        if self.host_namespace and self.host_proc is None:
            return "host"
        if self.host_proc is not None:
            return "host-proc"
        return "unmappable"

    def status(self) -> dict[str, Any]:
        """The mapping mode and, when PIDs cannot be mapped, why and what to do."""
        mode = self.mode
        out: dict[str, Any] = {"mode": mode, "host_pid_namespace": self.host_namespace}
        if mode == "host":
            out["reason"] = "the agent shares the host PID namespace: NVML PIDs are the agent's PIDs"
        elif mode == "host-proc":
            out["reason"] = f"NVML host PIDs are mapped through NSpid in {self.host_proc}"
        else:
            out["reason"] = (
                "the agent runs in its own PID namespace and cannot see the host's /proc, so NVML's host PIDs "
                "cannot be joined to processes: run it in the host PID namespace (docker --pid=host, Kubernetes "
                f"hostPID: true) or mount the host's /proc at {DEFAULT_HOST_PROC} (or set {HOST_PROC_ENV})")
        return out

    def to_local(self, host_pid: int) -> tuple[int | None, int | None]:
        """``(pid in the agent's namespace or None, pid inside the process's own container or None)``."""
        if self.mode == "host":
            nspid = proc_nspid(host_pid, self.proc_root)
            if nspid is None:
                return None, None
            return host_pid, (nspid[-1] if len(nspid) > 1 else None)
        if self.mode == "host-proc":
            nspid = proc_nspid(host_pid, self.host_proc)
            start = proc_start_ticks(host_pid, self.host_proc)
            if not nspid or start is None:
                return None, None
            container_pid = nspid[-1] if len(nspid) > 1 else None
            for candidate in nspid:
                local = proc_nspid(candidate, self.proc_root)
                if (local and local[-1] == nspid[-1]
                        and proc_start_ticks(candidate, self.proc_root) == start):
                    return candidate, container_pid
            return None, container_pid
        return None, None


# --- the probe -------------------------------------------------------------------------


@dataclass
class _Gpu:
    index: int
    handle: Any = None
    uuid: str | None = None
    name: str | None = None
    pci_bus_id: str | None = None
    mig_mode: str | None = None
    virtualization_mode: str | None = None
    lost: bool = False
    lost_reason: str = ""
    nvlinks: list[int] | None = None
    xid_counts: dict[str, int] = field(default_factory=dict)
    static: dict[str, Any] = field(default_factory=dict)

    @property
    def entity(self) -> str:
        return f"gpu{self.index}"

    @property
    def unreliable(self) -> str | None:
        if self.mig_mode == "enabled":
            return ("MIG is enabled: utilization and per-process memory of the physical GPU mix every "
                    "GPU instance; each MIG device's memory is in gpu_mig_memory_*_bytes")
        if self.virtualization_mode not in (None, "none", "passthrough"):
            return (f"virtualization mode {self.virtualization_mode}: the guest sees a time-sliced share, "
                    "so utilization and clocks describe the physical GPU, not this tenant")
        return None


class NvmlProbe(Probe):
    """NVML counters per GPU ("gpu" frame) and per-process device memory ("process" frame)."""

    name = "nvml"

    def __init__(self, interval_s: float = 1.0, *, node: str | None = None, xid_events: bool = True,
                 pid_map: PidNamespaceMap | None = None, reinit_interval_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic):
        self.interval_s = interval_s
        self.node = node
        self.reinit_interval_s = reinit_interval_s
        self._clock = clock
        self._want_xid = xid_events
        self.pid_map = pid_map or PidNamespaceMap()
        self._missing = MissingFields()
        self._transient: dict[str, int] = {}
        self._gpus: list[_Gpu] = []
        self._initialised = False
        self._available = False
        self._reason = ""
        self._driver_version: str | None = None
        self._cuda_driver_version: str | None = None
        self._event_set = None
        self._xid_status = "off"
        self._last_init_try: float | None = None
        self._try_init()

    # -- lifecycle --------------------------------------------------------------------

    def _try_init(self) -> None:
        self._last_init_try = self._clock()
        if pynvml is None:
            self._reason = f"nvidia-ml-py (pynvml) cannot be imported: {_PYNVML_IMPORT_ERROR}"
            return
        try:
            pynvml.nvmlInit()
        except NVML_FAILURES as exc:  # any failure here means "no NVML", never a crash
            self._reason = nvml_unavailable_reason(exc)
            log.info("nvml probe unavailable: %s", self._reason)
            return
        self._initialised = True
        try:
            self._driver_version = _text(pynvml.nvmlSystemGetDriverVersion())
        except NVML_FAILURES:
            self._driver_version = None
        try:
            self._cuda_driver_version = cuda_version_text(pynvml.nvmlSystemGetCudaDriverVersion_v2())
        except NVML_FAILURES:
            try:
                self._cuda_driver_version = cuda_version_text(pynvml.nvmlSystemGetCudaDriverVersion())
            except NVML_FAILURES:
                self._cuda_driver_version = None
        try:
            count = pynvml.nvmlDeviceGetCount()
        except NVML_FAILURES as exc:
            self._reason = f"NVML cannot count GPUs: {type(exc).__name__}: {exc}"
            self._shutdown()
            return
        if count == 0:
            self._reason = "NVML reports no GPU on this machine"
            self._shutdown()
            return
        self._gpus = [self._open_gpu(i) for i in range(count)]
        self._available = True
        self._reason = ""
        if self._want_xid:
            self._open_events()

    def _open_gpu(self, index: int) -> _Gpu:
        gpu = _Gpu(index)
        try:
            gpu.handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        except (_err("GpuIsLost"), _err("GpuNotFound")) as exc:
            gpu.lost, gpu.lost_reason = True, f"NVML: {exc}"
            return gpu
        except NVML_FAILURES as exc:
            gpu.lost, gpu.lost_reason = True, f"NVML cannot open the GPU: {type(exc).__name__}: {exc}"
            return gpu
        try:
            gpu.uuid = self._static(gpu, "uuid", lambda h: _text(pynvml.nvmlDeviceGetUUID(h)))
            gpu.name = self._static(gpu, "name", lambda h: _text(pynvml.nvmlDeviceGetName(h)))
            gpu.pci_bus_id = self._static(gpu, "pci_bus_id",
                                          lambda h: _text(pynvml.nvmlDeviceGetPciInfo(h).busId))
            mig = self._static(gpu, "mig_mode", lambda h: pynvml.nvmlDeviceGetMigMode(h)[0])
            gpu.mig_mode = None if mig is None else ("enabled" if mig else "disabled")
            virt = self._static(gpu, "virtualization_mode", pynvml.nvmlDeviceGetVirtualizationMode)
            gpu.virtualization_mode = None if virt is None else VIRTUALIZATION_MODES.get(virt, str(virt))
            for column, clock_type in ((M.gpu_sm_clock_max_hertz, pynvml.NVML_CLOCK_SM),
                                       (M.gpu_memory_clock_max_hertz, pynvml.NVML_CLOCK_MEM)):
                mhz = self._static(gpu, column, lambda h, c=clock_type: pynvml.nvmlDeviceGetMaxClockInfo(h, c))
                if mhz is not None:
                    gpu.static[column] = mhz * _MHZ
            gpu.nvlinks = self._discover_nvlinks(gpu)
        except _GpuLost as exc:
            gpu.lost, gpu.lost_reason = True, str(exc)
        except _NvmlDown as exc:
            gpu.lost, gpu.lost_reason = True, str(exc)
        if gpu.unreliable:
            log.info("gpu%d: %s", index, gpu.unreliable)
        return gpu

    def _discover_nvlinks(self, gpu: _Gpu) -> list[int]:
        links = []
        for link in range(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18)):
            try:
                active = pynvml.nvmlDeviceGetNvLinkState(gpu.handle, link)
            except (_err("GpuIsLost"), _err("GpuNotFound")) as exc:
                raise _GpuLost(f"NVML: {exc}") from None
            except NVML_FAILURES as exc:
                if link == 0:
                    self._missing.add(gpu.entity, M.gpu_nvlink_errors_total, f"no NVLink ({exc})")
                break  # links are numbered densely; the first unsupported one ends the list
            if active:
                links.append(link)
        if not links and not self._missing.has(gpu.entity, M.gpu_nvlink_errors_total):
            self._missing.add(gpu.entity, M.gpu_nvlink_errors_total, "no active NVLink")
        return links

    def _open_events(self) -> None:
        try:
            self._event_set = pynvml.nvmlEventSetCreate()
        except NVML_FAILURES as exc:
            self._xid_status = f"unavailable: NVML cannot create an event set ({exc})"
            return
        registered = 0
        for gpu in self._gpus:
            if gpu.lost:
                continue
            try:
                pynvml.nvmlDeviceRegisterEvents(gpu.handle, pynvml.nvmlEventTypeXidCriticalError,
                                                self._event_set)
                registered += 1
            except NVML_FAILURES as exc:
                self._missing.add(gpu.entity, M.gpu_xid_errors_total, f"XID events not available ({exc})")
        self._xid_status = "on" if registered else "unavailable: no GPU accepts XID event registration"

    def _free_events(self) -> None:
        if self._event_set is not None:
            try:
                pynvml.nvmlEventSetFree(self._event_set)
            except NVML_FAILURES as exc:
                log.debug("nvmlEventSetFree: %s", exc)
            self._event_set = None

    def _shutdown(self) -> None:
        self._free_events()
        if self._initialised:
            try:
                pynvml.nvmlShutdown()
            except NVML_FAILURES as exc:
                log.debug("nvmlShutdown: %s", exc)
        self._initialised = False

    def close(self) -> None:
        """Free the event set and shut NVML down."""
        self._shutdown()
        self._available = False
        if not self._reason:
            self._reason = "closed"

    # -- reading ----------------------------------------------------------------------

    def _classify(self, gpu: _Gpu, column: str, exc: BaseException) -> None:
        """Remember a permanently missing field; count a transient failure; re-raise a lost GPU."""
        if isinstance(exc, (_err("GpuIsLost"), _err("GpuNotFound"))):
            raise _GpuLost(f"NVML: {exc}") from None
        if isinstance(exc, (_err("Uninitialized"), _err("DriverNotLoaded"), _err("LibRmVersionMismatch"))):
            raise _NvmlDown(f"NVML stopped answering: {exc}") from None
        if isinstance(exc, _err("NotSupported")):
            self._missing.add(gpu.entity, column, "not supported by this GPU or driver")
        elif isinstance(exc, _err("NoPermission")):
            self._missing.add(gpu.entity, column, "no permission (needs root or a driver setting)")
        elif isinstance(exc, (_err("FunctionNotFound"), AttributeError)):
            self._missing.add(gpu.entity, column, "this driver's NVML lacks the function")
        else:
            key = f"{gpu.entity}.{column}"
            self._transient[key] = self._transient.get(key, 0) + 1

    def _read(self, gpu: _Gpu, column: str, fn: Callable[[Any], Any]) -> Any:
        """``fn(handle)``, or None when the field is missing (recorded) or failed this tick."""
        if self._missing.has(gpu.entity, column):
            return None
        try:
            return fn(gpu.handle)
        except (_GpuLost, _NvmlDown):
            raise
        except NVML_FAILURES as exc:
            self._classify(gpu, column, exc)
            return None

    _static = _read

    def _field_value(self, gpu: _Gpu, column: str, field_id: int) -> float | None:
        values = self._read(gpu, column, lambda h: pynvml.nvmlDeviceGetFieldValues(h, [field_id]))
        if values is None:
            return None
        fv = values[0]
        if fv.nvmlReturn != 0:
            try:
                raise pynvml.NVMLError(fv.nvmlReturn)
            except NVML_FAILURES as exc:
                self._classify(gpu, column, exc)
            return None
        member = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}
        return getattr(fv.value, member.get(fv.valueType, "uiVal"))

    def _gpu_row(self, gpu: _Gpu) -> dict[str, Any]:
        row: dict[str, Any] = {"gpu": gpu.index, "uuid": gpu.uuid}
        if self.node:
            row["node"] = self.node
        row.update({"name": gpu.name, "pci_bus_id": gpu.pci_bus_id, "driver_version": self._driver_version,
                    "cuda_driver_version": self._cuda_driver_version, "mig_mode": gpu.mig_mode,
                    "virtualization_mode": gpu.virtualization_mode, M.gpu_info: 1})
        if gpu.unreliable:
            row["metrics_unreliable"] = gpu.unreliable
        if gpu.lost:
            row[M.gpu_lost] = 1
            row["lost_reason"] = gpu.lost_reason
            return row
        row[M.gpu_lost] = 0
        row.update(gpu.static)
        put = _Putter(row)

        util = self._read(gpu, M.gpu_utilization_ratio, pynvml.nvmlDeviceGetUtilizationRates)
        if util is not None:
            row[M.gpu_utilization_ratio] = util.gpu / 100.0
            row[M.gpu_memory_utilization_ratio] = util.memory / 100.0
        mem = self._read(gpu, M.gpu_memory_reserved_bytes,
                         lambda h: pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2))
        if mem is not None:
            row[M.gpu_memory_reserved_bytes] = mem.reserved
        else:  # the v2 struct (with "reserved") needs driver >= 510
            mem = self._read(gpu, M.gpu_memory_used_bytes, pynvml.nvmlDeviceGetMemoryInfo)
        if mem is not None:
            row[M.gpu_memory_used_bytes] = mem.used
            row[M.gpu_memory_total_bytes] = mem.total
        for column, clock_type in ((M.gpu_sm_clock_hertz, pynvml.NVML_CLOCK_SM),
                                   (M.gpu_memory_clock_hertz, pynvml.NVML_CLOCK_MEM)):
            put(column, self._read(gpu, column, lambda h, c=clock_type: pynvml.nvmlDeviceGetClockInfo(h, c)), _MHZ)
        put(M.gpu_power_watts, self._read(gpu, M.gpu_power_watts, pynvml.nvmlDeviceGetPowerUsage), _MILLIWATT)
        put(M.gpu_power_limit_watts,
            self._read(gpu, M.gpu_power_limit_watts, pynvml.nvmlDeviceGetEnforcedPowerLimit), _MILLIWATT)
        put(M.gpu_temperature_celsius, self._read(
            gpu, M.gpu_temperature_celsius,
            lambda h: pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU)))
        put(M.gpu_memory_temperature_celsius,
            self._field_value(gpu, M.gpu_memory_temperature_celsius, pynvml.NVML_FI_DEV_MEMORY_TEMP))
        put(M.gpu_fan_speed_ratio, self._read(gpu, M.gpu_fan_speed_ratio, pynvml.nvmlDeviceGetFanSpeed), 0.01)
        for column, counter in ((M.gpu_pcie_tx_bytes_per_second, pynvml.NVML_PCIE_UTIL_TX_BYTES),
                                (M.gpu_pcie_rx_bytes_per_second, pynvml.NVML_PCIE_UTIL_RX_BYTES)):
            put(column, self._read(gpu, column, lambda h, c=counter: pynvml.nvmlDeviceGetPcieThroughput(h, c)),
                _PCIE_UNIT_BYTES)
        put(M.gpu_pcie_replay_total,
            self._read(gpu, M.gpu_pcie_replay_total, pynvml.nvmlDeviceGetPcieReplayCounter))
        self._nvlink_errors(gpu, row)
        self._ecc(gpu, row)
        self._retired_and_remapped(gpu, row)
        reasons = self._read(gpu, M.gpu_clock_throttle_active, self._throttle_bits)
        if reasons is not None:
            row[M.gpu_clock_throttle_active] = {name: int(bool(reasons & bit))
                                                for name, bit in THROTTLE_REASON_BITS.items()}
        pstate = self._read(gpu, M.gpu_performance_state, pynvml.nvmlDeviceGetPerformanceState)
        if pstate is not None and pstate != _PSTATE_UNKNOWN:
            row[M.gpu_performance_state] = pstate
        if not self._missing.has(gpu.entity, M.gpu_xid_errors_total) and self._xid_status == "on":
            row[M.gpu_xid_errors_total] = dict(gpu.xid_counts)
        return row

    @staticmethod
    def _throttle_bits(handle) -> int:
        fn = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
        if fn is None:  # the older name of the same call
            fn = pynvml.nvmlDeviceGetCurrentClocksThrottleReasons
        return fn(handle)

    def _nvlink_errors(self, gpu: _Gpu, row: dict[str, Any]) -> None:
        if not gpu.nvlinks or self._missing.has(gpu.entity, M.gpu_nvlink_errors_total):
            return
        totals: dict[str, int] = {}
        for counter, kind in enumerate(NVLINK_ERROR_KINDS):
            column = f"{M.gpu_nvlink_errors_total}.{kind}"
            values = [self._read(gpu, column, lambda h, ln=link, c=counter:
                                 pynvml.nvmlDeviceGetNvLinkErrorCounter(h, ln, c)) for link in gpu.nvlinks]
            if values and all(v is not None for v in values):
                totals[kind] = int(sum(values))
        if totals:
            row[M.gpu_nvlink_errors_total] = totals

    def _ecc(self, gpu: _Gpu, row: dict[str, Any]) -> None:
        if self._missing.has(gpu.entity, M.gpu_ecc_errors_total):
            return
        out: dict[str, dict[str, int]] = {}
        for scope, counter_type in (("volatile", pynvml.NVML_VOLATILE_ECC),
                                    ("aggregate", pynvml.NVML_AGGREGATE_ECC)):
            for kind, error_type in (("corrected", pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED),
                                     ("uncorrected", pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED)):
                value = self._read(gpu, M.gpu_ecc_errors_total, lambda h, e=error_type, c=counter_type:
                                   pynvml.nvmlDeviceGetTotalEccErrors(h, e, c))
                if value is not None:
                    out.setdefault(scope, {})[kind] = int(value)
        if out:
            row[M.gpu_ecc_errors_total] = out

    def _retired_and_remapped(self, gpu: _Gpu, row: dict[str, Any]) -> None:
        retired = {}
        for cause, code in (("multiple_single_bit_ecc",
                             pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS),
                            ("double_bit_ecc", pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)):
            pages = self._read(gpu, M.gpu_retired_pages_total,
                               lambda h, c=code: pynvml.nvmlDeviceGetRetiredPages(h, c))
            if pages is not None:
                retired[cause] = len(pages)
        if retired:
            row[M.gpu_retired_pages_total] = retired
        remap = self._read(gpu, M.gpu_remapped_rows_total, pynvml.nvmlDeviceGetRemappedRows)
        if remap is not None:
            correctable, uncorrectable, pending, failure = remap
            row[M.gpu_remapped_rows_total] = {"correctable": int(correctable), "uncorrectable": int(uncorrectable)}
            row["row_remap_pending"] = bool(pending)
            row["row_remap_failed"] = bool(failure)

    def _mig_devices(self, gpu: _Gpu) -> list[dict[str, Any]]:
        """The MIG devices of a GPU in MIG mode: ``uuid``, ``gpu_instance``, ``compute_instance``, memory.

        Empty without MIG (no call is made unless NVML said MIG is enabled). An empty slot
        answers NOT_FOUND and is skipped; a failure of one device's memory is that field
        missing, not the device.
        """
        if gpu.mig_mode != "enabled":
            return []
        count = self._read(gpu, "mig_devices", pynvml.nvmlDeviceGetMaxMigDeviceCount)
        out = []
        for i in range(int(count or 0)):
            try:
                mh = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu.handle, i)
                dev = {"uuid": _text(pynvml.nvmlDeviceGetUUID(mh)),
                       "gpu_instance": int(pynvml.nvmlDeviceGetGpuInstanceId(mh)),
                       "compute_instance": int(pynvml.nvmlDeviceGetComputeInstanceId(mh))}
            except _err("NotFound"):
                continue  # no MIG device in this slot (or it was destroyed since the count)
            except NVML_FAILURES as exc:
                self._classify(gpu, "mig_devices", exc)
                if self._missing.has(gpu.entity, "mig_devices"):
                    return []
                continue
            mem = self._read(gpu, M.gpu_mig_memory_used_bytes, lambda h, m=mh: pynvml.nvmlDeviceGetMemoryInfo(m))
            if mem is not None:
                dev["used_bytes"], dev["total_bytes"] = int(mem.used), int(mem.total)
            out.append(dev)
        return out

    def _process_rows(self, gpu: _Gpu, mig: list[dict[str, Any]] = ()) -> list[dict[str, Any]]:
        by_pid: dict[int, Any] = {}
        for column, fn_name in (("compute_processes", "nvmlDeviceGetComputeRunningProcesses"),
                                ("graphics_processes", "nvmlDeviceGetGraphicsRunningProcesses")):
            procs = self._read(gpu, column, lambda h, n=fn_name: getattr(pynvml, n)(h))
            for p in procs or ():
                by_pid.setdefault(int(p.pid), p)  # compute first: a CUDA process is listed in both
        rows = []
        for host_pid, p in sorted(by_pid.items()):
            local_pid, container_pid = self.pid_map.to_local(host_pid)
            name = proc_comm(local_pid, self.pid_map.proc_root) if local_pid is not None else None
            if name is None:
                try:
                    name = os.path.basename(_text(pynvml.nvmlSystemGetProcessName(host_pid)))
                except NVML_FAILURES:
                    name = None
            row: dict[str, Any] = {"gpu": gpu.index, "uuid": gpu.uuid,
                                   "pid": local_pid if local_pid is not None else host_pid,
                                   "process": name, "host_pid": host_pid, "pid_mapped": local_pid is not None}
            if self.node:
                row["node"] = self.node
            if container_pid is not None:
                row["container_pid"] = container_pid
            if p.usedGpuMemory is not None:  # None: NVML_VALUE_NOT_AVAILABLE (MIG without permission, WDDM)
                row[M.process_gpu_memory_bytes] = int(p.usedGpuMemory)
            gi, ci = getattr(p, "gpuInstanceId", None), getattr(p, "computeInstanceId", None)
            if gpu.mig_mode == "enabled" and gi is not None and gi != _NO_INSTANCE:
                row["gpu_instance"] = int(gi)
                if ci is not None and ci != _NO_INSTANCE:
                    row["compute_instance"] = int(ci)
                # The MIG device's UUID: what the kubelet's device plugin hands pods under MIG.
                dev = next((d for d in mig if d["gpu_instance"] == row["gpu_instance"]
                            and d["compute_instance"] == row.get("compute_instance")), None)
                if dev is not None:
                    row["mig_uuid"] = dev["uuid"]
            if gpu.unreliable:
                row["metrics_unreliable"] = gpu.unreliable
            rows.append(row)
        return rows

    def _drain_xid_events(self) -> None:
        if self._event_set is None:
            return
        by_handle = {_handle_key(g.handle): g for g in self._gpus if g.handle is not None}
        timeout_error = _err("Timeout")
        for _ in range(_MAX_EVENTS_PER_TICK):
            try:
                data = pynvml.nvmlEventSetWait_v2(self._event_set, 0)
            except timeout_error:
                return
            except NVML_FAILURES as exc:
                if isinstance(exc, (_err("NotSupported"), _err("FunctionNotFound"), AttributeError)):
                    self._xid_status = f"unavailable: this driver cannot wait for events ({exc})"
                    self._free_events()
                    return
                key = "xid_events"
                self._transient[key] = self._transient.get(key, 0) + 1
                log.debug("nvml event wait failed: %s", exc)
                return
            if not data.eventType & pynvml.nvmlEventTypeXidCriticalError:
                continue
            gpu = by_handle.get(_handle_key(data.device))
            if gpu is not None:
                xid = str(int(data.eventData))
                gpu.xid_counts[xid] = gpu.xid_counts.get(xid, 0) + 1

    def sample(self, now: float) -> list[Frame]:
        """One "gpu" frame (a row per GPU, lost ones with ``gpu_lost = 1``) and one "process" frame."""
        if not self._available:
            if (self._last_init_try is None
                    or self._clock() - self._last_init_try >= self.reinit_interval_s):
                self._try_init()
            if not self._available:
                return []
        try:
            self._drain_xid_events()
            gpu_rows, process_rows = [], []
            for gpu in self._gpus:
                if not gpu.lost:
                    try:
                        row = self._gpu_row(gpu)
                        mig = self._mig_devices(gpu)
                        if mig:
                            _mig_columns(row, mig)
                        gpu_rows.append(row)
                        process_rows.extend(self._process_rows(gpu, mig))
                        continue
                    except _GpuLost as exc:
                        gpu.lost, gpu.lost_reason = True, str(exc)
                        log.warning("gpu%d is lost: %s", gpu.index, exc)
                gpu_rows.append(self._gpu_row(gpu))
        except _NvmlDown as exc:
            self._available = False
            self._reason = str(exc)
            self._shutdown()
            raise ProbeError(str(exc)) from None
        return [Frame("gpu", now, gpu_rows), Frame("process", now, process_rows)]

    def status(self) -> dict[str, Any]:
        """Availability, versions, GPUs (lost, unreliable), fields missing per GPU, XID events, PID mapping."""
        return {
            "name": self.name,
            "available": self._available,
            "reason": self._reason,
            "driver_version": self._driver_version,
            "cuda_driver_version": self._cuda_driver_version,
            "gpus": [{"gpu": g.index, "uuid": g.uuid, "name": g.name, "lost": g.lost,
                      "lost_reason": g.lost_reason or None, "mig_mode": g.mig_mode,
                      "virtualization_mode": g.virtualization_mode, "metrics_unreliable": g.unreliable}
                     for g in self._gpus],
            "missing_fields": self._missing.as_dict(),
            "transient_errors": dict(self._transient),
            "xid_events": self._xid_status,
            "pid_namespace": self.pid_map.status(),
        }


class _Putter:
    """Sets ``row[column] = value * scale`` only for a value that was read (absent stays absent)."""

    def __init__(self, row: dict[str, Any]):
        self.row = row

    def __call__(self, column: str, value: Any, scale: float | None = None) -> None:
        if value is None:
            return
        self.row[column] = value * scale if scale is not None else value
