"""Rotary embedding of q and k fused with the KV-cache store: what every layer does between its qkv
projection and its attention.

Contract: `qkv` is the fused projection output `[T, (Hq + 2 Hk) * D]`; q and k heads are rotated with
`cos_sin` rows (see rotary.py), the rotated k and the v heads are written to the tokens' `slots` of the
paged caches (see kv_store.py), and the rotated q comes back as a new `[T, Hq, D]` tensor. The torch and
Triton sets compose their rotary and store ops; the native CPU op does it in one pass, so K never exists
outside the cache.
"""
from __future__ import annotations

import torch

from pdserve.kernels import native
from pdserve.kernels.kv_store import store_kv_torch, store_kv_triton
from pdserve.kernels.rotary import rotary_torch, rotary_triton


def _split(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int):
    qk = qkv[:, :(num_heads + num_kv_heads) * head_dim].view(-1, num_heads + num_kv_heads, head_dim)
    v = qkv[:, (num_heads + num_kv_heads) * head_dim:].view(-1, num_kv_heads, head_dim)
    return qk, v


def rotary_store_kv_torch(qkv: torch.Tensor, cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          slots: torch.Tensor, num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """qkv: [T, (Hq + 2 Hk) * D]; cos_sin: [T, D] fp32; caches: [P, S, Hk, D] (strided); slots: [T] int64.
    Returns the rotated q [T, Hq, D]."""
    qk, v = _split(qkv, num_heads, num_kv_heads, k_cache.shape[-1])
    qk = rotary_torch(qk, cos_sin)
    store_kv_torch(qk[:, num_heads:], v, k_cache, v_cache, slots)
    return qk[:, :num_heads]


def rotary_store_kv_triton(qkv: torch.Tensor, cos_sin: torch.Tensor, k_cache: torch.Tensor,
                           v_cache: torch.Tensor, slots: torch.Tensor, num_heads: int,
                           num_kv_heads: int) -> torch.Tensor:
    """Same contract as rotary_store_kv_torch."""
    qk, v = _split(qkv, num_heads, num_kv_heads, k_cache.shape[-1])
    qk = rotary_triton(qk, cos_sin)
    store_kv_triton(qk[:, num_heads:], v, k_cache, v_cache, slots)
    return qk[:, :num_heads]


def rotary_store_kv_native(qkv: torch.Tensor, cos_sin: torch.Tensor, k_cache: torch.Tensor,
                           v_cache: torch.Tensor, slots: torch.Tensor, num_heads: int,
                           num_kv_heads: int) -> torch.Tensor:
    """Same contract as rotary_store_kv_torch (CPU, fp32 or bf16)."""
    return native.load().rotary_store_kv(qkv, cos_sin, k_cache, v_cache, slots, num_heads, num_kv_heads)
