"""Host-side preprocessing before a request reaches the scheduler: inline on the engine thread, or in workers.

Every request is tokenized, padded and run through its feature transforms
before the engine can schedule it; that costs ``CostModel.preprocess_s`` of
one CPU core. Where it runs decides whether the GPU is fed:

- inline (``workers == 0``): on the engine's one host thread, between engine
  steps, as in a serving loop that takes the next request, preprocesses it,
  hands it to the scheduler and steps: one request per decode step while
  requests wait and the engine has a free slot (``max_num_seqs`` less
  running and queued). The GPU waits through every preprocessing.
- workers (``workers > 0``): that many worker processes preprocess ahead
  into a bounded prefetch queue of ``queue_depth`` requests; the engine
  thread only takes ready requests off the queue (``handoff_s`` each: the
  inter-process copy), as many as it has free slots. The workers are real
  capacity: each preprocesses one request at a time. A worker whose result
  finds the queue full holds it and stops taking work until the engine
  makes room (backpressure); a queue that stays empty means the workers are
  the bottleneck.

Requests wait for preprocessing in arrival order (the server's listen
backlog); they are not yet in the engine's own queue, so
``num_requests_waiting`` does not count them.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Callable

from gpudiag.errors import GpudiagError
from gpudiag.reference_engine.core.sequence import Sequence


@dataclass
class PreprocessConfig:
    """Where request preprocessing runs: ``workers == 0`` is the engine thread itself."""

    workers: int = 0
    queue_depth: int = 64  # preprocessed requests the prefetch queue holds
    handoff_s: float = 0.3e-3  # engine thread: taking one preprocessed request off the queue

    def validate(self) -> None:
        """Raise GpudiagError on values no pipeline could run with."""
        if self.workers < 0:
            raise GpudiagError(f"preprocess workers must be 0 (inline) or more, got {self.workers}")
        if self.workers and self.queue_depth <= 0:
            raise GpudiagError(f"the prefetch queue needs room for at least one request, got {self.queue_depth}")
        if self.handoff_s < 0:
            raise GpudiagError("handoff time must not be negative")


class _PerSecond:
    """Seconds of some activity summed per second of the virtual clock (any number of actors)."""

    def __init__(self):
        self.by_second: dict[int, float] = {}

    def add(self, t0: float, t1: float) -> None:
        while t1 > t0:
            s = math.floor(t0)
            end = min(t1, s + 1.0)
            self.by_second[s] = self.by_second.get(s, 0.0) + end - t0
            t0 = end

    def pop(self, second: int) -> float:
        return self.by_second.pop(second, 0.0)


@dataclass(eq=False)
class _Worker:
    item: Sequence | None = None
    done_s: float = 0.0  # when the item in hand is (or was) preprocessed
    blocked: bool = False  # holding a finished item: the prefetch queue was full
    blocked_from_s: float = 0.0  # blocked time before this is already counted


class Preprocessing:
    """The preprocessing stage between the front door and the scheduler."""

    def __init__(self, cfg: PreprocessConfig, cost_s: Callable[[Sequence], float]):
        cfg.validate()
        self.cfg = cfg
        self.cost_s = cost_s
        self.backlog: deque[Sequence] = deque()  # arrived, not yet preprocessed
        self.ready: deque[Sequence] = deque()  # preprocessed, in the prefetch queue
        self.workers = [_Worker() for _ in range(cfg.workers)]
        self.busy = _PerSecond()
        self.blocked = _PerSecond()

    @property
    def inline(self) -> bool:
        """True when the engine thread preprocesses (no workers)."""
        return not self.workers

    def arrive(self, seq: Sequence) -> None:
        """A request came in at the front door."""
        self.backlog.append(seq)

    # -- inline ---------------------------------------------------------------------
    def take_one(self) -> tuple[Sequence, float] | None:
        """The oldest waiting request and its preprocessing time (None when none waits)."""
        if not self.backlog:
            return None
        seq = self.backlog.popleft()
        return seq, self.cost_s(seq)

    # -- workers --------------------------------------------------------------------
    def advance(self, t: float) -> None:
        """Run the workers up to time ``t``, event by event in time order.

        Events: a free worker takes the oldest waiting request (once it has
        arrived); a busy worker finishes its request and puts it on the queue,
        or holds it when the queue is full.
        """
        while self.workers:
            # (time, finish before start, worker order): the earliest event, ties in a fixed order.
            events = [(w.done_s, 0, i) for i, w in enumerate(self.workers) if w.item is not None and not w.blocked]
            if self.backlog:
                events += [(max(w.done_s, self.backlog[0].arrival_s), 1, i)
                           for i, w in enumerate(self.workers) if w.item is None]
            if not events:
                return
            when, start, i = min(events)
            if when > t:
                return
            if start:
                self._start(self.workers[i], when)
            else:
                self._complete(self.workers[i])

    def _start(self, w: _Worker, t0: float) -> None:
        w.item = self.backlog.popleft()
        d = self.cost_s(w.item)
        self.busy.add(t0, t0 + d)
        w.done_s = t0 + d

    def _complete(self, w: _Worker) -> None:
        if len(self.ready) >= self.cfg.queue_depth:
            w.blocked = True
            w.blocked_from_s = w.done_s
            return
        self.ready.append(w.item)
        w.item = None

    def take_ready(self, t: float, room: int) -> list[Sequence]:
        """The engine thread takes up to ``room`` preprocessed requests at ``t``; blocked workers resume."""
        self.advance(t)
        out = []
        while self.ready and len(out) < room:
            out.append(self.ready.popleft())
        for w in sorted((w for w in self.workers if w.blocked), key=lambda w: w.done_s):  # held longest first
            if len(self.ready) < self.cfg.queue_depth:
                self.blocked.add(w.blocked_from_s, t)
                w.blocked = False
                w.done_s = t
                self.ready.append(w.item)
                w.item = None
        self.advance(t)
        return out

    def next_ready_s(self) -> float | None:
        """Earliest time a worker finishes a request (None when none is being preprocessed)."""
        return min((w.done_s for w in self.workers if w.item is not None and not w.blocked), default=None)

    # -- sampling -------------------------------------------------------------------
    def sample(self, second: int) -> dict[str, float]:
        """Queue lengths at the end of second ``second`` and the workers' busy and blocked shares of it.

        The workers must have been advanced to the end of the second; each second is sampled once, in order.
        """
        end = second + 1.0
        backlog = len(self.backlog)
        for seq in reversed(self.backlog):  # arrivals the engine has seen after the second ended
            if seq.arrival_s <= end:
                break
            backlog -= 1
        out = {"backlog": float(backlog), "ready": float(len(self.ready))}
        if self.workers:
            n = len(self.workers)
            blocked = self.blocked.pop(second)
            for w in self.workers:  # still blocked: count this second now, the rest when it resumes
                if w.blocked:
                    blocked += max(0.0, end - max(w.blocked_from_s, float(second)))
                    w.blocked_from_s = max(w.blocked_from_s, end)
            out["busy_ratio"] = min(1.0, self.busy.pop(second) / n)
            out["blocked_ratio"] = min(1.0, blocked / n)
        return out
