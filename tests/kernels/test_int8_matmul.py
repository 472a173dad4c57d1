from __future__ import annotations

import pytest
import torch
from kernel_cases import TRITON_DEVICE, error_in_child, needs_native

from pdserve.kernels import native
from pdserve.kernels.int8_matmul import (dequantize_rows_native, dequantize_rows_torch, dequantize_rows_triton,
                                         int8_mm, quantize_rows_native, quantize_rows_torch, quantize_rows_triton)
from pdserve.shared import int8_linear
from pdserve.shared.int8_linear import Int8Linear


def activations(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Rows of different ranges, an outlier column, a constant row and a row of GELU-like outputs."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=gen) * torch.rand(rows, 1, generator=gen) * 4
    x[:, 3] *= 25
    x[1] = 0.75
    x[2] = torch.nn.functional.gelu(x[2])
    return x


def dequantize_definition(acc, scale, zero, col_scale, col_sum, bias, residual) -> torch.Tensor:
    out = acc.double() * scale.double()[:, None] * col_scale.double() + zero.double()[:, None] * col_sum.double()
    return out + bias.double() + residual.double()


@pytest.mark.parametrize("smooth", [False, True])
def test_torch_reference_reconstructs_each_row_within_half_a_step(smooth):
    x = activations(9, 70)
    inv_smooth = torch.rand(70) + 0.5 if smooth else None
    q, scale, zero = quantize_rows_torch(x, inv_smooth)
    assert q.dtype == torch.int8 and scale.shape == zero.shape == (9,)
    target = x * inv_smooth if smooth else x
    error = (scale[:, None] * q.float() + zero[:, None] - target).abs()
    assert (error <= scale[:, None] * 0.5 + 1e-5).all()
    assert q.min() == -128 and q.max() == 127  # every non-constant row spans the whole int8 range
    if not smooth:  # a constant row comes back exactly
        assert torch.equal(q[1], torch.full((70,), -128, dtype=torch.int8)) and zero[1] == 0.75 and scale[1] == 0


def test_torch_reference_dequantizes_by_definition():
    gen = torch.Generator().manual_seed(1)
    acc = torch.randint(-300_000, 300_000, (6, 40), dtype=torch.int32, generator=gen)
    args = (acc, torch.rand(6, generator=gen), torch.randn(6, generator=gen), torch.rand(40, generator=gen),
            torch.randn(40, generator=gen), torch.randn(40, generator=gen), torch.randn(6, 40, generator=gen))
    torch.testing.assert_close(dequantize_rows_torch(*args).double(), dequantize_definition(*args), atol=0, rtol=1e-6)


def test_the_zero_point_folds_out_of_the_integer_matmul():
    """Quantize, multiply in int8, dequantize: the float matmul of the quantized operands, exactly as stated."""
    x = activations(12, 64, seed=2)
    w = torch.randn(24, 64) * 0.1
    col_scale = w.abs().amax(1) / 127
    wq = torch.round(w / col_scale[:, None]).to(torch.int8)
    col_sum = wq.float().sum(1) * col_scale
    q, scale, zero = quantize_rows_torch(x)
    acc = int8_mm(q, wq.t())
    assert torch.equal(acc.long(), q.long() @ wq.t().long())
    got = dequantize_rows_torch(acc, scale, zero, col_scale, col_sum)
    x_hat = scale[:, None].double() * q.double() + zero[:, None].double()
    expected = x_hat @ (wq.double() * col_scale.double()[:, None]).t()
    torch.testing.assert_close(got.double(), expected, atol=1e-4, rtol=1e-5)
    assert (got - x @ w.t()).abs().max() < 0.05 * (x @ w.t()).abs().max()  # and close to the float matmul


@pytest.mark.parametrize("cols", [70, 1100])
@pytest.mark.parametrize("smooth", [False, True])
def test_triton_matches_torch(cols, smooth):
    x = activations(5, cols + 8)[:, :cols].to(TRITON_DEVICE)  # strided rows
    inv_smooth = (torch.rand(cols) + 0.5).to(TRITON_DEVICE) if smooth else None
    expected = quantize_rows_torch(x, inv_smooth)
    got = quantize_rows_triton(x, inv_smooth)
    assert torch.equal(got[0], expected[0])
    torch.testing.assert_close(got[1], expected[1], atol=0, rtol=1e-6)
    torch.testing.assert_close(got[2], expected[2], atol=1e-6, rtol=1e-6)
    acc = torch.randint(-300_000, 300_000, (5, cols), dtype=torch.int32).to(TRITON_DEVICE)
    vecs = [torch.rand(5), torch.randn(5), torch.rand(cols), torch.randn(cols), torch.randn(cols)]
    args = (acc, *[v.to(TRITON_DEVICE) for v in vecs], torch.randn(5, cols).to(TRITON_DEVICE))
    torch.testing.assert_close(dequantize_rows_triton(*args), dequantize_rows_torch(*args), atol=1e-3, rtol=1e-6)
    torch.testing.assert_close(dequantize_rows_triton(*args[:5]), dequantize_rows_torch(*args[:5]),
                               atol=1e-3, rtol=1e-6)


@needs_native
@pytest.mark.parametrize("cols", [7, 64, 384, 1100])  # a tail only, whole vectors, MiniLM's width, a ragged tail
@pytest.mark.parametrize("smooth", [False, True])
def test_native_matches_torch(cols, smooth):
    x = activations(37, cols + 8)[:, :cols]  # strided rows
    inv_smooth = torch.rand(cols) + 0.5 if smooth else None
    expected = quantize_rows_torch(x, inv_smooth)
    got = quantize_rows_native(x, inv_smooth)
    assert torch.equal(got[0], expected[0])
    torch.testing.assert_close(got[1], expected[1], atol=0, rtol=1e-6)
    torch.testing.assert_close(got[2], expected[2], atol=1e-6, rtol=1e-6)
    acc = torch.randint(-300_000, 300_000, (37, cols), dtype=torch.int32)
    args = (acc, torch.rand(37), torch.randn(37), torch.rand(cols), torch.randn(cols), torch.randn(cols),
            torch.randn(37, cols + 3)[:, :cols])
    torch.testing.assert_close(dequantize_rows_native(*args), dequantize_rows_torch(*args), atol=1e-3, rtol=1e-6)
    torch.testing.assert_close(dequantize_rows_native(*args[:5]), dequantize_rows_torch(*args[:5]),
                               atol=1e-3, rtol=1e-6)


@needs_native
def test_native_accepts_no_rows():
    q, scale, zero = quantize_rows_native(torch.randn(0, 32))
    assert q.shape == (0, 32) and scale.shape == zero.shape == (0,)
    out = dequantize_rows_native(torch.zeros(0, 8, dtype=torch.int32), scale, zero, torch.ones(8), torch.ones(8))
    assert out.shape == (0, 8)


BAD_INPUTS = {  # case: (call, what the error says)
    "bf16 activations": (lambda: quantize_rows_native(torch.randn(3, 16).bfloat16()), "float32"),
    "strided columns": (lambda: quantize_rows_native(torch.randn(3, 32)[:, ::2]), "contiguous rows"),
    "short smoothing": (lambda: quantize_rows_native(torch.randn(3, 16), torch.ones(15)), "inv_smooth"),
    "float accumulator": (lambda: dequantize_rows_native(torch.zeros(2, 4), torch.ones(2), torch.ones(2),
                                                         torch.ones(4), torch.ones(4)), "int32"),
    "short column scales": (lambda: dequantize_rows_native(torch.zeros(2, 4, dtype=torch.int32), torch.ones(2),
                                                           torch.ones(2), torch.ones(3), torch.ones(4)), "col_scale"),
    "residual shape": (lambda: dequantize_rows_native(torch.zeros(2, 4, dtype=torch.int32), torch.ones(2),
                                                      torch.ones(2), torch.ones(4), torch.ones(4), None,
                                                      torch.zeros(2, 5)), "residual"),
}


@needs_native
@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_native_refuses_bad_inputs(case):
    call, match = BAD_INPUTS[case]
    message = error_in_child(call)
    assert message.startswith("RuntimeError") and match in message, message


def test_int8_mm_sums_extreme_codes_exactly():
    """Codes at the ends of int8's range: oneDNN's AVX2 GEMM saturates on them (measured: sums off by 10^5), so
    int8_mm must not hand them to it there (the AVX2 build's run holds oneDNN to AVX2)."""
    gen = torch.Generator().manual_seed(3)
    q = torch.where(torch.rand(32, 576, generator=gen) < 0.5, 127, -128).to(torch.int8)
    w = torch.where(torch.rand(576, 96, generator=gen) < 0.5, 127, -127).to(torch.int8)
    assert torch.equal(int8_mm(q, w).long(), q.long() @ w.long())


# ---------------------------------------------------------------- the fused layer (Int8Linear)


def _fused_available() -> bool:
    try:
        return native.load().int8_linear_supported()
    except native.NativeUnavailable:
        return False


FUSED = _fused_available()
needs_fused = pytest.mark.skipif(not FUSED, reason="no native int8 kernel in this build (it needs AVX512-VNNI or "
                                                   "AVX2): Int8Linear runs two passes around int8_mm here, "
                                                   "tested below on every CPU")


def two_pass(monkeypatch, weight, bias=None, absmax=None) -> Int8Linear:
    """The layer as it is built on a CPU without the fused kernel (AVX2, or no native build)."""
    with monkeypatch.context() as patch:
        patch.setattr(int8_linear, "_fused_kernel", lambda device: None)
        return Int8Linear(weight, bias, absmax)


def by_definition(weight, bias, x, residual) -> torch.Tensor:
    """y = dequantized (quantized x) @ (quantized w)^T, in float64 from the same codes."""
    col_scale = weight.abs().amax(1).clamp_min(1e-12) / 127
    wq = torch.round(weight / col_scale[:, None]).clamp(-127, 127)
    q, scale, zero = quantize_rows_torch(x.float())
    acc = (q.double() @ wq.double().t()).round().to(torch.int32)
    return dequantize_definition(acc, scale, zero, col_scale, wq.sum(1) * col_scale, bias, residual.float())


# Ragged shapes: a channel tail (N % 32), a K tail (K % 4), and the default model's widths.
SHAPES = [(37, 13), (96, 64), (70, 130), (960, 576), (576, 1536)]


@pytest.mark.parametrize("n,k", SHAPES)
def test_two_pass_layer_computes_the_definition(monkeypatch, n, k):
    gen = torch.Generator().manual_seed(n)
    weight, bias = torch.randn(n, k, generator=gen) * 0.05, torch.randn(n, generator=gen)
    x, residual = activations(19, k), torch.randn(19, n, generator=gen)
    layer = two_pass(monkeypatch, weight, bias)
    torch.testing.assert_close(layer(x, residual), by_definition(weight, bias, x, residual).float(),
                               atol=2e-4, rtol=1e-5)
    out = layer(x.bfloat16(), residual.bfloat16())
    assert out.dtype == torch.bfloat16  # a bf16 model's layer answers in bf16


@needs_fused
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("rows", [1, 2, 7, 8, 9, 37])
def test_native_fused_layer_equals_the_two_pass_one(monkeypatch, n, k, rows):
    """The same codes and integer sums, the same epilogue: bit for bit, in fp32 and bf16, with every option."""
    gen = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(n, k, generator=gen) * 0.05, torch.randn(n, generator=gen)
    absmax = torch.rand(k, generator=gen) * 10 + 0.1
    x, residual = activations(max(rows, 3), k + 5)[:rows, :k], torch.randn(rows, n, generator=gen)  # strided rows
    for b, smooth in ((None, None), (bias, absmax)):
        fused, plain = Int8Linear(weight, b, smooth), two_pass(monkeypatch, weight, b, smooth)
        assert fused.packed is not None
        assert torch.equal(fused(x), plain(x))
        assert torch.equal(fused(x, residual), plain(x, residual))
        xb, rb = x.bfloat16(), residual.bfloat16()
        assert torch.equal(fused(xb, rb), plain(xb, rb))


@needs_fused
def test_native_fused_layer_rows_do_not_depend_on_their_batch():
    """Each row is quantized and summed on its own: alone or among 45 others, the same bits (what the
    deterministic mode needs from a quantized model)."""
    weight = torch.randn(200, 96) * 0.05
    layer = Int8Linear(weight)
    x = activations(45, 96).bfloat16()
    batch = layer(x)
    for i in (0, 7, 8, 44):
        assert torch.equal(layer(x[i:i + 1]), batch[i:i + 1])


@needs_fused
def test_native_fused_layer_accepts_no_rows():
    assert Int8Linear(torch.randn(40, 24))(torch.randn(0, 24)).shape == (0, 40)


def _fused_call(layer: Int8Linear, x, residual=None, packed=None):
    col_scale, col_sum, sum128, bias = layer._vectors
    return native.load().int8_linear(x, layer.packed if packed is None else packed, layer.shape[0], col_scale,
                                     col_sum, sum128, bias, residual, None)


_LAYER = Int8Linear(torch.randn(40, 24)) if FUSED else None
FUSED_BAD_INPUTS = {  # case: (call, what the error says)
    "int8 activations": (lambda: _fused_call(_LAYER, torch.zeros(2, 24, dtype=torch.int8)), "float32 or bfloat16"),
    "wrong width": (lambda: _fused_call(_LAYER, torch.randn(2, 32)), "packed"),
    "flat weight": (lambda: _fused_call(_LAYER, torch.randn(2, 24), packed=torch.zeros(40, 24, dtype=torch.int8)),
                    "packed"),
    "residual dtype": (lambda: _fused_call(_LAYER, torch.randn(2, 24), torch.zeros(2, 40, dtype=torch.bfloat16)),
                       "residual"),
}


@needs_fused
@pytest.mark.parametrize("case", list(FUSED_BAD_INPUTS))
def test_native_fused_layer_refuses_bad_inputs(case):
    call, match = FUSED_BAD_INPUTS[case]
    message = error_in_child(call)
    assert message.startswith("RuntimeError") and match in message, message
