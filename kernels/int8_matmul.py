"""The two ends of a w8a8 int8 matmul: per-row activation quantization before it, dequantization after it.

    q, scale, zero = quantize_rows(x, inv_smooth)        # x[m] * inv_smooth ~ scale[m] * q[m] + zero[m]
    acc = int8_mm(q, weight_t)                           # int32 [M, N], exact
    y = dequantize_rows(acc, scale, zero, col_scale, col_sum, bias, residual)

Activations are quantized per row and asymmetrically (the row's [min, max] onto [-128, 127]): a GELU output
is almost never below -0.17, so a symmetric range would waste half the codes on it. The zero point is folded
out of the integer matmul, because sum_k (s q_k + z) w_nk = s sum_k q_k w_nk + z sum_k w_nk: the epilogue adds
`zero[m] * col_sum[n]`, where col_sum is the real-valued sum of the quantized weight row n (col_scale[n] times
its integer sum). `inv_smooth` divides each input column by a smoothing factor that the weight's columns were
multiplied by (SmoothQuant), moving outlier channels of the activations into the weights.

Rounding is to nearest even, as torch.round does; quantize_rows' q is bit-identical across implementations,
its scale and zero and dequantize_rows' output agree to float32 rounding.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from pdserve.kernels import native


def quantize_rows_torch(x: torch.Tensor, inv_smooth: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x: [M, K] float32 -> q int8 [M, K], scale [M], zero [M]."""
    v = x if inv_smooth is None else x * inv_smooth
    lo, hi = v.amin(1), v.amax(1)
    span = hi - lo
    inv_step = torch.where(span > 0, 255.0 / span, torch.zeros_like(span))
    step = span / 255.0
    q = (torch.round((v - lo[:, None]) * inv_step[:, None]) - 128).clamp(-128, 127).to(torch.int8)
    return q, step, lo + 128.0 * step


def dequantize_rows_torch(acc: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, col_scale: torch.Tensor,
                          col_sum: torch.Tensor, bias: torch.Tensor | None = None,
                          residual: torch.Tensor | None = None) -> torch.Tensor:
    """acc: int32 [M, N] -> float32 [M, N] = acc * scale[m] * col_scale[n] + zero[m] * col_sum[n] (+ bias, residual)."""
    out = acc.float() * scale[:, None] * col_scale + zero[:, None] * col_sum
    if bias is not None:
        out = out + bias
    if residual is not None:
        out = out + residual
    return out


def quantize_rows_native(x: torch.Tensor, inv_smooth: torch.Tensor | None = None):
    """Same contract as quantize_rows_torch (CPU, float32, contiguous rows)."""
    return tuple(native.load().quantize_rows(x, inv_smooth))


def dequantize_rows_native(acc, scale, zero, col_scale, col_sum, bias=None, residual=None) -> torch.Tensor:
    """Same contract as dequantize_rows_torch (CPU)."""
    return native.load().dequantize_rows(acc, scale, zero, col_scale, col_sum, bias, residual)


@triton.jit
def _quantize_rows_kernel(x_ptr, s_ptr, q_ptr, scale_ptr, zero_ptr, stride_x, K,
                          HAS_SMOOTH: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < K
    v = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_SMOOTH:
        v = v * tl.load(s_ptr + cols, mask=mask, other=1.0)
    lo = tl.min(tl.where(mask, v, float("inf")), axis=0)
    hi = tl.max(tl.where(mask, v, float("-inf")), axis=0)
    span = hi - lo
    inv_step = tl.where(span > 0, 255.0 / tl.where(span > 0, span, 1.0), 0.0)
    step = span / 255.0
    # t lies in [0, 255]: adding and taking away 1.5 * 2^23 rounds it to the nearest even integer in float32.
    t = (v - lo) * inv_step
    n = (t + 12582912.0) - 12582912.0
    n = tl.minimum(tl.maximum(n - 128.0, -128.0), 127.0)
    tl.store(q_ptr + row * K + cols, n.to(tl.int8), mask=mask)
    tl.store(scale_ptr + row, step)
    tl.store(zero_ptr + row, lo + 128.0 * step)


@triton.jit
def _dequantize_rows_kernel(acc_ptr, scale_ptr, zero_ptr, cs_ptr, csum_ptr, bias_ptr, res_ptr, out_ptr,
                            stride_acc, stride_res, N, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
                            BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    a = tl.load(acc_ptr + row * stride_acc + cols, mask=mask, other=0).to(tl.float32)
    s = tl.load(scale_ptr + row)
    z = tl.load(zero_ptr + row)
    out = a * s * tl.load(cs_ptr + cols, mask=mask, other=0.0) + z * tl.load(csum_ptr + cols, mask=mask, other=0.0)
    if HAS_BIAS:
        out += tl.load(bias_ptr + cols, mask=mask, other=0.0)
    if HAS_RES:
        out += tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * N + cols, out, mask=mask)


def quantize_rows_triton(x: torch.Tensor, inv_smooth: torch.Tensor | None = None):
    """Same contract as quantize_rows_torch; one program per row (rows of up to a few thousand columns)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    M, K = x.shape
    q = torch.empty((M, K), dtype=torch.int8, device=x.device)
    scale = torch.empty(M, dtype=torch.float32, device=x.device)
    zero = torch.empty(M, dtype=torch.float32, device=x.device)
    if M:
        smooth = inv_smooth if inv_smooth is not None else scale  # unread when HAS_SMOOTH is off
        _quantize_rows_kernel[(M,)](x, smooth, q, scale, zero, x.stride(0), K, HAS_SMOOTH=inv_smooth is not None,
                                    BLOCK=triton.next_power_of_2(K))
    return q, scale, zero


def dequantize_rows_triton(acc, scale, zero, col_scale, col_sum, bias=None, residual=None) -> torch.Tensor:
    """Same contract as dequantize_rows_torch."""
    M, N = acc.shape
    out = torch.empty((M, N), dtype=torch.float32, device=acc.device)
    if M:
        block = min(1024, triton.next_power_of_2(N))
        _dequantize_rows_kernel[(M, triton.cdiv(N, block))](
            acc, scale, zero, col_scale, col_sum, bias if bias is not None else col_sum,
            residual if residual is not None else out, out, acc.stride(0),
            residual.stride(0) if residual is not None else 0, N,
            HAS_BIAS=bias is not None, HAS_RES=residual is not None, BLOCK=block)
    return out


def int8_mm(q: torch.Tensor, weight_t: torch.Tensor) -> torch.Tensor:
    """q int8 [M, K] @ weight_t int8 [K, N] -> int32 [M, N], exactly. torch._int_mm where it is exact and takes
    the shape: on CPU only where oneDNN multiplies with VNNI (its AVX2 kernel's 16-bit pair sums saturate:
    `int_mm_exact_on_cpu`), on CUDA (cuBLASLt) from 17 rows with multiples of 8. Elsewhere float64, which holds
    every int32 sum exactly."""
    if q.device.type == "cpu":
        if int_mm_exact_on_cpu():
            return torch._int_mm(q, weight_t)
    elif q.shape[0] > 16 and q.shape[1] % 8 == 0 and weight_t.shape[1] % 8 == 0:
        return torch._int_mm(q, weight_t)
    return (q.double() @ weight_t.double()).to(torch.int32)


@functools.cache
def int_mm_exact_on_cpu() -> bool:
    """Whether oneDNN's int8 GEMM sums exactly here: codes of 127 saturate VPMADDUBSW's pair sums (255 x 127 x 2
    after oneDNN shifts the activations to unsigned) and not VPDPBUSD's. Asked of the kernel rather than read
    from the CPU's flags, since ONEDNN_MAX_CPU_ISA can hold oneDNN below what the CPU has."""
    q = torch.full((1, 64), 127, dtype=torch.int8)
    return torch._int_mm(q, torch.full((64, 8), 127, dtype=torch.int8)).eq(127 * 127 * 64).all().item()
