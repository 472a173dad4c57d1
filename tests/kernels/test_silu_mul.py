from __future__ import annotations

import pytest
import torch
from kernel_cases import DEVICES, TRITON_DEVICE, TRITON_DTYPES, assert_close

from pdserve.kernels.silu_mul import silu_and_mul_torch, silu_and_mul_triton


@pytest.mark.parametrize("device", DEVICES)
def test_torch_reference_is_swiglu(device):
    torch.manual_seed(0)
    x = torch.randn(3, 2 * 40, dtype=torch.float64, device=device)
    gate, up = x[:, :40], x[:, 40:]
    expected = gate / (1 + torch.exp(-gate)) * up
    torch.testing.assert_close(silu_and_mul_torch(x), expected)


@pytest.mark.parametrize("dtype", TRITON_DTYPES)
@pytest.mark.parametrize("inter", [48, 1100])  # 1100 spans two column blocks with a ragged tail
def test_triton_matches_torch(dtype, inter):
    torch.manual_seed(1)
    x = (3 * torch.randn(3, 2 * inter + 16, device=TRITON_DEVICE)).to(dtype)[:, :2 * inter]  # strided rows
    assert_close(silu_and_mul_triton(x), silu_and_mul_torch(x), dtype)
