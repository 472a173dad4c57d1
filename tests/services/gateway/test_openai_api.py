"""The OpenAI-compatible API through a real gateway and worker, with the official `openai` client."""
from __future__ import annotations

import asyncio

import openai
import pytest

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
EOS = 2  # <|im_end|> of the default model


def client(gw) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.base, api_key=gw.api_key or "none", max_retries=0, timeout=120)


def model_name(gw) -> str:
    return client(gw).models.list().data[0].id


@pytest.fixture(scope="module")
def tok(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


def test_models_list_and_retrieve(colocated, default_model_dir):
    c = client(colocated.open)
    models = c.models.list().data
    assert [m.id for m in models] == [str(default_model_dir)]
    card = c.models.retrieve(models[0].id)
    assert card.id == models[0].id and card.max_model_len == 8192
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("no-such-model")


def test_chat_answers_paris_with_sglang_fields(colocated, tok):
    r = client(colocated.open).chat.completions.create(model=model_name(colocated.open), messages=FRANCE,
                                                       temperature=0, max_tokens=32)
    choice = r.choices[0]
    assert "Paris" in choice.message.content
    assert choice.finish_reason == "stop"
    assert choice.model_extra["matched_stop"] == EOS
    assert choice.message.role == "assistant" and choice.message.model_extra["reasoning_content"] is None
    prompt_text = tok.apply_chat_template(FRANCE, add_generation_prompt=True, tokenize=False)
    assert r.usage.prompt_tokens == len(tok.encode(prompt_text, add_special_tokens=False))
    # every generated token is counted, the eos included (as SGLang does); the text shows all but the eos
    assert r.usage.completion_tokens == len(tok.encode(choice.message.content, add_special_tokens=False)) + 1
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.prompt_tokens_details is None  # no --enable-cache-report on this gateway
    assert r.object == "chat.completion" and len(r.id) == 32


def test_chat_streaming_matches_the_whole_answer_and_reports_usage(colocated):
    c = client(colocated.open)
    whole = c.chat.completions.create(model=model_name(colocated.open), messages=FRANCE, temperature=0,
                                      max_tokens=32)
    chunks = list(c.chat.completions.create(model=model_name(colocated.open), messages=FRANCE, temperature=0,
                                            max_tokens=32, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == whole.choices[0].message.content
    finals = [ch.choices[0] for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].finish_reason == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(ch.object == "chat.completion.chunk" and ch.id == chunks[0].id for ch in chunks)


def test_continuous_usage_stats_counts_tokens_in_every_chunk(colocated):
    c = client(colocated.open)
    chunks = list(c.chat.completions.create(
        model=model_name(colocated.open), messages=FRANCE, temperature=0, max_tokens=16, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    content = [ch for ch in chunks if ch.choices and ch.choices[0].delta.content]
    counts = [ch.usage.completion_tokens for ch in content]
    assert counts == sorted(counts) and counts[0] >= 1  # running totals
    assert all(ch.usage.prompt_tokens == chunks[-1].usage.prompt_tokens for ch in content)
    assert chunks[-1].usage.completion_tokens >= counts[-1]
    plain = list(c.completions.create(model=model_name(colocated.open), prompt="One, two,", temperature=0,
                                      max_tokens=8, stream=True,
                                      stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert [ch.usage.completion_tokens for ch in plain if ch.choices][-1] >= 1
    # without the option only the final chunk carries usage
    chunks = list(c.chat.completions.create(model=model_name(colocated.open), messages=FRANCE, temperature=0,
                                            max_tokens=8, stream=True, stream_options={"include_usage": True}))
    assert all(ch.usage is None for ch in chunks[:-1])


def test_chat_stop_string_cuts_text_and_is_reported(colocated):
    c = client(colocated.open)
    kwargs = dict(model=model_name(colocated.open), messages=FRANCE, temperature=0, max_tokens=32, stop=["Paris"])
    r = c.chat.completions.create(**kwargs)
    assert r.choices[0].finish_reason == "stop" and r.choices[0].model_extra["matched_stop"] == "Paris"
    assert r.choices[0].message.content.endswith("is ") and "Par" not in r.choices[0].message.content
    streamed = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(**kwargs, stream=True))
    assert streamed == r.choices[0].message.content


def test_chat_length_limit_n_and_seed(colocated):
    c = client(colocated.open)
    r = c.chat.completions.create(model=model_name(colocated.open), messages=FRANCE, max_tokens=5, n=2,
                                  temperature=1.2, seed=7)
    assert [ch.index for ch in r.choices] == [0, 1]
    assert all(ch.finish_reason == "length" and ch.model_extra["matched_stop"] is None for ch in r.choices)
    assert r.usage.completion_tokens == 10
    again = c.chat.completions.create(model=model_name(colocated.open), messages=FRANCE, max_tokens=5, n=2,
                                      temperature=1.2, seed=7)
    assert [ch.message.content for ch in again.choices] == [ch.message.content for ch in r.choices]


def test_chat_logprobs(colocated):
    r = client(colocated.open).chat.completions.create(model=model_name(colocated.open), messages=FRANCE,
                                                       temperature=0, max_tokens=4, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 4
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob >= entry.top_logprobs[2].logprob
        assert entry.top_logprobs[0].token == entry.token  # greedy takes the best token
    assert "".join(bytes(e.bytes).decode("utf-8", "replace") for e in content) == r.choices[0].message.content


def test_chat_text_parts_and_system_message(colocated):
    r = client(colocated.open).chat.completions.create(
        model=model_name(colocated.open), temperature=0, max_tokens=32,
        messages=[{"role": "system", "content": "You are a helpful assistant."},
                  {"role": "user", "content": [{"type": "text", "text": "What is the capital"},
                                               {"type": "text", "text": "of France?"}]}])
    assert "Paris" in r.choices[0].message.content


def test_completions_forms(colocated, tok):
    c = client(colocated.open)
    name = model_name(colocated.open)
    one = c.completions.create(model=name, prompt="The capital of France is", temperature=0, max_tokens=6)
    assert one.object == "text_completion" and one.choices[0].finish_reason == "length"
    ids = tok.encode("The capital of France is", add_special_tokens=False)
    by_ids = c.completions.create(model=name, prompt=ids, temperature=0, max_tokens=6)
    assert by_ids.choices[0].text == one.choices[0].text
    many = c.completions.create(model=name, prompt=["The capital of France is", "One, two, three,"],
                                temperature=0, max_tokens=6)
    assert [ch.index for ch in many.choices] == [0, 1] and many.choices[0].text == one.choices[0].text
    assert many.usage.prompt_tokens == len(ids) + len(tok.encode("One, two, three,", add_special_tokens=False))
    batch_ids = c.completions.create(model=name, prompt=[ids, ids[:3]], temperature=0, max_tokens=6, n=2)
    assert [ch.index for ch in batch_ids.choices] == [0, 1, 2, 3]
    echo = c.completions.create(model=name, prompt="The capital of France is", temperature=0, max_tokens=6,
                                echo=True)
    assert echo.choices[0].text == "The capital of France is" + one.choices[0].text
    with_lps = c.completions.create(model=name, prompt="The capital of France is", temperature=0, max_tokens=6,
                                    echo=True, logprobs=1)
    lps = with_lps.choices[0].logprobs
    prompt_len = with_lps.usage.prompt_tokens
    assert lps.token_logprobs[0] is None and all(v <= 0 for v in lps.token_logprobs[1:])
    assert len(lps.tokens) == prompt_len + with_lps.usage.completion_tokens
    assert "".join(lps.tokens) == with_lps.choices[0].text and lps.text_offset[prompt_len] == len("The capital of France is")
    streamed = c.completions.create(model=name, prompt="The capital of France is", temperature=0, max_tokens=6,
                                    echo=True, logprobs=1, stream=True)
    tokens, values = [], []
    for chunk in streamed:
        if chunk.choices and chunk.choices[0].logprobs:
            tokens += chunk.choices[0].logprobs.tokens
            values += chunk.choices[0].logprobs.token_logprobs
    assert tokens == lps.tokens and values[0] is None
    assert values[1:] == pytest.approx(lps.token_logprobs[1:], abs=1e-4)


def test_a_long_echo_with_20_logprobs_is_the_short_answer_with_more_alternatives(colocated, tok):
    # 400 prompt tokens x (1 + 20 alternatives): an answer the gateway builds and encodes on its CPU pool; with
    # one alternative it is small and built inline. Everything but the alternatives is the same.
    c = client(colocated.open)
    name = model_name(colocated.open)
    ids = tok.encode("The quick brown fox jumps over the lazy dog; é ü 東京. " * 30, add_special_tokens=False)[:400]
    ask = dict(model=name, prompt=ids, temperature=0, max_tokens=2, echo=True)
    wide, narrow = (c.completions.create(**ask, logprobs=n) for n in (20, 1))
    a, b = wide.choices[0], narrow.choices[0]
    assert a.text == b.text and a.logprobs.tokens == b.logprobs.tokens and len(a.logprobs.tokens) == 402
    assert a.logprobs.text_offset == b.logprobs.text_offset
    assert a.logprobs.token_logprobs[0] is None
    assert a.logprobs.token_logprobs[1:] == pytest.approx(b.logprobs.token_logprobs[1:], abs=1e-4)
    assert a.logprobs.top_logprobs[0] is None and all(0 < len(top) <= 20 for top in a.logprobs.top_logprobs[1:])
    for wide_top, narrow_top in zip(a.logprobs.top_logprobs[1:], b.logprobs.top_logprobs[1:]):
        (best, value), = narrow_top.items()
        if "\ufffd" not in best:  # tokens holding part of a character share that text: a key may repeat
            assert wide_top[best] == pytest.approx(value, abs=1e-4) and max(wide_top.values()) == wide_top[best]
    streamed = list(c.completions.create(**ask, logprobs=20, stream=True))
    echoed = streamed[0].choices[0].logprobs
    assert echoed.tokens == a.logprobs.tokens[:400] and echoed.top_logprobs[1:] == a.logprobs.top_logprobs[1:400]


def test_completions_stop_logprobs_and_stream(colocated):
    c = client(colocated.open)
    name = model_name(colocated.open)
    r = c.completions.create(model=name, prompt="Count: 1, 2, 3, 4,", temperature=0, max_tokens=16, stop=[" 7"],
                             logprobs=2)
    assert r.choices[0].finish_reason == "stop" and r.choices[0].model_extra["matched_stop"] == " 7"
    assert " 7" not in r.choices[0].text and " 6" in r.choices[0].text
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens
    assert all(len(t) <= 2 for t in lp.top_logprobs) and lp.text_offset[0] == 0
    pieces = list(c.completions.create(model=name, prompt="Count: 1, 2, 3, 4,", temperature=0, max_tokens=16,
                                       stop=[" 7"], stream=True))
    assert "".join(p.choices[0].text for p in pieces) == r.choices[0].text
    assert pieces[-1].choices[0].finish_reason == "stop"


async def test_async_client_concurrent_requests(colocated):
    c = openai.AsyncOpenAI(base_url=colocated.open.base, api_key="none", max_retries=0, timeout=120)
    name = (await c.models.list()).data[0].id
    questions = ["What is the capital of France?", "What is 2+2?", "Name a color."]
    rs = await asyncio.gather(*(c.chat.completions.create(model=name, temperature=0, max_tokens=12,
                                                          messages=[{"role": "user", "content": q}])
                                for q in questions))
    assert all(r.choices[0].message.content for r in rs)
    assert "Paris" in rs[0].choices[0].message.content
    stream = await c.completions.create(model=name, prompt="The capital of France is", temperature=0,
                                        max_tokens=6, stream=True)
    text = "".join([chunk.choices[0].text async for chunk in stream])
    assert text == (await c.completions.create(model=name, prompt="The capital of France is", temperature=0,
                                               max_tokens=6)).choices[0].text
    await c.close()


def test_cache_report_and_reasoning_parser(colocated):
    c = client(colocated.secured)
    name = model_name(colocated.secured)
    first = c.chat.completions.create(model=name, messages=FRANCE, temperature=0, max_tokens=8)
    second = c.chat.completions.create(model=name, messages=FRANCE, temperature=0, max_tokens=8)
    assert second.usage.prompt_tokens_details.cached_tokens >= 16  # the shared prompt pages came from the cache
    assert second.usage.prompt_tokens_details.cached_tokens > first.usage.prompt_tokens_details.cached_tokens - 1
    # deepseek-r1 output starts inside the reasoning: without </think> everything is reasoning
    msg = second.choices[0].message
    assert msg.model_extra["reasoning_content"] and not msg.content
    assert second.usage.model_extra["reasoning_tokens"] > 0
    plain = c.chat.completions.create(model=name, messages=FRANCE, temperature=0, max_tokens=8,
                                      extra_body={"separate_reasoning": False})
    assert plain.choices[0].message.content == msg.model_extra["reasoning_content"]
    open_c = client(colocated.open)
    r = open_c.chat.completions.create(model=model_name(colocated.open), messages=FRANCE, temperature=0,
                                       max_tokens=4, extra_body={"return_cached_tokens_details": True})
    assert r.usage.prompt_tokens_details is None  # the client's ask alone tells nothing, as SGLang


def test_chat_multi_turn_with_tool_role_and_sglang_sampling_fields(colocated):
    r = client(colocated.open).chat.completions.create(
        model=model_name(colocated.open), max_completion_tokens=4,
        messages=[{"role": "system", "content": "You answer with numbers."},
                  {"role": "user", "content": "What is 6 times 7?"},
                  {"role": "assistant", "content": "Let me compute that."},
                  {"role": "tool", "content": "42", "tool_call_id": "call_1"},
                  {"role": "user", "content": "So?"}],
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "chat_template_kwargs": {"x": 1}})
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens <= 4
