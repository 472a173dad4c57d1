"""Batch input validation on its own (no processes): which files make a batch fail, and what `errors` says."""
from __future__ import annotations

import json

import pytest

from pdserve.services.jobs.batches import MAX_ERRORS, LineSplitter, parse_create, parse_input
from pdserve.services.jobs.errors import ApiError
from pdserve.services.jobs.files import expiry_seconds
from pdserve.services.jobs.store import FILE_ID, new_id

CHAT = "/v1/chat/completions"
FILE = new_id(FILE_ID)


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


def test_a_model_name_that_is_not_a_short_string_fails_the_batch_at_its_line():
    # The batch keeps its first line's model for as long as it is kept: 99 MB of it were once accepted.
    for model in ("m" * 257, ["m"], {"a": 1}):
        items, errors = parse_input(line("a", model=model).encode(), CHAT)
        assert items == [] and [(e["code"], e["param"]) for e in errors.errors] == [("invalid_body", "body.model")]
    items, errors = parse_input(line("a", model="m" * 256).encode(), CHAT)
    assert not errors.errors and items[0].body["model"] == "m" * 256


def test_a_line_over_many_chunks_is_split_as_one():
    text = "x" * 3_000_000 + "\n" + "y\r\n"
    splitter, lines = LineSplitter(), []
    data = text.encode()
    for i in range(0, len(data), 1 << 16):
        lines += splitter.feed(data[i:i + (1 << 16)])
    lines += splitter.feed(b"", final=True)
    assert lines == [(1, "x" * 3_000_000), (2, "y")]


@pytest.mark.parametrize("seconds", ["--5", "²", "٣٦٠٠", "1e4", "99999999999999999999"])
def test_expiry_seconds_are_ascii_integers_in_range(seconds):
    with pytest.raises(ApiError) as info:  # "--5" and "²" were 500s, Arabic-Indic digits were taken
        expiry_seconds("created_at", seconds, "expires_after")
    assert info.value.status == 400 and info.value.param == "expires_after[seconds]"
    assert expiry_seconds("created_at", " 3600 ", "expires_after") == 3600


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
    ({"input_file_id": "f", "endpoint": CHAT, "completion_window": "24h"}, "input_file_id"),
    ({"input_file_id": FILE + ":content", "endpoint": CHAT, "completion_window": "24h"}, "input_file_id"),
    ({"input_file_id": FILE.upper(), "endpoint": CHAT, "completion_window": "24h"}, "input_file_id"),
    ({"input_file_id": FILE, "endpoint": "/v1/embeddings", "completion_window": "24h"}, "endpoint"),
    ({"input_file_id": FILE, "endpoint": "/embeddings", "completion_window": "24h"}, "endpoint"),
    ({"input_file_id": FILE, "endpoint": "chat/completions", "completion_window": "24h"}, "endpoint"),
    ({"input_file_id": FILE, "endpoint": ["/v1/completions"], "completion_window": "24h"}, "endpoint"),
    ({"input_file_id": FILE, "endpoint": CHAT, "completion_window": "48h"}, "completion_window"),
    ({"input_file_id": FILE, "endpoint": CHAT, "completion_window": ["24h"]}, "completion_window"),  # was a 500
    ({"input_file_id": FILE, "endpoint": CHAT, "completion_window": {"24h": 1}}, "completion_window"),
    ({"input_file_id": FILE, "endpoint": CHAT, "completion_window": "24h", "metadata": {"k": 1}}, "metadata"),
    ({"input_file_id": FILE, "endpoint": CHAT, "completion_window": "24h",
      "metadata": {str(i): "v" for i in range(17)}}, "metadata"),
])
def test_create_parameters_are_checked(body, param):
    with pytest.raises(ApiError) as info:
        parse_create(body)
    assert info.value.status == 400 and info.value.param == param


@pytest.mark.parametrize("given, stored", [
    ("/v1/chat/completions", "/v1/chat/completions"), ("/chat/completions", "/v1/chat/completions"),
    ("/v1/completions", "/v1/completions"), ("/completions", "/v1/completions"),
])
def test_endpoint_may_leave_out_v1(given, stored):
    params = parse_create({"input_file_id": FILE, "endpoint": given, "completion_window": "24h"})
    assert params.endpoint == stored and params.input_file_id == FILE


def test_line_urls_may_leave_out_v1_but_must_name_the_batch_endpoint():
    items, errors = parse_input("\n".join([line("a"), line("b", url="/chat/completions")]).encode(), CHAT)
    assert not errors.errors and [i.custom_id for i in items] == ["a", "b"]
    items, errors = parse_input(line("c", url="/completions").encode(), "/v1/completions")
    assert not errors.errors and [i.custom_id for i in items] == ["c"]
    text = "\n".join([line("a", url="/chat/completions"), line("b", url="/completions"),
                      line("c", url="/v1/embeddings"), line("d", url="/embeddings"), line("e", url="chat/completions")])
    items, errors = parse_input(text.encode(), CHAT)
    assert items == [] and [(e["line"], e["code"], e["param"]) for e in errors.errors] == [
        (n, "mismatched_url", "url") for n in (2, 3, 4, 5)]
    assert "'/completions'" in errors.errors[0]["message"] and CHAT in errors.errors[0]["message"]
