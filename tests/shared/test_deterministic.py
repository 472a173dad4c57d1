"""Deterministic inference: a prompt's greedy tokens and their log-probabilities are the same bits whether it
runs alone, inside a busy batch whose make-up changes while it decodes, after a partial prefix-cache hit, or
with its prompt prefilled in small chunks; in bf16 (the dtype the CPU serves in, where rounding order shows),
fp32 and w8a8 int8. The layers under it give a row the same bits at every row count from 1 to 300, and a
machine where they would not refuses deterministic mode at start.
"""
from __future__ import annotations

import pytest
import torch

from pdserve.kernels import native
from pdserve.shared.config import CacheConfig, RuntimeConfig, SchedulerConfig
from pdserve.shared.engine import Engine
from pdserve.shared.int8_linear import Int8Linear
from pdserve.shared.invariance import NotBatchInvariant, check_batch_invariance
from pdserve.shared.linear import Linear
from pdserve.shared.req import Req
from pdserve.shared.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not native.available(), reason="needs the native CPU kernels")

# name -> (dtype, quantization): the numerics deterministic mode serves in.
MODES = {"bf16": ("bfloat16", None), "fp32": ("float32", None), "int8": ("bfloat16", "w8a8_int8")}
NEW_TOKENS = 24
QUESTION = "Explain in two sentences why the sky is blue, and what color sunsets have."
OTHERS = ["Hi", "List three fruits and their colors.", "Write a haiku about winter mornings in a quiet town.",
          "What is 17 times 23? Show the steps of the multiplication one by one, then check the result.",
          "Name a planet.", "Tell me a very long story about a dragon who learned to cook soup " * 3]


def make_engine(model_dir, mode: str = "bf16", chunk: int = 2048, deterministic: bool = True,
                mixed: bool = False) -> Engine:
    dtype, quantization = MODES[mode]
    cfg = RuntimeConfig(model_path=str(model_dir), dtype=dtype, deterministic=deterministic,
                        quantization=quantization, cache=CacheConfig(page_size=16, max_total_tokens=16 * 512),
                        scheduler=SchedulerConfig(chunked_prefill_size=chunk, max_prefill_tokens=max(chunk, 64),
                                                  mixed_prefill=mixed))
    return Engine(cfg)


@pytest.fixture(scope="module", params=list(MODES))
def mode(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def engine(default_model_dir, mode) -> Engine:
    return make_engine(default_model_dir, mode)


GREEDY = dict(temperature=0)
SEEDED = dict(temperature=0.7, top_p=0.9, seed=42)  # a sampled request: the same seed must give the same draws


def run(engine: Engine, prompts: dict[str, list[int]], join_later: dict[str, list[int]] | None = None,
        join_after_steps: int = 3, cached: dict[str, int] | None = None,
        sampling: dict | None = None) -> dict[str, list[tuple[int, float]]]:
    """(token, logprob) of every request, greedy unless `sampling` says otherwise; `join_later` requests arrive
    after a few steps; `cached` receives each request's prefix-cache hit in tokens."""
    out: dict[str, list[tuple[int, float]]] = {}
    cached = {} if cached is None else cached

    def collect(o):
        out.setdefault(o.rid, []).extend((t, lp.logprob) for t, lp in zip(o.token_ids, o.logprobs))
        cached[o.rid] = o.cached_tokens

    def add(rid: str, ids: list[int]) -> None:
        engine.add_request(Req(rid=rid, input_ids=ids, on_output=collect,
                               params=SamplingParams(**(sampling or GREEDY), max_new_tokens=NEW_TOKENS,
                                                     ignore_eos=True, return_logprob=True)))

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


def test_a_seeded_sample_inside_a_busy_batch(engine, chat):
    engine.flush_cache()
    alone = run(engine, {"a": chat(QUESTION)}, sampling=SEEDED)["a"]
    engine.flush_cache()
    first = {f"o{i}": chat(t) for i, t in enumerate(OTHERS[:3])}
    later = {f"l{i}": chat(t) for i, t in enumerate(OTHERS[3:])}
    assert run(engine, {**first, "a": chat(QUESTION)}, join_later=later, sampling=SEEDED)["a"] == alone


def test_beside_prefills_in_mixed_batches(default_model_dir, mode, chat, alone):
    engine = make_engine(default_model_dir, mode, mixed=True)
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


def test_chunked_prefill(default_model_dir, mode, chat, alone):
    engine = make_engine(default_model_dir, mode, chunk=16)
    got = run(engine, {"a": chat(QUESTION), "b": chat(OTHERS[-1])})
    assert got["a"] == alone


LAYERS = {"bf16": lambda w: Linear(w.bfloat16(), batch_invariant=True),
          "fp32": lambda w: Linear(w, batch_invariant=True),
          "int8": lambda w: Int8Linear(w),
          "lm_head": lambda w: Linear(w.bfloat16(), batch_invariant=True, fp32_output=True)}


@pytest.mark.parametrize("kind", list(LAYERS))
def test_layer_rows_do_not_depend_on_the_batch_from_1_to_300_rows(kind):
    torch.manual_seed(0)
    # The default model's down projection (the shape where oneDNN's small-row kernel differed) and qkv.
    for out_f, in_f in [(576, 1536), (960, 576)]:
        lin = LAYERS[kind](torch.randn(out_f, in_f) * 0.05)
        x = torch.randn(300, in_f).to(torch.float32 if kind == "fp32" else torch.bfloat16)
        alone = torch.cat([lin(x[r:r + 1]) for r in range(300)])
        for m in range(1, 301):
            assert torch.equal(lin(x[:m]), alone[:m]), f"{kind} {out_f}x{in_f}: {m} rows"


def test_the_start_check_passes_here_and_refuses_a_layer_that_depends_on_the_batch(engine):
    model, ops = engine.runner.model, engine.runner.ops
    assert check_batch_invariance(model, ops, 16) > 10
    # A layer whose rows change with the number of rows computed together (what oneDNN's kernel choice did).
    layer = model.layers[0]
    honest = layer.o

    class ByRowCount:
        shape, fp32_output = honest.shape, False

        def __call__(self, x, residual=None):
            return honest(x) + (x.shape[0] > 8) * 1e-2

    try:
        layer.o = ByRowCount()
        with pytest.raises(NotBatchInvariant, match=r"with 17 rows than alone.*--enable-deterministic-inference"):
            check_batch_invariance(model, ops, 16)
    finally:
        layer.o = honest


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
