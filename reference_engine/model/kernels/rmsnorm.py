"""Fused RMSNorm (optionally with the residual add before it): a Triton kernel and its torch reference.

Definition (both paths)::

    if residual is given:  x = x + residual           (rounded to x's dtype; becomes the new residual)
    out = (x_fp32 * rsqrt(mean(x_fp32 ** 2) + eps) * weight_fp32).to(x.dtype)

The statistics are computed in float32 whatever the storage dtype, as the
Llama reference does. The Triton kernel reads a row once, adds the residual,
writes the new residual and the normalised row in one pass: the unfused
torch path reads and writes the row about five times.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the engine runs the torch path without triton
    triton = None


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float,
                       residual: torch.Tensor | None = None):
    """RMSNorm over the last dimension; with ``residual``, returns ``(out, x + residual)``."""
    if residual is not None:
        x = (x.float() + residual.float()).to(x.dtype)
    xf = x.float()
    out = (xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
    return (out, x) if residual is not None else out


if triton is not None:

    @triton.jit
    def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
                         x_stride, res_stride, out_stride, res_out_stride,
                         n_cols, eps,
                         HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0)
            # Round the sum to the storage dtype first, as the reference does,
            # so the residual stream is the same on both paths.
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
            tl.store(res_out_ptr + row * res_out_stride + cols, x, mask=mask)
        xf = x.to(tl.float32)
        var = tl.sum(xf * xf, axis=0) / n_cols
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        y = xf * (1.0 / tl.sqrt(var + eps)) * w
        tl.store(out_ptr + row * out_stride + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    residual: torch.Tensor | None = None):
    """The Triton kernel; same contract as :func:`rms_norm_reference`."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    shape = x.shape
    n = shape[-1]
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty_like(x2)
    rows = x2.shape[0]
    if residual is not None:
        r2 = residual.reshape(-1, n)
        if r2.stride(-1) != 1:
            r2 = r2.contiguous()
        res_out = torch.empty_like(x2)
    else:
        r2, res_out = x2, out  # unused: HAS_RESIDUAL is off
    if rows:
        block = triton.next_power_of_2(n)
        # One warp per 256 columns keeps every lane busy on a 4096-wide row (16 warps cap).
        num_warps = min(max(block // 256, 1), 16)
        _rms_norm_kernel[(rows,)](x2, r2, weight, out, res_out,
                                  x2.stride(0), r2.stride(0), out.stride(0), res_out.stride(0),
                                  n, eps, HAS_RESIDUAL=residual is not None, BLOCK=block,
                                  num_warps=num_warps)
    out = out.view(shape)
    return (out, res_out.view(shape)) if residual is not None else out
