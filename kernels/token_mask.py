"""Grammar token mask: ban, in place, every token whose bit is clear in a packed bitmask.

Contract: `logits` [B, V] (fp32 or bf16, rows contiguous) and `bitmask` [B, ceil(V/32)] int32, where bit t % 32
of word t // 32 says token t is allowed (xgrammar's layout). Disallowed tokens become -inf; allowed ones are
left bit for bit as they were. The torch twin unpacks the bits into a full boolean mask, which costs ~7 ms for
32 rows of a 49k vocabulary on two CPU cores: more than a fifth of a decode step; the native op reads each word
once and is ~20x faster.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels import native


def apply_token_mask_torch(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).reshape(bitmask.shape[0], -1)[:, :logits.shape[1]]
    return logits.masked_fill_(allowed == 0, float("-inf"))


def apply_token_mask_native(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    native.load().apply_token_mask(logits, bitmask)
    return logits


@triton.jit
def _token_mask_kernel(logits_ptr, mask_ptr, stride_logits, stride_mask, V, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < V
    words = tl.load(mask_ptr + row * stride_mask + cols // 32, mask=inside, other=-1)
    banned = ((words >> (cols % 32)) & 1) == 0
    tl.store(logits_ptr + row * stride_logits + cols, float("-inf"), mask=inside & banned)


def apply_token_mask_triton(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    B, V = logits.shape
    if B == 0:
        return logits
    block = 1024
    _token_mask_kernel[(B, triton.cdiv(V, block))](logits, bitmask, logits.stride(0), bitmask.stride(0), V,
                                                     BLOCK=block)
    return logits


def apply_token_mask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """The implementation for logits' device: Triton on CUDA, native on CPU where built, else the torch twin."""
    if bitmask.shape != (logits.shape[0], (logits.shape[1] + 31) // 32) or bitmask.dtype != torch.int32:
        raise ValueError(f"bitmask must be int32 [{logits.shape[0]}, {(logits.shape[1] + 31) // 32}], "
                         f"got {bitmask.dtype} {list(bitmask.shape)}")
    bitmask = bitmask.to(logits.device, non_blocking=True)
    if logits.is_cuda:
        return apply_token_mask_triton(logits, bitmask)
    if native.available() and logits.dtype in (torch.float32, torch.bfloat16) and logits.stride(1) == 1:
        return apply_token_mask_native(logits, bitmask.contiguous())
    return apply_token_mask_torch(logits, bitmask)
