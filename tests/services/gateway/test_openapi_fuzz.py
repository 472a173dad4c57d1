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
        else:
            assert error["object"] == "error" and error["code"] == response.status_code and error["message"]
        assert "Traceback" not in response.text
