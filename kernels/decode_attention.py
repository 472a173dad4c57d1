"""Decode attention: one new query token per sequence against its paged KV cache.

The new token's K/V is already stored, so sequence b attends to its first `seq_lens[b]`
cached tokens, found page by page through `page_table[b]`. GQA: query head h reads kv
head `h // (Hq // Hk)`. Scores and softmax are fp32; the output is in q's dtype.

The Triton path is split-K (flash decoding): stage one gives each (sequence, kv head,
split) program one slice of the sequence and all query heads of that kv head, writing a
partial output and its log-sum-exp; stage two merges, in order, the splits that hold tokens.
Split boundaries are fixed (`_split_len`); how many programs share a sequence's splits is sized
to the batch. Splits past a sequence's end are neither computed nor read, so no host sync on
lengths is needed.

The torch path gathers each sequence's pages into a padded batch. What that needs from the
page table and lengths (rows grouped by length, page indices, padding mask) is the same for
every layer of a step: `plan_decode_torch` computes it once and each layer's call reuses it.
Small groups run their matmuls in fp32 as well, which on CPU is faster than bf16 there.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pdserve.kernels import native

_MAX_SPLITS = 64
_SPLIT_LEN_GPU = 256


@dataclass(frozen=True)
class _PaddedGroup:
    rows: torch.Tensor | None  # [b] int64 rows of the batch in this group; None: all rows, in order
    pages: torch.Tensor  # [b * num_pages] int64 pages to gather, page-table order
    bias: torch.Tensor  # [b, 1, 1, N] fp32 added to the scores: 0 within each row's length, -inf past it
    num_tokens: int  # N: the group's padded length, a whole number of pages
    in_fp32: bool  # small enough that fp32 matmuls beat the cache dtype's (see plan_decode_torch)


@dataclass(frozen=True)
class DecodePlan:
    groups: list[_PaddedGroup]


def plan_decode_torch(page_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int) -> DecodePlan:
    """Everything decode_attention_torch derives from the page table and lengths, for all layers of a step."""
    groups = _length_groups(seq_lens.tolist())
    planned = []
    for rows in groups:
        index = None if len(groups) == 1 else torch.tensor(rows, device=page_table.device)
        table = page_table if index is None else page_table[index]
        lens = seq_lens if index is None else seq_lens[index]
        num_pages = triton.cdiv(int(lens.max()), page_size)
        n = num_pages * page_size
        pages = table[:, :num_pages].clamp(min=0).reshape(-1).long()
        padding = torch.arange(n, device=lens.device)[None, :] >= lens[:, None]  # [b, N]
        bias = torch.zeros(padding.shape, device=lens.device).masked_fill_(padding, float("-inf"))
        # bf16 batched matmuls on CPU carry a fixed cost per call that dominates small problems: fp32 is
        # faster until the group is both wide and long (measured from 1 x 4096 to 64 x 64 tokens).
        in_fp32 = len(rows) <= 8 or len(rows) * n <= 2048
        planned.append(_PaddedGroup(index, pages, bias[:, None, None, :], n, in_fp32))
    return DecodePlan(planned)


def decode_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           page_table: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           plan: DecodePlan | None = None) -> torch.Tensor:
    """q: [B, Hq, D]; caches: [P, S, Hk, D] (strided); page_table: [B, max_pages]; seq_lens: [B].

    `plan`: from plan_decode_torch on the same page_table and seq_lens (computed here when None)."""
    plan = plan or plan_decode_torch(page_table, seq_lens, k_cache.shape[1])
    if len(plan.groups) == 1:
        return _padded_decode_attention(q, k_cache, v_cache, plan.groups[0], scale)
    out = torch.empty_like(q)
    for group in plan.groups:
        out[group.rows] = _padded_decode_attention(q[group.rows], k_cache, v_cache, group, scale)
    return out


def _length_groups(lens: list[int], slack: int = 2, min_len: int = 256) -> list[list[int]]:
    """Rows grouped so that padding a group to its longest sequence at most doubles its work.

    One long sequence among short ones would otherwise make every sequence of the batch gather and
    attend over the long one's length. Sequences up to `min_len` tokens always share a group.
    """
    order = sorted(range(len(lens)), key=lens.__getitem__)
    groups: list[list[int]] = []
    floor = 0
    for row in order:
        if not groups or lens[row] > max(slack * floor, min_len):
            groups.append([])
            floor = lens[row]
        groups[-1].append(row)
    return groups


def _padded_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: _PaddedGroup,
                             scale: float) -> torch.Tensor:
    B, num_heads, D = q.shape
    n, num_kv_heads, q_dtype = group.num_tokens, k_cache.shape[2], q.dtype
    # Padded gather of every sequence's pages (index_select is far faster than fancy indexing on CPU), then
    # kv heads outermost: each (sequence, kv head) becomes one contiguous [N, D] matrix. Batched matmuls over
    # the strided gather would copy it inside each call, several times slower than this one copy.
    dtype = torch.float32 if group.in_fp32 else k_cache.dtype
    k = k_cache.index_select(0, group.pages).view(B, n, num_kv_heads, D).transpose(1, 2)
    v = v_cache.index_select(0, group.pages).view(B, n, num_kv_heads, D).transpose(1, 2)
    k, v = _contiguous_as(k, dtype), _contiguous_as(v, dtype)  # [B, Hk, N, D]
    # GQA as a batched matmul: the query heads of one kv head are rows of one small matrix. With a single
    # query row per head this is several times faster on CPU than scaled_dot_product_attention.
    q = q.reshape(B, num_kv_heads, num_heads // num_kv_heads, D).to(dtype)
    scores = torch.add(group.bias, torch.matmul(q, k.transpose(2, 3)), alpha=scale)  # [B, Hk, G, N] fp32
    probs = torch.softmax(scores, dim=-1).to(dtype)
    return torch.matmul(probs, v).view(B, num_heads, D).to(q_dtype)  # [B, Hq, D]


def _contiguous_as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One copy that both converts and lays out contiguously (`to` alone keeps a permuted layout)."""
    return x.contiguous() if x.dtype == dtype else x.to(dtype, memory_format=torch.contiguous_format)


def decode_attention_native(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            page_table: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                            plan: None = None) -> torch.Tensor:
    """Same contract as decode_attention_torch (CPU, fp32 or bf16): reads each sequence's pages in place,
    one (sequence, kv head) per task, with no gather and no padding."""
    return native.load().decode_attention(q, k_cache, v_cache, page_table, seq_lens, scale)


def plan_decode_native(page_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int) -> None:
    """The native kernel reads the page table and lengths directly: nothing to plan."""
    return None


@triton.jit
def _decode_split_kernel(q_ptr, k_ptr, v_ptr, pt_ptr, lens_ptr, o_ptr, lse_ptr,
                         stride_qb, stride_qh,
                         stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
                         stride_pt, stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
                         qk_scale, group, head_dim, page_size, split_len, programs,
                         NATIVE_DOT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_D: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    seq_len = tl.load(lens_ptr + b)
    used = tl.cdiv(seq_len, split_len)  # splits holding tokens; the merge reads no other

    g = tl.arange(0, BLOCK_H)
    heads = kv_head * group + g
    h_mask = g < group
    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=h_mask[:, None] & d_mask[None, :], other=0.0)
    if not NATIVE_DOT:
        q = q.to(tl.float32)

    # Program p computes splits p, p + programs, ...: how many programs share a sequence changes nothing in
    # what each split computes.
    for split in range(tl.program_id(2), used, programs):
        start = split * split_len
        end = tl.minimum(start + split_len, seq_len)
        m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
        for n0 in range(start, end, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            n_mask = n < end
            page = tl.load(pt_ptr + b * stride_pt + n // page_size, mask=n_mask, other=0).to(tl.int64)
            offset = n % page_size
            kv_mask = n_mask[:, None] & d_mask[None, :]
            k = tl.load(k_ptr + (page * stride_kp + offset * stride_ks + kv_head * stride_kh)[:, None] + d[None, :],
                        mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
            v = tl.load(v_ptr + (page * stride_vp + offset * stride_vs + kv_head * stride_vh)[:, None] + d[None, :],
                        mask=kv_mask, other=0.0)
            if NATIVE_DOT:
                s = tl.dot(q, tl.trans(k))
            else:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            s = tl.where(n_mask[None, :], s * qk_scale, float("-inf"))  # [BLOCK_H, BLOCK_N], log2 domain
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if NATIVE_DOT:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            else:
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            m_i = m_new
        # Every split read here holds at least one token, so l_i > 0.
        tl.store(o_ptr + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + d[None, :],
                 acc / l_i[:, None], mask=h_mask[:, None] & d_mask[None, :])
        tl.store(lse_ptr + b * stride_lb + heads * stride_lh + split, m_i + tl.log2(l_i), mask=h_mask)


@triton.jit
def _decode_merge_kernel(o_part_ptr, lse_ptr, lens_ptr, out_ptr,
                         stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
                         split_len, head_dim, BLOCK_D: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim
    # Only the splits that hold tokens, in order: how many splits the launch had (a graph bucket's page table
    # is wider than an eager step's) then changes nothing in the sum, bit for bit.
    used = tl.maximum(tl.cdiv(tl.load(lens_ptr + b), split_len), 1)
    lse_row = lse_ptr + b * stride_lb + h * stride_lh
    top = tl.load(lse_row)  # split 0 always holds a token (seq_len >= 1), so the max is finite
    for s in range(1, used):
        top = tl.maximum(top, tl.load(lse_row + s))
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    total = 0.0
    for s in range(0, used):
        w = tl.exp2(tl.load(lse_row + s) - top)
        acc += w * tl.load(o_part_ptr + b * stride_pb + h * stride_ph + s * stride_ps + d, mask=d_mask, other=0.0)
        total += w
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, (acc / total).to(out_ptr.dtype.element_ty), mask=d_mask)


def _programs(device: torch.device, batch_kv: int, splits: int) -> int:
    """Programs per (sequence, kv head): enough for about two per SM across the batch, at most one per split."""
    target = 2 * torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
    return max(1, min(triton.cdiv(target, max(batch_kv, 1)), splits))


def _split_len(on_gpu: bool, max_len: int, block_n: int, num_splits: int | None) -> int:
    """Tokens per split. Fixed per device kind rather than sized to the batch or the page table's width, so a
    sequence is cut (and rounded) the same way in any batch and in any decode graph bucket: greedy output does
    not change with graphs on or off. Past _MAX_SPLITS * that length (16k tokens on a GPU) splits grow longer."""
    if num_splits:  # tests choose the count, to exercise the merge
        return triton.cdiv(triton.cdiv(max_len, num_splits), block_n) * block_n
    split_len = _SPLIT_LEN_GPU if on_gpu else 2 * block_n  # the interpreter: short splits, the merge exercised
    return max(split_len, triton.cdiv(triton.cdiv(max_len, _MAX_SPLITS), block_n) * block_n)


def decode_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            page_table: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                            plan: None = None, num_splits: int | None = None) -> torch.Tensor:
    """Same contract as decode_attention_torch (it needs no plan); `num_splits` overrides the split heuristic."""
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("KV cache views must be contiguous in head_dim")
    B, num_heads, D = q.shape
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty((B, num_heads, D), dtype=q.dtype, device=q.device)
    if B == 0:
        return out
    on_gpu = q.device.type == "cuda"
    block_n = 64 if on_gpu else 16
    # Upper bound on any sequence's length, known without reading seq_lens on the host.
    max_len = page_table.shape[1] * page_size
    split_len = _split_len(on_gpu, max_len, block_n, num_splits)
    splits = triton.cdiv(max_len, split_len)
    o_part = torch.empty((B, num_heads, splits, D), dtype=torch.float32, device=q.device)
    lse = torch.empty((B, num_heads, splits), dtype=torch.float32, device=q.device)
    block_d = max(16, triton.next_power_of_2(D))
    native = on_gpu and q.dtype in (torch.float16, torch.bfloat16)
    programs = _programs(q.device, B * num_kv_heads, splits)
    _decode_split_kernel[(B, num_kv_heads, programs)](
        q, k_cache, v_cache, page_table, seq_lens, o_part, lse,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), page_table.stride(0), o_part.stride(0), o_part.stride(1), o_part.stride(2),
        lse.stride(0), lse.stride(1),
        scale * 1.4426950408889634, group, D, page_size, split_len, programs,
        NATIVE_DOT=native, BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n, BLOCK_D=block_d,
        num_warps=4, num_stages=2)
    _decode_merge_kernel[(B, num_heads)](
        o_part, lse, seq_lens, out, o_part.stride(0), o_part.stride(1), o_part.stride(2), lse.stride(0),
        lse.stride(1), out.stride(0), out.stride(1), split_len, D, BLOCK_D=block_d, num_warps=1)
    return out


def plan_decode_triton(page_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int) -> None:
    """The Triton kernel reads the page table and lengths directly: nothing to plan."""
    return None
