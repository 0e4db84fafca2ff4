"""Prefill: write new K/V into the paged cache, then causal flash attention over it.

Two kernels, each with a torch reference:

* ``reshape_and_cache``: token ``t``'s key and value ``[num_kv_heads,
  head_dim]`` go to slot ``slot_mapping[t]`` of the paged cache (layout in
  :mod:`.paged_attention`); a negative slot means "padding, do not write".
* ``prefill_attention``: the new tokens of each sequence (packed one after
  another, ``cu_seqlens_q`` giving where each sequence starts) attend,
  causally, to everything the cache holds for that sequence. The new tokens
  are the last ``q_len`` of ``context_len`` tokens, so query ``i`` sits at
  absolute position ``context_len - q_len + i`` and sees keys ``0..`` that
  position. Reading K/V through the block table (after ``reshape_and_cache``
  put the new ones there) makes one kernel serve a plain prefill, a prefill
  after a prefix-cache hit (the prefix's blocks are already filled) and a
  chunked prefill alike.

The attention kernel is flash-style: one program per (block of queries,
sequence, head) walks the keys in tiles with an online softmax (running max
and sum in float32, base 2), so memory is linear in the context and no
``[q_len, context_len]`` score matrix is ever stored.
"""

from __future__ import annotations

import torch

from .paged_attention import LOG2E, dot_in_fp32, dot_precision

try:
    import triton
    import triton.language as tl

    from .paged_attention import _kv_tile_offsets
except ImportError:  # the engine runs the torch path without triton
    triton = None


def reshape_and_cache_reference(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                                v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write ``key/value [T, KVH, D]`` into the caches at ``slot_mapping [T]`` (negative: skip)."""
    bs = k_cache.shape[1]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    block, row = slots // bs, slots % bs
    k_cache[block, row] = key[valid].to(k_cache.dtype)
    v_cache[block, row] = value[valid].to(v_cache.dtype)


def prefill_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                block_tables: torch.Tensor, context_lens: torch.Tensor,
                                cu_seqlens_q: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of packed new queries ``q [T, H, D]`` over the paged cache -> ``[T, H, D]``.

    One loop iteration per sequence, each a dense masked softmax in float32.
    """
    _, h, d = q.shape
    bs, kvh = k_cache.shape[1], k_cache.shape[2]
    g = h // kvh
    out = torch.zeros_like(q)
    starts = cu_seqlens_q.tolist()
    ctxs = context_lens.tolist()
    for seq, ctx in enumerate(ctxs):
        q0, q1 = starts[seq], starts[seq + 1]
        q_len = q1 - q0
        if q_len == 0:
            continue
        blocks = block_tables[seq, : -(-ctx // bs)].long()
        k = k_cache[blocks].reshape(-1, kvh, d)[:ctx].float().permute(1, 0, 2)[:, None]  # [KVH, 1, ctx, D]
        v = v_cache[blocks].reshape(-1, kvh, d)[:ctx].float().permute(1, 0, 2)[:, None]
        qs = q[q0:q1].float().reshape(q_len, kvh, g, d).permute(1, 2, 0, 3)  # [KVH, G, q_len, D]
        scores = torch.matmul(qs, k.transpose(-1, -2)) * scale  # [KVH, G, q_len, ctx]
        pos = torch.arange(ctx - q_len, ctx, device=q.device)
        future = torch.arange(ctx, device=q.device)[None, :] > pos[:, None]
        probs = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
        o = torch.matmul(probs, v)  # [KVH, G, q_len, D]
        out[q0:q1] = o.permute(2, 0, 1, 3).reshape(q_len, h, d).to(q.dtype)
    return out


if triton is not None:

    @triton.jit
    def _reshape_and_cache_kernel(
        key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
        stride_kt, stride_kh, stride_vt, stride_vh,
        stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch,
        NUM_KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    ):
        tok = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
        if slot < 0:
            return
        block = slot // BLOCK_SIZE
        row = slot % BLOCK_SIZE
        hh = tl.arange(0, HEADS_PAD)
        d = tl.arange(0, HEAD_DIM_PAD)
        mask = (hh < NUM_KV_HEADS)[:, None] & (d < HEAD_DIM)[None, :]
        k = tl.load(key_ptr + tok * stride_kt + hh[:, None] * stride_kh + d[None, :], mask=mask)
        v = tl.load(value_ptr + tok * stride_vt + hh[:, None] * stride_vh + d[None, :], mask=mask)
        kc = k_cache_ptr + block * stride_kcb + row * stride_kct + hh[:, None] * stride_kch + d[None, :]
        vc = v_cache_ptr + block * stride_vcb + row * stride_vct + hh[:, None] * stride_vch + d[None, :]
        tl.store(kc, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(vc, v.to(v_cache_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _prefill_attention_kernel(
        out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, cu_seqlens_ptr,
        qk_scale_log2,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
        stride_bt,
        QUERY_GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
    ):
        m_block = tl.program_id(0)
        seq = tl.program_id(1)
        head = tl.program_id(2)
        q_start = tl.load(cu_seqlens_ptr + seq)
        q_len = tl.load(cu_seqlens_ptr + seq + 1) - q_start
        if m_block * BLOCK_M >= q_len:
            return
        ctx = tl.load(context_lens_ptr + seq)
        prefix = ctx - q_len
        kv_head = head // QUERY_GROUP

        i = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
        i_mask = i < q_len
        pos = prefix + i  # absolute position of each query row
        d = tl.arange(0, HEAD_DIM_PAD)
        d_mask = d < HEAD_DIM
        rows = (q_start + i).to(tl.int64)
        q = tl.load(q_ptr + rows[:, None] * stride_qt + head * stride_qh + d[None, :],
                    mask=i_mask[:, None] & d_mask[None, :], other=0.0)
        if DOT_FP32:
            q = q.to(tl.float32)
        bt_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt

        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_sum = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
        # Keys past the last query of this block are all in the future: stop there.
        kv_end = tl.minimum(prefix + (m_block + 1) * BLOCK_M, ctx)
        for t0 in range(0, kv_end, BLOCK_N):
            t = t0 + tl.arange(0, BLOCK_N)
            t_mask = t < kv_end
            kv_mask = t_mask[:, None] & d_mask[None, :]
            k_off = _kv_tile_offsets(bt_ptr, t, t_mask, kv_head, d, stride_kb, stride_kt, stride_kh, BLOCK_SIZE)
            k = tl.load(k_cache_ptr + k_off, mask=kv_mask, other=0.0)
            if DOT_FP32:
                k = k.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale_log2
            # Key 0 is visible to every row (pos >= 0), so after the first tile
            # each row's running max is finite and exp2 never sees -inf - -inf.
            visible = t_mask[None, :] & (t[None, :] <= pos[:, None])
            s = tl.where(visible, s, float("-inf"))
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
        out = acc / l_sum[:, None]
        tl.store(out_ptr + rows[:, None] * stride_ot + head * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=i_mask[:, None] & d_mask[None, :])


def reshape_and_cache_triton(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                             v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """The Triton kernel; same contract as :func:`reshape_and_cache_reference`."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    t, kvh, d = key.shape
    if t == 0:
        return
    for x in (key, value, k_cache, v_cache):
        if x.stride(-1) != 1:
            raise ValueError("key, value and the caches need a contiguous last (head_dim) dimension")
    _reshape_and_cache_kernel[(t,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=kvh, HEADS_PAD=triton.next_power_of_2(kvh),
        HEAD_DIM=d, HEAD_DIM_PAD=triton.next_power_of_2(d), BLOCK_SIZE=k_cache.shape[1], num_warps=1)


def prefill_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             block_tables: torch.Tensor, context_lens: torch.Tensor,
                             cu_seqlens_q: torch.Tensor, scale: float, max_query_len: int | None = None,
                             block_m: int | None = None, block_n: int | None = None) -> torch.Tensor:
    """The Triton kernel; same contract as :func:`prefill_attention_reference`.

    ``max_query_len`` sizes the grid (default: read from ``cu_seqlens_q``,
    one device sync); ``block_m``/``block_n`` are the query and key tile sizes.
    """
    if triton is None:
        raise RuntimeError("triton is not installed")
    t_total, h, d = q.shape
    bs, kvh = k_cache.shape[1], k_cache.shape[2]
    if h % kvh:
        raise ValueError(f"{h} query heads do not divide into {kvh} KV heads")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("q, k_cache and v_cache need a contiguous last (head_dim) dimension")
    out = torch.empty_like(q)
    b = cu_seqlens_q.shape[0] - 1
    if t_total == 0 or b == 0:
        return out
    if max_query_len is None:
        max_query_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    d_pad = max(16, triton.next_power_of_2(d))
    # 64x64 tiles keep q, k, v and the accumulator of a 128-wide head in
    # registers with 4 warps; 256-wide heads halve the query tile.
    block_m = block_m or (64 if d_pad <= 128 else 32)
    block_n = block_n or 64
    block_tables, context_lens, cu_seqlens_q = (
        x if x.dtype == torch.int32 else x.to(torch.int32) for x in (block_tables, context_lens, cu_seqlens_q))
    grid = (triton.cdiv(max_query_len, block_m), b, h)
    _prefill_attention_kernel[grid](
        out, q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q, scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        QUERY_GROUP=h // kvh, HEAD_DIM=d, HEAD_DIM_PAD=d_pad, BLOCK_SIZE=bs,
        BLOCK_M=block_m, BLOCK_N=block_n,
        DOT_FP32=dot_in_fp32(_prefill_attention_kernel, q.dtype), PRECISION=dot_precision(q.dtype),
        num_warps=4)
    return out
