from __future__ import annotations

import pytest
import torch
from kernel_cases import DEVICES, TRITON_DEVICE, TRITON_DTYPES, assert_close, make_paged_kv, naive_attention

from pdserve.kernels.extend_attention import extend_attention_torch, extend_attention_triton

D = 32
# (cached prefix, new tokens) per sequence: a fresh prompt, a chunk after a prefix hit,
# a single new token, and a prompt longer than one query block.
SEQS = [(0, 13), (21, 6), (16, 1), (3, 35)]


def make_case(seqs, page_size, group, dtype, device, num_kv_heads=2):
    lens = [p + n for p, n in seqs]
    kv = make_paged_kv(lens, page_size, num_kv_heads, D, dtype, device)
    ext = [n for _, n in seqs]
    starts = [sum(ext[:b]) for b in range(len(ext))]
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(sum(ext), num_kv_heads * group, D, generator=gen).to(dtype=dtype, device=device)
    extend_lens = torch.tensor(ext, dtype=torch.int32, device=device)
    q_start = torch.tensor(starts, dtype=torch.int32, device=device)
    return q, kv, extend_lens, q_start


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("group", [1, 3])
def test_torch_reference_matches_naive(device, page_size, group):
    q, kv, extend_lens, q_start = make_case(SEQS, page_size, group, torch.float32, device)
    out = extend_attention_torch(q, kv.k_cache, kv.v_cache, kv.page_table, kv.seq_lens, extend_lens, q_start,
                                 D ** -0.5)
    assert out.shape == q.shape and out.dtype == q.dtype
    row = 0
    for b, (prefix, n) in enumerate(SEQS):
        expected = naive_attention(q[row:row + n], kv.keys[b], kv.values[b], prefix, D ** -0.5)
        torch.testing.assert_close(out[row:row + n].double().cpu(), expected, atol=1e-5, rtol=1e-5)
        row += n


def test_torch_reference_in_bf16_stays_close():
    q, kv, extend_lens, q_start = make_case(SEQS, 16, 3, torch.bfloat16, "cpu")
    out = extend_attention_torch(q, kv.k_cache, kv.v_cache, kv.page_table, kv.seq_lens, extend_lens, q_start,
                                 D ** -0.5)
    assert out.dtype == torch.bfloat16
    row = 0
    for b, (prefix, n) in enumerate(SEQS):
        expected = naive_attention(q[row:row + n], kv.keys[b], kv.values[b], prefix, D ** -0.5)
        torch.testing.assert_close(out[row:row + n].double(), expected, atol=2e-2, rtol=2e-2)
        row += n


@pytest.mark.parametrize("dtype", TRITON_DTYPES)
@pytest.mark.parametrize("page_size,group", [(16, 3), (1, 1)])
def test_triton_matches_torch(dtype, page_size, group):
    q, kv, extend_lens, q_start = make_case(SEQS, page_size, group, dtype, TRITON_DEVICE)
    args = (q, kv.k_cache, kv.v_cache, kv.page_table, kv.seq_lens, extend_lens, q_start, D ** -0.5)
    assert_close(extend_attention_triton(*args), extend_attention_torch(*args), dtype)
