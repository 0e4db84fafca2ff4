"""KV-cache managers: how a request's keys and values get device memory.

Every manager allocates through the device's caching allocator, so the
memory behaviour (holes, retries, OOMs) is the allocator's, not scripted.

- ``contiguous``: one region per request, grown by realloc+copy (a new,
  larger region is allocated while the old one is still held, the KV copied,
  the old one freed). The strategy of SCENARIOS.md §1.
- ``chunked``: fixed-size chunks appended as the request grows; no
  contiguity, so every hole is exactly one chunk and reusable.
- ``paged``: one pool allocated at start, cut into blocks of ``block_size``
  tokens; requests hold block tables (vLLM's PagedAttention layout).
- ``reserve-max``: a region for the longest possible request at admission.

A manager's methods return ``None`` on success and the failed request's size
in bytes when device memory could not be had.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

from gpudiag.catalog import M
from gpudiag.errors import GpudiagError
from gpudiag.reference_engine.core.allocator import CachingAllocator, OutOfMemory
from gpudiag.reference_engine.core.sequence import Sequence
from gpudiag.units import fmt_bytes

MIB = 1024**2
UNBOUNDED = 1 << 30  # steps: "no allocation needed in any horizon we look at"


@dataclass
class KVConfig:
    """How KV memory is managed; one dataclass for every strategy."""

    strategy: str = "paged"  # contiguous | chunked | paged | reserve-max
    initial_bytes: int = 256 * MIB  # contiguous: first region
    growth_factor: float = 2.0  # contiguous: each realloc multiplies the region by this
    chunk_bytes: int = 256 * MIB  # chunked
    block_size: int = 16  # paged: tokens per block
    max_model_len: int = 8192  # reserve-max: tokens reserved per request
    # paged: keep full blocks of finished prompts and outputs, found again by a hash of the
    # token prefix (vLLM's automatic prefix caching); see prefix_cache.py.
    prefix_caching: bool = False
    cache_policy: str = "lru"  # which cached-but-unused block goes first: lru | lfu-decay
    cache_half_life_s: float = 600.0  # lfu-decay: an access counts half after this long
    # paged: a host KV tier of this many bytes (vLLM's --kv-offloading-size, native CPU backend). Full
    # blocks of every request leaving the GPU, finished or preempted, are kept there, least recently
    # used first out; a preempted request re-admitted loads what it finds there over the host link
    # instead of recomputing it. 0: no tier.
    offload_bytes: int = 0

    def validate(self) -> None:
        """Raise GpudiagError on values no engine could run with."""
        if self.strategy not in STRATEGIES:
            raise GpudiagError(f"unknown KV strategy {self.strategy!r}; valid: {', '.join(STRATEGIES)}")
        if self.block_size <= 0:
            raise GpudiagError(f"block size must be a positive number of tokens, got {self.block_size}")
        if self.initial_bytes <= 0 or self.chunk_bytes <= 0:
            raise GpudiagError("KV region and chunk sizes must be positive")
        if self.growth_factor <= 1.0:
            raise GpudiagError(f"growth factor must be > 1, got {self.growth_factor}")
        if self.max_model_len <= 0:
            raise GpudiagError("max_model_len must be positive")
        if self.prefix_caching and self.strategy != "paged":
            raise GpudiagError("prefix caching needs the paged KV strategy (blocks shared by hash)")
        if self.cache_policy not in CACHE_POLICIES:
            raise GpudiagError(f"unknown prefix-cache policy {self.cache_policy!r}; valid: {', '.join(CACHE_POLICIES)}")
        if not self.cache_half_life_s > 0:
            raise GpudiagError(f"cache half-life must be positive, got {self.cache_half_life_s}")
        if self.offload_bytes < 0:
            raise GpudiagError(f"the host KV tier cannot be negative, got {self.offload_bytes} bytes")
        if self.offload_bytes and (self.strategy != "paged" or self.prefix_caching):
            raise GpudiagError("a host KV tier is simulated for the paged strategy without prefix caching "
                               "(it stores blocks, and the prefix cache would have to share its hashes)")


class KVManager:
    """Common bookkeeping: live tokens, bytes handed to requests, realloc copies."""

    name = "base"
    now = 0.0  # the engine's time, set by the scheduler before each call (for cache policies)

    def __init__(self, allocator: CachingAllocator, bytes_per_token: int, capacity_bytes: int, cfg: KVConfig):
        self.allocator = allocator
        self.bytes_per_token = bytes_per_token
        self.capacity_bytes = capacity_bytes
        self.cfg = cfg
        self.reserved_bytes = 0  # bytes held for requests (live tokens + slack)
        self.live_tokens = 0  # tokens whose KV is stored
        self.copy_bytes_total = 0  # bytes moved by realloc copies
        self.host_loaded_bytes = 0  # KV loaded from a host tier since the engine last took it

    # -- helpers -------------------------------------------------------
    def _malloc(self, nbytes: int) -> int | None:
        try:
            return self.allocator.malloc(nbytes)
        except OutOfMemory:
            return None

    @property
    def used_bytes(self) -> int:
        """Bytes holding tokens."""
        return self.live_tokens * self.bytes_per_token

    @property
    def usage_ratio(self) -> float:
        """Fraction of the KV capacity handed to requests (vLLM's kv_cache_usage_perc)."""
        return min(1.0, self.reserved_bytes / self.capacity_bytes) if self.capacity_bytes else 0.0

    # -- interface ---------------------------------------------------------
    def estimate_bytes(self, tokens: int) -> int:
        """Bytes the manager would hand a request of ``tokens`` tokens."""
        return tokens * self.bytes_per_token

    def allocate(self, seq: Sequence, tokens: int) -> int | None:
        """Give a newly scheduled sequence room for ``tokens`` tokens."""
        raise NotImplementedError

    def grow(self, seq: Sequence, tokens: int) -> int | None:
        """Make room for the sequence to hold ``tokens`` tokens (may reallocate); stores nothing.

        Tokens are counted as stored by ``advance``, as the decode step writes them.
        """
        raise NotImplementedError

    def steps_without_alloc(self, seqs: list[Sequence], limit: int = UNBOUNDED) -> int:
        """How many decode steps (at most ``limit``) every sequence can take before one needs an allocation."""
        raise NotImplementedError

    def advance(self, seqs: list[Sequence], k: int) -> None:
        """Record that each sequence appended ``k`` tokens (within steps_without_alloc)."""
        self.live_tokens += k * len(seqs)

    def free(self, seq: Sequence) -> int:
        """Release everything the sequence holds; returns the bytes released."""
        raise NotImplementedError

    def cache_metrics(self) -> dict[str, float]:
        """Prefix-cache columns of the engine row (none without a prefix cache)."""
        return {}

    def take_host_loaded_bytes(self) -> int:
        """Bytes loaded from the host tier since the last call (what the next step waits for)."""
        n, self.host_loaded_bytes = self.host_loaded_bytes, 0
        return n


class _Region:
    __slots__ = ("addrs", "capacity_tokens", "nbytes", "tokens")

    def __init__(self):
        self.addrs: list[int] = []
        self.capacity_tokens = 0
        self.nbytes = 0
        self.tokens = 0


class ContiguousKV(KVManager):
    """One region per request, grown by realloc+copy."""

    name = "contiguous"

    def _size_for(self, tokens: int, current: int = 0) -> int:
        need = tokens * self.bytes_per_token
        size = current or self.cfg.initial_bytes
        while size < need:
            size = int(size * self.cfg.growth_factor)
        return size

    def allocate(self, seq, tokens):
        size = self._size_for(tokens)
        addr = self._malloc(size)
        if addr is None:
            return size
        r = _Region()
        r.addrs, r.nbytes, r.capacity_tokens, r.tokens = [addr], size, size // self.bytes_per_token, tokens
        seq.kv = r
        self.reserved_bytes += size
        self.live_tokens += tokens
        return None

    def grow(self, seq, tokens):
        r: _Region = seq.kv
        if tokens <= r.capacity_tokens:
            return None
        size = self._size_for(tokens, r.nbytes)
        addr = self._malloc(size)  # the old region is still held: realloc needs both
        if addr is None:
            return size
        self.copy_bytes_total += r.tokens * self.bytes_per_token
        self.allocator.free(r.addrs[0])
        self.reserved_bytes += size - r.nbytes
        r.addrs, r.nbytes, r.capacity_tokens = [addr], size, size // self.bytes_per_token
        return None

    def estimate_bytes(self, tokens):
        return self._size_for(tokens)

    def steps_without_alloc(self, seqs, limit=UNBOUNDED):
        return min(limit, min((s.kv.capacity_tokens - s.kv.tokens for s in seqs), default=UNBOUNDED))

    def advance(self, seqs, k):
        for s in seqs:
            s.kv.tokens += k
        super().advance(seqs, k)

    def free(self, seq):
        r: _Region = seq.kv
        for a in r.addrs:
            self.allocator.free(a)
        self.reserved_bytes -= r.nbytes
        self.live_tokens -= r.tokens
        seq.kv = None
        return r.nbytes


class ReserveMaxKV(ContiguousKV):
    """A region for max_model_len tokens at admission; never grows."""

    name = "reserve-max"

    def _size_for(self, tokens, current=0):
        return max(tokens, self.cfg.max_model_len) * self.bytes_per_token


class ChunkedKV(ContiguousKV):
    """Fixed-size chunks appended as the request grows; no contiguity needed."""

    name = "chunked"

    def _chunks_for(self, tokens: int) -> int:
        return max(1, math.ceil(tokens * self.bytes_per_token / self.cfg.chunk_bytes))

    def estimate_bytes(self, tokens):
        return self._chunks_for(tokens) * self.cfg.chunk_bytes

    def allocate(self, seq, tokens):
        r = _Region()
        seq.kv = r
        failed = self._add_chunks(r, self._chunks_for(tokens))
        if failed is not None:
            self.free(seq)
            return failed
        r.tokens = tokens
        self.live_tokens += tokens
        return None

    def _add_chunks(self, r: _Region, n: int) -> int | None:
        per_chunk_tokens = self.cfg.chunk_bytes // self.bytes_per_token
        while len(r.addrs) < n:
            addr = self._malloc(self.cfg.chunk_bytes)
            if addr is None:
                return self.cfg.chunk_bytes
            r.addrs.append(addr)
            r.nbytes += self.cfg.chunk_bytes
            r.capacity_tokens += per_chunk_tokens
            self.reserved_bytes += self.cfg.chunk_bytes
        return None

    def grow(self, seq, tokens):
        r: _Region = seq.kv
        if tokens > r.capacity_tokens:
            return self._add_chunks(r, self._chunks_for(tokens))
        return None


class PagedKV(KVManager):
    """vLLM-style paged KV: one preallocated pool of fixed-size blocks, block tables per request."""

    name = "paged"

    def __init__(self, allocator, bytes_per_token, capacity_bytes, cfg):
        super().__init__(allocator, bytes_per_token, capacity_bytes, cfg)
        self.block_bytes = cfg.block_size * bytes_per_token
        self.num_blocks = capacity_bytes // self.block_bytes
        if self.num_blocks == 0 and capacity_bytes < bytes_per_token:
            raise GpudiagError("the KV pool cannot hold a single block: no device memory left after the weights")
        if self.num_blocks == 0:
            # The device has room for KV, just not for one block this large.
            raise GpudiagError(f"block size {cfg.block_size} tokens is too large: one block takes "
                               f"{fmt_bytes(self.block_bytes)} and the KV pool has {fmt_bytes(capacity_bytes)} "
                               f"after the weights; at most {capacity_bytes // bytes_per_token:,} tokens per block "
                               f"fit here")
        self.pool_addr = allocator.malloc(self.num_blocks * self.block_bytes)
        self.free_blocks = self.num_blocks
        self.capacity_bytes = self.num_blocks * self.block_bytes
        # The host tier: per request, the full blocks held there, least recently used first.
        self.host_capacity_blocks = cfg.offload_bytes // self.block_bytes
        self._host: OrderedDict[int, int] = OrderedDict()
        self._host_blocks = 0  # sum of self._host's values
        self.external_queries_tokens = 0  # tokens looked up in the host tier (vLLM's connector counters)
        self.external_hits_tokens = 0

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.cfg.block_size)

    def estimate_bytes(self, tokens):
        return self._blocks_for(tokens) * self.block_bytes

    def allocate(self, seq, tokens):
        need = self._blocks_for(tokens)
        if need > self.free_blocks:
            return need * self.block_bytes
        self.free_blocks -= need
        seq.kv = [need, tokens]  # [blocks held, tokens stored]
        self.reserved_bytes += need * self.block_bytes
        self.live_tokens += tokens
        if self.host_capacity_blocks:
            self._load_from_host(seq)
        return None

    def _load_from_host(self, seq) -> None:
        """What the host tier holds of the sequence is loaded, not computed: its ``cached_tokens``.

        Only full blocks were stored, and the last token is always computed (its logits sample the next
        one): vLLM's lookup stops at ``num_tokens - 1``.
        """
        self.external_queries_tokens += seq.num_tokens
        bs = self.cfg.block_size
        hit = min(self._host.get(seq.seq_id, 0), (seq.num_tokens - 1) // bs) * bs
        if hit > 0:
            self._host.move_to_end(seq.seq_id)
            self.external_hits_tokens += hit
            self.host_loaded_bytes += hit * self.bytes_per_token
        seq.cached_tokens = hit

    def _store_to_host(self, seq_id: int, tokens: int) -> None:
        blocks = tokens // self.cfg.block_size
        self._host_blocks -= self._host.pop(seq_id, 0)
        if blocks == 0 or blocks > self.host_capacity_blocks:
            return
        while self._host_blocks + blocks > self.host_capacity_blocks:
            self._host_blocks -= self._host.popitem(last=False)[1]
        self._host[seq_id] = blocks
        self._host_blocks += blocks

    def cache_metrics(self):
        if not self.host_capacity_blocks:
            return {}
        return {M.external_prefix_cache_queries_total: self.external_queries_tokens,
                M.external_prefix_cache_hits_total: self.external_hits_tokens}

    def grow(self, seq, tokens):
        held = seq.kv[0]
        need = self._blocks_for(tokens) - held
        if need > self.free_blocks:
            return need * self.block_bytes
        if need > 0:
            self.free_blocks -= need
            self.reserved_bytes += need * self.block_bytes
            seq.kv[0] = held + need
        return None

    def _blocks_needed(self, seqs, k: int) -> int:
        bs = self.cfg.block_size
        return sum(max(0, -(-(s.kv[1] + k) // bs) - s.kv[0]) for s in seqs)

    def steps_without_alloc(self, seqs, limit=UNBOUNDED):
        # Blocks come from the pool without touching the allocator; the limit is
        # the pool running dry. Largest k <= limit with blocks_needed(k) <= free.
        if not seqs:
            return limit
        if limit < UNBOUNDED and self._blocks_needed(seqs, limit) <= self.free_blocks:
            return limit  # the common case: one pass, no search
        lo, hi = 0, min(limit, max(1, self.free_blocks * self.cfg.block_size // len(seqs) + self.cfg.block_size))
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._blocks_needed(seqs, mid) <= self.free_blocks:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def advance(self, seqs, k):
        bs = self.cfg.block_size
        for s in seqs:
            held, stored = s.kv
            need = max(0, -(-(stored + k) // bs) - held)
            s.kv[0] = held + need
            s.kv[1] = stored + k
            self.free_blocks -= need
            self.reserved_bytes += need * self.block_bytes
        super().advance(seqs, k)

    def free(self, seq):
        held, stored = seq.kv
        if self.host_capacity_blocks:
            self._store_to_host(seq.seq_id, stored)
        self.free_blocks += held
        self.reserved_bytes -= held * self.block_bytes
        self.live_tokens -= stored
        seq.kv = None
        return held * self.block_bytes


CACHE_POLICIES = ("lru", "lfu-decay")
STRATEGIES = {"contiguous": ContiguousKV, "chunked": ChunkedKV, "paged": PagedKV, "reserve-max": ReserveMaxKV}


def make_kv_manager(cfg: KVConfig, allocator: CachingAllocator, bytes_per_token: int,
                    capacity_bytes: int) -> KVManager:
    """Build the manager ``cfg.strategy`` names."""
    cfg.validate()
    if cfg.prefix_caching:
        from gpudiag.reference_engine.core.prefix_cache import PrefixCachingKV

        return PrefixCachingKV(allocator, bytes_per_token, capacity_bytes, cfg)
    return STRATEGIES[cfg.strategy](allocator, bytes_per_token, capacity_bytes, cfg)
