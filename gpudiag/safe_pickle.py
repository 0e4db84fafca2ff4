"""Loading pickles that may come from anywhere, without running their code.

A pickle can name any importable callable and have the loader call it (that
is how ``__reduce__`` works), so ``pickle.load`` on an untrusted file runs
arbitrary code. PyTorch memory snapshots (``torch.cuda.memory._dump_snapshot``)
are pickles of plain data, so they are loaded here with an unpickler that
builds plain data and nothing else:

* dict, list, tuple, str, bytes, int, float, bool and None have their own
  pickle opcodes and never go through ``find_class``;
* the only globals admitted are ``builtins.set``, ``builtins.frozenset`` and
  ``builtins.bytearray`` (also under their Python 2 module name
  ``__builtin__``, which protocols 0-2 write), which older protocols rebuild
  by calling the type on a list of items;
* every other global (``os.system``, ``builtins.eval``, any class) is refused
  with GpudiagError naming it, before anything is called. That includes
  ``_codecs.encode``, through which protocols 0-2 write bytes: snapshots are
  written with the default protocol (4 or later), where bytes have opcodes.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any, BinaryIO

from gpudiag.errors import GpudiagError

ADMITTED_GLOBALS = frozenset(
    (module, name) for module in ("builtins", "__builtin__") for name in ("set", "frozenset", "bytearray")
)

_TYPES = {"set": set, "frozenset": frozenset, "bytearray": bytearray}


class RefusedGlobal(pickle.UnpicklingError):
    """A pickle named a global outside ADMITTED_GLOBALS."""

    def __init__(self, module: str, name: str):
        super().__init__(f"{module}.{name}")
        self.module = module
        self.name = name


class PlainDataUnpickler(pickle.Unpickler):
    """An Unpickler that builds only plain containers and scalars (see the module docstring)."""

    def find_class(self, module: str, name: str) -> Any:
        """Return set, frozenset or bytearray for their builtins names; refuse everything else."""
        if (module, name) in ADMITTED_GLOBALS:
            return _TYPES[name]
        raise RefusedGlobal(module, name)

    def persistent_load(self, pid: Any) -> Any:
        """Refuse persistent ids: they hand object construction to the caller."""
        raise pickle.UnpicklingError("persistent ids are not admitted")


def loads_plain(data: bytes, source: str = "pickle") -> Any:
    """Unpickle ``data`` with PlainDataUnpickler; GpudiagError (naming ``source``) on anything else."""
    return _load_plain(io.BytesIO(data), source)


def _load_plain(file: BinaryIO, source: str) -> Any:
    try:
        return PlainDataUnpickler(file).load()
    except RefusedGlobal as exc:
        raise GpudiagError(
            f"refusing to load {source}: it asks to import {exc.module}.{exc.name}, and only plain "
            "containers and scalars are admitted (a memory snapshot never needs more)"
        ) from None
    except RecursionError:
        raise GpudiagError(f"{source} is nested too deeply to be a memory snapshot") from None
    except Exception as exc:  # noqa: BLE001 - a damaged pickle can raise almost any type from the C unpickler
        raise GpudiagError(f"{source} is not a readable pickle ({type(exc).__name__}: {exc})") from None


def load_snapshot(path: str | Path) -> Any:
    """Read a pickled PyTorch memory snapshot from ``path`` without executing any of its code.

    Returns the unpickled plain data (for a snapshot, a dict with ``segments``
    and ``device_traces``); the caller checks its shape. GpudiagError when the
    file is missing, unreadable, not a pickle, or refers to any global beyond
    the admitted container types.
    """
    p = Path(path)
    try:
        file = p.open("rb")
    except FileNotFoundError:
        raise GpudiagError(f"snapshot file not found: {p}") from None
    except IsADirectoryError:
        raise GpudiagError(f"{p} is a directory, not a snapshot file") from None
    except OSError as exc:
        raise GpudiagError(f"cannot read snapshot file {p}: {exc.strerror or exc}") from None
    # Read as the pickle asks for its bytes, not whole first: a stream that never ends (a device,
    # a pipe that is not a pickle) is refused at its first bad byte instead of filling memory.
    with file:
        return _load_plain(file, str(p))
