"""The serving front end around the simulated engine: admission, clients that give up and retry, restarts.

What sits between users and the engine loop in a deployment, modelled as
mechanisms rather than curves (SCENARIOS.md §5):

- admission control (``admission.AdmissionController``): with no limits every
  request is queued (an unbounded queue); with a token bucket and a queue
  bound, the excess is refused with 429 and never queued;
- clients with a timeout: a request not finished ``client_timeout_s`` after
  it was sent is abandoned, and the engine aborts it wherever it is (queued
  or generating: work already spent on it is lost). A client re-sends after a
  timeout or a refused connection, up to ``client_retries`` times, after an
  exponential backoff with jitter; a 429 is passed to the caller (the gateway
  routes it elsewhere), not retried here;
- a liveness probe (``LivenessProbe``) answered by the serving loop after
  the requests queued ahead of it: its latency is the age of the oldest
  waiting request. ``failure_threshold`` probes in a row slower than
  ``timeout_s`` and the orchestrator restarts the instance: running and
  queued requests are dropped (their clients retry), the instance is WARMING
  for ``warmup_s`` (process start, weights, KV tables) and refuses
  connections, then SERVING again and the retries land on it at once.

Timeouts and probes are evaluated between engine steps; a run of fast-
forwarded decode steps is at most about a second, so a deadline or a probe is
honoured within a second of simulated time.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from gpudiag.catalog import M
from gpudiag.errors import GpudiagError
from gpudiag.reference_engine.core.sequence import Sequence, Status
from gpudiag.reference_engine.serving.admission import AdmissionConfig, AdmissionController, ServingState, Verdict

if TYPE_CHECKING:
    from gpudiag.reference_engine.sim.engine import SimEngine

# How far into the queue the probe looks for the oldest request: preempted
# sequences go back to the head, so the oldest is always among the first few.
_PROBE_LOOKAHEAD = 64


@dataclass
class LivenessProbe:
    """A Kubernetes-style liveness probe and what a restart costs."""

    period_s: float = 10.0
    timeout_s: float = 10.0  # a probe answered later than this fails
    failure_threshold: int = 3  # consecutive failures that restart the instance
    warmup_s: float = 60.0  # from the restart until the instance serves again

    def validate(self) -> None:
        """Raise GpudiagError on a probe that could never run."""
        if not (self.period_s > 0 and self.timeout_s > 0 and self.warmup_s >= 0):
            raise GpudiagError("liveness probe period and timeout must be positive, warm-up not negative")
        if self.failure_threshold < 1:
            raise GpudiagError("liveness failure threshold must be at least 1")


@dataclass
class FrontendConfig:
    """Admission limits, client behaviour and the liveness probe of one instance."""

    admission: AdmissionConfig = field(default_factory=AdmissionConfig)  # no limits: an unbounded queue
    client_timeout_s: float | None = None  # None: clients wait as long as it takes
    client_retries: int = 0
    retry_backoff_s: float = 2.0  # first retry after about this long; doubles with each attempt
    liveness: LivenessProbe | None = None  # None: nothing ever restarts the instance

    def validate(self) -> None:
        """Raise GpudiagError on values no front end could run with."""
        self.admission.validate()
        if self.client_timeout_s is not None and not self.client_timeout_s > 0:
            raise GpudiagError(f"client timeout must be positive, got {self.client_timeout_s}")
        if self.client_retries < 0 or not self.retry_backoff_s >= 0:
            raise GpudiagError("client retries and retry backoff must not be negative")
        if self.liveness is not None:
            self.liveness.validate()


class Frontend:
    """Feeds the engine's scheduler through admission; aborts what clients abandon; restarts the instance."""

    def __init__(self, cfg: FrontendConfig, engine: SimEngine, seed: int):
        cfg.validate()
        self.cfg = cfg
        self.engine = engine
        # The run starts with a warm instance; WARMING happens after a restart.
        self.admission = AdmissionController(cfg.admission, now=0.0, state=ServingState.SERVING)
        self._rng = np.random.default_rng([seed, 0x5E7])
        self._ids = itertools.count(len(engine.requests))
        self._next_original = 0
        self._retries: list[tuple[float, int, Sequence]] = []  # (send time, id, the attempt)
        self._deadlines: list[tuple[float, int, Sequence]] = []
        self._attempts: dict[int, int] = {}  # seq_id -> attempts made before it
        self._warm_until: float | None = None
        self._next_probe = cfg.liveness.period_s if cfg.liveness else math.inf
        self._probe_failures = 0
        self.arrived_total = 0  # requests that reached the instance (429s included)
        self.timed_out_total = 0
        self.restarts_total = 0
        self.dropped_by_restarts = 0  # requests in flight when the instance restarted
        self.refused_connections = 0  # sent while the instance was warming
        self.given_up = 0  # clients that ran out of retries

    # -- the engine's hooks ----------------------------------------------------------------
    def step(self, t: float) -> None:
        """Everything due by ``t``: the end of a warm-up, arrivals and retries, timeouts, liveness probes."""
        if self._warm_until is not None and t >= self._warm_until:
            self.admission.ready(self._warm_until)
            self._warm_until = None
        reqs = self.engine.requests
        while True:
            nxt_orig = reqs[self._next_original].arrival_s if self._next_original < len(reqs) else math.inf
            nxt_retry = self._retries[0][0] if self._retries else math.inf
            if min(nxt_orig, nxt_retry) > t:
                break
            if nxt_orig <= nxt_retry:
                seq = reqs[self._next_original]
                self._next_original += 1
            else:
                seq = heapq.heappop(self._retries)[2]
            self._arrive(seq)
        self._expire(t)
        self._probe(t)

    def next_event_s(self) -> float:
        """When the front end next has something for the engine: an arrival, a retry, the end of a warm-up."""
        reqs = self.engine.requests
        nxt = reqs[self._next_original].arrival_s if self._next_original < len(reqs) else math.inf
        if self._retries:
            nxt = min(nxt, self._retries[0][0])
        if self._warm_until is not None:
            nxt = min(nxt, self._warm_until)
        return nxt

    def in_flight(self) -> int:
        """Requests queued, running or waiting to be re-sent."""
        return len(self.engine.sched.waiting) + len(self.engine.sched.running) + len(self._retries)

    def metrics(self, t: float) -> dict:
        """The front end's columns of the engine row."""
        state = self.admission.state_at(t)
        return {
            M.engine_requests_arrived_total: self.arrived_total,
            M.engine_requests_rejected_total: self.admission.rejected_total,
            M.engine_requests_timed_out_total: self.timed_out_total,
            M.engine_restarts_total: self.restarts_total,
            M.engine_serving_state: {s.value: int(s is state) for s in ServingState},
        }

    # -- mechanisms ------------------------------------------------------------------------
    def _arrive(self, seq: Sequence) -> None:
        t = seq.arrival_s
        sched = self.engine.sched
        verdict = self.admission.offer(t, len(sched.waiting))
        if verdict is Verdict.NOT_SERVING:
            self.refused_connections += 1
            self._retry(seq, t)
            return
        self.arrived_total += 1
        if verdict is not Verdict.ACCEPTED:
            return  # 429: counted by admission, never queued
        self.engine._enqueue(seq)
        if self.cfg.client_timeout_s is not None:
            heapq.heappush(self._deadlines, (t + self.cfg.client_timeout_s, seq.seq_id, seq))

    def _expire(self, t: float) -> None:
        while self._deadlines and self._deadlines[0][0] <= t:
            deadline, _, seq = heapq.heappop(self._deadlines)
            if seq.status is not Status.WAITING and seq.status is not Status.RUNNING:
                continue  # finished in time, or already dropped by a restart
            self.engine.sched.abort(seq, t)
            self.timed_out_total += 1
            self._retry(seq, deadline)

    def _retry(self, seq: Sequence, t: float) -> None:
        attempt = self._attempts.pop(seq.seq_id, 0) + 1
        if attempt > self.cfg.client_retries:
            self.given_up += 1
            return
        backoff = self.cfg.retry_backoff_s * 2 ** (attempt - 1) * float(self._rng.uniform(0.5, 1.5))
        again = Sequence(next(self._ids), t + backoff, seq.prompt_tokens, seq.max_output_tokens, seq.tier, seq.kind)
        again.content, again.output_segment = seq.content, seq.output_segment
        self._attempts[again.seq_id] = attempt
        heapq.heappush(self._retries, (again.arrival_s, again.seq_id, again))

    def _probe(self, t: float) -> None:
        probe = self.cfg.liveness
        if probe is None:
            return
        while self._next_probe <= t:
            at = self._next_probe
            self._next_probe += probe.period_s
            if self._warm_until is not None:
                continue  # no probe counts while the instance warms up
            waiting = self.engine.sched.waiting
            oldest = min((s.arrival_s for s in itertools.islice(waiting, _PROBE_LOOKAHEAD)), default=at)
            if at - oldest > probe.timeout_s:
                self._probe_failures += 1
            else:
                self._probe_failures = 0
            if self._probe_failures >= probe.failure_threshold:
                self._restart(t)
                return

    def _restart(self, t: float) -> None:
        sched = self.engine.sched
        dropped = list(sched.running) + list(sched.waiting)
        for seq in dropped:
            sched.abort(seq, t)
            self._retry(seq, t)
        self.dropped_by_restarts += len(dropped)
        self.restarts_total += 1
        self.admission.restart(t)
        self._warm_until = t + self.cfg.liveness.warmup_s
        self._probe_failures = 0
        self._next_probe = self._warm_until + self.cfg.liveness.period_s
