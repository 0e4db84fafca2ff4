"""Reading a recorded file line by line: streamed, gzip by its magic bytes, each line capped in length."""

from __future__ import annotations

import gzip
import os
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

from gpudiag.errors import GpudiagError

# The longest legitimate line of any format read here is a dcgm-exporter sample with every
# label (about 600 bytes) or an nvidia-smi query of every field (about 2 KB); a line this long
# is no telemetry (a binary file, a log without newlines) and is skipped, not held in memory.
MAX_LINE_BYTES = 64 << 10
# Progress is reported after each this many bytes of the file (compressed bytes for gzip).
PROGRESS_EVERY_BYTES = 4 << 20
GZIP_MAGIC = b"\x1f\x8b"

ProgressFn = Callable[[str, int, int], None]


def file_size(path: Path) -> int:
    """The file's size in bytes on disk (0 when it cannot be read: the reader then names the reason)."""
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _open(path: Path):
    try:
        raw = open(path, "rb")
    except FileNotFoundError:
        raise GpudiagError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise GpudiagError(f"{path} is a folder where a file was expected") from None
    except OSError as exc:
        raise GpudiagError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        magic = raw.read(2)
        raw.seek(0)
    except OSError as exc:
        raw.close()
        raise GpudiagError(f"cannot read {path}: {exc.strerror or exc}") from None
    if magic == GZIP_MAGIC:
        return raw, gzip.GzipFile(fileobj=raw, mode="rb")
    return raw, raw


def lines(path: Path, progress: ProgressFn | None = None, label: str | None = None) -> Iterator[tuple[int, str | None]]:
    """``(line number, text without the newline)`` of every line; text is None for a line over MAX_LINE_BYTES.

    The file is read a line at a time (never whole), decompressed on the fly
    when it is gzip; bytes that are not UTF-8 become U+FFFD. GpudiagError when
    the file cannot be opened or its gzip stream is damaged.
    """
    raw, f = _open(path)
    total = file_size(path)
    label = label or f"reading {path.name}"
    next_report = PROGRESS_EVERY_BYTES
    n = 0
    try:
        while True:
            try:
                line = f.readline(MAX_LINE_BYTES + 1)
            except (OSError, EOFError, zlib.error) as exc:
                raise GpudiagError(f"{path}: the file cannot be read past line {n} ({exc})") from None
            if not line:
                break
            n += 1
            if len(line) > MAX_LINE_BYTES and not line.endswith(b"\n"):
                while True:  # the rest of an overlong line is read and dropped, a bounded piece at a time
                    try:
                        more = f.readline(MAX_LINE_BYTES)
                    except (OSError, EOFError, zlib.error) as exc:
                        raise GpudiagError(f"{path}: the file cannot be read past line {n} ({exc})") from None
                    if not more or more.endswith(b"\n"):
                        break
                yield n, None
            else:
                yield n, line.decode("utf-8", "replace").rstrip("\r\n")
            if progress is not None and n % 4096 == 0:
                at = raw.tell()
                if at >= next_report:
                    progress(label, at, total)
                    next_report = at + PROGRESS_EVERY_BYTES
    finally:
        f.close()
        if f is not raw:
            raw.close()
    if progress is not None and total >= PROGRESS_EVERY_BYTES:
        progress(label, total, total)


def head(path: Path, n: int) -> list[str]:
    """The first ``n`` lines that are not empty (overlong ones left out), for recognising the format."""
    out: list[str] = []
    for _, text in lines(path):
        if text is not None and text.strip():
            out.append(text)
            if len(out) >= n:
                break
    return out


def mtime(path: Path) -> float:
    """The file's modification time (Unix seconds)."""
    return os.stat(path).st_mtime
