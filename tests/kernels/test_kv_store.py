from __future__ import annotations

import pytest
import torch
from kernel_cases import DEVICES, TRITON_DEVICE, TRITON_DTYPES

from pdserve.kernels.kv_store import store_kv_torch, store_kv_triton

HK, D = 2, 32


def make_case(page_size: int, dtype: torch.dtype, device: str):
    gen = torch.Generator().manual_seed(page_size)
    pool = torch.randn(8, 3, 2, page_size, HK, D, generator=gen).to(dtype=dtype, device=device)
    slots = torch.randperm(8 * page_size, generator=gen)[:7].to(device)  # scattered, distinct
    # k and v as strided views of a fused projection output.
    kv = torch.randn(7, 2 * HK * D + 8, generator=gen).to(dtype=dtype, device=device)
    k = kv[:, :HK * D].view(7, HK, D)
    v = kv[:, HK * D:2 * HK * D].view(7, HK, D)
    return pool, slots, k, v


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("page_size", [1, 16])
def test_torch_reference_writes_only_the_slots(device, page_size):
    pool, slots, k, v = make_case(page_size, torch.float32, device)
    expected = pool.clone()
    for t, slot in enumerate(slots.tolist()):  # naive per-token write into layer 1
        expected[slot // page_size, 1, 0, slot % page_size] = k[t]
        expected[slot // page_size, 1, 1, slot % page_size] = v[t]
    store_kv_torch(k, v, pool[:, 1, 0], pool[:, 1, 1], slots)
    assert torch.equal(pool, expected)


@pytest.mark.parametrize("dtype", TRITON_DTYPES)
@pytest.mark.parametrize("page_size", [1, 16])
def test_triton_matches_torch(dtype, page_size):
    pool, slots, k, v = make_case(page_size, dtype, TRITON_DEVICE)
    expected = pool.clone()
    store_kv_torch(k, v, expected[:, 2, 0], expected[:, 2, 1], slots)
    store_kv_triton(k, v, pool[:, 2, 0], pool[:, 2, 1], slots)
    assert torch.equal(pool, expected)
