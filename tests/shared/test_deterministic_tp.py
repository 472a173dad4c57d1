"""Deterministic mode under tensor parallelism: a worker split over 2 ranks (rank 0 here, rank 1 its own process,
the ranks summing in shared memory) gives a request the same tokens and log-probability bits alone and inside
batches of other sizes and make-ups: others prefilled with it, others joining while it decodes, it joining a
running batch, its prompt cut into other chunks by the prefill budget it shares, its prompt from the prefix cache
to the token; greedy and seeded sampling.

A tiny Qwen3-MoE carries every reduction a TP rank runs: the split matmuls and their all-reduce, Qwen3's head
norms, the experts' slices, the fused norms, attention over this rank's heads. Its dense layer is wide (each
rank's down projection sums 1,536 products) and it runs in fp32: there oneDNN's kernels give a row other bits at
other row counts, so the default mode fails these tests where deterministic mode must pass them.
"""
from __future__ import annotations

import random

import pytest

from fixtures import make_tiny_model
from pdserve.kernels import native
from pdserve.shared.config import CacheConfig, Role, RuntimeConfig, SchedulerConfig
from pdserve.shared.engine import Engine
from test_deterministic import SEEDED, run
from test_tensor_parallel import Split

pytestmark = pytest.mark.skipif(not native.available(), reason="needs the native CPU kernels")

_rng = random.Random(7)
PROMPT = [_rng.randrange(3, 500) for _ in range(45)]
OTHERS = [[_rng.randrange(3, 500) for _ in range(n)] for n in (11, 70, 3, 28, 52, 17, 90)]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    model = make_tiny_model("qwen3-moe", tmp_path_factory.mktemp("deterministic-tp") / "qwen3-moe",
                            intermediate_size=3072)
    # A prefill budget of 64 tokens: a long prompt is cut into chunks that depend on what else is prefilling.
    cfg = RuntimeConfig(model_path=str(model), dtype="float32", deterministic=True,
                        cache=CacheConfig(page_size=16, max_total_tokens=16 * 160),
                        scheduler=SchedulerConfig(chunked_prefill_size=64, max_prefill_tokens=64, mixed_prefill=True))
    with Split(cfg, 2) as runner:
        assert runner.tp is not None and runner.model.group.size == 2
        yield Engine(cfg, Role.COLOCATED, runner)


def others(*which: int) -> dict[str, list[int]]:
    return {f"o{i}": OTHERS[i] for i in which}


@pytest.fixture(scope="module")
def alone(engine):
    engine.flush_cache()
    return run(engine, {"a": PROMPT})["a"]


@pytest.mark.parametrize("first, later", [((1, 2, 3), ()), ((4,), (0, 5, 6)), ((0, 1, 2, 3, 4, 5, 6), ())],
                         ids=["beside-3", "1-then-3-join", "beside-7"])
def test_inside_batches_of_other_sizes_and_make_ups(engine, alone, first, later):
    assert len({t for t, _ in alone}) > 1  # a real answer, not one token repeated
    engine.flush_cache()
    got = run(engine, {**others(*first), "a": PROMPT}, join_later=others(*later) or None)
    assert got["a"] == alone


def test_joining_a_batch_already_decoding(engine, alone):
    engine.flush_cache()
    got = run(engine, others(1, 4, 6), join_later={"a": PROMPT}, join_after_steps=5)
    assert got["a"] == alone


def test_a_seeded_sample_inside_a_batch(engine):
    engine.flush_cache()
    sampled = run(engine, {"a": PROMPT}, sampling=SEEDED)["a"]
    engine.flush_cache()
    assert run(engine, {**others(2, 5), "a": PROMPT}, join_later=others(1), sampling=SEEDED)["a"] == sampled


def test_a_prompt_from_the_cache_to_the_token_on_both_ranks(engine, alone):
    # The repeat shares all but its last token: two whole pages and 12 tokens of a full third, which each rank
    # copies from its own cached page (its heads) before the step that computes the rest.
    engine.flush_cache()
    run(engine, {"warm": PROMPT})
    cached: dict[str, int] = {}
    got = run(engine, {"a": PROMPT}, cached=cached)
    assert cached["a"] == len(PROMPT) - 1 and got["a"] == alone
