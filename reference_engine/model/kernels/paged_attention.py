"""Paged-attention decode: one new query token per sequence against its KV in a paged cache.

Paged KV cache layout (shared by every kernel in this package and by the model):

* per layer, two tensors ``k_cache`` and ``v_cache`` of shape
  ``[num_blocks, block_size, num_kv_heads, head_dim]`` (the last dimension
  contiguous);
* token ``i`` of a sequence lives in physical block
  ``block_tables[seq, i // block_size]`` at row ``i % block_size``; its
  *slot* is ``block * block_size + i % block_size``;
* ``context_lens[seq]`` tokens are valid; block-table entries past them are
  never read (pad them with any block id, 0 is customary).

Grouped-query attention: query head ``h`` reads KV head ``h // (num_heads //
num_kv_heads)``. The softmax scale is applied to ``q·k``; accumulation is in
float32 for every storage dtype.

Split-KV (flash-decoding): with few sequences, one program per (sequence, KV
head) cannot fill a GPU, and a long context serialises in one program. The
context is then cut into ``num_splits`` ranges processed in parallel; each
writes its partial output, normalised by its own softmax sum, and the
log-sum-exp of its scores. A second kernel merges them::

    out = sum_s exp(lse_s - max lse) * out_s / sum_s exp(lse_s - max lse)

which is exact (not an approximation) because each partial is a softmax over
a disjoint range. Both kernels keep scores in base 2 (``exp2`` with the scale
multiplied by log2(e)), the usual flash-attention trick for the faster
instruction.
"""

from __future__ import annotations

import math

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the engine runs the torch path without triton
    triton = None

LOG2E = 1.4426950408889634

# Below this many tokens per split the merge pass and each program's fixed
# cost (loading q, block-table lookups) outweigh the extra parallelism.
MIN_TOKENS_PER_SPLIT = 256
# Programs per SM to aim for: two resident programs per SM hide each other's
# memory latency; more only adds merge traffic.
TARGET_PROGRAMS_PER_SM = 2
MAX_SPLITS = 64
# SM count assumed when there is no CUDA device (interpreter runs): an H100 SXM.
DEFAULT_SM_COUNT = 132


def paged_decode_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                     block_tables: torch.Tensor, context_lens: torch.Tensor,
                                     scale: float) -> torch.Tensor:
    """Decode attention in plain torch: ``q [B, H, D]`` -> ``[B, H, D]`` in q's dtype.

    Gathers every sequence's blocks (all of ``block_tables``' width, masked to
    ``context_lens``), so it needs no host synchronisation and runs batched.
    A sequence with no context gets a zero output.
    """
    b, h, d = q.shape
    _, bs, kvh, _ = k_cache.shape
    g = h // kvh
    bt = block_tables.long().clamp(min=0)
    n = bt.shape[1] * bs
    k = k_cache[bt].reshape(b, n, kvh, d).permute(0, 2, 1, 3).float()  # [B, KVH, N, D]
    v = v_cache[bt].reshape(b, n, kvh, d).permute(0, 2, 1, 3).float()
    qf = q.float().reshape(b, kvh, g, d)
    scores = torch.matmul(qf, k.transpose(-1, -2)) * scale  # [B, KVH, G, N]
    invalid = torch.arange(n, device=q.device)[None, :] >= context_lens.to(q.device).long()[:, None]
    scores = scores.masked_fill(invalid[:, None, None, :], float("-inf"))
    # Rows past the context may hold anything (a recycled block's old tokens,
    # uninitialised memory): zero them, since 0 * NaN would still be NaN.
    v = v.masked_fill(invalid[:, None, :, None], 0.0)
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # empty context: all -inf -> 0
    return torch.matmul(probs, v).reshape(b, h, d).to(q.dtype)


def choose_num_splits(batch: int, num_kv_heads: int, max_context_len: int, sm_count: int) -> int:
    """How many KV splits decode should use: enough programs to fill the GPU, none too short."""
    useful = max(1, max_context_len // MIN_TOKENS_PER_SPLIT)
    wanted = math.ceil(TARGET_PROGRAMS_PER_SM * sm_count / max(1, batch * num_kv_heads))
    return max(1, min(wanted, useful, MAX_SPLITS))


def device_sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (DEFAULT_SM_COUNT elsewhere)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return DEFAULT_SM_COUNT


def dot_in_fp32(kernel, dtype: torch.dtype) -> bool:
    """Whether a kernel must upcast bf16 dot operands to fp32.

    Triton's interpreter (3.x, ``interpreter.py: create_dot``) multiplies
    bf16 operands as their raw uint16 bit patterns, so a bf16 ``tl.dot``
    returns garbage there; loads, stores and casts of bf16 are right. Under
    the interpreter only, bf16 dots therefore run on fp32 copies; on a GPU
    they go to the tensor cores as bf16.
    """
    if dtype != torch.bfloat16 or triton is None:
        return False
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:
        return False
    return isinstance(kernel, InterpretedFunction)


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 storage gets true fp32 products: TF32 would cost ~1e-3 relative
    # error, which the fp32 path exists to avoid.
    return "ieee" if dtype == torch.float32 else "tf32"


if triton is not None:

    @triton.jit
    def _kv_tile_offsets(block_tables_ptr, t, t_mask, kv_head, d,
                         stride_block, stride_token, stride_head, BLOCK_SIZE: tl.constexpr):
        """Element offsets of tokens ``t`` of one sequence's KV head in a paged cache."""
        block = tl.load(block_tables_ptr + t // BLOCK_SIZE, mask=t_mask, other=0).to(tl.int64)
        row = (t % BLOCK_SIZE).to(tl.int64)
        return block[:, None] * stride_block + row[:, None] * stride_token + kv_head * stride_head + d[None, :]

    @triton.jit
    def _paged_decode_kernel(
        out_ptr, lse_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
        qk_scale_log2,
        stride_qb, stride_qh,
        stride_kb, stride_kt, stride_kh,
        stride_vb, stride_vt, stride_vh,
        stride_bt,
        stride_ob, stride_oh, stride_os,
        stride_lb, stride_lh,
        tokens_per_split,
        QUERY_GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
        SPLIT: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
    ):
        # One program: one sequence, one KV head with all the query heads that
        # share it (GQA), one range of the context. The query heads form the M
        # dimension of the dots, padded to 16 as tl.dot requires.
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        ctx = tl.load(context_lens_ptr + seq)
        start = split * tokens_per_split
        end = tl.minimum(start + tokens_per_split, ctx)

        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, HEAD_DIM_PAD)
        head = kv_head * QUERY_GROUP + g
        g_mask = g < QUERY_GROUP
        d_mask = d < HEAD_DIM
        q = tl.load(q_ptr + seq.to(tl.int64) * stride_qb + head[:, None] * stride_qh + d[None, :],
                    mask=g_mask[:, None] & d_mask[None, :], other=0.0)
        if DOT_FP32:
            q = q.to(tl.float32)
        bt_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt

        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_sum = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
        for t0 in range(start, end, BLOCK_N):
            t = t0 + tl.arange(0, BLOCK_N)
            t_mask = t < end
            kv_mask = t_mask[:, None] & d_mask[None, :]
            k_off = _kv_tile_offsets(bt_ptr, t, t_mask, kv_head, d, stride_kb, stride_kt, stride_kh, BLOCK_SIZE)
            k = tl.load(k_cache_ptr + k_off, mask=kv_mask, other=0.0)
            if DOT_FP32:
                k = k.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale_log2
            s = tl.where(t_mask[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            p = tl.math.exp2(s - m_new[:, None])
            alpha = tl.math.exp2(m - m_new)
            l_sum = l_sum * alpha + tl.sum(p, axis=1)
            v_off = _kv_tile_offsets(bt_ptr, t, t_mask, kv_head, d, stride_vb, stride_vt, stride_vh, BLOCK_SIZE)
            v = tl.load(v_cache_ptr + v_off, mask=kv_mask, other=0.0)
            if DOT_FP32:
                v = v.to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m = m_new

        has = l_sum > 0.0  # an empty range (past the context) contributes nothing
        out = acc / tl.where(has, l_sum, 1.0)[:, None]
        o_ptr = out_ptr + seq.to(tl.int64) * stride_ob + head[:, None] * stride_oh + d[None, :]
        if SPLIT:
            o_ptr += split * stride_os
            lse = tl.where(has, m + tl.math.log2(tl.where(has, l_sum, 1.0)), float("-inf"))
            tl.store(lse_ptr + seq.to(tl.int64) * stride_lb + head * stride_lh + split, lse, mask=g_mask)
        tl.store(o_ptr, out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])

    @triton.jit
    def _merge_splits_kernel(
        out_ptr, part_ptr, lse_ptr,
        stride_ob, stride_oh, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
        NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    ):
        seq = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        s = tl.arange(0, SPLITS_PAD)
        d = tl.arange(0, HEAD_DIM_PAD)
        s_mask = s < NUM_SPLITS
        d_mask = d < HEAD_DIM
        lse = tl.load(lse_ptr + seq * stride_lb + head * stride_lh + s, mask=s_mask, other=float("-inf"))
        top = tl.max(lse, axis=0)
        w = tl.where(lse > float("-inf"), tl.math.exp2(lse - top), 0.0)
        total = tl.sum(w, axis=0)
        parts = tl.load(part_ptr + seq * stride_pb + head * stride_ph + s[:, None] * stride_ps + d[None, :],
                        mask=s_mask[:, None] & d_mask[None, :], other=0.0)
        out = tl.sum(w[:, None] * parts, axis=0) / tl.where(total > 0.0, total, 1.0)
        tl.store(out_ptr + seq * stride_ob + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d_mask)


def paged_decode_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                  block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                                  max_context_len: int | None = None, num_splits: int | None = None,
                                  block_n: int | None = None) -> torch.Tensor:
    """The Triton decode kernel; same contract as :func:`paged_decode_attention_reference`.

    ``max_context_len`` bounds the context (default: the block tables' width
    times the block size, which needs no device sync) and sizes the split;
    ``num_splits`` overrides :func:`choose_num_splits`; ``block_n`` is the
    number of tokens per inner tile.
    """
    if triton is None:
        raise RuntimeError("triton is not installed")
    b, h, d = q.shape
    _, bs, kvh, _ = k_cache.shape
    if h % kvh:
        raise ValueError(f"{h} query heads do not divide into {kvh} KV heads")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("q, k_cache and v_cache need a contiguous last (head_dim) dimension")
    group = h // kvh
    out = torch.empty_like(q)
    if b == 0:
        return out
    if max_context_len is None:
        max_context_len = block_tables.shape[1] * bs
    if num_splits is None:
        num_splits = choose_num_splits(b, kvh, max_context_len, device_sm_count(q.device))
    block_n = block_n or 64
    tokens_per_split = triton.cdiv(triton.cdiv(max(max_context_len, 1), num_splits), block_n) * block_n
    block_tables = block_tables.to(torch.int32) if block_tables.dtype != torch.int32 else block_tables
    context_lens = context_lens.to(torch.int32) if context_lens.dtype != torch.int32 else context_lens
    common = {
        "QUERY_GROUP": group, "GROUP_PAD": max(16, triton.next_power_of_2(group)),
        "HEAD_DIM": d, "HEAD_DIM_PAD": max(16, triton.next_power_of_2(d)),
        "BLOCK_SIZE": bs, "BLOCK_N": block_n,
        "DOT_FP32": dot_in_fp32(_paged_decode_kernel, q.dtype), "PRECISION": dot_precision(q.dtype),
        "num_warps": 4,
    }
    qk_scale_log2 = scale * LOG2E
    grid = (b, kvh, num_splits)
    if num_splits == 1:
        _paged_decode_kernel[grid](
            out, out, q, k_cache, v_cache, block_tables, context_lens, qk_scale_log2,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
            out.stride(0), out.stride(1), 0, 0, 0, tokens_per_split, SPLIT=False, **common)
        return out
    partial = torch.empty((b, h, num_splits, d), dtype=torch.float32, device=q.device)
    lse = torch.empty((b, h, num_splits), dtype=torch.float32, device=q.device)
    _paged_decode_kernel[grid](
        partial, lse, q, k_cache, v_cache, block_tables, context_lens, qk_scale_log2,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        partial.stride(0), partial.stride(1), partial.stride(2), lse.stride(0), lse.stride(1),
        tokens_per_split, SPLIT=True, **common)
    _merge_splits_kernel[(b, h)](
        out, partial, lse, out.stride(0), out.stride(1), partial.stride(0), partial.stride(1),
        partial.stride(2), lse.stride(0), lse.stride(1),
        NUM_SPLITS=num_splits, SPLITS_PAD=triton.next_power_of_2(num_splits),
        HEAD_DIM=d, HEAD_DIM_PAD=common["HEAD_DIM_PAD"], num_warps=4)
    return out
