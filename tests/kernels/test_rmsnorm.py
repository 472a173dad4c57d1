from __future__ import annotations

import pytest
import torch
from kernel_cases import DEVICES, TRITON_DEVICE, TRITON_DTYPES, assert_close
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from pdserve.kernels.rmsnorm import rmsnorm_torch, rmsnorm_triton

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
