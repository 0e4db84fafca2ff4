"""``nvidia-smi --query-gpu=... --format=csv -l N`` logs.

What is read:

- the header (``timestamp, name, utilization.gpu [%], memory.used [MiB]``),
  any subset and order of query fields, or a hand-written one
  (``timestamp,gpu,index,memory.used``). Without a header (``noheader``)
  the columns are named from their values (:func:`infer_columns`); those
  that cannot be named are listed and not read;
- values with units (``0 %``, ``1129 MiB``, ``33.09 W``, ``1410 MHz``) or
  without (``nounits``); ``[N/A]``, ``[Not Supported]`` and the other
  bracketed answers are missing values, not errors;
- several GPUs per timestamp: the GPU is the ``index`` column, else the
  uuid or bus id, else its position among the lines of one timestamp. A
  column called index (or gpu) that repeats within one timestamp is not the
  GPU index and is not read;
- the node is the file's stem (nvidia-smi logs name no host).

A line is skipped, counted and the first one quoted, when it cannot be one
line of one nvidia-smi: another number of fields than the file's lines;
separators (``, `` or ``,``) other than the file's own (nvidia-smi always
writes ``, ``, so a lone ``,`` is where two lines were spliced); a
timestamp or a value that does not parse with its column's unit; a GPU
name other than that GPU's name on its other lines (a name held by fewer
than SPLICED_NAME_SHARE of them). Messages of nvidia-smi itself ("Unable to
determine the device handle ...") are skipped too, and quoted in the notes.

Several loggers writing into one file (two ``nvidia-smi -l`` with ``>>``, a
log appended after another ran) make one GPU's time go back. Lines are given
to the logger whose last line is the latest before them, a new logger where
none is; loggers whose spans do not overlap (by more than
WRITER_OVERLAP_INTERVALS lines) are one. Each further logger is read as a
GPU of its own node, ``STEM#2``, ``STEM#3``: their samples of the same
second differ, so they are not one GPU, and the file does not say which.
"""

from __future__ import annotations

import math
import re
from array import array
from collections import Counter
from dataclasses import dataclass, field
from itertools import chain, islice
from pathlib import Path

import numpy as np

from gpudiag.catalog import M
from gpudiag.errors import GpudiagError
from gpudiag.promql_source import Foreign

from .clock import Clock, kind_of
from .lines import ProgressFn, lines
from .recording import FileRead, Recording

MIB = 1 << 20
# Lines read before the rest to learn the file's layout (header or not, separators, GPU index).
LAYOUT_LINES = 1000
# A GPU's name held by fewer than this share of its lines is a splice of two lines, not the GPU.
SPLICED_NAME_SHARE = 0.01
# Two loggers whose spans overlap by less than this many sample intervals (a clock step back,
# a restart) are one logger.
WRITER_OVERLAP_INTERVALS = 3.0
WRITER_OVERLAP_MIN_S = 5.0
# Integers in this range, one column of them, in a headerless log with units: a temperature in C.
TEMPERATURE_RANGE_C = (5.0, 125.0)
# Two columns of MiB whose sum varies by less than this share: used and free (their sum is the
# capacity less the driver's reserve).
CONSTANT_SUM_SHARE = 0.01


def _s(name: str, column: str, scale: float = 1.0, **kw) -> Foreign:
    return Foreign(name, column, scale, exporter="nvidia-smi", **kw)


_REASONS = ("gpu_idle", "applications_clocks_setting", "sw_power_cap", "hw_slowdown", "sync_boost",
            "sw_thermal_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown", "display_clock_setting")

# nvidia-smi's query fields -> catalog columns (the factor to SI: percent -> ratio, MiB -> bytes,
# MHz -> hertz; watts and celsius as they are). "memory.total" is also made from used + free
# (+ reserved) where a log has no total.
FIELDS: tuple[Foreign, ...] = (
    _s("utilization.gpu", M.gpu_utilization_ratio, 0.01),
    _s("utilization.memory", M.gpu_memory_utilization_ratio, 0.01),
    _s("memory.used", M.gpu_memory_used_bytes, MIB),
    _s("memory.total", M.gpu_memory_total_bytes, MIB),
    _s("memory.reserved", M.gpu_memory_reserved_bytes, MIB),
    _s("power.draw", M.gpu_power_watts),
    _s("power.draw.instant", M.gpu_power_watts),
    _s("power.draw.average", M.gpu_power_watts),
    _s("enforced.power.limit", M.gpu_power_limit_watts),
    _s("power.limit", M.gpu_power_limit_watts),
    _s("temperature.gpu", M.gpu_temperature_celsius),
    _s("temperature.memory", M.gpu_memory_temperature_celsius),
    _s("clocks.sm", M.gpu_sm_clock_hertz, 1e6),
    _s("clocks.current.sm", M.gpu_sm_clock_hertz, 1e6),
    _s("clocks.max.sm", M.gpu_sm_clock_max_hertz, 1e6),
    _s("clocks.mem", M.gpu_memory_clock_hertz, 1e6),
    _s("clocks.current.memory", M.gpu_memory_clock_hertz, 1e6),
    _s("clocks.max.mem", M.gpu_memory_clock_max_hertz, 1e6),
    _s("clocks.max.memory", M.gpu_memory_clock_max_hertz, 1e6),
    _s("fan.speed", M.gpu_fan_speed_ratio, 0.01),
    _s("pstate", M.gpu_performance_state),
    _s("clocks_throttle_reasons.active", M.gpu_clock_throttle_active, decode="clock_event_bits"),
    _s("clocks_event_reasons.active", M.gpu_clock_throttle_active, decode="clock_event_bits"),
    *(_s(f"{group}.{r}", M.gpu_clock_throttle_active, path=(r,))
      for group in ("clocks_throttle_reasons", "clocks_event_reasons") for r in _REASONS),
    _s("ecc.errors.corrected.volatile.total", M.gpu_ecc_errors_total, path=("volatile", "corrected")),
    _s("ecc.errors.uncorrected.volatile.total", M.gpu_ecc_errors_total, path=("volatile", "uncorrected")),
    _s("ecc.errors.corrected.aggregate.total", M.gpu_ecc_errors_total, path=("aggregate", "corrected")),
    _s("ecc.errors.uncorrected.aggregate.total", M.gpu_ecc_errors_total, path=("aggregate", "uncorrected")),
    _s("retired_pages.single_bit_ecc.count", M.gpu_retired_pages_total, path=("multiple_single_bit_ecc",)),
    _s("retired_pages.sbe", M.gpu_retired_pages_total, path=("multiple_single_bit_ecc",)),
    _s("retired_pages.double_bit.count", M.gpu_retired_pages_total, path=("double_bit_ecc",)),
    _s("retired_pages.dbe", M.gpu_retired_pages_total, path=("double_bit_ecc",)),
)
_MAPPED = {f.name for f in FIELDS}
# Fields read only to sum into memory.total where the log has none.
_MEMORY_PARTS = ("memory.used", "memory.free", "memory.reserved")

# Fields that say which GPU a line is about (nvidia-smi's names and their documented aliases).
_FACT_FIELDS = {"name": "name", "gpu_name": "name", "uuid": "uuid", "gpu_uuid": "uuid",
                "pci.bus_id": "pci_bus_id", "gpu_bus_id": "pci_bus_id", "driver_version": "driver_version"}
# Columns that may hold the GPU index: nvidia-smi's field, and what hand-written headers call it.
_INDEX_FIELDS = ("index", "gpu", "gpu_index", "gpu_id")
_OTHER_FIELDS = ("serial", "gpu_serial", "vbios_version", "count", "memory.free", "pcie.link.gen.current",
                 "pcie.link.gen.max", "pcie.link.width.current", "pcie.link.width.max", "compute_mode",
                 "persistence_mode", "display_mode", "clocks.gr", "clocks.current.graphics", "clocks.max.gr",
                 "clocks.max.graphics", "power.default_limit", "power.min_limit", "power.max_limit",
                 "mig.mode.current", "encoder.stats.sessionCount", "utilization.encoder", "utilization.decoder")

# The unit each field's values carry (nvidia-smi's defaults), and other units it may be written in.
_UNIT_PREFIX = (("utilization.", "%"), ("fan.", "%"), ("memory.", "MiB"), ("power.", "W"), ("enforced.power", "W"),
                ("clocks.", "MHz"), ("temperature.", ""))
_OTHER_UNITS = {"MiB": {"KiB": 1 / 1024, "GiB": 1024.0}, "W": {"mW": 1e-3}, "MHz": {"GHz": 1e3, "kHz": 1e-3}}
_NUMBER_UNIT = re.compile(r"\s*([-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)\s*([A-Za-z%]*)\s*\Z")
_HEADER_UNIT = re.compile(r"(.*?)\s*\[([^\]]*)\]\s*\Z")
# nvidia-smi's own messages in place of samples.
_MESSAGE = re.compile(r"\s*(Unable to determine|No devices were found|NVIDIA-SMI has failed|Failed to|"
                      r"GPU is lost|Unknown Error)", re.IGNORECASE)
_UUID = re.compile(r"(GPU|MIG)-[0-9a-fA-F-]{20,}\Z")
_BUS_ID = re.compile(r"[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-9A-Fa-f]\Z")
_PSTATE = re.compile(r"P(\d{1,2})\Z")
_HEX = re.compile(r"0x[0-9A-Fa-f]+\Z")
_DRIVER = re.compile(r"\d{3}\.\d{1,3}\.\d{1,3}\Z")
_GPU_NAME = re.compile(r"(NVIDIA|Tesla|Quadro|GeForce|TITAN|RTX|[AHBL]\d{2,3}\b)", re.IGNORECASE)

BAD = object()  # a value that does not parse: the line is skipped


def _unit_of(field_name: str) -> str | None:
    for prefix, unit in _UNIT_PREFIX:
        if field_name.startswith(prefix):
            return unit
    return None


def _normalise(text: str) -> tuple[str, str | None]:
    """A header field: (its name in lower case, the unit in brackets or None)."""
    s = text.strip()
    m = _HEADER_UNIT.match(s)
    if m:
        return m.group(1).strip().lower(), m.group(2).strip()
    return s.lower(), None


def _known(name: str) -> bool:
    return (name in _MAPPED or name in _FACT_FIELDS or name in _INDEX_FIELDS or name in _OTHER_FIELDS
            or name == "timestamp")


def is_header(text: str) -> bool:
    """True when ``text`` is an nvidia-smi CSV header (or a hand-written one in its field names)."""
    names = [_normalise(f)[0] for f in text.split(",")]
    if len(names) < 2 or any(kind_of(n) for n in names):
        return False
    known = sum(_known(n) for n in names)
    return ("timestamp" in names and known >= 2) or known >= max(2, len(names) // 2 + 1)


def looks_headerless(sample: list[str]) -> bool:
    """True when most lines are a timestamp and values with nvidia-smi's units (a noheader log)."""
    hits = 0
    for text in sample:
        fields = [f.strip() for f in text.split(",")]
        if len(fields) < 2 or not any(kind_of(f) for f in fields[:2]):
            continue
        units = [_NUMBER_UNIT.match(f) for f in fields]
        if any(u and u.group(2) in ("%", "MiB", "W", "MHz") for u in units) or "[N/A]" in fields:
            hits += 1
    return hits >= max(1, 0.8 * len(sample))


def _number(text: str, unit: str | None) -> float | object:
    """A field's value in its field's unit; NaN for nvidia-smi's "[N/A]"-like answers; BAD when it is no value."""
    s = text.strip()
    if s.startswith("[") or s in ("N/A", ""):
        return math.nan
    m = _NUMBER_UNIT.match(s)
    if m is None:
        return BAD
    value, written = float(m.group(1)), m.group(2)
    if not written or written == unit or unit is None:
        return value
    factor = _OTHER_UNITS.get(unit, {}).get(written)
    return BAD if factor is None else value * factor


def _reader(name: str, unit: str | None):
    """The function that turns one field's text into a number in the field's unit (or NaN, BAD)."""
    if name == "pstate":
        def pstate(text: str):
            s = text.strip()
            m = _PSTATE.match(s)
            return float(m.group(1)) if m else math.nan if s.startswith("[") else BAD
        return pstate
    if name.endswith("reasons.active"):
        def bits(text: str):
            s = text.strip()
            return float(int(s, 16)) if _HEX.match(s) else math.nan if s.startswith("[") else BAD
        return bits
    if name.startswith(("clocks_throttle_reasons.", "clocks_event_reasons.")):
        def active(text: str):
            s = text.strip()
            return 1.0 if s == "Active" else 0.0 if s == "Not Active" else math.nan if s.startswith("[") else BAD
        return active
    unit = _unit_of(name) if unit is None else unit
    cut = -len(unit) if unit else None

    def number(text: str):
        # The common cases without a regular expression or an exception: "1129 MiB", "41" (float()
        # takes the spaces around); the rest (other units, [N/A], splices) by _number.
        if cut is not None and text.endswith(unit):
            body = text[:cut]
            if body.strip().replace(".", "", 1).isdigit():
                return float(body)
        elif text.strip().replace(".", "", 1).isdigit():
            return float(text)
        return _number(text, unit)
    return number


@dataclass
class Layout:
    """How one log's lines are laid out."""

    fields: list[str | None]  # the query field of each column; None where unnamed
    units: list[str | None]
    header: list[str] | None = None  # the header's names (a repeated header line is passed over)
    timestamp: int = 0
    index: int | None = None
    identity: int | None = None  # uuid or bus id, when there is no index column
    facts: dict[str, int] = field(default_factory=dict)  # name/uuid/pci_bus_id/driver_version -> column
    separators: tuple[bool, ...] | None = None  # whether each comma is followed by a space
    inferred: bool = False
    unread: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    clock_kind: str = "nvidia-smi"

    @property
    def n(self) -> int:
        return len(self.fields)


def _ordinal(i: int) -> str:
    return f"column {i + 1}"


def infer_columns(rows: list[list[str]]) -> tuple[list[str | None], list[str], list[str]]:
    """Query fields of a headerless log's columns, named from their values: (fields, unread, notes).

    Definitions: a column of timestamps is the timestamp; "GPU-..." a uuid;
    "0000:3B:00.0" a bus id; "P0" the pstate; "0x..." the clock event
    reasons; text naming an NVIDIA product the name. With units: one column
    in % is utilization.gpu, two are utilization.gpu and .memory (the busier
    is the GPU's: the memory is read or written only while kernels or copies
    run); MiB columns: one that holds still and is the largest is the
    total, two whose sum holds still are used and free (used is the one
    that reaches lower: an idle GPU holds almost nothing); one column in W
    is power.draw; one column of integers within TEMPERATURE_RANGE_C is
    temperature.gpu. Clocks in MHz cannot be told apart (SM, memory,
    graphics) and more than two % columns cannot either: those are listed,
    not read. A log written with ``nounits`` and no header has nothing to
    tell its numbers apart: only its timestamps and text are named.
    """
    n = len(rows[0])
    cols = [[r[i].strip() for r in rows] for i in range(n)]
    fields: list[str | None] = [None] * n
    unread: list[str] = []
    notes: list[str] = []
    by_unit: dict[str, list[int]] = {}
    plain_ints: list[int] = []
    any_units = False
    for i, values in enumerate(cols):
        present = [v for v in values if not v.startswith("[") and v not in ("N/A", "")]
        if not present:
            unread.append(f"{_ordinal(i)}: no value ({values[0]!r})")
            continue
        if all(kind_of(v) for v in present):
            fields[i] = "timestamp"
        elif all(_UUID.match(v) for v in present):
            fields[i] = "uuid"
        elif all(_BUS_ID.match(v) for v in present):
            fields[i] = "pci.bus_id"
        elif all(_PSTATE.match(v) for v in present):
            fields[i] = "pstate"
        elif all(_HEX.match(v) for v in present):
            fields[i] = "clocks_event_reasons.active"
        elif all(_DRIVER.match(v) for v in present):
            fields[i] = "driver_version"
        elif all(_NUMBER_UNIT.match(v) for v in present):
            units = Counter(_NUMBER_UNIT.match(v).group(2) for v in present)
            unit = units.most_common(1)[0][0]
            any_units = any_units or bool(unit)
            if unit:
                by_unit.setdefault(unit, []).append(i)
            elif all(float(v).is_integer() for v in present):
                plain_ints.append(i)
            else:
                unread.append(f"{_ordinal(i)}: numbers without a unit")
        elif all(_GPU_NAME.search(v) for v in present):
            fields[i] = "name"
        else:
            unread.append(f"{_ordinal(i)}: text that names no field ({present[0][:30]!r})")

    def numbers(i: int) -> np.ndarray:
        out = []
        for v in cols[i]:
            x = _number(v, None)
            out.append(math.nan if x is BAD else x)
        return np.array(out, dtype=float)

    if not any_units:
        for i in by_unit.get("", []) + plain_ints:
            unread.append(f"{_ordinal(i)}: a number without a unit (a headerless nounits log cannot be named)")
        return fields, unread, notes
    pct = by_unit.pop("%", [])
    if len(pct) == 1:
        fields[pct[0]] = "utilization.gpu"
    elif len(pct) == 2:
        a, b = pct
        busier = a if np.nanmean(numbers(a)) >= np.nanmean(numbers(b)) else b
        fields[busier], fields[b if busier == a else a] = "utilization.gpu", "utilization.memory"
    else:
        unread.extend(f"{_ordinal(i)}: one of {len(pct)} columns in % (which is which cannot be told)" for i in pct)
    mib = by_unit.pop("MiB", [])
    _name_memory(mib, numbers, fields, unread)
    watts = by_unit.pop("W", [])
    if len(watts) == 1:
        fields[watts[0]] = "power.draw"
    elif len(watts) == 2:
        a, b = (numbers(i) for i in watts)
        still = [i for i, x in zip(watts, (a, b)) if np.nanmax(x) == np.nanmin(x)]
        if len(still) == 1:
            fields[still[0]] = "enforced.power.limit"
            fields[watts[1] if still[0] == watts[0] else watts[0]] = "power.draw"
        else:
            unread.extend(f"{_ordinal(i)}: one of two columns in W (draw and limit cannot be told)" for i in watts)
    else:
        unread.extend(f"{_ordinal(i)}: one of {len(watts)} columns in W" for i in watts)
    for unit, idx in by_unit.items():
        why = "a clock (SM, memory and graphics clocks cannot be told apart)" if unit == "MHz" else f"in {unit}"
        unread.extend(f"{_ordinal(i)}: {why}" for i in idx)
    temps = [i for i in plain_ints
             if TEMPERATURE_RANGE_C[0] <= np.nanmin(numbers(i)) and np.nanmax(numbers(i)) <= TEMPERATURE_RANGE_C[1]]
    if len(temps) == 1:
        fields[temps[0]] = "temperature.gpu"
    for i in plain_ints:
        if fields[i] is None:
            unread.append(f"{_ordinal(i)}: integers without a unit")
    named = [f"{_ordinal(i)} {f}" for i, f in enumerate(fields) if f]
    notes.append("no header: columns named from their values: " + ", ".join(named))
    return fields, unread, notes


def _name_memory(mib: list[int], numbers, fields: list[str | None], unread: list[str]) -> None:
    if not mib:
        return
    vals = {i: numbers(i) for i in mib}
    still = [i for i in mib if np.nanmax(vals[i]) == np.nanmin(vals[i])]
    rest = [i for i in mib if i not in still]
    total = None
    if still and rest:
        top = max(still, key=lambda i: np.nanmax(vals[i]))
        if all(np.nanmax(vals[i]) <= np.nanmax(vals[top]) for i in mib):
            total = top
    if total is not None:
        fields[total] = "memory.total"
        others = [i for i in mib if i != total]
    else:
        others = list(mib)
    if len(others) == 1 and total is not None:
        fields[others[0]] = "memory.used"
    elif len(others) == 2:
        a, b = others
        s = vals[a] + vals[b]
        if np.nanmax(s) - np.nanmin(s) <= CONSTANT_SUM_SHARE * np.nanmean(s):
            used = a if np.nanmin(vals[a]) <= np.nanmin(vals[b]) else b
            fields[used], fields[b if used == a else a] = "memory.used", "memory.free"
    for i in mib:
        if fields[i] is None:
            unread.append(f"{_ordinal(i)}: in MiB (used, free or total cannot be told)")


def _separators(fields: list[str]) -> tuple[bool, ...]:
    return tuple(f.startswith(" ") for f in fields[1:])


def layout_of(path: Path, sample: list[str]) -> Layout:
    """The layout of a log from its first lines (GpudiagError when they are no nvidia-smi log)."""
    texts = [t for t in sample if t.strip() and not _MESSAGE.match(t)]
    if not texts:
        raise GpudiagError(f"{path} holds no nvidia-smi sample in its first {len(sample)} lines")
    if is_header(texts[0]):
        named = [_normalise(f) for f in texts[0].split(",")]
        lay = Layout([n for n, _ in named], [u for _, u in named], header=[n for n, _ in named])
        data = [t.split(",") for t in texts[1:] if not is_header(t)]
        data = [r for r in data if len(r) == lay.n]
    else:
        widths = Counter(len(t.split(",")) for t in texts)
        width = widths.most_common(1)[0][0]
        data = [t.split(",") for t in texts if len(t.split(",")) == width]
        fields, unread, notes = infer_columns(data)
        lay = Layout(fields, [None] * width, inferred=True, unread=unread, notes=notes)
    if "timestamp" not in lay.fields:
        raise GpudiagError(f"{path}: an nvidia-smi log without a timestamp column cannot be put in time: "
                           f"add timestamp to --query-gpu")
    lay.timestamp = lay.fields.index("timestamp")
    if data:
        lay.separators = Counter(_separators(r) for r in data).most_common(1)[0][0]
        kinds = Counter(kind_of(r[lay.timestamp]) for r in data)
        kind = kinds.most_common(1)[0][0]
        if kind is None:
            raise GpudiagError(f"{path}: the timestamp column holds no time gpudiag reads "
                               f"({data[0][lay.timestamp].strip()!r})")
        lay.clock_kind = kind
    _choose_identity(lay, data)
    for i, name in enumerate(lay.fields):
        if name is None or name == "timestamp" or i == lay.index:
            continue
        if name in _FACT_FIELDS:
            lay.facts.setdefault(_FACT_FIELDS[name], i)
        elif name not in _MAPPED and name not in _MEMORY_PARTS and name not in _INDEX_FIELDS and not lay.inferred:
            lay.unread.append(f"{name}: no gpudiag metric")
    return lay


def _choose_identity(lay: Layout, data: list[list[str]]) -> None:
    """The column that tells a line's GPU: an index column distinct within each timestamp, else uuid or bus id."""
    candidates = [i for i, f in enumerate(lay.fields) if f in _INDEX_FIELDS]
    good = []
    for i in candidates:
        groups: dict[str, set[str]] = {}
        ok = True
        for r in data:
            v = r[i].strip()
            if not v.isdigit():
                ok = False
                break
            seen = groups.setdefault(r[lay.timestamp].strip(), set())
            if v in seen:
                ok = False
                break
            seen.add(v)
        if ok:
            good.append(i)
    if good:
        lay.index = min(good, key=lambda i: (lay.fields[i] != "index", i))
    for i in candidates:
        if i != lay.index:
            lay.unread.append(f"{lay.fields[i]} ({_ordinal(i)}): repeats within one timestamp, so it is not the "
                              f"GPU index")
    if lay.index is None:
        for f in ("uuid", "gpu_uuid", "pci.bus_id", "gpu_bus_id"):
            if f in lay.fields:
                lay.identity = lay.fields.index(f)
                break


@dataclass
class _GpuLines:
    """The lines of one GPU (by index, uuid or position), columns as arrays."""

    index: int
    fields: tuple[str, ...]  # the read fields, in the order of each line's values
    t: array = field(default_factory=lambda: array("d"))
    line: array = field(default_factory=lambda: array("q"))
    writer: array = field(default_factory=lambda: array("i"))
    name: array = field(default_factory=lambda: array("i"))
    columns: list[array] = field(default_factory=list)
    facts: dict[tuple[str, ...], int] = field(default_factory=dict)  # (name, uuid, ...) of its lines -> count
    writers_last: list[float] = field(default_factory=list)
    back_steps: int = 0

    def __post_init__(self):
        self.columns = [array("d") for _ in self.fields]

    def writer_of(self, t: float, interval_s: float) -> int:
        """The logger this line continues: of those whose last line is before it, the one whose last line is
        nearest to one interval before it (a new logger when every one is past it)."""
        best, miss = -1, math.inf
        for w, last in enumerate(self.writers_last):
            if last < t and abs(t - last - interval_s) < miss:
                best, miss = w, abs(t - last - interval_s)
        if best < 0:
            if self.writers_last:
                self.back_steps += 1
            self.writers_last.append(t)
            return len(self.writers_last) - 1
        self.writers_last[best] = t
        return best

    def append(self, t: float, line: int, name: int, values: list[float], interval_s: float) -> None:
        for col, v in zip(self.columns, values):
            col.append(v)
        self.writer.append(self.writer_of(t, interval_s))
        self.t.append(t)
        self.line.append(line)
        self.name.append(name)


def _interval(lay: Layout, sample: list[str], clock: Clock) -> float:
    """The logging interval (-l N): the median step between the distinct timestamps of the first lines."""
    times = set()
    for text in sample:
        fields = text.split(",")
        if len(fields) == lay.n:
            t = clock.parse(fields[lay.timestamp].strip())
            if t is not None:
                times.add(t)
    d = np.diff(sorted(times))
    d = d[d > 0]
    return float(np.median(d)) if d.size else 1.0


def read(path: Path, rec: Recording, source: int, node: str, progress: ProgressFn | None = None) -> None:
    """Read one nvidia-smi log into the recording (its FileRead counts rows, skipped lines, GPUs)."""
    report = rec.reads[source]
    stream = lines(path, progress)
    first = list(islice(stream, LAYOUT_LINES))
    lay = layout_of(path, [t for _, t in first if t is not None])
    report.columns, report.inferred_columns = list(lay.fields), lay.inferred
    report.unread_columns, report.notes = list(lay.unread), list(lay.notes)
    clock = Clock(lay.clock_kind)
    interval = _interval(lay, [t for _, t in first if t is not None], clock)
    readers = [(i, f, _reader(f, lay.units[i])) for i, f in enumerate(lay.fields)
               if f is not None and (f in _MAPPED or f in _MEMORY_PARTS)]
    read_fields = tuple(f for _, f, _ in readers)
    fact_names = tuple(lay.facts)
    fact_columns = tuple(lay.facts.values())
    spaced = lay.separators is not None and all(lay.separators)  # nvidia-smi's own ", " everywhere
    gpus: dict[str, _GpuLines] = {}
    names: dict[str, int] = {}
    messages: list[str] = []
    last_stamp, position = None, 0
    for lineno, text in chain(first, stream):
        if text is None:
            report.skip(lineno, None, "longer than any nvidia-smi line")
            continue
        if not text[:1].isdigit():  # every sample starts with its timestamp (or index)
            if not text.strip():
                continue
            if lay.header is not None and [_normalise(f)[0] for f in text.split(",")] == lay.header:
                continue  # the header again: a logger restarted with >>
            if _MESSAGE.match(text):
                messages.append(text.strip())
                report.skip(lineno, text, "a message of nvidia-smi, not a sample")
                continue
        fields = text.split(",")
        if len(fields) != lay.n:
            report.skip(lineno, text, f"{len(fields)} fields where the log has {lay.n}")
            continue
        if lay.separators is not None and (text.count(", ") != lay.n - 1 if spaced
                                           else _separators(fields) != lay.separators):
            report.skip(lineno, text, "separators unlike the log's own (two lines spliced together)")
            continue
        stamp = fields[lay.timestamp].strip()
        t = clock.parse(stamp)
        if t is None:
            report.skip(lineno, text, "no timestamp")
            continue
        values = [parse(fields[i]) for i, _, parse in readers]
        bad = None
        if BAD in values:
            i, name, _ = readers[values.index(BAD)]
            bad = f"{fields[i].strip()!r} is no {name} value"
        if bad is None and lay.index is not None and not fields[lay.index].strip().isdigit():
            bad = f"{fields[lay.index].strip()!r} is no GPU index"
        if bad is not None:
            report.skip(lineno, text, bad)
            continue
        if lay.index is not None:
            key = fields[lay.index].strip()
        elif lay.identity is not None:
            key = fields[lay.identity].strip()
        else:
            position = position + 1 if stamp == last_stamp else 0
            key = str(position)
        last_stamp = stamp
        g = gpus.get(key)
        if g is None:
            index = int(key) if lay.index is not None or lay.identity is None else len(gpus)
            g = gpus[key] = _GpuLines(index, read_fields)
        name_text = fields[lay.facts["name"]].strip() if "name" in lay.facts else ""
        g.append(t, lineno, names.setdefault(name_text, len(names)), values, interval)
        if fact_columns:
            seen = tuple(fields[c].strip() for c in fact_columns)
            g.facts[seen] = g.facts.get(seen, 0) + 1
    if messages:
        report.notes.append(f"nvidia-smi reported {len(messages)} errors in place of samples, "
                            f"the first: {messages[0][:120]!r}")
    _emit(rec, source, report, node, gpus, {v: k for k, v in names.items()}, fact_names, "name" in lay.facts)


def _facts(g: _GpuLines, fact_names: tuple[str, ...]) -> dict[str, str]:
    """Each fact of a GPU (name, uuid, bus id, driver) as most of its lines give it."""
    out = {}
    for i, fact in enumerate(fact_names):
        counts: Counter = Counter()
        for values, n in g.facts.items():
            counts[values[i]] += n
        if counts:
            out[fact] = counts.most_common(1)[0][0]
    return out


def _emit(rec: Recording, source: int, report: FileRead, node: str, gpus: dict[str, _GpuLines],
          names: dict[int, str], fact_names: tuple[str, ...], named: bool) -> None:
    """Series per GPU and logger, after dropping spliced names and joining loggers that did not overlap."""
    loggers_seen = 1
    back_steps = 0
    for g in gpus.values():
        t = np.frombuffer(g.t, dtype=float)
        keep = np.ones(t.size, dtype=bool)
        name_codes = np.frombuffer(g.name, dtype=np.int32)
        if named and t.size:
            counts = np.bincount(name_codes)
            main = int(np.argmax(counts))
            for code in np.flatnonzero(counts).tolist():
                if code != main and counts[code] < SPLICED_NAME_SHARE * t.size:
                    for i in np.flatnonzero(name_codes == code).tolist():
                        report.skip(int(g.line[i]), None, f"GPU {g.index} named {names[code]!r} where its other "
                                                          f"lines say {names[main]!r} (two lines spliced together)")
                    keep &= name_codes != code
        groups = _join_loggers(t, np.frombuffer(g.writer, dtype=np.int32), keep)
        back_steps += g.back_steps
        fact = _facts(g, fact_names)
        for grp in range(int(groups.max()) + 1 if groups.size else 0):
            rows = np.flatnonzero(keep & (groups == grp))
            if rows.size == 0:
                continue
            loggers_seen = max(loggers_seen, grp + 1)
            node_name = node if grp == 0 else f"{node}#{grp + 1}"
            labels = {"node": node_name, "gpu": str(g.index)}
            if fact.get("uuid"):
                labels["uuid"] = fact["uuid"]
            _put(rec, source, labels, t[rows],
                 {f: np.frombuffer(col, dtype=float)[rows] for f, col in zip(g.fields, g.columns)})
            rec.gpu_facts[(node_name, g.index)] = {f: v for f, v in fact.items() if v and not v.startswith("[")}
            report.gpus.append({"node": node_name, "gpu": g.index, **rec.gpu_facts[(node_name, g.index)],
                                "rows": int(rows.size)})
            report.rows += int(rows.size)
            lo, hi = float(t[rows].min()), float(t[rows].max())
            report.start_s = lo if report.start_s is None else min(report.start_s, lo)
            report.end_s = hi if report.end_s is None else max(report.end_s, hi)
    if loggers_seen > 1:
        report.notes.append(f"a GPU's time went back {back_steps} times: more than one logger wrote into this file "
                            f"at once; its lines, split by time into {loggers_seen} series, are read as GPUs of "
                            f"nodes {node}, {node}#2, ... (their samples of the same second differ: they are not "
                            f"one GPU, and the file does not say which GPUs they are)")


def _join_loggers(t: np.ndarray, writer: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """Per line, its logger after joining those whose spans overlap by less than a few intervals."""
    if t.size == 0:
        return np.zeros(0, dtype=int)
    n = int(writer.max()) + 1
    spans = []
    for w in range(n):
        tw = t[(writer == w) & keep]
        if tw.size:
            spans.append((float(tw.min()), float(tw.max()), w))
    d = np.diff(np.sort(t[keep])) if keep.sum() > 1 else np.array([])
    d = d[d > 0]
    interval = float(np.median(d)) if d.size else 0.0
    tolerance = max(WRITER_OVERLAP_MIN_S, WRITER_OVERLAP_INTERVALS * interval)
    joined: list[list[float]] = []  # [first, last] per joined logger
    group_of = np.zeros(n, dtype=int)
    for first, last, w in sorted(spans):
        fits = [j for j, (_, end) in enumerate(joined) if end <= first + tolerance]
        if fits:
            j = max(fits, key=lambda j: joined[j][1])
            joined[j][1] = max(joined[j][1], last)
        else:
            j = len(joined)
            joined.append([first, last])
        group_of[w] = j
    return group_of[writer]


def _put(rec: Recording, source: int, labels: dict[str, str], t: np.ndarray, values: dict[str, np.ndarray]) -> None:
    """Series of one GPU's fields (NaN left out); memory.total from its parts where the log has none."""
    if "memory.total" not in values and "memory.free" in values and "memory.used" in values:
        total = values["memory.used"] + values["memory.free"]
        if "memory.reserved" in values:
            total = total + np.nan_to_num(values["memory.reserved"])
        values = {**values, "memory.total": total}
    for name, v in values.items():
        if name not in _MAPPED:
            continue
        ok = ~np.isnan(v)
        if not ok.any():
            continue
        s = rec.series({"__name__": name, **labels}, source)
        s.t.extend(t[ok].tolist())
        s.v.extend(v[ok].tolist())
