"""Reading PyTorch profiler (Kineto) traces without holding them in memory.

A Kineto trace is one JSON object (optionally gzip-compressed) whose
``traceEvents`` member is a list that can hold millions of events. The scanner
here walks that object with ``json.JSONDecoder.raw_decode`` over a sliding
text buffer and yields one event at a time, so memory is the buffer plus
whatever the caller keeps; ``read_kineto_trace`` keeps only the columns the
analysis needs (analyzers.kineto.KinetoTrace), a few tens of bytes per GPU
activity and per correlated host call.

A missing, truncated or malformed file, or JSON that is not a trace, raises
GpudiagError with one line saying what is wrong.
"""

from __future__ import annotations

import codecs
import gzip
import json
import math
import re
import zlib
from array import array
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from gpudiag.analyzers.kineto import (
    DEVICE_CATEGORIES,
    HOST_SYNC_CALLS,
    LAUNCH_CALLS,
    MEMORY,
    MTIA_DEVICE_CATEGORY,
    NO_STREAM_IDS,
    PROFILER_STEP,
    KinetoTrace,
    WorkloadSignals,
    kernel_category,
    name_signal,
)
from gpudiag.errors import GpudiagError

CHUNK_BYTES = 1 << 20
# A single value (one event, or one metadata member) larger than this is not
# something the profiler writes; stop instead of buffering the rest of the file.
MAX_VALUE_CHARS = 64 << 20
# A decode error followed only by one partial token (``tru``, ``-``, ``1e``,
# ``\u12``) is where the text ran out, not a syntax error.
_PARTIAL_TOKEN_AT_END = re.compile(r"[^\s,:\[\]{}]*\s*\Z")
_WS = re.compile(r"[ \t\n\r]*")
_GZIP_MAGIC = b"\x1f\x8b"


class TraceEventStream:
    """The events of one trace file, one dict at a time.

    Iterate once. After iteration, ``metadata`` holds the top-level members
    other than ``traceEvents`` and ``bytes_read`` the uncompressed size.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.metadata: dict[str, Any] = {}
        self.bytes_read = 0
        self._buf = ""
        self._pos = 0
        self._eof = False
        self._raw: BinaryIO | None = None
        self._text = codecs.getincrementaldecoder("utf-8")()
        self._json = json.JSONDecoder()

    # --- input ------------------------------------------------------------------
    def _open(self) -> BinaryIO:
        try:
            fh = open(self.path, "rb")  # noqa: SIM115 - returned; __iter__ closes it
        except FileNotFoundError:
            raise GpudiagError(f"trace file not found: {self.path}") from None
        except OSError as exc:
            raise GpudiagError(f"cannot read trace file {self.path}: {exc.strerror or exc}") from None
        if fh.read(2) == _GZIP_MAGIC:
            fh.seek(0)
            return gzip.GzipFile(fileobj=fh, mode="rb")  # type: ignore[return-value]
        fh.seek(0)
        return fh

    def _fill(self, at_least: int = CHUNK_BYTES) -> None:
        """Append more text to the buffer, dropping what has been consumed."""
        if self._eof:
            return
        try:
            data = self._raw.read(max(CHUNK_BYTES, at_least))  # type: ignore[union-attr]
            text = self._text.decode(data, final=not data)
        except (EOFError, zlib.error, gzip.BadGzipFile) as exc:
            raise GpudiagError(f"{self.path} is truncated or a damaged gzip file ({exc})") from None
        except UnicodeDecodeError:
            raise GpudiagError(f"{self.path} is not UTF-8 text near byte {self.bytes_read}; not a trace file") from None
        except OSError as exc:
            raise GpudiagError(f"cannot read trace file {self.path}: {exc}") from None
        self.bytes_read += len(data)
        if not data:
            self._eof = True
        self._buf = self._buf[self._pos:] + text
        self._pos = 0

    def _next_char(self) -> str | None:
        """The next non-whitespace character, consumed; None at end of file."""
        while True:
            self._pos = _WS.match(self._buf, self._pos).end()
            if self._pos < len(self._buf):
                ch = self._buf[self._pos]
                self._pos += 1
                return ch
            if self._eof:
                return None
            self._fill()

    def _expect(self, wanted: str, where: str) -> None:
        ch = self._next_char()
        if ch != wanted:
            self._malformed(f"expected '{wanted}' {where}, found {_shown(ch)}", truncated=ch is None)

    def _value(self) -> Any:
        """Decode the next JSON value, reading more text until it is complete."""
        while True:
            self._pos = _WS.match(self._buf, self._pos).end()
            try:
                obj, end = self._json.raw_decode(self._buf, self._pos)
            except json.JSONDecodeError as exc:
                cut = self._ran_out(exc)
                if self._eof or not cut:
                    self._malformed(exc.msg, at=exc.pos, truncated=cut)
                self._grow()
                continue
            if end >= len(self._buf) and not self._eof:
                self._grow()  # a number at the end of the buffer may go on
                continue
            self._pos = end
            return obj

    def _ran_out(self, exc: json.JSONDecodeError) -> bool:
        """True when the decode error only says the text ended inside a value."""
        return exc.msg.startswith("Unterminated string") or _PARTIAL_TOKEN_AT_END.match(self._buf, exc.pos) is not None

    def _grow(self) -> None:
        pending = len(self._buf) - self._pos
        if pending > MAX_VALUE_CHARS:
            self._malformed(f"a single value is larger than {MAX_VALUE_CHARS >> 20} MiB")
        self._fill(at_least=pending)

    def _malformed(self, what: str, at: int | None = None, truncated: bool | None = None) -> None:
        at = self._pos if at is None else at
        if truncated is None:  # a structural check failed: truncated if nothing is left to read
            truncated = self._eof and _WS.match(self._buf, at).end() >= len(self._buf)
        if truncated:
            raise GpudiagError(f"{self.path} is truncated: the JSON ends inside the trace ({what})")
        offset = self.bytes_read - len(self._buf[at:].encode("utf-8", "surrogatepass"))
        raise GpudiagError(f"{self.path} is not valid trace JSON near byte {max(offset, 0)}: {what}")

    # --- structure ----------------------------------------------------------------
    def __iter__(self) -> Iterator[dict]:
        self._raw = self._open()
        try:
            yield from self._events()
        finally:
            self._raw.close()

    def _events(self) -> Iterator[dict]:
        not_trace = (f"{self.path} is not a PyTorch profiler trace: expected a JSON object "
                     "with a 'traceEvents' list")
        self._fill()
        if self._next_char() != "{":
            raise GpudiagError(not_trace)
        seen_events = False
        ch = self._next_char()
        if ch == "}":
            raise GpudiagError(not_trace)
        self._pos -= 1
        while True:
            key = self._value()
            if not isinstance(key, str):
                self._malformed("expected a member name")
            self._expect(":", f"after {key!r}")
            if key == "traceEvents" and not seen_events:
                seen_events = True
                yield from self._event_list(not_trace)
            else:
                self.metadata[key] = self._value()
            ch = self._next_char()
            if ch == "}":
                break
            if ch != ",":
                self._malformed(f"expected ',' or '}}' after the value of {key!r}, found {_shown(ch)}",
                                truncated=ch is None)
        if not seen_events:
            raise GpudiagError(not_trace)

    def _event_list(self, not_trace: str) -> Iterator[dict]:
        if self._next_char() != "[":
            raise GpudiagError(not_trace)
        if self._next_char() == "]":
            return
        self._pos -= 1
        while True:
            event = self._value()
            if not isinstance(event, dict):
                self._malformed(f"a trace event must be a JSON object, found {type(event).__name__}")
            yield event
            ch = self._next_char()
            if ch == "]":
                return
            if ch != ",":
                self._malformed(f"expected ',' or ']' between trace events, found {_shown(ch)}",
                                truncated=ch is None)


def _shown(ch: str | None) -> str:
    return "end of file" if ch is None else repr(ch)


def iter_trace_events(path: str | Path) -> Iterator[dict]:
    """Yield the events of a Kineto trace (.json or .json.gz) one dict at a time."""
    return iter(TraceEventStream(path))


def _as_int(v: Any) -> int | None:
    """An integer JSON value (ints and integral floats), else None."""
    if v.__class__ is int:
        return v
    if v.__class__ is float and v.is_integer():
        return int(v)
    return None


_DECIMAL = re.compile(r"-?[0-9]+")
MALFORMED_STREAM, MISSING_STREAM = "malformed_stream", "missing_stream"
# Host-side event categories whose names tell training from inference.
_HOST_OP_CATEGORIES = frozenset({"cpu_op", "user_annotation", "python_function"})


def stream_id(value: Any) -> int | str | None:
    """The stream of a device activity from its ``args.stream``.

    An int (or an integral float, or a decimal string such as ``"7"``, which
    HTA also reads as a number) is the stream id; -1 and 4294967295 (CUPTI's
    "no stream", signed and unsigned) give None: no stream, not a problem.
    Anything else gives the reason the activity cannot be placed:
    MISSING_STREAM without a value, MALFORMED_STREAM for a value that is not
    a non-negative integer id (``"seven"``, ``true``, ``-3``, ``[7]``).
    """
    if value is None:
        return MISSING_STREAM
    if value.__class__ is str and _DECIMAL.fullmatch(value):
        value = int(value)
    n = _as_int(value)
    if n is None:
        return MALFORMED_STREAM
    if n in NO_STREAM_IDS:
        return None
    return n if n >= 0 else MALFORMED_STREAM


def read_kineto_trace(path: str | Path) -> KinetoTrace:
    """Read a trace file into the columns of analyzers.kineto.KinetoTrace.

    Kept, as HTA keeps them: events with a ``dur`` and a ``cat`` other than
    ``Trace``. An event of a device category (DEVICE_CATEGORIES) on a stream
    is a device activity; a host event with ``args.correlation`` is a runtime
    call (a launch when its name is in LAUNCH_CALLS), whether or not it
    carries a ``stream`` argument (ROCm's runtime calls and Triton's launcher
    ops do: they are not device work); ``ProfilerStep#N`` host events mark
    iterations. Start and end are rounded inward to whole microseconds (start
    up, end down), as HTA does for fractional timestamps.

    A device activity whose ``args.stream`` is missing or malformed (see
    stream_id) is skipped and counted in ``KinetoTrace.skipped`` by reason,
    with one offending value in ``skipped_example``: one bad event must not
    sink a trace of millions, and the report says what was left out (when
    nothing usable remains, analyze_trace's error names the skipped events).
    Along the way the names of host operators and kernels are counted into
    ``KinetoTrace.workload`` (WorkloadSignals). Everything else is dropped as
    it is read.
    """
    stream = TraceEventStream(path)
    g_start, g_end, g_stream, g_corr = array("q"), array("q"), array("q"), array("q")
    g_cat = array("b")
    r_corr, r_start, r_end = array("q"), array("q"), array("q")
    r_launch = array("b")
    steps: list[tuple[str, int]] = []
    stream_device: dict[int, int] = {}
    host_pid: int | None = None
    category_of: dict[tuple[str, str], int] = {}
    is_device_cat: dict[Any, bool] = {}
    signal_of: dict[str, str | None] = {}
    workload = WorkloadSignals()
    skipped: dict[str, int] = {}
    skipped_example: Any = None
    device_kind = "GPU"
    launch_calls, host_syncs, host_op_cats = LAUNCH_CALLS, HOST_SYNC_CALLS, _HOST_OP_CATEGORIES
    numbers = (int, float)
    ceil, floor = math.ceil, math.floor
    try:
        for ev in stream:
            dur = ev.get("dur")
            if dur is None:
                continue
            cat = ev.get("cat")
            ts = ev.get("ts")
            if cat is None or cat == "Trace" or ts.__class__ not in numbers or dur.__class__ not in numbers:
                continue
            start = ceil(ts)
            end = floor(ts + dur)
            end = max(end, start)
            args = ev.get("args")
            if args.__class__ is not dict:
                args = {}
            name = ev.get("name")
            if name.__class__ is not str:
                name = ""
            device_cat = is_device_cat.get(cat)
            if device_cat is None:
                device_cat = is_device_cat[cat] = cat.__class__ is str and cat.lower() in DEVICE_CATEGORIES
                if device_cat and cat.lower() == MTIA_DEVICE_CATEGORY:
                    device_kind = "MTIA"
            corr = args.get("correlation")
            if corr is not None:
                corr = _as_int(corr)
            if device_cat:
                gpu_stream = stream_id(args.get("stream"))
                if gpu_stream is None:
                    continue
                if gpu_stream.__class__ is str:
                    skipped[gpu_stream] = skipped.get(gpu_stream, 0) + 1
                    if skipped_example is None:
                        skipped_example = args.get("stream")
                    continue
                key = (name, cat)
                category = category_of.get(key)
                if category is None:
                    category = category_of[key] = kernel_category(name, cat)
                    signal_of[name] = name_signal(name)
                signal = signal_of[name]
                if signal is not None:
                    setattr(workload, signal, getattr(workload, signal) + 1)
                if category == MEMORY and "Pageable" in name and "HtoD" in name:
                    workload.pageable_copies += 1
                g_start.append(start)
                g_end.append(end)
                g_stream.append(gpu_stream)
                g_corr.append(-1 if corr is None else corr)
                g_cat.append(category)
                if gpu_stream not in stream_device:
                    device = _as_int(args.get("device"))
                    if device is not None:
                        stream_device[gpu_stream] = device
            elif corr is not None and corr != -1:
                r_corr.append(corr)
                r_start.append(start)
                r_end.append(end)
                r_launch.append(name in launch_calls)
                if name in host_syncs:
                    workload.host_syncs += 1
                if host_pid is None:
                    host_pid = _as_int(ev.get("pid"))
            else:
                if cat in host_op_cats:
                    workload.host_ops += 1
                    signal = signal_of.get(name, 0)
                    if signal == 0:
                        signal = signal_of[name] = name_signal(name)
                    if signal is not None:
                        setattr(workload, signal, getattr(workload, signal) + 1)
                if name.startswith("ProfilerStep") and PROFILER_STEP.match(name):
                    steps.append((name, start))
    except OverflowError:
        raise GpudiagError(f"{stream.path}: a timestamp, stream or correlation id does not fit in 64 bits") from None
    except (ValueError, TypeError) as exc:  # inf/NaN timestamps and the like
        raise GpudiagError(f"{stream.path}: an event has an unusable timestamp or duration ({exc})") from None

    def col(a: array, dtype) -> np.ndarray:
        # a view on the array's buffer, not a copy: the array can no longer grow, and need not
        return np.frombuffer(a, dtype=dtype) if len(a) else np.empty(0, dtype=dtype)

    return KinetoTrace(
        gpu_start_us=col(g_start, np.int64),
        gpu_end_us=col(g_end, np.int64),
        gpu_stream=col(g_stream, np.int64),
        gpu_correlation=col(g_corr, np.int64),
        gpu_category=col(g_cat, np.int8),
        runtime_correlation=col(r_corr, np.int64),
        runtime_start_us=col(r_start, np.int64),
        runtime_end_us=col(r_end, np.int64),
        runtime_is_launch=col(r_launch, np.int8).astype(bool),
        profiler_steps=steps,
        stream_device=stream_device,
        host_pid=host_pid,
        metadata={**stream.metadata, "uncompressed_bytes": stream.bytes_read},
        device_kind=device_kind,
        workload=workload,
        skipped=skipped,
        skipped_example=skipped_example,
    )
