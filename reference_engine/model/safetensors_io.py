"""Reading and writing the safetensors format, memory-mapped, without the `safetensors` package.

The format (https://github.com/huggingface/safetensors): 8 bytes, a
little-endian u64 ``N``; ``N`` bytes of a UTF-8 JSON object mapping each
tensor name to ``{"dtype": "F16", "shape": [...], "data_offsets": [begin,
end]}`` (offsets into the byte buffer that follows the header) plus an
optional ``"__metadata__"`` map of strings; then the byte buffer, row-major,
little-endian. Nothing in it is executable, which is why checkpoints are
read from it and never from pickles.

A file is checked the way the reference implementation checks it before
any tensor is touched: header length within the file and below 100 MB,
known dtypes, byte ranges that match the shapes and tile the buffer with no
gap and no overlap. A file that fails is reported with one GpudiagError.

The data is never read into memory as a whole: :class:`SafetensorsFile`
maps the file and hands out views and chunks of it, so hashing or loading
a 14 GB checkpoint costs page cache, not 14 GB of process memory. torch is
imported only by the functions that build tensors.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from gpudiag.errors import GpudiagError

# The reference implementation's bound: a larger header is refused as hostile.
MAX_HEADER_BYTES = 100_000_000
METADATA_KEY = "__metadata__"

# dtype name -> bytes per element.
DTYPE_ITEMSIZE = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}


def _torch_dtypes() -> dict:
    import torch

    table = {
        "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16,
        "F16": torch.float16, "BF16": torch.bfloat16, "I32": torch.int32, "F32": torch.float32,
        "I64": torch.int64, "F64": torch.float64,
    }
    for name, attr in (("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64"),
                       ("F8_E5M2", "float8_e5m2"), ("F8_E4M3", "float8_e4m3fn")):
        if hasattr(torch, attr):
            table[name] = getattr(torch, attr)
    return table


def dtype_name(torch_dtype) -> str:
    """The safetensors name of a torch dtype (torch.float16 -> 'F16')."""
    for name, dt in _torch_dtypes().items():
        if dt == torch_dtype:
            return name
    raise GpudiagError(f"dtype {torch_dtype} has no safetensors name")


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a file: its name, dtype, shape and absolute byte range in the file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor's data."""
        return self.end - self.start

    @property
    def numel(self) -> int:
        """Number of elements."""
        n = 1
        for d in self.shape:
            n *= d
        return n


class SafetensorsFile:
    """A validated safetensors file, memory-mapped on first access to its data.

    Use as a context manager, or call :meth:`close`.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._mmap: mmap.mmap | None = None
        self._fh = None
        try:
            self._fh = open(self.path, "rb")  # noqa: SIM115 -- held open with the mapping, closed by close()
            self.file_bytes = os.fstat(self._fh.fileno()).st_size
            self.entries, self.metadata, self.data_start = _parse_header(self._fh, self.file_bytes)
        except GpudiagError as exc:
            self.close()
            raise GpudiagError(f"{self.path}: not a valid safetensors file: {exc}") from None
        except IsADirectoryError:
            self.close()
            raise GpudiagError(f"{self.path} is a directory, not a safetensors file") from None
        except OSError as exc:
            self.close()
            raise GpudiagError(f"cannot read {self.path}: {exc.strerror or exc}") from None

    def __enter__(self) -> SafetensorsFile:  # noqa: PYI034 -- Python 3.10 has no typing.Self
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Unmap and close; tensors made with ``copy=False`` keep the mapping alive until dropped."""
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:  # a zero-copy tensor still points into it; GC unmaps later
                pass
            self._mmap = None
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def names(self) -> list[str]:
        """Tensor names in file order."""
        return list(self.entries)

    def _map(self) -> mmap.mmap:
        if self._mmap is None:
            if self._fh is None:
                raise GpudiagError(f"{self.path}: file is closed")
            # Copy-on-write: torch.frombuffer needs a writable buffer; nothing is ever written.
            self._mmap = mmap.mmap(self._fh.fileno(), 0, access=mmap.ACCESS_COPY)
            if hasattr(mmap, "MADV_SEQUENTIAL"):
                self._mmap.madvise(mmap.MADV_SEQUENTIAL)
        return self._mmap

    def view(self, name: str) -> memoryview:
        """The raw bytes of one tensor, zero-copy."""
        e = self._entry(name)
        return memoryview(self._map())[e.start:e.end]

    def iter_chunks(self, name: str, chunk_bytes: int = 16 << 20) -> Iterator[memoryview]:
        """The tensor's bytes in chunks of at most ``chunk_bytes``; pages already read are dropped.

        Dropping (MADV_DONTNEED on a mapping that was never written) keeps the
        resident set at about one chunk however large the file is; the bytes
        stay in the page cache.
        """
        e = self._entry(name)
        m = self._map()
        mv = memoryview(m)
        page = mmap.PAGESIZE
        try:
            for off in range(e.start, e.end, chunk_bytes):
                stop = min(off + chunk_bytes, e.end)
                yield mv[off:stop]
                lo = (off // page) * page
                hi = (stop // page) * page
                if hi > lo and hasattr(mmap, "MADV_DONTNEED"):
                    m.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
        finally:
            mv.release()

    def tensor(self, name: str, copy: bool = True):
        """The tensor as a CPU torch.Tensor; ``copy=False`` returns a view of the mapping."""
        import torch

        e = self._entry(name)
        dt = _torch_dtypes().get(e.dtype)
        if dt is None:
            raise GpudiagError(f"{self.path}: tensor {name!r} has dtype {e.dtype}, which this torch cannot hold")
        if e.numel == 0:
            return torch.empty(e.shape, dtype=dt)
        t = torch.frombuffer(self._map(), dtype=dt, count=e.numel, offset=e.start).view(e.shape)
        return t.clone() if copy else t

    def _entry(self, name: str) -> TensorEntry:
        try:
            return self.entries[name]
        except KeyError:
            raise GpudiagError(f"{self.path}: no tensor named {name!r}") from None


def _parse_header(fh, file_bytes: int) -> tuple[dict[str, TensorEntry], dict[str, str], int]:
    if file_bytes < 8:
        raise GpudiagError(f"{file_bytes} bytes is too short for the 8-byte header length")
    (n,) = struct.unpack("<Q", fh.read(8))
    if n > MAX_HEADER_BYTES:
        raise GpudiagError(f"header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit")
    if 8 + n > file_bytes:
        raise GpudiagError(f"header length {n} runs past the end of the {file_bytes}-byte file")
    raw = fh.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise GpudiagError("header is not UTF-8") from None
    except json.JSONDecodeError as exc:
        raise GpudiagError(f"header is not valid JSON ({exc.msg})") from None
    if not isinstance(header, dict):
        raise GpudiagError("header is not a JSON object")
    metadata = header.pop(METADATA_KEY, {}) or {}
    if not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise GpudiagError(f"{METADATA_KEY} must map strings to strings")
    data_start = 8 + n
    data_bytes = file_bytes - data_start
    entries: dict[str, TensorEntry] = {}
    for name, info in header.items():
        entries[name] = _parse_entry(name, info, data_start)
    # The byte ranges must tile the buffer exactly: no gap (unhashed, unloaded
    # bytes), no overlap (two tensors aliasing), nothing trailing.
    cursor = 0
    for e in sorted(entries.values(), key=lambda e: (e.start, e.end)):
        if e.start - data_start != cursor:
            kind = "overlaps the previous tensor" if e.start - data_start < cursor else "leaves a gap before it"
            raise GpudiagError(f"tensor {e.name!r} {kind} (data offset {e.start - data_start}, expected {cursor})")
        cursor = e.end - data_start
    if cursor != data_bytes:
        raise GpudiagError(f"tensors cover {cursor} bytes but the data buffer holds {data_bytes} "
                           "(truncated or trailing bytes)")
    return entries, metadata, data_start


def _parse_entry(name: str, info, data_start: int) -> TensorEntry:
    if not isinstance(info, dict):
        raise GpudiagError(f"tensor {name!r}: entry is not an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in DTYPE_ITEMSIZE:
        raise GpudiagError(f"tensor {name!r}: unsupported dtype {dtype!r}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                              for d in shape):
        raise GpudiagError(f"tensor {name!r}: shape must be a list of non-negative integers")
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]):
        raise GpudiagError(f"tensor {name!r}: data_offsets must be [begin, end] with 0 <= begin <= end")
    numel = 1
    for d in shape:
        numel *= d
    if numel * DTYPE_ITEMSIZE[dtype] != offsets[1] - offsets[0]:
        raise GpudiagError(f"tensor {name!r}: {dtype}{shape} needs {numel * DTYPE_ITEMSIZE[dtype]} bytes, "
                           f"data_offsets give {offsets[1] - offsets[0]}")
    return TensorEntry(name, dtype, tuple(shape), data_start + offsets[0], data_start + offsets[1])


def write_safetensors(path: str | os.PathLike, tensors: Mapping, metadata: Mapping[str, str] | None = None) -> None:
    """Write torch tensors to ``path`` in the mapping's order (the header is padded to 8 bytes).

    The file is written to a temporary name and renamed, so a reader never
    sees half a file.
    """
    header: dict = {}
    if metadata:
        header[METADATA_KEY] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    prepared = []
    for name, t in tensors.items():
        t = t.detach().to("cpu").contiguous()
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": dtype_name(t.dtype), "shape": list(t.shape),
                        "data_offsets": [offset, offset + nbytes]}
        prepared.append(t)
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    blob += b" " * (-len(blob) % 8)
    path = Path(path)
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for t in prepared:
            if t.numel():
                f.write(t.reshape(-1).view(_byte_dtype()).numpy().data)
    os.replace(tmp, path)


def _byte_dtype():
    import torch

    return torch.uint8
