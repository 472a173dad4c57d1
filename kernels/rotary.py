"""Rotary position embedding (neox / rotate_half style, as in transformers' Llama).

The cos/sin table is built once per model (`build_cos_sin_cache`) as fp32
`[max_pos, D]`: columns `[:D/2]` hold cos and `[D/2:]` hold sin of the D/2 inverse
frequencies. A forward step selects the rows of its tokens' positions once
(`cos_sin_rows`) and every layer rotates with them.

The op rotates q and k in one call: they are adjacent in the fused qkv projection, so
the model hands over one `[T, Hq + Hk, D]` view. It returns a new tensor and leaves its
input untouched; the rotation is computed in fp32 and rounded once to the input dtype.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths slowed by `factor`, a smooth ramp in between."""
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def build_cos_sin_cache(head_dim: int, max_pos: int, base: float, rope_scaling: dict | None,
                        device: torch.device | str) -> torch.Tensor:
    """fp32 [max_pos, head_dim]: cos of every (position, frequency) pair, then sin."""
    rope_type = "default"
    if rope_scaling:
        rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise ValueError(f"unsupported rope scaling type {rope_type!r} (supported: default, llama3)")
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float32)
    inv_freq = 1.0 / (base ** (exponents / head_dim))  # [D/2]
    if rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, rope_scaling)
    positions = torch.arange(max_pos, device=device, dtype=torch.int64).float()
    freqs = positions[:, None] * inv_freq[None, :]  # [max_pos, D/2]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def cos_sin_rows(cos_sin_cache: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[T, D] fp32: the cache row of each token's position, shared by every layer of a step."""
    return cos_sin_cache.index_select(0, positions)


def rotary_torch(qk: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """qk: [T, H, D] (q and k heads together, may be strided); cos_sin: [T, D]. Returns rotated [T, H, D].

    With x = (x1, x2) the two halves of a head: out = (x1 cos - x2 sin, x2 cos + x1 sin), written as
    x * cos + (-x2 sin, x1 sin) so the whole step is a handful of ops over all heads at once.
    """
    T, H, D = qk.shape
    half = D // 2
    cos, sin = cos_sin.view(T, 1, 2, half).split(1, dim=2)  # [T, 1, 1, D/2] each
    x = qk.float().view(T, H, 2, half)
    swapped = x.flip(2).mul_(sin)  # (x2 sin, x1 sin)
    swapped[:, :, 0].neg_()
    return torch.addcmul(swapped, x, cos).reshape(T, H, D).to(qk.dtype)


@triton.jit
def _rotary_kernel(x_ptr, out_ptr, cs_ptr,
                   stride_xt, stride_xh, stride_ot, stride_oh, stride_cs,
                   num_heads,
                   HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """One program per token: every head of that token, one cos/sin row."""
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)
    d_mask = d < HALF
    cos = tl.load(cs_ptr + t * stride_cs + d, mask=d_mask, other=0.0).to(tl.float32)
    sin = tl.load(cs_ptr + t * stride_cs + HALF + d, mask=d_mask, other=0.0).to(tl.float32)
    heads = tl.arange(0, BLOCK_H)
    for h0 in range(0, num_heads, BLOCK_H):
        h = h0 + heads
        mask = (h < num_heads)[:, None] & d_mask[None, :]
        x_off = t * stride_xt + h[:, None] * stride_xh + d[None, :]
        x1 = tl.load(x_ptr + x_off, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptr + x_off + HALF, mask=mask, other=0.0).to(tl.float32)
        o_off = t * stride_ot + h[:, None] * stride_oh + d[None, :]
        out1 = x1 * cos[None, :] - x2 * sin[None, :]
        out2 = x2 * cos[None, :] + x1 * sin[None, :]
        tl.store(out_ptr + o_off, out1.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(out_ptr + o_off + HALF, out2.to(out_ptr.dtype.element_ty), mask=mask)


def rotary_triton(qk: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """Same contract as rotary_torch."""
    x = qk if qk.stride(-1) == 1 else qk.contiguous()
    cos_sin = cos_sin if cos_sin.stride(-1) == 1 else cos_sin.contiguous()
    T, H, D = x.shape
    out = torch.empty((T, H, D), dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    half = D // 2
    block_half = triton.next_power_of_2(half)
    block_h = max(1, min(triton.next_power_of_2(H), 4096 // block_half))
    _rotary_kernel[(T,)](x, out, cos_sin, x.stride(0), x.stride(1), out.stride(0), out.stride(1),
                         cos_sin.stride(0), H, HALF=half, BLOCK_H=block_h, BLOCK_HALF=block_half, num_warps=4)
    return out
