"""The GGUF block matmul (kernels/native/gguf.cpp through shared/gguf_linear.py) against its oracle: the gguf
package's own dequantization, then an fp64 matmul. Each block type, every row tiling of the register kernel
(1 to 4 rows at a time and what is left), the dense path past DENSE_ROWS, bf16 and fp32 activations, bias,
residual and fp32 logits; the same to within fp32 rounding. tests/kernels/test_avx2_build.py runs it again
against the AVX2 build."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from pdserve.kernels import native
from pdserve.shared.gguf_linear import DENSE_ROWS, GGUFLinear
from pdserve.shared.gguf_weights import BLOCK_TYPES, BlockWeight

pytestmark = pytest.mark.skipif(not native.available(), reason="no native build (the layer falls back to dense)")

TYPES = sorted(BLOCK_TYPES)


def random_blocks(qtype: int, n: int, k: int, seed: int = 0) -> BlockWeight:
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    data = quants.quantize(w, GGMLQuantizationType(qtype))
    return BlockWeight(qtype, k, torch.from_numpy(np.ascontiguousarray(data)))


@pytest.mark.parametrize("qtype", TYPES, ids=[BLOCK_TYPES[t][0] for t in TYPES])
@pytest.mark.parametrize("rows", [1, 2, 3, 7, DENSE_ROWS + 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_dequantize_then_matmul(qtype, rows, dtype):
    n, k = 67, 192  # an odd row count: the kernel's last pass takes one weight row
    weight = random_blocks(qtype, n, k)
    ref_w = weight.dequantize().double()  # [n, k]
    x = torch.randn(rows, k).to(dtype)
    bias = torch.randn(n)
    residual = torch.randn(rows, n).to(dtype)
    ref = x.double() @ ref_w.t() + bias.double()
    out = GGUFLinear(weight, bias, dtype)(x)
    assert out.dtype == dtype and out.shape == (rows, n)
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), ref, rtol=0, atol=1e-4)
    else:  # rounded once to bf16; past DENSE_ROWS the weight is widened to bf16 too, as a bf16 model holds it
        dense_w = ref_w if rows < DENSE_ROWS else ref_w.to(torch.bfloat16).double()
        torch.testing.assert_close(out.double(), x.double() @ dense_w.t() + bias.double(), rtol=2 ** -7, atol=2e-2)
    logits = GGUFLinear(weight, None, dtype, fp32_output=True)(x, residual)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits.double(), x.double() @ ref_w.t() + residual.double(), rtol=0, atol=1e-4)


def test_rows_do_not_depend_on_the_rows_beside_them():
    """Below DENSE_ROWS (and at every row count when batch-invariant) a row's sums have one order."""
    weight = random_blocks(3, 40, 128, seed=1)
    x = torch.randn(DENSE_ROWS + 5, 128).bfloat16()
    layer = GGUFLinear(weight, None, torch.bfloat16, batch_invariant=True)
    together = layer(x)
    for i in (0, 3, DENSE_ROWS + 4):
        assert torch.equal(layer(x[i:i + 1])[0], together[i])


def test_block_cuts_match_the_dense_cuts():
    """What the loader does to a weight (tensor-parallel cuts, q|k|v fusion, vocabulary padding) gives the same
    weights as doing it to the dequantized matrix; a cut inside a block is refused with a clear error."""
    w = random_blocks(2, 12, 128, seed=2)
    dense = w.dequantize()
    assert torch.equal(w[2:5].dequantize(), dense[2:5])
    assert torch.equal(w[:, 32:96].contiguous().dequantize(), dense[:, 32:96])
    assert torch.equal(w.narrow(1, 64, 64).dequantize(), dense[:, 64:])
    fused = torch.cat([w[:4], w[8:]])
    assert torch.equal(fused.dequantize(), torch.cat([dense[:4], dense[8:]]))
    assert torch.equal(w.new_zeros(3, 128).dequantize(), torch.zeros(3, 128))
    with pytest.raises(ValueError, match="32-column block boundaries"):
        w.narrow(1, 16, 64)
