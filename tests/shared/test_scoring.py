"""Prefill-only scoring on the generative runtime against transformers, and the pages it leaves behind."""
from __future__ import annotations

import pytest
import torch

from pdserve.shared.config import CacheConfig, RuntimeConfig, SchedulerConfig
from pdserve.shared.engine import Engine
from pdserve.shared.sampling_params import MAX_SCORE_LABELS, MAX_SCORE_VALUES
from pdserve.shared.scoring import PoolBusy, check_inputs, plan_groups, prefill_prefix, score_group, step_budget

QUERY = [5, 17, 99, 3, 250, 8, 8, 41, 300, 7, 66, 12, 13]
ITEMS = [[40, 41], [100, 7, 9, 21, 22], [3]]
LABELS = [7, 9, 300]


def hf_label_logprobs(model_dir, seqs: list[list[int]], labels: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows = []
    with torch.no_grad():
        for ids in seqs:
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            rows.append(torch.log_softmax(logits, -1)[labels])
    return torch.stack(rows)


def make_engine(model_dir, page_size: int, pages: int = 64) -> Engine:
    return Engine(RuntimeConfig(model_path=str(model_dir), dtype="float32", kernels="torch",
                                cache=CacheConfig(page_size=page_size, max_total_tokens=page_size * pages),
                                scheduler=SchedulerConfig(max_prefill_tokens=64)))


@pytest.mark.parametrize("page_size", [1, 4])
def test_scores_match_transformers_and_free_every_page(tiny_models, page_size):
    engine = make_engine(tiny_models["qwen2"], page_size)
    seqs = [QUERY + item for item in ITEMS]
    want = hf_label_logprobs(tiny_models["qwen2"], seqs, LABELS)
    first = score_group(engine, seqs, LABELS)
    assert torch.allclose(torch.tensor(first.logprobs), want, atol=1e-4)
    assert first.prompt_tokens == sum(map(len, seqs))
    # The shared query is in the radix cache now: the same items again reuse its full pages, same answer.
    again = score_group(engine, seqs, LABELS)
    assert again.cached_tokens >= len(seqs) * (len(QUERY) // page_size) * page_size > 0
    assert torch.allclose(torch.tensor(again.logprobs), want, atol=1e-4)
    report = engine.scheduler.check_integrity()
    assert report.ok and report.held == 0, report.message


def test_full_pool_refuses_and_frees_what_it_took(tiny_models):
    engine = make_engine(tiny_models["llama"], page_size=4, pages=4)  # 16 tokens of KV
    with pytest.raises(PoolBusy):
        score_group(engine, [QUERY, QUERY[:9] + [1]], LABELS)
    report = engine.scheduler.check_integrity()
    assert report.ok and report.held == 0, report.message


def test_groups_respect_the_token_budget():
    assert plan_groups([5, 5, 5, 20, 1], 10) == [range(0, 2), range(2, 3), range(3, 4), range(4, 5)]
    assert plan_groups([3], 1) == [range(0, 1)]


@pytest.mark.parametrize("seqs,labels,message", [
    ([], [1], "no input"), ([[1]], [], "label_token_ids is empty"), ([[1]], [512], "outside the vocabulary"),
    ([[]], [1], "empty"), ([[1] * 600], [1], "context length")])
def test_bad_inputs_are_refused(seqs, labels, message):
    with pytest.raises(ValueError, match=message):
        check_inputs(seqs, labels, vocab_size=512, context_length=512)


def test_a_long_sequence_is_scored_chunk_by_chunk(tiny_models):
    # The worker computes a sequence longer than one prefill chunk one chunk per engine call: each call's full
    # pages go to the radix cache and the next starts there. The answer is the one-forward answer.
    engine = make_engine(tiny_models["qwen2"], page_size=4)
    seq = (QUERY * 4)[:48]
    want = hf_label_logprobs(tiny_models["qwen2"], [seq], LABELS)
    prefill_prefix(engine, seq[:16])
    prefill_prefix(engine, seq[:32])
    result = score_group(engine, [seq], LABELS)
    assert result.cached_tokens == 32 and result.prompt_tokens == 48
    assert torch.allclose(torch.tensor(result.logprobs), want, atol=1e-4)
    report = engine.scheduler.check_integrity()
    assert report.ok and report.held == 0, report.message


def test_the_step_budget_is_one_prefill_chunk():
    assert step_budget(SchedulerConfig(max_prefill_tokens=8192, chunked_prefill_size=2048)) == 2048
    assert step_budget(SchedulerConfig(max_prefill_tokens=1024, chunked_prefill_size=2048)) == 1024
    assert step_budget(SchedulerConfig(max_prefill_tokens=8192, chunked_prefill_size=0)) == 8192


def test_labels_are_capped_at_the_workers_edge():
    # items x labels is the answer's size: a gRPC client with the cluster token cannot ask for gigabytes.
    check_inputs([[1, 2]], list(range(MAX_SCORE_LABELS)), 50_000, 64)
    with pytest.raises(ValueError, match=f"limit of {MAX_SCORE_LABELS}"):
        check_inputs([[1, 2]], [1] * (MAX_SCORE_LABELS + 1), 50_000, 64)
    items = MAX_SCORE_VALUES // MAX_SCORE_LABELS + 1
    with pytest.raises(ValueError, match="scores per call"):
        check_inputs([[1]] * items, [1] * MAX_SCORE_LABELS, 50_000, 64)
