"""Continuous batching: which sequences run in the next step, and who is evicted.

Two loops, as in nano-vllm: admit waiting sequences into a prefill step while
memory allows; otherwise run one decode step over the running batch, making
room for each sequence's next token and preempting (by recompute) when the
KV manager cannot.

Preemption policies (victim among the running batch):
- ``lru``: the least recently (re)admitted sequence, i.e. the one whose KV
  has been resident longest. Every running sequence is touched every step,
  so residency is the only recency that separates them. Tiers are ignored.
- ``priority``: only sequences of the same or a lower tier than the one
  that needs room are candidates (a running request of a higher tier is
  never evicted); the lowest tier goes first, LRU within a tier. With no
  candidate, the sequence that needs room preempts itself.
- ``newest``: vLLM V1's FCFS rule (vllm/v1/core/sched/scheduler.py,
  ``preempted_req = self.running.pop()``): the last sequence to join the
  running batch, which may be the one that needs room (it then preempts
  itself). The batch keeps its oldest, largest sequences, which finish.
- ``self``: the sequence that needs room preempts itself; no other running
  sequence loses its KV. For contiguous KV grown by realloc: evicting
  another sequence frees a region somewhere else, not room next to the one
  that must grow, so the engine gives up the growing one and recomputes it
  later.

Re-queueing a preempted sequence (``requeue``):
- ``head``: at the head of the waiting queue, before every other waiting
  sequence (vLLM V1's ``self.waiting.prepend_request``): the one preempted
  last comes back first.
- ``fifo``: at the head, behind the sequences preempted before it: they come
  back in the order they were preempted, so none waits behind a stream of
  later ones.

With ``recompute_watermark_bytes``, a preempted sequence is re-admitted only
when the KV memory left free after its allocation is at least that much: the
room new requests need for their first allocations is not taken back by
recomputes (vLLM V0's block manager kept such a watermark, 1 % of the blocks,
for every admission).

With ``admit_while_preempting`` off, as in vLLM V1 (``if not preempted_reqs:``
before it schedules the waiting queue), no waiting sequence is admitted in a
step that preempted: the running batch takes the freed memory first.

Batching (admission):
- ``fcfs``: in arrival order while the KV manager can allocate.
- ``memory-aware``: also by estimated footprint: a sequence is admitted only
  if the estimated final KV bytes of the running batch plus its own stay
  under ``memory_watermark`` of the KV capacity, and very long sequences are
  kept apart from batches of short ones (at most ``max_long_seqs`` at once).
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from dataclasses import dataclass

from gpudiag.errors import GpudiagError
from gpudiag.reference_engine.core.kv_manager import KVManager
from gpudiag.reference_engine.core.sequence import Sequence, Status

POLICIES = ("lru", "priority", "newest", "self")
REQUEUE = ("head", "fifo")
# How far into the waiting queue admission looks: far enough for every realistic queue of
# sequences known not to fit, bounded so that a step's cost does not grow with a runaway queue.
ADMISSION_SCAN = 1024
BATCHING = ("fcfs", "memory-aware")


@dataclass
class SchedulerConfig:
    """Batch limits, preemption policy and admission rule."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 16384
    policy: str = "lru"
    batching: str = "fcfs"
    memory_watermark: float = 0.9
    long_seq_tokens: int = 2048
    max_long_seqs: int = 16
    # Allocation attempts past a head of the queue that cannot get KV memory, per prefill. A
    # sequence already known not to fit (see the failure floor) is passed over without an
    # attempt and does not count: however many long recomputes wait at the head, short
    # requests behind them are still admitted while memory allows. 0: nothing is tried behind a head
    # that does not fit, known or not (vLLM V1's waiting loop: ``if new_blocks is None: break``).
    admission_lookahead: int = 16
    # False: a decode step that preempted holds admission until a decode step that did not (vLLM V1).
    admit_while_preempting: bool = True
    # Where a preempted sequence goes in the waiting queue (REQUEUE; see the module's docstring).
    requeue: str = "head"
    # KV memory a re-admitted (preempted) sequence must leave free; 0: none.
    recompute_watermark_bytes: int = 0
    # True: a prefill step is followed by a decode step of the running batch before the next prefill
    # (vLLM V1 schedules every running request first in each step, then waiting ones in the tokens
    # and KV left: running requests get their next blocks before new prompts take them).
    running_first: bool = False

    def validate(self) -> None:
        """Raise GpudiagError on values no scheduler could run with."""
        if self.policy not in POLICIES:
            raise GpudiagError(f"unknown preemption policy {self.policy!r}; valid: {', '.join(POLICIES)}")
        if self.requeue not in REQUEUE:
            raise GpudiagError(f"unknown requeue {self.requeue!r}; valid: {', '.join(REQUEUE)}")
        if self.recompute_watermark_bytes < 0:
            raise GpudiagError("recompute_watermark_bytes cannot be negative")
        if self.batching not in BATCHING:
            raise GpudiagError(f"unknown batching {self.batching!r}; valid: {', '.join(BATCHING)}")
        if self.max_num_seqs <= 0 or self.max_num_batched_tokens <= 0:
            raise GpudiagError("max_num_seqs and max_num_batched_tokens must be positive")
        if not 0.0 < self.memory_watermark <= 1.0:
            raise GpudiagError("memory_watermark must be in (0, 1]")


class _Floor:
    """After a request of S bytes could not be had, requests of S bytes or more are not tried again until
    S bytes have been freed (each try would fail the same way)."""

    __slots__ = ("bytes", "freed")

    def __init__(self):
        self.bytes, self.freed = math.inf, 0

    def hold(self, nbytes: int) -> None:
        self.bytes, self.freed = min(self.bytes, nbytes), 0

    def release(self, nbytes: int) -> None:
        self.freed += nbytes
        if self.freed >= self.bytes:
            self.bytes = math.inf

    def clear(self) -> None:
        self.bytes = math.inf


@dataclass
class StepStats:
    """What the last scheduling decision did to memory."""

    alloc_failures: int = 0
    evictions: int = 0
    largest_failed_bytes: int = 0
    recomputed_tokens: int = 0


class Scheduler:
    """Waiting deque, running list, one policy; the same code on every device."""

    def __init__(self, cfg: SchedulerConfig, kv: KVManager):
        cfg.validate()
        self.cfg = cfg
        self.kv = kv
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # After a KV allocation of S bytes fails, requests needing >= S bytes
        # are not tried again until S bytes have been freed: each failed try
        # runs the allocator's expensive retry path (cudaFree of cached
        # segments, a device synchronize) for nothing. Smaller ones still are.
        self._failed = _Floor()
        # The same for preempted sequences held back by the recompute watermark: those needing >= this
        # are not tried again until this much has been freed. New requests are not held to it.
        self._held = _Floor()
        self.stats = StepStats()
        self._running_estimate = 0  # memory-aware: estimated final bytes of the running batch
        self._running_long = 0
        self._preempted_in_decode = False

    # -- queue ---------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _candidates(self):
        return itertools.islice(self.waiting, ADMISSION_SCAN)

    def _worth_trying(self, seq: Sequence) -> bool:
        need = self.kv.estimate_bytes(seq.num_tokens + 1)
        return need < self._failed.bytes and not (seq.preemptions and need >= self._held.bytes)

    @property
    def admission_blocked(self) -> bool:
        """True while requests wait and none of the first ADMISSION_SCAN could get KV memory.

        An empty queue is not blocked: the next arrival may be admitted at once.
        """
        return bool(self.waiting) and not any(self._worth_trying(s) for s in self._candidates())

    def _freed(self, nbytes: int) -> None:
        self._failed.release(nbytes)
        self._held.release(nbytes)

    def can_admit(self) -> bool:
        """True when a prefill step could start now."""
        if self._preempted_in_decode and not self.cfg.admit_while_preempting and self.running:
            return False
        return bool(self.waiting) and len(self.running) < self.cfg.max_num_seqs and not self.admission_blocked

    def retry_admission(self) -> None:
        """Forget past allocation failures: the next prefill tries every waiting sequence again.

        For an engine with nothing running: no free will come to lift the floor.
        """
        self._failed.clear()
        self._held.clear()

    # -- prefill ---------------------------------------------------------------
    def schedule_prefill(self, now: float) -> list[Sequence]:
        """Admit waiting sequences into one prefill step; [] when none can be admitted.

        When the sequence at the head cannot get KV memory, up to
        ``admission_lookahead`` allocation attempts are made behind it, so one
        large recompute does not block every short request behind it; those
        known not to fit are passed over without an attempt (up to
        ADMISSION_SCAN in all).
        """
        batch: list[Sequence] = []
        tokens = 0
        skipped: list[Sequence] = []
        attempts_failed = 0
        self.kv.now = now
        while self.waiting and len(self.running) + len(batch) < self.cfg.max_num_seqs \
                and attempts_failed <= self.cfg.admission_lookahead and len(skipped) < ADMISSION_SCAN:
            seq = self.waiting[0]
            n = seq.num_tokens
            if batch and tokens + n > self.cfg.max_num_batched_tokens:
                break
            if self.cfg.batching == "memory-aware" and not self._fits_estimate(seq):
                break
            if not self._worth_trying(seq):
                if self.cfg.admission_lookahead == 0:
                    break  # strictly first come, first served: nothing passes a head that does not fit
                skipped.append(self.waiting.popleft())
                continue
            if seq.preemptions and self._below_watermark(n + 1):
                # Not an allocation failure (nothing was asked of the allocator): like one, this and any
                # preempted sequence as large are tried again once that much memory has been freed.
                self._held.hold(self.kv.estimate_bytes(n + 1))
                skipped.append(self.waiting.popleft())
                attempts_failed += 1
                continue
            seq.cached_tokens = 0  # the KV manager says what its caches hold at this admission
            failed = self.kv.allocate(seq, n + 1)
            if failed is not None:
                self._note_failure(failed)
                self._failed.hold(failed)
                skipped.append(self.waiting.popleft())
                attempts_failed += 1
                continue
            self.waiting.popleft()
            if not seq.preemptions and seq.reused_tokens:
                # At least the last prompt token is computed: its logits sample the first output token.
                seq.cached_tokens = max(seq.cached_tokens, min(seq.reused_tokens, seq.prompt_tokens - 1))
            if seq.first_scheduled_s is None:
                seq.first_scheduled_s = now
            if seq.preemptions:
                self.stats.recomputed_tokens += n - seq.cached_tokens
            seq.status = Status.RUNNING
            seq.admitted_s = now
            self._track(seq, +1)
            batch.append(seq)
            tokens += n
        self.waiting.extendleft(reversed(skipped))  # they keep their places at the head
        self.running.extend(batch)
        return batch

    def _below_watermark(self, tokens: int) -> bool:
        """True when a sequence of ``tokens`` re-admitted now would leave less KV memory free than the
        recompute watermark."""
        w = self.cfg.recompute_watermark_bytes
        return bool(w) and self.kv.capacity_bytes - self.kv.reserved_bytes - self.kv.estimate_bytes(tokens) < w

    def _estimate(self, seq: Sequence) -> int:
        return self.kv.estimate_bytes(seq.estimated_final_tokens)

    def _is_long(self, seq: Sequence) -> bool:
        return seq.estimated_final_tokens >= self.cfg.long_seq_tokens

    def _fits_estimate(self, seq: Sequence) -> bool:
        if self._is_long(seq) and self._running_long >= self.cfg.max_long_seqs:
            return False
        budget = self.cfg.memory_watermark * self.kv.capacity_bytes
        return self._running_estimate + self._estimate(seq) <= budget or not self.running

    def _track(self, seq: Sequence, sign: int) -> None:
        if self.cfg.batching == "memory-aware":
            self._running_estimate += sign * self._estimate(seq)
            self._running_long += sign * int(self._is_long(seq))

    # -- decode ----------------------------------------------------------------
    def prepare_decode(self, now: float) -> list[Sequence]:
        """Make room for one more token of every running sequence; returns the decode batch."""
        self.kv.now = now
        evictions = self.stats.evictions
        for seq in list(self.running):
            if seq.status is not Status.RUNNING:
                continue  # evicted earlier in this loop
            self._make_room(seq, seq.num_tokens + 1)
        self._preempted_in_decode = self.stats.evictions > evictions
        return self.running

    def _make_room(self, seq: Sequence, tokens: int) -> bool:
        while True:
            failed = self.kv.grow(seq, tokens)
            if failed is None:
                return True
            self._note_failure(failed)
            victim = self._victim(seq)
            self.preempt(victim or seq)
            if victim is None:
                return False

    def _victim(self, needy: Sequence) -> Sequence | None:
        others = [s for s in self.running if s is not needy]
        if self.cfg.policy == "priority":
            others = [s for s in others if s.tier >= needy.tier]
            if not others:
                return None
            return min(others, key=lambda s: (-s.tier, s.admitted_s, s.seq_id))
        if self.cfg.policy == "self":
            return None
        if self.cfg.policy == "newest":
            last = self.running[-1]  # admission order: preempted sequences rejoin at the end
            return None if last is needy else last
        if not others:
            return None
        return min(others, key=lambda s: (s.admitted_s, s.seq_id))

    def _note_failure(self, failed_bytes: int) -> None:
        self.stats.alloc_failures += 1
        self.stats.largest_failed_bytes = max(self.stats.largest_failed_bytes, failed_bytes)

    def preempt(self, seq: Sequence) -> None:
        """Evict a running sequence's KV and put it back at the head of the queue (recompute later)."""
        self._freed(self.kv.free(seq))
        self.running.remove(seq)
        self._track(seq, -1)
        seq.status = Status.WAITING
        if self.cfg.requeue == "fifo":
            # Behind the preempted sequences already at the head: each went in at the head, and
            # admission puts those it passed over back at the head in their order.
            at = next((i for i, q in enumerate(self.waiting) if not q.preemptions), len(self.waiting))
            self.waiting.insert(at, seq)
        else:
            self.waiting.appendleft(seq)
        seq.preemptions += 1
        self.stats.evictions += 1

    # -- completion --------------------------------------------------------------
    def finish(self, seq: Sequence, now: float) -> None:
        """A sequence produced its last token: release its KV."""
        self.kv.now = now
        self._freed(self.kv.free(seq))
        self.running.remove(seq)
        self._track(seq, -1)
        seq.status = Status.FINISHED
        seq.finish_s = now

    def abort(self, seq: Sequence, now: float) -> None:
        """Drop a waiting or running sequence whose client went away; its KV is released, no result is kept."""
        if seq.status is Status.RUNNING:
            self.kv.now = now
            self._freed(self.kv.free(seq))
            self.running.remove(seq)
            self._track(seq, -1)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        seq.status = Status.ABORTED
