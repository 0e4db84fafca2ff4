"""The simulated GPU as a probe: the reference engine paced to wall time, read like a real node.

``open_sim_probes`` starts the scenario's engine on the simulated GPU in a
background thread, on a virtual clock paced to real time (``speed`` simulated
seconds per wall second), and returns a probe whose ``sample`` yields the
latest gpu, process, engine and node frames, plus the request rows finished
since the previous sample — the same frame kinds the NVML, torch and engine
probes yield, so everything downstream runs without a GPU.

With ``timeline=True`` the probe also keeps every simulated second's frames
until :meth:`SimProbe.drain` takes them: at ``speed`` 400 the engine produces
400 seconds of frames per wall second, and the agent's analyzers want each
of them (1 s samples), not the one that happens to be newest at a wall tick.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

from gpudiag.errors import GpudiagError
from gpudiag.frames import Frame
from gpudiag.probes.base import Probe
from gpudiag.reference_engine import scenarios
from gpudiag.reference_engine.sim.engine import SimEngine, VirtualClock


class _Stopped(Exception):
    pass


# Frames kept for drain() when nobody drains: an hour of simulated time (five kinds a
# second), a few MB; beyond it the oldest are dropped and counted.
MAX_TIMELINE_FRAMES = 5 * 3600


class SimProbe(Probe):
    """Latest frames of a simulated engine running in a background thread."""

    name = "sim"
    interval_s = 1.0

    def __init__(self, scenario: str, *, speed: float = 1.0, seed: int = 0, fix: str | None = None,
                 timeline: bool = False, hold_after_s: float | None = None, gpu_index: int = 0):
        sc = scenarios.get(scenario)
        cfg, workload = sc.build(fix)
        if speed <= 0:
            raise GpudiagError(f"speed must be positive, got {speed}")
        self.scenario = sc.name
        self.speed = speed
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._latest: dict[str, Frame] = {}
        self._requests: list[dict[str, Any]] = []
        self._error: str | None = None
        self._done = False
        self._timeline: deque[Frame] | None = deque() if timeline else None
        self.dropped_frames = 0
        self._horizon_s: float | None = hold_after_s  # see hold_after; set before the engine's first step
        self._horizon_moved = threading.Condition(self._lock)
        self.sim_time_s = 0.0
        self.engine = SimEngine(cfg, workload, seed=seed, clock=VirtualClock(speed, sleep=self._sleep),
                                gpu_index=gpu_index)
        self._thread = threading.Thread(target=self._run, name=f"gpudiag-sim-{sc.name}", daemon=True)
        self._thread.start()

    def _sleep(self, delay: float) -> None:
        if self._stop.wait(delay):
            raise _Stopped()

    def _run(self) -> None:
        try:
            for fr in self.engine.frames():
                with self._lock:
                    while self._horizon_s is not None and fr.t > self._horizon_s and not self._stop.is_set():
                        self._horizon_moved.wait(0.1)
                    if fr.kind == "request":
                        if self._timeline is None:  # drain() hands them out instead
                            self._requests.extend(fr.rows)
                    else:
                        self._latest[fr.kind] = fr
                    if self._timeline is not None:
                        if len(self._timeline) >= MAX_TIMELINE_FRAMES:
                            self._timeline.popleft()
                            self.dropped_frames += 1
                        self._timeline.append(fr)
                    self.sim_time_s = fr.t
                if self._stop.is_set():
                    return
        except _Stopped:
            return
        except Exception as exc:  # the probe reports it; the agent keeps running
            self._error = f"{type(exc).__name__}: {exc}"
        finally:
            self._done = True

    def sample(self, now: float) -> list[Frame]:
        """The latest simulated second's frames, stamped ``now``; request rows since the last call."""
        with self._lock:
            frames = [Frame(f.kind, now, [dict(r, sim_t=f.t) for r in f.rows]) for f in self._latest.values()]
            if self._requests:
                frames.append(Frame("request", now, self._requests))
                self._requests = []
        return frames

    def drain(self) -> list[Frame]:
        """Every frame produced since the previous drain, on the simulated time base (``t`` = simulated
        seconds), rows carrying ``sim_t``. Needs ``timeline=True``."""
        if self._timeline is None:
            raise RuntimeError("SimProbe(timeline=True) keeps the frames drain() returns")
        with self._lock:
            taken = list(self._timeline)
            self._timeline.clear()
        return [Frame(f.kind, f.t, [dict(r, sim_t=f.t) for r in f.rows]) for f in taken]

    def hold_after(self, sim_t: float | None) -> None:
        """Let the engine run up to simulated second ``sim_t`` and wait there (None: no limit).

        A consumer that cannot keep up with ``speed`` (the agent's analyzers) holds the
        simulation back instead of seeing its findings late; the pace is then the
        slower of ``speed`` and the consumer.
        """
        with self._lock:
            self._horizon_s = sim_t
            self._horizon_moved.notify_all()

    @property
    def finished(self) -> bool:
        """True once the scenario's workload has run to its end (or failed)."""
        return self._done

    def status(self) -> dict[str, Any]:
        """Scenario, speed and simulated time reached; unavailable with the reason when the engine failed."""
        return {"name": self.name, "available": self._error is None,
                "reason": self._error or ("scenario finished" if self._done else ""),
                "missing_fields": {}, "scenario": self.scenario, "speed": self.speed,
                "sim_time_s": self.sim_time_s, "dropped_frames": self.dropped_frames}

    def close(self) -> None:
        """Stop the engine thread."""
        self._stop.set()
        self.hold_after(None)
        self._thread.join(timeout=2.0)


def open_sim_probes(scenario: str = "kv-eviction-storm", speed: float = 1.0, seed: int = 0,
                    fix: str | None = None) -> list[Probe]:
    """Probes over a simulated node running ``scenario`` paced at ``speed`` x real time."""
    return [SimProbe(scenario, speed=speed, seed=seed, fix=fix)]
