from __future__ import annotations

import pytest
import torch
from kernel_cases import NATIVE_DTYPES, TRITON_DEVICE, TRITON_DTYPES, needs_native

from pdserve.kernels.token_mask import (apply_token_mask, apply_token_mask_native, apply_token_mask_torch,
                                        apply_token_mask_triton)


def _case(rows: int, vocab: int, dtype: torch.dtype, device: str = "cpu"):
    torch.manual_seed(vocab)
    logits = torch.randn(rows, vocab, device=device).to(dtype)
    bitmask = torch.randint(-2**31, 2**31 - 1, (rows, (vocab + 31) // 32), dtype=torch.int32, device=device)
    bitmask[0] = -1  # a row with every token allowed
    if rows > 1:
        bitmask[1] = 0  # and one with none
        bitmask[1, 0] = 1 << 3  # but token 3
    return logits, bitmask


def _reference(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    out = logits.clone()
    for r in range(logits.shape[0]):
        for t in range(logits.shape[1]):
            if not (int(bitmask[r, t // 32]) >> (t % 32)) & 1:
                out[r, t] = float("-inf")
    return out


@pytest.mark.parametrize("vocab", [64, 77])  # whole words, and a ragged last word
def test_torch_twin_matches_bit_by_bit_reference(vocab):
    logits, bitmask = _case(3, vocab, torch.float32)
    expected = _reference(logits, bitmask)
    out = apply_token_mask_torch(logits.clone(), bitmask)
    assert torch.equal(out, expected)
    assert torch.isfinite(out[0]).all() and torch.isfinite(out[1]).sum() == 1 and torch.isfinite(out[1, 3])


@pytest.mark.parametrize("dtype", TRITON_DTYPES)
@pytest.mark.parametrize("vocab", [77, 1100])
def test_triton_matches_torch(dtype, vocab):
    logits, bitmask = _case(3, vocab, dtype, TRITON_DEVICE)
    assert torch.equal(apply_token_mask_triton(logits.clone(), bitmask), apply_token_mask_torch(logits.clone(), bitmask))


@needs_native
@pytest.mark.parametrize("dtype", NATIVE_DTYPES)
@pytest.mark.parametrize("vocab", [77, 1100, 49152])
def test_native_matches_torch_in_place(dtype, vocab):
    logits, bitmask = _case(5, vocab, dtype)
    expected = apply_token_mask_torch(logits.clone(), bitmask)
    out = apply_token_mask_native(logits, bitmask)
    assert out is logits and torch.equal(out, expected)


@needs_native
def test_native_masks_strided_rows_only_inside_the_row():
    wide = torch.randn(4, 128)
    logits = wide[:, :96]  # rows 128 apart, 96 tokens each
    bitmask = torch.zeros(4, 3, dtype=torch.int32)
    apply_token_mask_native(logits, bitmask)
    assert torch.isinf(wide[:, :96]).all() and torch.isfinite(wide[:, 96:]).all()


def test_dispatcher_refuses_a_bitmask_of_the_wrong_shape():
    with pytest.raises(ValueError, match=r"bitmask must be int32 \[2, 3\]"):
        apply_token_mask(torch.randn(2, 70), torch.zeros(2, 2, dtype=torch.int32))
