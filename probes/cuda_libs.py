"""Finding the CUDA runtime (libcudart) and driver (libcuda) libraries to put uprobes on.

A uprobe lives on a file, not on a process: attaching once to a library catches every
process that maps that file, and attaching twice counts every call twice. So candidates
from every source are reduced to one per distinct file:

- a process's mappings (/proc/PID/maps), which also finds the private copies that pip
  wheels carry (site-packages/nvidia/cuda_runtime/lib/libcudart.so.12, ...), files
  replaced on disk since they were mapped, and files inside containers;
- a path the user names (``--lib``);
- the system: ``ldconfig -p`` and the usual install locations.

A file is identified by (inode, size, mtime) rather than by (device, inode): the device
number of one file differs between an overlayfs path and the layer below it, and between
a btrfs subvolume and /proc/PID/maps, while the kernel puts the uprobe on the one real
inode underneath.
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
from dataclasses import dataclass, field

from gpudiag.errors import GpudiagError

RUNTIME, DRIVER = "runtime", "driver"

# libcudart.so, libcudart.so.13, libcudart.so.12.4.127, and wheel-repaired copies such
# as libcudart-d0da41ae.so.11.0; not libcudart_static.a or libcudadevrt.a.
_KIND_BY_NAME = (
    (re.compile(r"^libcudart(-[0-9a-f]{8})?\.so(\.\d+)*$"), RUNTIME),
    (re.compile(r"^libcuda(-[0-9a-f]{8})?\.so(\.\d+)*$"), DRIVER),
)

KNOWN_LOCATIONS = (
    "/usr/local/cuda/lib64", "/usr/local/cuda/targets/x86_64-linux/lib", "/usr/local/cuda-*/lib64",
    "/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib/wsl/lib", "/usr/lib/aarch64-linux-gnu",
)


def library_kind(path: str) -> str | None:
    """"runtime" for a libcudart, "driver" for a libcuda, None for anything else."""
    base = os.path.basename(path)
    for pattern, kind in _KIND_BY_NAME:
        if pattern.match(base):
            return kind
    return None


@dataclass(frozen=True)
class CudaLibrary:
    """One CUDA library file, and a path through which this process can reach it."""

    path: str  # to open and attach through (may be /proc/PID/root/... or /proc/PID/map_files/...)
    name: str  # as the process or the user names it
    kind: str | None  # runtime | driver | None (a --lib file with another name)
    inode: int
    size_bytes: int
    mtime_ns: int
    dev: int
    origin: str  # where it was found
    pids: tuple[int, ...] = field(default=(), compare=False)

    @property
    def identity(self) -> tuple[int, int, int]:
        """The file, whatever path leads to it (see the module docstring)."""
        return (self.inode, self.size_bytes, self.mtime_ns)


@dataclass(frozen=True)
class MappedFile:
    """One file-backed line of /proc/PID/maps."""

    start: int
    end: int
    perms: str
    offset: int
    dev: int
    inode: int
    path: str
    deleted: bool


def parse_maps(text: str) -> list[MappedFile]:
    """The file-backed mappings in the text of a /proc/PID/maps file."""
    out = []
    for line in text.splitlines():
        fields = line.split(None, 5)
        if len(fields) < 6 or not fields[5].startswith("/"):
            continue  # anonymous, [heap], [stack], [vdso] ...
        addresses, perms, offset, dev, inode, path = fields
        try:
            start_s, end_s = addresses.split("-")
            major, minor = dev.split(":")
            ino = int(inode)
        except ValueError:
            continue
        deleted = path.endswith(" (deleted)")
        if deleted:
            path = path[: -len(" (deleted)")]
        out.append(MappedFile(int(start_s, 16), int(end_s, 16), perms, int(offset, 16),
                              os.makedev(int(major, 16), int(minor, 16)), ino, path, deleted))
    return out


def mapped_files(pid: int, proc: str = "/proc") -> list[MappedFile]:
    """The file-backed mappings of a process; OSError when it is gone or unreadable."""
    with open(f"{proc}/{pid}/maps") as fh:
        return parse_maps(fh.read())


def _stat_library(path: str, name: str, kind: str | None, origin: str,
                  pids: tuple[int, ...] = ()) -> CudaLibrary:
    st = os.stat(path)
    return CudaLibrary(path=path, name=name, kind=kind, inode=st.st_ino, size_bytes=st.st_size,
                       mtime_ns=st.st_mtime_ns, dev=st.st_dev, origin=origin, pids=pids)


def libraries_in_process(pid: int, proc: str = "/proc",
                         maps: list[MappedFile] | None = None) -> list[CudaLibrary]:
    """The CUDA libraries a process has mapped, one per file; [] when it is gone or unreadable.

    The file is reached through /proc/PID/root (the process's own view of the file
    system, right inside containers) when that still names the mapped inode, else
    through /proc/PID/map_files (the mapping itself: right for files deleted or
    replaced since they were mapped).
    """
    if maps is None:
        try:
            maps = mapped_files(pid, proc)
        except OSError:
            return []
    seen: dict[tuple[int, int, int], CudaLibrary] = {}
    for m in maps:
        kind = library_kind(m.path)
        if kind is None:
            continue
        candidates = []
        if not m.deleted:
            candidates.append(f"{proc}/{pid}/root{m.path}")
        candidates.append(f"{proc}/{pid}/map_files/{m.start:x}-{m.end:x}")
        for path in candidates:
            try:
                lib = _stat_library(path, m.path, kind, f"mapped by pid {pid}", (pid,))
            except OSError:
                continue
            if lib.inode != m.inode:
                continue  # the name now points to another file; try the mapping itself
            seen.setdefault(lib.identity, lib)
            break
    return list(seen.values())


def library_from_path(path: str, origin: str = "--lib") -> CudaLibrary:
    """A library the user names; GpudiagError when it is not a readable ELF file."""
    try:
        with open(path, "rb") as fh:
            magic = fh.read(4)
    except OSError as exc:
        raise GpudiagError(f"--lib {path}: {exc.strerror}") from None
    if magic != b"\x7fELF":
        raise GpudiagError(f"--lib {path}: not an ELF shared library")
    real = os.path.realpath(path)
    return _stat_library(real, path, library_kind(real) or library_kind(path), origin)


def _ldconfig_paths() -> list[str]:
    for exe in ("ldconfig", "/sbin/ldconfig", "/usr/sbin/ldconfig"):
        try:
            out = subprocess.run([exe, "-p"], capture_output=True, text=True, timeout=10,
                                 check=False).stdout
        except (OSError, subprocess.TimeoutExpired):
            continue
        return [line.rsplit("=>", 1)[1].strip() for line in out.splitlines() if "=>" in line]
    return []


def system_libraries() -> list[CudaLibrary]:
    """CUDA libraries installed system-wide (ldconfig's cache and the usual places), one per file.

    Stub libraries (…/stubs/libcuda.so, for linking only) are left out: no process
    runs them.
    """
    found: dict[tuple[int, int, int], CudaLibrary] = {}
    candidates = [(p, "ldconfig") for p in _ldconfig_paths()]
    for pattern in KNOWN_LOCATIONS:
        for directory in sorted(glob.glob(pattern)):
            for name in sorted(os.listdir(directory)) if os.path.isdir(directory) else ():
                candidates.append((os.path.join(directory, name), "known location"))
    for path, origin in candidates:
        kind = library_kind(path)
        if kind is None or "/stubs/" in path:
            continue
        try:
            lib = _stat_library(os.path.realpath(path), path, kind, origin)
        except OSError:
            continue
        found.setdefault(lib.identity, lib)
    return list(found.values())


def distinct(libraries: list[CudaLibrary]) -> list[CudaLibrary]:
    """One library per file, the first seen kept (with the pids of all that map it)."""
    out: dict[tuple[int, int, int], CudaLibrary] = {}
    for lib in libraries:
        first = out.get(lib.identity)
        if first is None:
            out[lib.identity] = lib
        elif lib.pids:
            pids = tuple(sorted(set(first.pids) | set(lib.pids)))
            out[lib.identity] = CudaLibrary(**{**first.__dict__, "pids": pids})
    return list(out.values())


def processes_with_cuda(proc: str = "/proc") -> dict[int, list[CudaLibrary]]:
    """Every process that has a CUDA library mapped, with those libraries."""
    out = {}
    for entry in os.listdir(proc):
        if not entry.isdigit():
            continue
        pid = int(entry)
        try:
            with open(f"{proc}/{pid}/maps") as fh:
                text = fh.read()
        except OSError:
            continue
        if "libcuda" not in text:  # cheap filter before parsing thousands of lines
            continue
        libs = libraries_in_process(pid, proc, parse_maps(text))
        if libs:
            out[pid] = libs
    return out
