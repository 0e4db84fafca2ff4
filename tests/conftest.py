"""Shared test setup: the `gpu` marker skips without a GPU and says why."""

import os
import subprocess
import sys

import pytest


def _gpu_reason() -> str | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        n = pynvml.nvmlDeviceGetCount()
        pynvml.nvmlShutdown()
        if n == 0:
            return "NVML reports no GPU on this machine"
        return None
    except Exception as exc:  # NVML library absent or no driver
        return f"no NVIDIA GPU/driver here (NVML: {exc.__class__.__name__}: {exc})"


def pytest_collection_modifyitems(config, items):
    # Triton's interpreter is switched on per process (TRITON_INTERPRET is read when
    # triton is imported): its cases run in a subprocess of their own, the runner
    # test only in the outer session.
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    drops = {"interpreter_runner" if interpreted else "interpreter_only"}
    deselected = [it for it in items if drops & set(it.keywords)]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [it for it in items if not drops & set(it.keywords)]
    reason = None
    checked = False
    for item in items:
        if "gpu" in item.keywords:
            if not checked:
                reason, checked = _gpu_reason(), True
            if reason:
                item.add_marker(pytest.mark.skip(reason=f"needs a GPU: {reason}"))


@pytest.fixture
def cli():
    """Run ``gpudiag ARGS...`` as a real subprocess; returns the CompletedProcess (text mode)."""

    def run(*args, timeout=600, env=None, input=None):
        return subprocess.run([sys.executable, "-m", "gpudiag", *map(str, args)], capture_output=True,
                              text=True, timeout=timeout, env=env, input=input)

    return run


@pytest.fixture(scope="session")
def scenario_run():
    """``scenario_run(name, fix=None, seed=0)``: a finished ``gpudiag.repro`` run, computed once per session.

    The scenario tests and the scenario matrix look at the same runs; each runs once.
    """
    from gpudiag import repro
    from gpudiag.reference_engine import scenarios

    cache: dict[tuple[str, str | None, int], object] = {}

    def run(name: str, fix: str | None = None, seed: int = 0):
        key = (name, fix, seed)
        if key not in cache:
            cache[key] = repro.run(scenarios.get(name), fix, seed)
        return cache[key]

    return run
