"""The limits table itself (no processes): one flag per field with its docstring as help, the checks that run on
a raw body, and max_tokens capped at what the context leaves."""
from __future__ import annotations

import argparse
from dataclasses import fields

import pytest

from pdserve.services.gateway.errors import ApiError
from pdserve.services.gateway.limits import Limits, add_arguments, from_args, nesting


def test_every_limit_is_a_flag_with_its_docstring_as_help():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    text = " ".join(parser.format_help().split())
    for f in fields(Limits):
        flag = "--" + f.name.removesuffix("_s").replace("_", "-")
        assert flag in text, flag
    assert "OpenAI's 128" in text
    limits = from_args(parser.parse_args(["--max-tools", "5", "--stream-write-timeout", "2.5"]))
    assert limits.max_tools == 5 and limits.stream_write_timeout_s == 2.5 and limits.max_messages == 2048


@pytest.mark.parametrize("argv", [["--max-tools", "0"], ["--max-stop-token-ids", "257"],
                                  ["--max-score-labels", "1025"], ["--header-timeout", "-1"]])
def test_settings_a_gateway_cannot_start_with(argv):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(ValueError):
        from_args(parser.parse_args(argv))


def test_max_new_tokens_is_capped_at_what_the_context_leaves():
    limits = Limits()
    assert limits.new_tokens(None, 100, 8192) == 8092  # absent: all the context leaves, as before
    assert limits.new_tokens(10**9, 100, 8192) == 8092
    assert limits.new_tokens(16, 100, 8192) == 16
    assert limits.new_tokens(-1, 100, 8192) == -1  # SamplingParams refuses it in its own words
    assert Limits(max_new_tokens=512).new_tokens(None, 100, 8192) == 512


def test_nesting_counts_containers_and_stops_early():
    assert nesting("x", 64) == 0 and nesting({"a": [1, {"b": 2}]}, 64) == 3
    deep: object = 1
    for _ in range(100_000):  # deeper than Python's stack: counted without recursion
        deep = [deep]
    assert nesting(deep, 64) == 65


def test_a_refusal_names_the_field_the_limit_and_the_flag():
    with pytest.raises(ApiError) as info:
        Limits().sampling({"logit_bias": {str(i): 1 for i in range(301)}}, "sampling_params.")
    err = info.value
    assert (err.status, err.param) == (400, "sampling_params.logit_bias")
    assert "300" in err.message and "--max-logit-bias" in err.message
