from __future__ import annotations

import pytest
import torch
from kernel_cases import (DEVICES, NATIVE_DTYPES, NATIVE_HEADS, REF_TOL, TRITON_DEVICE, TRITON_DTYPES, assert_close,
                          error_in_child, ints, make_paged_kv, naive_attention, needs_native,
                          strided_q, torch_threads)

from pdserve.kernels.decode_attention import (decode_attention_native, decode_attention_torch,
                                              decode_attention_triton, plan_decode_torch)

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


@pytest.mark.parametrize("dtype", TRITON_DTYPES)
def test_triton_gives_a_row_the_same_bits_in_any_batch_and_page_table_width(dtype):
    # A decode graph bucket pads the batch and reads a page table as wide as the whole context; an eager step
    # reads only its own rows and pages. Greedy output must not depend on which ran, so neither may one bit.
    lens = [70, 3, 150]  # several splits (32 tokens each in the interpreter, 256 on a GPU) and a single one
    q, kv = make_case(lens, 16, 3, dtype, TRITON_DEVICE)
    args = (kv.k_cache, kv.v_cache)
    narrow = decode_attention_triton(q, *args, kv.page_table, kv.seq_lens, D ** -0.5)
    wide_table = torch.nn.functional.pad(kv.page_table, (0, 100))  # 1,600 more tokens of columns, all unused
    pad_q = torch.cat([q, q[:1]])  # a padded row, as a bucket adds
    wide = decode_attention_triton(pad_q, *args, torch.cat([wide_table, wide_table[:1]]),
                                   torch.cat([kv.seq_lens, kv.seq_lens[:1]]), D ** -0.5)
    assert torch.equal(wide[:3], narrow)
    for b in range(3):  # each row alone
        alone = decode_attention_triton(q[b:b + 1], *args, kv.page_table[b:b + 1], kv.seq_lens[b:b + 1], D ** -0.5)
        assert torch.equal(alone, narrow[b:b + 1])


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


def ragged_lens(page_size: int) -> list[int]:
    """A lone token, exactly one page, both sides of the page boundary, and several hundred tokens."""
    return [1, page_size, max(page_size - 1, 1), page_size + 1, 333]


@needs_native
@pytest.mark.parametrize("dtype", NATIVE_DTYPES)
@pytest.mark.parametrize("page_size", [1, 16, 5])
@pytest.mark.parametrize("head_dim,group", NATIVE_HEADS)
def test_native_matches_naive(dtype, page_size, head_dim, group):
    lens = ragged_lens(page_size)
    kv = make_paged_kv(lens, page_size, 2, head_dim, dtype, "cpu")
    q = strided_q(len(lens), 2 * group, 2, head_dim, dtype)
    scale = head_dim ** -0.5
    out = decode_attention_native(q, kv.k_cache, kv.v_cache, kv.page_table, kv.seq_lens, scale)
    assert out.shape == q.shape and out.dtype == dtype
    for b, n in enumerate(lens):
        expected = naive_attention(q[b:b + 1], kv.keys[b], kv.values[b], n - 1, scale)
        tol = REF_TOL[dtype]
        torch.testing.assert_close(out[b:b + 1].double(), expected, atol=tol, rtol=tol)


@needs_native
@pytest.mark.parametrize("dtype", NATIVE_DTYPES)
@pytest.mark.parametrize("head_dim,group", [(64, 3), (128, 8), (80, 4)])
def test_native_sequence_output_does_not_depend_on_the_batch(dtype, head_dim, group):
    # The deterministic mode needs a sequence's decode bits to be the same whatever else is decoding. One
    # thread makes the kernel take both of its work splits on any machine: one task per kv head for a lone
    # sequence, one task per sequence for a batch.
    lens = [70, 1, 16, 333, 17, 5]
    kv = make_paged_kv(lens, 16, 2, head_dim, dtype, "cpu")
    q = strided_q(len(lens), 2 * group, 2, head_dim, dtype)
    args = (kv.k_cache, kv.v_cache)
    with torch_threads(1):
        alone = decode_attention_native(q[:1], *args, kv.page_table[:1], kv.seq_lens[:1], 0.125)
        batched = decode_attention_native(q, *args, kv.page_table, kv.seq_lens, 0.125)
    reordered = decode_attention_native(q.flip(0), *args, kv.page_table.flip(0), kv.seq_lens.flip(0), 0.125)
    assert torch.equal(batched[0], alone[0])
    assert torch.equal(reordered.flip(0), batched)


@needs_native
def test_native_accepts_an_empty_batch():
    kv = make_paged_kv([3], 16, 2, 64, torch.float32, "cpu")
    q = torch.empty(0, 4, 64)
    out = decode_attention_native(q, kv.k_cache, kv.v_cache, kv.page_table[:0], kv.seq_lens[:0], 0.125)
    assert out.shape == (0, 4, 64)


def _with_page(page_table: torch.Tensor, row: int, index: int, page: int) -> torch.Tensor:
    page_table = page_table.clone()
    page_table[row, index] = page
    return page_table


# case: (what replaces the valid inputs, what the error says)
BAD_INPUTS = {
    "fp16 q": (lambda a: {"q": a["q"].half()}, "float32 or bfloat16"),
    "cache dtype differs from q": (lambda a: {"q": a["q"].bfloat16()}, "dtype"),
    "int64 page table": (lambda a: {"page_table": a["page_table"].long()}, "page_table must be int32"),
    "int64 lengths": (lambda a: {"seq_lens": a["seq_lens"].long()}, "seq_lens must be int32"),
    "empty sequence": (lambda a: {"seq_lens": ints([20, 0])}, "seq_lens out of range"),
    "sequence longer than its page-table row": (lambda a: {"seq_lens": ints([20, 33])}, "seq_lens out of range"),
    "one length for two queries": (lambda a: {"seq_lens": a["seq_lens"][:1]}, "length per query"),
    "query heads not a multiple of kv heads": (lambda a: {"q": a["q"][:, :3]}, "multiple of kv heads"),
    "page id past the pool": (lambda a: {"page_table": _with_page(a["page_table"], 0, 1, 1 << 20)}, "page"),
}


@needs_native
@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_native_refuses_bad_inputs(case):
    kv = make_paged_kv([20, 5], 16, 2, 64, torch.float32, "cpu")
    args = {"q": strided_q(2, 4, 2, 64, torch.float32), "k_cache": kv.k_cache, "v_cache": kv.v_cache,
            "page_table": kv.page_table, "seq_lens": kv.seq_lens, "scale": 0.125}
    change, match = BAD_INPUTS[case]
    args.update(change(args))
    message = error_in_child(lambda: decode_attention_native(**args))
    assert message.startswith(("RuntimeError", "ValueError", "IndexError")) and match in message, message
