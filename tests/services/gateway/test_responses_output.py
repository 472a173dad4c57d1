"""The Responses API's output builder and in-memory store, on their own (no processes): a streamed output ends
with exactly the items of the same output read whole, its events come in OpenAI's order, and a stored
response changes only from the statuses a transition names."""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from pdserve.services.gateway.apis.responses.items import chat_messages, input_items
from pdserve.services.gateway.apis.responses.output import OutputBuilder
from pdserve.services.gateway.apis.responses.store import MemoryResponses, Stored, new_item_id
from pdserve.services.gateway.intake.tool_calls import ToolPlan, plan_tools

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


def required_plan() -> ToolPlan:
    req = SimpleNamespace(tools=[WEATHER], tool_choice="required", functions=None, function_call=None,
                          parallel_tool_calls=None)
    return plan_tools(req, None)


def pieces(text: str, size: int) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


def strip_ids(items: list[dict]) -> list[dict]:
    return [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in items]


@pytest.mark.parametrize("parser, plan, text", [
    (None, ToolPlan(), "The capital of France is Paris."),
    ("deepseek-r1", ToolPlan(), "Let me think.</think>The capital is Paris."),
    (None, None, '[{"name": "get_weather", "parameters": {"city": "Paris"}}]'),
])
@pytest.mark.parametrize("size", [1, 3, 7])
def test_streamed_items_equal_whole_items(parser, plan, text, size):
    plan = plan or required_plan()
    whole = OutputBuilder(parser, plan)
    whole.push(text, final=True)
    streamed = OutputBuilder(parser, plan)
    events = []
    for piece in pieces(text, size):
        events += streamed.push(piece)
    events += streamed.push("", final=True)
    assert strip_ids(streamed.items) == strip_ids(whole.items)
    done = {e["output_index"]: e["item"] for e in events if e["type"] == "response.output_item.done"}
    assert [done[i] for i in sorted(done)] == streamed.items  # every item ends once, as it is in the output
    for index, item in enumerate(streamed.items):
        kinds = [e["type"] for e in events if e.get("output_index") == index]
        assert kinds[0] == "response.output_item.added" and kinds[-1] == "response.output_item.done"
        if item["type"] == "message":
            text_deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
            assert text_deltas == item["content"][0]["text"]
        if item["type"] == "function_call":
            assert json.loads(item["arguments"]) == {"city": "Paris"} and item["name"] == "get_weather"


def test_an_incomplete_output_marks_its_items_incomplete():
    builder = OutputBuilder(None, ToolPlan())
    builder.push("The capital")
    builder.push(" of", final=True, status="incomplete")
    assert builder.items[0]["status"] == "incomplete" and builder.items[0]["content"][0]["text"] == "The capital of"


def test_items_become_chat_messages_with_calls_joined_to_the_assistant_turn():
    items = input_items([{"role": "user", "content": "Weather?"},
                         {"role": "assistant", "content": [{"type": "output_text", "text": "Looking."}]},
                         {"type": "function_call", "call_id": "c1", "name": "get_weather",
                          "arguments": '{"city": "Rome"}'},
                         {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
                         {"type": "reasoning", "summary": []}])
    assert [i["id"][:3] for i in items] == ["msg", "msg", "fc_", "fco", "rs_"]
    messages = chat_messages("Be brief.", items)
    assert messages == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Looking.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]


def test_the_memory_store_changes_only_from_the_named_statuses_and_forgets_the_oldest():
    async def run():
        store = MemoryResponses(ttl_s=60, capacity=2)
        first = {"id": new_item_id("resp_"), "status": "queued"}
        await store.put(Stored(first, [{"type": "message"}]))
        assert await store.update({**first, "status": "in_progress"}, when=("queued",))
        assert not await store.update({**first, "status": "completed"}, when=("queued",))
        assert await store.update({**first, "status": "cancelled"}, when=("queued", "in_progress"))
        record = await store.get(first["id"])
        assert record.response["status"] == "cancelled" and record.input == [{"type": "message"}]
        record.response["status"] = "edited"  # a copy: the store keeps its own
        assert (await store.get(first["id"])).response["status"] == "cancelled"
        for _ in range(2):
            await store.put(Stored({"id": new_item_id("resp_"), "status": "completed"}, []))
        assert await store.get(first["id"]) is None  # the oldest went first
        expired = MemoryResponses(ttl_s=-1)
        await expired.put(Stored({"id": "resp_x", "status": "completed"}, []))
        assert await expired.get("resp_x") is None

    asyncio.run(run())
