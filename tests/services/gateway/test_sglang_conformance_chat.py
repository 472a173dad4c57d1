"""Chat and Responses as a client written against SGLang sees them, with the official `openai` client on the
shared colocated system (conftest.py): every streamed chat delta carries `content`, `reasoning_content` and
`tool_calls`; tool_choice required takes tools whose parameters use `$defs`, and a tool whose parameters are
no JSON schema is SGLang's 400; a response cut by max_output_tokens ends with `response.completed` (and, with
--responses-incomplete-status, OpenAI's `incomplete`), its usage in both sets of names."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest
import requests

from harness import start_gateway

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
DELTA_FIELDS = {"content", "reasoning_content", "tool_calls"}
ADDRESS = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Lyon"]},
                                            "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
           "required": ["city", "zip"], "additionalProperties": False}


def client(gw) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.base, api_key=gw.api_key or "unused", max_retries=0, timeout=120)


def ship_tool(name: str = "ship", address: dict = ADDRESS) -> dict:
    return {"type": "function", "function": {"name": name, "description": "Ship a parcel", "parameters": {
        "type": "object", "properties": {"to": {"$ref": "#/$defs/Address"}, "weight_kg": {"type": "integer"}},
        "required": ["to", "weight_kg"], "additionalProperties": False, "$defs": {"Address": address}}}}


# ---------------------------------------------------------------- streamed chat deltas
def raw_deltas(gw, **body) -> list[dict]:
    r = requests.post(gw.url + "/v1/chat/completions", headers=gw.headers(), stream=True, timeout=120,
                      json={"model": "default", "messages": QUESTION, "temperature": 0, "stream": True, **body})
    assert r.status_code == 200, r.text
    events = [json.loads(line[6:]) for line in r.iter_lines(decode_unicode=True)
              if line.startswith("data: ") and line != "data: [DONE]"]
    return [ch for event in events for ch in event["choices"]]


def test_every_streamed_delta_carries_content_reasoning_and_tool_calls(colocated):
    choices = raw_deltas(colocated.open, max_tokens=8)
    assert all(set(ch["delta"]) >= DELTA_FIELDS for ch in choices), choices
    assert choices[0]["delta"] == {"role": "assistant", "content": "", "reasoning_content": None, "tool_calls": None}
    assert all("role" not in ch["delta"] for ch in choices[1:])  # the role comes once
    last = choices[-1]
    assert last["finish_reason"] is not None and last["delta"]["reasoning_content"] is None  # was `"delta": {}`


def test_openai_client_reads_reasoning_content_on_every_chunk(colocated):
    # Without a reasoning parser every chunk's reasoning_content is None (it raised AttributeError when absent).
    chunks = list(client(colocated.open).chat.completions.create(model="default", messages=QUESTION, temperature=0,
                                                                 max_tokens=12, stream=True))
    assert [ch.choices[0].delta.reasoning_content for ch in chunks] == [None] * len(chunks)
    assert "Paris" in "".join(ch.choices[0].delta.content or "" for ch in chunks)
    # deepseek-r1 (the secured gateway): the output opens inside the reasoning, so it all streams as reasoning.
    chunks = list(client(colocated.secured).chat.completions.create(
        model="default", messages=QUESTION, temperature=0, max_tokens=12, stream=True))
    reasoning = "".join(ch.choices[0].delta.reasoning_content or "" for ch in chunks)
    assert "Paris" in reasoning and not any(ch.choices[0].delta.content for ch in chunks)


# ---------------------------------------------------------------- tools whose parameters use $defs
def test_tool_choice_required_takes_a_tool_whose_parameters_use_defs(colocated):
    c = client(colocated.open)
    tools = [ship_tool(), {"type": "function", "function": {"name": "ping"}}]
    kwargs = dict(model="default", temperature=0, max_tokens=80, tools=tools, tool_choice="required",
                  parallel_tool_calls=False, messages=[{"role": "user", "content": "Ship 3 kg to Paris, zip 75001."}])
    for given in (tools[:1], tools):  # one tool alone failed too
        r = c.chat.completions.create(**{**kwargs, "tools": given}).choices[0]
        assert r.finish_reason == "tool_calls" and r.message.tool_calls, r
        for call in r.message.tool_calls:
            schema = next(t["function"].get("parameters") or {} for t in given
                          if t["function"]["name"] == call.function.name)
            jsonschema.validate(json.loads(call.function.arguments), schema)
    streamed = list(c.chat.completions.create(**{**kwargs, "tools": tools[:1]}, stream=True))
    args = "".join(tc.function.arguments or "" for ch in streamed for tc in ch.choices[0].delta.tool_calls or [])
    jsonschema.validate(json.loads(args), tools[0]["function"]["parameters"])


def test_defs_hold_through_the_responses_and_messages_dialects(colocated):
    fn = ship_tool()["function"]
    ask = "Ship 3 kg to Paris, zip 75001."
    r = client(colocated.open).responses.create(model="default", input=ask, temperature=0, max_output_tokens=80,
                                                tools=[{"type": "function", **fn}], tool_choice="required",
                                                parallel_tool_calls=False)
    calls = [item for item in r.output if item.type == "function_call"]
    assert [c.name for c in calls] == ["ship"], r.output
    jsonschema.validate(json.loads(calls[0].arguments), fn["parameters"])
    m = requests.post(colocated.open.url + "/v1/messages", timeout=120, json={
        "model": "default", "max_tokens": 80, "temperature": 0, "messages": [{"role": "user", "content": ask}],
        "tools": [{"name": "ship", "input_schema": fn["parameters"]}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True}})
    assert m.status_code == 200, m.text
    uses = [block for block in m.json()["content"] if block["type"] == "tool_use"]
    assert [u["name"] for u in uses] == ["ship"] and m.json()["stop_reason"] == "tool_use", m.json()
    jsonschema.validate(uses[0]["input"], fn["parameters"])


def test_two_tools_defining_one_name_differently_are_a_400_naming_both(colocated):
    tools = [ship_tool(), ship_tool("bill", {"type": "string"})]
    with pytest.raises(openai.BadRequestError) as info:
        client(colocated.open).chat.completions.create(model="default", messages=QUESTION, tools=tools,
                                                       tool_choice="required", max_tokens=8)
    assert info.value.body["param"] == "tools" and "'ship' and 'bill'" in info.value.body["message"]
    sglang = "Tool definition 'Address' has multiple schemas, which is not supported"  # SGLang's words
    assert info.value.body["message"].startswith(sglang)
    same = [ship_tool(), ship_tool("bill")]  # the same definition twice is one definition
    r = client(colocated.open).chat.completions.create(model="default", messages=QUESTION, tools=same,
                                                       tool_choice="required", max_tokens=80, temperature=0,
                                                       parallel_tool_calls=False)
    assert r.choices[0].message.tool_calls


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_a_tool_whose_parameters_are_no_json_schema_is_a_400_in_sglangs_words(colocated, choice):
    bad = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "unknown_type"}}, "required": ["x"]}}}
    with pytest.raises(openai.BadRequestError) as info:
        client(colocated.open).chat.completions.create(model="default", messages=QUESTION, max_tokens=4,
                                                       tools=[ship_tool(), bad], tool_choice=choice)
    body = info.value.body
    assert body["message"].startswith("Tool 1 function has invalid 'parameters' schema: ")
    assert "unknown_type" in body["message"] and body["param"] == "tools.1.function.parameters"


# ---------------------------------------------------------------- /v1/responses cut by max_output_tokens
def test_a_responses_stream_cut_by_max_output_tokens_completes_for_the_sdk_helper(colocated):
    c = client(colocated.open)
    with c.responses.stream(model="default", input="Write a long story about a dragon.", max_output_tokens=4,
                            temperature=0) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()  # raised "Didn't receive a `response.completed` event"
    assert kinds[-1] == "response.completed" and "response.incomplete" not in kinds
    assert final.status == "completed" and final.incomplete_details.reason == "max_output_tokens"
    usage = final.usage
    assert usage.output_tokens == usage.model_extra["completion_tokens"] == 4
    assert usage.input_tokens == usage.model_extra["prompt_tokens"] > 0
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens


@pytest.fixture(scope="module")
def openai_status(colocated, default_model_dir):
    gw = start_gateway(default_model_dir, "--worker", colocated.worker, "--responses-incomplete-status")
    try:
        gw.proc.wait_healthy(60)
        yield gw
    finally:
        gw.proc.stop()


def test_responses_incomplete_status_flag_gives_openais_incomplete(openai_status):
    c = client(openai_status)
    ask = dict(model="default", input="Write a long story about a dragon.", max_output_tokens=4, temperature=0)
    whole = c.responses.create(**ask)
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert whole.usage.model_extra["completion_tokens"] == whole.usage.output_tokens == 4
    events = list(c.responses.create(**ask, stream=True))
    assert events[-1].type == "response.incomplete" and events[-1].response.output_text == whole.output_text
    done = c.responses.create(model="default", input="Say hi.", max_output_tokens=64, temperature=0)
    assert done.status == "completed" and done.incomplete_details is None  # only a cut output is incomplete
