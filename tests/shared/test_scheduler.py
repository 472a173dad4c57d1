"""Scheduler and engine bookkeeping on CPU, with a stand-in model.

The stand-in "model" always predicts (last token + 1) % vocab, so every
expected output is known exactly and any mistake in which tokens get computed
(chunking, prefix reuse, retraction, forking) shows up as a wrong token. Real
model numerics are covered by test_model_runner.py.
"""
from __future__ import annotations

from concurrent.futures import Future

import pytest
import torch

from pdserve.shared.config import CacheConfig, ModelConfig, Role, RuntimeConfig, SchedulerConfig
from pdserve.shared.engine import Engine
from pdserve.shared.outputs import FirstToken, ReqOutput
from pdserve.shared.kv_pool import KVLayout, KVPool
from pdserve.shared.req import Req, ReqStatus
from pdserve.shared.sampling_params import SamplingParams

VOCAB = 1000
EOS = 999


class CountingRunner:
    """Predicts last_token + 1; records which token positions each step computed."""

    def __init__(self, page_size: int, num_pages: int, context_length: int = 4096) -> None:
        self.model_config = ModelConfig(
            path="", architecture="LlamaForCausalLM", model_type="llama", num_layers=1, hidden_size=8,
            intermediate_size=8, num_heads=1, num_kv_heads=1, head_dim=4, vocab_size=VOCAB, rms_norm_eps=1e-5,
            rope_theta=10000.0, rope_scaling=None, max_position_embeddings=context_length,
            tie_word_embeddings=True, attention_bias=False, torch_dtype="float32", eos_token_ids=(EOS,))
        self.pool = KVPool(KVLayout(num_pages, page_size, 1, 1, 4, torch.float32))
        self.page_size = page_size
        self.context_length = context_length
        self.computed: list[tuple[str, int, int]] = []  # (rid, first position, count)
        self.copies: list[tuple[int, int]] = []  # the page copies steps asked for (src, dst)

    def forward(self, batch):
        self.copies += batch.page_copies
        rows = []
        for req, n in zip(batch.reqs, batch.extend_lens):
            self.computed.append((req.rid, req.num_computed, n))
            pages_needed = -(-(req.num_computed + n) // self.page_size)
            assert len(req.pages) >= pages_needed, "scheduler ran a request without pages for its tokens"
            last = req.fill_ids[req.num_computed + n - 1]
            row = torch.full((VOCAB,), -10.0)
            row[(last + 1) % VOCAB] = 10.0
            rows.append(row)
        return torch.stack(rows)


def make_engine(page_size=4, num_pages=64, role=Role.COLOCATED, **sched) -> Engine:
    cfg = RuntimeConfig(model_path="", cache=CacheConfig(page_size=page_size, max_total_tokens=page_size * num_pages),
                        scheduler=SchedulerConfig(**sched))
    return Engine(cfg, role, runner=CountingRunner(page_size, num_pages))


def make_req(rid: str, prompt: list[int], outputs: dict, **params) -> Req:
    params.setdefault("temperature", 0.0)
    params.setdefault("max_new_tokens", 8)
    return Req(rid=rid, input_ids=prompt, params=SamplingParams(**params),
               on_output=lambda out: outputs.setdefault((out.rid, out.index), []).append(out))


def run_until_idle(engine: Engine, max_steps: int = 10_000) -> None:
    for _ in range(max_steps):
        if not engine.has_work():
            return
        engine.step()
    raise AssertionError("engine did not finish")


def tokens_of(outputs: dict, rid: str, index: int = 0) -> list[int]:
    return [t for out in outputs[(rid, index)] for t in out.token_ids]


def finish_of(outputs: dict, rid: str, index: int = 0) -> ReqOutput:
    last = outputs[(rid, index)][-1]
    assert last.finish_reason is not None
    return last


def assert_integrity(engine: Engine) -> None:
    report = engine.scheduler.check_integrity()
    assert report.ok, report.message


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_batched_requests_of_mixed_lengths_get_exact_outputs(page_size):
    engine, outputs = make_engine(page_size=page_size, num_pages=256 // page_size * 4), {}
    prompts = {f"r{i}": list(range(10 * i, 10 * i + 3 + 7 * i)) for i in range(5)}
    for rid, prompt in prompts.items():
        engine.add_request(make_req(rid, prompt, outputs, max_new_tokens=6))
    run_until_idle(engine)
    for rid, prompt in prompts.items():
        assert tokens_of(outputs, rid) == [prompt[-1] + k for k in range(1, 7)]
        assert finish_of(outputs, rid).finish_reason == "length"
    assert_integrity(engine)
    assert engine.scheduler.check_integrity().held == 0


def test_prefix_cache_hit_skips_cached_tokens_and_reports_them():
    engine, outputs = make_engine(page_size=4), {}
    prompt = list(range(1, 20))  # 19 tokens: four full pages and 3 tokens of a fifth
    engine.add_request(make_req("a", prompt, outputs))
    run_until_idle(engine)
    engine.runner.computed.clear()
    engine.add_request(make_req("b", prompt + [50, 51], outputs))
    run_until_idle(engine)
    first = engine.runner.computed[0]
    assert first[:2] == ("b", 19)  # only the tokens after the shared 19 were computed
    assert finish_of(outputs, "b").cached_tokens == 19
    assert tokens_of(outputs, "b")[0] == 52
    assert_integrity(engine)


@pytest.mark.parametrize("page_size", [4, 16])
def test_a_prompt_leaving_a_cached_page_part_way_computes_on_a_copy_from_the_first_token_it_does_not_share(
        page_size):
    engine, outputs = make_engine(page_size=page_size), {}
    engine.add_request(make_req("a", list(range(1, 3 * page_size + 1)), outputs, max_new_tokens=1))
    run_until_idle(engine)
    shared = page_size + 2  # a whole page and 2 tokens of the next, which the cache holds full
    engine.runner.computed.clear()
    engine.add_request(make_req("b", list(range(1, shared + 1)) + [700, 701, 702], outputs, max_new_tokens=2))
    run_until_idle(engine)
    assert engine.runner.computed[0] == ("b", shared, 3) and finish_of(outputs, "b").cached_tokens == shared
    assert tokens_of(outputs, "b") == [703, 704]
    second_page = engine.cache.match_prefix(list(range(1, 2 * page_size + 1))).pages[1]
    assert [src for src, _ in engine.runner.copies] == [second_page]  # copied, never written in place
    assert engine.runner.copies[0][1] != second_page
    assert_integrity(engine)


def test_the_page_a_prompt_copies_stays_cached_until_the_request_is_released():
    # On a GPU the copy runs when the stream reaches it, after the step is issued: until then its source page must
    # not be evicted and handed to other KV (a peer's write into a reservation, which no stream orders).
    engine, outputs = make_engine(page_size=4), {}
    engine.add_request(make_req("a", list(range(1, 13)), outputs, max_new_tokens=1))
    run_until_idle(engine)
    b = make_req("b", [1, 2, 3, 4, 5, 6, 700], outputs, max_new_tokens=1)
    engine.add_request(b)
    (source, copy), = engine.scheduler.schedule_prefill().page_copies
    evicted = engine.cache.evict(10**6)
    engine.scheduler.allocator.free(evicted)
    assert source not in evicted
    engine.scheduler.release(b, cache=False)
    evicted = engine.cache.evict(10**6)
    engine.scheduler.allocator.free(evicted)
    assert source in evicted
    assert_integrity(engine)


def test_a_sequence_longer_than_the_pool_can_hold_ends_with_length_not_an_error():
    # --max-total-tokens below the context: the answer stops where the pool is full, as SGLang's max_req_len.
    engine, outputs = make_engine(page_size=4, num_pages=16), {}
    engine.add_request(make_req("a", list(range(1, 11)), outputs, max_new_tokens=100))
    run_until_idle(engine)
    assert finish_of(outputs, "a").finish_reason == "length" and finish_of(outputs, "a").error is None
    assert tokens_of(outputs, "a") == list(range(11, 11 + 64 - 10))  # prompt and answer fill the 64 tokens
    assert_integrity(engine)


def test_decode_role_sends_a_prompt_sharing_less_than_a_page_with_its_cache_to_a_prefill_worker():
    engine, outputs = make_engine(page_size=4, role=Role.DECODE, local_prefill_max_tokens=10), {}
    reserved: list[Req] = []
    first = make_req("t1", list(range(1, 13)), outputs, max_new_tokens=2)
    first.on_pages_reserved = reserved.append
    engine.add_request(first)
    engine.role.kv_ready("t1", [FirstToken(13)], 0)
    run_until_idle(engine)
    few = make_req("few", [1, 2, 3] + list(range(300, 306)), outputs, max_new_tokens=1)  # 3 shared tokens
    page = make_req("page", [1, 2, 3, 4, 5] + list(range(300, 305)), outputs, max_new_tokens=1)  # 5 shared
    for req in (few, page):
        req.on_pages_reserved = reserved.append
        engine.add_request(req)
    assert reserved == [first, few]  # `page` is computed here, after the 5 tokens it shares
    assert_integrity(engine)


def test_a_prompt_the_pool_cannot_hold_is_refused_not_left_waiting():
    engine, outputs = make_engine(page_size=4, num_pages=4), {}
    with pytest.raises(ValueError, match="16 tokens this worker's KV pool holds"):
        engine.add_request(make_req("big", list(range(1, 21)), outputs))
    engine.add_request(make_req("small", list(range(1, 11)), outputs, max_new_tokens=20))
    run_until_idle(engine)
    assert finish_of(outputs, "small").finish_reason == "length" and len(tokens_of(outputs, "small")) == 6


def test_a_full_cache_is_evicted_a_slice_at_a_time_not_a_page_per_step(monkeypatch):
    # Distinct prompts leave the pool full of cached pages; a later request then needs a page every few steps.
    # Each eviction walks the whole cache tree, so it frees 1 % of the pool at once, not the one page asked for.
    engine, outputs = make_engine(page_size=1, num_pages=400), {}
    for i in range(13):
        engine.add_request(make_req(f"fill{i}", [i * 40 + k for k in range(28)], outputs, max_new_tokens=4))
    run_until_idle(engine)
    assert engine.cache.evictable_pages() > 360 and engine.allocator.num_free < 40  # the pool is mostly cache
    walks = []
    evict = engine.cache.evict
    monkeypatch.setattr(engine.cache, "evict", lambda n: walks.append(n) or evict(n))
    engine.add_request(make_req("long", [900, 901], outputs, max_new_tokens=60))
    run_until_idle(engine)
    assert tokens_of(outputs, "long") == [(901 + k) % VOCAB for k in range(1, 61)]
    assert walks and all(n >= 4 for n in walks) and len(walks) <= 62 // 4 + 1
    assert_integrity(engine)


def test_fully_cached_prompt_still_computes_its_last_token():
    engine, outputs = make_engine(page_size=4), {}
    prompt = list(range(1, 17))  # exactly four pages
    engine.add_request(make_req("a", prompt, outputs, max_new_tokens=1))
    run_until_idle(engine)
    engine.add_request(make_req("b", prompt, outputs, max_new_tokens=1))
    run_until_idle(engine)
    assert finish_of(outputs, "b").cached_tokens == 15  # all but the last, whose logits give the first token
    assert tokens_of(outputs, "b") == [17]


def test_chunked_prefill_splits_long_prompts_and_interleaves_decodes():
    engine, outputs = make_engine(page_size=4, chunked_prefill_size=8, max_prefill_tokens=8), {}
    engine.add_request(make_req("short", [1, 2, 3], outputs, max_new_tokens=20))
    engine.step()  # prefill of the short prompt
    engine.add_request(make_req("long", list(range(100, 130)), outputs, max_new_tokens=3))
    run_until_idle(engine)
    chunks = [(pos, n) for rid, pos, n in engine.runner.computed if rid == "long"]
    assert chunks[:4] == [(0, 8), (8, 8), (16, 8), (24, 6)]
    assert tokens_of(outputs, "long") == [130, 131, 132]
    assert tokens_of(outputs, "short") == list(range(4, 24))
    assert_integrity(engine)


def test_retraction_requeues_when_pages_run_out_and_outputs_stay_exact():
    # 12 pages of 4 tokens cannot hold four requests of 4 + 16 tokens at once.
    engine, outputs = make_engine(page_size=4, num_pages=12), {}
    for i in range(4):
        engine.add_request(make_req(f"r{i}", [100 * i + 1, 100 * i + 2, 100 * i + 3, 100 * i + 4], outputs,
                                    max_new_tokens=16))
    run_until_idle(engine)
    prefills = [rid for rid, pos, n in engine.runner.computed if n > 1]
    assert len(prefills) > 4  # some request was retracted and prefilled again
    for i in range(4):
        assert tokens_of(outputs, f"r{i}") == list(range(100 * i + 5, 100 * i + 21))
    assert_integrity(engine)


def test_decode_role_retraction_recomputes_the_request_here_and_every_stream_completes():
    # 12 pages of 4 tokens cannot hold four prefilled requests of 4 + 16 tokens at once: a decode worker
    # retracts one, and must compute its prompt and output again itself (its prefill worker is done with it).
    engine, outputs = make_engine(page_size=4, num_pages=12, role=Role.DECODE), {}
    for i in range(4):
        engine.add_request(make_req(f"r{i}", [100 * i + 1, 100 * i + 2, 100 * i + 3, 100 * i + 4], outputs,
                                    max_new_tokens=16))
        engine.role.kv_ready(f"r{i}", [FirstToken(100 * i + 5)], 0)
    run_until_idle(engine, max_steps=500)
    assert [rid for rid, pos, n in engine.runner.computed if n > 1]  # some request was recomputed here
    for i in range(4):
        assert tokens_of(outputs, f"r{i}") == list(range(100 * i + 5, 100 * i + 21))
        assert finish_of(outputs, f"r{i}").finish_reason == "length"
    assert_integrity(engine)
    assert engine.scheduler.check_integrity().held == 0


def test_decode_role_a_lone_request_waits_for_pages_held_by_reservations():
    # 8 pages of 4 tokens: r0 grows to 5 pages while r1's prompt has 4 reserved, waiting for its KV. r0 cannot
    # grow, and is the only one running: it waits (retracted) instead of failing as if the pool were too small.
    engine, outputs = make_engine(page_size=4, num_pages=8, role=Role.DECODE), {}
    engine.add_request(make_req("r0", [1, 2, 3, 4], outputs, max_new_tokens=16))
    engine.role.kv_ready("r0", [FirstToken(5)], 0)
    engine.add_request(make_req("r1", list(range(101, 117)), outputs, max_new_tokens=2))
    for _ in range(30):
        engine.step()
    assert ("r0", 0) in outputs and not any(o.finish_reason for o in outputs[("r0", 0)])
    engine.role.kv_ready("r1", [FirstToken(117)], 0)
    run_until_idle(engine, max_steps=500)
    assert tokens_of(outputs, "r0") == list(range(5, 21)) and finish_of(outputs, "r0").finish_reason == "length"
    assert tokens_of(outputs, "r1") == [117, 118] and finish_of(outputs, "r1").finish_reason == "length"
    assert_integrity(engine)


def test_decode_role_computes_a_next_turn_itself_from_the_conversation_it_holds():
    engine, outputs = make_engine(page_size=4, role=Role.DECODE, local_prefill_max_tokens=10), {}
    reserved: list[Req] = []
    first = make_req("t1", list(range(1, 13)), outputs, max_new_tokens=8)
    first.on_pages_reserved = reserved.append
    engine.add_request(first)
    engine.role.kv_ready("t1", [FirstToken(13)], 0)
    run_until_idle(engine)
    assert tokens_of(outputs, "t1") == list(range(13, 21)) and reserved == [first]
    # The next turn: the whole first exchange, then 5 new tokens. This worker's cache holds 19 of its 25 tokens
    # (all it computed, a whole page and the tail of the next; the last output token's KV never was): it
    # computes the other 6 itself, and no prefill worker is asked.
    second = make_req("t2", list(range(1, 21)) + [100, 101, 102, 103, 104], outputs, max_new_tokens=3)
    second.on_pages_reserved = reserved.append
    engine.runner.computed.clear()
    engine.add_request(second)
    run_until_idle(engine)
    assert reserved == [first]
    assert tokens_of(outputs, "t2") == [105, 106, 107]
    assert engine.runner.computed[0] == ("t2", 19, 6) and outputs[("t2", 0)][0].cached_tokens == 19
    # A prompt whose uncached rest is longer than the limit goes to a prefill worker as before.
    third = make_req("t3", list(range(1, 21)) + list(range(200, 212)), outputs, max_new_tokens=1)
    third.on_pages_reserved = reserved.append
    engine.add_request(third)
    assert reserved == [first, third]
    assert_integrity(engine)


@pytest.mark.parametrize("stage", ["waiting", "chunked", "running"])
def test_abort_at_any_stage_frees_everything(stage):
    engine, outputs = make_engine(page_size=4, chunked_prefill_size=4, max_prefill_tokens=4), {}
    engine.add_request(make_req("x", list(range(1, 14)), outputs, max_new_tokens=100))
    steps = {"waiting": 0, "chunked": 1, "running": 5}[stage]
    for _ in range(steps):
        engine.step()
    assert engine.abort("x")
    assert finish_of(outputs, "x").finish_reason == "abort"
    assert not engine.has_work()
    assert_integrity(engine)
    assert engine.scheduler.check_integrity().held == 0


def test_eos_and_stop_tokens_finish_with_the_matched_token():
    engine, outputs = make_engine(), {}
    engine.add_request(make_req("eos", [995], outputs))
    engine.add_request(make_req("stop", [10], outputs, stop_token_ids=(13,)))
    engine.add_request(make_req("ignore", [997], outputs, ignore_eos=True, max_new_tokens=3))
    run_until_idle(engine)
    assert tokens_of(outputs, "eos") == [996, 997, 998, 999]
    assert (finish_of(outputs, "eos").finish_reason, finish_of(outputs, "eos").matched_stop_token) == ("stop", EOS)
    assert finish_of(outputs, "stop").matched_stop_token == 13 and tokens_of(outputs, "stop") == [11, 12, 13]
    assert tokens_of(outputs, "ignore") == [998, 999, 0]


def test_n_choices_share_the_prompt_pages():
    engine, outputs = make_engine(page_size=4), {}
    engine.add_request(make_req("n", list(range(1, 11)), outputs, n=3, max_new_tokens=4))
    engine.step()  # prefill: the prompt's two full pages are cached once and locked by all three choices
    assert engine.cache.num_pages == 2
    assert engine.scheduler.check_integrity().held == 3  # each choice owns only its copy of the partial page
    run_until_idle(engine)
    for index in range(3):
        assert tokens_of(outputs, "n", index) == [11, 12, 13, 14]
    assert_integrity(engine)


def test_lpm_policy_schedules_the_longest_cached_prefix_first():
    engine = make_engine(page_size=4, policy="lpm", max_prefill_tokens=16, chunked_prefill_size=16)
    outputs: dict = {}
    engine.add_request(make_req("warm", list(range(1, 17)), outputs, max_new_tokens=1))
    run_until_idle(engine)
    engine.runner.computed.clear()
    engine.add_request(make_req("cold", list(range(500, 516)), outputs, max_new_tokens=1))
    engine.add_request(make_req("hit", list(range(1, 17)) + [7], outputs, max_new_tokens=1))
    run_until_idle(engine)
    assert engine.runner.computed[0][0] == "hit"


def test_flush_cache_only_when_idle():
    engine, outputs = make_engine(page_size=4), {}
    engine.add_request(make_req("a", list(range(1, 10)), outputs, max_new_tokens=2))
    assert not engine.flush_cache()
    run_until_idle(engine)
    assert engine.cache.num_pages > 0
    assert engine.flush_cache()
    assert engine.cache.num_pages == 0 and engine.allocator.num_free == engine.allocator.num_pages


def test_prompt_longer_than_context_is_refused_naming_both_lengths():
    engine = make_engine()
    engine.runner.context_length = 32
    with pytest.raises(ValueError, match="40 tokens.*32"):
        engine.add_request(make_req("long", list(range(40)), {}))
    assert not engine.has_work()


def test_decode_role_reserves_pages_then_decodes_after_kv_arrives():
    engine, outputs = make_engine(page_size=4, role=Role.DECODE), {}
    reserved: list[Req] = []
    req = make_req("d", list(range(1, 11)), outputs, max_new_tokens=3, n=2)
    req.on_pages_reserved = reserved.append
    engine.add_request(req)
    assert reserved and len(reserved[0].pages) == 3 and req.status == ReqStatus.WAITING_FOR_KV
    engine.role.kv_ready("d", [FirstToken(11), FirstToken(11)], cached_tokens=4)
    run_until_idle(engine)
    assert tokens_of(outputs, "d", 0) == [11, 12, 13] == tokens_of(outputs, "d", 1)
    assert outputs[("d", 0)][0].cached_tokens == 4
    assert_integrity(engine)


def test_decode_role_abort_while_waiting_for_kv_frees_the_reservation_once_the_write_is_over():
    engine, outputs = make_engine(page_size=4, num_pages=4, role=Role.DECODE), {}
    reserved: list[Req] = []
    first = make_req("d", list(range(1, 11)), outputs)
    first.on_pages_reserved = reserved.append
    engine.add_request(first)
    pages = list(reserved[0].pages)
    assert engine.scheduler.check_integrity().held == 3
    engine.abort("d", error="client went away")
    assert finish_of(outputs, "d").error == "client went away"
    # The prefill worker may still be writing into those pages: a new request must not get them.
    late = make_req("e", list(range(1, 11)), outputs)
    late.on_pages_reserved = reserved.append
    engine.add_request(late)
    assert len(reserved) == 1 and late.status == ReqStatus.WAITING_FOR_PAGES
    assert engine.scheduler.check_integrity().held == 3
    assert_integrity(engine)
    engine.role.kv_ready("d", [FirstToken(11)], 0)  # a late reply is ignored ...
    engine.role.kv_settled("d")  # ... and once the prefill call ended, the pages go back
    engine.step()
    assert len(reserved) == 2 and sorted(reserved[1].pages) == sorted(pages)
    engine.abort("e")
    engine.role.kv_settled("e")
    assert engine.scheduler.check_integrity().held == 0
    assert_integrity(engine)


def test_decode_role_a_settle_ends_a_request_still_waiting_for_its_kv_and_frees_its_pages():
    """An abort that overtook its request found nothing; once the reservation is settled (the prefill call ended
    unanswered) no KV comes for it: it ends with an error instead of holding its pages for good."""
    engine, outputs = make_engine(page_size=4, num_pages=4, role=Role.DECODE), {}
    req = make_req("d", list(range(1, 11)), outputs)
    req.on_pages_reserved = lambda r: None
    assert not engine.abort("d")  # before the request came
    engine.add_request(req)
    assert engine.scheduler.check_integrity().held == 3
    engine.role.kv_settled("d")
    assert "will not come" in finish_of(outputs, "d").error
    assert engine.scheduler.check_integrity().held == 0
    engine.abort("d")  # a later abort finds nothing left to quarantine
    assert engine.scheduler.check_integrity().held == 0
    assert_integrity(engine)


def test_prefill_role_refuses_a_request_whose_abort_came_first():
    engine = make_engine(page_size=4, role=Role.PREFILL)
    engine.role.transfer_fn = lambda req: 0.001
    from pdserve.shared.req import TransferTarget

    assert not engine.abort("p")  # the abort overtook its request
    req = make_req("p", list(range(1, 11)), {})
    req.transfer = TransferTarget("decode-0", [7, 8, 9])
    with pytest.raises(RuntimeError, match="aborted before it arrived"):
        engine.role.add(req)
    assert not engine.has_work()
    again = make_req("p", list(range(1, 11)), {})  # remembered once only
    again.transfer = TransferTarget("decode-0", [7, 8, 9])
    fut = engine.role.add(again)
    run_until_idle(engine)
    assert fut.result(timeout=1).first_tokens[0].token_id == 11
    assert_integrity(engine)


def test_prefill_role_transfers_pages_then_returns_first_tokens():
    sent = []
    engine = make_engine(page_size=4, role=Role.PREFILL)
    engine.role.transfer_fn = lambda req: sent.append((list(req.pages), req.transfer.dst_pages)) or 0.001
    from pdserve.shared.req import TransferTarget

    req = make_req("p", list(range(1, 11)), {}, n=2)
    req.transfer = TransferTarget("decode-0", [7, 8, 9])
    fut: Future = engine.role.add(req)
    run_until_idle(engine)
    result = fut.result(timeout=1)
    assert [t.token_id for t in result.first_tokens] == [11, 11]
    assert len(sent) == 1 and len(sent[0][0]) == 3 and sent[0][1] == [7, 8, 9]
    assert_integrity(engine)
    assert engine.cache.num_pages == 3  # the prompt's pages (2 full, a tail) stay cached for later prefix hits


def test_prefill_role_transfer_failure_fails_the_request_and_frees_pages():
    engine = make_engine(page_size=4, role=Role.PREFILL)

    def broken(req):
        raise RuntimeError("peer died")

    engine.role.transfer_fn = broken
    from pdserve.shared.req import TransferTarget

    req = make_req("p", list(range(1, 11)), {})
    req.transfer = TransferTarget("decode-0", [0, 1, 2])
    fut = engine.role.add(req)
    run_until_idle(engine)
    with pytest.raises(RuntimeError, match="peer died"):
        fut.result(timeout=1)
    assert engine.scheduler.check_integrity().held == 0
    assert_integrity(engine)


@pytest.mark.parametrize("field,value", [("temperature", -1.0), ("top_p", 0.0), ("top_p", 1.5), ("n", 0),
                                         ("top_k", -5), ("min_p", 2.0)])
def test_invalid_sampling_params_are_refused_naming_the_field_and_nothing_is_queued(field, value):
    from pdserve.shared.sampling_params import InvalidParam

    engine = make_engine()
    with pytest.raises(InvalidParam) as err:
        engine.add_request(make_req("bad", [1, 2, 3], {}, **{field: value}))
    assert err.value.field == field and field in str(err.value)
    assert not engine.has_work()
    assert engine.scheduler.check_integrity().free == engine.allocator.num_pages
