from __future__ import annotations

import pytest
import torch
from kernel_cases import DEVICES, TRITON_DEVICE, TRITON_DTYPES, assert_close, make_paged_kv, naive_attention

from pdserve.kernels.decode_attention import decode_attention_torch, decode_attention_triton, plan_decode_torch

D = 32
LENS = [1, 16, 37, 5]  # a lone token, an exact page, several pages with a ragged tail


def make_case(lens, page_size, group, dtype, device, num_kv_heads=2):
    kv = make_paged_kv(lens, page_size, num_kv_heads, D, dtype, device)
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(len(lens), num_kv_heads * group, D, generator=gen).to(dtype=dtype, device=device)
    return q, kv


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("group", [1, 3])
def test_torch_reference_matches_naive(device, page_size, group):
    q, kv = make_case(LENS, page_size, group, torch.float32, device)
    out = decode_attention_torch(q, kv.k_cache, kv.v_cache, kv.page_table, kv.seq_lens, D ** -0.5)
    assert out.shape == q.shape and out.dtype == q.dtype
    for b, n in enumerate(LENS):
        # The decode token is the last cached one: it sits at position n - 1 and sees all n tokens.
        expected = naive_attention(q[b:b + 1], kv.keys[b], kv.values[b], n - 1, D ** -0.5)
        torch.testing.assert_close(out[b:b + 1].double().cpu(), expected, atol=1e-5, rtol=1e-5)


# A small batch runs its matmuls in fp32; a wide and long one in the cache's bf16. Both must be right.
@pytest.mark.parametrize("lens,in_fp32", [(LENS, True), ([200 + 7 * i for i in range(12)], False)])
def test_torch_reference_in_bf16_stays_close(lens, in_fp32):
    q, kv = make_case(lens, 16, 3, torch.bfloat16, "cpu")
    plan = plan_decode_torch(kv.page_table, kv.seq_lens, 16)
    assert [g.in_fp32 for g in plan.groups] == [in_fp32]
    out = decode_attention_torch(q, kv.k_cache, kv.v_cache, kv.page_table, kv.seq_lens, D ** -0.5, plan)
    assert out.dtype == torch.bfloat16
    for b, n in enumerate(lens):
        expected = naive_attention(q[b:b + 1], kv.keys[b], kv.values[b], n - 1, D ** -0.5)
        torch.testing.assert_close(out[b:b + 1].double(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", TRITON_DTYPES)
@pytest.mark.parametrize("page_size,group,num_splits", [(16, 3, None), (1, 1, None), (16, 1, 1), (1, 3, 4)])
def test_triton_matches_torch(dtype, page_size, group, num_splits):
    q, kv = make_case(LENS, page_size, group, dtype, TRITON_DEVICE)
    args = (q, kv.k_cache, kv.v_cache, kv.page_table, kv.seq_lens, D ** -0.5)
    assert_close(decode_attention_triton(*args, num_splits=num_splits), decode_attention_torch(*args), dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_torch_reference_with_one_long_sequence_among_short_ones(device):
    # Short and long rows are attended in separate groups; every row must still see exactly its own tokens.
    lens = [3, 600, 17, 290, 5, 1200]
    q, kv = make_case(lens, 16, 3, torch.float32, device)
    out = decode_attention_torch(q, kv.k_cache, kv.v_cache, kv.page_table, kv.seq_lens, D ** -0.5)
    for b, n in enumerate(lens):
        expected = naive_attention(q[b:b + 1], kv.keys[b], kv.values[b], n - 1, D ** -0.5)
        torch.testing.assert_close(out[b:b + 1].double().cpu(), expected, atol=1e-5, rtol=1e-5)


def test_length_groups_bound_padding_and_keep_short_rows_together():
    from pdserve.kernels.decode_attention import _length_groups

    assert _length_groups([40, 100, 7, 255]) == [[2, 0, 1, 3]]
    groups = _length_groups([50, 1100, 60, 300, 2500])
    assert sorted(r for g in groups for r in g) == [0, 1, 2, 3, 4]
    assert groups[0] == [0, 2]  # the short rows together; 300 would more than double their work
    lens = [50, 1100, 60, 300, 2500]
    for g in groups:
        assert max(lens[r] for r in g) <= max(2 * min(lens[r] for r in g), 256)
