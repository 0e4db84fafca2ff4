"""Admission control for a serving instance: token bucket, bounded queue, serving states.

Pure logic with no clock of its own: every method that depends on time takes
``now`` (seconds on any monotonic time base: the simulated clock of the
reference engine, or ``time.monotonic()`` in an HTTP server). Nothing here
sleeps, spawns or does I/O.

What a request meets at the door (SCENARIOS.md §5), in this order:

1. the serving state: only SERVING and THROTTLING accept work. WARMING
   (weights loading, KV tables being built) and DRAINING (SIGTERM received:
   finish in-flight work, take no new) answer 503;
2. the bounded queue: a request that would wait behind ``max_queue`` others
   is refused with 429 and never queued, so no accepted request waits longer
   than the queue takes to drain;
3. the token bucket: ``rate_per_s`` requests per second on average, bursts of
   up to ``burst``; beyond it 429 (with the seconds until a token is back, for
   a Retry-After header).

The instance is THROTTLING while it refuses: from the first 429 until
``calm_s`` without one, then SERVING again. A refusal costs the caller one
round trip instead of a timeout, and costs the instance nothing.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from enum import Enum
from typing import Generic, TypeVar

from gpudiag.errors import GpudiagError

T = TypeVar("T")


class ServingState(str, Enum):
    """Where an instance is in its life: WARMING -> SERVING <-> THROTTLING -> DRAINING."""

    WARMING = "warming"
    SERVING = "serving"
    THROTTLING = "throttling"
    DRAINING = "draining"

    @property
    def accepts(self) -> bool:
        """True in the states that take new requests."""
        return self in (ServingState.SERVING, ServingState.THROTTLING)


class Verdict(str, Enum):
    """What admission decided for one request."""

    ACCEPTED = "accepted"
    QUEUE_FULL = "queue_full"
    RATE_LIMITED = "rate_limited"
    NOT_SERVING = "not_serving"

    @property
    def http_status(self) -> int:
        """The HTTP status a server answers with: 200, 429 (over the limits) or 503 (not serving)."""
        return {Verdict.ACCEPTED: 200, Verdict.QUEUE_FULL: 429, Verdict.RATE_LIMITED: 429,
                Verdict.NOT_SERVING: 503}[self]


class TokenBucket:
    """``rate_per_s`` tokens per second into a bucket of ``burst``; a request takes one.

    The bucket starts full at ``now``. Time never runs backwards: an earlier
    ``now`` than the last one seen refills nothing.
    """

    def __init__(self, rate_per_s: float, burst: float, now: float = 0.0):
        if not (rate_per_s > 0) or math.isinf(rate_per_s):
            raise GpudiagError(f"token bucket rate must be a positive number per second, got {rate_per_s}")
        if not (burst >= 1):
            raise GpudiagError(f"token bucket burst must be at least 1, got {burst}")
        self.rate_per_s = float(rate_per_s)
        self.burst = float(burst)
        self._tokens = float(burst)
        self._t = float(now)

    def _refill(self, now: float) -> None:
        if now > self._t:
            self._tokens = min(self.burst, self._tokens + (now - self._t) * self.rate_per_s)
            self._t = now

    def available(self, now: float) -> float:
        """Tokens in the bucket at ``now``."""
        self._refill(now)
        return self._tokens

    def try_take(self, now: float, n: float = 1.0) -> bool:
        """Take ``n`` tokens if the bucket holds them; False (and nothing taken) otherwise."""
        self._refill(now)
        if self._tokens >= n:
            self._tokens -= n
            return True
        return False

    def retry_after_s(self, now: float, n: float = 1.0) -> float:
        """Seconds until ``n`` tokens are in the bucket (0 when they are now); inf when n exceeds the burst."""
        self._refill(now)
        if n > self.burst:
            return math.inf
        return max(0.0, (n - self._tokens) / self.rate_per_s)


class BoundedQueue(Generic[T]):
    """A FIFO that holds at most ``capacity`` items; ``put`` refuses beyond it instead of growing."""

    def __init__(self, capacity: int):
        if capacity < 0:
            raise GpudiagError(f"queue capacity must not be negative, got {capacity}")
        self.capacity = capacity
        self._items: deque[T] = deque()

    def __len__(self) -> int:
        return len(self._items)

    @property
    def full(self) -> bool:
        """True when a ``put`` would be refused."""
        return len(self._items) >= self.capacity

    def put(self, item: T) -> bool:
        """Append ``item``; False (not queued) when the queue is full."""
        if self.full:
            return False
        self._items.append(item)
        return True

    def get(self) -> T:
        """Remove and return the oldest item; IndexError when empty."""
        return self._items.popleft()

    def remove(self, item: T) -> bool:
        """Drop ``item`` (a caller that gave up); False when it was not queued."""
        try:
            self._items.remove(item)
        except ValueError:
            return False
        return True


@dataclass
class AdmissionConfig:
    """The limits of one instance. ``None`` leaves a limit off (an unbounded queue, no rate limit)."""

    rate_per_s: float | None = None
    burst: float = 1.0
    max_queue: int | None = None
    calm_s: float = 10.0  # THROTTLING -> SERVING after this long without a refusal

    def validate(self) -> None:
        """Raise GpudiagError on limits no instance could apply."""
        if self.rate_per_s is not None and (not (self.rate_per_s > 0) or math.isinf(self.rate_per_s)):
            raise GpudiagError(f"admission rate must be a positive number per second, got {self.rate_per_s}")
        if not (self.burst >= 1):
            raise GpudiagError(f"admission burst must be at least 1, got {self.burst}")
        if self.max_queue is not None and self.max_queue < 0:
            raise GpudiagError(f"max_queue must not be negative, got {self.max_queue}")
        if not (self.calm_s >= 0):
            raise GpudiagError(f"calm_s must not be negative, got {self.calm_s}")


class AdmissionController:
    """Decides, request by request, whether an instance takes work; keeps the serving state and counts.

    Use: ``ready(now)`` once warm; ``offer(now, queue_depth)`` per arriving
    request (``queue_depth``: requests already waiting, not counting this
    one); ``drain(now)`` on SIGTERM; ``restart(now)`` when the process comes
    back cold. ``state_at(now)`` gives the state for health and metrics.
    """

    def __init__(self, cfg: AdmissionConfig | None = None, now: float = 0.0,
                 state: ServingState = ServingState.WARMING):
        self.cfg = cfg or AdmissionConfig()
        self.cfg.validate()
        self._bucket = TokenBucket(self.cfg.rate_per_s, self.cfg.burst, now) if self.cfg.rate_per_s else None
        self._state = state
        self._since = float(now)
        self._last_refusal = -math.inf
        self.accepted_total = 0
        self.rejected_total = 0  # 429s: over the queue bound or the rate
        self.unavailable_total = 0  # 503s: warming or draining
        self.rejected_by_verdict: dict[Verdict, int] = {Verdict.QUEUE_FULL: 0, Verdict.RATE_LIMITED: 0}

    # -- state ------------------------------------------------------------------------
    def state_at(self, now: float) -> ServingState:
        """The serving state at ``now`` (THROTTLING ends ``calm_s`` after the last refusal)."""
        if self._state is ServingState.THROTTLING and now - self._last_refusal >= self.cfg.calm_s:
            self._set(ServingState.SERVING, self._last_refusal + self.cfg.calm_s)
        return self._state

    def state_since(self, now: float) -> float:
        """When the state in force at ``now`` was entered."""
        self.state_at(now)
        return self._since

    def _set(self, state: ServingState, now: float) -> None:
        if state is not self._state:
            self._state = state
            self._since = now

    def ready(self, now: float) -> None:
        """Warm-up finished: start SERVING. Ignored unless WARMING."""
        if self._state is ServingState.WARMING:
            self._set(ServingState.SERVING, now)

    def drain(self, now: float) -> None:
        """Stop taking new requests and let in-flight ones finish (SIGTERM)."""
        self._set(ServingState.DRAINING, now)

    def restart(self, now: float) -> None:
        """The process came back cold: WARMING again, a full bucket, no recent refusal."""
        self._set(ServingState.WARMING, now)
        self._last_refusal = -math.inf
        if self._bucket is not None:
            self._bucket = TokenBucket(self._bucket.rate_per_s, self._bucket.burst, now)

    # -- the door -----------------------------------------------------------------------
    def offer(self, now: float, queue_depth: int) -> Verdict:
        """Admit or refuse one request arriving at ``now`` with ``queue_depth`` requests already waiting."""
        state = self.state_at(now)
        if not state.accepts:
            self.unavailable_total += 1
            return Verdict.NOT_SERVING
        verdict = Verdict.ACCEPTED
        # The queue bound is checked first: a request it refuses must not spend a token.
        if self.cfg.max_queue is not None and queue_depth >= self.cfg.max_queue:
            verdict = Verdict.QUEUE_FULL
        elif self._bucket is not None and not self._bucket.try_take(now):
            verdict = Verdict.RATE_LIMITED
        if verdict is Verdict.ACCEPTED:
            self.accepted_total += 1
            return verdict
        self.rejected_total += 1
        self.rejected_by_verdict[verdict] += 1
        self._last_refusal = now
        self._set(ServingState.THROTTLING, now)
        return verdict

    def retry_after_s(self, now: float) -> float:
        """Seconds a refused caller should wait (a Retry-After header): until a token is back, at least 1 s."""
        if self._bucket is None:
            return 1.0
        return max(1.0, math.ceil(self._bucket.retry_after_s(now)))
