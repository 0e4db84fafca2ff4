"""A request as the engine sees it: prompt, generated tokens, timings, tier."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from gpudiag.catalog import M

# Priority tiers, highest first (SCENARIOS.md §1 fix 2): paying/VIP traffic,
# replayable/internal traffic, offline batch.
TIERS = ("vip", "internal", "batch")


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"  # its client went away (timeout) or the instance restarted under it
    FAILED = "failed"  # it ended in an error (CUDA out of memory) instead of its last token


@dataclass(eq=False)
class Sequence:
    """One request: its tokens so far, where it is, and when things happened to it."""

    seq_id: int
    arrival_s: float
    prompt_tokens: int
    max_output_tokens: int
    tier: int = 1  # index into TIERS; lower is more important
    kind: str = "short"  # workload class, for reporting
    status: Status = Status.WAITING
    generated: int = 0
    first_scheduled_s: float | None = None
    first_token_s: float | None = None
    finish_s: float | None = None
    preemptions: int = 0
    recomputed_tokens: int = 0
    admitted_s: float = 0.0  # last time its KV was (re)built
    kv: object = field(default=None, repr=False)  # the KV manager's handle
    # What the prompt is made of, for prefix caching: (segment id, tokens) pieces; equal
    # pieces are equal tokens. None: a prompt of its own that shares nothing.
    content: tuple[tuple[int, int], ...] | None = field(default=None, repr=False)
    output_segment: int | None = None  # segment id of its generated tokens (a later turn's prompt holds them)
    cached_tokens: int = 0  # prompt tokens found in the prefix cache at its last admission
    # Prompt tokens served from a cache outside the simulation at its first admission, not prefilled: a
    # replayed window's prefix caches (gpudiag repro --file/--from-store fits them from the hit counters).
    reused_tokens: int = 0
    last_token_s: float | None = None  # when its latest token came out

    @property
    def num_tokens(self) -> int:
        """Tokens whose KV the sequence needs: prompt plus generated."""
        return self.prompt_tokens + self.generated

    @property
    def remaining(self) -> int:
        """Output tokens still to generate."""
        return self.max_output_tokens - self.generated

    @property
    def estimated_final_tokens(self) -> int:
        """Upper bound on the KV the sequence will ever need."""
        return self.prompt_tokens + self.max_output_tokens

    def latencies(self) -> dict[str, float]:
        """TTFT, TPOT, e2e, queue and prefill time of a finished sequence (seconds)."""
        ttft = self.first_token_s - self.arrival_s
        e2e = self.finish_s - self.arrival_s
        tpot = (self.finish_s - self.first_token_s) / (self.generated - 1) if self.generated > 1 else 0.0
        return {
            M.time_to_first_token_seconds: ttft,
            M.inter_token_latency_seconds: tpot,
            M.e2e_request_latency_seconds: e2e,
            M.request_queue_time_seconds: self.first_scheduled_s - self.arrival_s,
            M.request_prefill_time_seconds: self.first_token_s - self.first_scheduled_s,
        }
