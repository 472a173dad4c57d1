"""Bounded work per request, on a real gateway and worker: every request over a limit is a 400 naming the field and
the limit, answered before the work it asks for starts; the worker's memory and the gateway's event loop hold.

Each case was found on main at b3020c0 (issue 28): there, these requests were accepted and cost what the
comments say.
"""
from __future__ import annotations

import json
import threading
import time
from urllib.parse import urlsplit

import grpc
import pytest
import requests
from harness import start_gateway, start_worker

from pdserve.proto import worker_pb2 as pb
from pdserve.proto import worker_pb2_grpc as pb_grpc

ERROR_KEYS = {"object", "message", "type", "param", "code"}


def refused(r: requests.Response, param: str, *words: str) -> dict:
    """A 400 in the API's error shape naming `param`, whose message holds `words` (the limit, the flag)."""
    assert r.status_code == 400, r.text[:500]
    body = r.json()
    if set(body) == {"error"}:  # /v1/responses: OpenAI's envelope, as SGLang answers there
        body = {"object": "error", **body["error"]}
    kind = "BadRequestError" if urlsplit(r.url).path == "/v1/score" else "invalid_request_error"  # SGLang's type
    assert set(body) == ERROR_KEYS and body["code"] == 400 and body["type"] == kind, body
    assert body["param"] == param, body
    for word in words:
        assert word in body["message"], body
    return body


def post(gw, path: str, body: dict | bytes, timeout: float = 60) -> requests.Response:
    if isinstance(body, bytes):
        return requests.post(gw.url + path, data=body, headers={"Content-Type": "application/json"}, timeout=timeout)
    return requests.post(gw.url + path, json=body, timeout=timeout)


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        line = next(x for x in f if x.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


class LiveProbe:
    """Asks /live every 10 ms on one connection while it runs; `worst` is the slowest answer, in seconds."""

    def __init__(self, url: str) -> None:
        self.url, self.worst, self.count = url + "/live", 0.0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with requests.Session() as s:
            s.get(self.url, timeout=5)  # the connection is open before the measuring starts
            while not self._stop.is_set():
                start = time.perf_counter()
                assert s.get(self.url, timeout=5).status_code == 200
                self.worst = max(self.worst, time.perf_counter() - start)
                self.count += 1
                time.sleep(0.01)

    def __enter__(self) -> LiveProbe:
        self._thread.start()
        time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)


# ---------------------------------------------------------------- /v1/score
def test_score_labels_over_the_limit_are_400_and_the_worker_rss_holds(hostile):
    # b3020c0: 8 items x 4M labels built a 1.5 GB array on the worker. Here 8 x 1M (a 3 MB body).
    before = rss_mib(hostile.worker_pid)
    start = time.monotonic()
    r = post(hostile.plain, "/v1/score", {"query": "Is Paris in France? Answer:", "items": [" yes"] * 8,
                                          "label_token_ids": [1] * 1_000_000})
    refused(r, "label_token_ids", "256", "--max-score-labels")
    assert time.monotonic() - start < 5
    assert rss_mib(hostile.worker_pid) - before < 50
    # At the limit it is served.
    ok = post(hostile.plain, "/v1/score", {"query": "Is Paris in France? Answer:", "items": [" yes", " no"],
                                           "label_token_ids": list(range(256))})
    assert ok.status_code == 200, ok.text
    assert [len(s) for s in ok.json()["scores"]] == [256, 256]


def test_the_worker_refuses_too_many_labels_at_its_own_edge(hostile):
    # A gRPC client that skips the gateway meets the worker's own limit (MAX_SCORE_LABELS).
    before = rss_mib(hostile.worker_pid)
    with grpc.insecure_channel(hostile.worker, options=[("grpc.max_send_message_length", 64 << 20)]) as ch:
        request = pb.EncodeRequest(rid="hostile", inputs=[pb.TokenSeq(ids=[1, 2, 3])] * 8,
                                   label_token_ids=[5] * 2_000_000)
        with pytest.raises(grpc.RpcError) as info:
            pb_grpc.PoolingStub(ch).Encode(request, timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "1024" in info.value.details()
    assert rss_mib(hostile.worker_pid) - before < 100


def test_a_30_mb_score_query_is_400_at_once_and_live_answers_meanwhile(hostile):
    # b3020c0: refused after 37 s, with /live silent for 36.8 s (tokenized on the event loop).
    body = json.dumps({"query": "hello world " * 2_500_000, "items": [" yes"], "label_token_ids": [1]}).encode()
    with LiveProbe(hostile.plain.url) as live:
        start = time.monotonic()
        r = post(hostile.plain, "/v1/score", body)
        elapsed = time.monotonic() - start
        time.sleep(0.1)
    refused(r, "query", "characters", "8192")
    assert elapsed < 3, elapsed
    assert live.count > 5 and live.worst < 0.1, (live.count, live.worst)


def test_score_items_over_the_list_limit_are_400(hostile):
    r = post(hostile.plain, "/v1/score", {"query": "q", "items": ["a"] * 2049, "label_token_ids": [1]})
    refused(r, "items", "2048", "--max-list-items")


# ---------------------------------------------------------------- stop ids, logit_bias, grammars, tools
@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "x", "max_tokens": 1, "stop_token_ids": list(range(257))}, "stop_token_ids"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stop_token_ids": [7] * 1_000_000},
     "stop_token_ids"),
    ("/generate", {"text": "x", "sampling_params": {"stop_token_ids": list(range(257))}},
     "sampling_params.stop_token_ids"),
    ("/generate", {"text": ["x", "y"], "sampling_params": [{}, {"stop_token_ids": list(range(300))}]},
     "sampling_params.1.stop_token_ids"),
])
def test_stop_token_ids_over_the_limit_are_400(hostile, path, body, param):
    # b3020c0: 4M ids were accepted and took 8.3 s, stalling a neighbouring stream 2 s.
    start = time.monotonic()
    refused(post(hostile.plain, path, body), param, "256", "--max-stop-token-ids")
    assert time.monotonic() - start < 3


def test_stop_token_ids_at_the_limit_are_served(hostile):
    r = post(hostile.plain, "/v1/completions", {"prompt": "x", "max_tokens": 1, "stop_token_ids": list(range(256))})
    assert r.status_code == 200, r.text


def nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}


@pytest.mark.parametrize("body, param, words", [
    ({**CHAT, "logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias", ("300", "--max-logit-bias")),
    ({**CHAT, "stop": [f"s{i}" for i in range(65)]}, "stop", ("64", "--max-stop-strings")),
    ({**CHAT, "tools": [TOOL] * 129}, "tools", ("128", "--max-tools")),
    ({**CHAT, "tools": [{**TOOL, "function": {**TOOL["function"], "description": "d" * 300_000}}]}, "tools",
     ("bytes", "--max-tools-bytes")),
    ({**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": nested(450)}}},
     "response_format.json_schema.schema", ("64", "--max-schema-depth")),
    ({**CHAT, "json_schema": json.dumps(nested(40))}, "json_schema", ("64", "--max-schema-depth")),
    ({**CHAT, "regex": "a" * 200_000}, "regex", ("bytes", "--max-grammar-bytes")),
    ({**CHAT, "tools": [{**TOOL, "function": {**TOOL["function"], "parameters": nested(40)}}],
      "tool_choice": "required"}, "tools", ("64", "--max-schema-depth")),
])
def test_chat_limits_are_400_before_any_work(hostile, body, param, words):
    # b3020c0: a 25 KB schema nested 900 deep compiled for 56 s; 1,500 tools with tool_choice required for 250 s.
    start = time.monotonic()
    refused(post(hostile.plain, "/v1/chat/completions", body), param, *words)
    assert time.monotonic() - start < 3


def test_a_schema_within_the_depth_limit_is_served(hostile):
    schema = nested(10)
    r = post(hostile.plain, "/v1/chat/completions", {**CHAT, "max_tokens": 4, "response_format": {
        "type": "json_schema", "json_schema": {"name": "n", "schema": schema}}})
    assert r.status_code == 200, r.text


# ---------------------------------------------------------------- messages, lists, totals, max_tokens
def test_too_many_messages_are_400_before_rendering(hostile):
    # b3020c0: 400k messages rendered for 8 s on the event loop before any size check.
    messages = [{"role": "user", "content": "x"}] * 100_000
    with LiveProbe(hostile.plain.url) as live:
        start = time.monotonic()
        r = post(hostile.plain, "/v1/chat/completions", {"messages": messages})
        elapsed = time.monotonic() - start
    refused(r, "messages", "2048", "--max-messages")
    assert elapsed < 2 and live.worst < 0.25, (elapsed, live.worst)
    r = post(hostile.plain, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}] * 2049})
    refused(r, "messages", "2048")
    ok = post(hostile.plain, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}] * 50,
                                                      "max_tokens": 1})
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": ["x"] * 2049, "max_tokens": 1}, "prompt"),
    ("/v1/completions", {"prompt": [[1, 2]] * 2049, "max_tokens": 1}, "prompt"),
    ("/generate", {"text": ["x"] * 2049}, "text"),
    ("/tokenize", {"prompt": ["x"] * 2049}, "prompt"),
])
def test_lists_over_the_list_limit_are_400(hostile, path, body, param):
    refused(post(hostile.plain, path, body), param, "2048", "--max-list-items")


@pytest.mark.parametrize("path, make, param", [
    ("/v1/completions", lambda p: {"prompt": p, "max_tokens": 1}, "prompt"),
    ("/generate", lambda p: {"text": p, "sampling_params": {"max_new_tokens": 1}}, "text"),
])
def test_a_list_over_the_total_tokens_is_400(hostile, path, make, param):
    # Each prompt fits the context; together they pass --max-request-tokens (4096 on this gateway). b3020c0
    # took each prompt under the per-prompt cap, so a list of them was any size.
    text = "hello world " * 700  # ~1400 tokens
    refused(post(hostile.strict, path, make([text] * 3)), param, "4096", "--max-request-tokens")
    ids = [[1000] * 1500] * 3
    body = make(None)
    body.pop("prompt" if "prompt" in body else "text")
    body["prompt" if path == "/v1/completions" else "input_ids"] = ids
    refused(post(hostile.strict, path, body), param if path == "/v1/completions" else "input_ids", "4096")


# ---------------------------------------------------------------- the Messages and Responses dialects
def test_messages_and_responses_take_the_same_limits_before_any_work(hostile):
    many = [{"role": "user", "content": "x"}] * 2049
    tools = [{"name": f"t{i}", "input_schema": {"type": "object"}} for i in range(129)]
    r = post(hostile.plain, "/v1/messages", {"model": "default", "max_tokens": 4, "messages": many})
    assert r.status_code == 400 and r.json()["type"] == "error", r.text[:300]
    assert r.json()["error"]["type"] == "invalid_request_error" and "2048" in r.json()["error"]["message"]
    r = post(hostile.plain, "/v1/messages/count_tokens", {"model": "default", "messages": many})
    assert r.status_code == 400 and "max-messages" in r.json()["error"]["message"]
    r = post(hostile.plain, "/v1/messages", {"model": "default", "max_tokens": 4, "tools": tools,
                                               "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 400 and "128" in r.json()["error"]["message"]
    refused(post(hostile.plain, "/v1/responses", {"model": "default", "input": many}), "input", "2048")
    fn_tools = [{"type": "function", "name": f"t{i}", "parameters": {"type": "object"}} for i in range(129)]
    refused(post(hostile.plain, "/v1/responses", {"model": "default", "input": "x", "tools": fn_tools}), "tools",
            "128")


@pytest.mark.parametrize("path, extra, param, words", [
    ("/v1/responses", {"regex": "a" * 200_000}, "regex", ("bytes", "--max-grammar-bytes")),
    ("/v1/responses", {"json_schema": json.dumps(nested(450))}, "json_schema", ("64", "--max-schema-depth")),
    ("/v1/responses", {"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias", ("300", "--max-logit-bias")),
    ("/v1/messages", {"regex": "a" * 200_000}, "regex", ("bytes", "--max-grammar-bytes")),
    ("/v1/messages", {"json_schema": json.dumps(nested(450))}, "json_schema", ("64", "--max-schema-depth")),
    ("/v1/messages", {"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias", ("300", "--max-logit-bias")),
])
def test_the_grammar_and_bias_extensions_take_chat_limits_on_messages_and_responses(hostile, path, extra, param,
                                                                                    words):
    # Before: both dialects passed these to the grammar compiler (a 450-deep schema compiles for tens of
    # seconds, holding back every other grammar request) and a logit_bias of any size to the workers.
    body = ({"model": "default", "input": "hi", "max_output_tokens": 4} if path == "/v1/responses" else
            {"model": "default", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    start = time.monotonic()
    r = post(hostile.plain, path, {**body, **extra})
    assert time.monotonic() - start < 3
    if path == "/v1/responses":
        refused(r, param, *words)
    else:  # Anthropic's error shape: no param, the field named in the message
        assert r.status_code == 400 and r.json()["type"] == "error", r.text[:300]
        assert r.json()["error"]["type"] == "invalid_request_error"
        assert all(w in r.json()["error"]["message"] for w in (repr(param), *words)), r.json()


def test_a_responses_input_over_the_context_is_400_unrendered_even_with_truncation_auto(hostile):
    # Before: with truncation "auto" the size check was skipped, so 3 MB were rendered and tokenized on the
    # event loop (about 1.5 s of it) before the 400; a chain of many turns was tokenized again per turn dropped.
    huge = "word " * 600_000
    with LiveProbe(hostile.plain.url) as live:
        start = time.monotonic()
        r = post(hostile.plain, "/v1/responses", {"model": "default", "input": huge, "truncation": "auto"})
        elapsed = time.monotonic() - start
    refused(r, "input", "characters")
    assert elapsed < 3 and live.worst < 0.25, (elapsed, live.worst)


def test_a_long_chain_with_truncation_auto_keeps_the_latest_turns_that_fit(default_model_dir):
    # A worker of a 2,048-token context: the chain passes it within a few turns, and each turn once past it
    # computes 2k tokens again rather than 8k (what the shared worker's context would take, at 4x the time).
    proc, addr = start_worker("colocated", str(default_model_dir), "--context-length", "2048", threads=1)
    gw = start_gateway(default_model_dir, "--worker", addr)
    try:
        proc.wait_healthy(180)
        gw.proc.wait_healthy(60)
        previous = None
        for turn in range(6):  # each turn ~700 tokens: the chain passes the context at the third
            body = {"model": "default", "input": f"turn {turn}: " + "tell me more " * 230, "max_output_tokens": 2,
                    "truncation": "auto", **({"previous_response_id": previous} if previous else {})}
            r = post(gw, "/v1/responses", body, timeout=120)
            assert r.status_code == 200, r.text[:300]
            previous = r.json()["id"]
        items = requests.get(f"{gw.url}/v1/responses/{previous}/input_items?limit=100", timeout=30).json()["data"]
        texts = [part["text"] for item in items if item.get("role") == "user" for part in item["content"]]
        kept = sorted(int(t.split(":")[0].split()[1]) for t in texts)
        assert kept[-1] == 5 and kept == list(range(kept[0], 6)) and kept[0] > 0, kept  # the oldest dropped
        assert r.json()["usage"]["input_tokens"] < 2048
    finally:
        gw.proc.stop()
        proc.stop()


def test_a_block_type_that_is_not_a_string_is_a_400_in_anthropic_shape(hostile):
    for content in ([{"type": ["text"], "text": "x"}],
                    [{"type": "tool_result", "tool_use_id": "t1", "content": [{"type": {"a": 1}}]}]):
        r = post(hostile.plain, "/v1/messages", {"model": "default", "max_tokens": 4,
                                                 "messages": [{"role": "user", "content": content}]})
        assert r.status_code == 400 and r.json()["type"] == "error", r.text[:300]  # was a 500
    r = post(hostile.plain, "/v1/messages", {"model": "default", "max_tokens": 0,
                                             "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"], r.text[:300]


def test_the_operators_cap_on_new_tokens_holds_on_every_api(hostile, default_model_dir):
    gw = start_gateway(default_model_dir, "--worker", hostile.worker, "--max-new-tokens", "3")
    try:
        gw.proc.wait_healthy(60)
        asked = 40
        chat = post(gw, "/v1/chat/completions", {**CHAT, "max_tokens": asked, "ignore_eos": True}).json()
        messages = post(gw, "/v1/messages", {"model": "default", "max_tokens": asked, "ignore_eos": True,
                                             "messages": [{"role": "user", "content": "hi"}]}).json()
        responses = post(gw, "/v1/responses", {"model": "default", "input": "hi", "max_output_tokens": asked,
                                               "ignore_eos": True}).json()
        assert chat["usage"]["completion_tokens"] == 3, chat
        assert messages["usage"]["output_tokens"] == 3 and messages["stop_reason"] == "max_tokens", messages
        assert responses["usage"]["output_tokens"] == 3, responses
        assert responses["incomplete_details"] == {"reason": "max_output_tokens"}, responses
    finally:
        gw.proc.stop()
