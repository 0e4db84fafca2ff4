"""Exported series recorded in files: Prometheus text, OpenMetrics, folders of scrapes, dcgm-exporter long CSV.

Series are read by their exported names, as :mod:`gpudiag.promql_source`
maps them: gpudiag's own, vLLM's ``vllm:*`` (latency histograms from their
``_bucket`` series) and dcgm-exporter's ``DCGM_FI_*``. Other series are
counted and named in the file's report, not read.

Time:

- a sample's own timestamp (milliseconds in Prometheus' text format,
  seconds in OpenMetrics: told apart by size);
- without one, in a folder of scrapes: a timestamp in the file's name
  (``metrics-20250718T134233Z.txt``, ``1752846153.prom``) when every scrape
  has one, else each file's modification time. The name comes first
  because copying a folder (scp, tar, git) resets modification times;
- without one, in a single file: scrapes are told apart by a series that
  repeats (or ``# EOF``), and placed DEFAULT_SCRAPE_INTERVAL_S apart, the
  last at the file's modification time; the file's report says so.

Entities: the node is the series' ``node``, ``Hostname`` or ``instance``
(its host) label, else its ``pod`` (dcgm-exporter on Kubernetes labels a
GPU's series with the pod using it; a trace that names pods only has no
other identity), else the file's stem. A GPU series without a ``gpu``
label is numbered by its UUID in order of appearance on its node, else 0.
dcgm-exporter's ``modelName`` and ``DCGM_FI_DRIVER_VERSION`` labels become
the GPU's name and driver version.

A line that is no sample, comment or blank line of the format is skipped and
counted.
"""

from __future__ import annotations

import csv
import re
from datetime import datetime, timezone
from pathlib import Path

from gpudiag import promql_source
from gpudiag.catalog import CATALOG
from gpudiag.errors import GpudiagError

from .clock import parse_any
from .lines import ProgressFn, file_size, head, lines, mtime
from .recording import Recording

# dcgm-exporter's default collection interval (-c 30000 ms): scrapes without timestamps are
# placed this far apart, since faster scrapes would repeat its values.
DEFAULT_SCRAPE_INTERVAL_S = 30.0
# Unread series names listed in a file's report at most.
MAX_UNREAD_NAMES = 10
# Samples with a timestamp above this are in milliseconds (Unix seconds reach it in the year 5138).
MILLISECONDS_ABOVE = 1e11
# Files of a scrape folder recognised as scrapes are read; others are counted, up to this many
# files in all (a folder of a day of 1 s scrapes holds 86,400).
MAX_FOLDER_FILES = 1_000_000

_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_SAMPLE = re.compile(rf"({_NAME})(?:\{{(.*)\}})?[ \t]+(\S+)(?:[ \t]+(\S+))?[ \t]*\Z")
_LABEL = re.compile(r'[ \t]*([a-zA-Z_][a-zA-Z0-9_]*)[ \t]*=[ \t]*"((?:[^"\\]|\\.)*)"[ \t]*(?:,|\Z)')
_COMMENT = re.compile(r"#[ \t]*(HELP|TYPE|UNIT|EOF)\b")
_ESCAPES = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}
_ESCAPE = re.compile(r'\\[\\"n]')
# dcgm-exporter's label of the node and the GPU's facts.
_HOST_LABELS = ("node", "Hostname", "instance")
_FACT_LABELS = {"modelName": "name", "DCGM_FI_DRIVER_VERSION": "driver_version", "pci_bus_id": "pci_bus_id"}
# A timestamp in a scrape file's name.
_NAME_TIME = re.compile(r"(?<!\d)(\d{4})-?(\d{2})-?(\d{2})[T_ -]?(\d{2})[-:_]?(\d{2})[-:_]?(\d{2})(?:[.,](\d+))?"
                        r"(Z|[+-]\d{2}:?\d{2})?(?!\d)")
_NAME_UNIX = re.compile(r"(?<!\d)(1\d{9})(?:[._](\d{1,6}))?(?!\d)|(?<!\d)(1\d{12})(?!\d)")
# Long CSV: the columns of a metric's name, its value, its time; other columns are labels.
_CSV_NAME = ("metric_name", "metric", "__name__", "name")
_CSV_LABEL_RENAMES = {"gpu_id": "gpu", "uuid": "UUID"}


def is_exposition_line(text: str) -> bool:
    """True for a sample line or a HELP/TYPE/UNIT/EOF comment of Prometheus text or OpenMetrics."""
    s = text.strip()
    if s.startswith("#"):
        return bool(_COMMENT.match(s))
    m = _SAMPLE.match(s.split(" # ", 1)[0])
    return m is not None and _float(m.group(3)) is not None


def is_exposition(sample: list[str]) -> bool:
    """True when the lines are Prometheus text or OpenMetrics (some samples, nearly all lines of the format)."""
    if not sample:
        return False
    good = [is_exposition_line(t) for t in sample]
    samples = sum(1 for t, g in zip(sample, good) if g and not t.lstrip().startswith("#"))
    return samples > 0 and sum(good) >= 0.9 * len(sample)


def is_long_csv(sample: list[str]) -> bool:
    """True when the first line is a long-CSV header: a metric name, a value and a timestamp column."""
    if not sample:
        return False
    try:
        header = [h.strip().lower() for h in next(csv.reader([sample[0]]))]
    except (csv.Error, StopIteration):
        return False
    return "value" in header and "timestamp" in header and any(n in header for n in _CSV_NAME)


def _float(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def _unescape(text: str) -> str:
    return _ESCAPE.sub(lambda m: _ESCAPES[m.group(0)], text) if "\\" in text else text


def _labels(text: str | None) -> dict[str, str] | None:
    """The labels of ``{a="x",b="y"}`` (inside the braces); None when they do not parse."""
    out: dict[str, str] = {}
    if not text or not text.strip():
        return out
    pos = 0
    while pos < len(text):
        m = _LABEL.match(text, pos)
        if m is None:
            return None
        out[m.group(1)] = _unescape(m.group(2))
        pos = m.end()
    return out


class _Names:
    """Which exported names are read, and where each goes."""

    def __init__(self):
        self.maps = promql_source.mappings()
        self.plain = set(self.maps)
        self.buckets: dict[str, str] = {}  # "<histogram>_bucket" -> catalog column
        self.companions: set[str] = set()  # a read histogram's _count, _sum, _created: part of it, not unread
        for column, names in promql_source.histograms():
            for n in names:
                self.buckets.setdefault(n + "_bucket", column)
                self.companions.update(n + suffix for suffix in ("_count", "_sum", "_created"))
        self.companions.update(n[: -len("_total")] + "_created" for n in self.plain if n.endswith("_total"))

    def unread(self, name: str) -> bool:
        """True for a series name that is not read and not part of one that is."""
        return name not in self.plain and name not in self.buckets and name not in self.companions

    def entity_of(self, name: str) -> str | None:
        maps = self.maps.get(name)
        return CATALOG[maps[0].column].entity if maps else None


class _Entities:
    """Resolves a series' node and GPU the same way for every file of a run."""

    def __init__(self, rec: Recording, names: _Names):
        self.rec = rec
        self.names = names
        self._uuids: dict[str, dict[str, int]] = {}
        self._entity: dict[str, str | None] = {}

    def labels(self, name: str, labels: dict[str, str], default_node: str) -> dict[str, str]:
        """The labels a series is stored under: ``node`` resolved, ``gpu`` given to a GPU series."""
        out = {"__name__": name, **{k: v for k, v in labels.items() if v != ""}}
        node = next((out[k] for k in _HOST_LABELS if out.get(k)), None)
        if node is not None and "node" not in out and "Hostname" not in out:
            node = promql_source.host_of(node)
        node = node or out.get("pod") or default_node
        out["node"] = node
        if name not in self._entity:
            self._entity[name] = self.names.entity_of(name)
        if self._entity[name] == "gpu":
            if "gpu" not in out:
                uuid = out.get("UUID") or out.get("uuid")
                numbers = self._uuids.setdefault(node, {})
                out["gpu"] = str(numbers.setdefault(uuid, len(numbers))) if uuid else "0"
            facts = {f: out[k] for k, f in _FACT_LABELS.items() if out.get(k)}
            if out.get("UUID"):
                facts["uuid"] = out["UUID"]
            if facts:
                try:
                    self.rec.gpu_facts.setdefault((node, int(out["gpu"])), {}).update(facts)
                except ValueError:
                    pass
        return out


def entities(rec: Recording) -> _Entities:
    """How the series of every file of one investigation are given their node and GPU."""
    return _Entities(rec, _Names())


class _Scrapes:
    """Samples of one text file: the scrape each belongs to, its time, unread names."""

    def __init__(self, path: Path, rec: Recording, source: int, default_node: str, entities: _Entities,
                 scrape_time_s: float | None = None):
        self.path = path
        self.rec = rec
        self.source = source
        self.report = rec.reads[source]
        self.default_node = default_node
        self.entities = entities
        self.names = entities.names
        self.scrape_time_s = scrape_time_s  # a folder's scrape: the time of every sample without its own
        self.scrape = 0
        self.in_scrape: set[tuple] = set()
        self.untimed: list[tuple[int, dict[str, str], float, str | None]] = []  # (scrape, labels, value, hist)
        self.unread: dict[str, int] = {}
        self.last_t: float | None = None
        self.has_eof = False
        self.in_seconds = False  # OpenMetrics stamps samples in seconds, Prometheus' text format in milliseconds

    def line(self, lineno: int, text: str | None) -> None:
        """Read one line."""
        if text is None:
            self.report.skip(lineno, None, "longer than any exposition line")
            return
        s = text.strip()
        if not s:
            return
        if s.startswith("#"):  # HELP, TYPE, UNIT or a free comment; EOF ends an OpenMetrics scrape
            if s in ("# EOF", "#EOF"):
                self.has_eof = True
                self._next_scrape()
            return
        m = _SAMPLE.match(s.split(" # ", 1)[0])  # an OpenMetrics exemplar follows " # "
        value = _float(m.group(3)) if m else None
        labels = _labels(m.group(2)) if m else None
        stamp = _float(m.group(4)) if m and m.group(4) is not None else None
        if m is None or value is None or labels is None or (m.group(4) is not None and stamp is None):
            self.report.skip(lineno, text, "not a sample line")
            return
        name = m.group(1)
        self.report.rows += 1
        hist = self.names.buckets.get(name)
        if hist is None and name not in self.names.plain:
            if self.names.unread(name):
                self.unread[name] = self.unread.get(name, 0) + 1
            return
        key = (name, m.group(2))
        if key in self.in_scrape and stamp is None and self.scrape_time_s is None:
            self._next_scrape()  # the same series again: the next scrape of a concatenation
        self.in_scrape.add(key)
        stored = self.entities.labels(name, labels, self.default_node)
        if stamp is not None:
            t = stamp / 1000.0 if stamp > MILLISECONDS_ABOVE else stamp
            self.in_seconds = self.in_seconds or stamp <= MILLISECONDS_ABOVE
            self.last_t = t
            self.rec.add(stored, self.source, t, value, hist)
        elif self.scrape_time_s is not None:
            self.rec.add(stored, self.source, self.scrape_time_s, value, hist)
        elif self.last_t is not None:
            self.rec.add(stored, self.source, self.last_t, value, hist)  # its scrape's time, from its neighbours
        else:
            self.untimed.append((self.scrape, stored, value, hist))

    def _next_scrape(self) -> None:
        if self.in_scrape:
            self.scrape += 1
            self.in_scrape = set()

    def finish(self) -> None:
        """Place untimed scrapes in time, note what was not read."""
        if self.untimed:
            n = self.scrape + (1 if self.in_scrape else 0)
            end = mtime(self.path)
            for scrape, labels, value, hist in self.untimed:
                self.rec.add(labels, self.source, end - (n - 1 - scrape) * DEFAULT_SCRAPE_INTERVAL_S, value, hist)
            self.report.notes.append(
                f"the samples carry no timestamps: {n} scrapes placed {DEFAULT_SCRAPE_INTERVAL_S:g} s apart "
                f"(dcgm-exporter's default collection interval), the last at the file's modification time")
            self.report.scrapes = n
        if self.unread:
            top = sorted(self.unread, key=lambda k: -self.unread[k])[:MAX_UNREAD_NAMES]
            more = len(self.unread) - len(top)
            self.report.unread_series = top + ([f"and {more} more names"] if more > 0 else [])
        if self.report.format == "prometheus-text" and (self.has_eof or self.in_seconds):
            self.report.format = "openmetrics"


def read_text(path: Path, rec: Recording, source: int, default_node: str, entities: _Entities,
              progress: ProgressFn | None = None, scrape_time_s: float | None = None) -> None:
    """Read one Prometheus-text or OpenMetrics file (one scrape or many) into the recording."""
    scrapes = _Scrapes(path, rec, source, default_node, entities, scrape_time_s)
    for lineno, text in lines(path, progress):
        scrapes.line(lineno, text)
    scrapes.finish()


def name_time(name: str) -> float | None:
    """A timestamp written in a file's name (UTC unless it says otherwise); None when there is none."""
    m = _NAME_TIME.search(name)
    if m:
        frac = float("0." + m.group(7)) if m.group(7) else 0.0
        try:
            dt = datetime(*(int(m.group(i)) for i in range(1, 7)))
        except ValueError:
            dt = None
        if dt is not None:
            zone = m.group(8)
            if zone and zone != "Z":
                dt = datetime.fromisoformat(dt.isoformat() + zone[:3] + ":" + zone[-2:])
            else:
                dt = dt.replace(tzinfo=timezone.utc)
            return dt.timestamp() + frac
    m = _NAME_UNIX.search(name)
    if m:
        if m.group(3):
            return int(m.group(3)) / 1000.0
        return float(m.group(1) + ("." + m.group(2) if m.group(2) else ""))
    return None


def read_folder(path: Path, rec: Recording, source: int, default_node: str, entities: _Entities,
                progress: ProgressFn | None = None) -> None:
    """Read a folder of scrapes, one file each (GpudiagError when none is a scrape)."""
    report = rec.reads[source]
    try:
        files = sorted(p for p in path.iterdir() if p.is_file())
    except OSError as exc:
        raise GpudiagError(f"cannot list {path}: {exc.strerror or exc}") from None
    if len(files) > MAX_FOLDER_FILES:
        raise GpudiagError(f"{path} holds {len(files):,} files, more than {MAX_FOLDER_FILES:,}: "
                           f"give a folder of one recording")
    scrapes = [p for p in files if file_size(p) > 0 and is_exposition(head(p, 20))]
    if not scrapes:
        raise GpudiagError(f"{path} is a folder without /metrics scrapes ({len(files)} files, none in Prometheus "
                           f"text or OpenMetrics)")
    named = [name_time(p.name) for p in scrapes]
    by_name = all(t is not None for t in named)
    times = named if by_name else [mtime(p) for p in scrapes]
    total = sum(file_size(p) for p in scrapes)
    done = 0
    for i, (p, t) in enumerate(zip(scrapes, times)):
        before = rec.samples
        read_text(p, rec, source, default_node, entities, None, scrape_time_s=t)
        if rec.samples == before:
            report.notes.append(f"{p.name}: no series gpudiag reads")
        done += file_size(p)
        if progress is not None and (i % 64 == 0 or i == len(scrapes) - 1):
            progress(f"reading {path.name}/", done, total)
    report.scrapes = len(scrapes)
    report.notes.append(f"{len(scrapes)} scrapes, each at the time in its file name" if by_name else
                        f"{len(scrapes)} scrapes, each at its file's modification time (not every name holds a time)")
    if len(files) > len(scrapes):
        report.notes.append(f"{len(files) - len(scrapes)} files of the folder are no scrape and were not read")


def read_long_csv(path: Path, rec: Recording, source: int, default_node: str, entities: _Entities,
                  progress: ProgressFn | None = None) -> None:
    """Read series in long CSV (a row per sample: timestamp, metric name, value and label columns)."""
    report = rec.reads[source]
    header: list[str] | None = None
    cols: dict[str, int] = {}
    unread: dict[str, int] = {}
    for lineno, text in lines(path, progress):
        if text is None:
            report.skip(lineno, None, "longer than any CSV row of series")
            continue
        if not text.strip():
            continue
        try:
            row = next(csv.reader([text]))
        except (csv.Error, StopIteration):
            report.skip(lineno, text, "not a CSV row")
            continue
        if header is None:
            header = [h.strip() for h in row]
            lower = [h.lower() for h in header]
            cols = {"t": lower.index("timestamp"), "v": lower.index("value"),
                    "name": next(lower.index(n) for n in _CSV_NAME if n in lower)}
            raw = lower.index("labels_raw") if "labels_raw" in lower else None
            continue
        if len(row) != len(header):
            report.skip(lineno, text, f"{len(row)} columns where the header has {len(header)}")
            continue
        t = parse_any(row[cols["t"]])
        value = _float(row[cols["v"]].strip())
        name = row[cols["name"]].strip()
        if t is None or value is None or not re.fullmatch(_NAME, name):
            report.skip(lineno, text, "no timestamp, value or metric name")
            continue
        report.rows += 1
        hist = entities.names.buckets.get(name)
        if hist is None and name not in entities.names.plain:
            if entities.names.unread(name):
                unread[name] = unread.get(name, 0) + 1
            continue
        labels = _labels(row[raw]) if raw is not None else None
        if labels is None:
            labels = {_CSV_LABEL_RENAMES.get(h, h): v for i, (h, v) in enumerate(zip(header, row))
                      if i not in cols.values() and i != raw and v != ""}
        labels.pop("__name__", None)
        rec.add(entities.labels(name, labels, default_node), source, t, value, hist)
    if header is None:
        raise GpudiagError(f"{path} is empty")
    if unread:
        top = sorted(unread, key=lambda k: -unread[k])[:MAX_UNREAD_NAMES]
        more = len(unread) - len(top)
        report.unread_series = top + ([f"and {more} more names"] if more > 0 else [])
