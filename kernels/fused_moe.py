"""Mixture-of-Experts MLP: every token through its top-k experts' SwiGLU MLPs, summed with its routing weights.

Contract: `x [T, H]`, the experts' weights (`ExpertWeights`: stacked `w13 [E, 2I, H]`, gate rows then up
rows as one `[gate | up]` projection, and `w2 [E, H, I]`), and the router's choice `topk_ids [T, k]` with its
weights `topk_weights [T, k]` (fp32). Returns `[T, H]` in x's dtype:

    out[t] = sum_j topk_weights[t, j] * w2[e] @ (silu(w13[e, :I] @ x[t]) * (w13[e, I:] @ x[t])),  e = topk_ids[t, j]

Work is grouped by expert, never looped over tokens: the T * k (token, expert) pairs are sorted by expert
so that each expert runs one matmul over all of its rows. An expert no token chose costs nothing. The
weighted sum over a token's k experts is done in fp32 and rounded once.

The CPU set runs the torch twin's grouping with each expert's matmuls prepared for the CPU by the model
(`ExpertWeights.gate_up` / `.down`: packed oneDNN weights, the native bf16 GEMV for a few rows). Measured on
a 16-expert, H 1024, I 512 block in bf16 on one thread: 2.2x faster than plain `F.linear` over the stacked
weights for 1-4 tokens, 1.2-1.3x for 32-256; a C++ loop around the same matmuls would add nothing.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from pdserve.kernels.silu_mul import silu_and_mul_native, silu_and_mul_torch, silu_and_mul_triton

Matmul = Callable[[torch.Tensor], torch.Tensor]  # rows [n, in] -> rows [n, out], one expert's weight


@dataclass
class ExpertWeights:
    """Every expert of one MoE layer."""

    w13: torch.Tensor  # [E, 2I, H]
    w2: torch.Tensor  # [E, H, I]
    # Optional, per expert: the same weights prepared for the device (the CPU set uses them when given).
    gate_up: Sequence[Matmul] | None = None
    down: Sequence[Matmul] | None = None

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]


def _check(x: torch.Tensor, experts: ExpertWeights, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> None:
    w13, w2 = experts.w13, experts.w2
    E, two_i, H = w13.shape
    if x.dim() != 2 or x.shape[1] != H or two_i % 2 or w2.shape != (E, H, two_i // 2):
        raise ValueError(f"fused_moe: x {tuple(x.shape)}, w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} "
                         "must be [T, H], [E, 2I, H] and [E, H, I]")
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"fused_moe: topk_ids {tuple(topk_ids.shape)} and topk_weights "
                         f"{tuple(topk_weights.shape)} must both be [T, k] with T = {x.shape[0]}")


def _grouped(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int,
             expert_mlp: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Sort the (token, expert) pairs by expert, run `expert_mlp(e, rows)` once per expert with rows, and sum
    each token's weighted results in fp32."""
    T, k = topk_ids.shape
    flat = topk_ids.reshape(-1)
    order = flat.argsort(stable=True)  # [T*k] pair ids, grouped by expert
    token = order // k  # [T*k] the token of each sorted pair
    xs = x.index_select(0, token)  # [T*k, H]
    ys = torch.empty_like(xs)
    start = 0
    for e, n in enumerate(torch.bincount(flat, minlength=num_experts).tolist()):
        if n:
            ys[start:start + n] = expert_mlp(e, xs[start:start + n])  # [n, H]
            start += n
    weighted = ys.float() * topk_weights.reshape(-1).index_select(0, order).float()[:, None]
    out = torch.zeros(T, x.shape[1], dtype=torch.float32, device=x.device)
    return out.index_add_(0, token, weighted).to(x.dtype)


def fused_moe_torch(x: torch.Tensor, experts: ExpertWeights, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor) -> torch.Tensor:
    """x: [T, H]; experts: w13 [E, 2I, H], w2 [E, H, I]; topk_weights: [T, k] fp32; topk_ids: [T, k].
    Returns [T, H]."""
    _check(x, experts, topk_weights, topk_ids)
    w13, w2 = experts.w13, experts.w2
    return _grouped(x, topk_weights, topk_ids, experts.num_experts,
                    lambda e, rows: F.linear(silu_and_mul_torch(F.linear(rows, w13[e])), w2[e]))


def fused_moe_native(x: torch.Tensor, experts: ExpertWeights, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor) -> torch.Tensor:
    """Same contract as fused_moe_torch (CPU, fp32 or bf16), with the experts' prepared matmuls when given."""
    if experts.gate_up is None or experts.down is None:
        return fused_moe_torch(x, experts, topk_weights, topk_ids)
    _check(x, experts, topk_weights, topk_ids)
    gate_up, down = experts.gate_up, experts.down
    return _grouped(x, topk_weights, topk_ids, experts.num_experts,
                    lambda e, rows: down[e](silu_and_mul_native(gate_up[e](rows))))


class ExpertBlocks:
    """The sorted (token, expert) pairs cut into blocks of `block_m` rows, each block owned by one expert.

    Computed on the device without reading anything back, so a step launches its kernels at once: the grid is
    the upper bound `cdiv(T*k, block_m) + E` blocks, and the blocks past the last real one are marked idle."""

    def __init__(self, topk_ids: torch.Tensor, num_experts: int, block_m: int) -> None:
        flat = topk_ids.reshape(-1)
        pairs = flat.numel()
        counts = torch.bincount(flat, minlength=num_experts)  # [E]
        padded = (counts + block_m - 1) // block_m * block_m  # every expert's rows fill whole blocks
        pad_end = padded.cumsum(0)
        order = flat.argsort(stable=True)
        expert = flat.index_select(0, order)
        rank = torch.arange(pairs, device=flat.device) - (counts.cumsum(0) - counts).index_select(0, expert)
        self.num_blocks = triton.cdiv(pairs, block_m) + num_experts
        # [num_blocks * block_m] pair id of each row; `pairs` marks padding rows.
        self.rows = torch.full((self.num_blocks * block_m,), pairs, dtype=torch.int32, device=flat.device)
        self.rows[(pad_end - padded).index_select(0, expert) + rank] = order.to(torch.int32)
        block_starts = torch.arange(self.num_blocks, device=flat.device) * block_m
        # [num_blocks] expert of each block; num_experts for the idle tail.
        self.expert = torch.searchsorted(pad_end, block_starts, right=True).to(torch.int32)
        self.pairs = pairs
        self.block_m = block_m


@triton.jit
def _moe_matmul_kernel(a_ptr, w_ptr, c_ptr, rows_ptr, expert_ptr, weights_ptr,
                       N, K, num_experts, num_pairs, a_row_div,
                       stride_a, stride_we, stride_wn, stride_wk, stride_c,
                       MUL_WEIGHT: tl.constexpr, NATIVE_DOT: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """C[pair] = A[pair // a_row_div] @ W[expert].T for one block of an expert's pairs and BLOCK_N columns,
    optionally scaled by the pair's routing weight."""
    block = tl.program_id(0)
    expert = tl.load(expert_ptr + block).to(tl.int64)
    if expert >= num_experts:  # the idle tail of the grid
        return
    m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(rows_ptr + m).to(tl.int64)
    row_mask = pair < num_pairs
    a_row = pair // a_row_div
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_mask = kk < K
        a = tl.load(a_ptr + a_row[:, None] * stride_a + kk[None, :], mask=row_mask[:, None] & k_mask[None, :],
                    other=0.0)  # [BLOCK_M, BLOCK_K]
        w = tl.load(w_ptr + expert * stride_we + n[None, :] * stride_wn + kk[:, None] * stride_wk,
                    mask=k_mask[:, None] & n_mask[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
        if NATIVE_DOT:
            acc += tl.dot(a, w)
        else:
            acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
    if MUL_WEIGHT:
        acc *= tl.load(weights_ptr + pair, mask=row_mask, other=0.0).to(tl.float32)[:, None]
    tl.store(c_ptr + pair[:, None] * stride_c + n[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=row_mask[:, None] & n_mask[None, :])


def _moe_matmul(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, blocks: ExpertBlocks, a_row_div: int,
                weights: torch.Tensor | None) -> None:
    N, K = w.shape[1], w.shape[2]
    native = a.is_cuda and a.dtype in (torch.float16, torch.bfloat16)
    block_n = min(64, max(16, triton.next_power_of_2(N)))
    block_k = min(64, max(16, triton.next_power_of_2(K)))
    grid = (blocks.num_blocks, triton.cdiv(N, block_n))
    _moe_matmul_kernel[grid](a, w, out, blocks.rows, blocks.expert, weights if weights is not None else out,
                             N, K, w.shape[0], blocks.pairs, a_row_div,
                             a.stride(0), w.stride(0), w.stride(1), w.stride(2), out.stride(0),
                             MUL_WEIGHT=weights is not None, NATIVE_DOT=native,
                             BLOCK_M=blocks.block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4)


def fused_moe_triton(x: torch.Tensor, experts: ExpertWeights, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor) -> torch.Tensor:
    """Same contract as fused_moe_torch: two grouped matmul launches around one SwiGLU launch."""
    _check(x, experts, topk_weights, topk_ids)
    w13, w2 = experts.w13, experts.w2
    T, k = topk_ids.shape
    H = x.shape[1]
    if T == 0:
        return torch.empty_like(x)
    x = x if x.stride(-1) == 1 else x.contiguous()
    # Small blocks while decoding: an expert then holds a handful of rows, and a 64-row block would be mostly padding.
    blocks = ExpertBlocks(topk_ids, w13.shape[0], 16 if T * k <= 64 * w13.shape[0] else 64)
    gate_up = torch.empty(T * k, w13.shape[1], dtype=x.dtype, device=x.device)  # [T*k, 2I], row = pair id
    _moe_matmul(x, w13, gate_up, blocks, k, None)
    act = silu_and_mul_triton(gate_up)  # [T*k, I]
    down = torch.empty(T * k, H, dtype=torch.float32, device=x.device)  # weighted, summed over k below
    _moe_matmul(act, w2, down, blocks, 1, topk_weights.reshape(-1).float().contiguous())
    return down.view(T, k, H).sum(1).to(x.dtype)
