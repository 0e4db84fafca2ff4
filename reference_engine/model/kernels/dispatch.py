"""Which implementation of each kernel runs: the torch path or the Triton kernel.

``backend`` is one of:

* ``"auto"`` (the default): tensors on the CPU take the torch path (the
  Triton interpreter is for correctness tests, far too slow to serve);
  tensors on a CUDA device take the Triton kernels, except RMSNorm on small
  inputs (below).
* ``"torch"``: the torch path everywhere (the reference).
* ``"triton"``: the Triton kernels everywhere; on the CPU this works only if
  the kernels were imported with ``TRITON_INTERPRET=1`` set (Triton decides
  interpreted-or-compiled when ``@triton.jit`` runs, at import).

Cut-over on CUDA, and why (each constant names the figure of
``bench/kernels_gpu.py`` that re-measures it):

* RMSNorm takes the torch path (``x + residual``, then
  ``torch.nn.functional.rms_norm``, a fused kernel dispatched from C++)
  below :data:`RMSNORM_TRITON_MIN_ELEMENTS`. Every norm but the model's
  first carries the residual add: the torch path is then two launches
  making five passes over the rows, the Triton kernel one launch making
  four, but Triton's Python launcher costs more host time than two C++
  dispatches. Measured on an H200 (torch 2.11, Triton 3.6, bf16, hidden
  4096, host-inclusive time per call, calls back to back): with the residual,
  Triton 34.9 / 35.6 / 35.8 / 68.6 us against torch 17.4 / 17.5 / 16.8 /
  94.3 us at 4 Ki / 256 Ki / 4 Mi / 32 Mi elements. Host time decides up to
  4 Mi elements (decode batches: <= 256 rows of 4096 = 1 Mi); at 32 Mi the
  saved pass over HBM makes Triton take 27 % less time. The cut-over lies between
  the two; the constant is the first measured size at which Triton won.
* Decode attention, prefill attention and reshape-and-cache always take
  Triton on CUDA: their torch paths are several launches each (gather K,
  gather V, mask, matmul, softmax, matmul; index arithmetic and two index
  writes) where the kernels are one (two with split-KV), so there is no size
  at which the torch path launches less. Tiny decode shapes already get the
  cheapest kernel form: one split, no merge pass. The bench's "decode
  cut-over" table checks this; on the H200 (bf16, GQA 4, head_dim 128) the
  kernel took 46-65 us per call host-inclusive against the torch path's
  257-303 us, at batch 1-16 and context 16-256.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gpudiag.errors import GpudiagError

from . import paged_attention, prefill_attention, rmsnorm

BACKENDS = ("auto", "torch", "triton")

# Re-measure with bench/kernels_gpu.py: the "rmsnorm cut-over" table gives the
# smallest element count at which the Triton kernel (with residual) beats torch.
RMSNORM_TRITON_MIN_ELEMENTS = 1 << 25


def check_backend(backend: str) -> str:
    """Validate a backend name (``auto``, ``torch``, ``triton``)."""
    if backend not in BACKENDS:
        raise GpudiagError(f"unknown kernel backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    return backend


def triton_runs_on(device: torch.device, kernel) -> bool:
    """Whether a Triton kernel can run for tensors on ``device`` in this process."""
    if paged_attention.triton is None:
        return False
    if device.type == "cuda":
        return True
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:
        return False
    return isinstance(kernel, InterpretedFunction)


def _use_triton(backend: str, device: torch.device, kernel, auto_on_cuda: bool) -> bool:
    if backend == "torch":
        return False
    if backend == "triton":
        if not triton_runs_on(device, kernel):
            raise GpudiagError(
                f"the Triton kernels cannot run on {device.type}: they need a CUDA device, or on the CPU "
                "TRITON_INTERPRET=1 set before gpudiag's kernels are imported (and triton installed)")
        return True
    check_backend(backend)
    return device.type == "cuda" and auto_on_cuda and triton_runs_on(device, kernel)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             backend: str = "auto"):
    """RMSNorm of the last dimension; with ``residual``, returns ``(out, x + residual)``."""
    kernel = getattr(rmsnorm, "_rms_norm_kernel", None)
    if _use_triton(backend, x.device, kernel, x.numel() >= RMSNORM_TRITON_MIN_ELEMENTS):
        return rmsnorm.rms_norm_triton(x, weight, eps, residual)
    if x.device.type == "cuda":
        if residual is not None:
            x = x + residual  # rounded once to x's dtype, as the reference does
            return F.rms_norm(x, (x.shape[-1],), weight, eps), x
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return rmsnorm.rms_norm_reference(x, weight, eps, residual)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, backend: str = "auto") -> None:
    """Write new K/V ``[T, KVH, D]`` into the paged caches at ``slot_mapping`` (negative: skip)."""
    kernel = getattr(prefill_attention, "_reshape_and_cache_kernel", None)
    if _use_triton(backend, key.device, kernel, True):
        prefill_attention.reshape_and_cache_triton(key, value, k_cache, v_cache, slot_mapping)
    else:
        prefill_attention.reshape_and_cache_reference(key, value, k_cache, v_cache, slot_mapping)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, scale: float, max_context_len: int | None = None,
                     backend: str = "auto") -> torch.Tensor:
    """Paged decode attention, ``q [B, H, D]`` -> ``[B, H, D]`` (see :mod:`.paged_attention`)."""
    kernel = getattr(paged_attention, "_paged_decode_kernel", None)
    if _use_triton(backend, q.device, kernel, True):
        return paged_attention.paged_decode_attention_triton(q, k_cache, v_cache, block_tables, context_lens,
                                                             scale, max_context_len=max_context_len)
    return paged_attention.paged_decode_attention_reference(q, k_cache, v_cache, block_tables, context_lens, scale)


def prefill_attention_paged(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, context_lens: torch.Tensor, cu_seqlens_q: torch.Tensor,
                            scale: float, max_query_len: int | None = None, backend: str = "auto") -> torch.Tensor:
    """Causal prefill attention of packed queries ``[T, H, D]`` over the paged cache (see :mod:`.prefill_attention`)."""
    kernel = getattr(prefill_attention, "_prefill_attention_kernel", None)
    if _use_triton(backend, q.device, kernel, True):
        return prefill_attention.prefill_attention_triton(q, k_cache, v_cache, block_tables, context_lens,
                                                          cu_seqlens_q, scale, max_query_len=max_query_len)
    return prefill_attention.prefill_attention_reference(q, k_cache, v_cache, block_tables, context_lens,
                                                         cu_seqlens_q, scale)
