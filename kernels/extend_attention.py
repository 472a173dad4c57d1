"""Extend (prefill) attention: new tokens of several sequences against their paged KV.

q packs the new tokens of B sequences back to back: sequence b owns rows
`q_start[b] : q_start[b] + extend_lens[b]`. Its K/V (cached prefix and new tokens, already
stored) are its first `seq_lens[b]` tokens through `page_table[b]`. New token i sits at
absolute position `seq_lens[b] - extend_lens[b] + i` and attends causally to every
position up to its own. GQA: query head h reads kv head `h // (Hq // Hk)`. Scores and
softmax are fp32; the output is in q's dtype.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from pdserve.kernels import native


def _gather_kv(cache: torch.Tensor, pages: torch.Tensor, length: int) -> torch.Tensor:
    """[length, Hk, D] contiguous copy of one sequence's tokens from a strided paged cache."""
    num_kv_heads, head_dim = cache.shape[2:]
    return cache.index_select(0, pages).view(-1, num_kv_heads, head_dim)[:length]


def extend_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           page_table: torch.Tensor, seq_lens: torch.Tensor, extend_lens: torch.Tensor,
                           q_start: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [T, Hq, D]; caches: [P, S, Hk, D] (strided); page_table: [B, max_pages]; others: [B]."""
    page_size = k_cache.shape[1]
    out = torch.empty_like(q)
    for b, (seq_len, ext, start) in enumerate(zip(seq_lens.tolist(), extend_lens.tolist(), q_start.tolist())):
        if ext == 0:
            continue
        pages = page_table[b, :triton.cdiv(seq_len, page_size)].long()
        k = _gather_kv(k_cache, pages, seq_len).transpose(0, 1)  # [Hk, L, D]
        v = _gather_kv(v_cache, pages, seq_len).transpose(0, 1)
        # 4-D inputs: with 3-D ones torch falls back from its CPU flash kernel to a ~5x slower math path.
        qb = q[start:start + ext].transpose(0, 1)[None]  # [1, Hq, ext, D]
        k, v = k[None], v[None]
        prefix = seq_len - ext
        if prefix == 0:
            o = F.scaled_dot_product_attention(qb, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:
            # Bottom-right aligned causal mask: query i sees keys 0 .. prefix + i.
            keys = torch.arange(seq_len, device=q.device)
            mask = keys[None, :] <= torch.arange(prefix, seq_len, device=q.device)[:, None]  # [ext, L]
            o = F.scaled_dot_product_attention(qb, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[start:start + ext] = o[0].transpose(0, 1)
    return out


def extend_attention_native(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            page_table: torch.Tensor, seq_lens: torch.Tensor, extend_lens: torch.Tensor,
                            q_start: torch.Tensor, scale: float) -> torch.Tensor:
    """Same contract as extend_attention_torch (CPU, fp32 or bf16): every query row attends on its own, in
    the same order as decode_attention_native, so a token's output does not depend on how its prompt was
    chunked or cached. Its cost grows with the square of the new tokens, where the torch twin's flash kernel
    tiles them: `extend_attention_cpu` picks between the two."""
    return native.load().extend_attention(q, k_cache, v_cache, page_table, seq_lens, extend_lens, q_start, scale)


def tiled_supported(q: torch.Tensor) -> bool:
    """Whether extend_attention_tiled takes q: bf16 with head_dim 64 or 128, on a CPU with AVX512-BF16."""
    return q.dtype == torch.bfloat16 and native.load().tiled_extend_supported(q.shape[2])


def extend_attention_tiled(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           page_table: torch.Tensor, seq_lens: torch.Tensor, extend_lens: torch.Tensor,
                           q_start: torch.Tensor, scale: float) -> torch.Tensor:
    """Same contract as extend_attention_torch, where `tiled_supported(q)`: four query rows of a kv head share
    every K and V vector they read, through bf16 dot products (3x the native kernel over a cached prefix, 3x
    the torch twin's flash kernel on long prompts; kernels/native/extend_tiled.cpp)."""
    return native.load().extend_attention_tiled(q, k_cache, v_cache, page_table, seq_lens, extend_lens, q_start,
                                                scale)


@triton.jit
def _extend_kernel(q_ptr, k_ptr, v_ptr, o_ptr, pt_ptr, lens_ptr, ext_ptr, qstart_ptr,
                   stride_qt, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
                   stride_ot, stride_oh, stride_pt,
                   qk_scale, group, head_dim, page_size,
                   NATIVE_DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_D: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    m_block = tl.program_id(2)
    ext = tl.load(ext_ptr + b)
    if m_block * BLOCK_M >= ext:
        return
    seq_len = tl.load(lens_ptr + b)
    row0 = tl.load(qstart_ptr + b).to(tl.int64)
    prefix = seq_len - ext
    kv_head = head // group

    m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = m < ext
    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim
    q = tl.load(q_ptr + (row0 + m)[:, None] * stride_qt + head * stride_qh + d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    if not NATIVE_DOT:
        q = q.to(tl.float32)
    q_pos = prefix + m  # absolute positions of this block's queries

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # Keys past the block's last query position are masked for every row: stop there.
    kv_end = tl.minimum(seq_len, prefix + (m_block + 1) * BLOCK_M)
    for n0 in range(0, kv_end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < kv_end
        page = tl.load(pt_ptr + b * stride_pt + n // page_size, mask=n_mask, other=0).to(tl.int64)
        offset = n % page_size
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + (page * stride_kp + offset * stride_ks + kv_head * stride_kh)[:, None] + d[None, :],
                    mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        v = tl.load(v_ptr + (page * stride_vp + offset * stride_vs + kv_head * stride_vh)[:, None] + d[None, :],
                    mask=kv_mask, other=0.0)
        if NATIVE_DOT:
            s = tl.dot(q, tl.trans(k))
        else:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        # Key 0 is visible to every row, so each row's running max is finite after the first block.
        visible = n_mask[None, :] & (n[None, :] <= q_pos[:, None])
        s = tl.where(visible, s * qk_scale, float("-inf"))  # [BLOCK_M, BLOCK_N], log2 domain
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if NATIVE_DOT:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        else:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m_i = m_new

    out = acc / l_i[:, None]
    tl.store(o_ptr + (row0 + m)[:, None] * stride_ot + head * stride_oh + d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def extend_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            page_table: torch.Tensor, seq_lens: torch.Tensor, extend_lens: torch.Tensor,
                            q_start: torch.Tensor, scale: float) -> torch.Tensor:
    """Same contract as extend_attention_torch."""
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("KV cache views must be contiguous in head_dim")
    T, num_heads, D = q.shape
    out = torch.empty((T, num_heads, D), dtype=q.dtype, device=q.device)
    B = extend_lens.shape[0]
    if T == 0 or B == 0:
        return out
    on_gpu = q.device.type == "cuda"
    block_m, block_n = (64, 64) if on_gpu else (16, 16)
    max_extend = int(extend_lens.max())
    num_kv_heads = k_cache.shape[2]
    native = on_gpu and q.dtype in (torch.float16, torch.bfloat16)
    grid = (B, num_heads, triton.cdiv(max_extend, block_m))
    _extend_kernel[grid](
        q, k_cache, v_cache, out, page_table, seq_lens, extend_lens, q_start,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1),
        page_table.stride(0), scale * 1.4426950408889634, num_heads // num_kv_heads, D, k_cache.shape[1],
        NATIVE_DOT=native, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=max(16, triton.next_power_of_2(D)),
        num_warps=4, num_stages=2)
    return out


# Where the tiled kernel does not apply: while every sequence's attention work (new tokens x keys) stays below
# this, the native per-row kernel beats the torch twin's flash kernel, whose set-up per sequence dominates short
# prompts; above it the flash kernel wins (bf16 SmolLM2 shapes: 40 new tokens 0.06 vs 0.13 ms, 128: 0.53 vs
# 0.43 ms).
NATIVE_EXTEND_MAX_WORK = 96 * 96


def extend_attention_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         page_table: torch.Tensor, seq_lens: torch.Tensor, extend_lens: torch.Tensor,
                         q_start: torch.Tensor, scale: float) -> torch.Tensor:
    """Same contract as extend_attention_torch: the tiled kernel where it applies (it is the fastest at every
    size measured, up to 4x the others), else the faster of the native kernel and the torch twin."""
    if tiled_supported(q):
        return extend_attention_tiled(q, k_cache, v_cache, page_table, seq_lens, extend_lens, q_start, scale)
    work = int((extend_lens.long() * seq_lens.long()).max()) if len(seq_lens) else 0
    if work <= NATIVE_EXTEND_MAX_WORK:
        return extend_attention_native(q, k_cache, v_cache, page_table, seq_lens, extend_lens, q_start, scale)
    return extend_attention_torch(q, k_cache, v_cache, page_table, seq_lens, extend_lens, q_start, scale)
