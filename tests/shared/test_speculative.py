"""Speculative decoding with n-gram drafts: the same tokens as plain decoding, in fewer steps where the text
repeats itself, with every page of a rejected draft back in the pool.

Exactness is judged on the default model in fp32 (greedy: identical tokens), under deterministic inference in
bf16 (identical tokens and logprob bits) and for seeded sampling (identical tokens for every seed: a seeded
request draws the same uniforms, so the output distribution is unchanged seed by seed).
"""
from __future__ import annotations

import math

import pytest

from pdserve.kernels import native
from pdserve.shared.config import CacheConfig, RuntimeConfig, SpeculativeConfig
from pdserve.shared.engine import Engine
from pdserve.shared.req import Req
from pdserve.shared.sampling_params import SamplingParams
from pdserve.shared.speculative import NgramIndex, StepCost

PASSAGE = ("The committee met on Tuesday to review the budget. It approved the new library, the bicycle lanes "
           "on Main Street and the repairs to the old bridge. def area(width, height):\n    return width * height\n")
COPY = f"Repeat the following text exactly, word for word:\n\n{PASSAGE}"
CHAT = "Explain in two sentences why the sky is blue."


# ---------------------------------------------------------------- the index
def test_the_draft_continues_the_longest_latest_match():
    index = NgramIndex([1, 2, 3, 4, 9, 9, 2, 3, 5, 6, 1, 2, 3], min_match=2, max_match=4)
    # "2 3" occurs twice before the end; "1 2 3" only at the start, so that match wins: 4 9 9 follow it.
    assert index.draft(3) == [4, 9, 9]
    index.extend([7])
    assert index.draft(3) == []  # "3 7" never occurred
    index.extend([1, 2, 3])
    assert index.draft(2) == [7, 1]  # "1 2 3" ends at 2 and at 12 now: the latest wins, 7 1 followed it


def test_an_index_built_token_by_token_drafts_as_one_built_at_once():
    tokens = [5, 1, 2, 5, 1, 2, 3, 5, 1, 2, 3, 4, 5, 1]
    whole = NgramIndex(tokens, 2, 5)
    grown = NgramIndex(tokens[:3], 2, 5)
    for t in tokens[3:]:
        grown.extend([t])
    assert grown.ends == whole.ends
    assert grown.draft(4) == whole.draft(4) == [2, 3, 4, 5]


def test_the_step_cost_fit_recovers_a_line_and_prices_rows_by_batch():
    cost = StepCost()
    assert cost.threshold(1) == 0.0  # before any evidence rows are free: drafting starts at once
    for tokens in (1, 5, 3, 7, 2, 6) * 4:
        cost.observe(tokens, 0.010 + 0.001 * tokens)
    assert cost.fixed == pytest.approx(0.010, rel=1e-6) and cost.per_token == pytest.approx(0.001, rel=1e-6)
    # One more row costs 1 ms: against 11 ms per token at batch 1 it pays at 9 %, at batch 32 only at 76 %.
    assert cost.threshold(1) == pytest.approx(0.001 / 0.011)
    assert cost.threshold(32) == pytest.approx(0.001 / (0.042 / 32))


# ---------------------------------------------------------------- the engine
def make_engine(model_dir, speculative: bool, dtype: str = "float32", deterministic: bool = False) -> Engine:
    return Engine(RuntimeConfig(model_path=str(model_dir), dtype=dtype, deterministic=deterministic,
                                cache=CacheConfig(page_size=16, max_total_tokens=16 * 512),
                                speculative=SpeculativeConfig() if speculative else None))


@pytest.fixture(scope="module")
def engines(default_model_dir) -> dict[bool, Engine]:
    return {spec: make_engine(default_model_dir, spec) for spec in (False, True)}


def generate(engine: Engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[tuple[str, int], dict]:
    """(rid, choice) -> its tokens, logprobs, finish reason and output messages, all requests run together."""
    out: dict[tuple[str, int], dict] = {}

    def collect(o):
        entry = out.setdefault((o.rid, o.index), {"tokens": [], "logprobs": [], "finish": None, "messages": 0})
        entry["tokens"] += o.token_ids
        entry["logprobs"] += [lp.logprob for lp in o.logprobs]
        entry["finish"] = o.finish_reason or entry["finish"]
        entry["messages"] += 1

    free = engine.allocator.num_free + engine.cache.evictable_pages()
    for rid, (ids, params) in requests.items():
        engine.add_request(Req(rid=rid, input_ids=ids, params=params, on_output=collect))
    while engine.has_work():
        engine.step()
        assert engine.scheduler.check_integrity().ok
    assert engine.allocator.num_free + engine.cache.evictable_pages() == free  # no page left behind
    return out


def test_greedy_output_is_identical_in_fewer_steps_where_the_text_repeats(engines, chat, tokenizer):
    requests = {"copy": (chat(COPY), SamplingParams(temperature=0, max_new_tokens=80)),
                "chat": (chat(CHAT), SamplingParams(temperature=0, max_new_tokens=40))}
    steps = {}
    outputs = {}
    for spec, engine in engines.items():
        before = engine.stats.steps
        outputs[spec] = generate(engine, {"copy": requests["copy"]})
        steps[spec] = engine.stats.steps - before
        outputs[spec].update(generate(engine, {"chat": requests["chat"]}))
    assert {k: v["tokens"] for k, v in outputs[True].items()} == {k: v["tokens"] for k, v in outputs[False].items()}
    copied = tokenizer.decode(outputs[True][("copy", 0)]["tokens"])
    assert "bicycle lanes" in copied  # the model does copy, so drafts had something to be right about
    assert steps[True] <= steps[False] / 2, steps
    length, rate = engines[True].speculator.figures()
    assert length > 2 and 0 < rate <= 1
    # Several tokens leave in one message: fewer messages than tokens.
    copy = outputs[True][("copy", 0)]
    assert copy["messages"] < len(copy["tokens"])


def test_every_request_option_gives_the_same_output_with_speculation(engines, chat, tokenizer):
    ids = chat(COPY)
    comma, the = tokenizer.encode(",")[0], tokenizer.encode(" the")[0]
    schema = '{"type": "object", "properties": {"lines": {"type": "array", "items": {"type": "string"}}}}'
    requests = {
        "stop-token": (ids, SamplingParams(temperature=0, max_new_tokens=80, stop_token_ids=[comma])),
        "max-tokens": (ids, SamplingParams(temperature=0, max_new_tokens=13)),
        "logprobs": (ids, SamplingParams(temperature=0, max_new_tokens=30, return_logprob=True,
                                         top_logprobs_num=3)),
        "penalties": (ids, SamplingParams(temperature=0, max_new_tokens=40, frequency_penalty=0.3,
                                          repetition_penalty=1.1)),
        "bias": (ids, SamplingParams(temperature=0, max_new_tokens=40, logit_bias=((the, -5.0),))),
        "min-tokens": (ids, SamplingParams(temperature=0, max_new_tokens=60, min_new_tokens=50)),
        "grammar": (ids, SamplingParams(temperature=0, max_new_tokens=60, json_schema=schema)),
        "n": (ids, SamplingParams(temperature=0.7, top_p=0.9, n=3, seed=11, max_new_tokens=40)),
    }
    plain = generate(engines[False], requests)
    spec = generate(engines[True], requests)
    assert set(plain) == set(spec)
    for key in plain:
        assert spec[key]["tokens"] == plain[key]["tokens"], key
        assert spec[key]["finish"] == plain[key]["finish"], key
    assert len(spec[("max-tokens", 0)]["tokens"]) == 13
    assert spec[("stop-token", 0)]["tokens"][-1] == comma
    assert len(spec[("min-tokens", 0)]["tokens"]) >= 50
    assert spec[("logprobs", 0)]["logprobs"] == pytest.approx(plain[("logprobs", 0)]["logprobs"], abs=1e-3)
    import json

    json.loads(tokenizer.decode(spec[("grammar", 0)]["tokens"], skip_special_tokens=True))


def test_verify_steps_on_the_static_decode_buffers_give_the_same_tokens(default_model_dir, engines, chat):
    # A verify batch runs as a decode batch of one row per token, so it runs on the bucketed buffers that CUDA
    # graphs capture on a GPU ("static": the same path without capture, on the CPU).
    engine = Engine(RuntimeConfig(model_path=str(default_model_dir), dtype="float32", decode_graphs="static",
                                  cache=CacheConfig(page_size=16, max_total_tokens=16 * 512),
                                  speculative=SpeculativeConfig()))
    requests = {"copy": (chat(COPY), SamplingParams(temperature=0, max_new_tokens=40))}
    assert generate(engine, requests)[("copy", 0)]["tokens"] == generate(engines[False], requests)[("copy", 0)]["tokens"]
    assert engine.speculator.verify_steps > 0


def test_seeded_sampling_draws_the_same_tokens_seed_by_seed(engines, chat):
    ids = chat(COPY)
    requests = {f"seed-{seed}": (ids, SamplingParams(temperature=0.8, top_p=0.95, top_k=40, seed=seed,
                                                     max_new_tokens=40)) for seed in range(12)}
    plain = generate(engines[False], requests)
    spec = generate(engines[True], requests)
    assert {k: v["tokens"] for k, v in spec.items()} == {k: v["tokens"] for k, v in plain.items()}
    assert len({tuple(v["tokens"]) for v in spec.values()}) > 1  # the seeds do sample different texts


@pytest.mark.skipif(not native.available(), reason="deterministic inference needs the native CPU kernels")
def test_deterministic_inference_gives_the_same_bits(default_model_dir, chat):
    ids = chat(COPY)
    params = SamplingParams(temperature=0, max_new_tokens=48, return_logprob=True)
    out = {spec: generate(make_engine(default_model_dir, spec, "bfloat16", deterministic=True), {"r": (ids, params)})
           for spec in (False, True)}
    assert out[True][("r", 0)]["tokens"] == out[False][("r", 0)]["tokens"]
    assert out[True][("r", 0)]["logprobs"] == out[False][("r", 0)]["logprobs"]


def test_drafting_backs_off_when_rows_cost_more_than_drafts_return(engines, chat):
    engine = engines[True]
    cost = engine.speculator.cost
    saved = (cost.fixed, cost.per_token, cost.w)
    try:
        # A step where a row costs as much as a request's share: no draft pays, none is verified.
        cost.fixed, cost.per_token, cost.w = 0.0, 0.01, 0.0
        cost.observe = lambda tokens, seconds: None  # keep this price for the test
        before = engine.speculator.verify_steps
        out = generate(engine, {"copy": (chat(COPY), SamplingParams(temperature=0, max_new_tokens=30))})
        assert engine.speculator.verify_steps == before and len(out[("copy", 0)]["tokens"]) == 30
    finally:
        del cost.observe
        cost.fixed, cost.per_token, cost.w = saved


def test_the_acceptance_of_a_request_that_drafts_badly_falls_until_it_stops(engines):
    from pdserve.shared.speculative import Drafting

    state = Drafting(NgramIndex([], 2, 4))
    assert state.rate == 0.5
    for _ in range(10):
        state.record(drafted=4, accepted=0)
    assert state.rate < 0.15
    theta = 0.2  # what a draft must reach at some batch size
    assert int(math.log(theta) / math.log(state.rate)) == 0  # no draft token pays any more
    for _ in range(40):
        state.idle()  # evidence fades while it does not draft: it tries again later
    assert state.rate > 0.4
