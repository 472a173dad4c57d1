"""Structured output through the gateway with the official openai client: OpenAI's response_format, SGLang's
regex / ebnf / json_schema / structural_tag, on chat, completions and native /generate, streamed or not."""
from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import openai
import pytest
import requests

USER = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                         "email": {"type": "string", "maxLength": 24}},
        "required": ["name", "age"], "additionalProperties": False}
PHONE = r"\d{3}-\d{3}-\d{4}"
ASK_USER = [{"role": "user", "content": "Generate user info."}]


def client(gw) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.base, api_key=gw.api_key or "none", max_retries=0, timeout=120)


def chat(gw, messages=ASK_USER, **kwargs):
    kwargs.setdefault("max_tokens", 64)
    return client(gw).chat.completions.create(model="default", messages=messages, **kwargs)


def test_json_schema_response_format_holds_for_every_seed(colocated):
    fmt = {"type": "json_schema", "json_schema": {"name": "user_info", "schema": USER}}
    r = chat(colocated.open, response_format=fmt, temperature=1.0, n=4, seed=5)
    assert len(r.choices) == 4
    for choice in r.choices:
        jsonschema.validate(json.loads(choice.message.content), USER)
        assert choice.finish_reason == "stop"


def test_json_object_gives_an_object(colocated):
    r = chat(colocated.open, messages=[{"role": "user", "content": "Describe a cat in JSON."}],
             response_format={"type": "json_object"}, temperature=0, max_tokens=96)
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # an open-ended object may outrun max_tokens: then it is still a valid prefix of one
        assert r.choices[0].finish_reason == "length" and r.choices[0].message.content.startswith("{")


def test_regex_and_ebnf_from_extra_body(colocated):
    for seed in range(3):
        r = chat(colocated.open, messages=[{"role": "user", "content": "Generate a phone number"}],
                 extra_body={"regex": PHONE}, temperature=1.0, seed=seed)
        assert re.fullmatch(PHONE, r.choices[0].message.content)
    r = chat(colocated.open, messages=[{"role": "user", "content": "What is the capital of France?"}],
             extra_body={"ebnf": 'root ::= "The capital is " city "."\ncity ::= "Paris" | "London" | "Rome"'},
             temperature=0)
    assert r.choices[0].message.content == "The capital is Paris."


def test_streaming_equals_non_streaming_under_greedy(colocated):
    fmt = {"type": "json_schema", "json_schema": {"name": "user_info", "schema": USER, "strict": True}}
    whole = chat(colocated.open, response_format=fmt, temperature=0).choices[0].message.content
    stream = chat(colocated.open, response_format=fmt, temperature=0, stream=True)
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(pieces) == whole and json.loads(whole)


def test_completions_and_native_generate_accept_constraints(colocated):
    r = client(colocated.open).completions.create(model="default", prompt="My phone number is ", max_tokens=20,
                                                  temperature=0, extra_body={"regex": PHONE})
    assert re.fullmatch(PHONE, r.choices[0].text)
    body = {"text": "The user record: ", "sampling_params": {"max_new_tokens": 64, "temperature": 0,
                                                            "json_schema": json.dumps(USER)}}
    out = requests.post(colocated.open.url + "/generate", json=body, timeout=120).json()
    jsonschema.validate(json.loads(out["text"]), USER)
    body["sampling_params"] = {"max_new_tokens": 8, "temperature": 0, "regex": "(yes|no)"}
    out = requests.post(colocated.open.url + "/generate", json=body, timeout=120).json()
    assert out["text"] in ("yes", "no") and out["meta_info"]["finish_reason"]["type"] == "stop"


def test_structural_tag_constrains_the_tagged_part(colocated):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
              "additionalProperties": False}
    fmt = {"type": "structural_tag", "structures": [{"begin": "<weather>", "schema": schema, "end": "</weather>"}],
           "triggers": ["<weather>"]}
    messages = [{"role": "user", "content": "Write <weather> followed by a JSON object with the city Paris."}]
    r = chat(colocated.open, messages=messages, response_format=fmt, temperature=0, max_tokens=48)
    for inside in re.findall(r"<weather>(.*?)</weather>", r.choices[0].message.content, re.S):
        jsonschema.validate(json.loads(inside), schema)


def test_logit_bias_bans_a_token(colocated, default_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    plain = chat(colocated.open, messages=messages, temperature=0, max_tokens=1, logprobs=True)
    first = tok.convert_tokens_to_ids(plain.choices[0].logprobs.content[0].token) \
        if plain.choices[0].logprobs.content[0].token in tok.get_vocab() else None
    first = first if first is not None else tok.encode(plain.choices[0].message.content)[0]
    banned = chat(colocated.open, messages=messages, temperature=0, max_tokens=1, logit_bias={str(first): -100})
    assert banned.choices[0].message.content != plain.choices[0].message.content


def test_cached_grammar_needs_no_new_compile(colocated):
    """The same schema twice: the second request is not slower for compiling (both sides cache it)."""
    schema = {"type": "object", "properties": {f"field_{i}": {"type": "string", "maxLength": 4} for i in range(12)}}
    fmt = {"type": "json_schema", "json_schema": {"name": "wide", "schema": schema}}
    for _ in range(2):
        r = chat(colocated.open, response_format=fmt, temperature=0, max_tokens=4)
        assert r.choices[0].finish_reason == "length" and r.choices[0].message.content.startswith("{")


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object",
      "properties": {"a": {"type": "nonsense"}}}}}}, "response_format.json_schema.schema"),
    ({"extra_body": {"regex": "[a-"}}, "regex"),
    ({"extra_body": {"ebnf": "root ::= "}}, "ebnf"),
    ({"response_format": {"type": "json_object"}, "extra_body": {"regex": "a"}}, "regex"),
])
def test_bad_constraints_are_400_naming_the_field(colocated, extra, param):
    with pytest.raises(openai.BadRequestError) as info:
        chat(colocated.open, temperature=0, **extra)
    assert info.value.body["param"] == param


def test_with_a_reasoning_parser_the_grammar_waits_for_the_end_of_thinking(default_model_dir):
    from pdserve.services.gateway.intake.constraints import after_reasoning
    from pdserve.services.gateway.tokenization import ModelTokenizer

    tok = ModelTokenizer(default_model_dir)
    end = tuple(tok.encode("</think>", add_special_tokens=False))
    forced = after_reasoning({"regex": "a+"}, "deepseek-r1", tok)
    assert (forced["think_start_ids"], forced["think_end_ids"]) == ((), end)
    opened = after_reasoning({"regex": "a+"}, "qwen3", tok)
    assert opened["think_start_ids"] == tuple(tok.encode("<think>", add_special_tokens=False))
    assert after_reasoning({"regex": "a+"}, None, tok) == {"regex": "a+"}
    assert after_reasoning({"regex": None}, "qwen3", tok) == {"regex": None}  # no grammar: nothing to wait for


def test_the_gateway_process_never_loads_torch_even_after_compiling_a_grammar(colocated):
    """Grammars compile in the gateway's child processes: the gateway itself stays without torch or xgrammar."""
    fmt = {"type": "json_schema", "json_schema": {"name": "user_info", "schema": USER}}
    r = chat(colocated.open, response_format=fmt, temperature=0, max_tokens=8)
    assert r.choices[0].message.content.startswith("{")
    with pytest.raises(openai.BadRequestError):
        chat(colocated.open, extra_body={"regex": "[a-"}, temperature=0)
    maps = Path(f"/proc/{colocated.open.proc.popen.pid}/maps").read_text()
    assert "libtorch" not in maps and "xgrammar" not in maps


def test_a_grammar_past_its_compile_budget_is_cut_off_and_the_next_one_compiles(default_model_dir):
    import asyncio

    from pdserve.services.gateway.intake.grammar_check import CompileTimeout, GrammarChecker, GrammarSource
    from pdserve.services.gateway.tokenization import ModelTokenizer
    from pdserve.shared.sampling_params import SamplingParams

    tok = ModelTokenizer(default_model_dir)
    checker = GrammarChecker(GrammarSource(str(default_model_dir), tok.vocab_size, tuple(tok.eos_token_ids)),
                             timeout_s=60, size=1)
    slow = {"type": "object", "properties": {f"f{i}": {"type": "string", "pattern": "(a|b)*c{2,40}(d|e)+" * 8}
                                             for i in range(60)}}

    async def run():
        assert await checker.check(SamplingParams(regex="a+b")) is None  # the child is up: budgets count compiles
        checker.timeout_s = 0.01
        with pytest.raises(CompileTimeout):
            await checker.check(SamplingParams(json_schema=json.dumps(slow)))
        checker.timeout_s = 60
        assert await checker.check(SamplingParams(regex="[0-9]+")) is None  # a fresh child took over
        field, reason = await checker.check(SamplingParams(regex="[a-"))
        assert field == "regex" and "not valid" in reason

    try:
        asyncio.run(run())
    finally:
        checker.close()
