"""RMSNorm, optionally fused with the residual add that precedes it.

Math matches transformers' LlamaRMSNorm: normalise in fp32, round to the input dtype, then
multiply by the weight. With a residual, `r = x + residual` is rounded to the input dtype
first and returned as the new residual, so a layer's residual stream is the same tensor the
unfused model would carry.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels import native


def rmsnorm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float,
                  residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x: [T, H]; weight: [H]. Returns out [T, H], or (out, new_residual) when residual is given."""
    if residual is not None:
        x = x + residual  # [T, H], in x.dtype: this is the new residual
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * h.to(x.dtype)
    return (out, x) if residual is not None else out


def rmsnorm_native(x: torch.Tensor, weight: torch.Tensor, eps: float,
                   residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Same contract as rmsnorm_torch (CPU, fp32 or bf16; rows may be strided)."""
    out = native.load().rmsnorm(x, weight, eps, residual)
    return out[0] if residual is None else (out[0], out[1])


@triton.jit
def _rmsnorm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
                    stride_x, stride_res, stride_out, stride_res_out,
                    H, eps,
                    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0).to(tl.float32)
        # Round the sum to the storage dtype, as the unfused add would.
        x = (x + r).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_res_out + cols, x, mask=mask)
        x = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / H + eps)
    normed = (x * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def rmsnorm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float,
                   residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Same contract as rmsnorm_torch; rows may be strided, the last dim must be contiguous."""
    x = _last_dim_contiguous(x)
    T, H = x.shape
    out = torch.empty((T, H), dtype=x.dtype, device=x.device)
    if T == 0:
        return out if residual is None else (out, residual.clone())
    block = triton.next_power_of_2(H)
    num_warps = 4 if block <= 2048 else 8
    if residual is None:
        _rmsnorm_kernel[(T,)](x, x, weight, out, out, x.stride(0), 0, out.stride(0), 0, H, eps,
                              HAS_RESIDUAL=False, BLOCK=block, num_warps=num_warps)
        return out
    residual = _last_dim_contiguous(residual)
    res_out = torch.empty_like(out)
    _rmsnorm_kernel[(T,)](x, residual, weight, out, res_out, x.stride(0), residual.stride(0), out.stride(0),
                          res_out.stride(0), H, eps, HAS_RESIDUAL=True, BLOCK=block, num_warps=num_warps)
    return out, res_out


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()
