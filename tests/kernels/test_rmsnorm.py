from __future__ import annotations

import pytest
import torch
from kernel_cases import (DEVICES, NATIVE_DTYPES, TRITON_DEVICE, TRITON_DTYPES, assert_close,
                          error_in_child, needs_native)
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from pdserve.kernels.rmsnorm import rmsnorm_native, rmsnorm_torch, rmsnorm_triton

EPS = 1e-5


def hf_norm(weight: torch.Tensor) -> LlamaRMSNorm:
    norm = LlamaRMSNorm(weight.shape[0], eps=EPS).to(device=weight.device, dtype=weight.dtype)
    norm.weight.data.copy_(weight)
    return norm


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_reference_is_transformers_llama_rmsnorm(device, dtype):
    torch.manual_seed(0)
    x = torch.randn(5, 72, device=device).to(dtype)
    res = torch.randn(5, 72, device=device).to(dtype)
    w = torch.randn(72, device=device).to(dtype)
    norm = hf_norm(w)
    assert torch.equal(rmsnorm_torch(x, w, EPS), norm(x))
    out, new_res = rmsnorm_torch(x, w, EPS, res)
    assert torch.equal(new_res, x + res)
    assert torch.equal(out, norm(x + res))


@pytest.mark.parametrize("dtype", TRITON_DTYPES)
@pytest.mark.parametrize("hidden", [64, 72])
def test_triton_matches_torch(dtype, hidden):
    torch.manual_seed(1)
    # Rows of a wider buffer: the kernel must follow the row stride.
    x = torch.randn(4, hidden + 8, device=TRITON_DEVICE).to(dtype)[:, :hidden]
    res = torch.randn(4, hidden, device=TRITON_DEVICE).to(dtype)
    w = (1 + 0.1 * torch.randn(hidden, device=TRITON_DEVICE)).to(dtype)
    res_before = res.clone()
    assert_close(rmsnorm_triton(x, w, EPS), rmsnorm_torch(x, w, EPS), dtype)
    out, new_res = rmsnorm_triton(x, w, EPS, res)
    ref_out, ref_res = rmsnorm_torch(x, w, EPS, res)
    assert torch.equal(new_res, ref_res)  # the residual add is one rounding in both
    assert_close(out, ref_out, dtype)
    assert torch.equal(res, res_before)  # inputs are left alone


@needs_native
@pytest.mark.parametrize("dtype", NATIVE_DTYPES)
@pytest.mark.parametrize("hidden", [64, 72, 2056])
def test_native_matches_torch(dtype, hidden):
    torch.manual_seed(1)
    # 37 rows: more than one of the kernel's parallel chunks; x and the residual are rows of wider buffers.
    x = (3 * torch.randn(37, hidden + 8)).to(dtype)[:, :hidden]
    res = torch.randn(37, hidden + 24).to(dtype)[:, 16:16 + hidden]
    w = (1 + 0.1 * torch.randn(hidden)).to(dtype)
    x_before, res_before = x.clone(), res.clone()
    out = rmsnorm_native(x, w, EPS)
    assert out.dtype == dtype and out.shape == x.shape
    assert_close(out, rmsnorm_torch(x, w, EPS), dtype)
    out, new_res = rmsnorm_native(x, w, EPS, res)
    ref_out, ref_res = rmsnorm_torch(x, w, EPS, res)
    assert torch.equal(new_res, ref_res)  # the residual add is one rounding in both
    assert_close(out, ref_out, dtype)
    assert torch.equal(x, x_before) and torch.equal(res, res_before)  # inputs are left alone


@needs_native
def test_native_accepts_no_rows():
    x, w = torch.randn(0, 64), torch.ones(64)
    assert rmsnorm_native(x, w, EPS).shape == (0, 64)
    out, new_res = rmsnorm_native(x, w, EPS, x)
    assert out.shape == new_res.shape == (0, 64)


# case: (x, weight, residual, what the error says)
BAD_INPUTS = {
    "fp16": lambda x, w: (x.half(), w.half(), None, "float32 or bfloat16"),
    "weight dtype differs": lambda x, w: (x, w.bfloat16(), None, "weight"),
    "weight length differs": lambda x, w: (x, w[:-1], None, "weight"),
    "3-d x": lambda x, w: (x[None], w, None, "[T, H]"),
    "residual shape differs": lambda x, w: (x, w, x[:-1], "residual"),
    "residual dtype differs": lambda x, w: (x, w, x.bfloat16(), "residual"),
}


@needs_native
@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_native_refuses_bad_inputs(case):
    x, weight, residual, match = BAD_INPUTS[case](torch.randn(4, 64), torch.ones(64))
    message = error_in_child(lambda: rmsnorm_native(x, weight, EPS, residual))
    assert message.startswith(("RuntimeError", "ValueError")) and match in message, message
