from __future__ import annotations

import pytest
import torch
from kernel_cases import (DEVICES, NATIVE_DTYPES, TRITON_DEVICE, TRITON_DTYPES, assert_close,
                          error_in_child, needs_native)

from pdserve.kernels.silu_mul import silu_and_mul_native, silu_and_mul_torch, silu_and_mul_triton


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


@needs_native
@pytest.mark.parametrize("dtype", NATIVE_DTYPES)
@pytest.mark.parametrize("inter", [48, 1100])
def test_native_matches_torch(dtype, inter):
    torch.manual_seed(1)
    x = (3 * torch.randn(19, 2 * inter + 16)).to(dtype)[:, :2 * inter]  # strided rows
    # Gates far out in both tails, where the kernel's exp saturates.
    x[0, :10] = torch.tensor([-1e4, -100.0, -88.0, -87.0, -20.0, -0.0, 20.0, 88.0, 100.0, 1e4]).to(dtype)
    out = silu_and_mul_native(x)
    assert out.dtype == dtype and out.shape == (19, inter)
    assert_close(out, silu_and_mul_torch(x), dtype)
    if dtype == torch.float32:  # and against the float64 formula the torch twin is checked with
        gate, up = x[:, :inter].double(), x[:, inter:].double()
        torch.testing.assert_close(out.double(), gate / (1 + torch.exp(-gate)) * up, atol=2e-5, rtol=2e-5)


@needs_native
def test_native_accepts_no_rows():
    assert silu_and_mul_native(torch.randn(0, 96)).shape == (0, 48)


BAD_INPUTS = {  # case: (x, what the error says)
    "fp16": (lambda: torch.randn(3, 96).half(), "float32 or bfloat16"),
    "odd width": (lambda: torch.randn(3, 95), "[T, 2I]"),
    "strided columns": (lambda: torch.randn(3, 192)[:, ::2], "[T, 2I]"),
}


@needs_native
@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_native_refuses_bad_inputs(case):
    make, match = BAD_INPUTS[case]
    x = make()
    message = error_in_child(lambda: silu_and_mul_native(x))
    assert message.startswith(("RuntimeError", "ValueError")) and match in message, message
