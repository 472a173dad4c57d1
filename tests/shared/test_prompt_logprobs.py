"""Prompt logprobs (return_logprob with logprob_start_len): the logprob of each prompt token given the ones
before it, as transformers computes them, whatever the chunking and the prefix cache."""
from __future__ import annotations

import pytest
import torch

from pdserve.shared.config import CacheConfig, RuntimeConfig, SchedulerConfig
from pdserve.shared.engine import Engine
from pdserve.shared.req import Req
from pdserve.shared.sampling_params import InvalidParam, SamplingParams

TEXT = "The quick brown fox jumps over the lazy dog, and then it runs far away into the green forest to rest."


@pytest.fixture(scope="module")
def engine(default_model_dir) -> Engine:
    cfg = RuntimeConfig(model_path=str(default_model_dir), dtype="float32",
                        cache=CacheConfig(page_size=4, max_total_tokens=4 * 128),
                        scheduler=SchedulerConfig(chunked_prefill_size=8, max_prefill_tokens=8))
    return Engine(cfg)


@pytest.fixture(scope="module")
def expected(default_model_dir):
    """(prompt ids, [P, V] log-softmax of transformers' logits in fp32)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = AutoTokenizer.from_pretrained(default_model_dir).encode(TEXT)
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return ids, torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def run(engine: Engine, ids: list[int], **params) -> tuple[list, int]:
    outs = []
    engine.add_request(Req(rid="r", input_ids=ids, on_output=outs.append,
                           params=SamplingParams(temperature=0, max_new_tokens=2, return_logprob=True, **params)))
    while engine.has_work():
        engine.step()
    assert engine.scheduler.check_integrity().ok
    return outs[0].input_logprobs or [], outs[0].cached_tokens


@pytest.mark.parametrize("start", [0, 1, 13])
def test_prompt_logprobs_match_transformers_across_chunks(engine, expected, start):
    ids, want = expected
    got, _ = run(engine, ids, logprob_start_len=start, top_logprobs_num=3)
    first = max(start, 1)
    assert len(got) == len(ids) - first  # one per prompt token from max(start, 1); the first token has none
    for j, lp in zip(range(first, len(ids)), got):
        assert lp.logprob == pytest.approx(want[j - 1, ids[j]].item(), abs=2e-3)
        top = want[j - 1].topk(3)
        assert lp.top_ids == top.indices.tolist()
        assert lp.top_logprobs == pytest.approx(top.values.tolist(), abs=2e-3)


def test_a_cached_prefix_is_recomputed_where_logprobs_are_asked(engine, expected):
    ids, want = expected
    engine.flush_cache()
    run(engine, ids)  # caches the prompt
    got, cached = run(engine, ids, logprob_start_len=20)
    assert cached <= 19 and len(got) == len(ids) - 20
    assert got[0].logprob == pytest.approx(want[19, ids[20]].item(), abs=2e-3)
    _, cached = run(engine, ids)  # without prompt logprobs the whole cached prefix serves
    assert cached > 19


def test_without_logprob_start_len_no_prompt_logprobs(engine, expected):
    assert run(engine, expected[0])[0] == []
    with pytest.raises(InvalidParam, match="logprob_start_len"):
        SamplingParams(logprob_start_len=-2).validate()
