"""Sampler: each sampling parameter does what it promises, seeded rows are reproducible, logprobs are the model's.

Every test runs twice: with the CPU's draw (top_p by rejection, filters only on the rows that have them) and with
the GPU's, which never waits for the device (`sync_free`: filters on every row, the nucleus cut after a sort).
"""
from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from pdserve.shared.logprobs import HostCopy
from pdserve.shared.sampler import Sampler, make_generator
from pdserve.shared.sampling_params import SamplingParams

torch.set_num_threads(1)

EOS = 3
# Vocabulary sizes for both code paths: 4096 splits into blocks (as the default model's 49152 does), 1001 does not.
VOCABS = [4096, 1001]
PROBS = [0.5, 0.3, 0.15, 0.05]  # tokens 0..3; the rest of the vocabulary is (almost) impossible


@pytest.fixture(autouse=True, params=[False, True], ids=["rejection", "sync-free"])
def sync_free(request, monkeypatch):
    monkeypatch.setattr(Sampler, "__init__", lambda self, sync_free=request.param: setattr(self, "sync_free", sync_free))
    return request.param


def sample(logits, params, outputs=None, prompts=None, generators=None, eos=(EOS,)):
    batch = logits.shape[0]
    params = params if isinstance(params, list) else [params] * batch
    return Sampler().sample(logits, params, prompts or [[7]] * batch, outputs or [[]] * batch,
                            generators or [None] * batch, eos)


def peaked(vocab: int, rows: int = 1, probs=PROBS) -> torch.Tensor:
    """[rows, vocab] logits whose softmax puts `probs` on the first tokens and ~1e-30 on each of the others."""
    x = torch.full((rows, vocab), math.log(1e-30) + 10.0)
    x[:, :len(probs)] = torch.log(torch.tensor(probs)) + 10.0
    return x


def frequencies(tokens: torch.Tensor) -> dict[int, float]:
    return {t: c / tokens.numel() for t, c in Counter(tokens.tolist()).items()}


# ---------------------------------------------------------------- greedy
@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_takes_the_argmax(vocab, dtype):
    torch.manual_seed(0)
    logits = (torch.randn(16, vocab) * 3).to(dtype)
    logits[5, 10] = logits[5, vocab - 1] = 100.0  # ties go to the first index, as argmax does
    out = sample(logits, SamplingParams(temperature=0))
    assert out.token_ids.dtype == torch.int64
    assert out.token_ids.tolist() == logits.float().argmax(-1).tolist()
    assert out.token_ids[5] == 10
    assert out.logprobs is None and out.top_ids is None


@pytest.mark.parametrize("vocab", VOCABS)
def test_top_k_one_and_tiny_top_p_sample_like_greedy(vocab):
    torch.manual_seed(1)
    logits = torch.randn(64, vocab) * 2
    greedy = sample(logits, SamplingParams(temperature=0)).token_ids
    assert torch.equal(sample(logits, SamplingParams(temperature=1.3, top_k=1)).token_ids, greedy)
    assert torch.equal(sample(logits, SamplingParams(temperature=1.3, top_p=1e-6)).token_ids, greedy)
    assert torch.equal(sample(logits, SamplingParams(temperature=1e-7)).token_ids, greedy)


def test_greedy_and_sampled_rows_in_one_batch():
    torch.manual_seed(2)
    logits = torch.randn(8, 49152)
    params = [SamplingParams(temperature=0) if i % 2 else SamplingParams(top_k=2) for i in range(8)]
    tokens = sample(logits, params).token_ids
    top2 = logits.topk(2).indices
    for i in range(8):
        if i % 2:
            assert tokens[i] == top2[i, 0]
        else:
            assert tokens[i] in top2[i]


# ---------------------------------------------------------------- sampling distribution and filters
@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_temperature_reshapes_the_distribution(vocab, temperature):
    torch.manual_seed(3)
    draws = 4000
    tokens = sample(peaked(vocab, draws), SamplingParams(temperature=temperature)).token_ids
    scaled = torch.tensor(PROBS) ** (1 / temperature)
    expected = (scaled / scaled.sum()).tolist()
    seen = frequencies(tokens)
    assert set(seen) <= {0, 1, 2, 3}
    for token, p in enumerate(expected):
        # 4000 draws: standard error <= 0.008; 0.035 is more than 4 of them.
        assert abs(seen.get(token, 0.0) - p) < 0.035, (token, seen, expected)


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("top_p,kept", [(0.45, {0}), (0.75, {0, 1}), (0.85, {0, 1, 2}), (1.0, {0, 1, 2, 3})])
def test_top_p_keeps_the_smallest_set_reaching_p(vocab, top_p, kept):
    torch.manual_seed(4)
    tokens = sample(peaked(vocab, 3000), SamplingParams(top_p=top_p)).token_ids
    seen = frequencies(tokens)
    assert set(seen) == kept
    total = sum(PROBS[t] for t in kept)
    for token in kept:  # renormalised over the nucleus
        assert abs(seen[token] - PROBS[token] / total) < 0.04


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("min_p,kept", [(0.05, {0, 1, 2, 3}), (0.2, {0, 1, 2}), (0.35, {0, 1}), (0.61, {0})])
def test_min_p_drops_tokens_less_likely_than_min_p_times_the_top(vocab, min_p, kept):
    torch.manual_seed(5)
    tokens = sample(peaked(vocab, 3000), SamplingParams(min_p=min_p)).token_ids
    assert set(frequencies(tokens)) == kept


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("top_k,kept", [(2, {0, 1}), (3, {0, 1, 2}), (-1, {0, 1, 2, 3}), (0, {0, 1, 2, 3})])
def test_top_k_keeps_the_k_most_likely(vocab, top_k, kept):
    torch.manual_seed(6)
    tokens = sample(peaked(vocab, 3000), SamplingParams(top_k=top_k)).token_ids
    seen = frequencies(tokens)
    assert set(seen) == kept
    total = sum(PROBS[t] for t in kept)
    for token in kept:
        assert abs(seen[token] - PROBS[token] / total) < 0.04


def test_each_row_keeps_its_own_top_k():
    torch.manual_seed(14)
    params = [SamplingParams(top_k=[1, 2, 3, -1][i % 4], temperature=1.0 + i % 4) for i in range(2000)]
    tokens = sample(peaked(4096, 2000), params).token_ids.tolist()
    for k, kept in [(1, {0}), (2, {0, 1}), (3, {0, 1, 2}), (4, {0, 1, 2, 3})]:
        assert set(tokens[k - 1::4]) == kept


def test_filters_are_judged_jointly_on_the_full_distribution():
    torch.manual_seed(7)
    logits = peaked(4096, 2000)
    # top_p is a share of the whole distribution, not of what top_k left (SGLang): with top_k=2 the tokens
    # more likely than token 1 hold 0.5 < 0.55 of the whole, but 0.625 of the top two.
    assert set(frequencies(sample(logits, SamplingParams(top_k=2, top_p=0.55)).token_ids)) == {0, 1}
    assert set(frequencies(sample(logits, SamplingParams(top_k=3, top_p=0.6)).token_ids)) == {0, 1}
    assert set(frequencies(sample(logits, SamplingParams(top_k=2, min_p=0.2)).token_ids)) == {0, 1}
    assert set(frequencies(sample(logits, SamplingParams(top_k=3, top_p=0.9, min_p=0.5)).token_ids)) == {0, 1}


def test_filters_with_a_wide_random_distribution_never_leave_their_set():
    torch.manual_seed(8)
    logits = torch.randn(64, 49152)
    probs = torch.softmax(logits, -1)
    tokens = sample(logits, SamplingParams(top_k=40)).token_ids
    assert all(t in row for t, row in zip(tokens.tolist(), logits.topk(40).indices.tolist()))
    tokens = sample(logits, SamplingParams(top_p=0.3)).token_ids
    chosen = probs.gather(1, tokens[:, None]).squeeze(1)
    mass_above = (probs * (probs > chosen[:, None])).sum(-1)
    assert bool((mass_above < 0.3).all())
    tokens = sample(logits, SamplingParams(min_p=0.3)).token_ids
    chosen = probs.gather(1, tokens[:, None]).squeeze(1)
    assert bool((chosen >= 0.3 * probs.amax(-1)).all())


# ---------------------------------------------------------------- penalties
def two_tokens(seen: float, other: float, vocab: int = 1024) -> torch.Tensor:
    """Logits where token 10 (seen before) competes with token 20; everything else is far below."""
    x = torch.full((1, vocab), -50.0)
    x[0, 10], x[0, 20] = seen, other
    return x


@pytest.mark.parametrize("seen,other,winner", [
    (2.0, 1.81, 10), (2.0, 1.82, 20),  # positive logits are divided: 2 / 1.1 = 1.818
    (-1.0, -1.09, 20), (-1.0, -1.11, 10),  # negative logits are multiplied: -1 * 1.1 = -1.1
])
@pytest.mark.parametrize("where", ["prompt", "output"])
def test_repetition_penalty_scales_logits_of_prompt_and_output_tokens(seen, other, winner, where):
    params = SamplingParams(temperature=0, repetition_penalty=1.1)
    history = {"prompts": [[1, 10, 2]], "outputs": [[5]]} if where == "prompt" else \
        {"prompts": [[1, 2]], "outputs": [[5, 10]]}
    assert sample(two_tokens(seen, other), params, **history).token_ids.item() == winner
    assert sample(two_tokens(seen, other), SamplingParams(temperature=0), **history).token_ids.item() == 10


@pytest.mark.parametrize("other,winner", [(0.6, 20), (0.4, 10)])
def test_frequency_penalty_counts_each_occurrence_in_the_output(other, winner):
    params = SamplingParams(temperature=0, frequency_penalty=0.5)
    # token 10 occurs 3 times: 2.0 - 3 * 0.5 = 0.5
    out = sample(two_tokens(2.0, other), params, outputs=[[10, 4, 10, 10]]).token_ids.item()
    assert out == winner


@pytest.mark.parametrize("other,winner", [(1.6, 20), (1.4, 10)])
def test_presence_penalty_counts_once(other, winner):
    params = SamplingParams(temperature=0, presence_penalty=0.5)
    # token 10 occurs 3 times, penalised once: 2.0 - 0.5 = 1.5
    assert sample(two_tokens(2.0, other), params, outputs=[[10, 10, 4, 10]]).token_ids.item() == winner


def test_negative_penalties_favour_repeats_and_prompt_tokens_do_not_count_for_them():
    favour = SamplingParams(temperature=0, frequency_penalty=-1.0, presence_penalty=-1.0)
    assert sample(two_tokens(1.0, 2.5), favour, outputs=[[10]]).token_ids.item() == 10  # 1 + 1 + 1 = 3 > 2.5
    assert sample(two_tokens(1.0, 2.5), favour, prompts=[[10, 10, 10]]).token_ids.item() == 20


def test_penalties_apply_to_sampled_rows_and_leave_the_logits_untouched():
    logits = two_tokens(2.0, 1.9)
    before = logits.clone()
    params = SamplingParams(temperature=0.8, top_p=1e-6, repetition_penalty=1.2)
    assert sample(logits, params, outputs=[[10]]).token_ids.item() == 20  # 2 / 1.2 = 1.67 < 1.9
    assert torch.equal(logits, before)


def test_logit_bias_adds_to_the_named_tokens_of_its_row_only():
    logits = peaked(4096, rows=2)
    biased = SamplingParams(temperature=0, logit_bias={2: 5.0, 0: -100})  # 0.15 * e^5 beats 0.3; token 0 banned
    out = sample(logits.clone(), [biased, SamplingParams(temperature=0)])
    assert out.token_ids.tolist() == [2, 0]
    draws = sample(peaked(4096, rows=2000), SamplingParams(logit_bias={0: -100, 1: -100})).token_ids
    assert set(draws.tolist()) <= {2, 3}  # a -100 bias leaves a token next to impossible, as OpenAI documents


def test_penalties_are_per_row():
    logits = torch.cat([two_tokens(2.0, 1.9)] * 3)
    params = [SamplingParams(temperature=0, repetition_penalty=1.2), SamplingParams(temperature=0),
              SamplingParams(temperature=0, frequency_penalty=1.0)]
    outputs = [[10], [10], [10]]
    assert sample(logits, params, outputs=outputs).token_ids.tolist() == [20, 10, 20]


# ---------------------------------------------------------------- min_new_tokens
@pytest.mark.parametrize("vocab", VOCABS)
def test_min_new_tokens_blocks_eos_and_stop_tokens_until_reached(vocab):
    torch.manual_seed(9)
    logits = peaked(vocab, 500, probs=[0.05, 0.05, 0.1, 0.6, 0.2])  # token 3 is eos, token 4 a stop token
    params = SamplingParams(min_new_tokens=2, stop_token_ids=(4,))
    early = sample(logits, params, outputs=[[1]] * 500).token_ids
    assert not set(early.tolist()) & {EOS, 4}
    assert set(early.tolist()) == {0, 1, 2}
    later = sample(logits, params, outputs=[[1, 2]] * 500).token_ids
    assert {EOS, 4} <= set(later.tolist())
    greedy = SamplingParams(temperature=0, min_new_tokens=2, stop_token_ids=(4,))
    assert sample(logits[:1], greedy, outputs=[[]]).token_ids.item() == 2
    assert sample(logits[:1], greedy, outputs=[[0, 0]]).token_ids.item() == EOS


def test_min_new_tokens_with_ignore_eos_blocks_only_stop_tokens():
    logits = peaked(1024, 1, probs=[0.05, 0.05, 0.1, 0.6, 0.2])
    params = SamplingParams(temperature=0, min_new_tokens=5, ignore_eos=True, stop_token_ids=(4,))
    assert sample(logits, params).token_ids.item() == EOS  # eos ends nothing here, so it is not banned


# ---------------------------------------------------------------- seeds
def run_steps(steps_logits, row, params, seed, neighbours):
    """Tokens of one seeded row over several steps, batched at position `row` among `neighbours`."""
    gen = make_generator(seed)
    neighbour_gens = [make_generator(1000 + i) if i % 2 else None for i in range(len(neighbours))]
    tokens = []
    for step, logits in enumerate(steps_logits):
        others = torch.randn(len(neighbours), logits.shape[0]) * 2
        batch = torch.cat([others[:row], logits[None], others[row:]])
        ps = neighbours[:row] + [params] + neighbours[row:]
        gens = neighbour_gens[:row] + [gen] + neighbour_gens[row:]
        out = Sampler().sample(batch, ps, [[1, 2]] * len(ps), [[5] * step] * len(ps), gens, (EOS,))
        tokens.append(out.token_ids[row].item())
    return tokens


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(top_p=0.9, temperature=0.7),
                                    SamplingParams(top_k=50, min_p=0.01), SamplingParams(frequency_penalty=1.0)])
def test_same_seed_gives_the_same_tokens_whatever_the_neighbours(params):
    torch.manual_seed(10)
    steps = [torch.randn(49152) for _ in range(6)]  # flat enough that draws vary from step to step
    alone = run_steps(steps, 0, params, seed=1234, neighbours=[])
    crowd = [SamplingParams(), SamplingParams(temperature=0), SamplingParams(top_k=5, seed=3),
             SamplingParams(top_p=0.5), SamplingParams(min_p=0.1, repetition_penalty=1.3)]
    assert run_steps(steps, 3, params, seed=1234, neighbours=crowd) == alone
    assert run_steps(steps, 1, params, seed=1234, neighbours=crowd[:2]) == alone
    assert len(set(alone)) > 1  # the generator advances from step to step
    assert run_steps(steps, 0, params, seed=4321, neighbours=[]) != alone


def test_make_generator():
    assert make_generator(None) is None
    a, b = make_generator(5), make_generator(5)
    assert torch.equal(torch.rand(4, generator=a), torch.rand(4, generator=b))
    assert make_generator(2**63 + 5) is not None and make_generator(-7) is not None


# ---------------------------------------------------------------- logprobs
@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_are_those_of_the_raw_model_distribution(vocab, dtype):
    torch.manual_seed(11)
    logits = (torch.randn(6, vocab) * 3).to(dtype)
    params = [SamplingParams(temperature=0.5, top_p=0.9, return_logprob=True, top_logprobs_num=5),
              SamplingParams(temperature=0, repetition_penalty=1.5, return_logprob=True),
              SamplingParams(),  # asks for nothing
              SamplingParams(top_k=3, top_logprobs_num=2),
              SamplingParams(temperature=0, return_logprob=True, top_logprobs_num=1),
              SamplingParams(temperature=2.0, frequency_penalty=2.0, return_logprob=True, top_logprobs_num=3)]
    out = sample(logits, params, outputs=[[0, 1, 2]] * 6)
    reference = torch.log_softmax(logits.float(), dim=-1)
    expected = reference.gather(1, out.token_ids[:, None]).squeeze(1)
    asked = [0, 1, 3, 4, 5]
    torch.testing.assert_close(out.logprobs[asked], expected[asked])
    assert math.isnan(out.logprobs[2].item())
    assert out.top_ids.shape == out.top_logprobs.shape == (6, 5)
    ref_top = reference.topk(5)
    for i in asked:
        k = params[i].top_logprobs_num
        torch.testing.assert_close(out.top_logprobs[i, :k], ref_top.values[i, :k])
        # Ids: each one's logprob is the one reported (bf16 logits tie often, and ties may come in any order).
        ids = out.top_ids[i, :k]
        assert len(set(ids.tolist())) == k
        torch.testing.assert_close(reference[i, ids], out.top_logprobs[i, :k])
        assert bool((out.top_logprobs[i, :-1] >= out.top_logprobs[i, 1:]).all())  # most likely first
    assert out.top_ids[2].tolist() == [-1] * 5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_ids_logprob_are_the_named_ids_logprobs_in_their_order(dtype):
    torch.manual_seed(14)
    logits = (torch.randn(4, 1001) * 3).to(dtype)
    named = (1000, int(logits[0].float().argmax()), 5)  # the greedy token among them
    params = [SamplingParams(temperature=0, return_logprob=True, token_ids_logprob=named),
              SamplingParams(temperature=0.7, return_logprob=True, top_logprobs_num=2),  # names none
              SamplingParams(token_ids_logprob=(9,)),  # no logprobs asked: nothing reported
              SamplingParams(temperature=0, repetition_penalty=1.5, return_logprob=True, token_ids_logprob=(42,))]
    tokens, lps = HostCopy(sample(logits, params, outputs=[[42]] * 4)).read(params)
    reference = torch.log_softmax(logits.float(), dim=-1)
    torch.testing.assert_close(torch.tensor(lps[0].id_logprobs), reference[0, list(named)])
    torch.testing.assert_close(torch.tensor(lps[3].id_logprobs), reference[3, [42]])  # the raw model's, unpenalised
    assert tokens[0] == named[1] and lps[0].id_logprobs[1] == lps[0].logprob
    assert lps[1].id_logprobs == [] and len(lps[1].top_ids) == 2 and lps[2] is None


def test_logprob_of_a_greedy_token_is_the_top_logprob():
    torch.manual_seed(12)
    logits = torch.randn(4, 49152)
    out = sample(logits, SamplingParams(temperature=0, return_logprob=True, top_logprobs_num=1))
    assert torch.equal(out.top_ids[:, 0], out.token_ids)
    torch.testing.assert_close(out.top_logprobs[:, 0], out.logprobs)


def test_sampling_never_picks_an_impossible_token():
    torch.manual_seed(13)
    logits = torch.full((200, 49152), float("-inf"))
    logits[:, 49151] = 0.0  # the only possible token sits in the last block, at the very end
    logits[:, 1000] = -200.0  # possible in theory, its probability underflows to 0 in fp32
    assert set(sample(logits, SamplingParams()).token_ids.tolist()) == {49151}
