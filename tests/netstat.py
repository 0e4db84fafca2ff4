"""The kernel's TCP counters, for tests that must show a burst never overflowed a listen queue."""

from __future__ import annotations


def listen_overflows() -> int | None:
    """Connections a full listen queue turned away (all sockets), None where unreadable."""
    try:
        with open("/proc/net/netstat") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for names, values in zip(lines[::2], lines[1::2]):
        if names.startswith("TcpExt:"):
            row = dict(zip(names.split()[1:], values.split()[1:]))
            return int(row["ListenOverflows"]) if "ListenOverflows" in row else None
    return None
