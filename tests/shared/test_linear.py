"""Linear: the model's weight matmuls, packed once on CPU, give what F.linear gives."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.shared.linear import Linear


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("tokens", [1, 7, 64])
def test_bf16_on_cpu_is_packed_and_bit_identical_to_f_linear(bias, tokens):
    torch.manual_seed(tokens)
    weight = torch.randn(96, 48, dtype=torch.bfloat16)
    b = torch.randn(96, dtype=torch.bfloat16) if bias else None
    x = torch.randn(tokens, 48, dtype=torch.bfloat16)
    lin = Linear(weight, b)
    assert lin.is_packed  # the fast path is taken, not silently skipped
    assert torch.equal(lin(x), F.linear(x, weight, b))


def test_fp32_matches_f_linear_and_the_weight_reads_back_exactly():
    torch.manual_seed(0)
    weight, x = torch.randn(64, 32), torch.randn(5, 32)
    lin = Linear(weight)
    torch.testing.assert_close(lin(x), F.linear(x, weight))
    assert torch.equal(lin.dense_weight(), weight)
    assert lin.shape == (64, 32) and lin.nbytes == 64 * 32 * 4


def test_fp16_works_whether_or_not_this_cpu_can_pack_it():
    torch.manual_seed(1)
    weight, x = torch.randn(32, 16, dtype=torch.float16), torch.randn(3, 16, dtype=torch.float16)
    lin = Linear(weight)
    torch.testing.assert_close(lin(x), F.linear(x, weight))
    assert torch.equal(lin.dense_weight(), weight)
