"""ModelRunner: the engine's steps on real tensors (device ``cpu`` or ``cuda``), or charged to a roofline (``sim``).

The scheduler and the KV managers are the simulated engine's own
(:mod:`.scheduler`, :mod:`.kv_manager`): they decide who runs and how many
bytes each request holds. This module adds what real tensors need:

* storage behind the managers' ``malloc``/``free``. On ``cpu``,
  :class:`HostBackedAllocator` keeps the accounting in the simulated GPU's
  caching-allocator model (so holes, retries and OOMs are the ones ``sim``
  shows) and gives every block a host buffer of the same size. On ``cuda``,
  :class:`TorchCudaAllocator` is the real caching allocator (``torch.empty``
  of bytes), its figures from ``torch.cuda.memory_stats``;
* KV managers holding K/V in those buffers: :class:`PagedTensorKV` (the pool
  is one preallocated tensor, blocks get ids for the block tables),
  :class:`PrefixCachingTensorKV` (the prefix cache's blocks, named by content
  hash, each hash kept on the physical block that holds its K/V while it
  stays cached) and :class:`ContiguousTensorKV` / :class:`ReserveMaxTensorKV`
  (one region per request, grown by allocating the larger region and copying
  the K/V over: the realloc of SCENARIOS.md §1, for real). Chunked KV has no tensor form:
  attention would need its chunks gathered every step;
* :class:`ModelRunner`: packs a batch into the model's paged forward and
  samples greedily. Regions run one sequence at a time (each region is its
  own cache) on the torch path: the realloc strategy is here to reproduce
  the incident, not to be fast.

:class:`SimRunner` is the same interface without tensors: token ids from a
hash, each step charged the cost model's GPU time, paced to the wall clock.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable

import torch

from gpudiag.errors import GpudiagError
from gpudiag.reference_engine.core.allocator import AllocatorStats, CachingAllocator, OutOfMemory
from gpudiag.reference_engine.core.kv_manager import ContiguousKV, KVConfig, KVManager, PagedKV, ReserveMaxKV
from gpudiag.reference_engine.core.prefix_cache import PrefixCachingKV, block_keys, token_stream
from gpudiag.reference_engine.model.model import PagedKVCache
from gpudiag.reference_engine.model.model_config import ModelConfig
from gpudiag.reference_engine.sim.sim_gpu import CostModel, SimGPU

LogitsHook = Callable[[str, list, torch.Tensor], None]


# -- storage behind the KV managers -----------------------------------------------------------

class HostBackedAllocator:
    """Device memory accounted by the simulated GPU's caching allocator, stored in host tensors (device cpu)."""

    def __init__(self, accounting: CachingAllocator):
        self.accounting = accounting
        self._buffers: dict[int, torch.Tensor] = {}

    def malloc(self, size: int) -> int:
        """A block from the allocator model (OutOfMemory as it decides) with a host buffer of ``size`` bytes."""
        addr = self.accounting.malloc(size)
        self._buffers[addr] = torch.empty(size, dtype=torch.uint8)
        return addr

    def free(self, addr: int) -> None:
        """Return the block to the allocator model; the buffer lives on while a view still uses it."""
        self.accounting.free(addr)
        del self._buffers[addr]

    def buffer(self, addr: int) -> torch.Tensor:
        """The bytes of the live block at ``addr``."""
        return self._buffers[addr]

    def stats(self) -> AllocatorStats:
        """The allocator model's figures: the white and grey layers this engine reports."""
        return self.accounting.stats()


class TorchCudaAllocator:
    """The real PyTorch caching allocator behind the KV managers' malloc/free (device cuda)."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self._buffers: dict[int, torch.Tensor] = {}

    def malloc(self, size: int) -> int:
        """``torch.empty(size)`` bytes on the device; OutOfMemory when the caching allocator gives up."""
        try:
            t = torch.empty(size, dtype=torch.uint8, device=self.device)
        except torch.cuda.OutOfMemoryError:
            s = self.stats()
            free, _ = torch.cuda.mem_get_info(self.device)
            raise OutOfMemory(size, s.allocated_bytes, s.reserved_bytes, s.free_reserved_bytes,
                              s.largest_free_block_bytes, free) from None
        self._buffers[t.data_ptr()] = t
        return t.data_ptr()

    def free(self, addr: int) -> None:
        """Drop the tensor: its block goes back to the caching allocator once no view holds it."""
        del self._buffers[addr]

    def buffer(self, addr: int) -> torch.Tensor:
        """The bytes of the live block at ``addr``."""
        return self._buffers[addr]

    def stats(self) -> AllocatorStats:
        """``torch.cuda.memory_stats`` in the allocator model's terms (no largest-free-block: torch has none)."""
        s = torch.cuda.memory_stats(self.device)

        def g(key: str) -> int:
            return int(s.get(key, 0))

        allocated, reserved = g("allocated_bytes.all.current"), g("reserved_bytes.all.current")
        return AllocatorStats(
            allocated_bytes=allocated, requested_bytes=g("requested_bytes.all.current"), reserved_bytes=reserved,
            active_bytes=g("active_bytes.all.current"), inactive_split_bytes=g("inactive_split_bytes.all.current"),
            free_reserved_bytes=reserved - allocated, largest_free_block_bytes=0,
            segment_count=g("segment.all.current"), num_alloc_retries=g("num_alloc_retries"),
            num_ooms=g("num_ooms"), num_device_mallocs=g("num_device_alloc"), num_device_frees=g("num_device_free"),
            device_malloc_bytes=g("reserved_bytes.all.allocated"), device_free_bytes=g("reserved_bytes.all.freed"))


def _typed_view(buf: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    numel = 1
    for n in shape:
        numel *= n
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    return buf[:nbytes].view(dtype).view(shape)


# -- KV managers holding real tensors -------------------------------------------------------

def _pool_cache(kv: PagedKV, model_config: ModelConfig, dtype: torch.dtype) -> PagedKVCache:
    """The paged manager's pool block as the model's KV cache tensor (zeroed: unused rows stay finite)."""
    c = model_config
    shape = (c.num_layers, 2, kv.num_blocks, kv.cfg.block_size, c.num_kv_heads, c.head_dim)
    cache = PagedKVCache(_typed_view(kv.allocator.buffer(kv.pool_addr), dtype, shape))
    cache.storage.zero_()
    return cache


class PagedTensorKV(PagedKV):
    """Paged KV whose pool is one preallocated tensor; each sequence's blocks have ids (its block table).

    The parent counts blocks; this class names them. After every change of a
    sequence's holding the table is brought to the count: new blocks from the
    free list, released ones back to it.
    """

    def __init__(self, allocator, bytes_per_token: int, capacity_bytes: int, cfg: KVConfig,
                 model_config: ModelConfig, dtype: torch.dtype):
        super().__init__(allocator, bytes_per_token, capacity_bytes, cfg)
        self.cache = _pool_cache(self, model_config, dtype)
        self._free_ids = list(range(self.num_blocks - 1, -1, -1))
        self._tables: dict[object, list[int]] = {}

    def _held(self, seq) -> int:
        return seq.kv[0] if seq.kv is not None else 0

    def _sync(self, seq) -> None:
        table = self._tables.setdefault(seq, [])
        held = self._held(seq)
        while len(table) < held:
            table.append(self._free_ids.pop())
        while len(table) > held:
            self._free_ids.append(table.pop())
        if not table:
            del self._tables[seq]

    def allocate(self, seq, tokens):
        failed = super().allocate(seq, tokens)
        if failed is None:
            self._sync(seq)
        return failed

    def grow(self, seq, tokens):
        failed = super().grow(seq, tokens)
        if failed is None:
            self._sync(seq)
        return failed

    def advance(self, seqs, k):
        super().advance(seqs, k)
        for s in seqs:
            self._sync(s)

    def free(self, seq):
        nbytes = super().free(seq)
        self._sync(seq)
        return nbytes

    def block_table(self, seq) -> list[int]:
        """The physical blocks of ``seq``, in token order."""
        return self._tables[seq]


class PrefixCachingTensorKV(PrefixCachingKV):
    """The prefix-caching pool as a real tensor: cached blocks keep their physical block while cached.

    The parent names a sequence's blocks by content hash (shared, cached) or
    leaves them unnamed (its own, filled as it decodes). Here a hash maps to
    the physical block holding that content, an unnamed block to a physical
    block of the sequence's own. When a finished or preempted sequence's full
    block enters the cache, its physical block goes with it. Physical blocks
    of hashes the parent evicted are taken back when the free list runs dry.
    """

    def __init__(self, allocator, bytes_per_token: int, capacity_bytes: int, cfg: KVConfig,
                 model_config: ModelConfig, dtype: torch.dtype):
        super().__init__(allocator, bytes_per_token, capacity_bytes, cfg)
        self.cache = _pool_cache(self, model_config, dtype)
        self._free_ids = list(range(self.num_blocks - 1, -1, -1))
        self._by_key: dict[int, int] = {}  # content hash -> physical block
        self._own: dict[object, dict[int, int]] = {}  # sequence -> {block index: physical block} of unnamed blocks
        self._tables: dict[object, list[int]] = {}

    def _new_id(self) -> int:
        if not self._free_ids:
            for key in [k for k in self._by_key if k not in self._cache]:
                self._free_ids.append(self._by_key.pop(key))
        return self._free_ids.pop()

    def _sync(self, seq) -> None:
        own = self._own.setdefault(seq, {})
        phys = []
        for i, key in enumerate(seq.kv[2]):
            if key is None:
                b = own.get(i)
                if b is None:
                    b = own[i] = self._new_id()
            else:
                b = self._by_key.get(key)
                if b is None:  # named at this admission: the prefill about to run fills it
                    b = self._by_key[key] = self._new_id()
            phys.append(b)
        self._tables[seq] = phys

    def allocate(self, seq, tokens):
        self._own.pop(seq, None)
        failed = super().allocate(seq, tokens)
        if failed is None:
            self._sync(seq)
        return failed

    def grow(self, seq, tokens):
        failed = super().grow(seq, tokens)
        if failed is None:
            self._sync(seq)
        return failed

    def advance(self, seqs, k):
        super().advance(seqs, k)
        for s in seqs:
            self._sync(s)

    def free(self, seq):
        bs = self.cfg.block_size
        known = min(seq.kv[1], seq.num_tokens)
        keys = block_keys(token_stream(seq, known), known // bs, bs)
        own = self._own.pop(seq, {})
        cached_before = {i: keys[i] in self._cache for i in own if i < len(keys)}
        nbytes = super().free(seq)
        for i, b in own.items():
            if i in cached_before and not cached_before[i] and keys[i] in self._cache:
                stale = self._by_key.get(keys[i])  # an evicted copy of the same content: nobody uses it
                if stale is not None:
                    self._free_ids.append(stale)
                self._by_key[keys[i]] = b  # the block stays in the cache, with its content
            else:
                self._free_ids.append(b)
        self._tables.pop(seq, None)
        return nbytes

    def block_table(self, seq) -> list[int]:
        """The physical blocks of ``seq``, in token order."""
        return self._tables[seq]


class ContiguousTensorKV(ContiguousKV):
    """One K/V tensor per request, ``[layers, 2, 1, capacity, kv_heads, head_dim]``, grown by realloc+copy."""

    def __init__(self, allocator, bytes_per_token: int, capacity_bytes: int, cfg: KVConfig,
                 model_config: ModelConfig, dtype: torch.dtype):
        super().__init__(allocator, bytes_per_token, capacity_bytes, cfg)
        self.model_config = model_config
        self.dtype = dtype
        self._regions: dict[object, PagedKVCache] = {}

    def _region(self, seq) -> PagedKVCache:
        c, r = self.model_config, seq.kv
        shape = (c.num_layers, 2, 1, r.capacity_tokens, c.num_kv_heads, c.head_dim)
        return PagedKVCache(_typed_view(self.allocator.buffer(r.addrs[0]), self.dtype, shape))

    def allocate(self, seq, tokens):
        failed = super().allocate(seq, tokens)
        if failed is None:
            self._regions[seq] = self._region(seq)
        return failed

    def grow(self, seq, tokens):
        old = self._regions[seq]
        stored = seq.kv.tokens
        failed = super().grow(seq, tokens)  # frees the old block; ``old`` keeps its bytes alive for the copy
        if failed is None and seq.kv.capacity_tokens != old.block_size:
            new = self._region(seq)
            new.storage[:, :, :, :stored].copy_(old.storage[:, :, :, :stored])
            self._regions[seq] = new
        return failed

    def free(self, seq):
        self._regions.pop(seq, None)
        return super().free(seq)

    def region_cache(self, seq) -> PagedKVCache:
        """The sequence's region as a one-block paged cache (block table ``[0]``)."""
        return self._regions[seq]


class ReserveMaxTensorKV(ContiguousTensorKV):
    """A region for max_model_len tokens at admission, as real tensors; never grows."""

    name = "reserve-max"
    _size_for = ReserveMaxKV._size_for


TENSOR_STRATEGIES = {"paged": PagedTensorKV, "contiguous": ContiguousTensorKV, "reserve-max": ReserveMaxTensorKV}


def make_tensor_kv_manager(cfg: KVConfig, allocator, capacity_bytes: int, model_config: ModelConfig,
                           dtype: torch.dtype) -> KVManager:
    """The KV manager ``cfg.strategy`` names, holding real K/V in ``allocator``'s buffers."""
    cfg.validate()
    cls = PrefixCachingTensorKV if cfg.prefix_caching else TENSOR_STRATEGIES.get(cfg.strategy)
    if cls is None:
        raise GpudiagError(f"KV strategy {cfg.strategy!r} runs on the sim device only; on cpu/cuda use one of "
                           f"{', '.join(TENSOR_STRATEGIES)}")
    return cls(allocator, model_config.kv_bytes_per_token(), capacity_bytes, cfg, model_config, dtype)


# -- runners ----------------------------------------------------------------------------------

def cached_tokens(kv: KVManager, seq) -> int:
    """Tokens of ``seq`` whose K/V is already in the cache when its prefill starts (a prefix-cache hit)."""
    return seq.cached_tokens if isinstance(kv, PrefixCachingKV) else 0


class ModelRunner:
    """Prefill and decode steps of the scheduler's batches through the model; greedy sampling.

    A sequence gives ``token_ids`` (prompt then output so far). Prefill
    computes the tokens not yet cached (all of them, or those after a
    prefix-cache hit; a recompute after preemption is a prefill of prompt and
    output) and samples the next token; decode feeds each sequence's last
    token. ``on_logits(kind, seqs, logits)`` sees every step's float32 logits.
    """

    def __init__(self, model, kv: KVManager, backend: str = "auto", on_logits: LogitsHook | None = None):
        self.model = model
        self.kv = kv
        self.backend = backend
        self.device = model.device
        self.on_logits = on_logits

    def prefill(self, seqs: list) -> list[int]:
        """Compute the uncached tokens of every sequence; the next token of each."""
        if hasattr(self.kv, "block_table"):
            logits = self._paged(seqs, prefill=True)
        else:
            logits = torch.cat([self._region(s, prefill=True) for s in seqs])
        return self._sample("prefill", seqs, logits)

    def decode(self, seqs: list) -> list[int]:
        """One token per sequence (its last) through the model; the next token of each."""
        if hasattr(self.kv, "block_table"):
            logits = self._paged(seqs, prefill=False)
        else:
            logits = torch.cat([self._region(s, prefill=False) for s in seqs])
        return self._sample("decode", seqs, logits)

    def prefill_token_count(self, seqs: list) -> int:
        """Tokens a prefill of ``seqs`` computes."""
        return sum(len(s.token_ids) - cached_tokens(self.kv, s) for s in seqs)

    def _sample(self, kind: str, seqs: list, logits: torch.Tensor) -> list[int]:
        if self.on_logits is not None:
            self.on_logits(kind, seqs, logits)
        return logits.argmax(-1).tolist()

    def _tensor(self, values, dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

    def _paged(self, seqs: list, prefill: bool) -> torch.Tensor:
        bs = self.kv.cfg.block_size
        tables = [self.kv.block_table(s) for s in seqs]
        width = max(map(len, tables))
        bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64)
        lens = [len(s.token_ids) for s in seqs]
        if prefill:
            starts = [cached_tokens(self.kv, s) for s in seqs]
            ids = [t for s, a in zip(seqs, starts) for t in s.token_ids[a:]]
            pos = torch.cat([torch.arange(a, n) for a, n in zip(starts, lens)])
            row = torch.repeat_interleave(torch.arange(len(seqs)), torch.tensor([n - a for a, n in zip(starts, lens)]))
            cu = [0]
            for a, n in zip(starts, lens):
                cu.append(cu[-1] + n - a)
        else:
            ids = [s.token_ids[-1] for s in seqs]
            pos = torch.tensor([n - 1 for n in lens])
            row = torch.arange(len(seqs))
        slots = bt[row, pos // bs] * bs + pos % bs
        dev = self.device
        return self.model.forward_paged(
            self._tensor(ids, torch.int64), pos.to(dev), self.kv.cache, bt.to(torch.int32).to(dev),
            self._tensor(lens, torch.int32), slots.to(dev), prefill,
            cu_seqlens_q=self._tensor(cu, torch.int32) if prefill else None,
            max_query_len=max(b - a for a, b in zip(cu, cu[1:])) if prefill else None,
            max_context_len=max(lens), backend=self.backend)

    def _region(self, seq, prefill: bool) -> torch.Tensor:
        cache = self.kv.region_cache(seq)
        n = len(seq.token_ids)
        start = cached_tokens(self.kv, seq) if prefill else n - 1
        dev = self.device
        pos = torch.arange(start, n)
        return self.model.forward_paged(
            self._tensor(seq.token_ids[start:], torch.int64), pos.to(dev), cache,
            torch.zeros((1, 1), dtype=torch.int32, device=dev), self._tensor([n], torch.int32), pos.to(dev),
            prefill, cu_seqlens_q=self._tensor([0, n - start], torch.int32) if prefill else None,
            max_query_len=n - start, max_context_len=n, backend="torch")


class SimRunner:
    """No tensors: each step costs the simulated GPU's roofline time (paced to wall time); tokens from a hash.

    ``speed`` is simulated seconds per wall second (None: no waiting at all).
    Token ids are lowercase letters drawn from (request, position), so a
    recompute after preemption produces what the first pass did.
    """

    def __init__(self, gpu: SimGPU, cost: CostModel, kv: KVManager, speed: float | None = 1.0,
                 sleep: Callable[[float], None] = time.sleep):
        self.gpu = gpu
        self.cost = cost
        self.kv = kv
        self.speed = speed
        self._sleep = sleep
        self.busy_s = 0.0

    def _charge(self, gpu_s: float) -> None:
        self.busy_s += gpu_s
        if self.speed is not None:
            self._sleep(gpu_s / self.speed)

    @staticmethod
    def _token(seq) -> int:
        digest = hashlib.blake2b(f"{seq.seq_id}/{len(seq.token_ids)}".encode(), digest_size=2).digest()
        return ord("a") + int.from_bytes(digest, "little") % 26

    def prefill_token_count(self, seqs: list) -> int:
        """Tokens a prefill of ``seqs`` computes."""
        return sum(len(s.token_ids) - cached_tokens(self.kv, s) for s in seqs)

    def prefill(self, seqs: list) -> list[int]:
        """Charge the prefill's roofline time; the next token of each sequence."""
        counts = [len(s.token_ids) - cached_tokens(self.kv, s) for s in seqs]
        self._charge(self.cost.prefill_gpu_s(self.gpu.spec, self.gpu.model, counts))
        return [self._token(s) for s in seqs]

    def decode(self, seqs: list) -> list[int]:
        """Charge one decode step's roofline time; the next token of each sequence."""
        ctx = sum(len(s.token_ids) for s in seqs)
        self._charge(self.cost.decode_gpu_s(self.gpu.spec, self.gpu.model, len(seqs), ctx))
        return [self._token(s) for s in seqs]
