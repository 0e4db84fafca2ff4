"""The Triton kernels compute what their torch references compute.

They run under Triton's interpreter (``TRITON_INTERPRET=1``), on the CPU.
Triton reads that variable when ``@triton.jit`` runs: for our kernels at
their import, and for the ``@jit`` functions of ``triton.language`` itself
(``tl.max``, ``tl.sum``, ...) when triton is first imported. It must
therefore be set before anything in the process imports triton, which a
pytest session cannot promise (any test module collected earlier may import
the model). So in a normal session this module runs one test,
:func:`test_kernels_match_their_references_in_the_triton_interpreter`, which
runs this same file in a fresh pytest process with the variable set; there
the cases below run (here they are skipped, saying so). The variable never
touches the outer session. Running ``TRITON_INTERPRET=1 pytest
tests/test_kernels.py`` runs the cases directly.

Tolerances (outputs are softmax-weighted means of N(0, 1) values, |out| < ~3):

* float32: atol = rtol = 1e-5 (summation order only).
* float16: atol = rtol = 2e-3. The kernels round the softmax weights to fp16
  before the P·V product (as flash attention does on a GPU) and the output
  to fp16 (ulp 1e-3 near 1).
* bfloat16: atol = 1e-2, rtol = 1.6e-2 (one bf16 ulp, torch's default bf16
  rtol). Two facts of Triton 3.9's interpreter shape this case:
  ``tl.dot`` on bf16 operands multiplies their raw uint16 bit patterns
  (``interpreter.py: create_dot``), so under the interpreter, and only there,
  the kernels upcast bf16 dot operands to fp32 (``dot_in_fp32``); and casts
  fp32 -> bf16 truncate toward zero where a GPU rounds to nearest even, so
  bf16 results may differ from the GPU's by one ulp. The bf16 GPU dot path
  itself is exercised only by ``bench/kernels_gpu.py`` on a GPU.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed; the kernels' torch references run without it")

from gpudiag.reference_engine.model.kernels import paged_attention as pa
from gpudiag.reference_engine.model.kernels import prefill_attention as pf
from gpudiag.reference_engine.model.kernels import rmsnorm as rn

INTERPRETER_RUN = os.environ.get("TRITON_INTERPRET") == "1"
# Cases marked so run only in the TRITON_INTERPRET=1 subprocess; the outer
# session deselects them (tests/conftest.py), so nothing is reported skipped.
in_interpreter = pytest.mark.interpreter_only

TOLERANCE = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 1e-2, "rtol": 1.6e-2},
}


@pytest.mark.interpreter_runner
def test_kernels_match_their_references_in_the_triton_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider"],
                          check=False, capture_output=True, text=True, timeout=900, env=env,
                          cwd=Path(__file__).resolve().parents[1])
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert proc.returncode == 0, (proc.stdout[-6000:] + proc.stderr[-2000:])
    # Every interpreter case ran there and passed; nothing was skipped.
    assert re.search(r"\b\d+ passed\b", summary) and "skipped" not in summary and "failed" not in summary, summary


# Every GQA ratio meets every block size in float32; float16 and bfloat16 each
# see every ratio and every block size once (the interpreter is slow).
CASES = ([(torch.float32, g, bs) for g in (1, 4, 8) for bs in (8, 16, 32)]
         + [(dt, g, bs) for dt in (torch.float16, torch.bfloat16) for g, bs in ((1, 8), (4, 16), (8, 32))])
CASE_IDS = [f"{str(dt).split('.')[1]}-gqa{g}-block{bs}" for dt, g, bs in CASES]


def _paged_layout(context_lens: list[int], block_size: int, num_blocks: int, seed: int):
    """Block tables over a shuffled pool (no sequence gets contiguous blocks), padded with 0."""
    gen = torch.Generator().manual_seed(seed)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in context_lens]
    width = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32), tables


def _random(shape, dtype, gen):
    return torch.randn(shape, generator=gen).to(dtype)


@in_interpreter
def test_the_kernels_under_test_are_interpreted():
    from triton.runtime.interpreter import InterpretedFunction

    for kernel in (pa._paged_decode_kernel, pa._merge_splits_kernel, pf._prefill_attention_kernel,
                   pf._reshape_and_cache_kernel, rn._rms_norm_kernel):
        assert isinstance(kernel, InterpretedFunction)


@in_interpreter
@pytest.mark.parametrize("dtype,gqa,block_size", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("num_splits", [1, 3], ids=["one-split", "split-kv"])
def test_paged_decode_matches_reference(dtype, gqa, block_size, num_splits):
    # Context lengths: one token; a partial last block; an exact number of
    # blocks; a length that is no multiple of anything. With 3 splits some
    # splits of the short sequences are empty and must drop out of the merge.
    gen = torch.Generator().manual_seed(gqa * 100 + block_size)
    kv_heads, head_dim = 2, 32
    heads = kv_heads * gqa
    ctx = [1, 2 * block_size + 3, 3 * block_size, 71]
    bt, _ = _paged_layout(ctx, block_size, num_blocks=24, seed=block_size)
    k_cache = _random((24, block_size, kv_heads, head_dim), dtype, gen)
    v_cache = _random((24, block_size, kv_heads, head_dim), dtype, gen)
    q = _random((len(ctx), heads, head_dim), dtype, gen)
    context_lens = torch.tensor(ctx, dtype=torch.int32)
    scale = head_dim ** -0.5
    ref = pa.paged_decode_attention_reference(q, k_cache, v_cache, bt, context_lens, scale)
    out = pa.paged_decode_attention_triton(q, k_cache, v_cache, bt, context_lens, scale,
                                           num_splits=num_splits, block_n=16)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), ref.float(), **TOLERANCE[dtype])


@in_interpreter
def test_split_kv_merge_equals_one_pass_on_a_long_context():
    # The heuristic chooses several splits for one sequence with a long
    # context; the log-sum-exp merge must reproduce the single pass.
    gen = torch.Generator().manual_seed(3)
    block_size, kv_heads, head_dim, heads = 16, 1, 16, 4
    ctx = [1000]
    bt, _ = _paged_layout(ctx, block_size, num_blocks=70, seed=3)
    k_cache = _random((70, block_size, kv_heads, head_dim), torch.float32, gen)
    v_cache = _random((70, block_size, kv_heads, head_dim), torch.float32, gen)
    q = _random((1, heads, head_dim), torch.float32, gen) * 3  # peaked softmax: the merge's max matters
    context_lens = torch.tensor(ctx, dtype=torch.int32)
    splits = pa.choose_num_splits(1, kv_heads, 1000, pa.DEFAULT_SM_COUNT)
    assert splits > 1
    merged = pa.paged_decode_attention_triton(q, k_cache, v_cache, bt, context_lens, 0.25, max_context_len=1000)
    single = pa.paged_decode_attention_triton(q, k_cache, v_cache, bt, context_lens, 0.25, num_splits=1)
    ref = pa.paged_decode_attention_reference(q, k_cache, v_cache, bt, context_lens, 0.25)
    torch.testing.assert_close(merged, single, **TOLERANCE[torch.float32])
    torch.testing.assert_close(merged, ref, **TOLERANCE[torch.float32])


def test_split_count_fills_the_gpu_only_when_it_pays():
    sms = 132
    assert pa.choose_num_splits(1, 8, 200, sms) == 1  # short context: nothing to split
    assert pa.choose_num_splits(256, 8, 32768, sms) == 1  # 2048 programs already fill 132 SMs
    assert pa.choose_num_splits(1, 8, 32768, sms) == 33  # 8 programs -> ~2 per SM
    assert pa.choose_num_splits(1, 1, 1 << 20, sms) == pa.MAX_SPLITS


@in_interpreter
def test_head_dim_that_is_not_a_power_of_two_is_masked():
    gen = torch.Generator().manual_seed(5)
    block_size, kv_heads, head_dim, heads = 8, 2, 24, 4
    ctx = [13, 5]
    bt, _ = _paged_layout(ctx, block_size, num_blocks=8, seed=5)
    k_cache = _random((8, block_size, kv_heads, head_dim), torch.float32, gen)
    v_cache = _random((8, block_size, kv_heads, head_dim), torch.float32, gen)
    q = _random((2, heads, head_dim), torch.float32, gen)
    cl = torch.tensor(ctx, dtype=torch.int32)
    torch.testing.assert_close(pa.paged_decode_attention_triton(q, k_cache, v_cache, bt, cl, 0.2, num_splits=2),
                               pa.paged_decode_attention_reference(q, k_cache, v_cache, bt, cl, 0.2),
                               **TOLERANCE[torch.float32])


def _prefill_batch(dtype, gqa, block_size, gen, kv_heads=2, head_dim=32):
    # (context after this step, new tokens): a fresh prompt shorter than a
    # block; a prompt after a prefix-cache hit of 24 tokens (it attends to
    # cached blocks); a prompt of exactly two blocks; one new token on a
    # cached prefix (a recompute or chunk tail).
    seqs = [(5, 5), (37, 13), (2 * block_size, 2 * block_size), (20, 1)]
    ctx = [c for c, _ in seqs]
    bt, tables = _paged_layout(ctx, block_size, num_blocks=24, seed=block_size + gqa)
    k_cache = _random((24, block_size, kv_heads, head_dim), dtype, gen)
    v_cache = _random((24, block_size, kv_heads, head_dim), dtype, gen)
    q_lens = [n for _, n in seqs]
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    q = _random((sum(q_lens), kv_heads * gqa, head_dim), dtype, gen)
    return q, k_cache, v_cache, bt, torch.tensor(ctx, dtype=torch.int32), cu, tables, seqs


@in_interpreter
@pytest.mark.parametrize("dtype,gqa,block_size", CASES, ids=CASE_IDS)
def test_prefill_attention_matches_reference(dtype, gqa, block_size):
    gen = torch.Generator().manual_seed(7 * gqa + block_size)
    q, k_cache, v_cache, bt, cl, cu, _, _ = _prefill_batch(dtype, gqa, block_size, gen)
    scale = q.shape[-1] ** -0.5
    ref = pf.prefill_attention_reference(q, k_cache, v_cache, bt, cl, cu, scale)
    # 16x16 tiles: several query blocks and key tiles per sequence, causal
    # cut inside a tile, tiles that straddle blocks.
    out = pf.prefill_attention_triton(q, k_cache, v_cache, bt, cl, cu, scale, block_m=16, block_n=16)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref.float(), **TOLERANCE[dtype])


@in_interpreter
def test_prefill_with_default_tiles_and_a_long_prompt():
    gen = torch.Generator().manual_seed(11)
    block_size, kv_heads, head_dim, heads = 16, 2, 16, 8
    seqs = [(150, 150), (90, 40)]
    ctx = [c for c, _ in seqs]
    bt, _ = _paged_layout(ctx, block_size, num_blocks=20, seed=11)
    k_cache = _random((20, block_size, kv_heads, head_dim), torch.float32, gen)
    v_cache = _random((20, block_size, kv_heads, head_dim), torch.float32, gen)
    cu = torch.tensor([0, 150, 190], dtype=torch.int32)
    q = _random((190, heads, head_dim), torch.float32, gen)
    cl = torch.tensor(ctx, dtype=torch.int32)
    torch.testing.assert_close(pf.prefill_attention_triton(q, k_cache, v_cache, bt, cl, cu, 0.25),
                               pf.prefill_attention_reference(q, k_cache, v_cache, bt, cl, cu, 0.25),
                               **TOLERANCE[torch.float32])


def test_reference_prefill_is_causal_attention():
    # The reference itself against a direct definition: softmax(q k^T) v over
    # positions <= the query's, one sequence, GQA 2.
    gen = torch.Generator().manual_seed(13)
    block_size, kv_heads, head_dim = 4, 1, 8
    k_seq = _random((10, kv_heads, head_dim), torch.float32, gen)
    v_seq = _random((10, kv_heads, head_dim), torch.float32, gen)
    q = _random((10, 2, head_dim), torch.float32, gen)
    k_cache = torch.zeros(3, block_size, kv_heads, head_dim)
    v_cache = torch.zeros(3, block_size, kv_heads, head_dim)
    bt = torch.tensor([[2, 0, 1]], dtype=torch.int32)
    slots = torch.tensor([int(bt[0, p // block_size]) * block_size + p % block_size for p in range(10)])
    pf.reshape_and_cache_reference(k_seq, v_seq, k_cache, v_cache, slots)
    out = pf.prefill_attention_reference(q, k_cache, v_cache, bt, torch.tensor([10]), torch.tensor([0, 10]), 0.5)
    for i in range(10):
        for h in range(2):
            w = torch.softmax((k_seq[: i + 1, 0] @ q[i, h]) * 0.5, dim=0)
            torch.testing.assert_close(out[i, h], w @ v_seq[: i + 1, 0])


@in_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_reshape_and_cache_writes_exactly_the_mapped_slots(dtype, block_size):
    gen = torch.Generator().manual_seed(block_size)
    kv_heads, head_dim, blocks = 3, 24, 5  # 3 heads and 24 dims: both padded in the kernel
    key = _random((9, kv_heads, head_dim), dtype, gen)
    value = _random((9, kv_heads, head_dim), dtype, gen)
    slots = torch.randperm(blocks * block_size, generator=gen)[:9]
    slots[4] = -1  # a padding token: written nowhere
    k0 = _random((blocks, block_size, kv_heads, head_dim), dtype, gen)
    v0 = _random((blocks, block_size, kv_heads, head_dim), dtype, gen)
    k_ref, v_ref, k_tri, v_tri = k0.clone(), v0.clone(), k0.clone(), v0.clone()
    pf.reshape_and_cache_reference(key, value, k_ref, v_ref, slots)
    pf.reshape_and_cache_triton(key, value, k_tri, v_tri, slots)
    assert torch.equal(k_tri, k_ref) and torch.equal(v_tri, v_ref)
    flat = k_ref.view(-1, kv_heads, head_dim)
    assert torch.equal(flat[slots[0]], key[0])
    untouched = torch.ones(blocks * block_size, dtype=torch.bool)
    untouched[slots[slots >= 0]] = False
    assert torch.equal(flat[untouched], k0.view(-1, kv_heads, head_dim)[untouched])


@in_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("hidden", [64, 96])
def test_rmsnorm_matches_reference_with_and_without_residual(dtype, hidden):
    gen = torch.Generator().manual_seed(hidden)
    x = _random((5, hidden), dtype, gen) * 3
    w = _random((hidden,), dtype, gen)
    r = _random((5, hidden), dtype, gen)
    torch.testing.assert_close(rn.rms_norm_triton(x, w, 1e-5).float(),
                               rn.rms_norm_reference(x, w, 1e-5).float(), **TOLERANCE[dtype])
    out, res = rn.rms_norm_triton(x, w, 1e-6, residual=r)
    out_ref, res_ref = rn.rms_norm_reference(x, w, 1e-6, residual=r)
    torch.testing.assert_close(out.float(), out_ref.float(), **TOLERANCE[dtype])
    if dtype == torch.bfloat16:  # the interpreter truncates the sum to bf16: one ulp
        torch.testing.assert_close(res.float(), res_ref.float(), atol=0, rtol=2 ** -7)
    else:
        assert torch.equal(res, res_ref)


def test_rmsnorm_reference_is_the_definition():
    x = torch.tensor([[3.0, 4.0]])
    w = torch.tensor([1.0, 2.0])
    rms = (12.5 + 1e-5) ** 0.5
    torch.testing.assert_close(rn.rms_norm_reference(x, w, 1e-5), torch.tensor([[3 / rms, 8 / rms]]))


@in_interpreter
def test_whole_model_through_the_triton_kernels_matches_the_torch_path():
    # backend="triton" runs every kernel (RMSNorm, reshape-and-cache, prefill,
    # decode) inside a real forward of the tiny model: prefill of two prompts
    # (11 tokens over two blocks, 3 tokens), then two decode steps.
    from gpudiag.reference_engine.model.model import allocate_kv_cache, build_model
    from gpudiag.reference_engine.model.model_config import ModelConfig

    cfg = ModelConfig.preset("tiny")
    model = build_model(cfg, seed=3)
    bs = 8
    tables = [[5, 1], [6]]
    bt = torch.tensor([t + [0] * (2 - len(t)) for t in tables], dtype=torch.int32)

    def slot(s, p):
        return tables[s][p // bs] * bs + p % bs

    caches = {b: allocate_kv_cache(cfg, 8, bs) for b in ("torch", "triton")}
    ids = torch.tensor(list(range(40, 51)) + list(range(60, 63)))
    pos = torch.tensor(list(range(11)) + list(range(3)))
    slots = torch.tensor([slot(0, p) for p in range(11)] + [slot(1, p) for p in range(3)])
    ctx = [11, 3]
    cu = torch.tensor([0, 11, 14], dtype=torch.int32)
    out = {b: [model.forward_paged(ids, pos, caches[b], bt, torch.tensor(ctx, dtype=torch.int32), slots, True,
                                   cu_seqlens_q=cu, backend=b)] for b in caches}
    tokens = out["torch"][0].argmax(-1)
    for _ in range(2):
        pos = torch.tensor(ctx)
        slots = torch.tensor([slot(s, ctx[s]) for s in range(2)])
        ctx = [c + 1 for c in ctx]
        for b, cache in caches.items():
            out[b].append(model.forward_paged(tokens, pos, cache, bt, torch.tensor(ctx, dtype=torch.int32),
                                              slots, False, backend=b))
        tokens = out["torch"][-1].argmax(-1)
    torch.testing.assert_close(caches["triton"].storage, caches["torch"].storage, atol=1e-5, rtol=1e-5)
    for ref, tri in zip(out["torch"], out["triton"]):
        torch.testing.assert_close(tri, ref, atol=1e-4, rtol=1e-4)
        assert torch.equal(tri.argmax(-1), ref.argmax(-1))
