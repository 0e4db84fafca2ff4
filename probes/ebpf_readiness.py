"""What the eBPF probes need from this machine, checked one item at a time.

``ebpf_checks()`` returns one dict per requirement (``gpudiag doctor`` prints them;
``gpudiag probe cuda`` refuses to start with the first required one that fails):

- privileges: root, or CAP_BPF + CAP_PERFMON (CAP_SYS_ADMIN on kernels before 5.8);
- bcc: Debian's python3-bpfcc (0.26 is known to work), imported from the system's
  dist-packages because it is not on PyPI (PyPI's ``bcc`` is an unrelated package);
- kernel headers: bcc compiles its C programs against them. BCC_KERNEL_SOURCE wins,
  then the tree ``scripts/system-deps.d/10-ebpf.sh`` builds in the checkout
  (``.cache/kernel-headers/tree``), then /lib/modules/$(uname -r)/build, then the
  kernel's own /sys/kernel/kheaders.tar.xz. A tree that another user can write to is
  refused: root compiles what is in it;
- the uprobe perf PMU (CONFIG_UPROBE_EVENTS), kernel lockdown, tracefs (host
  tracepoints only) and BTF (not used by these programs; reported for CO-RE tools).
"""

from __future__ import annotations

import importlib.util
import os
import stat
import sys
from pathlib import Path
from types import ModuleType

OK, MISSING, WRONG = "ok", "missing", "wrong"

CAP_SYS_ADMIN, CAP_PERFMON, CAP_BPF = 21, 38, 39

# Where distributions put bcc's Python module; GPUDIAG_BCC_PYTHONPATH (a colon-separated
# list) replaces them for a bcc built or installed elsewhere.
SYSTEM_BCC_PATHS = ("/usr/lib/python3/dist-packages", "/usr/lib/python3/site-packages")
BCC_PATH_ENV = "GPUDIAG_BCC_PYTHONPATH"

CHECKOUT_HEADER_TREE = Path(__file__).resolve().parents[1] / ".cache" / "kernel-headers" / "tree"
KHEADERS_ARCHIVE = Path("/sys/kernel/kheaders.tar.xz")
UPROBE_PMU = Path("/sys/bus/event_source/devices/uprobe/type")
BTF_VMLINUX = Path("/sys/kernel/btf/vmlinux")
LOCKDOWN = Path("/sys/kernel/security/lockdown")
TRACEFS_CANDIDATES = (Path("/sys/kernel/tracing"), Path("/sys/kernel/debug/tracing"))

HEADERS_FIX = ("run scripts/system-deps.d/10-ebpf.sh as root (Debian), or install the headers of "
               "the running kernel, or point BCC_KERNEL_SOURCE at a kernel header tree")


class BccUnavailable(Exception):
    """bcc's Python module cannot be imported; the message says why."""


def _check(name: str, status: str, detail: str, fix: str = "", required: bool = True) -> dict:
    return {"name": name, "status": status, "detail": detail, "fix": fix, "required": required}


def effective_capabilities(status_path: str = "/proc/self/status") -> int:
    """The effective capability mask of this process (0 when it cannot be read)."""
    try:
        with open(status_path) as fh:
            for line in fh:
                if line.startswith("CapEff:"):
                    return int(line.split()[1], 16)
    except OSError:
        pass
    return 0


def _has(caps: int, bit: int) -> bool:
    return bool(caps >> bit & 1)


def check_privileges() -> dict:
    """Root or CAP_BPF+CAP_PERFMON (or CAP_SYS_ADMIN) in the effective set."""
    caps, euid = effective_capabilities(), os.geteuid()
    bpf_perfmon = _has(caps, CAP_BPF) and _has(caps, CAP_PERFMON)
    if bpf_perfmon or _has(caps, CAP_SYS_ADMIN):
        who = "root" if euid == 0 else f"uid {euid} with " + (
            "CAP_BPF+CAP_PERFMON" if bpf_perfmon else "CAP_SYS_ADMIN")
        return _check("privileges", OK, f"{who}: may load BPF programs and attach uprobes")
    fix = ("run as root (sudo gpudiag ...), or grant the capabilities: "
           "sudo setcap cap_bpf,cap_perfmon,cap_sys_ptrace+ep on the Python interpreter")
    if euid == 0:
        return _check("privileges", WRONG,
                      "root, but CAP_BPF/CAP_PERFMON/CAP_SYS_ADMIN are not in the effective set "
                      "(a container that drops capabilities?)", fix)
    return _check("privileges", MISSING,
                  f"uid {euid} without CAP_BPF+CAP_PERFMON: loading BPF programs needs root", fix)


def _bcc_search_paths() -> list[str]:
    env = os.environ.get(BCC_PATH_ENV)
    if env is not None:
        return [p for p in env.split(":") if p]
    paths = list(SYSTEM_BCC_PATHS)
    paths += [str(p) for p in sorted(Path("/usr/lib").glob("python3*/site-packages"))]
    paths += [str(p) for p in sorted(Path("/usr/lib64").glob("python3*/site-packages"))]
    return paths


def _load_bcc_from(directory: str) -> ModuleType:
    init = Path(directory) / "bcc" / "__init__.py"
    spec = importlib.util.spec_from_file_location("bcc", init,
                                                  submodule_search_locations=[str(init.parent)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["bcc"] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        for name in [n for n in sys.modules if n == "bcc" or n.startswith("bcc.")]:
            del sys.modules[name]
        raise
    return module


def import_bcc() -> ModuleType:
    """bcc's Python module, loaded from the system (Debian: python3-bpfcc).

    The virtual environment does not see the system's dist-packages and PyPI's ``bcc``
    is another project, so the module is loaded from its file; sys.path is not changed.
    Raises BccUnavailable with the reason.
    """
    loaded = sys.modules.get("bcc")
    if loaded is not None and hasattr(loaded, "BPF"):
        return loaded
    found = [d for d in _bcc_search_paths() if os.path.isfile(Path(d) / "bcc" / "__init__.py")]
    if not found:
        raise BccUnavailable("bcc's Python module is not installed (looked in "
                             + ", ".join(_bcc_search_paths() or ["nothing"]) + ")")
    try:
        module = _load_bcc_from(found[0])
    except OSError as exc:  # the module is there but libbcc.so is not
        raise BccUnavailable(f"bcc in {found[0]} cannot load libbcc: {exc}") from None
    except Exception as exc:  # a broken install can raise anything at import
        raise BccUnavailable(f"bcc in {found[0]} fails to import: {type(exc).__name__}: {exc}") from None
    if not hasattr(module, "BPF"):
        raise BccUnavailable(f"{found[0]}/bcc is not the BPF Compiler Collection")
    return module


def check_bcc() -> dict:
    """bcc importable (and the real one)."""
    fix = "sudo apt-get install bpfcc-tools python3-bpfcc (Debian/Ubuntu; PyPI's 'bcc' is unrelated)"
    try:
        module = import_bcc()
    except BccUnavailable as exc:
        status = WRONG if "cannot load" in str(exc) or "fails to import" in str(exc) else MISSING
        return _check("bcc", status, str(exc), fix)
    version = getattr(module, "__version__", "unknown version")
    return _check("bcc", OK, f"bcc {version} from {Path(module.__file__).parent.parent}")


def untrusted_reason(path: Path) -> str | None:
    """Why root should not compile headers from ``path`` (None when it may).

    The directory and its parents must not be writable by other users: whoever can
    write there chooses what root's compiler reads.
    """
    try:
        resolved = path.resolve(strict=True)
    except OSError as exc:
        return f"{path} cannot be read ({exc.strerror})"
    me = os.geteuid()
    for p in (resolved, *resolved.parents):
        st = p.stat()
        if st.st_uid not in (0, me):
            return f"{p} belongs to uid {st.st_uid}"
        sticky = bool(st.st_mode & stat.S_ISVTX)
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not (sticky and p != resolved):
            return f"{p} is writable by other users"
    return None


def _usable_tree(path: Path) -> str | None:
    if not os.path.isdir(path / "include"):
        return f"{path} has no include/ directory"
    return untrusted_reason(path)


def kernel_source_tree() -> tuple[str, str] | None:
    """(path, where it came from) of the kernel headers bcc will use, or None.

    Raises ValueError when BCC_KERNEL_SOURCE is set but unusable: it was asked for.
    """
    env = os.environ.get("BCC_KERNEL_SOURCE")
    if env:
        reason = _usable_tree(Path(env))
        if reason:
            raise ValueError(f"BCC_KERNEL_SOURCE={env}: {reason}")
        return env, "BCC_KERNEL_SOURCE"
    if os.path.exists(CHECKOUT_HEADER_TREE / "include" / "generated" / "autoconf.h") \
            and untrusted_reason(CHECKOUT_HEADER_TREE) is None:
        return str(CHECKOUT_HEADER_TREE), "built by scripts/system-deps.d/10-ebpf.sh"
    build = Path("/lib/modules") / os.uname().release / "build"
    if os.path.isdir(build / "include"):
        return str(build), f"/lib/modules/{os.uname().release}/build"
    if os.path.exists(KHEADERS_ARCHIVE):
        return str(KHEADERS_ARCHIVE), "the kernel's own headers, CONFIG_IKHEADERS"
    return None


def check_kernel_headers() -> dict:
    """A kernel header tree for bcc's compiler."""
    try:
        found = kernel_source_tree()
    except ValueError as exc:
        return _check("kernel headers", WRONG, str(exc), HEADERS_FIX)
    if found is None:
        extra = ""
        if os.path.exists(CHECKOUT_HEADER_TREE):
            extra = f" ({CHECKOUT_HEADER_TREE} refused: {untrusted_reason(CHECKOUT_HEADER_TREE)})"
        return _check("kernel headers", MISSING,
                      f"no headers for kernel {os.uname().release}{extra}", HEADERS_FIX)
    path, origin = found
    return _check("kernel headers", OK, f"{path} ({origin})")


def check_uprobes() -> dict:
    """The kernel's uprobe perf PMU."""
    if os.path.exists(UPROBE_PMU):
        return _check("uprobes", OK, "uprobe perf events available")
    return _check("uprobes", MISSING, "the kernel has no uprobe PMU (CONFIG_UPROBE_EVENTS off)",
                  "use a kernel built with CONFIG_UPROBES and CONFIG_UPROBE_EVENTS")


def check_lockdown() -> dict:
    """Kernel lockdown in confidentiality mode forbids reading process memory from BPF."""
    try:
        mode = LOCKDOWN.read_text()
    except OSError:
        return _check("kernel lockdown", OK, "no lockdown")
    if "[confidentiality]" in mode:
        return _check("kernel lockdown", WRONG,
                      "lockdown=confidentiality forbids BPF reads of process memory",
                      "boot with lockdown=integrity or none (Secure Boot setups may set it)")
    return _check("kernel lockdown", OK, f"lockdown: {mode.strip()}")


def tracefs_root(mounts_path: str = "/proc/self/mounts") -> Path | None:
    """Where tracefs is mounted (None when it is not)."""
    try:
        with open(mounts_path) as fh:
            for line in fh:
                fields = line.split()
                if len(fields) > 2 and fields[2] == "tracefs":
                    return Path(fields[1].replace("\\040", " "))
    except OSError:
        pass
    for p in TRACEFS_CANDIDATES:  # /proc unreadable: fall back to looking
        if os.path.isdir(p / "events"):
            return p
    return None


def check_tracefs() -> dict:
    """tracefs, for the host tracepoints (sched_switch, OOM kills, library loads)."""
    root = tracefs_root()
    if root is not None:
        return _check("tracefs", OK, f"mounted at {root}", required=False)
    return _check("tracefs", MISSING,
                  "tracefs is not mounted: host tracepoints (off-CPU time, OOM kills, "
                  "immediate pickup of CUDA libraries loaded later) are off; uprobes still work",
                  "sudo mount -t tracefs nodev /sys/kernel/tracing (gpudiag probe cuda mounts "
                  "it itself when run as root)", required=False)


def check_btf() -> dict:
    """Kernel BTF (not needed by bcc's uprobe programs; CO-RE tools need it)."""
    if os.path.exists(BTF_VMLINUX):
        return _check("BTF", OK, f"{BTF_VMLINUX} present", required=False)
    return _check("BTF", MISSING, f"no {BTF_VMLINUX}: CO-RE eBPF tools will not load; "
                  "gpudiag's bcc probes do not need it", "use a kernel built with CONFIG_DEBUG_INFO_BTF",
                  required=False)


def ebpf_checks() -> list[dict]:
    """Every eBPF requirement as {"name", "status", "detail", "fix", "required"}.

    status is "ok", "missing" or "wrong"; fix says what to do when it is not ok;
    required says whether ``gpudiag probe cuda`` can start without it.
    """
    return [check_privileges(), check_bcc(), check_kernel_headers(), check_uprobes(),
            check_lockdown(), check_tracefs(), check_btf()]


def blocking(checks: list[dict]) -> list[dict]:
    """The required checks that failed, in order."""
    return [c for c in checks if c["required"] and c["status"] != OK]


def explain(check: dict) -> str:
    """One line: what is missing and how to fix it."""
    line = f"{check['name']}: {check['detail']}"
    return f"{line}; fix: {check['fix']}" if check["fix"] else line
