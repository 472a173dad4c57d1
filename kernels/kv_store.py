"""Write new tokens' K and V into their slots of the paged KV cache, in place.

A slot is `page * page_size + offset`. The caches are per-layer views of one page-major
pool (`pool[:, layer, 0]`), so they are strided and never flattened: every address is
computed from the view's own strides.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


def store_kv_torch(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slots: torch.Tensor) -> None:
    """k, v: [T, Hk, D]; k_cache, v_cache: [P, S, Hk, D] (strided views); slots: [T] int64, distinct."""
    rows = _slot_rows(k_cache, slots)
    _token_rows(k_cache).index_copy_(0, rows, k)
    if v_cache.stride() != k_cache.stride():  # pool views share strides: their rows are the same
        rows = _slot_rows(v_cache, slots)
    _token_rows(v_cache).index_copy_(0, rows, v)


def _token_rows(cache: torch.Tensor) -> torch.Tensor:
    """The cache as one row of [Hk, D] per token slot it can address, over its own storage.

    One index_copy_ into this view writes every new token; indexing pages and offsets
    separately costs several times more on CPU."""
    P, S, H, D = cache.shape
    row = H * D
    if cache.stride(3) != 1 or cache.stride(2) != D or cache.stride(1) != row or cache.stride(0) % row:
        raise ValueError("KV cache views must hold each token's [heads, head_dim] contiguously, page rows in order")
    num_rows = (P - 1) * (cache.stride(0) // row) + S
    return cache.as_strided((num_rows, H, D), (row, D, 1))


def _slot_rows(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    page_size, page_rows = cache.shape[1], cache.stride(0) // cache.stride(1)
    return slots + (slots // page_size) * (page_rows - page_size)


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slots_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_kcp, stride_kcs, stride_kch, stride_vcp, stride_vcs, stride_vch,
                     num_heads, head_dim, page_size,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    page = slot // page_size
    offset = slot % page_size
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h < num_heads)[:, None] & (d < head_dim)[None, :]
    k = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask).to(tl.float32)
    v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask).to(tl.float32)
    kc = kc_ptr + page * stride_kcp + offset * stride_kcs + h[:, None] * stride_kch + d[None, :]
    vc = vc_ptr + page * stride_vcp + offset * stride_vcs + h[:, None] * stride_vch + d[None, :]
    # The fp32 round trip is exact for fp16/bf16 and keeps the interpreter away from bf16 values.
    tl.store(kc, k.to(kc_ptr.dtype.element_ty), mask=mask)
    tl.store(vc, v.to(vc_ptr.dtype.element_ty), mask=mask)


def store_kv_triton(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slots: torch.Tensor) -> None:
    """Same contract as store_kv_torch."""
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("KV cache views must be contiguous in head_dim")
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    T, H, D = k.shape
    if T == 0:
        return
    block_d = triton.next_power_of_2(D)
    block_h = max(1, min(triton.next_power_of_2(H), 4096 // block_d))
    grid = (T, triton.cdiv(H, block_h))
    _store_kv_kernel[grid](k, v, k_cache, v_cache, slots,
                           k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                           k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                           v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
                           H, D, k_cache.shape[1], BLOCK_H=block_h, BLOCK_D=block_d, num_warps=4)
