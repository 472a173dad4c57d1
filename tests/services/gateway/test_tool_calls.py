"""Tool calling: the request checks, the grammar of tool_choice required / named, and the chat API end to end
with the official `openai` client (the parsers themselves: test_tool_parsers.py).

Checks run in-process. `--tool-call-parser` runs an in-process gateway over a scripted worker
that replays a model's tool-call output token by token (the default model writes no tool markup of its own);
required and named tool_choice run on the shared real gateway and worker (conftest.py), whose grammar makes
even the default model answer with valid calls.
"""
from __future__ import annotations

import argparse
import asyncio
import json

import jsonschema
import openai
import pytest
import requests
from aiohttp.test_utils import TestServer
from harness import ScriptedWorker

from pdserve.services.gateway.errors import ApiError
from pdserve.services.gateway.intake.protocol import ChatCompletionRequest, parse
from pdserve.services.gateway.tokenization import ModelTokenizer
from pdserve.services.gateway.intake.tool_calls import plan_tools, template_messages
from pdserve.services.gateway.intake.tool_parsers import get_parser

USER = [{"role": "user", "content": "What is the weather like in Paris today?"}]
WEATHER_PARAMS = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}
TIME_PARAMS = {"type": "object", "properties": {"hours": {"type": "integer", "minimum": 0, "maximum": 23}},
               "required": ["hours"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER_PARAMS}},
         {"type": "function", "function": {"name": "set_alarm", "description": "Set an alarm clock",
                                           "parameters": TIME_PARAMS}}]
SCHEMAS = {"get_weather": WEATHER_PARAMS, "set_alarm": TIME_PARAMS}


# ---------------------------------------------------------------- request checks
def plan(body: dict, parser: str | None = None):
    return plan_tools(parse(ChatCompletionRequest, {"messages": USER, **body}), parser)


def refusal(body: dict) -> ApiError:
    with pytest.raises(ApiError) as info:
        plan(body)
    assert info.value.status == 400
    return info.value


@pytest.mark.parametrize("body, param, words", [
    ({"tool_choice": "required"}, "tool_choice", "Tools cannot be empty if tool choice is set to required."),
    ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice",
     "Tools cannot be empty if tool choice is set to a specific tool."),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "Tool 'nope' not found in tools list."),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "required"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools.0.function.name",
     "required"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
     "tools.0.function.parameters", "dictionary"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools.0.function.parameters", "'object'"),
    ({"tools": [TOOLS[0], TOOLS[1], TOOLS[0]]}, "tools.2.function.name", "twice"),
    ({"tools": [{"type": "function", "function": {"name": "get weather!"}}]}, "tools.0.function.name", "letters"),
    ({"tools": [{"type": "retrieval"}]}, "tools.0.type", "function"),
    ({"tools": [{"type": "function"}]}, "tools.0.function", "required"),
    ({"tools": "get_weather"}, "tools", "list"),
    ({"tools": TOOLS, "functions": [TOOLS[0]["function"]]}, "functions", "not both"),
    ({"functions": [{"name": "f"}], "function_call": {"name": "g"}}, "function_call", "'g'"),
    ({"functions": [{"name": "f"}], "function_call": "required"}, "function_call", "auto"),
    ({"functions": [{"parameters": {}}]}, "functions.0.name", "required"),
])
def test_bad_tools_and_tool_choice_are_400_naming_the_field(body, param, words):
    err = refusal(body)
    assert err.param == param and words in err.message, err.message


def test_legacy_functions_map_onto_tools():
    fn = TOOLS[0]["function"]
    legacy = plan({"functions": [fn], "function_call": {"name": "get_weather"}})
    modern = plan({"tools": [TOOLS[0]], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    assert legacy == modern and legacy.choice == "function" and legacy.function == "get_weather"
    assert plan({"functions": [fn]}).choice == "auto" and plan({"functions": [fn], "function_call": "none"}).choice \
        == "none"
    assert plan({"functions": [fn]}).template_tools == [TOOLS[0]]


def test_tool_choice_decides_template_tools_grammar_and_reader():
    none = plan({"tools": TOOLS, "tool_choice": "none"}, "qwen25")
    assert none.template_tools is None and none.json_schema() is None and none.stream() is None
    auto = plan({"tools": TOOLS}, "qwen25")
    assert auto.choice == "auto" and auto.template_tools == TOOLS and auto.json_schema() is None
    assert isinstance(auto.stream().reader, type(get_parser("qwen25")))
    assert plan({"tools": TOOLS}).stream() is None  # no --tool-call-parser: plain content, as in SGLang
    assert plan({}).choice == "none" and plan({"tool_choice": "auto"}).choice == "none"
    named = plan({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "set_alarm"}}})
    assert named.template_tools == [TOOLS[1]] and json.loads(named.json_schema()) == TIME_PARAMS


def test_required_grammar_is_a_valid_schema_allowing_exactly_the_tools_calls():
    import xgrammar as xgr  # the grammar engine the workers use: the schema must compile there

    schema = json.loads(plan({"tools": TOOLS, "tool_choice": "required"}).json_schema())
    jsonschema.Draft202012Validator.check_schema(schema)
    xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    ok = [{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}},
          {"name": "set_alarm", "parameters": {"hours": 7}}]
    jsonschema.validate(ok, schema)
    for bad in ([], [{"name": "get_weather", "parameters": {"hours": 7}}], [{"name": "other", "parameters": {}}],
                [{"name": "set_alarm"}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = json.loads(plan({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}).json_schema())
    assert single["maxItems"] == 1 and single["minItems"] == 1
    bare = json.loads(plan({"tools": [{"type": "function", "function": {"name": "ping"}}],
                            "tool_choice": "required"}).json_schema())
    jsonschema.validate([{"name": "ping", "parameters": {}}], bare)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "ping", "parameters": {"x": 1}}], bare)


ADDRESS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
           "additionalProperties": False}


def function_with_defs(name: str, address: dict = ADDRESS, defs_key: str = "$defs") -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": {"to": {"$ref": f"#/{defs_key}/Address"}, "copy": {"$ref": "#/properties/to"},
                                         "then": {"anyOf": [{"type": "null"}, {"$ref": "#"}]}},
        "required": ["to", "copy", "then"], "additionalProperties": False, defs_key: {"Address": address}}}}


@pytest.mark.parametrize("tools", [[function_with_defs("ship")], [function_with_defs("ship"), function_with_defs("bill")],
                                   [function_with_defs("ship", defs_key="definitions"), TOOLS[1]]])
def test_required_grammar_hoists_each_tools_definitions_to_its_root(tools):
    import xgrammar as xgr

    schema = json.loads(plan({"tools": tools, "tool_choice": "required"}).json_schema())
    xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)  # was: "Cannot find field '$defs'"
    paris = {"city": "Paris"}
    jsonschema.validate([{"name": "ship", "parameters": {"to": paris, "copy": paris,
                                                         "then": {"to": paris, "copy": paris, "then": None}}}], schema)
    for wrong in ({"to": {"town": "Paris"}, "copy": paris, "then": None},  # the definition holds,
                  {"to": paris, "copy": {}, "then": None},  # references inside the tool still point inside it,
                  {"to": paris, "copy": paris, "then": {"to": paris}}):  # "#" is the tool's parameters
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate([{"name": "ship", "parameters": wrong}], schema)


def test_required_refuses_tools_giving_one_definition_two_schemas():
    tools = plan({"tools": [function_with_defs("ship"), function_with_defs("bill", {"type": "string"})],
                  "tool_choice": "required"})
    with pytest.raises(ApiError) as info:
        tools.json_schema()
    assert info.value.status == 400 and info.value.param == "tools"
    assert "'ship' and 'bill'" in info.value.message and "$defs/Address" in info.value.message


def test_required_cannot_be_combined_with_another_constraint():
    tools = plan({"tools": TOOLS, "tool_choice": "required"})
    with pytest.raises(ApiError) as info:
        tools.constrain({"regex": "a+"}, {})
    assert info.value.param == "tool_choice" and "'regex'" in info.value.message
    values, names = tools.constrain({"temperature": 0}, {})
    assert values["json_schema"] == tools.json_schema() and names["json_schema"] == "tools"


QWEN_LIKE_TEMPLATE = """{%- if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>
{% endif %}{%- for m in messages %}[{{ m.role }}]{% if m.content %} {{ m.content }}{% endif %}
{%- for c in m.tool_calls or [] %} <tool_call>{"name": "{{ c.function.name }}", "arguments": \
{{ c.function.arguments | tojson }}}</tool_call>{% endfor %}
{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"""


def test_tools_and_tool_results_render_through_the_template(default_model_dir, tmp_path):
    template = tmp_path / "tools.jinja"
    template.write_text(QWEN_LIKE_TEMPLATE)
    tok = ModelTokenizer(default_model_dir, chat_template_file=template)
    messages = USER + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"}]
    req = parse(ChatCompletionRequest, {"messages": messages, "tools": TOOLS})
    text = tok.render_chat(template_messages(req.template_messages()), tools=plan_tools(req, None).template_tools)
    assert text.startswith("<tools>") and '"name": "set_alarm"' in text
    # arguments reach the template as an object: written once as JSON, not as an escaped string
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}</tool_call>' \
        in text
    assert "[tool] 18 degrees, sunny" in text
    bad = [*messages[:1], {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]}]
    with pytest.raises(ApiError) as info:
        template_messages(parse(ChatCompletionRequest, {"messages": bad}).template_messages())
    assert info.value.param == "messages.1.tool_calls.0.function.arguments"


# ---------------------------------------------------------------- flags
def test_gateway_and_up_accept_the_parser_and_refuse_unknown_names(tmp_path, capsys):
    from pdserve.services import up, up_plan
    from pdserve.services.gateway import cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser, "gateway")
    assert parser.parse_args(["--tool-call-parser", "llama3"]).tool_call_parser == "llama3"
    with pytest.raises(SystemExit) as info:
        parser.parse_args(["--tool-call-parser", "nope"])
    assert info.value.code == 2 and "--tool-call-parser" in capsys.readouterr().err
    up_parser = argparse.ArgumentParser()
    up.add_arguments(up_parser, "up")
    args = up_parser.parse_args(["--tool-call-parser", "pythonic", "--state-dir", str(tmp_path)])
    gateway = next(s for s in up_plan.build_plan(args, tmp_path, cpus=2).services if s.name == "gateway")
    assert gateway.args[gateway.args.index("--tool-call-parser") + 1] == "pythonic"
    plain = up_plan.build_plan(up_parser.parse_args(["--state-dir", str(tmp_path)]), tmp_path, cpus=2)
    assert "--tool-call-parser" not in next(s for s in plain.services if s.name == "gateway").args


# ---------------------------------------------------------------- --tool-call-parser through HTTP (scripted worker)
QWEN_REPLY = ('I will check the weather.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
              '"unit": "celsius"}}\n</tool_call>')


@pytest.fixture(scope="module")
def scripted_gateway(default_model_dir):
    """An in-process gateway with --tool-call-parser qwen25 over a worker that always answers QWEN_REPLY."""
    import grpc

    from pdserve.proto import worker_pb2_grpc as pb_grpc
    from pdserve.services.gateway import cli

    tok = ModelTokenizer(default_model_dir)
    reply = tok.encode(QWEN_REPLY, add_special_tokens=False) + [2]  # then <|im_end|>, a stop token

    loop = asyncio.new_event_loop()

    async def start():
        server = grpc.aio.server()
        worker = ScriptedWorker([[t] for t in reply], finish="stop", stop_token=2, delay=0)
        pb_grpc.add_WorkerServicer_to_server(worker, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        parser = argparse.ArgumentParser()
        cli.add_arguments(parser, "gateway")
        args = parser.parse_args(["--model-path", str(default_model_dir), "--worker", f"127.0.0.1:{port}",
                                  "--tool-call-parser", "qwen25"])
        http = TestServer(cli.build(args))
        await http.start_server()
        return server, http

    server, http = loop.run_until_complete(start())
    yield loop, str(http.make_url("/v1"))
    loop.run_until_complete(http.close())
    loop.run_until_complete(server.stop(0))
    loop.close()


def stream_calls(chunks) -> tuple[str, list[tuple[str, str]], str | None]:
    """(content, [(name, arguments)], finish_reason) put together from streamed chunks, as a client does."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for tc in delta.tool_calls or []:
                if tc.id is not None:
                    assert tc.index not in calls and tc.type == "function" and tc.function.name
                    calls[tc.index] = [tc.function.name, ""]
                calls[tc.index][1] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [tuple(v) for v in calls.values()], finish


def test_parser_reads_calls_from_the_output_streamed_and_not(scripted_gateway):
    loop, base = scripted_gateway

    async def ask():
        client = openai.AsyncOpenAI(base_url=base, api_key="none", max_retries=0, timeout=60)
        whole = await client.chat.completions.create(model="default", messages=USER, tools=TOOLS)
        chunks = [c async for c in await client.chat.completions.create(model="default", messages=USER,
                                                                          tools=TOOLS, stream=True)]
        plain = await client.chat.completions.create(model="default", messages=USER, tools=TOOLS,
                                                     tool_choice="none")
        await client.close()
        return whole, chunks, plain

    whole, chunks, plain = loop.run_until_complete(ask())
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "I will check the weather."
    [call] = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "celsius"}
    content, calls, finish = stream_calls(chunks)
    assert (content, calls, finish) == (choice.message.content, [(call.function.name, call.function.arguments)],
                                        "tool_calls")
    assert sum(1 for c in chunks for ch in c.choices for tc in ch.delta.tool_calls or []) > 3  # incremental
    # tool_choice "none": the output is plain content, markup included, as the model wrote it
    assert plain.choices[0].message.content == QWEN_REPLY and plain.choices[0].message.tool_calls is None
    assert plain.choices[0].finish_reason == "stop"


# ---------------------------------------------------------------- required / named on the real model
def client(gw) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.base, api_key=gw.api_key or "none", max_retries=0, timeout=120)


def check_calls(message, names: set[str]) -> list[tuple[str, dict]]:
    assert message.tool_calls, message
    out = []
    for call in message.tool_calls:
        assert call.id.startswith("call_") and call.type == "function" and call.function.name in names
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, SCHEMAS[call.function.name])
        out.append((call.function.name, args))
    return out


NAMED = {"type": "function", "function": {"name": "set_alarm"}}


@pytest.mark.parametrize("tool_choice", ["required", NAMED])
def test_required_and_named_give_valid_calls_and_streaming_matches(colocated, tool_choice):
    c = client(colocated.open)
    # One call: greedy decoding of the small model would otherwise repeat calls until max_tokens.
    kwargs = dict(model="default", messages=USER, tools=TOOLS, tool_choice=tool_choice, temperature=0,
                  max_tokens=80, parallel_tool_calls=False)
    whole = c.chat.completions.create(**kwargs)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = check_calls(choice.message, {"set_alarm"} if tool_choice == NAMED else set(SCHEMAS))
    assert len(calls) == 1
    content, streamed, finish = stream_calls(c.chat.completions.create(**kwargs, stream=True))
    assert (content, finish) == ("", "tool_calls")
    assert streamed == [(t.function.name, t.function.arguments) for t in choice.message.tool_calls]


def test_required_parallel_calls_stream_as_they_come(colocated):
    c = client(colocated.open)
    kwargs = dict(model="default", messages=USER, tools=TOOLS, tool_choice="required", temperature=0,
                  max_tokens=60)
    whole = c.chat.completions.create(**kwargs).choices[0]
    content, streamed, finish = stream_calls(c.chat.completions.create(**kwargs, stream=True))
    assert (content, finish) == ("", whole.finish_reason)
    assert streamed == [(t.function.name, t.function.arguments) for t in whole.message.tool_calls]
    calls = whole.message.tool_calls
    for k, t in enumerate(calls):
        try:
            jsonschema.validate(json.loads(t.function.arguments), SCHEMAS[t.function.name])
        except ValueError:  # only the call max_tokens cut off may be incomplete
            assert k == len(calls) - 1 and whole.finish_reason == "length" and k > 0


def test_required_holds_for_sampled_outputs_and_single_call_without_parallel(colocated):
    r = client(colocated.open).chat.completions.create(
        model="default", messages=USER, tools=TOOLS, tool_choice="required", temperature=1.0, seed=7, n=4,
        max_tokens=80, parallel_tool_calls=False)
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls"
        assert len(check_calls(choice.message, set(SCHEMAS))) == 1


def test_tool_results_and_auto_without_parser(colocated):
    c = client(colocated.open)
    messages = USER + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"}]
    r = c.chat.completions.create(model="default", messages=messages, tools=TOOLS, temperature=0, max_tokens=8)
    # no --tool-call-parser on this gateway: tool_choice auto answers in plain content, as SGLang does
    assert r.choices[0].finish_reason in ("stop", "length") and r.choices[0].message.tool_calls is None
    assert r.choices[0].message.content
    named = c.chat.completions.create(model="default", messages=messages, tools=TOOLS, temperature=0,
                                      max_tokens=80, tool_choice={"type": "function",
                                                                  "function": {"name": "get_weather"}})
    assert check_calls(named.choices[0].message, {"get_weather"})


@pytest.mark.parametrize("body, param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": ["x"]}}]},
     "tools.0.function.parameters"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools.1.function.name"),
    ({"tools": TOOLS, "tool_choice": "required", "regex": "a+"}, "tool_choice"),
])
def test_bad_tool_requests_are_openai_style_400s(colocated, body, param):
    r = requests.post(colocated.open.url + "/v1/chat/completions", json={"messages": USER, **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["object"] == "error" and err["type"] == "invalid_request_error" and err["param"] == param
    if body.get("tool_choice") == "required" and "tools" not in body:
        assert err["message"] == "Tools cannot be empty if tool choice is set to required."  # SGLang's words
