"""Paged KV with prefix caching: full blocks shared by a hash of the token prefix, kept after use.

As vLLM's automatic prefix caching: a full block of ``block_size`` tokens is
named by a chained hash (the previous block's hash and the tokens in this
block), so two requests whose prompts start with the same tokens name the
same blocks. At admission the longest run of cached blocks at the head of a
prompt is reused (at least one token is always computed: the last one's
logits are needed) and only the rest is prefilled. A block's refcount is the
number of running requests that use it.

A request's full prompt blocks enter the cache when it is admitted (a second
request with the same prefix shares them at once); its full output blocks
enter when it finishes, so the next turn of a conversation, whose prompt
holds the previous answer, finds them. A cached block nobody uses
(refcount 0) still holds its KV and counts as free: it is evicted only when
a block is needed and no empty one is left, by the ``cache_policy``:

- ``lru``: the block used longest ago goes first (vLLM's free-block queue);
  among blocks used at the same moment, the one deepest in its sequence, so
  a prefix loses its tail before its head;
- ``lfu-decay``: each use adds 1 to a score that halves every
  ``cache_half_life_s``; the lowest decayed score goes first (ties as LRU).
  A prefix that many requests came back to (a conversation's early turns, a
  shared system prompt) outlives a burst of one-off prompts that LRU would
  keep instead. An evicted block's score is remembered with its hash, so
  content that comes back after an eviction starts from what it had earned
  (as TinyLFU keeps counts of items the cache no longer holds).

Token content comes from ``Sequence.content`` ((segment id, tokens) pieces:
equal pieces are equal tokens) and ``Sequence.output_segment``; a sequence
without them shares nothing. Evicted block hashes are remembered for a while
(``GHOST_BLOCKS_PER_BLOCK`` times the pool) so that a miss on a block that
had been cached is counted as a recompute of an evicted prefix.

A re-admitted sequence (evicted while running, or a client's retry) finds
its own blocks again if they are still cached.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import OrderedDict
from dataclasses import dataclass

from gpudiag.catalog import M
from gpudiag.reference_engine.core.kv_manager import PagedKV
from gpudiag.reference_engine.core.sequence import Sequence

# Remember this many evicted hashes per pool block: enough to recognise a prefix that
# comes back after the cache turned over a few times, bounded so a long run stays small.
GHOST_BLOCKS_PER_BLOCK = 4


@dataclass(eq=False)
class _Block:
    """A cached block: the hash naming its content, who uses it, and how it has been used."""

    key: int
    depth: int  # block index within the sequence that made it
    refcount: int = 0
    last_used: float = 0.0
    score: float = 0.0  # lfu-decay: decayed use count as of ``stamp``
    stamp: float = 0.0
    version: int = 0  # bumped whenever its eviction entry goes stale


def block_keys(content: tuple[tuple[int, int], ...], n_blocks: int, block_size: int) -> list[int]:
    """Chained hashes of the first ``n_blocks`` full blocks of a token stream given as (segment, tokens) pieces."""
    keys: list[int] = []
    h = 0
    piece, off = 0, 0
    for _ in range(n_blocks):
        need = block_size
        desc = []
        while need:
            seg, length = content[piece]
            take = min(need, length - off)
            desc.append((seg, off, off + take))
            need -= take
            off += take
            if off == length:
                piece, off = piece + 1, 0
        h = hash((h, tuple(desc)))
        keys.append(h)
    return keys


def token_stream(seq: Sequence, tokens: int) -> tuple[tuple[int, int], ...]:
    """The (segment, tokens) pieces of the sequence's first ``tokens`` tokens: prompt, then output."""
    prompt = seq.content if seq.content is not None else ((-2 * seq.seq_id - 2, seq.prompt_tokens),)
    out = seq.output_segment if seq.output_segment is not None else -2 * seq.seq_id - 1
    extra = tokens - seq.prompt_tokens
    return prompt + ((out, extra),) if extra > 0 else prompt


class PrefixCachingKV(PagedKV):
    """The paged pool with a prefix cache; ``free_blocks`` counts empty and evictable cached blocks."""

    def __init__(self, allocator, bytes_per_token, capacity_bytes, cfg):
        super().__init__(allocator, bytes_per_token, capacity_bytes, cfg)
        self._empty = self.free_blocks  # blocks holding no content
        self._cache: dict[int, _Block] = {}
        self._heap: list[tuple[float, int, int, int, int]] = []  # (priority, -depth, order, version, key)
        self._order = itertools.count()
        self._evictable = 0
        self._ghosts: OrderedDict[int, tuple[float, float]] = OrderedDict()  # evicted key -> (score, stamp)
        self._ghost_cap = GHOST_BLOCKS_PER_BLOCK * self.num_blocks
        self._lfu = cfg.cache_policy == "lfu-decay"
        self._tau = cfg.cache_half_life_s / math.log(2.0)
        self._shared_refs = 0  # sum over cached blocks of (refcount - 1): block uses beyond the first
        self.queries_tokens = 0
        self.hit_tokens = 0
        self.evicted_blocks = 0
        self.recomputed_tokens = 0  # prompt tokens prefilled again after their cached block was evicted

    # -- the cache ------------------------------------------------------------------
    def _priority(self, b: _Block) -> float:
        # Decayed scores compare the same at any instant: score * 2^-(now - stamp)/half-life
        # orders as log(score) + stamp / tau, which does not move with time.
        if self._lfu:
            return math.log(b.score) + b.stamp / self._tau
        return b.last_used

    def _touch(self, b: _Block) -> None:
        """A request starts using the block."""
        now = self.now
        if self._lfu:
            b.score = b.score * math.exp(-(now - b.stamp) / self._tau) + 1.0 if b.score else 1.0
            b.stamp = now
        b.last_used = now

    def _ref(self, b: _Block) -> None:
        if b.refcount == 0:
            self._evictable -= 1
            self.free_blocks -= 1
            self.reserved_bytes += self.block_bytes
            b.version += 1
        else:
            self._shared_refs += 1
        b.refcount += 1
        self._touch(b)

    def _unref(self, b: _Block) -> bool:
        """One user fewer; True when the block became evictable."""
        b.refcount -= 1
        b.last_used = self.now
        if b.refcount > 0:
            self._shared_refs -= 1
            return False
        self._make_evictable(b)
        self.reserved_bytes -= self.block_bytes
        return True

    def _make_evictable(self, b: _Block) -> None:
        self._evictable += 1
        self.free_blocks += 1
        b.version += 1
        heapq.heappush(self._heap, (self._priority(b), -b.depth, next(self._order), b.version, b.key))

    def _register(self, b: _Block) -> None:
        """Put a block (already touched by its first user) in the cache."""
        self._cache[b.key] = b
        ghost = self._ghosts.pop(b.key, None)  # cached again: a later miss on it is no longer the cache's doing
        if ghost is not None and self._lfu:
            # Its uses before the eviction still count (decayed), as TinyLFU's frequency sketch
            # remembers items the cache no longer holds: content that keeps coming back earns its
            # place even when it was evicted once.
            score, stamp = ghost
            b.score += score * math.exp(-(b.stamp - stamp) / self._tau)

    def _take(self, n: int) -> None:
        """Hand out ``n`` blocks: empty ones first, then evict cached ones by policy."""
        from_empty = min(n, self._empty)
        self._empty -= from_empty
        self.free_blocks -= n
        for _ in range(n - from_empty):
            while True:
                _, _, _, version, key = heapq.heappop(self._heap)
                b = self._cache.get(key)
                if b is not None and b.refcount == 0 and b.version == version:
                    break
            del self._cache[key]
            self._evictable -= 1
            self.evicted_blocks += 1
            self._ghosts[key] = (b.score, b.stamp)
            if len(self._ghosts) > self._ghost_cap:
                self._ghosts.popitem(last=False)

    # -- the manager's interface -------------------------------------------------------
    def estimate_bytes(self, tokens):
        return self._blocks_for(tokens) * self.block_bytes

    def allocate(self, seq, tokens):
        bs = self.cfg.block_size
        known = seq.num_tokens  # tokens whose content is known; ``tokens`` adds the slot for the next one
        keys = block_keys(token_stream(seq, known), known // bs, bs)
        hits: list[_Block] = []
        for key in keys[: (known - 1) // bs]:
            b = self._cache.get(key)
            if b is None:
                break
            hits.append(b)
        need = self._blocks_for(tokens)
        new = need - len(hits)
        reviving = sum(1 for b in hits if b.refcount == 0)  # evictable now, so not available for the new ones
        if new > self.free_blocks - reviving:
            return new * self.block_bytes
        for b in hits:
            self._ref(b)
        self._take(new)
        table: list[int | None] = [b.key for b in hits] + [None] * new
        for i in range(len(hits), len(keys)):
            key = keys[i]
            if key in self._ghosts:
                self.recomputed_tokens += bs
            if key not in self._cache:
                b = _Block(key, i, refcount=1)
                self._touch(b)
                self._register(b)
                table[i] = key
        self.queries_tokens += known
        self.hit_tokens += len(hits) * bs
        seq.cached_tokens = len(hits) * bs
        seq.kv = [need, tokens, table]
        self.reserved_bytes += new * self.block_bytes
        self.live_tokens += tokens
        return None

    def grow(self, seq, tokens):
        held, stored = seq.kv[0], seq.kv[1]
        # The next step writes one token after those stored; a sequence re-admitted after an
        # eviction stores one slot more than its token count, so ``tokens`` alone can fall short.
        need = self._blocks_for(max(tokens, stored + 1)) - held
        if need > self.free_blocks:
            return need * self.block_bytes
        if need > 0:
            self._take(need)
            self.reserved_bytes += need * self.block_bytes
            seq.kv[0] = held + need
            seq.kv[2].extend([None] * need)
        return None

    def advance(self, seqs, k):
        bs = self.cfg.block_size
        for s in seqs:
            held, stored, table = s.kv
            need = max(0, -(-(stored + k) // bs) - held)
            if need:
                self._take(need)
                self.reserved_bytes += need * self.block_bytes
                table.extend([None] * need)
            s.kv[0] = held + need
            s.kv[1] = stored + k
        self.live_tokens += k * len(seqs)

    def free(self, seq):
        held, stored, table = seq.kv
        bs = self.cfg.block_size
        known = min(stored, seq.num_tokens)
        keys = block_keys(token_stream(seq, known), known // bs, bs)
        released = 0
        for i, key in enumerate(table):
            if key is not None:
                released += self._unref(self._cache[key])
                continue
            self.reserved_bytes -= self.block_bytes
            released += 1
            if i < len(keys) and keys[i] not in self._cache:
                # A full output block (or a prompt block whose hash was taken): keep it cached.
                b = _Block(keys[i], i)
                self._touch(b)
                self._register(b)
                self._make_evictable(b)
            else:
                self._empty += 1
                self.free_blocks += 1
        self.live_tokens -= stored
        seq.kv = None
        return released * self.block_bytes

    # -- what it reports ----------------------------------------------------------------
    @property
    def used_bytes(self) -> int:
        """Bytes holding the running requests' tokens, a shared block counted once."""
        return (self.live_tokens - self._shared_refs * self.cfg.block_size) * self.bytes_per_token

    @property
    def logical_bytes(self) -> int:
        """Bytes the running requests address, a shared block counted once per request that uses it."""
        return self.live_tokens * self.bytes_per_token

    @property
    def cached_blocks(self) -> int:
        """Blocks in the cache, in use or not."""
        return len(self._cache)

    def cache_metrics(self) -> dict[str, float]:
        """Prefix-cache columns of the engine row (vLLM's query/hit counters in tokens, and gpudiag's own)."""
        return {
            M.prefix_cache_queries_total: self.queries_tokens,
            M.prefix_cache_hits_total: self.hit_tokens,
            M.engine_prefix_cache_evictions_total: self.evicted_blocks,
            M.engine_prefix_cache_recomputed_tokens_total: self.recomputed_tokens,
            M.engine_kv_logical_bytes: self.logical_bytes,
        }
