"""Hostile input on a real gateway and worker: oversized bodies, lone surrogates, thousands of stop strings,
prompts far over the context, template variables that try to be more, and request ids chosen to collide."""
from __future__ import annotations

import json
import socket
import threading
import time

import pytest
import requests

from harness import wait_idle

CHAT = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 4}
ERROR_KEYS = {"object", "message", "type", "param", "code"}
MIB = 1 << 20


def check_error(r: requests.Response, status: int, param: str | None = "any",
                type_: str = "invalid_request_error") -> dict:
    assert r.status_code == status, r.text[:500]
    body = r.json()
    assert set(body) == ERROR_KEYS and body["code"] == status and body["type"] == type_, body
    assert "Traceback" not in r.text
    if param != "any":
        assert body["param"] == param, body
    return body


def post(gw, path: str, body: dict, **kw) -> requests.Response:
    return requests.post(gw.url + path, json=body, timeout=kw.pop("timeout", 60), **kw)


# ---------------------------------------------------------------- body size
def raw_exchange(url: str, head: bytes, body: bytes) -> tuple[int, dict, float]:
    """Send a request head and part of its body on a raw socket; (status, JSON body, seconds to the answer)."""
    host, port = url.removeprefix("http://").split(":")
    start = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(head + body)
        data = b""
        while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < _length(data):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    status = int(data.split(b" ", 2)[1])
    return status, json.loads(data.split(b"\r\n\r\n", 1)[1]), time.monotonic() - start


def _length(data: bytes) -> int:
    head = data.split(b"\r\n\r\n", 1)[0].decode().lower()
    line = next((x for x in head.split("\r\n") if x.startswith("content-length:")), "content-length: 0")
    return int(line.split(":")[1])


def test_a_body_over_the_limit_is_413_before_it_is_sent(colocated):
    # Content-Length says 64 MiB, but only a few bytes come: the answer cannot wait for the rest.
    url = colocated.open.url
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {64 * MIB}\r\n\r\n").encode()
    status, body, seconds = raw_exchange(url, head, b'{"messages": [')
    assert status == 413 and seconds < 5
    assert body["code"] == 413 and "32 MiB" in body["message"] and body["type"] == "invalid_request_error"


def test_a_chunked_body_over_the_limit_is_413(colocated):
    sent = 0

    def chunks():  # no Content-Length: the gateway must stop reading at the limit by itself
        nonlocal sent
        yield b'{"prompt": "'
        while sent < 48 * MIB:
            sent += MIB
            yield b"a" * MIB
        yield b'"}'

    try:
        r = requests.post(colocated.open.url + "/v1/completions", data=chunks(), timeout=60,
                          headers={"Content-Type": "application/json"})
    except requests.ConnectionError:
        pytest.fail("the gateway closed the connection instead of answering 413")
    assert "32 MiB" in check_error(r, 413)["message"]
    assert post(colocated.open, "/v1/chat/completions", CHAT).status_code == 200  # and it still serves


# ---------------------------------------------------------------- JSON that is not text
@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "hi \ud800"}]}, "messages.0.content"),
    ("/v1/completions", {"prompt": "x\udfff", "max_tokens": 2}, "prompt"),
    ("/generate", {"text": ["ok", "\ud800"], "sampling_params": {"max_new_tokens": 2}}, "text.1"),
    ("/generate", {"text": "hi", "sampling_params": {"stop": ["\ud83d"]}}, "sampling_params.stop.0"),
    ("/tokenize", {"prompt": "\ud800"}, "prompt"),
])
def test_lone_surrogates_are_400_naming_the_field(colocated, path, body, param):
    # json.dumps writes a lone surrogate as the escape "\ud800", as a hostile client would send it.
    r = requests.post(colocated.open.url + path, data=json.dumps(body), timeout=60,
                      headers={"Content-Type": "application/json"})
    assert "surrogate" in check_error(r, 400, param)["message"]


def test_surrogate_pairs_are_text(colocated):
    r = requests.post(colocated.open.url + "/tokenize", data=json.dumps({"prompt": "smile \ud83d\ude00"}),
                      headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 200 and r.json()["count"] > 1


def test_deeply_nested_json_is_400(colocated):
    r = requests.post(colocated.open.url + "/v1/chat/completions", data=b'{"a": ' + b"[" * 200_000, timeout=60,
                      headers={"Content-Type": "application/json"})
    check_error(r, 400)


# ---------------------------------------------------------------- large bodies, decoded off the event loop
PAD = b" " * (256 << 10)  # whitespace before the JSON: the same request, in a body decoded on the gateway's pool


def send_raw(gw, path: str, body: bytes) -> requests.Response:
    return requests.post(gw.url + path, data=body, timeout=120, headers={"Content-Type": "application/json"})


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {**CHAT, "stop_token_ids": [7] * 1_000_000}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": list(range(1_000_000))}, "stop_token_ids"),
    ("/generate", {"text": "x", "sampling_params": {"stop_token_ids": [7] * 1_000_000}},
     "sampling_params.stop_token_ids"),
])
def test_a_million_stop_token_ids_are_400_naming_the_field_and_the_limit(colocated, path, body, param):
    message = check_error(post(colocated.open, path, body), 400, param)["message"]
    assert "1000000 entries" in message and "the limit is 256" in message and "--max-stop-token-ids" in message


@pytest.mark.parametrize("body", [
    b"{not json",
    b'{"prompt": "x", "max_tokens": 2,',
    b'{"a": ' + b"[" * 5000,  # deeper than either decoder goes
    b"[1, 2, 3]",
    b'{"prompt": ["ok", "x\\ud800"], "max_tokens": 2}',
    b'{"prompt": "x", "max_tokens": 2, "seed": 1180591620717411303425}',  # 2**70 + 1: beyond 64 bits, exactly
    b'{"prompt": "x", "max_tokens": 2, "temperature": NaN}',  # Python's JSON, as before
], ids=["not-json", "cut-off", "too-deep", "not-an-object", "lone-surrogate", "huge-int", "nan"])
def test_a_large_bad_body_is_refused_as_its_small_twin(colocated, body):
    small, large = (send_raw(colocated.open, "/v1/completions", b) for b in (body, PAD + body))
    refusal = check_error(small, 400)
    assert large.status_code == 400 and large.json() == refusal
    if b"ud800" in body:
        assert refusal["param"] == "prompt.1" and "surrogate" in refusal["message"]
    if b"seed" in body:  # read as the integer it is, never rounded to a float
        assert refusal["param"] == "seed" and "got 1180591620717411303425" in refusal["message"]
    if b"NaN" in body:
        assert refusal["param"] == "temperature" and "finite" in refusal["message"]


def test_a_large_body_gets_the_answer_of_its_small_twin(colocated):
    body = json.dumps({"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0, "seed": 2**62,
                       "logit_bias": {"11": -5.5}, "stop": ["\u00e9t\u00e9"]}).encode()
    small, large = (send_raw(colocated.open, "/v1/completions", b) for b in (body, PAD + body))
    assert small.status_code == large.status_code == 200, (small.text, large.text)
    assert large.json()["choices"] == small.json()["choices"] and large.json()["usage"] == small.json()["usage"]


# ---------------------------------------------------------------- stop strings
@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {**CHAT, "stop": [f"s{i}" for i in range(5000)]}, "stop"),
    ("/v1/completions", {"prompt": "x", "stop": [f"s{i}" for i in range(65)]}, "stop"),
    ("/generate", {"text": "x", "sampling_params": {"stop": [f"s{i}" for i in range(65)]}}, "sampling_params.stop"),
])
def test_more_than_64_stop_strings_are_400(colocated, path, body, param):
    assert "64" in check_error(post(colocated.open, path, body), 400, param)["message"]


def test_64_stop_strings_are_accepted(colocated):
    r = post(colocated.open, "/v1/completions", {"prompt": "one two", "max_tokens": 2,
                                                 "stop": [f"zz{i}" for i in range(64)]})
    assert r.status_code == 200, r.text


# ---------------------------------------------------------------- prompts far over the context
@pytest.mark.parametrize("path, make, param", [
    ("/v1/completions", lambda text: {"prompt": text}, "prompt"),
    ("/v1/chat/completions", lambda text: {"messages": [{"role": "user", "content": text}]}, "messages"),
    ("/generate", lambda text: {"text": text}, "text"),
    ("/tokenize", lambda text: {"prompt": text}, "prompt"),
])
def test_prompts_far_over_the_context_are_refused_without_tokenizing(colocated, path, make, param):
    text = "hello world " * 1_000_000  # 12 MB: about 2.7 million tokens, seconds of tokenizing
    start = time.monotonic()
    r = post(colocated.open, path, make(text))
    elapsed = time.monotonic() - start
    err = check_error(r, 400, param)
    assert "characters" in err["message"] and "8192" in err["message"]
    assert elapsed < 3.0, f"{elapsed:.1f} s: the text was tokenized"


# ---------------------------------------------------------------- template variables
def test_template_variables_cannot_replace_jinja_functions(colocated):
    for name in ("range", "namespace", "tokenizer_kwargs", "sanitize_control_tokens"):
        r = post(colocated.open, "/v1/chat/completions", {**CHAT, "chat_template_kwargs": {name: "x"}})
        assert name in check_error(r, 400, f"chat_template_kwargs.{name}")["message"]


def test_variables_the_template_does_not_read_change_nothing(colocated):
    plain = post(colocated.open, "/v1/chat/completions", {**CHAT, "temperature": 0}).json()
    extra = post(colocated.open, "/v1/chat/completions", {**CHAT, "temperature": 0, "chat_template_kwargs": {
        "enable_thinking": False, "not-an-identifier": 1, "reasoning_effort": "high"}}).json()
    assert extra["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]
    assert extra["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]


# ---------------------------------------------------------------- request ids
GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}


def stream_generate(gw, body: dict, events: list) -> threading.Thread:
    def consume():
        with requests.post(gw.url + "/generate", json=body, stream=True, timeout=120) as r:
            for line in r.iter_lines(decode_unicode=True):
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[len("data: "):]))

    thread = threading.Thread(target=consume)
    thread.start()
    return thread


def wait_for(events: list, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not events and time.monotonic() < deadline:
        time.sleep(0.05)
    assert events, "no output"


def test_a_client_rid_cannot_collide_with_another_request(colocated):
    gw = colocated.open
    solo = post(gw, "/generate", {"text": "The capital of France is", "sampling_params": GREEDY}).json()
    long_events: list = []
    long_body = {"text": "Tell me a long story", "rid": "shared", "stream": True,
                 "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}
    thread = stream_generate(gw, long_body, long_events)
    wait_for(long_events)
    # The same rid while the first request runs: its own request, its own pages, the same output as alone.
    twin = post(gw, "/generate", {"text": "The capital of France is", "rid": "shared", "sampling_params": GREEDY})
    assert twin.status_code == 200, twin.text
    assert twin.json()["output_ids"] == solo["output_ids"] and twin.json()["meta_info"]["id"] == "shared"
    assert long_events[0]["meta_info"]["id"] == "shared"
    # Another rid, or the id the server gave a request that named none, aborts nothing of this request.
    assert post(gw, "/abort_request", {"rid": "other"}, headers=gw.admin_headers()).json()["aborted"] == []
    assert post(gw, "/abort_request", {"rid": solo["meta_info"]["id"]}, headers=gw.admin_headers()).json()["aborted"] == []
    assert thread.is_alive()
    assert post(gw, "/abort_request", {"rid": "shared"}, headers=gw.admin_headers()).json()["aborted"] == ["shared"]
    thread.join(30)
    assert not thread.is_alive()
    assert long_events[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    load, stats = wait_idle(colocated.worker)
    assert (load.running, stats.used_pages, stats.integrity_ok) == (0, 0, True)


def test_ids_given_by_the_server_abort_their_own_request(colocated):
    gw = colocated.open
    events: list = []
    thread = stream_generate(gw, {"text": "Tell me a long story", "stream": True,
                                  "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}, events)
    wait_for(events)
    server_id = events[0]["meta_info"]["id"]
    assert len(server_id) == 32
    assert post(gw, "/abort_request", {"rid": server_id}, headers=gw.admin_headers()).json()["aborted"] == [server_id]
    thread.join(30)
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "abort"


def test_openai_rid_names_the_answer(colocated):
    r = post(colocated.open, "/v1/chat/completions", {**CHAT, "rid": "my-chat"}).json()
    assert r["id"] == "my-chat"
    r = post(colocated.open, "/v1/completions", {"prompt": ["a", "b"], "max_tokens": 2, "rid": "my-cmpl"}).json()
    assert r["id"] == "my-cmpl" and len(r["choices"]) == 2


def test_an_api_key_header_that_is_not_utf8_is_401(colocated):
    secured = colocated.secured
    r = requests.get(secured.url + "/v1/models", headers={"Authorization": b"Bearer \xff\xfe"}, timeout=30)
    check_error(r, 401, type_="authentication_error")
