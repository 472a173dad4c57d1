"""Anthropic's Messages API answers: the message object, its stream events, and errors in Anthropic's shape.

One `MessageWriter` per answer turns the output text, piece by piece or whole, into content blocks: the
reasoning parser's reasoning into a `thinking` block, the tool-call reader's calls into `tool_use` blocks (the
same `tool_calls.CallStream` chat uses), the rest into `text` blocks. Every change is also a stream event
(`content_block_start`/`_delta`/`_stop`), so the message a client puts together from the stream is the message
the same request gets whole.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from pdserve.services.gateway.intake.reasoning import ReasoningSplitter
from pdserve.services.gateway.intake.tool_calls import ToolPlan

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error",
               500: "api_error", 529: "overloaded_error"}
# The gateway's "no capacity now" (no worker up, shutting down) is Anthropic's overloaded status: clients retry it.
STATUS = {503: 529}


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def error_body(status: int, message: str, request_id: str | None = None) -> dict:
    body: dict = {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error" if status >= 500
                                                                      else "invalid_request_error"),
                                             "message": message}}
    if request_id:
        body["request_id"] = request_id
    return body


def usage(prompt_tokens: int, output_tokens: int, cached_tokens: int) -> dict:
    """Anthropic counts input in parts: `input_tokens` computed afresh, `cache_read_input_tokens` served from
    the prefix cache (their sum is the prompt, which count_tokens reports); the gateway creates no cache
    entries on request, so `cache_creation_input_tokens` is 0."""
    return {"input_tokens": prompt_tokens - cached_tokens, "output_tokens": output_tokens,
            "cache_read_input_tokens": cached_tokens, "cache_creation_input_tokens": 0}


def stop_reason(finish_reason: str | None, matched_stop: int | str | None, called: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished answer."""
    if finish_reason == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    if isinstance(matched_stop, str):
        return "stop_sequence", matched_stop
    return "end_turn", None


def message(mid: str, model: str, content: list[dict], reason: str | None, sequence: str | None,
            usage_: dict) -> dict:
    return {"id": mid, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": reason, "stop_sequence": sequence, "usage": usage_}


# ---------------------------------------------------------------- content blocks
@dataclass
class Blocks:
    """Content blocks in order, at most one open (receiving deltas); each call returns its stream events."""

    content: list[dict] = field(default_factory=list)
    arguments: dict[int, str] = field(default_factory=dict)  # tool_use block index -> its input's JSON so far
    calls: dict[int, int] = field(default_factory=dict)  # tool call index -> its block index
    open: int | None = None

    def text(self, kind: str, piece: str) -> list[dict]:
        """`kind` "text" or "thinking": a piece appended to the open block of that kind, or to a new one."""
        if not piece:
            return []
        events = []
        if self.open is None or self.content[self.open]["type"] != kind:
            events += self.close()
            block = {"type": "text", "text": ""} if kind == "text" else \
                {"type": "thinking", "thinking": "", "signature": ""}
            events += self._start(block)
        self.content[self.open][kind] += piece
        delta = {"type": "text_delta", "text": piece} if kind == "text" else {"type": "thinking_delta",
                                                                              "thinking": piece}
        return events + [{"type": "content_block_delta", "index": self.open, "delta": delta}]

    def call(self, delta: dict) -> list[dict]:
        """One tool-call delta of tool_calls.CallStream (OpenAI's shape): a new call opens a tool_use block."""
        events = []
        if "id" in delta:
            events += self.close()
            call_id = "toolu_" + delta["id"].removeprefix("call_")
            events += self._start({"type": "tool_use", "id": call_id, "name": delta["function"]["name"],
                                   "input": {}})
            self.calls[delta["index"]] = self.open
            self.arguments[self.open] = ""
        piece = delta.get("function", {}).get("arguments", "")
        index = self.calls.get(delta["index"])
        if piece and index is not None:
            self.arguments[index] += piece
            events.append({"type": "content_block_delta", "index": index,
                           "delta": {"type": "input_json_delta", "partial_json": piece}})
        return events

    def close(self) -> list[dict]:
        if self.open is None:
            return []
        index, self.open = self.open, None
        return [{"type": "content_block_stop", "index": index}]

    def _start(self, block: dict) -> list[dict]:
        self.content.append(block)
        self.open = len(self.content) - 1
        return [{"type": "content_block_start", "index": self.open, "content_block": dict(block)}]

    def final(self) -> list[dict]:
        """The blocks of the finished message: each tool_use with its input parsed."""
        out = []
        for i, block in enumerate(self.content):
            if block["type"] == "tool_use":
                block = {**block, "input": _parsed(self.arguments.get(i, ""))}
            out.append(block)
        return out


def _parsed(arguments: str) -> dict:
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return {}  # cut off by max_tokens: the stream's partial JSON is all there is
    return value if isinstance(value, dict) else {}


class MessageWriter:
    """One answer's output text -> content blocks and stream events (see the module docstring)."""

    def __init__(self, parser: str | None, tools: ToolPlan) -> None:
        self.splitter = ReasoningSplitter(parser) if parser else None
        self.calls = tools.stream()
        self.blocks = Blocks()

    @property
    def in_reasoning(self) -> bool:
        return self.splitter is not None and self.splitter.in_reasoning

    @property
    def called(self) -> bool:
        return bool(self.calls is not None and self.calls.calls)

    def push(self, text: str, final: bool) -> list[dict]:
        """The events of the next piece of output; `final`: the output is complete (every block is closed)."""
        reasoning, content = "", text
        if self.splitter is not None:
            split = self.splitter.push(text, final)
            reasoning, content = split.reasoning, split.content
        events = self.blocks.text("thinking", reasoning)
        if self.calls is None:
            events += self.blocks.text("text", content)
        else:
            new, deltas = self.calls.push(content, final)
            events += self.blocks.text("text", new)
            for delta in deltas:
                events += self.blocks.call(delta)
        if final:
            events += self.blocks.close()
        return events
