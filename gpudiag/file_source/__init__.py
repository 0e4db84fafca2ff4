"""Recorded telemetry as the source of an investigation: ``gpudiag investigate --file PATH``.

An on-call engineer often has a file, not a Prometheus: an ``nvidia-smi
--query-gpu ... -l 1 > gpu.log``, a dump of dcgm-exporter, a folder of
``/metrics`` scrapes. Each file's format is recognised by its content (not
its name), gzip is read as it is, every file is streamed a line at a time,
and the samples become the same :class:`~gpudiag.frames.Window` the store
and Prometheus sources build (catalog columns, SI units), for the same
analyzers and report. The formats (:data:`FORMATS`):

- ``nvidia-smi``: :mod:`.nvidia_smi` (header or none, any fields and order,
  units in values, several GPUs, interleaved writers);
- ``dcgm-csv``: series in long CSV, a row per sample (timestamp,
  metric_name, value and label columns, as dcgm-exporter's series are
  exported from a Prometheus);
- ``prometheus-text`` and ``openmetrics``: exposition text, one scrape or
  many concatenated, with timestamps or without (:mod:`.exposition`);
- ``scrape-folder``: a folder of scrapes, one file each;
- ``oom-log``: a program's log holding PyTorch "CUDA out of memory" messages
  (:mod:`gpudiag.analyzers.oom_message`): no samples, but each OOM says whose
  memory it met (another process, the pool's holes, or the process itself),
  and its findings join the window's.

Time: a recorded file ends where its data ends, so the window is the whole
span of the files unless ``--from``/``--to`` select within it; ``--since``
counts back from the files' last sample, not from now. Timestamps without
an offset are local time (:mod:`.clock`).

Corrupt lines are skipped, counted per file and the first one quoted
(:class:`.recording.FileRead`, the ``files`` of ``investigate --json``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gpudiag.analyzers import oom_message
from gpudiag.errors import GpudiagError
from gpudiag.frames import Window

from . import exposition, nvidia_smi
from .lines import ProgressFn, file_size, head, lines
from .recording import FileRead, Recording, build_window

FORMATS = {
    "nvidia-smi": "nvidia-smi --query-gpu CSV logs (with or without header and units)",
    "dcgm-csv": "dcgm-exporter series in long CSV (timestamp, metric_name, value, labels)",
    "prometheus-text": "Prometheus text from /metrics (dcgm-exporter, vLLM, gpudiag), one scrape or many",
    "openmetrics": "OpenMetrics with timestamps (what promtool tsdb create-blocks-from openmetrics takes)",
    "scrape-folder": "a folder of /metrics scrapes, one file each",
    "oom-log": "a log holding PyTorch 'CUDA out of memory' messages",
}
# Lines looked at to recognise a format.
SNIFF_LINES = 50
# Reading this many bytes takes a few seconds: a progress bar is worth drawing.
PROGRESS_MIN_BYTES = 32 << 20
# Suffixes left out of a file's name to name its node.
_SUFFIXES = (".gz", ".csv", ".log", ".txt", ".prom", ".om", ".metrics", ".out")


def _known_formats() -> str:
    return "; ".join(FORMATS.values())


def node_name(path: Path) -> str:
    """The node a file's series belong to when it names none: its name without the usual suffixes."""
    name = path.name
    while True:
        for suffix in _SUFFIXES:
            if name.lower().endswith(suffix) and len(name) > len(suffix):
                name = name[: -len(suffix)]
                break
        else:
            return name


def detect(path: Path) -> str:
    """The format of ``path`` by its content (GpudiagError for a missing, empty or unknown file)."""
    if path.is_dir():
        return "scrape-folder"
    if not path.exists():
        raise GpudiagError(f"{path}: no such file")
    if file_size(path) == 0:
        raise GpudiagError(f"{path} is empty: nothing to investigate")
    sample = head(path, SNIFF_LINES)
    if not sample:
        raise GpudiagError(f"{path} holds no line of telemetry (only blank or overlong lines)")
    if exposition.is_exposition(sample):
        return "prometheus-text"
    if exposition.is_long_csv(sample):
        return "dcgm-csv"
    if nvidia_smi.is_header(sample[0]) or nvidia_smi.looks_headerless(sample):
        return "nvidia-smi"
    if any(oom_message.is_oom_line(text) for _, text in lines(path) if text is not None):
        return "oom-log"
    raise GpudiagError(f"{path}: not a format gpudiag reads (it begins {sample[0][:60]!r}); it reads: "
                       f"{_known_formats()}")


def total_bytes(paths: list[str]) -> int:
    """Bytes on disk of the files (and folders' files) to read: decides whether progress is drawn."""
    total = 0
    for p in map(Path, paths):
        if p.is_dir():
            try:
                total += sum(file_size(f) for f in p.iterdir() if f.is_file())
            except OSError:
                pass
        else:
            total += file_size(p)
    return total


def resolve_window(time_range: tuple[float, float], *, since: str | None, start: str | None,
                   end: str | None) -> tuple[float, float]:
    """The [start, end] to investigate in files spanning ``time_range``: all of it unless the options select.

    ``--since`` counts back from the files' last sample (now has nothing to do
    with a recording); ``--from`` without ``--to`` runs to the last sample.
    """
    from gpudiag.investigate import iso, parse_duration, parse_time

    first, last = time_range
    if since is not None and (start is not None or end is not None):
        raise GpudiagError("give either --since or --from/--to, not both")
    if end is not None and start is None:
        raise GpudiagError("--to needs --from (or use --since)")
    if since is not None:
        return max(first, last - parse_duration(since)), last
    if start is None:
        return first, last
    lo = parse_time(start, "--from")
    hi = parse_time(end, "--to") if end is not None else max(last, lo)
    if lo >= hi:
        raise GpudiagError(f"--from ({iso(lo)}) must be before --to ({iso(hi)})")
    if lo > last or hi < first:
        raise GpudiagError(f"no data between {iso(lo)} and {iso(hi)}: the files hold {iso(first)} to "
                           f"{iso(last)}")
    return max(lo, first), min(hi, last)


def _read_oom_log(path: Path, read: FileRead, node: str, progress: ProgressFn | None) -> None:
    parsed = oom_message.parse(text or "" for _, text in lines(path, progress))
    read.rows = len(parsed)
    read.findings = oom_message.findings(parsed, node)
    times = [e.time_s for e in parsed if e.time_s is not None]
    if times:
        read.start_s, read.end_s = min(times), max(times)
    read.notes.append(f"{len(parsed)} CUDA out-of-memory messages, {len(oom_message.events(parsed))} OOMs once "
                      "repeats are merged")


def _read(path: Path, fmt: str, rec: Recording, source: int, entities, progress: ProgressFn | None) -> None:
    node = node_name(path)
    if fmt == "oom-log":
        _read_oom_log(path, rec.reads[source], node, progress)
        return
    if fmt == "nvidia-smi":
        nvidia_smi.read(path, rec, source, node, progress)
    elif fmt == "dcgm-csv":
        exposition.read_long_csv(path, rec, source, node, entities, progress)
    elif fmt == "scrape-folder":
        exposition.read_folder(path, rec, source, node, entities, progress)
    else:
        exposition.read_text(path, rec, source, node, entities, progress)
    read = rec.reads[source]
    if not any(s.source == source for s in rec.all_series()):
        why = (f"{read.skipped_lines} lines skipped, the first {read.first_skipped}" if read.skipped_lines
               else f"it holds only series gpudiag does not map: {', '.join(read.unread_series)}"
               if read.unread_series else "it holds no sample")
        raise GpudiagError(f"{path}: no sample could be read as {fmt} ({why})")
    if fmt != "nvidia-smi":
        _summarise(rec, source)


def _summarise(rec: Recording, source: int) -> None:
    """A file's span and GPUs (with their names) from its series."""
    read = rec.reads[source]
    gpus: dict[tuple[str, int], dict[str, Any]] = {}
    for s in rec.all_series():
        if s.source != source:
            continue
        lo, hi = min(s.t), max(s.t)
        read.start_s = lo if read.start_s is None else min(read.start_s, lo)
        read.end_s = hi if read.end_s is None else max(read.end_s, hi)
        if "gpu" in s.labels and s.labels.get("__name__", "").startswith(("DCGM_", "gpudiag_gpu_")):
            try:
                key = (s.labels["node"], int(s.labels["gpu"]))
            except ValueError:
                continue
            gpus.setdefault(key, {"node": key[0], "gpu": key[1], **rec.gpu_facts.get(key, {})})
    read.gpus = [gpus[k] for k in sorted(gpus)]


def load_window(paths: list[str], *, since: str | None = None, start: str | None = None, end: str | None = None,
                node: str | None = None, gpu: int | None = None,
                progress: ProgressFn | None = None) -> tuple[Window, list[FileRead]]:
    """Read the files and the window the options name: (window, what each file gave). GpudiagError on bad input."""
    from gpudiag.investigate import only_gpu

    if not paths:
        raise GpudiagError("--file needs a path")
    rec = Recording()
    entities = exposition.entities(rec)
    for source, path in enumerate(paths):
        p = Path(path)
        fmt = detect(p)
        rec.reads.append(FileRead(str(path), fmt))
        _read(p, fmt, rec, source, entities, progress)
    time_range = rec.time_range()
    logged = [f for r in rec.reads for f in r.findings]
    if time_range is None and logged:
        # Logs alone: the window is the span of their events, with no samples in it.
        times = [t for f in logged for t in (f.start_s, f.end_s)]
        lo, hi = resolve_window((min(times), max(times) + 1.0), since=since, start=start, end=end)
        return Window({}, lo, hi, logged[0].node, [f"file:{r.path}" for r in rec.reads],
                      ["no samples: the files are logs, read for their out-of-memory messages"]), rec.reads
    if time_range is None:
        raise GpudiagError("the files hold no sample gpudiag reads")
    lo, hi = resolve_window(time_range, since=since, start=start, end=end)
    if node is not None:
        nodes = rec.nodes()
        if node not in nodes:
            raise GpudiagError(f"no node {node!r} in the files; nodes there: {', '.join(nodes) or 'none'}")
        rec.keep_node(node)
    window = build_window(rec, lo, hi, nvidia_smi.FIELDS)
    if node is not None:
        window.node = node
    if gpu is not None:
        window = only_gpu(window, gpu)
    return window, rec.reads


def describe(read: dict[str, Any]) -> list[str]:
    """Lines of one file for the text report: format, rows, GPUs and their names, what was skipped, then
    what the reader noted (columns named from values, loggers kept apart) and what it did not read."""
    gpus = read.get("gpus") or []
    names = sorted({g.get("name") for g in gpus if g.get("name")})
    nodes = sorted({g["node"] for g in gpus})
    what = f"{len(gpus)} GPU{'s' if len(gpus) != 1 else ''}"
    if len(nodes) > 1:
        what += f" on {len(nodes)} nodes"
    if names:
        what += f" ({', '.join(names)})"
    line = f"{read['path']}: {read['format']}, {read['rows']} rows, {what}"
    if read.get("scrapes"):
        line += f", {read['scrapes']} scrapes"
    if read["skipped_lines"]:
        line += f"; {read['skipped_lines']} lines skipped (first: {read['first_skipped']})"
    out = [line] + [f"  note: {n}" for n in read.get("notes") or []]
    if read.get("unread_columns"):
        out.append(f"  not read: {'; '.join(read['unread_columns'])}")
    if read.get("unread_series"):
        out.append(f"  series gpudiag does not map: {', '.join(read['unread_series'])}")
    return out
