"""Batch input validation on its own (no processes): which files make a batch fail, and what `errors` says."""
from __future__ import annotations

import json

import pytest

from pdserve.services.jobs.batches import MAX_ERRORS, parse_create, parse_input
from pdserve.services.jobs.errors import ApiError

CHAT = "/v1/chat/completions"


def line(custom_id: str, url: str = CHAT, **body) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url,
                       "body": {"messages": [{"role": "user", "content": "hi"}], **body}})


def test_valid_file_keeps_order_and_skips_blank_lines():
    items, errors = parse_input(f"{line('a')}\n\n{line('b', max_tokens=3)}\n".encode(), CHAT)
    assert not errors.errors
    assert [(i.index, i.custom_id) for i in items] == [(0, "a"), (1, "b")]
    assert items[1].body["max_tokens"] == 3


def test_line_numbers_count_blank_lines_and_every_error_is_listed():
    text = "\n".join([line("a"), "", "not json", line("b", url="/v1/completions"), line("a"), "[1, 2]"])
    items, errors = parse_input(text.encode(), CHAT)
    assert items == []
    assert [(e["line"], e["code"]) for e in errors.errors] == [
        (3, "invalid_json"), (4, "mismatched_url"), (5, "duplicate_custom_id"), (6, "invalid_json")]


@pytest.mark.parametrize("text, code", [
    ("", "empty_file"),
    ("\n\n", "empty_file"),
    (json.dumps({"custom_id": "a", "method": "GET", "url": CHAT, "body": {}}), "invalid_method"),
    (json.dumps({"custom_id": "a", "url": CHAT}), "missing_body"),
    (json.dumps({"custom_id": "", "url": CHAT, "body": {}}), "missing_custom_id"),
    (line("a", stream=True), "invalid_body"),
])
def test_single_problem(text, code):
    items, errors = parse_input(text.encode(), CHAT)
    assert items == [] and [e["code"] for e in errors.errors] == [code]


def test_non_utf8_file():
    _, errors = parse_input(b"\xff\xfe{}", CHAT)
    assert errors.errors[0]["code"] == "invalid_encoding"


def test_errors_are_capped_with_a_count_of_the_rest():
    _, errors = parse_input(("x\n" * (MAX_ERRORS + 5)).encode(), CHAT)
    data = errors.as_object()["data"]
    assert len(data) == MAX_ERRORS + 1 and "5 more errors" in data[-1]["message"]


@pytest.mark.parametrize("body, param", [
    ([], None),
    ({"endpoint": CHAT, "completion_window": "24h"}, "input_file_id"),
    ({"input_file_id": "f", "endpoint": "/v1/embeddings", "completion_window": "24h"}, "endpoint"),
    ({"input_file_id": "f", "endpoint": CHAT, "completion_window": "48h"}, "completion_window"),
    ({"input_file_id": "f", "endpoint": CHAT, "completion_window": "24h", "metadata": {"k": 1}}, "metadata"),
    ({"input_file_id": "f", "endpoint": CHAT, "completion_window": "24h",
      "metadata": {str(i): "v" for i in range(17)}}, "metadata"),
])
def test_create_parameters_are_checked(body, param):
    with pytest.raises(ApiError) as info:
        parse_create(body)
    assert info.value.status == 400 and info.value.param == param
