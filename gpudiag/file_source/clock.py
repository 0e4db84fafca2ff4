"""Timestamps of recorded files: nvidia-smi's own format, ISO-8601 and Unix time.

A timestamp without an offset is local time, as ``--from``/``--to`` read
one (``gpudiag.investigate.parse_time``): a time copied from the file
selects the same instant. Run with ``TZ=...`` set to the recording
machine's zone to read such a file elsewhere.
"""

from __future__ import annotations

import re
from datetime import datetime

# nvidia-smi --query-gpu=timestamp writes "2026/02/15 06:12:48.455" (local time, no offset).
_NVIDIA_SMI = re.compile(r"(\d{4})/(\d{2})/(\d{2}) (\d{2}):(\d{2}):(\d{2}(?:\.\d+)?)\Z")
_ISO = re.compile(r"\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}(:\d{2}(\.\d+)?)?(Z|[+-]\d{2}:?\d{2})?\Z")
_UNIX = re.compile(r"\d{9,10}(\.\d+)?\Z")
# Unix time written in milliseconds (Prometheus' exposition format) has 13 digits.
_UNIX_MS = re.compile(r"\d{12,13}\Z")


def kind_of(text: str) -> str | None:
    """Which timestamp format ``text`` is in: "nvidia-smi", "iso", "unix", "unix_ms"; None when none."""
    s = text.strip()
    if _NVIDIA_SMI.match(s):
        return "nvidia-smi"
    if _ISO.match(s):
        return "iso"
    if _UNIX.match(s):
        return "unix"
    if _UNIX_MS.match(s):
        return "unix_ms"
    return None


class Clock:
    """Parses one file's timestamps (a cache per minute makes nvidia-smi's format cheap on long logs)."""

    def __init__(self, kind: str):
        self.kind = kind
        self._minutes: dict[str, float] = {}
        self.parse = {"nvidia-smi": self._nvidia_smi, "iso": self._iso, "unix": self._unix,
                      "unix_ms": self._unix_ms}[kind]

    def _nvidia_smi(self, text: str) -> float | None:
        m = _NVIDIA_SMI.match(text)
        if m is None:
            return None
        base = self._minutes.get(text[:16])
        if base is None:
            try:
                base = datetime(int(m[1]), int(m[2]), int(m[3]), int(m[4]), int(m[5])).timestamp()
            except ValueError:
                return None
            self._minutes[text[:16]] = base
        seconds = float(m[6])
        return base + seconds if seconds < 61 else None

    @staticmethod
    def _iso(text: str) -> float | None:
        if not _ISO.match(text):
            return None
        try:
            return datetime.fromisoformat(text).timestamp()
        except ValueError:
            return None

    @staticmethod
    def _unix(text: str) -> float | None:
        return float(text) if _UNIX.match(text) else None

    @staticmethod
    def _unix_ms(text: str) -> float | None:
        return float(text) / 1000.0 if _UNIX_MS.match(text) else None


def parse_any(text: str) -> float | None:
    """One timestamp in any of the formats (None when it is in none)."""
    kind = kind_of(text)
    return None if kind is None else Clock(kind).parse(text.strip())
