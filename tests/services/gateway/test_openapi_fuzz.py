"""The gateway's OpenAPI document, and schemathesis fuzzing every route it lists against the real gateway and
worker: whatever a client sends, the answer is never a 5xx and never takes longer than REQUEST_TIMEOUT_S."""
from __future__ import annotations

import time

import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

MAX_EXAMPLES = 15  # per route
REQUEST_TIMEOUT_S = 30.0  # an answer slower than this counts as a hang
# The fuzzer looks for crashes in validation, not for long generations on a CPU: every generation it asks
# for is cut to a few tokens (wrong types and negative values are kept, so validation still sees them).
MAX_GENERATED_TOKENS = 4
LENGTH_FIELDS = ("max_tokens", "max_completion_tokens", "max_new_tokens", "min_tokens", "min_new_tokens",
                 "max_output_tokens")


def test_openapi_lists_the_routes_with_their_request_schemas(colocated):
    r = requests.get(colocated.open.url + "/openapi.json", timeout=30)
    assert r.status_code == 200
    doc = r.json()
    assert doc["openapi"].startswith("3.1")
    paths = doc["paths"]
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/messages/count_tokens", "/generate",
                 "/tokenize", "/abort_request"):
        body = paths[path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body["$ref"].split("/")[-1] in doc["components"]["schemas"]
    for path in ("/v1/models", "/v1/models/{model}", "/health", "/get_model_info", "/metrics", "/openapi.json"):
        assert "get" in paths[path]
    responses = paths["/v1/responses"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert "input" in doc["components"]["schemas"][responses["$ref"].split("/")[-1]]["required"]
    assert {"get", "delete"} <= set(paths["/v1/responses/{response_id}"])
    assert "post" in paths["/v1/responses/{response_id}/cancel"]
    assert "get" in paths["/v1/responses/{response_id}/input_items"]
    chat = doc["components"]["schemas"]["ChatCompletionRequest"]
    assert "messages" in chat["required"] and "chat_template_kwargs" in chat["properties"]
    sampling = doc["components"]["schemas"]["GenerateRequest"]["properties"]["sampling_params"]
    assert "max_new_tokens" in sampling["anyOf"][0]["properties"]
    assert not any(p.startswith(("/v1/files", "/v1/batches")) for p in paths)  # the jobs service's own API
    secured = requests.get(colocated.secured.url + "/openapi.json", headers=colocated.secured.headers(), timeout=30)
    assert secured.json()["security"] == [{"bearer": []}]
    assert secured.json()["paths"]["/health"]["get"]["security"] == []


def bound_generation(body: object) -> None:
    """Cut the lengths a generation request asks for to MAX_GENERATED_TOKENS (see above), in place."""
    if isinstance(body, list):
        for item in body:
            bound_generation(item)
        return
    if not isinstance(body, dict):
        return
    for key in LENGTH_FIELDS:
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            body[key] = min(value, MAX_GENERATED_TOKENS)
    for key in ("max_tokens", "max_new_tokens", "max_output_tokens"):  # absent, they mean "up to the context"
        if key in body and body[key] is None:
            body[key] = MAX_GENERATED_TOKENS
    if "messages" in body or "prompt" in body:
        body.setdefault("max_tokens", MAX_GENERATED_TOKENS)
    if "input" in body:  # /v1/responses
        body.setdefault("max_output_tokens", MAX_GENERATED_TOKENS)
    if "text" in body or "input_ids" in body:
        params = body.get("sampling_params")
        if params is None:
            body["sampling_params"] = {"max_new_tokens": MAX_GENERATED_TOKENS}
        for sp in params if isinstance(params, list) else [params]:
            if isinstance(sp, dict):
                sp.setdefault("max_new_tokens", MAX_GENERATED_TOKENS)
    bound_generation(body.get("sampling_params"))


def test_no_route_answers_5xx_or_hangs(colocated):
    schema = schemathesis.openapi.from_url(colocated.open.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 20
    failures = []
    for operation in operations:
        try:
            fuzz(operation)
        except Exception as exc:  # every route gets its turn; all failures are reported together
            failures.append(f"{operation.label}: {exc}")
    assert not failures, "\n\n".join(failures)


def fuzz(operation) -> None:
    """MAX_EXAMPLES requests to `operation`: bodies that fit its schema and bodies that break it."""
    cases = st.one_of(operation.as_strategy(GenerationMode.POSITIVE), operation.as_strategy(GenerationMode.NEGATIVE))

    @given(case=cases)
    @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck),
              phases=(Phase.generate, Phase.shrink))
    def answers_without_5xx(case):
        check(case)

    answers_without_5xx()


def check(case) -> None:
    bound_generation(case.body)
    start = time.monotonic()
    try:
        response = case.call(timeout=REQUEST_TIMEOUT_S)
    except requests.Timeout:
        raise AssertionError(f"no answer within {REQUEST_TIMEOUT_S:g} s: {case.method} {case.formatted_path} "
                             f"{str(case.body)[:300]}") from None
    assert time.monotonic() - start < REQUEST_TIMEOUT_S
    assert response.status_code < 500, (case.method, case.formatted_path, str(case.body)[:300], response.text[:500])
    if response.status_code >= 400:
        error = response.json()
        if case.formatted_path.startswith("/v1/messages"):  # Anthropic's shape on its routes
            assert error["type"] == "error" and error["error"]["type"] and error["error"]["message"]
        elif case.formatted_path.startswith("/v1/responses"):  # OpenAI's envelope, as SGLang's there
            assert error["error"]["code"] == response.status_code and error["error"]["message"]
        else:
            assert error["object"] == "error" and error["code"] == response.status_code and error["message"]
        assert "Traceback" not in response.text


def hostile_bodies() -> list[tuple[str, dict]]:
    """The requests of issue 28's review that cost a worker or the gateway dearly, each over one limit."""
    deep = {"type": "object"}
    for _ in range(300):
        deep = {"type": "object", "properties": {"a": deep}}
    chat = {"model": "default", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    return [
        ("/v1/score", {"query": "q", "items": ["a"], "label_token_ids": list(range(100_000))}),
        ("/v1/score", {"query": "hello world " * 500_000, "items": [" yes"], "label_token_ids": [1]}),
        ("/v1/embeddings", {"model": "default", "input": ["x"] * 5000}),
        ("/generate", {"text": "hi", "sampling_params": {"stop_token_ids": [7] * 100_000}}),
        ("/v1/completions", {"model": "default", "prompt": ["hello"] * 5000, "max_tokens": 1}),
        ("/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": "x"}] * 100_000}),
        ("/v1/chat/completions", {**chat, "logit_bias": {str(t): -1 for t in range(49152)}}),
        ("/v1/chat/completions", {**chat, "stop": ["s"] * 1000}),
        ("/v1/chat/completions", {**chat, "response_format": {"type": "json_schema",
                                                              "json_schema": {"name": "d", "schema": deep}}}),
        ("/v1/chat/completions", {**chat, "tools": [tool] * 1500, "tool_choice": "required"}),
        ("/v1/messages", {"model": "default", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}] * 5000}),
        ("/v1/responses", {"model": "default", "input": [{"role": "user", "content": "x"}] * 5000}),
    ]


def test_hostile_requests_get_the_fuzz_runs_answers(colocated):
    """Each hostile request, held to what the fuzz run holds every answer to: a 4xx in the API's shape, in time,
    with no traceback."""
    for path, body in hostile_bodies():
        start = time.monotonic()
        r = requests.post(colocated.open.url + path, json=body, timeout=REQUEST_TIMEOUT_S)
        assert time.monotonic() - start < REQUEST_TIMEOUT_S
        assert 400 <= r.status_code < 500, (path, r.status_code, r.text[:300])
        error = r.json()
        if path.startswith("/v1/messages"):
            assert error["type"] == "error" and error["error"]["message"]
        elif path.startswith("/v1/responses"):  # OpenAI's envelope, as SGLang's there
            assert error["error"]["code"] == r.status_code and error["error"]["message"]
        else:
            assert error["object"] == "error" and error["code"] == r.status_code and error["message"]
        assert "Traceback" not in r.text
