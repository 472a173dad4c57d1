"""Multi-LoRA in the runtime: requests for several adapters and the base model share batches, and every one of
them gets transformers+PEFT's greedy tokens and logprobs (fp32), with prefix-cache hits and slot reuse."""
from __future__ import annotations

import pytest
import torch

from pdserve.shared.config import CacheConfig, LoraConfig, RuntimeConfig, SchedulerConfig, SpeculativeConfig
from pdserve.shared.engine import Engine
from pdserve.shared.lora import SUPPORTED_TARGETS, LoraError
from pdserve.shared.req import Req
from pdserve.shared.sampling_params import SamplingParams

NEW_TOKENS = 12
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea and the wind in the pines at night."]
ADAPTERS = [None, "sql", "poet", "terse"]


@pytest.fixture(scope="module")
def prompts(default_model_dir) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    return [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
                                    return_dict=False) for q in QUESTIONS]


@pytest.fixture(scope="module")
def expected(default_model_dir, default_model_adapters, prompts) -> dict:
    """{(adapter, prompt index): (greedy tokens, their logprobs)} from transformers (+ PEFT), fp32."""
    from lora_adapters import _load_base, load_peft_model

    out = {}
    for name in ADAPTERS:
        model = (_load_base(default_model_dir) if name is None
                 else load_peft_model(default_model_dir, default_model_adapters[name]))
        with torch.no_grad():
            for i, ids in enumerate(prompts):
                gen = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                     min_new_tokens=NEW_TOKENS, pad_token_id=2)[0]
                logits = model(input_ids=gen[None]).logits[0].float()
                lps = torch.log_softmax(logits, -1)[len(ids) - 1:-1].gather(1, gen[len(ids):, None])[:, 0]
                out[(name, i)] = (gen[len(ids):].tolist(), lps.tolist())
    return out


def make_engine(model_dir, adapters, slots: int = 4, speculative: SpeculativeConfig | None = None,
                **lora) -> Engine:
    cfg = RuntimeConfig(model_path=str(model_dir), dtype="float32",
                        cache=CacheConfig(page_size=16, max_total_tokens=16 * 128),
                        scheduler=SchedulerConfig(chunked_prefill_size=2048), speculative=speculative,
                        lora=LoraConfig(paths=tuple(adapters.items()), max_loras_per_batch=slots, **lora))
    return Engine(cfg)


@pytest.fixture(scope="module")
def engine(default_model_dir, default_model_adapters) -> Engine:
    return make_engine(default_model_dir, default_model_adapters)


def run(engine: Engine, jobs: list[tuple[str | None, list[int]]]) -> list[tuple[list[int], list[float], int]]:
    """Queue every (adapter, prompt) at once, step to the end; (tokens, logprobs, cached tokens) of each."""
    got: dict[str, tuple[list[int], list[float], list[int]]] = {}

    def collect(out):
        tokens, lps, cached = got.setdefault(out.rid, ([], [], [0]))
        tokens.extend(out.token_ids)
        lps.extend(lp.logprob for lp in out.logprobs)
        cached[0] = out.cached_tokens

    for i, (name, ids) in enumerate(jobs):
        engine.add_request(Req(rid=str(i), input_ids=ids, on_output=collect,
                               params=SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS,
                                                     min_new_tokens=NEW_TOKENS, return_logprob=True)), lora=name)
    while engine.has_work():
        engine.step()
    report = engine.scheduler.check_integrity()
    assert report.ok, report.message
    return [(got[str(i)][0], got[str(i)][1], got[str(i)][2][0]) for i in range(len(jobs))]


def assert_matches(results, jobs, expected, prompts):
    for (tokens, lps, _), (name, ids) in zip(results, jobs):
        want_tokens, want_lps = expected[(name, prompts.index(ids))]
        assert tokens == want_tokens, f"adapter {name}"
        assert lps == pytest.approx(want_lps, abs=2e-3), f"adapter {name}"


def test_adapters_change_the_output(expected):
    """The fixture's adapters are not no-ops: each one's greedy answer differs from the base model's."""
    for name in ADAPTERS[1:]:
        assert expected[(name, 0)][0] != expected[(None, 0)][0], name


def test_each_adapter_alone_matches_peft(engine, prompts, expected):
    for name in ADAPTERS:
        jobs = [(name, prompts[0])]
        assert_matches(run(engine, jobs), jobs, expected, prompts)


def test_one_batch_mixing_every_adapter_and_the_base_matches(engine, prompts, expected):
    engine.flush_cache()
    jobs = [(name, ids) for ids in prompts for name in ADAPTERS]
    assert_matches(run(engine, jobs), jobs, expected, prompts)


def test_speculative_decoding_keeps_every_adapters_output(default_model_dir, default_model_adapters, prompts,
                                                          expected):
    # One-token matches: drafts at nearly every step, so the verify steps carry adapter rows.
    engine = make_engine(default_model_dir, default_model_adapters, speculative=SpeculativeConfig(min_match=1))
    jobs = [(name, ids) for ids in prompts for name in ADAPTERS]
    assert_matches(run(engine, jobs), jobs, expected, prompts)
    assert engine.speculator.verify_steps > 0


def test_prefix_cache_is_per_adapter(engine, prompts, expected):
    engine.flush_cache()
    first = run(engine, [("sql", prompts[1])])
    assert first[0][2] == 0
    # The same prompt under another adapter (or the base) must not reuse sql's KV; under sql it does.
    jobs = [("poet", prompts[1]), (None, prompts[1]), ("sql", prompts[1])]
    results = run(engine, jobs)
    assert [cached for _, _, cached in results[:2]] == [0, 0]
    assert results[2][2] >= 16
    assert_matches(results, jobs, expected, prompts)
    again = run(engine, jobs)
    assert all(cached >= 16 for _, _, cached in again)
    assert_matches(again, jobs, expected, prompts)


def test_more_adapters_than_slots_take_turns(default_model_dir, default_model_adapters, prompts, expected):
    """With one slot, requests of three adapters and the base still all finish with PEFT's answers."""
    engine = make_engine(default_model_dir, default_model_adapters, slots=1)
    jobs = [(name, prompts[0]) for name in ADAPTERS] + [("sql", prompts[1])]
    assert_matches(run(engine, jobs), jobs, expected, prompts)
    assert engine.runner.lora.pool.in_use("sql") == 0


def test_adapter_loaded_while_serving_matches(default_model_dir, default_model_adapters, prompts, expected):
    engine = make_engine(default_model_dir, {"sql": default_model_adapters["sql"]}, max_rank=16,
                         target_modules=SUPPORTED_TARGETS)
    with pytest.raises(LoraError, match="'poet' is not loaded"):
        engine.add_request(Req(rid="x", input_ids=prompts[0], params=SamplingParams()), lora="poet")
    engine.adapters.load("poet", str(default_model_adapters["poet"]))
    jobs = [("poet", prompts[0]), ("sql", prompts[0])]
    assert_matches(run(engine, jobs), jobs, expected, prompts)
    # A request may name an adapter by the directory it was loaded from.
    by_path = [(str(default_model_adapters["poet"]), prompts[1])]
    assert run(engine, by_path)[0][0] == expected[("poet", 1)][0]
    engine.adapters.unload("poet")
    assert [a.name for a in engine.adapters.list()] == ["sql"]


def test_unload_is_refused_while_requests_use_the_adapter(default_model_dir, default_model_adapters, prompts):
    engine = make_engine(default_model_dir, {"sql": default_model_adapters["sql"]})
    engine.add_request(Req(rid="a", input_ids=prompts[0], params=SamplingParams(max_new_tokens=4)), lora="sql")
    with pytest.raises(LoraError, match="'sql': cannot unload it while 1 requests use it"):
        engine.adapters.unload("sql")
    while engine.has_work():
        engine.step()
    engine.adapters.unload("sql")
    assert engine.adapters.list() == []


def test_rank_above_the_limit_is_refused_and_nothing_loaded(default_model_dir, default_model_adapters):
    engine = make_engine(default_model_dir, {"sql": default_model_adapters["sql"]})  # max rank: sql's 8
    with pytest.raises(LoraError, match="'poet': rank 16 exceeds --max-lora-rank 8"):
        engine.adapters.load("poet", str(default_model_adapters["poet"]))
    assert [a.name for a in engine.adapters.list()] == ["sql"]


def test_lora_requests_need_lora_enabled(default_model_dir, prompts):
    engine = Engine(RuntimeConfig(model_path=str(default_model_dir), dtype="float32",
                                  cache=CacheConfig(page_size=16, max_total_tokens=16 * 32)))
    with pytest.raises(ValueError, match="'sql': LoRA is not enabled on this worker"):
        engine.add_request(Req(rid="x", input_ids=prompts[0], params=SamplingParams()), lora="sql")
    assert not engine.has_work()
