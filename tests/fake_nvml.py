"""A fake NVML at the pynvml function boundary, for machines without an NVIDIA driver.

``FakeNvml(...).install(monkeypatch)`` replaces the ``nvml*`` functions of the
real ``pynvml`` module; everything the probe does above that boundary is real.
Return values are pynvml's own ctypes structs and friendly objects, and
failures are pynvml's own exception classes (``pynvml.NVMLError(code)`` maps
to ``NVMLError_NotSupported``, ``NVMLError_GpuIsLost``, ...), raised the way
the driver raises them:

* ``fail(gpu, "nvmlDeviceGetFanSpeed", NVML_ERROR_NOT_SUPPORTED)`` for one
  function of one GPU (``gpu=None``: every GPU);
* ``lose(gpu)``: the GPU fell off the bus, every call on it answers
  ``GPU_IS_LOST`` from then on;
* ``FakeNvml(init_error=NVML_ERROR_LIBRARY_NOT_FOUND)`` (or
  ``DRIVER_NOT_LOADED``): ``nvmlInit`` fails as on a machine without a driver;
* ``xid(gpu, 79)``: an XID critical error event waits in every event set that
  registered the GPU.
* MIG: a GPU with ``mig_mode=1`` and ``mig_devices`` answers the MIG device
  calls (``nvmlDeviceGetMaxMigDeviceCount``, ``...GetMigDeviceHandleByIndex``,
  ``...GetGpuInstanceId``, ``...GetComputeInstanceId``, and UUID and memory of
  a MIG handle) the way the driver does: an empty slot is ``NOT_FOUND``, an
  index past the maximum ``INVALID_ARGUMENT``, instance IDs of a physical GPU
  ``NOT_SUPPORTED``, and with MIG off every slot is ``NOT_FOUND``. A GPU
  without MIG is ``fail(gpu, "nvmlDeviceGetMigMode", NVML_ERROR_NOT_SUPPORTED)``
  with ``max_mig_devices=0``.

Any other ``nvml*`` function is answered with ``FunctionNotFound`` and
recorded in ``unmodelled_calls``, so a test can insist the probe stayed inside
what the fake models.
"""

from __future__ import annotations

import ctypes
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pynvml

GIB = 1 << 30


@dataclass
class FakeProcess:
    """A process on a fake GPU: NVML's host PID and the memory the driver charges to it."""

    pid: int
    used_bytes: int | None  # None: NVML_VALUE_NOT_AVAILABLE
    graphics: bool = False
    gpu_instance: int | None = None  # the MIG instance it runs in (None: not under MIG)
    compute_instance: int | None = None


@dataclass
class FakeMigDevice:
    """One MIG device (a compute instance of a GPU instance) of a fake GPU."""

    uuid: str
    gpu_instance: int
    compute_instance: int
    memory_total: int = 10 * GIB
    memory_used: int = 1 * GIB


@dataclass
class FakeGpu:
    """What one fake GPU answers; a field set to None answers NotSupported."""

    uuid: str
    name: str = "NVIDIA A100-SXM4-80GB"
    pci_bus_id: str = "00000000:07:00.0"
    memory_total: int = 80 * GIB
    memory_used: int = 20 * GIB
    memory_reserved: int | None = 512 << 20
    util_gpu: int = 65
    util_memory: int = 40
    sm_clock_mhz: int = 1410
    sm_clock_max_mhz: int = 1410
    memory_clock_mhz: int = 1593
    memory_clock_max_mhz: int = 1593
    power_mw: int = 250_000
    power_limit_mw: int = 400_000
    temperature_c: int = 61
    memory_temperature_c: int | None = 70
    fan_percent: int | None = None  # datacenter boards have no fan reading
    pcie_tx_kib_s: int = 1000
    pcie_rx_kib_s: int = 2000
    pcie_replays: int = 0
    nvlinks_active: tuple[bool, ...] = (True,) * 12
    nvlink_errors: dict[int, int] = field(default_factory=lambda: {0: 0, 1: 0, 2: 1, 3: 0, 4: 0})
    ecc_errors: dict[tuple[int, int], int] | None = field(default_factory=lambda: {(0, 0): 3, (1, 0): 0,
                                                                                  (0, 1): 10, (1, 1): 0})
    retired_pages: dict[int, list[int]] | None = None  # None: NotSupported (Ampere remaps rows instead)
    remapped_rows: tuple[int, int, int, int] | None = (0, 0, 0, 0)
    throttle_bits: int = 0
    pstate: int = 0
    mig_mode: int = 0
    max_mig_devices: int = 7  # 0 on a GPU without MIG
    mig_devices: list[FakeMigDevice | None] = field(default_factory=list)  # by slot; None: an empty slot
    virtualization_mode: int = 0
    processes: list[FakeProcess] = field(default_factory=list)


# pynvml's own pure-Python helpers, not driver calls.
_HELPERS = {"nvmlStructToFriendlyObject", "nvmlFriendlyObjectToStruct", "nvmlExceptionClass"}


class FakeNvml:
    """N fake GPUs behind the real pynvml function names."""

    def __init__(self, gpus: list[FakeGpu], *, driver_version: str = "550.54.15", cuda_driver_version: int = 12040,
                 init_error: int | None = None):
        self.gpus = gpus
        self.driver_version = driver_version
        self.cuda_driver_version = cuda_driver_version
        self.init_error = init_error
        self.calls: Counter[str] = Counter()
        self.unmodelled_calls: Counter[str] = Counter()
        self.blocking_waits: list[int] = []
        self.gpu_calls: Counter[int] = Counter()  # device calls per GPU index, lost ones included
        self.initialised = False
        self._failures: dict[tuple[int | None, str], int] = {}
        self._lost: set[int] = set()
        self._structs = [pynvml.struct_c_nvmlDevice_t() for _ in gpus]  # keeps the handle targets alive
        self._handles = [pynvml.c_nvmlDevice_t(s) for s in self._structs]
        self._index_of = {ctypes.cast(h, ctypes.c_void_p).value: i for i, h in enumerate(self._handles)}
        self._event_sets: list[dict[str, Any]] = []
        self._mig_structs: list = []
        self._mig_of: dict[int, tuple[int, FakeMigDevice]] = {}  # MIG handle -> (GPU index, device)

    @classmethod
    def node(cls, n_gpus: int = 8, processes_per_gpu: int = 0, *, pids: list[int] | None = None,
             **kwargs) -> FakeNvml:
        """A node of ``n_gpus`` A100s, each running ``processes_per_gpu`` processes (PIDs from ``pids``)."""
        gpus = []
        for i in range(n_gpus):
            procs = []
            for j in range(processes_per_gpu):
                pid = pids[(i * processes_per_gpu + j) % len(pids)] if pids else 100000 + i * 100 + j
                procs.append(FakeProcess(pid, (1 + j) * GIB))
            gpus.append(FakeGpu(uuid=f"GPU-{i:08d}-fake-0000-0000-000000000000",
                                pci_bus_id=f"00000000:{0x07 + i:02X}:00.0", processes=procs))
        return cls(gpus, **kwargs)

    # -- fault injection --------------------------------------------------------------

    def fail(self, gpu: int | None, function: str, code: int) -> None:
        """Make ``function`` answer NVML error ``code`` on one GPU (None: on all)."""
        self._failures[(gpu, function)] = code

    def heal(self, gpu: int | None, function: str) -> None:
        """Undo ``fail``."""
        self._failures.pop((gpu, function), None)

    def lose(self, gpu: int) -> None:
        """The GPU fell off the bus: every call on it answers GPU_IS_LOST from now on."""
        self._lost.add(gpu)

    def xid(self, gpu: int, code: int) -> None:
        """Queue an XID critical error event for every event set that registered the GPU."""
        for es in self._event_sets:
            if gpu in es["gpus"]:
                es["queue"].append((gpu, code))

    # -- the boundary ---------------------------------------------------------------

    def install(self, monkeypatch) -> FakeNvml:
        """Replace every ``nvml*`` function of pynvml (``monkeypatch.setattr`` restores them)."""
        modelled = {name[len("_nvml"):]: getattr(self, name) for name in dir(self) if name.startswith("_nvml")}
        for name in dir(pynvml):
            value = getattr(pynvml, name)
            if not name.startswith("nvml") or not callable(value) or isinstance(value, type) or name in _HELPERS:
                continue
            short = name[len("nvml"):]
            fn = modelled.get(short) or self._unmodelled(name)
            monkeypatch.setattr(pynvml, name, self._counted(name, fn))
        return self

    def _counted(self, name, fn):
        def call(*args, **kwargs):
            self.calls[name] += 1
            return fn(*args, **kwargs)
        return call

    def _unmodelled(self, name):
        def call(*args, **kwargs):
            self.unmodelled_calls[name] += 1
            raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        return call

    def _gpu(self, handle, function: str) -> tuple[int, FakeGpu]:
        if not self.initialised:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)
        i = self._index_of.get(ctypes.cast(handle, ctypes.c_void_p).value)
        if i is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        self.gpu_calls[i] += 1
        if i in self._lost:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        code = self._failures.get((i, function), self._failures.get((None, function)))
        if code is not None:
            raise pynvml.NVMLError(code)
        return i, self.gpus[i]

    @staticmethod
    def _supported(value):
        if value is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return value

    # Each _nvmlX method models pynvml.nvmlX.

    def _nvmlInit(self):
        if self.init_error is not None:
            raise pynvml.NVMLError(self.init_error)
        self.initialised = True

    def _nvmlInitWithFlags(self, flags):
        self._nvmlInit()

    def _nvmlShutdown(self):
        self.initialised = False

    def _nvmlErrorString(self, code):
        return f"NVML error {code}"

    def _nvmlSystemGetDriverVersion(self):
        return self.driver_version

    def _nvmlSystemGetCudaDriverVersion(self):
        return self.cuda_driver_version

    def _nvmlSystemGetCudaDriverVersion_v2(self):
        return self.cuda_driver_version

    def _nvmlSystemGetProcessName(self, pid):
        return f"/usr/bin/proc{pid}"

    def _nvmlDeviceGetCount(self):
        if not self.initialised:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)
        return len(self.gpus)

    def _nvmlDeviceGetHandleByIndex(self, index):
        if not self.initialised:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)
        if index in self._lost:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        if not 0 <= index < len(self.gpus):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self._handles[index]

    def _mig(self, handle, function: str) -> FakeMigDevice | None:
        """The MIG device behind ``handle`` (None for a physical GPU's handle); its GPU's failures apply."""
        got = self._mig_of.get(ctypes.cast(handle, ctypes.c_void_p).value)
        if got is None:
            return None
        i, dev = got
        if not self.initialised:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)
        if i in self._lost:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        code = self._failures.get((i, function), self._failures.get((None, function)))
        if code is not None:
            raise pynvml.NVMLError(code)
        return dev

    def _nvmlDeviceGetUUID(self, h):
        dev = self._mig(h, "nvmlDeviceGetUUID")
        return dev.uuid if dev is not None else self._gpu(h, "nvmlDeviceGetUUID")[1].uuid

    def _nvmlDeviceGetMaxMigDeviceCount(self, h):
        return self._gpu(h, "nvmlDeviceGetMaxMigDeviceCount")[1].max_mig_devices

    def _nvmlDeviceGetMigDeviceHandleByIndex(self, h, index):
        i, g = self._gpu(h, "nvmlDeviceGetMigDeviceHandleByIndex")
        if not 0 <= index < g.max_mig_devices:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        dev = g.mig_devices[index] if g.mig_mode == 1 and index < len(g.mig_devices) else None
        if dev is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        s = pynvml.struct_c_nvmlDevice_t()
        self._mig_structs.append(s)
        handle = pynvml.c_nvmlDevice_t(s)
        self._mig_of[ctypes.cast(handle, ctypes.c_void_p).value] = (i, dev)
        return handle

    def _nvmlDeviceGetGpuInstanceId(self, h):
        dev = self._mig(h, "nvmlDeviceGetGpuInstanceId")
        if dev is None:
            self._gpu(h, "nvmlDeviceGetGpuInstanceId")
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)  # not a MIG device
        return dev.gpu_instance

    def _nvmlDeviceGetComputeInstanceId(self, h):
        dev = self._mig(h, "nvmlDeviceGetComputeInstanceId")
        if dev is None:
            self._gpu(h, "nvmlDeviceGetComputeInstanceId")
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return dev.compute_instance

    def _nvmlDeviceGetName(self, h):
        return self._gpu(h, "nvmlDeviceGetName")[1].name

    def _nvmlDeviceGetPciInfo(self, h):
        g = self._gpu(h, "nvmlDeviceGetPciInfo")[1]
        info = pynvml.nvmlPciInfo_t()
        info.busId = g.pci_bus_id.encode()
        return info

    def _nvmlDeviceGetMigMode(self, h):
        g = self._gpu(h, "nvmlDeviceGetMigMode")[1]
        return [g.mig_mode, g.mig_mode]

    def _nvmlDeviceGetVirtualizationMode(self, h):
        return self._gpu(h, "nvmlDeviceGetVirtualizationMode")[1].virtualization_mode

    def _nvmlDeviceGetMaxClockInfo(self, h, clock_type):
        g = self._gpu(h, "nvmlDeviceGetMaxClockInfo")[1]
        return g.sm_clock_max_mhz if clock_type == pynvml.NVML_CLOCK_SM else g.memory_clock_max_mhz

    def _nvmlDeviceGetClockInfo(self, h, clock_type):
        g = self._gpu(h, "nvmlDeviceGetClockInfo")[1]
        return g.sm_clock_mhz if clock_type == pynvml.NVML_CLOCK_SM else g.memory_clock_mhz

    def _nvmlDeviceGetUtilizationRates(self, h):
        g = self._gpu(h, "nvmlDeviceGetUtilizationRates")[1]
        u = pynvml.c_nvmlUtilization_t()
        u.gpu, u.memory = g.util_gpu, g.util_memory
        return u

    def _nvmlDeviceGetMemoryInfo(self, h, version=None):
        dev = self._mig(h, "nvmlDeviceGetMemoryInfo")
        if dev is not None:
            m = pynvml.c_nvmlMemory_t()
            m.total, m.used, m.free = dev.memory_total, dev.memory_used, dev.memory_total - dev.memory_used
            return m
        g = self._gpu(h, "nvmlDeviceGetMemoryInfo")[1]
        if version:
            if g.memory_reserved is None:  # a driver before 510 has no v2 struct
                raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
            m = pynvml.c_nvmlMemory_v2_t()
            m.version, m.reserved = version, g.memory_reserved
        else:
            m = pynvml.c_nvmlMemory_t()
        m.total, m.used = g.memory_total, g.memory_used
        m.free = g.memory_total - g.memory_used - (g.memory_reserved or 0)
        return m

    def _nvmlDeviceGetPowerUsage(self, h):
        return self._gpu(h, "nvmlDeviceGetPowerUsage")[1].power_mw

    def _nvmlDeviceGetEnforcedPowerLimit(self, h):
        return self._gpu(h, "nvmlDeviceGetEnforcedPowerLimit")[1].power_limit_mw

    def _nvmlDeviceGetTemperature(self, h, sensor):
        return self._gpu(h, "nvmlDeviceGetTemperature")[1].temperature_c

    def _nvmlDeviceGetFieldValues(self, h, field_ids):
        g = self._gpu(h, "nvmlDeviceGetFieldValues")[1]
        values = (pynvml.c_nvmlFieldValue_t * len(field_ids))()
        for i, fid in enumerate(field_ids):
            values[i].fieldId = fid
            if fid == pynvml.NVML_FI_DEV_MEMORY_TEMP and g.memory_temperature_c is not None:
                values[i].nvmlReturn = pynvml.NVML_SUCCESS
                values[i].valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
                values[i].value.uiVal = g.memory_temperature_c
            else:  # NVML fails one field inside a successful call
                values[i].nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
        return values

    def _nvmlDeviceGetFanSpeed(self, h):
        return self._supported(self._gpu(h, "nvmlDeviceGetFanSpeed")[1].fan_percent)

    def _nvmlDeviceGetPcieThroughput(self, h, counter):
        g = self._gpu(h, "nvmlDeviceGetPcieThroughput")[1]
        return g.pcie_tx_kib_s if counter == pynvml.NVML_PCIE_UTIL_TX_BYTES else g.pcie_rx_kib_s

    def _nvmlDeviceGetPcieReplayCounter(self, h):
        return self._gpu(h, "nvmlDeviceGetPcieReplayCounter")[1].pcie_replays

    def _nvmlDeviceGetNvLinkState(self, h, link):
        g = self._gpu(h, "nvmlDeviceGetNvLinkState")[1]
        if link >= len(g.nvlinks_active):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return int(g.nvlinks_active[link])

    def _nvmlDeviceGetNvLinkErrorCounter(self, h, link, counter):
        g = self._gpu(h, "nvmlDeviceGetNvLinkErrorCounter")[1]
        if link >= len(g.nvlinks_active):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return g.nvlink_errors.get(counter, 0)

    def _nvmlDeviceGetTotalEccErrors(self, h, error_type, counter_type):
        g = self._gpu(h, "nvmlDeviceGetTotalEccErrors")[1]
        return self._supported(g.ecc_errors)[(error_type, counter_type)]

    def _nvmlDeviceGetRetiredPages(self, h, cause):
        g = self._gpu(h, "nvmlDeviceGetRetiredPages")[1]
        return list(self._supported(g.retired_pages).get(cause, []))

    def _nvmlDeviceGetRemappedRows(self, h):
        return self._supported(self._gpu(h, "nvmlDeviceGetRemappedRows")[1].remapped_rows)

    def _nvmlDeviceGetCurrentClocksEventReasons(self, h):
        return self._gpu(h, "nvmlDeviceGetCurrentClocksEventReasons")[1].throttle_bits

    def _nvmlDeviceGetCurrentClocksThrottleReasons(self, h):
        return self._gpu(h, "nvmlDeviceGetCurrentClocksThrottleReasons")[1].throttle_bits

    def _nvmlDeviceGetPerformanceState(self, h):
        return self._gpu(h, "nvmlDeviceGetPerformanceState")[1].pstate

    def _procs(self, h, function, graphics):
        g = self._gpu(h, function)[1]
        out = []
        for p in g.processes:
            if graphics and not p.graphics:
                continue
            out.append(pynvml.nvmlFriendlyObject({
                "pid": p.pid, "usedGpuMemory": p.used_bytes,
                "gpuInstanceId": 0xFFFFFFFF if p.gpu_instance is None else p.gpu_instance,
                "computeInstanceId": 0xFFFFFFFF if p.compute_instance is None else p.compute_instance}))
        return out

    def _nvmlDeviceGetComputeRunningProcesses(self, h):
        return self._procs(h, "nvmlDeviceGetComputeRunningProcesses", graphics=False)

    def _nvmlDeviceGetGraphicsRunningProcesses(self, h):
        return self._procs(h, "nvmlDeviceGetGraphicsRunningProcesses", graphics=True)

    def _nvmlEventSetCreate(self):
        es = {"gpus": set(), "queue": [], "handle": pynvml.c_nvmlEventSet_t(pynvml.struct_c_nvmlEventSet_t())}
        self._event_sets.append(es)
        return es["handle"]

    def _event_set(self, handle):
        address = ctypes.cast(handle, ctypes.c_void_p).value
        for es in self._event_sets:
            if ctypes.cast(es["handle"], ctypes.c_void_p).value == address:
                return es
        raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)

    def _nvmlDeviceRegisterEvents(self, h, event_types, event_set):
        i, _ = self._gpu(h, "nvmlDeviceRegisterEvents")
        if event_types & pynvml.nvmlEventTypeXidCriticalError:
            self._event_set(event_set)["gpus"].add(i)

    def _nvmlEventSetWait_v2(self, event_set, timeout_ms):
        code = self._failures.get((None, "nvmlEventSetWait_v2"))
        if code is not None:
            raise pynvml.NVMLError(code)
        es = self._event_set(event_set)
        if not es["queue"]:
            if timeout_ms != 0:  # a real wait with a timeout > 0 blocks the sampler
                self.blocking_waits.append(timeout_ms)
            raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)
        gpu, code = es["queue"].pop(0)
        data = pynvml.c_nvmlEventData_t()
        data.device = self._handles[gpu]
        data.eventType = pynvml.nvmlEventTypeXidCriticalError
        data.eventData = code
        return data

    def _nvmlEventSetWait(self, event_set, timeout_ms):
        return self._nvmlEventSetWait_v2(event_set, timeout_ms)

    def _nvmlEventSetFree(self, event_set):
        self._event_sets.remove(self._event_set(event_set))


class Patcher:
    """A minimal ``monkeypatch`` for code outside pytest (the benchmark): ``undo()`` restores."""

    def __init__(self):
        self._saved: list[tuple[Any, str, Any]] = []

    def setattr(self, obj, name, value):
        """Set ``obj.name = value``, remembering the old value."""
        self._saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    def undo(self):
        """Restore everything set, newest first."""
        while self._saved:
            obj, name, value = self._saved.pop()
            setattr(obj, name, value)
