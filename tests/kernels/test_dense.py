"""The fixed-order dense kernel (kernels/native/dense.cpp, through shared.linear.FixedOrderMatmul): x W^T + bias
(+ residual) within fp32 rounding of a float64 reference, fp32 logits from bf16 operands, and every row the same
bits at every row count: what deterministic mode rests on, on every CPU the build runs on."""
from __future__ import annotations

import pytest
import torch

from pdserve.kernels import native
from pdserve.shared.linear import FixedOrderMatmul, Linear

pytestmark = pytest.mark.skipif(not native.available(), reason="needs the native CPU kernels")

DTYPES = [torch.bfloat16, torch.float32]


def layer(n: int, k: int, dtype: torch.dtype, bias: bool = False, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 0.05).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    return w, b


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("n, k", [(96, 576), (40, 77), (33, 3), (576, 1536)])  # partial blocks, odd K
def test_native_matches_a_float64_reference_within_one_rounding(dtype, bias, n, k):
    w, b = layer(n, k, dtype, bias)
    x = torch.randn(37, k).to(dtype)
    exact = x.double() @ w.double().T + (b.double() if bias else 0)
    got = Linear(w, b, batch_invariant=True)(x)
    assert got.dtype == dtype and got.shape == (37, n)
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the output's own rounding
    torch.testing.assert_close(got.double(), exact, rtol=tol, atol=tol)
    logits = Linear(w, b, fp32_output=True)(x)  # fp32 sums, never rounded to bf16
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits.double(), exact, rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fp32_output", [False, True])
@pytest.mark.parametrize("n, k", [(160, 576), (72, 1536)])  # the default model's inner widths
def test_a_row_has_the_same_bits_at_every_row_count_from_1_to_300(dtype, fp32_output, n, k):
    w, b = layer(n, k, dtype, bias=True)
    lin = Linear(w, b, batch_invariant=True, fp32_output=fp32_output)
    x = torch.randn(300, k).to(dtype)
    alone = torch.cat([lin(x[r:r + 1]) for r in range(300)])
    for m in range(1, 301):
        assert torch.equal(lin(x[:m]), alone[:m]), f"{m} rows"
    # Rows taken from anywhere in a batch, and strided views of a wider tensor, too.
    assert torch.equal(lin(x[117:260]), alone[117:260])
    wide = torch.randn(300, k + 64).to(dtype)
    wide[:, :k] = x
    assert torch.equal(lin(wide[:, :k]), alone)


@pytest.mark.parametrize("threads", [1, 2])
def test_the_thread_count_changes_no_bit(threads):
    w, b = layer(256, 576, torch.bfloat16, bias=True)
    lin = Linear(w, b, batch_invariant=True)
    x = torch.randn(50, 576).bfloat16()
    before = torch.get_num_threads()
    want = lin(x)
    try:
        torch.set_num_threads(threads)
        assert torch.equal(lin(x), want)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_residual_is_added_in_fp32_before_the_one_rounding(dtype):
    w, _ = layer(48, 64, dtype)
    x, residual = torch.randn(9, 64).to(dtype), torch.randn(9, 48).to(dtype)
    lin = Linear(w, batch_invariant=True)
    want = (x.float() @ w.float().T + residual.float()).to(dtype)
    torch.testing.assert_close(lin(x, residual), want, rtol=1e-2, atol=1e-2)
    assert torch.equal(lin(x, residual)[:4], lin(x[:4], residual[:4]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_weight_reads_back_exactly(dtype):
    w, _ = layer(45, 67, dtype)
    assert torch.equal(Linear(w, batch_invariant=True).dense_weight(), w)


def test_an_empty_batch_gives_an_empty_result():
    w, _ = layer(40, 64, torch.bfloat16)
    assert Linear(w, batch_invariant=True)(torch.empty(0, 64, dtype=torch.bfloat16)).shape == (0, 40)


def test_the_native_op_refuses_what_does_not_fit_its_weight():
    lib = native.load()
    w, _ = layer(40, 64, torch.bfloat16)
    fixed = FixedOrderMatmul.make(w, None)
    with pytest.raises(RuntimeError, match="packed"):
        lib.dense_linear(torch.randn(3, 96).bfloat16(), fixed.packed, 40, None, None, False)
    with pytest.raises(RuntimeError, match="packed"):
        lib.dense_linear(torch.randn(3, 64), fixed.packed, 40, None, None, False)  # fp32 x, bf16 weight
    with pytest.raises(RuntimeError, match="bias"):
        lib.dense_linear(torch.randn(3, 64).bfloat16(), fixed.packed, 40, torch.zeros(40), None, False)
    with pytest.raises(RuntimeError, match="residual"):
        lib.dense_linear(torch.randn(3, 64).bfloat16(), fixed.packed, 40, None, torch.zeros(3, 40), False)
