from __future__ import annotations

import pytest
import torch
from kernel_cases import DEVICES, NATIVE_DTYPES, TRITON_DEVICE, TRITON_DTYPES, assert_close, needs_native

from pdserve.kernels.fused_moe import ExpertBlocks, ExpertWeights, fused_moe_native, fused_moe_torch, fused_moe_triton


def make_case(tokens: int, num_experts: int, top_k: int, hidden: int, inter: int, dtype: torch.dtype,
              device: str, idle: tuple[int, ...] = (), seed: int = 0):
    """Random inputs whose routing leaves the experts in `idle` without tokens and the others ragged."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) / inter ** 0.5
    scores = torch.rand(tokens, num_experts, generator=gen)
    scores[:, list(idle)] = -1.0
    weights, ids = scores.topk(top_k, dim=-1)
    weights = torch.softmax(weights, dim=-1)
    to = dict(device=device)
    experts = ExpertWeights(w13.to(dtype=dtype, **to), w2.to(dtype=dtype, **to))
    return x.to(dtype=dtype, **to), experts, weights.to(**to), ids.to(**to)


def per_token_reference(x, experts, weights, ids) -> torch.Tensor:
    """float64, one token and one chosen expert at a time: the definition the grouped kernels must meet."""
    w13, w2 = experts.w13, experts.w2
    inter = w2.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = w13[e].double().cpu() @ x[t].double().cpu()
            act = torch.nn.functional.silu(h[:inter]) * h[inter:]
            out[t] += float(weights[t, j]) * (w2[e].double().cpu() @ act)
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tokens,num_experts,top_k,idle", [(1, 4, 2, ()), (13, 8, 2, (0, 5)), (40, 6, 3, (2,)),
                                                           (7, 4, 1, (1, 2, 3))])
def test_torch_matches_per_token_reference(device, tokens, num_experts, top_k, idle):
    x, experts, weights, ids = make_case(tokens, num_experts, top_k, 48, 24, torch.float64, device, idle)
    out = fused_moe_torch(x, experts, weights, ids)
    assert out.dtype == x.dtype and out.shape == x.shape
    torch.testing.assert_close(out.cpu(), per_token_reference(x, experts, weights, ids))


def test_torch_accepts_no_tokens():
    x, experts, weights, ids = make_case(0, 4, 2, 16, 8, torch.float32, "cpu")
    assert fused_moe_torch(x, experts, weights, ids).shape == (0, 16)


def test_blocks_hold_each_pair_once_under_its_expert():
    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [3, 1], [1, 0]])  # expert 2 idle, expert 3 over one block
    blocks = ExpertBlocks(ids, num_experts=4, block_m=2)
    rows, experts = blocks.rows.view(-1, 2).tolist(), blocks.expert.tolist()
    seen = []
    for block, expert in zip(rows, experts):
        real = [p for p in block if p < ids.numel()]
        if expert == 4:
            assert real == []  # the idle tail of the grid holds no pairs
        seen += real
        assert all(int(ids.view(-1)[p]) == expert for p in real)
    assert sorted(seen) == list(range(ids.numel()))
    assert 2 not in experts  # an expert without tokens owns no block


@pytest.mark.parametrize("dtype", TRITON_DTYPES)
@pytest.mark.parametrize("tokens,num_experts,top_k,hidden,inter,idle", [
    (5, 4, 2, 32, 16, (3,)),  # decode-sized: a few rows per expert, one idle
    (37, 8, 2, 48, 40, (1, 6)),  # ragged groups over block edges; hidden and inter not powers of two
])
def test_triton_matches_torch(dtype, tokens, num_experts, top_k, hidden, inter, idle):
    x, experts, weights, ids = make_case(tokens, num_experts, top_k, hidden, inter, dtype, TRITON_DEVICE, idle)
    out = fused_moe_triton(x, experts, weights, ids)
    assert out.dtype == dtype and out.shape == x.shape
    assert_close(out, fused_moe_torch(x, experts, weights, ids), dtype)


def test_triton_wide_prefill_uses_large_blocks():
    # Enough pairs per expert for 64-row blocks, with one expert holding a single token.
    x, experts, weights, ids = make_case(140, 2, 1, 16, 16, torch.float32, TRITON_DEVICE)
    ids[0, 0], ids[1:, 0] = 1, 0
    assert_close(fused_moe_triton(x, experts, weights, ids), fused_moe_torch(x, experts, weights, ids), torch.float32)


@needs_native
@pytest.mark.parametrize("dtype", NATIVE_DTYPES)
def test_native_with_packed_experts_matches_torch(dtype):
    from pdserve.shared.linear import Linear

    x, experts, weights, ids = make_case(9, 6, 2, 64, 32, dtype, "cpu", idle=(4,))
    packed = ExpertWeights(experts.w13, experts.w2, gate_up=[Linear(w) for w in experts.w13],
                           down=[Linear(w) for w in experts.w2])
    for rows in (1, 3, 9):  # 1-4 rows take the bf16 GEMV, more the packed oneDNN matmul
        args = (x[:rows], weights[:rows], ids[:rows])
        out = fused_moe_native(args[0], packed, *args[1:])
        assert_close(out, fused_moe_torch(args[0], experts, *args[1:]), dtype)


@pytest.mark.parametrize("fn", [fused_moe_torch, fused_moe_triton])
def test_mismatched_shapes_are_refused(fn):
    x, experts, weights, ids = make_case(3, 4, 2, 16, 8, torch.float32, TRITON_DEVICE)
    with pytest.raises(ValueError, match="must be"):
        fn(x, ExpertWeights(experts.w13, experts.w2[:, :, :4]), weights, ids)
    with pytest.raises(ValueError, match="topk_ids"):
        fn(x, experts, weights, ids[:2])
