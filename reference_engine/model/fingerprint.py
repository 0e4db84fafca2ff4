"""A model's fingerprint: SHA-256 over every tensor's name, dtype, shape and bytes.

It identifies the weights a process serves, whatever the file is called and
however it is laid out: tensors are hashed in the order of their names (not
their order in the file), and a checkpoint split into shards has the same
fingerprint as the one file it was split from. A model initialised in memory
and the safetensors file it is saved to have the same fingerprint too, so the
engine can export it without a file.

Digest input (version 1), for each tensor sorted by name::

    u64 len(name) | name (UTF-8) | u64 len(dtype) | dtype ("F16", ...) |
    u64 ndim | u64 dim ... | u64 nbytes | the tensor's bytes (row-major, little-endian)

after the tag ``gpudiag-fingerprint-v1``; integers are little-endian. Every
field is length-prefixed, so no two different models hash the same input.
File data is streamed from a memory map in chunks (see
:meth:`SafetensorsFile.iter_chunks`): hashing a 14 GB file needs about one
chunk of memory.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from gpudiag.errors import GpudiagError

from .safetensors_io import SafetensorsFile, dtype_name

FINGERPRINT_TAG = b"gpudiag-fingerprint-v1"
# Large enough that hashlib runs at memory speed, small enough to stay out of the RSS.
CHUNK_BYTES = 16 << 20


@dataclass(frozen=True)
class Fingerprint:
    """The digest of a set of tensors and what went into it."""

    sha256: str
    tensor_count: int
    tensor_bytes: int
    sources: tuple[str, ...] = ()

    @property
    def short(self) -> str:
        """The first 12 hex digits, for labels and log lines."""
        return self.sha256[:12]

    def to_dict(self) -> dict:
        """JSON-ready form."""
        return {"sha256": self.sha256, "tensor_count": self.tensor_count,
                "tensor_bytes": self.tensor_bytes, "sources": list(self.sources)}


def _u64(n: int) -> bytes:
    return struct.pack("<Q", n)


def _field(b: bytes) -> bytes:
    return _u64(len(b)) + b


def _tensor_prefix(name: str, dtype: str, shape: Iterable[int], nbytes: int) -> bytes:
    shape = tuple(shape)
    return (_field(name.encode("utf-8")) + _field(dtype.encode("ascii")) + _u64(len(shape))
            + b"".join(_u64(d) for d in shape) + _u64(nbytes))


def fingerprint_files(paths: Iterable[str | os.PathLike], chunk_bytes: int = CHUNK_BYTES) -> Fingerprint:
    """Fingerprint of the tensors of one file or of the shards of one model.

    Raises GpudiagError if a file is not valid safetensors, or if two files
    hold a tensor of the same name (they are then not shards of one model).
    """
    paths = [os.fspath(p) for p in paths]
    if not paths:
        raise GpudiagError("fingerprint: no files given")
    files: list[SafetensorsFile] = []
    try:
        owner: dict[str, SafetensorsFile] = {}
        for p in paths:
            f = SafetensorsFile(p)
            files.append(f)
            for name in f.entries:
                if name in owner:
                    raise GpudiagError(f"tensor {name!r} is in both {owner[name].path} and {p}: "
                                       "the files are not shards of one model")
                owner[name] = f
        h = hashlib.sha256(FINGERPRINT_TAG)
        total = 0
        for name in sorted(owner):
            f = owner[name]
            e = f.entries[name]
            h.update(_tensor_prefix(name, e.dtype, e.shape, e.nbytes))
            for chunk in f.iter_chunks(name, chunk_bytes):
                h.update(chunk)
            total += e.nbytes
        return Fingerprint(h.hexdigest(), len(owner), total, tuple(paths))
    finally:
        for f in files:
            f.close()


def fingerprint_file(path: str | os.PathLike, chunk_bytes: int = CHUNK_BYTES) -> Fingerprint:
    """Fingerprint of one safetensors file."""
    return fingerprint_files([path], chunk_bytes)


def fingerprint_tensors(tensors: Mapping, chunk_bytes: int = CHUNK_BYTES) -> Fingerprint:
    """Fingerprint of named torch tensors in memory (equal to that of the file they would be saved to).

    Tensors on a GPU are copied to the host one chunk at a time.
    """
    import torch

    h = hashlib.sha256(FINGERPRINT_TAG)
    total = 0
    for name in sorted(tensors):
        t = tensors[name].detach()
        nbytes = t.numel() * t.element_size()
        h.update(_tensor_prefix(name, dtype_name(t.dtype), t.shape, nbytes))
        if nbytes:
            flat = t.contiguous().reshape(-1).view(torch.uint8)
            for off in range(0, nbytes, chunk_bytes):
                h.update(flat[off:off + chunk_bytes].cpu().numpy().data)
        total += nbytes
    return Fingerprint(h.hexdigest(), len(tensors), total)


def fingerprint_model(model) -> Fingerprint:
    """Fingerprint of a torch module's state dict (its parameters and persistent buffers)."""
    return fingerprint_tensors(model.state_dict())
