"""Int8Linear: a weight matmul in w8a8 int8 (`--quantization w8a8_int8`, SGLang's name for the scheme).

Weights are quantized once, symmetrically per output channel; activations at every call, per row and
asymmetrically (pdserve.kernels.int8_matmul). Where activation maxima observed on calibration inputs are given,
the layer is smoothed first (SmoothQuant, alpha 0.5): input column j is divided by
s_j = sqrt(max|x_j| / max|w_j|) and the weight's column j multiplied by it, which moves the few outlier
channels of a transformer's residual stream (BERT's reach 30x the median) from the activations, quantized per
row, into the weights, quantized per channel.

The layer is one native call where the build has it (kernels/native/int8.cpp): the rows quantized, multiplied
with a packed copy of the weight and dequantized without leaving the kernel, in VPDPBUSD on AVX512-VNNI and in
VPMADDWD on AVX2. The integer sums are exact either way, so it gives the two-pass path's outputs bit for bit. On
the default model's shapes: with VNNI 0.55-0.65x the packed bf16 layers' time at 1 to 512 rows; on AVX2 0.35x
fp32's at one row and 0.67x at 32. Without AVX512-VNNI oneDNN's int8 GEMM is not an option: its AVX2 kernel
multiplies with VPMADDUBSW, whose 16-bit pair sums saturate (sums off by up to 10^5 measured on random codes).
Elsewhere (no native build, CUDA) two passes around kernels.int8_matmul.int8_mm, native, Triton or torch
kernels before and after it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.kernels import int8_matmul as ops
from pdserve.kernels import native
from pdserve.shared.huge_pages import place

SMOOTHING_ALPHA = 0.5
PACK_N = 32  # output channels per block of the fused kernel's packed weight


class Int8Linear:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 input_absmax: torch.Tensor | None = None, batched: bool = False, fp32_output: bool = False) -> None:
        """weight [out, in] in any float dtype; `input_absmax` [in]: each input column's largest magnitude seen
        on calibration inputs (None: no smoothing). `batched`: calls carry thousands of rows (an encoder's batch
        of whole sequences), where oneDNN's int8 GEMM, wherever it sums exactly, beats the fused kernel, made
        for a decode step's few rows (all-MiniLM-L6-v2, 64 x 128 tokens, AVX512-VNNI: 126-139 against 103-119
        sequences/s); the outputs are the same bit for bit. `fp32_output`: fp32 results whatever x's dtype (the
        LM head's logits; x's codes are the same either way, since a bf16 row is widened exactly)."""
        w = weight.float()
        self.shape = weight.shape
        self.fp32_output = fp32_output
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
        onednn = batched and weight.device.type == "cpu" and ops.int_mm_exact_on_cpu()
        self._fused = None if onednn else _fused_kernel(weight.device)
        self.packed = self._pack(q) if self._fused is not None else None
        if self._fused is None:
            self.weight_t = q.t()  # [in, out]: the layout torch._int_mm takes, without a copy
            self._quantize, self._dequantize = _kernels(weight.device)

    def _pack(self, q: torch.Tensor) -> torch.Tensor:
        """The fused kernel's weight: [N / 32][K / 4][32][4], padded with zeros; and its per-channel vectors
        padded to the packed channels."""
        n, k = q.shape
        pn, pk = -(-n // PACK_N) * PACK_N, -(-k // 4) * 4
        padded = torch.zeros(pn, pk, dtype=torch.int8)
        padded[:n, :k] = q
        pad = (0, pn - n)
        self._vectors = (F.pad(self.col_scale, pad), F.pad(self.col_sum, pad),
                         padded.sum(1, dtype=torch.int32) * 128,  # taken back out of the unsigned codes' sums
                         None if self.bias is None else F.pad(self.bias, pad))
        return place(padded.view(pn // PACK_N, PACK_N, pk // 4, 4).permute(0, 2, 1, 3).contiguous())  # 2 MiB pages

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x: [T, in] float32 or bfloat16 -> [T, out] of x's dtype, plus `residual` [T, out] when given (one pass
        fewer)."""
        if self.fp32_output:
            x = x.float()
            residual = None if residual is None else residual.float()
        if self._fused is not None:
            col_scale, col_sum, sum128, bias = self._vectors
            return self._fused(x, self.packed, self.shape[0], col_scale, col_sum, sum128, bias, residual,
                               self.inv_smooth)
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
    """The native one-call layer, where the build has it (AVX512-VNNI or AVX2); else None (two passes)."""
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
