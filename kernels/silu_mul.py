"""SwiGLU activation: `silu(gate) * up` over a fused [gate | up] projection output.

silu is computed in fp32 and rounded to the input dtype before the product, which is
what the unfused `act_fn(gate_proj(x)) * up_proj(x)` does.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from pdserve.kernels import native


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2I] -> [T, I]."""
    half = x.shape[-1] // 2
    return F.silu(x[:, :half]) * x[:, half:]


def silu_and_mul_native(x: torch.Tensor) -> torch.Tensor:
    """Same contract as silu_and_mul_torch (CPU, fp32 or bf16)."""
    return native.load().silu_and_mul(x)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, I, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + I + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """Same contract as silu_and_mul_torch; rows may be strided."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    T, two_i = x.shape
    I = two_i // 2
    out = torch.empty((T, I), dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    block = min(1024, triton.next_power_of_2(I))
    _silu_and_mul_kernel[(T, triton.cdiv(I, block))](x, out, x.stride(0), out.stride(0), I, BLOCK=block, num_warps=4)
    return out
