"""Shared helpers of the kernel tests: devices, tolerances, paged KV batches and naive oracles."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

HAS_CUDA = torch.cuda.is_available()
# Torch references run everywhere; Triton kernels run on CUDA, or in the interpreter on CPU.
DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])
TRITON_DEVICE = "cuda" if HAS_CUDA else "cpu"
# bf16 is broken in the Triton interpreter: checked only on a real GPU.
TRITON_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if HAS_CUDA else [])
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    tol = TOL[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


@dataclass
class PagedKV:
    """K/V of several sequences, both as contiguous per-sequence tensors and scattered into a paged pool."""
    pool: torch.Tensor  # [P, L, 2, S, Hk, D]
    k_cache: torch.Tensor  # pool[:, layer, 0], strided
    v_cache: torch.Tensor
    page_table: torch.Tensor  # [B, max_pages] int32, padded with 0
    seq_lens: torch.Tensor  # [B] int32
    keys: list[torch.Tensor]  # per sequence [len, Hk, D]
    values: list[torch.Tensor]


def make_paged_kv(lens: list[int], page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                  device: str, seed: int = 0, num_layers: int = 3, layer: int = 1) -> PagedKV:
    gen = torch.Generator().manual_seed(seed)
    needed = [math.ceil(n / page_size) for n in lens]
    num_pages = sum(needed) + 3  # spare pages hold garbage that must never be read
    # Garbage everywhere (other layers, spare pages, page tails) so a stray read shows up.
    pool = (torch.randn(num_pages, num_layers, 2, page_size, num_kv_heads, head_dim, generator=gen) * 100)
    pool = pool.to(dtype=dtype, device=device)
    k_cache, v_cache = pool[:, layer, 0], pool[:, layer, 1]
    order = torch.randperm(num_pages, generator=gen).tolist()  # shuffled, non-contiguous page ids
    table, keys, values = [], [], []
    for n, count in zip(lens, needed):
        pages, order = order[:count], order[count:]
        table.append(pages + [0] * (max(needed) - count))
        k = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype=dtype, device=device)
        v = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype=dtype, device=device)
        for pos in range(n):  # naive per-token scatter
            k_cache[pages[pos // page_size], pos % page_size] = k[pos]
            v_cache[pages[pos // page_size], pos % page_size] = v[pos]
        keys.append(k)
        values.append(v)
    return PagedKV(pool, k_cache, v_cache,
                   torch.tensor(table, dtype=torch.int32, device=device),
                   torch.tensor(lens, dtype=torch.int32, device=device), keys, values)


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first_pos: int, scale: float) -> torch.Tensor:
    """Dense causal attention in float64, one head and one query at a time.

    q: [n, Hq, D] at absolute positions first_pos..first_pos+n-1; k, v: [L, Hk, D]. Returns [n, Hq, D] fp64.
    """
    n, num_heads, _ = q.shape
    group = num_heads // k.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    for i in range(n):
        visible = first_pos + i + 1
        for h in range(num_heads):
            kh = k[:visible, h // group].double().cpu()
            vh = v[:visible, h // group].double().cpu()
            weights = torch.softmax(kh @ q[i, h].double().cpu() * scale, dim=0)
            out[i, h] = weights @ vh
    return out
