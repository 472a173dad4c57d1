from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from kernel_cases import (DEVICES, NATIVE_DTYPES, TRITON_DEVICE, assert_close, error_in_child,
                          needs_native)

from pdserve.kernels.rotary import build_cos_sin_cache, cos_sin_rows, rotary_torch
from pdserve.kernels.rotary_kv import rotary_store_kv_native, rotary_store_kv_torch, rotary_store_kv_triton

LAYER = 2


@dataclass
class Case:
    pool: torch.Tensor  # [P, L, 2, S, Hk, D], garbage everywhere
    qkv: torch.Tensor  # [T, (Hq + 2 Hk) * D], rows of a wider buffer
    cos_sin: torch.Tensor  # [T, D] fp32
    slots: torch.Tensor  # [T] int64, scattered and distinct
    num_heads: int
    num_kv_heads: int

    def run(self, op, pool: torch.Tensor) -> torch.Tensor:
        return op(self.qkv, self.cos_sin, pool[:, LAYER, 0], pool[:, LAYER, 1], self.slots, self.num_heads,
                  self.num_kv_heads)


def make_case(tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, page_size: int, dtype: torch.dtype,
              device: str = "cpu") -> Case:
    gen = torch.Generator().manual_seed(page_size * 100 + head_dim)
    num_pages = tokens // page_size + 3
    pool = (torch.randn(num_pages, 3, 2, page_size, num_kv_heads, head_dim, generator=gen) * 100).to(dtype)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(tokens, width + 16, generator=gen).to(dtype)[:, :width]
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    cos_sin = cos_sin_rows(build_cos_sin_cache(head_dim, 4096, 500000.0, None, "cpu"), positions)
    slots = torch.randperm(num_pages * page_size, generator=gen)[:tokens]
    return Case(pool.to(device), qkv.to(device), cos_sin.to(device), slots.to(device), num_heads, num_kv_heads)


def expected(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, pool) by the plain rotary op and a naive per-token write of the rotated k and the v."""
    hq, hk = case.num_heads, case.num_kv_heads
    T, D = case.cos_sin.shape
    heads = case.qkv.view(T, hq + 2 * hk, D)
    rotated = rotary_torch(heads[:, :hq + hk], case.cos_sin)
    pool = case.pool.clone()
    page_size = pool.shape[3]
    for t, slot in enumerate(case.slots.tolist()):
        pool[slot // page_size, LAYER, 0, slot % page_size] = rotated[t, hq:]
        pool[slot // page_size, LAYER, 1, slot % page_size] = heads[t, hq + hk:]
    return rotated[:, :hq], pool


def written(case: Case) -> torch.Tensor:
    """[P, L, 2, S] True at the slots the op writes, in its layer."""
    mask = torch.zeros(case.pool.shape[:4], dtype=torch.bool, device=case.pool.device)
    page_size = case.pool.shape[3]
    mask[case.slots // page_size, LAYER, :, case.slots % page_size] = True
    return mask


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("page_size", [1, 16, 5])
def test_torch_reference_rotates_q_and_k_and_stores_k_and_v(device, page_size):
    case = make_case(7, 6, 2, 32, page_size, torch.float32, device)
    qkv_before, pool = case.qkv.clone(), case.pool.clone()
    q = case.run(rotary_store_kv_torch, pool)
    exp_q, exp_pool = expected(case)
    assert torch.equal(q, exp_q) and torch.equal(pool, exp_pool)
    assert torch.equal(case.qkv, qkv_before)


@needs_native
@pytest.mark.parametrize("dtype", NATIVE_DTYPES)
@pytest.mark.parametrize("page_size", [1, 16, 5])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 4, 64), (6, 2, 128), (7, 1, 80), (24, 3, 32)])
def test_native_matches_torch(dtype, page_size, num_heads, num_kv_heads, head_dim):
    case = make_case(37, num_heads, num_kv_heads, head_dim, page_size, dtype)
    qkv_before, pool = case.qkv.clone(), case.pool.clone()
    q = case.run(rotary_store_kv_native, pool)
    exp_q, exp_pool = expected(case)
    assert q.shape == exp_q.shape and q.dtype == dtype and q.is_contiguous()
    # The same fp32 rotation rounded once: bit-identical to the torch twin, and nothing else in the pool moves.
    assert torch.equal(q, exp_q)
    assert torch.equal(pool, exp_pool)
    assert torch.equal(case.qkv, qkv_before)


@needs_native
def test_native_accepts_no_tokens():
    case = make_case(0, 6, 2, 64, 16, torch.float32)
    pool = case.pool.clone()
    assert case.run(rotary_store_kv_native, pool).shape == (0, 6, 64)
    assert torch.equal(pool, case.pool)


@pytest.mark.parametrize("page_size", [16, 5])
def test_triton_matches_torch(page_size):
    # fp32 only on CPU, as for the rotary op: the Triton interpreter's bf16 is broken.
    case = make_case(5, 6, 2, 32, page_size, torch.float32, TRITON_DEVICE)
    pool = case.pool.clone()
    q = case.run(rotary_store_kv_triton, pool)
    exp_q, exp_pool = expected(case)
    assert_close(q, exp_q, torch.float32)
    mask = written(case)
    assert torch.equal(pool[~mask], case.pool[~mask])
    assert_close(pool[mask], exp_pool[mask], torch.float32)


# case: (what replaces the valid inputs, what the error says)
BAD_INPUTS = {
    "int32 slots": (lambda a: {"slots": a["slots"].int()}, "slots must be int64"),
    "fp16 qkv": (lambda a: {"qkv": a["qkv"].half()}, "float32 or bfloat16"),
    "bf16 cos_sin": (lambda a: {"cos_sin": a["cos_sin"].bfloat16()}, "cos_sin"),
    "cache dtype differs from qkv": (lambda a: {"qkv": a["qkv"].bfloat16()}, "dtype"),
    "qkv width does not match the heads": (lambda a: {"num_heads": 5}, "qkv width"),
    "one slot for two tokens": (lambda a: {"slots": a["slots"][:1]}, "slots"),
    "slot past the cache": (lambda a: {"slots": torch.tensor([0, 1 << 30])}, "slot"),
    "negative slot": (lambda a: {"slots": torch.tensor([0, -1])}, "slot"),
    "caches with fewer kv heads": (lambda a: {"k_cache": a["k_cache"][:, :, :1], "v_cache": a["v_cache"][:, :, :1]},
                                   "head"),
    "v cache smaller than k cache": (lambda a: {"v_cache": a["v_cache"][:1, :1]}, "cache"),
}


@needs_native
@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_native_refuses_bad_inputs(case):
    valid = make_case(2, 4, 2, 64, 16, torch.float32)
    args = {"qkv": valid.qkv, "cos_sin": valid.cos_sin, "k_cache": valid.pool[:, LAYER, 0],
            "v_cache": valid.pool[:, LAYER, 1], "slots": valid.slots, "num_heads": 4, "num_kv_heads": 2}
    change, match = BAD_INPUTS[case]
    args.update(change(args))
    message = error_in_child(lambda: rotary_store_kv_native(**args))
    assert message.startswith(("RuntimeError", "ValueError", "IndexError")) and match in message, message
