"""Request validation: every refusal is a 400 in the OpenAI error shape that names the offending field."""
from __future__ import annotations

import pytest

from pdserve.services.gateway.errors import ApiError
from pdserve.services.gateway.intake.protocol import (UNSUPPORTED_NATIVE_SAMPLING, ChatCompletionRequest, CompletionRequest,
                                               GenerateRequest, NativeSampling, parse, refuse_unsupported)

MSG = [{"role": "user", "content": "hi"}]


def refusal(fn, *args) -> ApiError:
    with pytest.raises(ApiError) as info:
        fn(*args)
    return info.value


@pytest.mark.parametrize("body, param", [
    ({}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"content": "x"}]}, "messages.0.role"),
    ({"messages": MSG, "temperature": "hot"}, "temperature"),
    ({"messages": MSG, "stop": [1, 2]}, "stop"),
    ({"messages": MSG, "stop": ""}, "stop"),
    ({"messages": MSG, "n": "two"}, "n"),
    ({"messages": MSG, "stream_options": {"include_usage": "yes please"}}, "stream_options.include_usage"),
])
def test_chat_schema_errors_name_the_field(body, param):
    err = refusal(parse, ChatCompletionRequest, body)
    assert err.status == 400
    assert err.param == param
    assert param in err.message
    assert err.body() == {"object": "error", "message": err.message, "type": "invalid_request_error",
                          "param": param, "code": 400}


def test_chat_accepts_text_parts_and_ignores_unknown_fields():
    req = parse(ChatCompletionRequest, {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is"}, {"type": "text", "text": "the capital?"}]}],
        "some_future_field": 1, "stream_options": {"include_usage": True}})
    assert req.template_messages() == [{"role": "user", "content": "What is the capital?"}]
    assert req.include_usage


def test_chat_refuses_image_parts_naming_the_part():
    req = parse(ChatCompletionRequest, {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "http://x"}}]}]})
    err = refusal(req.template_messages)
    assert err.param == "messages.0.content.1.type"
    assert "not supported yet" in err.message


@pytest.mark.parametrize("field, value", [
    ("suffix", "and then"),
])
def test_later_features_are_refused_not_ignored(field, value):
    err = refusal(refuse_unsupported, {"messages": MSG, field: value})
    assert (err.status, err.param) == (400, field)
    assert "not supported yet" in err.message


@pytest.mark.parametrize("field, value", [("response_format", {"type": "text"}), ("tools", []),
                                          ("tool_choice", "none"), ("logit_bias", None), ("response_format", None)])
def test_neutral_values_of_later_features_are_accepted(field, value):
    refuse_unsupported({"messages": MSG, field: value})


@pytest.mark.parametrize("prompt, expected", [
    ("hi", ["hi"]), (["a", "b"], ["a", "b"]), ([1, 2, 3], [[1, 2, 3]]), ([[1, 2], [3]], [[1, 2], [3]])])
def test_completion_prompt_forms(prompt, expected):
    assert parse(CompletionRequest, {"prompt": prompt}).prompts() == expected


@pytest.mark.parametrize("prompt", [[], [[1], []], {"text": "x"}])
def test_completion_bad_prompt_names_prompt(prompt):
    err = refusal(parse, CompletionRequest, {"prompt": prompt})
    assert err.param is not None and err.param.startswith("prompt")


def test_completion_defaults_follow_openai():
    req = parse(CompletionRequest, {"prompt": "x"})
    assert (req.max_tokens, req.n, req.echo, req.stream, req.logprobs) == (16, 1, False, False, None)


def test_generate_native_sampling_names_and_refusals():
    sp = parse(NativeSampling, {"max_new_tokens": 8, "stop": "\n", "sampling_seed": 3})
    assert (sp.max_new_tokens, sp.stop_list(), sp.sampling_seed, sp.temperature) == (8, ["\n"], 3, 1.0)
    err = refusal(parse, NativeSampling, {"max_tokens": 8}, "sampling_params")
    assert err.param == "sampling_params.max_tokens" and "Unknown field" in err.message
    err = refusal(refuse_unsupported, {"custom_params": {"a": 1}}, UNSUPPORTED_NATIVE_SAMPLING, "sampling_params.")
    assert err.param == "sampling_params.custom_params"


def test_generate_needs_exactly_one_of_text_and_input_ids():
    assert parse(GenerateRequest, {"text": ["a", "b"]}).prompts() == (["a", "b"], True)
    assert parse(GenerateRequest, {"input_ids": [5, 6]}).prompts() == ([[5, 6]], False)
    for body in ({}, {"text": "a", "input_ids": [1]}):
        assert refusal(parse(GenerateRequest, body).prompts).param == "text"
