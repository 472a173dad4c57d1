from __future__ import annotations

import pytest
import torch
from kernel_cases import (DEVICES, NATIVE_DTYPES, NATIVE_HEADS, REF_TOL, TRITON_DEVICE, TRITON_DTYPES, assert_close,
                          error_in_child, ints, make_paged_kv, naive_attention, needs_native,
                          strided_q)

from pdserve.kernels.decode_attention import decode_attention_native
from pdserve.kernels import native
from pdserve.kernels.extend_attention import (NATIVE_EXTEND_MAX_WORK, extend_attention_cpu, extend_attention_native,
                                              extend_attention_tiled, extend_attention_torch, extend_attention_triton,
                                              tiled_supported)

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


def ragged_seqs(page_size: int) -> list[tuple[int, int]]:
    """(cached prefix, new tokens): a lone token, exactly one page, a chunk across a page boundary, a row
    with nothing new, a prompt that ends one token short of a page, and a long chunk after a long prefix."""
    return [(0, 1), (0, page_size), (page_size - 1, 2), (page_size + 1, 0), (1, max(page_size - 2, 1)), (300, 40)]


def packed(seqs: list[tuple[int, int]], num_heads: int, head_dim: int, dtype: torch.dtype, page_size: int):
    """The sequences' KV in a paged pool and their new tokens' queries packed back to back."""
    kv = make_paged_kv([p + n for p, n in seqs], page_size, 2, head_dim, dtype, "cpu")
    ext = [n for _, n in seqs]
    q = strided_q(sum(ext), num_heads, 2, head_dim, dtype)
    return q, kv, ints(ext), ints([sum(ext[:b]) for b in range(len(ext))])


@needs_native
@pytest.mark.parametrize("dtype", NATIVE_DTYPES)
@pytest.mark.parametrize("page_size", [1, 16, 5])
@pytest.mark.parametrize("head_dim,group", NATIVE_HEADS)
def test_native_matches_naive(dtype, page_size, head_dim, group):
    seqs = ragged_seqs(page_size)
    q, kv, extend_lens, q_start = packed(seqs, 2 * group, head_dim, dtype, page_size)
    scale = head_dim ** -0.5
    out = extend_attention_native(q, kv.k_cache, kv.v_cache, kv.page_table, kv.seq_lens, extend_lens, q_start,
                                  scale)
    assert out.shape == q.shape and out.dtype == dtype
    row, tol = 0, REF_TOL[dtype]
    for b, (prefix, n) in enumerate(seqs):
        expected = naive_attention(q[row:row + n], kv.keys[b], kv.values[b], prefix, scale)
        torch.testing.assert_close(out[row:row + n].double(), expected, atol=tol, rtol=tol)
        row += n


@needs_native
def test_native_accepts_no_new_tokens():
    q, kv, extend_lens, q_start = packed([(5, 0), (17, 0)], 4, 64, torch.float32, 16)
    args = (kv.k_cache, kv.v_cache, kv.page_table, kv.seq_lens)
    assert extend_attention_native(q, *args, extend_lens, q_start, 0.125).shape == (0, 4, 64)
    empty = ints([])
    assert extend_attention_native(q, kv.k_cache, kv.v_cache, kv.page_table[:0], empty, empty, empty,
                                   0.125).shape == (0, 4, 64)


@needs_native
@pytest.mark.parametrize("dtype", NATIVE_DTYPES)
@pytest.mark.parametrize("head_dim,group,page_size", [(64, 3, 16), (128, 8, 5), (80, 4, 1), (64, 1, 16)])
def test_native_rows_are_the_decode_outputs_however_the_prompt_is_split(dtype, head_dim, group, page_size):
    # The deterministic mode relies on this: a token's attention output has the same bits whether its prompt
    # is extended in one chunk, in several after cached prefixes, inside a batch, or the token is decoded.
    n = 45
    kv = make_paged_kv([n, 20, 37], page_size, 2, head_dim, dtype, "cpu")
    q = strided_q(n, 2 * group, 2, head_dim, dtype)  # q[p]: the query of the prompt's token at position p
    cache = (kv.k_cache, kv.v_cache)
    # Token p decoded: a sequence of p + 1 cached tokens. One call decodes every position.
    decoded = decode_attention_native(q, *cache, kv.page_table[:1].repeat(n, 1), ints(list(range(1, n + 1))), 0.1)

    whole = extend_attention_native(q, *cache, kv.page_table[:1], ints([n]), ints([n]), ints([0]), 0.1)
    assert torch.equal(whole, decoded)

    chunked, done = [], 0
    for size in (7, 1, 16, 21):  # each chunk after the cached prefix of the ones before
        chunked.append(extend_attention_native(q[done:done + size], *cache, kv.page_table[:1], ints([done + size]),
                                               ints([size]), ints([0]), 0.1))
        done += size
    assert torch.equal(torch.cat(chunked), decoded)

    # Behind another sequence's chunk, and beside a sequence with nothing new.
    others = strided_q(5, 2 * group, 2, head_dim, dtype, seed=8)
    batch_q = torch.cat([others, q[30:]])
    batched = extend_attention_native(batch_q, *cache, kv.page_table[[1, 0, 2]], ints([20, n, 37]), ints([5, 15, 0]),
                                      ints([0, 5, 20]), 0.1)
    assert torch.equal(batched[5:], decoded[30:])


def _has_tiled() -> bool:
    try:
        return native.load().tiled_extend_supported(64)
    except native.NativeUnavailable:
        return False


needs_tiled = pytest.mark.skipif(not _has_tiled(), reason="the tiled extend attention needs AVX512-BF16")


def assert_matches_naive(out, q, kv, seqs, scale, tol):
    row = 0
    for b, (prefix, n) in enumerate(seqs):
        expected = naive_attention(q[row:row + n], kv.keys[b], kv.values[b], prefix, scale)
        torch.testing.assert_close(out[row:row + n].double(), expected, atol=tol, rtol=tol)
        row += n


@needs_tiled
@pytest.mark.parametrize("page_size", [1, 16, 5])
@pytest.mark.parametrize("head_dim,group", [(64, 1), (64, 3), (64, 7), (128, 4), (128, 8)])
def test_tiled_matches_naive(page_size, head_dim, group):
    seqs = ragged_seqs(page_size)
    q, kv, extend_lens, q_start = packed(seqs, 2 * group, head_dim, torch.bfloat16, page_size)
    scale = head_dim ** -0.5
    out = extend_attention_tiled(q, kv.k_cache, kv.v_cache, kv.page_table, kv.seq_lens, extend_lens, q_start,
                                 scale)
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    assert_matches_naive(out, q, kv, seqs, scale, REF_TOL[torch.bfloat16])


@needs_tiled
def test_tiled_packs_sequences_past_its_buffer_budget_in_turns():
    # Six sequences of 6000 keys over 2 kv heads pack into 36 MB: more than one turn of the kernel's 16 MB
    # budget. Their few new tokens must still see every key of their own sequence and none of another's.
    seqs = [(6000 - n, n) for n in (3, 1, 9, 2, 5, 4)]
    q, kv, extend_lens, q_start = packed(seqs, 6, 64, torch.bfloat16, 16)
    out = extend_attention_tiled(q, kv.k_cache, kv.v_cache, kv.page_table, kv.seq_lens, extend_lens, q_start,
                                 0.125)
    assert_matches_naive(out, q, kv, seqs, 0.125, REF_TOL[torch.bfloat16])


@needs_tiled
def test_tiled_rows_do_not_depend_on_how_the_prompt_is_split():
    # A row's scores, weights and sums run over its own keys in a fixed order; tile mates with more keys only
    # add exact zeros. So chunked prefill and prefix hits give a token the bits of the whole prompt.
    n = 45
    kv = make_paged_kv([n], 16, 2, 64, torch.bfloat16, "cpu")
    q = strided_q(n, 6, 2, 64, torch.bfloat16)
    cache = (kv.k_cache, kv.v_cache, kv.page_table[:1])
    whole = extend_attention_tiled(q, *cache, ints([n]), ints([n]), ints([0]), 0.1)
    chunked, done = [], 0
    for size in (7, 1, 16, 21):
        chunked.append(extend_attention_tiled(q[done:done + size], *cache, ints([done + size]), ints([size]),
                                              ints([0]), 0.1))
        done += size
    assert torch.equal(torch.cat(chunked), whole)


@needs_native
@pytest.mark.parametrize("dtype", NATIVE_DTYPES)
def test_cpu_picks_tiled_where_it_applies_else_native_for_short_prompts_and_torch_for_long_ones(dtype):
    for seqs, untiled in (([(0, 13), (21, 6), (3, 35)], extend_attention_native),
                          ([(0, 13), (30, 90)], extend_attention_torch)):  # 90 x 120 tokens is past the bound
        assert (max(n * (p + n) for p, n in seqs) <= NATIVE_EXTEND_MAX_WORK) == (untiled is extend_attention_native)
        q, kv, extend_lens, q_start = packed(seqs, 6, 64, dtype, 16)
        args = (q, kv.k_cache, kv.v_cache, kv.page_table, kv.seq_lens, extend_lens, q_start, 0.125)
        assert tiled_supported(q) == (dtype == torch.bfloat16 and _has_tiled())
        out = extend_attention_cpu(*args)
        assert torch.equal(out, (extend_attention_tiled if tiled_supported(q) else untiled)(*args))
        assert_matches_naive(out, q, kv, seqs, 0.125, REF_TOL[dtype])


# case: (what replaces the valid inputs, what the error says)
BAD_INPUTS = {
    "bf16 q over fp32 caches": (lambda a: {"q": a["q"].bfloat16()}, "dtype"),
    "int64 extend lengths": (lambda a: {"extend_lens": a["extend_lens"].long()}, "int32"),
    "int64 q starts": (lambda a: {"q_start": a["q_start"].long()}, "int32"),
    "more new tokens than the sequence": (lambda a: {"extend_lens": ints([21, 5])}, "out of range"),
    "rows past the packed queries": (lambda a: {"q_start": ints([0, 21])}, "out of range"),
    "negative extend length": (lambda a: {"extend_lens": ints([-1, 5])}, "out of range"),
    "fewer page-table rows than sequences": (lambda a: {"page_table": a["page_table"][:1]}, "page"),
    "page id past the pool": (lambda a: {"page_table": a["page_table"].clone().fill_(1 << 20)}, "page"),
}


TILED_BAD_INPUTS = {
    "float32": (lambda a: {"q": a["q"].float(), "k_cache": a["k_cache"].float(), "v_cache": a["v_cache"].float()},
                "bfloat16"),
    "head_dim 80": (lambda a: {"q": a["q"][..., :40].repeat(1, 1, 2).contiguous(),
                               "k_cache": a["k_cache"][..., :40].repeat(1, 1, 1, 2).contiguous(),
                               "v_cache": a["v_cache"][..., :40].repeat(1, 1, 1, 2).contiguous()}, "head_dim"),
}


@needs_native
@pytest.mark.parametrize("kernel,case", [("native", c) for c in BAD_INPUTS] + [
    ("tiled", c) for c in [*BAD_INPUTS, *TILED_BAD_INPUTS] if c != "bf16 q over fp32 caches"])
def test_refuses_bad_inputs(kernel, case):
    if kernel == "tiled" and not _has_tiled():
        pytest.skip("the tiled extend attention needs AVX512-BF16")
    dtype = torch.float32 if kernel == "native" else torch.bfloat16
    q, kv, extend_lens, q_start = packed([(0, 20), (10, 5)], 4, 64, dtype, 16)
    args = {"q": q, "k_cache": kv.k_cache, "v_cache": kv.v_cache, "page_table": kv.page_table,
            "seq_lens": kv.seq_lens, "extend_lens": extend_lens, "q_start": q_start, "scale": 0.125}
    change, match = {**BAD_INPUTS, **TILED_BAD_INPUTS}[case]
    args.update(change(args))
    run = extend_attention_native if kernel == "native" else extend_attention_tiled
    message = error_in_child(lambda: run(**args))
    assert message.startswith(("RuntimeError", "ValueError", "IndexError")) and match in message, message
