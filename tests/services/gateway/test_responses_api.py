"""/v1/responses with the official openai client against real worker processes: two gateway replicas sharing
a real redis-server (stored responses, chains across replicas and restarts), and the shared `colocated`
system's own gateways (responses in memory; a reasoning parser)."""
from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import jsonschema
import openai
import pytest
import requests

sys.path.insert(0, str(Path(__file__).parents[1] / "jobs"))

from harness import Gateway, start_gateway, wait_idle  # noqa: E402
from jobs_harness import RedisServer  # noqa: E402

QUESTION = "What is the capital of France?"
SHORT = 12  # output tokens of most requests: enough to read, cheap on one CPU thread
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                          "additionalProperties": False}, "strict": True}


@dataclass
class Replicas:
    redis: RedisServer
    gateways: list[Gateway]
    worker: str
    model_dir: Path

    def client(self, i: int = 0) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.gateways[i].base, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def replicas(colocated, default_model_dir, tmp_path_factory):
    redis = RedisServer(tmp_path_factory.mktemp("responses-redis")).start()
    system = Replicas(redis, [], colocated.worker, default_model_dir)
    try:
        for _ in range(2):
            system.gateways.append(start_gateway(default_model_dir, "--worker", colocated.worker,
                                                 "--redis-url", redis.url(), "--enable-cache-report"))
        for gw in system.gateways:
            gw.proc.wait_healthy(60)
        yield system
    finally:
        for gw in system.gateways:
            gw.proc.stop()
        redis.stop()


def ask(client: openai.OpenAI, prompt=QUESTION, **kw):
    return client.responses.create(model="default", input=prompt, max_output_tokens=kw.pop("max_output_tokens", SHORT),
                                   temperature=0, **kw)


def test_a_plain_response_has_openais_shape_and_is_stored(replicas):
    r = ask(replicas.client())
    assert r.id.startswith("resp_") and r.object == "response" and r.status in ("completed", "incomplete")
    assert "Paris" in r.output_text
    message = r.output[0]
    assert message.type == "message" and message.role == "assistant" and message.content[0].type == "output_text"
    assert r.usage.input_tokens > 0 and r.usage.output_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.input_tokens_details.cached_tokens >= 0 and r.usage.output_tokens_details.reasoning_tokens == 0
    again = replicas.client(1).responses.retrieve(r.id)  # the other replica reads it from Redis
    assert again.output_text == r.output_text and again.status == r.status


def test_max_output_tokens_cuts_a_completed_response_with_incomplete_details(replicas):
    # SGLang's `completed` (OpenAI's `incomplete` is --responses-incomplete-status: test_sglang_conformance_chat.py)
    r = ask(replicas.client(), "Write a long story about a dragon.", max_output_tokens=4)
    assert r.status == "completed" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 4 and r.output[0].status == "incomplete"


def test_streamed_equals_not_streamed_and_events_come_in_order(replicas):
    client = replicas.client()
    whole = ask(client, store=False)
    with client.responses.stream(model="default", input=QUESTION, max_output_tokens=SHORT, temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert final.output_text == whole.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed" if whole.status == "completed" else "response.incomplete"]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert replicas.client().responses.retrieve(final.id).output_text == whole.output_text  # stored once done
    with pytest.raises(openai.NotFoundError):  # store: false keeps nothing
        client.responses.retrieve(whole.id)


def test_a_chain_continues_on_another_replica_from_the_prefix_cache(replicas):
    first = ask(replicas.client(0), "My name is Ada and I live in Paris. Say hello to me.")
    second = ask(replicas.client(1), "What is my name?", previous_response_id=first.id)
    assert second.previous_response_id == first.id
    # The second prompt holds the first exchange, and its start was already in the worker's prefix cache.
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens > 0
    items = replicas.client(0).responses.input_items.list(second.id, order="asc").data
    assert [i.type for i in items] == ["message", "message", "message"]
    assert items[0].content[0].text.startswith("My name is Ada") and items[1].role == "assistant"
    assert items[1].content[0].text == first.output_text and items[2].content[0].text == "What is my name?"
    page = replicas.client(0).responses.input_items.list(second.id, limit=2)  # newest first
    assert [i.id for i in page.data] == [items[2].id, items[1].id] and page.has_more


def test_function_calls_round_trip_through_function_call_output(replicas):
    client = replicas.client()
    r = ask(client, "What is the weather in Paris?", tools=[WEATHER], tool_choice="required", max_output_tokens=40)
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and calls[0].call_id
    assert isinstance(json.loads(calls[0].arguments)["city"], str)
    assert r.tools[0].name == "get_weather"
    answer = ask(client, [{"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny, 24 C"}],
                 previous_response_id=r.id, tools=[WEATHER])
    assert answer.status in ("completed", "incomplete") and answer.output_text
    items = client.responses.input_items.list(answer.id, order="asc").data
    assert [i.type for i in items][-2:] == ["function_call", "function_call_output"]
    named = ask(client, "Weather in Rome?", tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"},
                max_output_tokens=40)
    assert named.output[-1].type == "function_call" and named.tool_choice.name == "get_weather"


def test_json_schema_output_parses_and_validates(replicas):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                               "population": {"type": "integer", "minimum": 0, "maximum": 10**8}},
              "required": ["city", "population"], "additionalProperties": False}
    r = ask(replicas.client(), "Give the capital of France and its population as JSON.", max_output_tokens=64,
            text={"format": {"type": "json_schema", "name": "city", "schema": schema, "strict": True}})
    assert r.status == "completed", r.output_text
    value = json.loads(r.output_text)
    jsonschema.validate(value, schema)
    assert r.text.format.type == "json_schema"


def test_a_chain_survives_a_gateway_restart(replicas):
    first = ask(replicas.client(0), "Remember the number 42.")
    old = replicas.gateways[0]
    old.proc.stop()
    replicas.gateways[0] = start_gateway(replicas.model_dir, "--worker", replicas.worker, "--redis-url",
                                         replicas.redis.url(), "--enable-cache-report")
    replicas.gateways[0].proc.wait_healthy(60)
    second = ask(replicas.client(0), "Which number?", previous_response_id=first.id)
    assert second.status in ("completed", "incomplete")
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens


def test_background_responses_complete_or_cancel(replicas):
    client = replicas.client()
    r = ask(client, background=True)
    assert r.status in ("queued", "in_progress") and r.background
    deadline = time.monotonic() + 60
    while r.status in ("queued", "in_progress") and time.monotonic() < deadline:
        time.sleep(0.2)
        r = replicas.client(1).responses.retrieve(r.id)
    assert r.status in ("completed", "incomplete") and "Paris" in r.output_text
    long = ask(client, "Count to a thousand.", background=True, max_output_tokens=2000,
               extra_body={"ignore_eos": True})
    time.sleep(1.0)
    cancelled = replicas.client(1).responses.cancel(long.id)  # cancelled through the other replica
    assert cancelled.status == "cancelled"
    time.sleep(1.0)
    assert client.responses.retrieve(long.id).status == "cancelled"
    load, _ = wait_idle(replicas.worker)  # the generation was aborted on the worker
    assert load.running == 0
    with pytest.raises(openai.BadRequestError):  # a completed response cannot be cancelled
        client.responses.cancel(r.id)


def test_delete_then_404(replicas):
    client = replicas.client()
    r = ask(client, max_output_tokens=2)
    assert requests.delete(f"{replicas.gateways[1].base}/responses/{r.id}", timeout=10).json() == {
        "id": r.id, "object": "response", "deleted": True}
    for call in (lambda: client.responses.retrieve(r.id), lambda: client.responses.delete(r.id),
                 lambda: client.responses.input_items.list(r.id)):
        with pytest.raises(openai.NotFoundError):
            call()


def test_bad_requests_name_the_field(replicas):
    client = replicas.client()
    with pytest.raises(openai.BadRequestError) as err:  # a field of the request: 400, as OpenAI and SGLang
        ask(client, previous_response_id="resp_" + "0" * 32)
    assert err.value.body["param"] == "previous_response_id" and "not found" in err.value.body["message"]
    cases = [({"tools": [{"type": "web_search"}]}, "tools.0.type", "web_search"),
             ({"tools": [{"type": "file_search", "vector_store_ids": []}]}, "tools.0.type", "file_search"),
             ({"input": [{"type": "computer_call_output", "call_id": "c", "output": {}}]}, "input.0.type",
              "computer_call_output"),
             ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
              "input.0.content.0.type", "input_image"),
             ({"tool_choice": "sometimes"}, "tool_choice", "tool_choice"),
             ({"background": True, "store": False}, "background", "store")]
    for extra, param, word in cases:
        body = {"model": "default", "input": QUESTION, "max_output_tokens": 2, **extra}
        reply = requests.post(f"{replicas.gateways[0].base}/responses", json=body, timeout=30)
        assert reply.status_code == 400, (extra, reply.text)
        error = reply.json()["error"]  # OpenAI's envelope, as SGLang answers on /v1/responses
        assert error["param"] == param and word in error["message"] and error["code"] == 400, error


def test_a_chain_past_the_context_is_refused_or_truncated(replicas):
    client = replicas.client()
    long_text = "the quick brown fox jumps over the lazy dog " * 500  # 4,501 tokens: two pass the context
    first = ask(client, long_text, max_output_tokens=1)
    with pytest.raises(openai.BadRequestError) as err:
        ask(client, long_text, previous_response_id=first.id, max_output_tokens=1)
    assert "context length of 8192 tokens" in err.value.body["message"] and err.value.body["param"] == "input"
    cut = ask(client, long_text, previous_response_id=first.id, max_output_tokens=1, truncation="auto")
    assert cut.status in ("completed", "incomplete") and cut.usage.input_tokens < 8192


# ---------------------------------------------------------------- the shared system's gateways (no Redis)
def test_without_redis_responses_chain_in_memory(colocated):
    client = openai.OpenAI(base_url=colocated.open.base, api_key="unused", max_retries=0)
    first = ask(client, "Hello there.")
    second = ask(client, "Again.", previous_response_id=first.id)
    assert second.usage.input_tokens > first.usage.input_tokens
    with pytest.raises(openai.BadRequestError) as err:
        ask(client, previous_response_id="resp_" + "1" * 32)
    assert "memory" in err.value.body["message"]  # says why another replica or a restart would not have it


def test_a_reasoning_parser_gives_reasoning_items(colocated):
    gw = colocated.secured  # --reasoning-parser deepseek-r1: the output starts inside the reasoning
    client = openai.OpenAI(base_url=gw.base, api_key=gw.api_key, max_retries=0)
    r = ask(client, max_output_tokens=24)
    assert r.status == "completed" and r.output[0].type == "reasoning" and r.output[0].content[0].text
    assert r.usage.output_tokens_details.reasoning_tokens > 0
    with client.responses.stream(model="default", input=QUESTION, max_output_tokens=24, temperature=0) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert "response.reasoning_text.delta" in kinds
    assert final.output[0].content[0].text == r.output[0].content[0].text
