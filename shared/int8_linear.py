"""Int8Linear: a weight matmul in w8a8 int8 (`--quantization w8a8_int8`, SGLang's name for the scheme).

Weights are quantized once, symmetrically per output channel; activations at every call, per row and
asymmetrically (pdserve.kernels.int8_matmul). Where activation maxima observed on calibration inputs are given,
the layer is smoothed first (SmoothQuant, alpha 0.5): input column j is divided by
s_j = sqrt(max|x_j| / max|w_j|) and the weight's column j multiplied by it, which moves the few outlier
channels of a transformer's residual stream (BERT's reach 30x the median) from the activations, quantized per
row, into the weights, quantized per channel. On a CPU with AVX512-VNNI the int8 matmul is oneDNN's, 2.4-4x
faster than the packed fp32 one at MiniLM's shapes; the two passes around it are native kernels.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.kernels import int8_matmul as ops
from pdserve.kernels import native

SMOOTHING_ALPHA = 0.5
PACK_N = 32  # output channels per block of the fused kernel's packed weight


class Int8Linear:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 input_absmax: torch.Tensor | None = None) -> None:
        """weight [out, in] in any float dtype; `input_absmax` [in]: each input column's largest magnitude seen
        on calibration inputs (None: no smoothing)."""
        w = weight.float()
        self.shape = weight.shape
        self.inv_smooth = None
        if input_absmax is not None:
            smooth = (input_absmax.float().clamp_min(1e-5) ** SMOOTHING_ALPHA
                      / w.abs().amax(0).clamp_min(1e-5) ** (1 - SMOOTHING_ALPHA))
            w = w * smooth
            self.inv_smooth = (1.0 / smooth).contiguous()
        self.col_scale = (w.abs().amax(1).clamp_min(1e-12) / 127).contiguous()
        q = torch.round(w / self.col_scale[:, None]).clamp(-127, 127).to(torch.int8)
        self.col_sum = (q.float().sum(1) * self.col_scale).contiguous()  # folds the activations' zero point out
        self.bias = None if bias is None else bias.float().contiguous()
        self._fused = _fused_kernel(weight.device)
        if self._fused is not None:
            self._pack(q)
        else:
            self.weight_t = q.t()  # [in, out]: the layout torch._int_mm takes, without a copy
            self._quantize, self._dequantize = _kernels(weight.device)

    def _pack(self, q: torch.Tensor) -> None:
        """The fused kernel's layout (kernels/native/int8.cpp): [N / 32][K / 4][32][4], padded with zeros, and the
        per-channel vectors padded to the packed channels."""
        n, k = q.shape
        pn, pk = -(-n // PACK_N) * PACK_N, -(-k // 4) * 4
        padded = torch.zeros(pn, pk, dtype=torch.int8)
        padded[:n, :k] = q
        self.packed = padded.view(pn // PACK_N, PACK_N, pk // 4, 4).permute(0, 2, 1, 3).contiguous()
        self.sum128 = padded.sum(1, dtype=torch.int32) * 128  # taken back out of the unsigned codes' sums
        pad = pn - n
        self.col_scale, self.col_sum = F.pad(self.col_scale, (0, pad)), F.pad(self.col_sum, (0, pad))
        self.bias = None if self.bias is None else F.pad(self.bias, (0, pad))

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x: [T, in] float32 or bfloat16 -> [T, out] of x's dtype, plus `residual` [T, out] when given (one pass
        fewer)."""
        if self._fused is not None:
            return self._fused(x, self.packed, self.shape[0], self.col_scale, self.col_sum, self.sum128, self.bias,
                               residual, self.inv_smooth)
        dtype = x.dtype
        q, scale, zero = self._quantize(x.float().contiguous(), self.inv_smooth)
        acc = ops.int8_mm(q, self.weight_t)
        out = self._dequantize(acc, scale, zero, self.col_scale, self.col_sum, self.bias,
                               None if residual is None else residual.float())
        return out.to(dtype)


    @property
    def nbytes(self) -> int:
        """Bytes a pass over the weight reads: one per weight, and the per-channel vectors."""
        return self.shape.numel() + 12 * self.shape[0]


def _fused_kernel(device: torch.device):
    """The native one-call layer, where this CPU has AVX512-VNNI; else None (two passes around torch._int_mm)."""
    if device.type != "cpu" or not native.available():
        return None
    lib = native.load()
    return lib.int8_linear if lib.int8_linear_supported() else None


def _kernels(device: torch.device):
    if device.type == "cuda":
        return ops.quantize_rows_triton, ops.dequantize_rows_triton
    if device.type == "cpu" and native.available():
        return ops.quantize_rows_native, ops.dequantize_rows_native
    return ops.quantize_rows_torch, ops.dequantize_rows_torch


class AbsMaxObserver:
    """Wraps a linear layer during calibration: records each input column's largest magnitude, then calls it."""

    def __init__(self, linear) -> None:
        self.linear = linear
        self.absmax: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        seen = x.detach().abs().amax(0).float()
        self.absmax = seen if self.absmax is None else torch.maximum(self.absmax, seen)
        out = self.linear(x)
        return out if residual is None else out + residual
