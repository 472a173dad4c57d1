"""The output of one /v1/responses response: its items, its typed stream events, and the response object.

One `OutputBuilder` per response reads the generation's text through the chat path's own parts: the
ReasoningSplitter (a `reasoning` item), tool_calls.CallStream (`function_call` items), and what is left is the
`message` item's output_text. `push` returns the events the new text makes, in the order OpenAI sends them
(output_item.added, content_part.added, the deltas, then .done events as an item ends); a response that is not
streamed pushes its whole text once and reads `items`. Both go through the same code, so a streamed response
ends with exactly the items of the same response not streamed. Events get their sequence numbers from `Events`
as they are sent.
"""
from __future__ import annotations

import copy
import time
from typing import Any

from pdserve.services.gateway.apis.responses.store import new_item_id
from pdserve.services.gateway.intake.reasoning import ReasoningSplitter
from pdserve.services.gateway.intake.tool_calls import ToolPlan

INCOMPLETE = {"length": "max_output_tokens"}  # finish reason -> incomplete_details.reason


class OutputBuilder:
    def __init__(self, parser: str | None, tools: ToolPlan) -> None:
        self.splitter = ReasoningSplitter(parser) if parser else None
        self.calls = tools.stream()
        self.items: list[dict] = []
        self.open: list[int] = []  # output indexes of the items not yet done, in order
        self.message: int | None = None  # the message item text goes to (None: the next text opens one)
        self.reasoning: int | None = None
        self.call_items: dict[int, int] = {}  # CallStream's call index -> output index

    @property
    def reasoning_text(self) -> str:
        return "".join(p["text"] for item in self.items if item["type"] == "reasoning" for p in item["content"])

    def push(self, text: str, final: bool = False, status: str = "completed") -> list[dict]:
        """Events for the next piece of output; `final`: it is the last, every item ends with `status`."""
        events: list[dict] = []
        reasoning, content = "", text
        if self.splitter is not None:
            split = self.splitter.push(text, final)
            reasoning, content = split.reasoning, split.content
        if reasoning:
            events += self._reasoning(reasoning)
        deltas: list[dict] = []
        if self.calls is not None:
            content, deltas = self.calls.push(content, final)
        if content:
            events += self._text(content)
        for delta in deltas:
            events += self._call(delta)
        if final:
            for index in list(self.open):
                events += self._close(index, status)
        return events

    # ------------------------------------------------------------ items
    def _add(self, item: dict) -> tuple[int, list[dict]]:
        index = len(self.items)
        self.items.append(item)
        self.open.append(index)
        return index, [{"type": "response.output_item.added", "output_index": index, "item": copy.deepcopy(item)}]

    def _reasoning(self, text: str) -> list[dict]:
        events: list[dict] = []
        if self.reasoning is None:
            self.reasoning, events = self._add({"id": new_item_id("rs_"), "type": "reasoning", "summary": [],
                                                "content": [], "status": "in_progress"})
            part = {"type": "reasoning_text", "text": ""}
            self.items[self.reasoning]["content"].append(part)
            events.append(self._part_event("response.content_part.added", self.reasoning, copy.deepcopy(part)))
        item = self.items[self.reasoning]
        item["content"][0]["text"] += text
        events.append({"type": "response.reasoning_text.delta", "item_id": item["id"],
                       "output_index": self.reasoning, "content_index": 0, "delta": text})
        return events

    def _text(self, text: str) -> list[dict]:
        events: list[dict] = []
        if self.reasoning is not None:
            events += self._close(self.reasoning, "completed")
        if self.message is None:
            self.message, events_added = self._add({"id": new_item_id("msg_"), "type": "message",
                                                    "role": "assistant", "status": "in_progress", "content": []})
            events += events_added
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            self.items[self.message]["content"].append(part)
            events.append(self._part_event("response.content_part.added", self.message, copy.deepcopy(part)))
        item = self.items[self.message]
        item["content"][0]["text"] += text
        events.append({"type": "response.output_text.delta", "item_id": item["id"], "output_index": self.message,
                       "content_index": 0, "delta": text, "logprobs": []})
        return events

    def _call(self, delta: dict) -> list[dict]:
        events: list[dict] = []
        fn = delta.get("function", {})
        if delta["index"] not in self.call_items:
            for index in (self.reasoning, self.message):
                if index is not None:
                    events += self._close(index, "completed")
            index, added = self._add({"id": new_item_id("fc_"), "type": "function_call", "call_id": delta["id"],
                                      "name": fn.get("name") or "", "arguments": "", "status": "in_progress"})
            self.call_items[delta["index"]] = index
            events += added
        index = self.call_items[delta["index"]]
        if fn.get("arguments"):
            item = self.items[index]
            item["arguments"] += fn["arguments"]
            events.append({"type": "response.function_call_arguments.delta", "item_id": item["id"],
                           "output_index": index, "delta": fn["arguments"]})
        return events

    def _close(self, index: int, status: str) -> list[dict]:
        if index not in self.open:
            return []
        self.open.remove(index)
        item = self.items[index]
        item["status"] = status
        events: list[dict] = []
        if item["type"] == "message":
            self.message = None
            part = item["content"][0]
            events.append({"type": "response.output_text.done", "item_id": item["id"], "output_index": index,
                           "content_index": 0, "text": part["text"], "logprobs": []})
            events.append(self._part_event("response.content_part.done", index, copy.deepcopy(part)))
        elif item["type"] == "reasoning":
            self.reasoning = None
            part = item["content"][0]
            events.append({"type": "response.reasoning_text.done", "item_id": item["id"], "output_index": index,
                           "content_index": 0, "text": part["text"]})
            events.append(self._part_event("response.content_part.done", index, copy.deepcopy(part)))
        else:
            if not item["arguments"]:
                item["arguments"] = "{}"
            events.append({"type": "response.function_call_arguments.done", "item_id": item["id"],
                           "output_index": index, "name": item["name"], "arguments": item["arguments"]})
        events.append({"type": "response.output_item.done", "output_index": index, "item": copy.deepcopy(item)})
        return events

    def _part_event(self, kind: str, index: int, part: dict) -> dict:
        return {"type": kind, "item_id": self.items[index]["id"], "output_index": index, "content_index": 0,
                "part": part}


class Events:
    """Numbers the events of one stream as they are sent."""

    def __init__(self) -> None:
        self.next = 0

    def number(self, event: dict) -> dict:
        event = {**event, "sequence_number": self.next}
        self.next += 1
        return event

    def of_response(self, kind: str, response: dict) -> dict:
        return self.number({"type": kind, "response": response})


# ---------------------------------------------------------------- the response object
def shell(rid: str, req: Any, model: str, tools: list[dict], tool_choice: Any, status: str = "in_progress") -> dict:
    """The response object before any output: what response.created shows and a background request answers."""
    fmt = req.text.format.model_dump(exclude_none=True, by_alias=True) if req.text and req.text.format else \
        {"type": "text"}
    return {"id": rid, "object": "response", "created_at": int(time.time()), "status": status,
            "background": req.background, "error": None, "incomplete_details": None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "metadata": req.metadata or {}, "model": model, "output": [],
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": req.reasoning.model_dump() if req.reasoning else {"effort": None, "summary": None},
            "store": req.store, "temperature": req.temperature, "text": {"format": fmt},
            "tool_choice": tool_choice, "tools": tools, "top_p": req.top_p,
            "truncation": req.truncation or "disabled", "usage": None, "user": req.user}


def usage(input_tokens: int, output_tokens: int, cached_tokens: int, reasoning_tokens: int) -> dict:
    """OpenAI's names, and SGLang's (`prompt_tokens`, `completion_tokens`) for clients written against it."""
    return {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": input_tokens + output_tokens,
            "prompt_tokens": input_tokens, "completion_tokens": output_tokens}


def outcome(finish_reason: str | None, incomplete_status: bool) -> tuple[str, dict | None]:
    """(status, incomplete_details) for how the generation ended.

    An output cut by max_output_tokens has `incomplete_details` either way; its status is SGLang's `completed`
    unless `incomplete_status` (the gateway's --responses-incomplete-status) asks for OpenAI's `incomplete`:
    the openai SDK's `responses.stream()` helper raises on a stream that ends without `response.completed`.
    """
    if finish_reason == "abort":
        return "cancelled", None
    if finish_reason in INCOMPLETE:
        return "incomplete" if incomplete_status else "completed", {"reason": INCOMPLETE[finish_reason]}
    return "completed", None


def finished(response: dict, status: str, output: list[dict], usage_: dict | None,
             incomplete: dict | None = None, error: dict | None = None) -> dict:
    done = {**response, "status": status, "output": output, "usage": usage_, "incomplete_details": incomplete,
            "error": error}
    if status in ("completed", "incomplete"):
        done["completed_at"] = int(time.time())
    return done


def error_of(message: str, code: str = "server_error") -> dict:
    return {"code": code, "message": message}


def tools_out(plan: ToolPlan) -> list[dict]:
    """The function tools as the response object lists them (flat, as given)."""
    return [{"type": "function", "name": f.name, "description": f.description, "parameters": f.parameters,
             "strict": f.strict if f.strict is not None else True} for f in plan.functions]
