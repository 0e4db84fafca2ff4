"""The real-tensor engine: the simulated engine's scheduler and KV managers, computing tokens with the model.

Every greedy token the engine produces, through the paged KV cache, batched
with other prompts, across preemptions and recomputes and across contiguous
reallocations, must be the token a plain dense forward of the same model picks,
and every step's logits must match the dense logits at that position.

Tolerance for engine vs dense logits in float32: 1e-5 absolute, as in
tests/test_model.py: the seeded tiny model's logits are below ~0.7 and the two
paths differ by ~2e-7 (summation order), so 1e-5 is far above rounding and far
below a wrong position, a wrong block or a stale KV row (those move logits by
~1e-2).
"""

from __future__ import annotations

import pytest
import torch

from gpudiag.catalog import M
from gpudiag.errors import GpudiagError
from gpudiag.probes.torch_reporter import REPORTED_COLUMNS
from gpudiag.reference_engine.core.kv_manager import KVConfig
from gpudiag.reference_engine.core.sequence import Status
from gpudiag.reference_engine.model.llm_engine import LLMEngine, LLMEngineConfig
from gpudiag.reference_engine.model.model_runner import PagedTensorKV

LOGIT_ATOL = 1e-5
TINY_BPT = 512  # KV bytes per token of the tiny preset: 2 * 2 layers * 2 KV heads * 16 * 4 B
PROMPT_LENGTHS = (11, 3, 17, 40)


def _prompts(lengths=PROMPT_LENGTHS, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lengths]


class LogitsLog:
    """Records each step's logits per sequence: (kind, context length the logits follow, row)."""

    def __init__(self):
        self.by_seq: dict[int, list[tuple[str, int, torch.Tensor]]] = {}

    def __call__(self, kind, seqs, logits):
        for s, row in zip(seqs, logits):
            self.by_seq.setdefault(s.seq_id, []).append((kind, len(s.token_ids), row.clone()))


def _engine(log=None, **cfg) -> LLMEngine:
    cfg.setdefault("seed", 1234)
    return LLMEngine(LLMEngineConfig(device="cpu", **cfg), on_logits=log)


def _assert_matches_dense(engine: LLMEngine, seqs, log: LogitsLog) -> None:
    """Each sequence's tokens are dense greedy; each recorded logits row equals dense at its position."""
    for s in seqs:
        assert s.status is Status.FINISHED and s.generated == s.max_output_tokens
        dense = engine.model.forward_dense(torch.tensor(s.token_ids[:-1]))  # row i predicts token i + 1
        want = dense[s.prompt_tokens - 1:].argmax(-1).tolist()
        assert s.output_ids == want, f"request {s.seq_id}"
        for kind, ctx, row in log.by_seq[s.seq_id]:
            torch.testing.assert_close(row, dense[ctx - 1], atol=LOGIT_ATOL, rtol=0,
                                       msg=lambda m, s=s, kind=kind, ctx=ctx: f"request {s.seq_id} {kind}@{ctx}: {m}")


def test_greedy_tokens_of_mixed_length_prompts_through_the_paged_engine_equal_a_dense_forward():
    log = LogitsLog()
    engine = _engine(log)
    assert isinstance(engine.kv, PagedTensorKV)
    seqs = engine.generate(_prompts(), max_tokens=24)
    # 40 + 24 tokens cross four 16-token blocks; prompts of 3 and 11 share batches with it.
    _assert_matches_dense(engine, seqs, log)
    assert engine.steps_total["prefill"] == 1 and engine.steps_total["decode"] == 23
    assert engine.sched.stats.evictions == 0
    assert engine.kv.free_blocks == engine.kv.num_blocks and engine.kv.used_bytes == 0  # everything returned


def test_a_pool_too_small_for_the_batch_preempts_and_recomputes_without_changing_a_token():
    # 10 blocks of 16 tokens; the four requests hold 1 + 1 + 2 + 3 blocks after their prefill
    # and need 3 + 2 + 3 + 4 = 12 at their longest (prompt + 24 tokens).
    log = LogitsLog()
    engine = _engine(log, kv_capacity_bytes=10 * 16 * TINY_BPT)
    assert engine.kv.num_blocks == 10
    seqs = engine.generate(_prompts(), max_tokens=24)
    st = engine.sched.stats
    assert st.evictions >= 1 and st.recomputed_tokens > 0
    recomputed = [s for s in seqs if s.preemptions]
    assert recomputed
    for s in recomputed:  # its second prefill ran over prompt and output so far, then decode went on
        kinds = [k for k, _, _ in log.by_seq[s.seq_id]]
        assert kinds.count("prefill") == 1 + s.preemptions
    _assert_matches_dense(engine, seqs, log)
    assert engine.kv.free_blocks == engine.kv.num_blocks


def test_a_forced_preemption_mid_decode_recomputes_the_prefix_and_continues_exactly():
    log = LogitsLog()
    engine = _engine(log)
    seqs = [engine.add_request(p, 20, stop_at_eos=False) for p in _prompts()]
    for _ in range(6):
        engine.step()
    victim = seqs[2]
    assert victim.status is Status.RUNNING and victim.generated == 6
    engine.preempt(victim)
    assert victim.status is Status.WAITING and victim.kv is None
    engine.step()  # the recompute: a prefill over 17 prompt + 6 output tokens
    assert victim.status is Status.RUNNING and victim.generated == 7
    assert log.by_seq[victim.seq_id][-1][:2] == ("prefill", 17 + 6)
    while engine.has_unfinished:
        engine.step()
    assert engine.sched.stats.recomputed_tokens == 17 + 6
    _assert_matches_dense(engine, seqs, log)
    with pytest.raises(GpudiagError, match="not running"):
        engine.preempt(victim)


def test_contiguous_regions_grown_by_realloc_and_copy_keep_every_token():
    # Regions start at 16 tokens and double: the 40-token prompt starts in a 64-token
    # region and grows once; the short ones grow twice. Each growth copies the K/V over.
    log = LogitsLog()
    engine = _engine(log, kv=KVConfig(strategy="contiguous", initial_bytes=16 * TINY_BPT, growth_factor=2.0))
    seqs = engine.generate(_prompts(), max_tokens=30)
    assert engine.kv.copy_bytes_total > 0
    _assert_matches_dense(engine, seqs, log)
    assert engine.kv.reserved_bytes == 0 and engine.allocator.stats().allocated_bytes == \
        engine.sim_gpu.allocator.stats().allocated_bytes


def test_with_prefix_caching_a_shared_prefix_is_computed_once_and_every_token_still_equals_dense():
    # Three prompts open with the same 40 tokens (two full 16-token blocks and a part); the
    # first is prefilled alone, the other two find its two full blocks in the cache.
    log = LogitsLog()
    engine = _engine(log, kv=KVConfig(strategy="paged", block_size=16, prefix_caching=True))
    shared = _prompts((40,), seed=7)[0]
    tails = _prompts((5, 12, 21), seed=8)
    first = engine.generate([shared + tails[0]], max_tokens=10)
    computed = engine.prompt_tokens_total
    rest = engine.generate([shared + t for t in tails[1:]], max_tokens=10)
    assert [s.cached_tokens for s in rest] == [32, 32]
    assert engine.prompt_tokens_total - computed == sum(len(shared) + len(t) - 32 for t in tails[1:])
    row = engine.engine_row()
    assert row[M.prefix_cache_hits_total] == 64
    _assert_matches_dense(engine, first + rest, log)


def test_prefix_caching_across_preemptions_in_a_small_pool_changes_no_token():
    # 10 blocks: the four requests (two sharing a 24-token prefix) must evict one another,
    # and cached blocks are evicted and reused while they do.
    log = LogitsLog()
    engine = _engine(log, kv=KVConfig(strategy="paged", block_size=16, prefix_caching=True),
                     kv_capacity_bytes=10 * 16 * TINY_BPT)
    shared = _prompts((24,), seed=3)[0]
    prompts = [shared + p for p in _prompts((9, 2), seed=4)] + _prompts((17, 30), seed=5)
    seqs = engine.generate(prompts, max_tokens=24)
    assert engine.sched.stats.evictions >= 1 and engine.kv.evicted_blocks >= 1
    # a preempted request came back to its own blocks, still cached: only the rest was recomputed
    assert any(s.preemptions and s.cached_tokens for s in seqs)
    _assert_matches_dense(engine, seqs, log)
    # a second conversation turn: the first answer and a question more; its prompt's full blocks are cached
    turn = engine.generate([seqs[0].token_ids + [10, 20, 30]], max_tokens=6)
    assert turn[0].cached_tokens >= 16
    _assert_matches_dense(engine, turn, log)


def test_chunked_kv_is_refused_on_real_tensors_with_a_way_out():
    with pytest.raises(GpudiagError, match="sim device only"):
        _engine(kv=KVConfig(strategy="chunked"))


def test_the_cpu_engine_accounts_device_memory_through_the_allocator_model():
    engine = _engine(kv_capacity_bytes=4 << 20)
    a = engine.sim_gpu.allocator.stats()
    weights = engine.model_config.weight_bytes()
    # The KV pool is one block of the allocator model, next to the weights and activations.
    assert a.allocated_bytes >= weights + engine.kv.capacity_bytes
    row = engine.process_row()
    assert row[M.process_torch_allocated_bytes] == a.allocated_bytes
    assert row[M.process_torch_reserved_bytes] == a.reserved_bytes
    assert row[M.process_gpu_memory_bytes] > row[M.process_torch_reserved_bytes]  # black holds the context
    (entry,) = engine.reporter_entries()
    assert set(entry) - {"device", "gpu", "uuid"} <= REPORTED_COLUMNS
    assert entry[M.process_torch_reserved_bytes] == a.reserved_bytes


def test_engine_rows_count_tokens_and_finished_requests_once():
    engine = _engine()
    engine.generate(_prompts((5, 9)), max_tokens=4)
    row = engine.engine_row()
    assert row[M.prompt_tokens_total] == 14 and row[M.generation_tokens_total] == 8
    assert row[M.engine_requests_finished_total] == 2 and row[M.num_requests_running] == 0
    kinds = [f.kind for f in engine.frames()]
    assert kinds == ["engine", "process", "request"]
    assert [f.kind for f in engine.frames()] == ["engine", "process"]  # request rows are handed out once


@pytest.mark.parametrize("prompt,max_tokens,message", [
    ([], 4, "empty"),
    ([1, 2, 999], 4, "token ids"),
    ([1, 2, 3], 0, "max_tokens must be positive"),
    ([1] * 1000, 100, "exceeds the context"),
])
def test_a_request_that_could_never_run_is_refused_at_once(prompt, max_tokens, message):
    engine = _engine()
    with pytest.raises(GpudiagError, match=message):
        engine.add_request(prompt, max_tokens)
    assert not engine.has_unfinished


def test_a_cpu_kv_cache_larger_than_the_hosts_available_memory_is_refused_before_anything_is_built():
    # 1 EiB: no host this runs on has it; the engine says so instead of failing inside torch
    with pytest.raises(GpudiagError, match="more than this host's available memory"):
        LLMEngine(LLMEngineConfig(device="cpu", kv_capacity_bytes=2**60))


def test_the_sim_device_runs_the_same_scheduler_without_tensors():
    engine = LLMEngine(LLMEngineConfig(device="sim", sim_speed=None))
    assert engine.model is None and engine.model_config.name == "llama-7b"
    seqs = engine.generate([list(range(100)), list(range(7))], max_tokens=5)
    assert [s.generated for s in seqs] == [5, 5]
    assert all(97 <= t < 123 for s in seqs for t in s.output_ids)
    assert engine.runner.busy_s > 0  # charged the roofline time of a 7B model on an A100


@pytest.mark.gpu
def test_on_a_gpu_the_paged_engine_equals_the_dense_forward():
    log = LogitsLog()
    engine = LLMEngine(LLMEngineConfig(device="cuda", model="tiny", seed=1234, kv_capacity_bytes=64 << 20),
                       on_logits=log)
    seqs = engine.generate(_prompts(), max_tokens=24)
    _assert_matches_dense(engine, seqs, log)
    row = engine.process_row()
    assert row[M.process_torch_reserved_bytes] >= row[M.process_torch_allocated_bytes] > 0
