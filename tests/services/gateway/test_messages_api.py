"""Anthropic's Messages API end to end with the official `anthropic` client, against the shared real gateways and
worker (conftest.py), and once through a prefill/decode pair; the block writer and the ping timer in-process.

What a user of the anthropic client must see: the same answers as Chat Completions gives (the same prompt, the
same greedy tokens), a streamed message equal to the same request not streamed, tool calls that round-trip
through tool_result, tool_choice any/tool enforced, and errors in Anthropic's shape with Anthropic's statuses.
"""
from __future__ import annotations

import asyncio
import json

import anthropic
import jsonschema
import openai
import pytest
import requests
from harness import API_KEY
from test_worker_metrics import pd  # noqa: F401  (a prefill/decode pair behind a gateway with an API key)

from pdserve.services.gateway.apis.messages.routes import _with_pings
from pdserve.services.gateway.apis.messages.format import MessageWriter, stop_reason
from pdserve.services.gateway.intake.tool_calls import ToolPlan

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {"name": "get_weather", "description": "Current weather in a city", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
                                     "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}}
ALARM = {"name": "set_alarm", "description": "Set an alarm clock", "input_schema": {
    "type": "object", "properties": {"hours": {"type": "integer", "minimum": 0, "maximum": 23}},
    "required": ["hours"], "additionalProperties": False}}
# The anthropic client passes temperature, top_p and top_k through extra_body.
GREEDY = {"temperature": 0}
SCHEMAS = {t["name"]: t["input_schema"] for t in (WEATHER, ALARM)}


def client(gw, **kwargs) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gw.url, api_key=gw.api_key or "none", max_retries=0, timeout=120, **kwargs)


def same_message(a, b) -> None:
    """Two messages equal but for their ids and how much of the prompt the prefix cache served (the later of
    two requests finds the earlier one's prompt there)."""
    assert a.model_dump(exclude={"id", "usage"}) == b.model_dump(exclude={"id", "usage"})
    assert a.usage.output_tokens == b.usage.output_tokens
    assert a.usage.input_tokens + a.usage.cache_read_input_tokens == \
        b.usage.input_tokens + b.usage.cache_read_input_tokens


# ---------------------------------------------------------------- answers
def test_plain_answer_has_anthropics_shape_and_chats_tokens(colocated):
    c = client(colocated.open)
    m = c.messages.create(model="default", max_tokens=24, extra_body=GREEDY, messages=FRANCE)
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant" and m.model == "default"
    assert [b.type for b in m.content] == ["text"] and "Paris" in m.content[0].text
    assert m.stop_reason == "end_turn" and m.stop_sequence is None
    chat = openai.OpenAI(base_url=colocated.open.base, api_key="none", max_retries=0, timeout=120)
    r = chat.chat.completions.create(model="default", max_tokens=24, temperature=0, messages=FRANCE)
    assert m.content[0].text == r.choices[0].message.content
    prompt = m.usage.input_tokens + m.usage.cache_read_input_tokens
    assert prompt == r.usage.prompt_tokens and m.usage.output_tokens == r.usage.completion_tokens
    assert m.usage.cache_creation_input_tokens == 0
    count = c.messages.count_tokens(model="default", messages=FRANCE)
    assert count.input_tokens == prompt


def test_streamed_message_equals_the_message_not_streamed(colocated):
    c = client(colocated.open)
    kwargs = dict(model="default", max_tokens=40, extra_body=GREEDY, system="Answer in one short sentence.",
                  messages=[{"role": "user", "content": "Name three colours of the rainbow."}])
    whole = c.messages.create(**kwargs)
    with c.messages.stream(**kwargs) as stream:
        events = [e.type for e in stream]
        streamed = stream.get_final_message()
    same_message(streamed, whole)
    assert events[0] == "message_start" and events[-2:] == ["message_delta", "message_stop"]
    assert events[1] == "content_block_start" and events[-3] == "content_block_stop"
    # Raw events: each named, a ping right after message_start, no [DONE].
    extra = kwargs.pop("extra_body")
    raw = {**kwargs, **extra, "stream": True}
    r = requests.post(colocated.open.url + "/v1/messages", json=raw, stream=True, timeout=120)
    lines = r.text.splitlines()
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    datas = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]
    assert r.headers["Content-Type"].startswith("text/event-stream") and names[:2] == ["message_start", "ping"]
    assert names == [d["type"] for d in datas] and "[DONE]" not in r.text


def test_max_tokens_and_stop_sequences_set_the_stop_reason(colocated):
    c = client(colocated.open)
    short = c.messages.create(model="default", max_tokens=3, extra_body=GREEDY, messages=FRANCE)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 3
    stopped = c.messages.create(model="default", max_tokens=24, extra_body=GREEDY, messages=FRANCE,
                                stop_sequences=["Paris"])
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", "Paris")
    assert not stopped.content[0].text.endswith("Paris") and "capital" in stopped.content[0].text
    with c.messages.stream(model="default", max_tokens=24, extra_body=GREEDY, messages=FRANCE,
                           stop_sequences=["Paris"]) as stream:
        same_message(stream.get_final_message(), stopped)


def test_multi_turn_and_system_blocks_render_as_chat_does(colocated):
    c = client(colocated.open)
    first = c.messages.create(model="default", max_tokens=24, extra_body=GREEDY, messages=FRANCE)
    chat = openai.OpenAI(base_url=colocated.open.base, api_key="none", max_retries=0, timeout=120)
    chat_turns = [{"role": "system", "content": "You are a geography teacher."}, *FRANCE,
                  {"role": "assistant", "content": first.content[0].text},
                  {"role": "user", "content": "And of Italy?"}]
    r = chat.chat.completions.create(model="default", max_tokens=24, temperature=0, messages=chat_turns)
    turns = FRANCE + [{"role": "assistant", "content": first.content},
                      {"role": "user", "content": [{"type": "text", "text": "And of Italy?"}]}]
    second = c.messages.create(model="default", max_tokens=24, extra_body=GREEDY, messages=turns,
                               system=[{"type": "text", "text": "You are a geography teacher."}])
    assert "Rome" in second.content[0].text and second.content[0].text == r.choices[0].message.content
    # The same prompt, just served to chat, came from the prefix cache; without --enable-cache-report that is not
    # told (tests/services/gateway/test_cache_isolation.py): all of it counts as input.
    assert second.usage.input_tokens == r.usage.prompt_tokens and second.usage.cache_read_input_tokens == 0


# ---------------------------------------------------------------- tools
def tool_use(message) -> list:
    return [b for b in message.content if b.type == "tool_use"]


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "set_alarm"}])
def test_tool_choice_any_and_tool_are_enforced_and_stream_the_same_input(colocated, choice):
    c = client(colocated.open)
    kwargs = dict(model="default", max_tokens=60, extra_body=GREEDY, messages=FRANCE, tools=[WEATHER, ALARM],
                  tool_choice={**choice, "disable_parallel_tool_use": True})
    m = c.messages.create(**kwargs)
    calls = tool_use(m)
    assert m.stop_reason == "tool_use" and len(calls) == 1 and calls[0].id.startswith("toolu_")
    assert calls[0].name in ({"set_alarm"} if choice["type"] == "tool" else set(SCHEMAS))
    jsonschema.validate(calls[0].input, SCHEMAS[calls[0].name])  # the input_schema, parsed into `input`
    with c.messages.stream(**kwargs) as stream:
        deltas = [e.delta.type for e in stream if e.type == "content_block_delta"]
        streamed = stream.get_final_message()
    assert "input_json_delta" in deltas
    assert [(b.name, b.input) for b in tool_use(streamed)] == [(calls[0].name, calls[0].input)]
    assert streamed.stop_reason == "tool_use"


def test_a_tool_call_round_trips_through_tool_result(colocated):
    c = client(colocated.open)
    ask = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    m = c.messages.create(model="default", max_tokens=60, extra_body=GREEDY, messages=ask, tools=[WEATHER],
                          tool_choice={"type": "tool", "name": "get_weather"})
    call = tool_use(m)[0]
    assert call.name == "get_weather" and call.input["city"] in ("Paris", "London", "Tokyo")
    turns = ask + [{"role": "assistant", "content": m.content},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                 "content": [{"type": "text", "text": "Sunny, 24 degrees."}]}]}]
    answer = c.messages.create(model="default", max_tokens=30, extra_body=GREEDY, messages=turns, tools=[WEATHER])
    assert [b.type for b in answer.content] == ["text"] and answer.content[0].text
    # The tool result reached the prompt as chat's tool message does.
    chat_turns = ask + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(call.input)}}]},
        {"role": "tool", "tool_call_id": call.id, "name": "get_weather", "content": "Sunny, 24 degrees."}]
    tools = [{"type": "function", "function": {"name": WEATHER["name"], "description": WEATHER["description"],
                                               "parameters": WEATHER["input_schema"]}}]
    chat = openai.OpenAI(base_url=colocated.open.base, api_key="none", max_retries=0, timeout=120)
    r = chat.chat.completions.create(model="default", max_tokens=30, temperature=0, messages=chat_turns,
                                     tools=tools)
    assert answer.content[0].text == r.choices[0].message.content
    counted = c.messages.count_tokens(model="default", messages=turns, tools=[WEATHER])
    assert counted.input_tokens == r.usage.prompt_tokens


# ---------------------------------------------------------------- thinking, auth, errors
def test_thinking_blocks_come_from_the_reasoning_parser(colocated):
    # The secured gateway runs --reasoning-parser deepseek-r1: the answer opens inside the reasoning, and the
    # default model never closes it, so all of it is thinking.
    c = client(colocated.secured)
    kwargs = dict(model="default", max_tokens=12, extra_body=GREEDY, messages=FRANCE,
                  thinking={"type": "enabled", "budget_tokens": 1024})
    m = c.messages.create(**kwargs)
    assert [b.type for b in m.content] == ["thinking"] and m.content[0].thinking
    with c.messages.stream(**kwargs) as stream:
        deltas = {e.delta.type for e in stream if e.type == "content_block_delta"}
        same_message(stream.get_final_message(), m)
    assert deltas == {"thinking_delta"}
    plain = c.messages.create(**{**kwargs, "thinking": {"type": "disabled"}})
    assert [b.type for b in plain.content] == ["text"] and plain.content[0].text == m.content[0].thinking


def test_keys_by_x_api_key_or_bearer_and_anthropic_errors(colocated):
    gw = colocated.secured
    assert client(gw).messages.create(model="default", max_tokens=2, messages=FRANCE).content  # x-api-key
    bearer = anthropic.Anthropic(base_url=gw.url, auth_token=API_KEY, max_retries=0, timeout=120)
    assert bearer.messages.count_tokens(model="default", messages=FRANCE).input_tokens > 0
    with pytest.raises(anthropic.AuthenticationError) as info:
        anthropic.Anthropic(base_url=gw.url, api_key="wrong", max_retries=0).messages.create(
            model="default", max_tokens=2, messages=FRANCE)
    assert info.value.status_code == 401 and info.value.body["error"]["type"] == "authentication_error"
    assert info.value.body["type"] == "error" and info.value.body["request_id"]
    # The OpenAI routes keep OpenAI's shape.
    r = requests.post(gw.base + "/chat/completions", headers={"x-api-key": "wrong"}, json={}, timeout=30)
    assert r.status_code == 401 and r.json()["object"] == "error"


@pytest.mark.parametrize("body, status, kind, field", [
    ({"model": "default", "messages": FRANCE}, 400, "invalid_request_error", "max_tokens"),
    ({"model": "default", "max_tokens": 4, "messages": []}, 400, "invalid_request_error", "messages"),
    ({"model": "default", "max_tokens": 4, "messages": FRANCE, "temperature": -1}, 400, "invalid_request_error",
     "temperature"),
    ({"model": "default", "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image"}]}]}, 400,
     "invalid_request_error", "messages.0.content.0.type"),
    ({"model": "default", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "tool_result"}]}]}, 400, "invalid_request_error", "messages.0.content.0.tool_use_id"),
    ({"model": "default", "max_tokens": 4, "messages": FRANCE, "tool_choice": {"type": "any"}}, 400,
     "invalid_request_error", "tool_choice"),
    ({"model": "default", "max_tokens": 4, "messages": FRANCE, "tools": [WEATHER],
      "tool_choice": {"type": "tool", "name": "nope"}}, 400, "invalid_request_error", "tool_choice.name"),
    ({"model": "default", "max_tokens": 10**6, "messages": FRANCE}, 400, "invalid_request_error", "max_tokens"),
])
def test_bad_requests_are_anthropic_errors_naming_the_field(colocated, body, status, kind, field):
    r = requests.post(colocated.open.url + "/v1/messages", json=body, timeout=30)
    err = r.json()
    assert r.status_code == status and err["type"] == "error" and err["error"]["type"] == kind, err
    assert field in err["error"]["message"] and "Traceback" not in r.text


def test_no_worker_is_overloaded_and_routes_are_labelled_in_metrics(colocated):
    with pytest.raises(anthropic.APIStatusError) as info:
        client(colocated.dead).messages.create(model="default", max_tokens=2, messages=FRANCE)
    assert info.value.status_code == 529 and info.value.body["error"]["type"] == "overloaded_error"
    r = requests.get(colocated.open.url + "/metrics", timeout=30).text
    assert 'route="/v1/messages"' in r and 'route="/v1/messages/count_tokens"' in r


def test_prefill_decode_pair_serves_messages_streamed_and_not(pd):  # noqa: F811
    c = client(pd.gateway)
    m = c.messages.create(model="default", max_tokens=24, extra_body=GREEDY, messages=FRANCE)
    assert "Paris" in m.content[0].text and m.stop_reason == "end_turn"
    with c.messages.stream(model="default", max_tokens=24, extra_body=GREEDY, messages=FRANCE) as stream:
        same_message(stream.get_final_message(), m)
    call = c.messages.create(model="default", max_tokens=40, extra_body=GREEDY, messages=FRANCE, tools=[ALARM],
                             tool_choice={"type": "any"})
    jsonschema.validate(tool_use(call)[0].input, ALARM["input_schema"])


# ---------------------------------------------------------------- in-process
def test_blocks_follow_the_output_whole_or_in_pieces():
    plan = ToolPlan(choice="none")
    text = "<think>hmm</think>The answer."
    whole = MessageWriter("qwen3", plan)
    whole.push(text, final=True)
    assert whole.blocks.final() == [{"type": "thinking", "thinking": "hmm", "signature": ""},
                                    {"type": "text", "text": "The answer."}]
    pieces = MessageWriter("qwen3", plan)
    events = [e for k in range(len(text)) for e in pieces.push(text[k], final=k == len(text) - 1)]
    assert pieces.blocks.final() == whole.blocks.final()
    assert [e["type"] for e in events].count("content_block_start") == 2 == \
        [e["type"] for e in events].count("content_block_stop")
    assert stop_reason("stop", "Paris", False) == ("stop_sequence", "Paris")
    assert stop_reason("stop", 2, True) == ("tool_use", None) and stop_reason("length", None, True)[0] == "max_tokens"


def test_pings_fill_the_silences_of_a_slow_stream():
    async def slow():
        for k in range(2):
            await asyncio.sleep(0.25)
            yield k

    async def collect():
        return [u async for u in _with_pings(slow(), 0.1)]

    got = asyncio.run(collect())
    assert [u for u in got if u is not None] == [0, 1] and got.count(None) >= 2
