"""Deterministic inference: a prompt's greedy tokens and their log-probabilities are the same bits whether it
runs alone, inside a busy batch whose make-up changes while it decodes, after a partial prefix-cache hit, or
with its prompt prefilled in small chunks. bf16, the dtype the CPU serves in, where rounding order shows.
"""
from __future__ import annotations

import pytest

from pdserve.kernels import native
from pdserve.shared.config import CacheConfig, RuntimeConfig, SchedulerConfig
from pdserve.shared.engine import Engine
from pdserve.shared.linear import BATCH_INVARIANT_MIN_ROWS, Linear
from pdserve.shared.req import Req
from pdserve.shared.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not native.available(), reason="needs the native CPU kernels")

NEW_TOKENS = 24
QUESTION = "Explain in two sentences why the sky is blue, and what color sunsets have."
OTHERS = ["Hi", "List three fruits and their colors.", "Write a haiku about winter mornings in a quiet town.",
          "What is 17 times 23? Show the steps of the multiplication one by one, then check the result.",
          "Name a planet.", "Tell me a very long story about a dragon who learned to cook soup " * 3]


def make_engine(model_dir, chunk: int = 2048, deterministic: bool = True, mixed: bool = False) -> Engine:
    cfg = RuntimeConfig(model_path=str(model_dir), dtype="bfloat16", deterministic=deterministic,
                        cache=CacheConfig(page_size=16, max_total_tokens=16 * 512),
                        scheduler=SchedulerConfig(chunked_prefill_size=chunk, max_prefill_tokens=max(chunk, 64),
                                                  mixed_prefill=mixed))
    return Engine(cfg)


@pytest.fixture(scope="module")
def engine(default_model_dir) -> Engine:
    return make_engine(default_model_dir)


def run(engine: Engine, prompts: dict[str, list[int]], join_later: dict[str, list[int]] | None = None,
        join_after_steps: int = 3, cached: dict[str, int] | None = None) -> dict[str, list[tuple[int, float]]]:
    """Greedy (token, logprob) of every request; `join_later` requests arrive after a few steps; `cached`
    receives each request's prefix-cache hit in tokens."""
    out: dict[str, list[tuple[int, float]]] = {}
    cached = {} if cached is None else cached

    def collect(o):
        out.setdefault(o.rid, []).extend((t, lp.logprob) for t, lp in zip(o.token_ids, o.logprobs))
        cached[o.rid] = o.cached_tokens

    def add(rid: str, ids: list[int]) -> None:
        engine.add_request(Req(rid=rid, input_ids=ids, on_output=collect,
                               params=SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS, ignore_eos=True,
                                                     return_logprob=True)))

    for rid, ids in prompts.items():
        add(rid, ids)
    steps = 0
    while engine.has_work():
        engine.step()
        steps += 1
        if join_later and steps == join_after_steps:
            for rid, ids in join_later.items():
                add(rid, ids)
    assert engine.scheduler.check_integrity().ok
    return out


@pytest.fixture(scope="module")
def alone(engine, chat) -> list[tuple[int, float]]:
    engine.flush_cache()
    return run(engine, {"a": chat(QUESTION)})["a"]


def test_alone_is_repeatable(engine, chat, alone):
    engine.flush_cache()
    assert run(engine, {"a": chat(QUESTION)})["a"] == alone


def test_inside_a_busy_batch(engine, chat, alone):
    engine.flush_cache()
    first = {f"o{i}": chat(t) for i, t in enumerate(OTHERS[:3])}
    later = {f"l{i}": chat(t) for i, t in enumerate(OTHERS[3:])}
    got = run(engine, {**first, "a": chat(QUESTION)}, join_later=later)
    assert got["a"] == alone


def test_beside_prefills_in_mixed_batches(default_model_dir, chat, alone):
    engine = make_engine(default_model_dir, mixed=True)
    later = {f"l{i}": chat(t) for i, t in enumerate(OTHERS)}
    got = run(engine, {"a": chat(QUESTION)}, join_later=later, join_after_steps=4)
    assert got["a"] == alone


def test_after_a_partial_prefix_hit(engine, chat, alone):
    engine.flush_cache()
    prompt = chat(QUESTION)
    run(engine, {"warm": prompt[:len(prompt) - 5] + chat("unrelated")[:3]})  # shares all but the tail
    cached: dict[str, int] = {}
    got = run(engine, {"a": prompt}, cached=cached)
    assert 16 <= cached["a"] < len(prompt)  # whole pages of the shared part came from the cache
    assert got["a"] == alone


def test_chunked_prefill(default_model_dir, chat, alone):
    engine = make_engine(default_model_dir, chunk=16)
    got = run(engine, {"a": chat(QUESTION), "b": chat(OTHERS[-1])})
    assert got["a"] == alone


def test_linear_rows_do_not_depend_on_the_batch():
    import torch

    torch.manual_seed(0)
    for out_f, in_f in [(576, 1536), (960, 576)]:  # down (the shape where oneDNN's small-M kernel differs), qkv
        lin = Linear((torch.randn(out_f, in_f) * 0.05).bfloat16(), batch_invariant=True)
        x = torch.randn(300, in_f).bfloat16()
        rows = torch.cat([lin(x[r:r + 1]) for r in range(40)])
        for m in (1, 3, BATCH_INVARIANT_MIN_ROWS, 40, 300):
            assert torch.equal(lin(x[:m])[:40], rows[:min(m, 40)])


def test_a_next_turn_continuing_a_cached_partial_page_gives_the_bits_of_a_cold_cache(engine, default_model_dir):
    # The next turn of a conversation extends the last one's prompt and output, whose KV ends inside a page.
    # The cache keeps that partly filled page as a tail; the next turn computes only what follows it, on a copy.
    first = list(range(500, 537))  # 37 tokens: two pages and 5 tokens of a third
    engine.flush_cache()
    turn1 = run(engine, {"t1": first})["t1"]
    computed = first + [t for t, _ in turn1][:-1]  # the last output token's KV never was computed
    second = first + [t for t, _ in turn1] + list(range(900, 911))
    cached: dict[str, int] = {}
    warm = run(engine, {"t2": second}, cached=cached)["t2"]
    assert len(computed) % 16 != 0 and cached["t2"] == len(computed)  # more than its whole pages
    engine.flush_cache()
    cold_cached: dict[str, int] = {}
    assert run(engine, {"t2": second}, cached=cold_cached)["t2"] == warm and cold_cached["t2"] == 0
