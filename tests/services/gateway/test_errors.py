"""Every error status a user can meet, in the OpenAI error shape, from real gateway processes."""
from __future__ import annotations

import json
import socket
import time

import openai
import pytest
import requests

from harness import API_KEY, wait_idle
from conftest import MAX_RUNNING

CHAT = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 4}
ERROR_KEYS = {"object", "message", "type", "param", "code"}


def check_error(r: requests.Response, status: int, param: str | None = "any") -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == ERROR_KEYS and body["object"] == "error" and body["code"] == status
    assert "Traceback" not in r.text and 'File "' not in r.text
    if param != "any":
        assert body["param"] == param
    return body


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {**CHAT, "temperature": -1}, "temperature"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": -5}, "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "top_p": 1.5}, "top_p"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user"}], "n": 0}, "n"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "foo"}}}}, "response_format.json_schema.schema"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema"}}, "response_format.json_schema.schema"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "xml"}}, "response_format.type"),
    ("/v1/chat/completions", {**CHAT, "regex": "(ab"}, "regex"),
    ("/v1/chat/completions", {**CHAT, "regex": "a+", "ebnf": 'root ::= "a"'}, "ebnf"),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"49152": 5}}, "logit_bias"),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"12": 101}}, "logit_bias"),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"twelve": 1}}, "logit_bias"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"description": "x"}}]},
     "tools.0.function.name"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    ("/v1/chat/completions", {**CHAT, "logprobs": False, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21, "echo": True}, "logprobs"),
    ("/generate", {"text": "x y", "return_logprob": True, "logprob_start_len": 5}, "logprob_start_len"),
    ("/v1/completions", {"prompt": [5, 10 ** 9]}, "prompt"),
    ("/v1/completions", {"prompt": "x", "extra_body_typo": 1, "ebnf": "root ::= undefined_rule"}, "ebnf"),
    ("/generate", {"text": "x", "sampling_params": {"max_tokens": 3}}, "sampling_params.max_tokens"),
    ("/generate", {"text": "x", "sampling_params": {"temperature": -0.5}}, "sampling_params.temperature"),
    ("/generate", {"text": "x", "sampling_params": {"json_schema": '{"type": "foo"}'}}, "sampling_params.json_schema"),
    ("/generate", {"text": "x", "sampling_params": {"json_schema": "{not json"}}, "sampling_params.json_schema"),
    ("/generate", {"text": "x", "sampling_params": {"structural_tag": '{"structures": []}'}},
     "sampling_params.structural_tag"),
    ("/generate", {"text": "x", "sampling_params": {"logit_bias": {"5": -1000}}}, "sampling_params.logit_bias"),
    ("/generate", {"sampling_params": {}}, "text"),
    ("/v1/embeddings", {"input": "x"}, "model"),  # a generative model: the 400 names it
])
def test_invalid_requests_are_400_naming_the_field(colocated, path, body, param):
    r = requests.post(colocated.open.url + path, json=body, timeout=60)
    err = check_error(r, 400, param)
    assert param.split(".")[-1] in err["message"] or "not supported yet" in err["message"]


@pytest.mark.parametrize("name, value", [
    ("chat_template", "INJECTED {{ 7*7 }} {{ messages[0]['content'] }}"),
    ("tools", [{"type": "function", "function": {"name": "f"}}]),
    ("messages", [{"role": "user", "content": "other"}]),
    ("add_generation_prompt", False),
])
def test_chat_template_kwargs_may_set_template_variables_only(colocated, name, value):
    r = requests.post(colocated.open.url + "/v1/chat/completions",
                      json={**CHAT, "chat_template_kwargs": {"enable_thinking": False, name: value}}, timeout=60)
    err = check_error(r, 400, f"chat_template_kwargs.{name}")
    assert name in err["message"] and "49" not in err["message"]
    ok = requests.post(colocated.open.url + "/v1/chat/completions",
                       json={**CHAT, "chat_template_kwargs": {"enable_thinking": False}}, timeout=60)
    assert ok.status_code == 200, ok.text


def test_prompt_longer_than_context_names_both_lengths(colocated):
    long_text = "hello " * 9000
    r = requests.post(colocated.open.url + "/v1/completions", json={"prompt": long_text}, timeout=60)
    err = check_error(r, 400, "prompt")
    assert "9000" in err["message"] or "9001" in err["message"]
    assert "8192" in err["message"]


def test_bad_json_body_is_400(colocated):
    r = requests.post(colocated.open.url + "/v1/chat/completions", data=b"{not json", timeout=30,
                      headers={"Content-Type": "application/json"})
    check_error(r, 400)


def test_unknown_route_is_404_and_method_405(colocated):
    # (A model name nothing serves is SGLang's: served here, 400 where --served-model-name was given:
    # test_sglang_conformance.py.)
    check_error(requests.get(colocated.open.url + "/v1/nothing/here", timeout=30), 404)
    check_error(requests.delete(colocated.open.url + "/v1/chat/completions", timeout=30), 405)


@pytest.mark.parametrize("method, path", [("GET", "/v1/models"), ("POST", "/v1/chat/completions"),
                                          ("POST", "/v1/completions"), ("POST", "/generate"),
                                          ("GET", "/get_model_info"), ("POST", "/tokenize"),
                                          ("GET", "/health_generate"), ("POST", "/flush_cache"),
                                          ("GET", "/v1/files"), ("GET", "/v1/no-such-route")])
def test_api_key_is_required_everywhere_but_health_and_metrics(colocated, method, path):
    url = colocated.secured.url + path
    check_error(requests.request(method, url, json={}, timeout=30), 401)
    check_error(requests.request(method, url, json={}, headers={"Authorization": "Bearer wrong"}, timeout=30), 401)


def test_api_key_accepted_and_health_open(colocated):
    secured = colocated.secured
    assert requests.get(secured.url + "/health", timeout=30).status_code == 200
    assert "pdserve_gateway" in requests.get(secured.url + "/metrics", timeout=30).text  # scrapers hold no key
    assert requests.get(secured.url + "/v1/models", headers=secured.headers(), timeout=30).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=secured.base, api_key="wrong", max_retries=0).models.list()
    assert openai.OpenAI(base_url=secured.base, api_key=API_KEY, max_retries=0).models.list().data


def test_no_healthy_worker_is_503(colocated):
    dead = colocated.dead
    check_error(requests.get(dead.url + "/health", timeout=30), 503)
    check_error(requests.post(dead.url + "/v1/chat/completions", json=CHAT, timeout=30), 503)
    check_error(requests.post(dead.url + "/generate", json={"text": "hi", "stream": True}, timeout=30), 503)
    check_error(requests.get(dead.url + "/health_generate", timeout=30), 503)
    c = openai.OpenAI(base_url=dead.base, api_key="x", max_retries=0)
    with pytest.raises(openai.InternalServerError) as info:
        c.chat.completions.create(model=c.models.list().data[0].id, messages=CHAT["messages"])
    assert info.value.status_code == 503


def open_stream(gw, body: dict) -> socket.socket:
    """A raw HTTP streaming request; returns the socket once the first event arrived."""
    host, port = gw.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=60)
    payload = json.dumps(body).encode()
    headers = "".join(f"{k}: {v}\r\n" for k, v in gw.headers().items())
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n{headers}"
                 f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    received = b""
    while b"data: " not in received:
        chunk = sock.recv(4096)
        assert chunk, received
        received += chunk
    assert received.startswith(b"HTTP/1.1 200"), received
    return sock


LONG = {"prompt": "Write a very long story about a dragon.", "max_tokens": 2000, "ignore_eos": True, "stream": True}


def test_queue_limit_is_429_with_retry_after_and_disconnects_free_every_page(colocated):
    secured = colocated.secured
    socks = [open_stream(secured, LONG) for _ in range(MAX_RUNNING)]
    try:
        r = requests.post(secured.url + "/v1/completions", json={**LONG, "stream": False}, headers=secured.headers(),
                          timeout=30)
        assert "busy" in check_error(r, 429)["message"]
        assert int(r.headers["Retry-After"]) > 0
    finally:
        for s in socks:
            s.close()
    start = time.monotonic()
    load, stats = wait_idle(colocated.worker, timeout=20)
    assert (load.running, load.waiting, stats.used_pages, stats.integrity_ok) == (0, 0, 0, True), stats
    assert time.monotonic() - start < 20  # far less than 2000 tokens would take: the requests were aborted


def test_disconnect_of_a_non_streaming_request_aborts_it(colocated):
    with pytest.raises(requests.exceptions.ReadTimeout):
        requests.post(colocated.open.url + "/v1/completions", json={**LONG, "stream": False}, timeout=2,
                      headers={"X-Request-Id": "trace-disconnect-7"})
    load, stats = wait_idle(colocated.worker, timeout=20)
    assert (load.running, stats.used_pages, stats.integrity_ok) == (0, 0, True)
    # The gateway's request id travelled to the worker with the call: its line about the cancel names it.
    worker_log = colocated.system.workers[colocated.worker].log_path.read_text(errors="replace")
    assert any("trace-disconnect-7" in line and "cancelled" in line for line in worker_log.splitlines())
