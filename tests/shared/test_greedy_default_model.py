"""Greedy output of the runtime equals transformers' greedy `generate`, token for token, on the default model.

fp32 on both sides, so the comparison is about the runtime's logic (paging, batching,
prefix reuse, chunking), not about bf16 rounding order.
"""
from __future__ import annotations

import pytest
import torch

from pdserve.shared.config import CacheConfig, RuntimeConfig, SchedulerConfig
from pdserve.shared.engine import Engine
from pdserve.shared.req import Req
from pdserve.shared.sampling_params import SamplingParams

NEW_TOKENS = 64
QUESTIONS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List three fruits and their colors.",
    "Give me a recipe for pancakes with all the steps in detail, including the ingredients and their amounts.",
]


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False) for q in QUESTIONS]


@pytest.fixture(scope="module")
def expected(default_model_dir, prompts) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for ids in prompts:
            gen = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                 min_new_tokens=NEW_TOKENS, pad_token_id=2)
            out.append(gen[0, len(ids):].tolist())
    return out


@pytest.fixture(scope="module")
def engine(default_model_dir) -> Engine:
    return make_engine(default_model_dir, chunk=2048)


def make_engine(model_dir, chunk: int, mixed: bool = False) -> Engine:
    cfg = RuntimeConfig(model_path=str(model_dir), dtype="float32",
                        cache=CacheConfig(page_size=16, max_total_tokens=16 * 256),
                        scheduler=SchedulerConfig(chunked_prefill_size=chunk, max_prefill_tokens=max(chunk, 64),
                                                  mixed_prefill=mixed))
    return Engine(cfg)


def generate(engine: Engine, prompts: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    outputs: dict[str, list[int]] = {}
    cached: dict[str, int] = {}

    def collect(out):
        outputs.setdefault(out.rid, []).extend(out.token_ids)
        cached[out.rid] = out.cached_tokens

    for i, ids in enumerate(prompts):
        # min_new_tokens keeps EOS out, like transformers' min_new_tokens, so all 64 tokens are compared.
        engine.add_request(Req(rid=str(i), input_ids=ids, on_output=collect,
                               params=SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS,
                                                     min_new_tokens=NEW_TOKENS)))
    while engine.has_work():
        engine.step()
    report = engine.scheduler.check_integrity()
    assert report.ok, report.message
    return [outputs[str(i)] for i in range(len(prompts))], [cached[str(i)] for i in range(len(prompts))]


def test_france_is_answered_with_paris(engine, prompts, tokenizer):
    tokens, _ = generate(engine, prompts[:1])
    assert "Paris" in tokenizer.decode(tokens[0])


def test_one_request_alone_matches(engine, prompts, expected):
    for ids, want in zip(prompts[:2], expected[:2]):
        got, _ = generate(engine, [ids])
        assert got[0] == want


def test_mixed_lengths_batched_match(engine, prompts, expected):
    engine.flush_cache()
    got, _ = generate(engine, prompts)
    assert got == expected


def test_prefix_cache_hits_match(engine, prompts, expected):
    generate(engine, prompts)  # warm the cache with every prompt
    got, cached = generate(engine, prompts)
    assert all(c >= 16 for c in cached), cached  # each prompt's full pages were reused
    assert got == expected


def test_chunked_prefill_matches(default_model_dir, prompts, expected):
    engine = make_engine(default_model_dir, chunk=16)
    got, _ = generate(engine, prompts[-2:])
    assert got == expected[-2:]


def test_prompts_arriving_while_others_decode_match(default_model_dir, prompts, expected, monkeypatch):
    """With --enable-mixed-chunk, arrivals are prefilled in the same steps that decode the running requests."""
    from pdserve.shared.req import ReqStatus

    engine = make_engine(default_model_dir, chunk=2048, mixed=True)
    outputs: dict[str, list[int]] = {}
    mixed = []
    schedule = engine.role.schedule  # the colocated role's: prefill beside decode (Scheduler.schedule_mixed)

    def spy():
        batch = schedule()
        if batch is not None and not batch.is_decode and any(r.status == ReqStatus.RUNNING for r in batch.reqs):
            mixed.append(len(batch))
        return batch

    monkeypatch.setattr(engine.role, "schedule", spy)

    def add(i: int) -> None:
        engine.add_request(Req(rid=str(i), input_ids=prompts[i], on_output=lambda o: outputs.setdefault(
            o.rid, []).extend(o.token_ids), params=SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS,
                                                                  min_new_tokens=NEW_TOKENS)))

    add(0)
    add(1)
    steps = 0
    while engine.has_work():
        engine.step()
        steps += 1
        if steps in (3, 9):  # each arrival joins a batch that is decoding the others
            add(2 if steps == 3 else 3)
    assert engine.scheduler.check_integrity().ok
    assert mixed == [3, 4]  # the newcomer beside 2, then 3, running requests
    assert [outputs[str(i)] for i in range(4)] == expected[:4]
