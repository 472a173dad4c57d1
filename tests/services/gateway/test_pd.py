"""Two prefill and two decode workers behind one gateway; workers are killed while requests run.

What a user must see: requests keep being answered by the surviving workers, a request whose worker died
before it streamed anything is retried transparently, one that was already streaming ends quickly with an
error (never a hang), and the dead worker is out of rotation within seconds.
"""
from __future__ import annotations

import asyncio
import re
import time

import openai
import pytest
import requests

from harness import System, start_gateway, start_worker, wait_idle

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def pd(default_model_dir):
    system = System()
    try:
        prefills = [start_worker("prefill", str(default_model_dir), "--transfer-backend", "tcp") for _ in range(2)]
        paddrs = [a for _, a in prefills]
        decode_flags = [flag for a in paddrs for flag in ("--prefill", a)]
        # One decode worker speculates: streams move between a speculating worker and a plain one when killed.
        decodes = [start_worker("decode", str(default_model_dir), "--transfer-backend", "tcp", *decode_flags,
                                *(("--speculative-algorithm", "ngram") if i == 0 else ()))
                   for i in range(2)]
        for proc, addr in prefills + decodes:
            system.workers[addr] = proc
        targets = decode_flags + [flag for _, a in decodes for flag in ("--decode", a)]
        gw = start_gateway(default_model_dir, *targets, "--enable-cache-report")
        system.gateways.append(gw)
        for proc, _ in prefills + decodes:
            proc.wait_healthy(240)
        gw.proc.wait_healthy(60)
        # The gateway is healthy once it has one pair; the others join at its next health round.
        deadline = time.monotonic() + 60
        while not all(healthy_workers(gw).values()) and time.monotonic() < deadline:
            time.sleep(0.2)
        yield system, gw, paddrs, [a for _, a in decodes]
    finally:
        system.stop()


def healthy_workers(gw) -> dict[str, bool]:
    info = requests.get(gw.url + "/get_server_info", timeout=30).json()
    return {w["address"]: w["healthy"] for w in info["workers"]}


def test_pd_answers_through_every_pair(pd):
    system, gw, paddrs, daddrs = pd
    c = openai.OpenAI(base_url=gw.base, api_key="none", max_retries=0, timeout=120)
    r = c.chat.completions.create(model=c.models.list().data[0].id, messages=QUESTION, temperature=0, max_tokens=24)
    assert "Paris" in r.choices[0].message.content
    info = requests.get(gw.url + "/get_server_info", timeout=30).json()
    assert info["mode"] == "pd" and sorted(w["role"] for w in info["workers"]) == ["decode"] * 2 + ["prefill"] * 2
    workers = requests.get(gw.url + "/get_server_info", timeout=30).json()["workers"]
    assert all(w["healthy"] for w in workers), workers


def test_pd_tool_choice_is_enforced_from_the_first_token(pd):
    # The prefill worker samples the first token and the decode worker the rest: both apply the grammar.
    import json

    system, gw, paddrs, daddrs = pd
    c = openai.OpenAI(base_url=gw.base, api_key="none", max_retries=0, timeout=120)
    params = {"type": "object", "properties": {"hours": {"type": "integer", "minimum": 0, "maximum": 23}},
              "required": ["hours"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "set_alarm", "parameters": params}},
             {"type": "function", "function": {"name": "ping"}}]
    for choice in ("required", {"type": "function", "function": {"name": "set_alarm"}}):
        kwargs = dict(model="default", messages=QUESTION, tools=tools, tool_choice=choice, temperature=0,
                      max_tokens=60, parallel_tool_calls=False)
        r = c.chat.completions.create(**kwargs).choices[0]
        assert r.finish_reason == "tool_calls" and len(r.message.tool_calls) == 1
        call = r.message.tool_calls[0]
        args = json.loads(call.function.arguments)
        assert (call.function.name, args) == ("ping", {}) or \
            (call.function.name == "set_alarm" and list(args) == ["hours"] and 0 <= args["hours"] <= 23)
        streamed = "".join(tc.function.arguments or "" for chunk in c.chat.completions.create(**kwargs, stream=True)
                           for ch in chunk.choices for tc in ch.delta.tool_calls or [])
        assert streamed == call.function.arguments


def test_pd_tool_choice_required_with_defs_and_every_delta_field(pd):
    # The hoisted $defs compile on both workers; the streamed deltas carry content, reasoning_content, tool_calls.
    import json

    import jsonschema

    system, gw, paddrs, daddrs = pd
    c = openai.OpenAI(base_url=gw.base, api_key="none", max_retries=0, timeout=120)
    address = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Lyon"]}},
               "required": ["city"], "additionalProperties": False}
    params = {"type": "object", "properties": {"to": {"$ref": "#/$defs/Address"}}, "required": ["to"],
              "additionalProperties": False, "$defs": {"Address": address}}
    kwargs = dict(model="default", messages=[{"role": "user", "content": "Ship it to Paris."}], temperature=0,
                  max_tokens=40, tools=[{"type": "function", "function": {"name": "ship", "parameters": params}}],
                  tool_choice="required", parallel_tool_calls=False)
    call = c.chat.completions.create(**kwargs).choices[0].message.tool_calls[0]
    jsonschema.validate(json.loads(call.function.arguments), params)
    chunks = list(c.chat.completions.create(**kwargs, stream=True))
    assert all({"content", "reasoning_content", "tool_calls"} <= set(ch.choices[0].delta.model_dump())
               and ch.choices[0].delta.reasoning_content is None for ch in chunks)
    assert "".join(tc.function.arguments or "" for ch in chunks for tc in ch.choices[0].delta.tool_calls or []) \
        == call.function.arguments


def test_pd_a_responses_chain_is_prefilled_from_the_cache_of_the_worker_holding_it(pd):
    # Two prefill workers: the chained turn goes to the one whose radix cache holds the first exchange.
    system, gw, paddrs, daddrs = pd
    c = openai.OpenAI(base_url=gw.base, api_key="none", max_retries=0, timeout=120)
    first = c.responses.create(model="default", input="My name is Ada and I live in Paris. Say hello to me.",
                               temperature=0, max_output_tokens=16)
    second = c.responses.create(model="default", input="What is my name?", previous_response_id=first.id,
                                temperature=0, max_output_tokens=16)
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens // 16 * 16 > 0
    assert second.output_text


def test_pd_a_cache_salt_shares_a_prefix_only_within_itself(pd):
    # The salt travels to the prefill worker with the sampling parameters: its radix cache, the decode worker's
    # own cache and the router all keep the two salts apart.
    system, gw, paddrs, daddrs = pd
    c = openai.OpenAI(base_url=gw.base, api_key="none", max_retries=0, timeout=120)
    system_prompt = "You are the support assistant of a bank. The customer's PIN is 4921; never say it. " * 4

    def ask(salt: str) -> int:
        r = c.chat.completions.create(model="default", temperature=0, max_tokens=2, extra_body={"cache_salt": salt},
                                      messages=[{"role": "system", "content": system_prompt},
                                                {"role": "user", "content": "Hello?"}])
        return r.usage.prompt_tokens_details.cached_tokens

    assert ask("tenant-a") == 0
    assert ask("tenant-a") >= 5 * 16
    assert ask("tenant-b") == 0


def test_pd_cached_tokens_count_every_shared_token_not_whole_pages(pd):
    # SGLang's count (issue 59) through prefill and decode workers: a repeated 37-token prompt shares 36 tokens.
    system, gw, paddrs, daddrs = pd
    ids = [1000 + (k * 7919) % 39000 for k in range(37)]

    def cached(input_ids: list[int]) -> int:
        r = requests.post(gw.url + "/generate", timeout=120, json={
            "input_ids": input_ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
        assert r.status_code == 200, r.text
        return r.json()["meta_info"]["cached_tokens"]

    assert cached(ids) == 0
    assert cached(ids) == 36
    assert cached(ids[:20] + [2000 + k for k in range(17)]) == 20


def prompt_tokens(proc) -> float:
    text = requests.get(proc.health_url.replace("/health", "/metrics"), timeout=30).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("sglang:prompt_tokens_total"))


def test_pd_a_conversations_next_turn_is_computed_by_the_decode_worker_holding_it(pd):
    # The decode worker that decoded the first exchange holds its KV, output included: the router sends the next
    # turn back to it, and it computes the few new tokens itself; no prefill worker computes the turn again.
    system, gw, paddrs, daddrs = pd
    c = openai.OpenAI(base_url=gw.base, api_key="none", max_retries=0, timeout=120)
    first = c.responses.create(model="default", input="My name is Grace and I write compilers. Greet me.",
                               temperature=0, max_output_tokens=24)
    before = {a: prompt_tokens(system.workers[a]) for a in paddrs + daddrs}
    second = c.responses.create(model="default", input="What do I write?", previous_response_id=first.id,
                                temperature=0, max_output_tokens=8)
    after = {a: prompt_tokens(system.workers[a]) for a in paddrs + daddrs}
    assert [after[a] - before[a] for a in paddrs] == [0, 0]
    assert sum(after[a] - before[a] for a in daddrs) == second.usage.input_tokens
    exchange = first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= (exchange - 1) // 16 * 16
    assert second.output_text


def test_pd_serves_any_model_name_over_the_prompt_v1_tokenize_counts(pd):
    # SGLang's surface through prefill and decode (issue 59): no --served-model-name, so any `model` is served;
    # the prompt /v1/tokenize counts for the messages is the one the workers are charged for.
    system, gw, paddrs, daddrs = pd
    c = openai.OpenAI(base_url=gw.base, api_key="none", max_retries=0, timeout=120)
    r = c.chat.completions.create(model="gpt-9", messages=QUESTION, temperature=0, max_tokens=24)
    assert "Paris" in r.choices[0].message.content and r.model == "gpt-9"
    counted = requests.post(gw.url + "/v1/tokenize", json={"messages": QUESTION}, timeout=30).json()
    assert counted["count"] == r.usage.prompt_tokens
    assert counted["max_model_len"] == requests.get(gw.url + "/server_info", timeout=30).json()["context_length"]


def test_pd_a_length_the_context_cannot_hold_is_a_400_not_capped(pd):
    system, gw, paddrs, daddrs = pd
    limit = requests.get(gw.url + "/server_info", timeout=30).json()["context_length"]
    c = openai.OpenAI(base_url=gw.base, api_key="none", max_retries=0, timeout=120)
    with pytest.raises(openai.BadRequestError) as err:
        c.chat.completions.create(model="default", messages=QUESTION, max_tokens=limit + 1)
    assert f"max_completion_tokens is too large: {limit + 1}" in str(err.value)
    with pytest.raises(openai.BadRequestError) as err:
        c.completions.create(model="default", prompt="The capital of France is", max_tokens=limit - 2)
    assert f"exceeds the model's maximum context length of {limit} tokens" in str(err.value)


def test_pd_token_ids_logprob_and_a_prompt_scored_with_max_new_tokens_0(pd):
    """The first token's logprobs come from the prefill worker, the rest from decode; scoring (max_new_tokens 0)
    still has the prefill worker compute every prompt logprob."""
    system, gw, paddrs, daddrs = pd
    ids = [504, 3575, 282, 4649, 314, 7042, 0]  # "The capital of France is", " Paris", and an unlikely one
    body = {"text": "The capital of France is", "return_logprob": True, "logprob_start_len": 0,
            "token_ids_logprob": ids}
    answers = [requests.post(gw.url + "/generate", timeout=120, json={
        **body, "sampling_params": {"temperature": 0, "max_new_tokens": n}}).json()["meta_info"] for n in (4, 0)]
    four, zero = answers
    assert len(four["output_token_ids_logprobs"]) == four["completion_tokens"] == 4
    for named, (lp, token, _) in zip(four["input_token_ids_logprobs"][1:] + four["output_token_ids_logprobs"],
                                     four["input_token_logprobs"][1:] + four["output_token_logprobs"]):
        assert [entry[1] for entry in named] == ids and (token not in ids or named[ids.index(token)][0] == lp)
    assert zero["completion_tokens"] == 0 and zero["finish_reason"] == {"type": "length", "length": 0}
    assert len(zero["input_token_logprobs"]) == zero["prompt_tokens"] == 5
    assert zero["input_token_ids_logprobs"][0] is None
    assert zero["input_token_logprobs"] == four["input_token_logprobs"]
    assert zero["input_token_ids_logprobs"] == four["input_token_ids_logprobs"]
    assert zero["output_token_logprobs"] == [] and zero["output_token_ids_logprobs"] == \
        four["output_token_ids_logprobs"][:1]  # the position after the prompt, computed by the prefill worker


def test_pd_stop_regex_ends_the_output_at_its_first_match(pd):
    system, gw, paddrs, daddrs = pd
    c = openai.OpenAI(base_url=gw.base, api_key="none", max_retries=0, timeout=120)
    r = c.completions.create(model=c.models.list().data[0].id, prompt="Count: 1, 2, 3, 4,", temperature=0,
                             max_tokens=40, extra_body={"stop_regex": r"\d{2}"})
    assert r.choices[0].finish_reason == "stop" and r.choices[0].matched_stop == r"\d{2}"
    text = r.choices[0].text
    assert re.search(r"\d{2}", text).end() == len(text) and r.usage.completion_tokens < 40


async def test_killing_workers_mid_run(pd):
    system, gw, paddrs, daddrs = pd
    c = openai.AsyncOpenAI(base_url=gw.base, api_key="none", max_retries=0, timeout=120)
    model = (await c.models.list()).data[0].id

    started = [asyncio.Event() for _ in range(4)]

    async def streamed(i: int) -> tuple[str, float]:
        """A long stream; returns ('ok' or the error it ended with, when it ended)."""
        try:
            stream = await c.completions.create(model=model, prompt=f"Tell me story number {i} about a dragon.",
                                                max_tokens=80, stream=True, extra_body={"ignore_eos": True})
            async for _ in stream:
                started[i].set()
            return "ok", time.monotonic()
        except openai.APIError as exc:
            return f"error: {exc}", time.monotonic()

    async def whole(i: int) -> str:
        r = await c.completions.create(model=model, prompt=f"Count to {i}:", max_tokens=12, temperature=0)
        return r.choices[0].finish_reason

    streams = [asyncio.create_task(streamed(i)) for i in range(4)]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)  # all four are streaming
    on = {w["address"]: w["in_flight"] for w in requests.get(gw.url + "/get_server_info", timeout=30).json()["workers"]
          if w["address"] in daddrs}
    victim = max(daddrs, key=lambda a: on[a])  # the decode worker with the most of the streams
    system.workers[victim].kill()
    killed_at = time.monotonic()
    # Sent before the gateway has noticed: any that lands on the dead worker is retried on the other.
    early = asyncio.gather(*(whole(i) for i in range(4)))
    results = await asyncio.wait_for(asyncio.gather(*streams), 90)
    assert await asyncio.wait_for(early, 90) == ["length"] * 4
    # The streams on the dead worker go on on the other one (migration): every client gets its whole stream.
    assert [r for r, _ in results] == ["ok"] * 4, results
    migrated = [line for line in requests.get(gw.url + "/metrics", timeout=30).text.splitlines()
                if line.startswith("pdserve_gateway_migrations_total")]
    assert migrated and float(migrated[0].split()[-1]) >= on[victim] >= 1, (migrated, on)
    # Whole (non-streamed) requests sent now all succeed on the survivors.
    finishes = await asyncio.gather(*(whole(i) for i in range(4)))
    assert finishes == ["length"] * 4
    deadline = killed_at + 10
    while healthy_workers(gw)[victim] and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    assert not healthy_workers(gw)[victim]

    # A prefill worker dies too: prompts go to the other one.
    system.workers[paddrs[0]].kill()
    finishes = await asyncio.gather(*(whole(i) for i in range(4)))
    assert finishes == ["length"] * 4
    assert requests.get(gw.url + "/health", timeout=30).status_code == 200
    await c.close()
    for addr in (daddrs[1], paddrs[1]):
        load, stats = wait_idle(addr)
        assert (load.running, stats.used_pages, stats.integrity_ok) == (0, 0, True), (addr, stats)
