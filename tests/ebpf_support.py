"""Whether BPF programs can be loaded here, for the tests that load them."""

from __future__ import annotations

import os
import shutil

import pytest

from gpudiag.probes import ebpf_readiness


def ebpf_skip_reason() -> str | None:
    """Why BPF programs cannot be loaded here (the readiness checks' first blocker), or None."""
    if os.geteuid() != 0:
        return "loading BPF programs needs root (CI runs this suite as root)"
    blockers = ebpf_readiness.blocking(ebpf_readiness.ebpf_checks())
    if blockers:
        return "eBPF unavailable: " + ebpf_readiness.explain(blockers[0])
    if shutil.which("gcc") is None:
        return "gcc is not installed (scripts/system-deps.d/10-ebpf.sh installs it)"
    return None


EBPF_SKIP = ebpf_skip_reason()


def needs_ebpf(test):
    """Marks a test that loads BPF programs; skipped, with the reason, where it cannot."""
    return pytest.mark.ebpf(pytest.mark.skipif(EBPF_SKIP is not None, reason=str(EBPF_SKIP))(test))
