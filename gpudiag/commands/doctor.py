"""``gpudiag doctor``: what this node can observe, what is missing or wrong, and how to fix it.

Driver/firmware versus framework mismatches masquerade as framework bugs
(SCENARIOS.md, practice notes), so versions come first. Every check is one
dict ``{"feature", "name", "status", "detail", "fix", "required"}`` with
status ``ok``, ``missing`` or ``wrong``; ``fix`` says what to do when it is
not ok; ``required`` says whether the feature works without it.

Features: ``nvml`` (GPU counters, per-process memory, PID mapping), ``cuda``
(driver's CUDA version against every CUDA runtime found), ``torch`` (the
in-process reporter), ``ebpf`` (the CUDA API probes). By default the features
the node has are checked, and always ``nvml``: the NVIDIA driver is what
gpudiag watches GPUs through, so a node without one lacks a required piece,
said first, with what still works without it (WITHOUT_DRIVER). The exit code
is 0 when every required check of the chosen features is ok, 1 otherwise.
With the agent's ``--config``, the eBPF checks follow its ``probes.ebpf``:
left out when off, optional when auto.
"""

from __future__ import annotations

import ctypes
import glob
import importlib
import importlib.metadata
import importlib.util
import json
import os
import re
import sys
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from gpudiag.errors import GpudiagError
from gpudiag.render import figure_column, identity_column, terminal_table, text_column

OK, MISSING, WRONG = "ok", "missing", "wrong"
FEATURES = ("nvml", "cuda", "torch", "ebpf", "kubernetes")
# What gpudiag still does on a node without an NVIDIA driver: nothing of it reads a GPU of this node.
WITHOUT_DRIVER = (
    "gpudiag repro and agent --sim: incidents on the simulated GPU",
    "gpudiag analyze trace / snapshot: profiler traces and allocator snapshots recorded elsewhere",
    "gpudiag investigate --prometheus URL or --store PATH: telemetry of other nodes",
    "gpudiag engine serve --device cpu, and scraping a serving engine's /metrics",
)

# Pip wheels that carry a CUDA runtime (cu11/cu12 suffixes before CUDA 13, none after).
_RUNTIME_WHEEL = re.compile(r"^nvidia[-_]cuda[-_]runtime([-_]cu\d+)?$", re.IGNORECASE)
_CUDART_VERSION = re.compile(r"#define\s+CUDART_VERSION\s+(\d+)")


def _check(feature: str, name: str, status: str, detail: str, fix: str = "", required: bool = True) -> dict:
    return {"feature": feature, "name": name, "status": status, "detail": detail, "fix": fix,
            "required": required}


def parse_version(text: str | None) -> tuple[int, int] | None:
    """``"12.4"`` or ``"12.4.131"`` -> (12, 4); None when it is not a version."""
    if not text:
        return None
    m = re.match(r"^\s*(\d+)(?:\.(\d+))?", str(text))
    if not m:
        return None
    return int(m.group(1)), int(m.group(2) or 0)


def _int_version(v: int) -> str:
    return f"{v // 1000}.{(v % 1000) // 10}"


# --- NVML -------------------------------------------------------------------------------


def nvml_facts() -> dict[str, Any]:
    """The NVML probe's status (availability, driver and CUDA driver versions, GPUs, PID mapping)."""
    from gpudiag.probes.nvml import NvmlProbe

    probe = NvmlProbe(xid_events=False)
    try:
        return probe.status()
    finally:
        probe.close()


def nvml_checks(facts: dict[str, Any]) -> list[dict]:
    """NVML reachable and the driver version; MIG/vGPU; lost GPUs; the PID namespace."""
    out = []
    if not facts.get("available"):
        out.append(_check("nvml", "NVML", MISSING, facts.get("reason") or "NVML is not reachable",
                          "install the NVIDIA driver (it ships libnvidia-ml.so.1) and load its kernel module; "
                          "in a container, run with the NVIDIA container toolkit (--gpus all)"))
        return out
    gpus = facts.get("gpus") or []
    out.append(_check("nvml", "NVML", OK, f"driver {facts.get('driver_version')}, "
                      f"CUDA driver API {facts.get('cuda_driver_version')}, {len(gpus)} GPU(s): "
                      + ", ".join(sorted({g.get('name') or '?' for g in gpus}))))
    lost = [g for g in gpus if g.get("lost")]
    if lost:
        out.append(_check("nvml", "GPUs lost", WRONG,
                          "; ".join(f"GPU {g['gpu']}: {g.get('lost_reason')}" for g in lost),
                          "check `dmesg` for XID 79 / 'fallen off the bus'; drain the node and reset the GPU "
                          "(nvidia-smi -r) or reboot"))
    unreliable = [g for g in gpus if g.get("metrics_unreliable")]
    if unreliable:
        out.append(_check("nvml", "MIG / vGPU", WRONG,
                          "; ".join(f"GPU {g['gpu']}: {g['metrics_unreliable']}" for g in unreliable),
                          "read per-tenant figures from DCGM's MIG profiling or the hypervisor; treat "
                          "utilization and per-process memory here as the physical GPU's", required=False))
    else:
        out.append(_check("nvml", "MIG / vGPU", OK, "no MIG, no vGPU: NVML's figures describe this node",
                          required=False))
    ns = facts.get("pid_namespace") or {}
    if ns.get("mode") == "unmappable":
        out.append(_check("nvml", "PID namespace", WRONG, ns.get("reason", ""),
                          "docker run --pid=host, or hostPID: true in the pod spec, or mount the host's /proc "
                          "at /host/proc", required=False))
    else:
        out.append(_check("nvml", "PID namespace", OK, ns.get("reason", ""), required=False))
    return out


def pid_namespace_check() -> dict:
    """The PID namespace on its own (without NVML: where the agent's PIDs come from)."""
    from gpudiag.probes.nvml import PidNamespaceMap

    st = PidNamespaceMap().status()
    status = WRONG if st["mode"] == "unmappable" else OK
    return _check("nvml", "PID namespace", status, st["reason"],
                  "" if status == OK else "docker run --pid=host, or hostPID: true in the pod spec",
                  required=False)


# --- CUDA runtimes ------------------------------------------------------------------------


def _toolkit_version(root: str) -> tuple[str | None, str]:
    """The CUDA runtime version of a toolkit directory, and where it was read."""
    header = os.path.join(root, "include", "cuda_runtime_api.h")
    try:
        with open(header, errors="replace") as fh:
            m = _CUDART_VERSION.search(fh.read())
        if m:
            return _int_version(int(m.group(1))), header
    except OSError:
        pass
    try:
        with open(os.path.join(root, "version.json")) as fh:
            v = json.load(fh).get("cuda", {}).get("version")
        if v:
            return v, os.path.join(root, "version.json")
    except (OSError, ValueError, AttributeError):
        pass
    for lib in sorted(glob.glob(os.path.join(root, "lib64", "libcudart.so.*"))):
        v = runtime_library_version(lib)
        if v:
            return v, lib
    return None, root


def runtime_library_version(path: str) -> str | None:
    """``cudaRuntimeGetVersion`` of a libcudart (works without a driver); None if it cannot load."""
    try:
        lib = ctypes.CDLL(path)
        value = ctypes.c_int()
        if lib.cudaRuntimeGetVersion(ctypes.byref(value)) == 0 and value.value:
            return _int_version(value.value)
    except (OSError, AttributeError):
        pass
    return None


def find_cuda_runtimes() -> list[dict[str, str]]:
    """Every CUDA runtime this node would load: system toolkits, $CUDA_HOME, pip wheels, torch's build."""
    found: list[dict[str, str]] = []
    roots = sorted(set(glob.glob("/usr/local/cuda*")) | {os.environ.get(v) for v in ("CUDA_HOME", "CUDA_PATH")
                                                         if os.environ.get(v)})
    seen = set()
    for root in roots:
        real = os.path.realpath(root)
        if real in seen or not os.path.isdir(real):
            continue
        seen.add(real)
        version, source = _toolkit_version(real)
        if version:
            found.append({"kind": "toolkit", "where": real, "version": version, "source": source})
    for dist in importlib.metadata.distributions():
        name = dist.metadata.get("Name") or ""
        if _RUNTIME_WHEEL.match(name):
            found.append({"kind": "pip wheel", "where": name, "version": dist.version, "source": "pip"})
    torch = _import("torch")
    if torch is not None and getattr(torch.version, "cuda", None):
        found.append({"kind": "torch build", "where": f"torch {torch.__version__}", "version": torch.version.cuda,
                      "source": "torch.version.cuda"})
    return found


def cuda_checks(driver_cuda: str | None, runtimes: list[dict[str, str]]) -> list[dict]:
    """Each runtime against the driver's CUDA version.

    A runtime of a newer major version than the driver cannot initialise
    (cudaErrorInsufficientDriver); a newer minor version of the same major
    runs under CUDA's minor-version compatibility, except code that needs the
    driver to JIT newer PTX.
    """
    out = []
    drv = parse_version(driver_cuda)
    if not runtimes:
        out.append(_check("cuda", "CUDA runtimes", MISSING, "no CUDA runtime found (system, pip or torch)",
                          "install a CUDA build of your framework (pip wheels carry their runtime)",
                          required=False))
    if drv is None:
        listed = ", ".join(f"{r['version']} ({r['kind']})" for r in runtimes) or "none"
        out.append(_check("cuda", "CUDA driver", MISSING,
                          f"no CUDA driver version (no NVML / driver); runtimes found: {listed}",
                          "install the NVIDIA driver; every CUDA runtime fails without it "
                          "(cudaErrorInsufficientDriver)"))
        return out
    out.append(_check("cuda", "CUDA driver", OK, f"the driver supports CUDA up to {driver_cuda}"))
    for r in runtimes:
        rv = parse_version(r["version"])
        label = f"CUDA runtime {r['version']} ({r['kind']}: {r['where']})"
        if rv is None:
            out.append(_check("cuda", label, WRONG, f"unreadable version {r['version']!r}", required=False))
        elif rv[0] > drv[0]:
            out.append(_check("cuda", label, WRONG,
                              f"needs a driver for CUDA {rv[0]}.x; this driver supports {driver_cuda}",
                              f"upgrade the NVIDIA driver to one for CUDA {rv[0]}.{rv[1]} or newer, or use a "
                              f"build of the framework for CUDA {drv[0]}.x"))
        elif rv > drv:
            out.append(_check("cuda", label, OK,
                              f"newer minor version than the driver's {driver_cuda}: runs under minor-version "
                              "compatibility, but kernels that need PTX JIT will fail",
                              f"upgrade the driver to CUDA {rv[0]}.{rv[1]} if you see "
                              "cudaErrorUnsupportedPtxVersion", required=False))
        else:
            out.append(_check("cuda", label, OK, f"supported by the driver ({driver_cuda})"))
    return out


# --- torch / triton ---------------------------------------------------------------------


def _import(name: str):
    try:
        return importlib.import_module(name)
    except Exception:  # noqa: BLE001 - a broken install is reported as "not importable"
        return None


def torch_checks(node_has_gpu: bool) -> list[dict]:
    """torch and triton versions and whether torch sees a GPU (required only where the node has one)."""
    out = []
    torch = _import("torch")
    if torch is None:
        out.append(_check("torch", "torch", MISSING, "torch is not importable in this environment",
                          "pip install torch (the in-process reporter needs it in the training/serving process)"))
        return out
    cuda = getattr(torch.version, "cuda", None)
    out.append(_check("torch", "torch", OK, f"torch {torch.__version__}, built for CUDA {cuda or '(none: CPU build)'}"))
    if cuda is None:
        out.append(_check("torch", "torch sees a GPU", MISSING if not node_has_gpu else WRONG,
                          "this torch is a CPU build: gpudiag.instrument() is a no-op in it",
                          "install a CUDA build of torch whose CUDA version the driver supports "
                          "(see the cuda checks)", required=node_has_gpu))
    else:
        try:
            count = torch.cuda.device_count()
            available = torch.cuda.is_available()
        except Exception as exc:  # noqa: BLE001 - whatever CUDA initialisation raises is the finding
            count, available = 0, False
            reason = f"{type(exc).__name__}: {exc}"
        else:
            reason = "torch.cuda.is_available() is False"
        if available and count:
            out.append(_check("torch", "torch sees a GPU", OK, f"{count} CUDA device(s) visible"))
        else:
            out.append(_check("torch", "torch sees a GPU", WRONG if node_has_gpu else MISSING,
                              f"{reason}; CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')}",
                              "check the driver (nvidia-smi), CUDA_VISIBLE_DEVICES and that torch's CUDA "
                              "version is supported by the driver (see the cuda checks)", required=node_has_gpu))
    triton = _import("triton")
    if triton is None:
        out.append(_check("torch", "triton", MISSING, "triton is not importable",
                          "pip install triton (torch.compile and the reference engine's kernels need it)",
                          required=False))
    else:
        out.append(_check("torch", "triton", OK, f"triton {getattr(triton, '__version__', '?')}", required=False))
    return out


# --- eBPF -------------------------------------------------------------------------------


def ebpf_checks() -> list[dict]:
    """The eBPF readiness checks (root or capabilities, BTF, bcc, kernel headers...)."""
    try:
        module = importlib.import_module("gpudiag.probes.ebpf_readiness")
        checks = module.ebpf_checks()
    except ImportError:
        return [_check("ebpf", "eBPF checks", MISSING,
                       "eBPF checks are unavailable: gpudiag.probes.ebpf_readiness is not installed",
                       "install a gpudiag with the eBPF probes")]
    except Exception as exc:  # noqa: BLE001 - a failing check module is itself a finding
        return [_check("ebpf", "eBPF checks", WRONG, f"the eBPF checks failed: {type(exc).__name__}: {exc}",
                       "run with GPUDIAG_DEBUG=1 and report it")]
    return [_check("ebpf", c.get("name", "?"), c.get("status", WRONG), c.get("detail", ""), c.get("fix", ""),
                   bool(c.get("required", True))) for c in checks]


# --- the whole ------------------------------------------------------------------------------


def kubernetes_checks(socket_path: str | None = None) -> list[dict]:
    """What pod attribution reads (docs/kubernetes.md): grpcio, the kubelet's pod-resources socket, its
    log names, and the host PID namespace."""
    from gpudiag.probes.base import in_host_pid_namespace
    from gpudiag.probes.kube import CONTAINER_LOGS_DIR
    from gpudiag.probes.pod_resources import DEFAULT_SOCKET, PodResourcesError, check_socket

    socket_path = socket_path or DEFAULT_SOCKET
    out = []
    try:
        import grpc  # noqa: F401
        out.append(_check("kubernetes", "grpcio", OK, "installed"))
    except ImportError:
        out.append(_check("kubernetes", "grpcio", MISSING, "not installed: the pod-resources API is gRPC",
                          "pip install 'gpudiag[kubernetes]'"))
    try:
        check_socket(socket_path)
        out.append(_check("kubernetes", "kubelet pod-resources", OK, f"{socket_path} answers connections"))
    except PodResourcesError as e:
        out.append(_check("kubernetes", "kubelet pod-resources", MISSING, str(e),
                          "mount /var/lib/kubelet/pod-resources read-only and run the agent as root "
                          "(deploy/kubernetes/daemonset.yaml)"))
    readable = os.access(CONTAINER_LOGS_DIR, os.R_OK | os.X_OK)
    out.append(_check("kubernetes", "kubelet log names", OK if readable else MISSING,
                      f"{CONTAINER_LOGS_DIR} {'readable' if readable else 'not readable'}: container ID -> pod names",
                      "" if readable else "mount /var/log/containers and /var/log/pods read-only", required=False))
    host = in_host_pid_namespace()  # None: cannot tell (no /proc/self/ns/pid)
    out.append(_check("kubernetes", "host PID namespace", OK if host else WRONG if host is False else MISSING,
                      "every process's /proc/PID/cgroup is visible" if host
                      else "only this container's processes are visible" if host is False
                      else "cannot tell which PID namespace this is", "" if host else "hostPID: true"))
    return out


def default_features(facts: dict[str, Any]) -> list[str]:
    """What the node has, and nvml always: cuda where NVML answers, torch where it imports, ebpf where root
    or bcc is. Without a driver nvml is checked all the same: gpudiag watches GPUs through it."""
    out = ["nvml"]
    if facts.get("available"):
        out.append("cuda")
    if importlib.util.find_spec("torch") is not None:
        out.append("torch")
    if os.geteuid() == 0 or os.path.isdir("/usr/lib/python3/dist-packages/bcc"):
        out.append("ebpf")
    from gpudiag.probes.kube import on_kubernetes

    if on_kubernetes():
        out.append("kubernetes")
    return out


def run_checks(features: list[str] | None = None, *, ebpf_mode: str | None = None,
               pod_resources_socket: str | None = None) -> dict[str, Any]:
    """Run the checks of ``features`` (None: the node's); returns {"features", "checks", "ok", "driver"},
    and ``without_driver`` (what still works, WITHOUT_DRIVER) on a node without an NVIDIA driver.

    ``ebpf_mode`` is the agent's ``probes.ebpf`` (``--config``): where the features are the
    node's, "off" leaves the eBPF checks out, "auto" makes them optional (the agent runs
    without the CUDA API probes then) and "on" requires them, root or not.
    """
    unknown = [f for f in features or () if f not in FEATURES]
    if unknown:
        raise GpudiagError(f"unknown feature {', '.join(unknown)}: choose from {', '.join(FEATURES)}")
    facts = nvml_facts()
    chosen = list(dict.fromkeys(features)) if features else default_features(facts)
    ebpf_optional = False
    if not features and ebpf_mode is not None:
        if ebpf_mode == "off":
            chosen = [f for f in chosen if f != "ebpf"]
        elif ebpf_mode == "on" and "ebpf" not in chosen:
            chosen.append("ebpf")
        ebpf_optional = ebpf_mode == "auto"
    checks: list[dict] = []
    if "nvml" in chosen:
        checks += nvml_checks(facts)
        if not facts.get("available"):
            checks.append(pid_namespace_check())  # where the agent's PIDs come from, driver or not
    else:  # not chosen: still say whether NVML answers, as information
        checks += [dict(c, required=False) for c in nvml_checks(facts) if c["name"] == "NVML"]
        checks.append(pid_namespace_check())
    if "cuda" in chosen:
        checks += cuda_checks(facts.get("cuda_driver_version"), find_cuda_runtimes())
    if "torch" in chosen:
        checks += torch_checks(bool(facts.get("available")))
    if "ebpf" in chosen:
        checks += [dict(c, required=False) if ebpf_optional else c for c in ebpf_checks()]
    if "kubernetes" in chosen:
        checks += kubernetes_checks(pod_resources_socket)
    ok = all(c["status"] == OK for c in checks if c["required"] and c["feature"] in chosen)
    driver = bool(facts.get("available"))
    out = {"features": chosen, "checks": checks, "ok": ok,
           "driver": {"present": driver, "detail": facts.get("driver_version") if driver
                      else facts.get("reason") or "NVML is not reachable"}}
    if not driver:
        out["without_driver"] = list(WITHOUT_DRIVER)
    return out


_STYLE = {OK: "green", MISSING: "yellow", WRONG: "red"}


def checks_table(checks: list[dict[str, Any]]) -> Table:
    """The checks as a table that reads at 80 columns: status, the check's name whole, its detail and fix wrapped."""
    names = [f"{c['feature']}: {c['name']}" + ("" if c["required"] else " (optional)") for c in checks]
    table = terminal_table(show_header=False, box=None)
    figure_column(table, "status")
    identity_column(table, "check", names)
    text_column(table, "detail")
    for c, name in zip(checks, names):
        detail = Text(c["detail"] or "")
        if c["status"] != OK and c["fix"]:
            detail.append(f"\nfix: {c['fix']}", style="cyan")
        table.add_row(Text(c["status"], style=_STYLE[c["status"]]),
                      Text(name, style="bold" if c["required"] else ""), detail)
    return table


def register(app: typer.Typer) -> None:
    """Add the ``doctor`` command."""

    @app.command("doctor")
    def doctor(
        feature: Annotated[list[str] | None, typer.Option(
            "--feature", "-f", metavar="FEATURE", help=f"Check this feature ({', '.join(FEATURES)}); repeatable. "
                                    "Default: the features this node has.")] = None,
        config: Annotated[str | None, typer.Option(
            "--config", metavar="FILE",
            help="The agent's config file: check the features it uses "
                 "(probes.ebpf off: no eBPF checks; auto: optional; on: required).")] = None,
        json_out: Annotated[bool, typer.Option("--json", help="Print one JSON document.")] = False,
    ) -> None:
        """Check what gpudiag needs on this node: each check ok / missing / wrong, with the fix."""
        ebpf_mode = socket_path = None
        if config is not None:
            from gpudiag.agent.config import load

            loaded = load(config)
            ebpf_mode = loaded.get("probes.ebpf")
            socket_path = loaded.get("kubernetes.pod_resources_socket")
        result = run_checks([f.strip().lower() for f in feature or ()] or None, ebpf_mode=ebpf_mode,
                            pod_resources_socket=socket_path)
        if config is not None:
            result["agent_config"] = {"path": config, "probes.ebpf": ebpf_mode}
        if json_out:
            sys.stdout.write(json.dumps(result, indent=1) + "\n")
        else:
            console = Console()
            console.print(Text(f"gpudiag doctor: {', '.join(result['features']) or 'no feature'}", style="bold"))
            if not result["driver"]["present"]:
                console.print(Text(f"no NVIDIA driver on this node: {result['driver']['detail']}. gpudiag cannot "
                                   "watch a GPU here; what still works:", style="bold red"))
                for line in result["without_driver"]:
                    console.print(Text(f"  - {line}"))
            if ebpf_mode is not None:
                console.print(Text(f"agent config {config}: probes.ebpf = {ebpf_mode}", style="dim"))
            if result["checks"]:
                console.print(checks_table(result["checks"]))
            if not result["ok"]:
                verdict = "something needed is missing or wrong (see fix)"
            elif result["driver"]["present"]:
                verdict = "everything needed is present"
            else:  # features chosen that do without the driver: theirs is present, and no GPU can be watched
                verdict = (f"what {', '.join(result['features'])} needs is present; without an NVIDIA driver "
                           "no GPU of this node can be watched")
            console.print(Text(verdict, style="green" if result["ok"] else "red"))
        raise typer.Exit(0 if result["ok"] else 1)
