"""GGUFLinear: a weight matmul over a GGUF file's quantized blocks (`--quantization gguf`).

The weight stays as the file stores it (shared/gguf_weights.BlockWeight: Q4_0, Q4_1 or Q8_0 blocks); the
activations and outputs keep the model's dtype (bf16 or fp32). A decode step's few rows go through the native
kernel (kernels/native/gguf.cpp), which widens each block in registers and multiplies it with fp32 activations:
the weight is read once per step at its stored width, 3.2x fewer bytes than bf16 for Q4_1. From DENSE_ROWS
rows on (a prefill chunk, a large batch) the multiply is compute-bound, not read-bound: there the weight is
widened into a transient dense copy and multiplied by torch's GEMM, which does the arithmetic far faster than
the register kernel's fp32 lanes. Without a native build (no C++ compiler) the layer keeps a dense copy and
runs as a plain Linear, and says so in the log.
"""
from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from pdserve.kernels import native
from pdserve.shared.gguf_weights import BlockWeight
from pdserve.shared.linear import Linear

log = logging.getLogger(__name__)

DENSE_ROWS = 8  # from this many rows on, widen the weight and multiply densely (see the module docstring)


class GGUFLinear:
    def __init__(self, weight: BlockWeight, bias: torch.Tensor | None = None, dtype: torch.dtype = torch.bfloat16,
                 fp32_output: bool = False, batch_invariant: bool = False) -> None:
        """`dtype`: the activations' (bf16 or fp32). `fp32_output`: fp32 results whatever x's dtype (the LM
        head's logits). `batch_invariant`: every row count runs the register kernel, whose per-row sums do not
        depend on the other rows (deterministic mode)."""
        self.weight = weight
        self.shape = weight.shape  # [out_features, in_features]
        self.bias = None if bias is None else bias.float().contiguous()
        self.fp32_output = fp32_output
        self.dense_rows = None if batch_invariant else DENSE_ROWS
        self._lib = _native()
        self._fallback = None
        if self._lib is None:
            self._fallback = Linear(weight.dequantize().to(dtype), bias, fp32_output=fp32_output)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x: [T, in] float32 or bfloat16 -> [T, out] of x's dtype (fp32 with fp32_output), plus `residual`."""
        if self._fallback is not None:
            return self._fallback(x, residual)
        out_dtype = torch.float32 if self.fp32_output else x.dtype
        if residual is not None:
            residual = residual.to(out_dtype).contiguous()
        if self.dense_rows is not None and x.shape[0] >= self.dense_rows:
            w = self._lib.gguf_dequantize(self.weight.data, self.weight.qtype, self.shape[1], out_dtype)
            out = F.linear(x.to(out_dtype), w)
            out = out if self.bias is None else out.add_(self.bias)
            return out if residual is None else out.add_(residual)
        return self._lib.gguf_linear(x.contiguous(), self.weight.data, self.weight.qtype, self.shape[1], self.bias,
                                     residual, self.fp32_output)

    @property
    def nbytes(self) -> int:
        """Bytes a pass over the weight reads: its blocks."""
        return self.weight.data.numel()

    def dense_weight(self) -> torch.Tensor:
        """The weight widened to fp32 [out, in]: for inspection, not the hot path."""
        return self.weight.dequantize()


@functools.cache  # one answer per process, and one log line
def _native():
    """The native module where it has the kernel; else None (the dense fallback), logged."""
    try:
        lib = native.load()
    except native.NativeUnavailable as exc:
        why = str(exc)
    else:
        if hasattr(lib, "gguf_linear"):
            return lib
        why = "the build has no gguf_linear"
    log.warning("--quantization gguf: no native kernel (%s); the weights are widened to dense copies", why)
    return None
