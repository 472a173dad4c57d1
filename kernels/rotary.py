"""Rotary position embedding (neox / rotate_half style, as in transformers' Llama).

The cos/sin table is built once per model (`build_cos_sin_cache`) as fp32
`[max_pos, D]`: columns `[:D/2]` hold cos and `[D/2:]` hold sin of the D/2 inverse
frequencies. Each op returns new q and k tensors and leaves its inputs untouched; the
rotation is computed in fp32 and rounded once to the input dtype.
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


def _rotate_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def rotary_torch(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                 cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, Hq, D]; k: [T, Hk, D]; positions: [T] int64. Returns rotated (q, k)."""
    cos, sin = cos_sin_cache.index_select(0, positions).unsqueeze(1).chunk(2, dim=-1)  # [T, 1, D/2] each
    return _rotate_torch(q, cos, sin), _rotate_torch(k, cos, sin)


@triton.jit
def _rotary_kernel(x_ptr, out_ptr, pos_ptr, cache_ptr,
                   stride_xt, stride_xh, stride_ot, stride_oh, stride_cache,
                   num_heads,
                   HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """One program per token: every head of that token, one cos/sin row."""
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)
    d_mask = d < HALF
    cos = tl.load(cache_ptr + pos * stride_cache + d, mask=d_mask, other=0.0).to(tl.float32)
    sin = tl.load(cache_ptr + pos * stride_cache + HALF + d, mask=d_mask, other=0.0).to(tl.float32)
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


def _rotate_triton(x: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    if x.stride(-1) != 1:
        x = x.contiguous()
    T, H, D = x.shape
    out = torch.empty((T, H, D), dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    half = D // 2
    block_half = triton.next_power_of_2(half)
    block_h = max(1, min(triton.next_power_of_2(H), 4096 // block_half))
    _rotary_kernel[(T,)](x, out, positions, cache, x.stride(0), x.stride(1), out.stride(0), out.stride(1),
                         cache.stride(0), H, HALF=half, BLOCK_H=block_h, BLOCK_HALF=block_half, num_warps=4)
    return out


def rotary_triton(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                  cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as rotary_torch; q and k may be strided views (e.g. of a fused qkv output)."""
    cache = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    return _rotate_triton(q, positions, cache), _rotate_triton(k, positions, cache)
