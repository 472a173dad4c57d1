"""What a /v1/responses request says, in the terms the chat path already speaks.

The request schema (its sampling fields generated through the dialect table, dialects.OPENAI_RESPONSES); its
input items checked and given ids (`input_items`: what a stored response keeps and `input_items` lists); the
conversation turned into chat messages for the template (`chat_messages`); function tools, tool_choice and
`text.format` turned into their Chat Completions shapes, so that tool_calls.plan_tools and the constraint code
serve both APIs. Anything this server does not do (web search, file search, computer use, images) is a 400
naming the field and the type.
"""
from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any, Literal

from pydantic import Field, create_model, field_validator

from pdserve.services.gateway.apis.responses.store import new_item_id
from pdserve.services.gateway.errors import ApiError, unsupported
from pdserve.services.gateway.intake.dialects import OPENAI_RESPONSES, sampling_fields
from pdserve.services.gateway.intake.protocol import (JsonSchemaFormat, ResponseFormat, StopField, RequestModel,
                                                      check_stop_count)
from pdserve.services.gateway.intake.tool_calls import ToolPlan, plan_tools

MAX_METADATA_KEYS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512  # OpenAI's limits
INPUT_ROLES = ("user", "system", "developer")
TEXT_PARTS = ("input_text", "output_text", "text")
MEDIA_PARTS = ("input_image", "input_file", "input_audio")
ITEM_PREFIXES = {"message": "msg_", "function_call": "fc_", "function_call_output": "fco_", "reasoning": "rs_"}


class TextFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(RequestModel):
    format: TextFormat | None = None
    verbosity: str | None = None


class ReasoningConfig(RequestModel):
    effort: str | None = None
    summary: str | None = None


_ResponsesSamplingFields = create_model("_ResponsesSamplingFields", __base__=RequestModel,
                                        **sampling_fields(OPENAI_RESPONSES))


class ResponsesRequest(_ResponsesSamplingFields):
    """POST /v1/responses: OpenAI's fields, SamplingParams' under their OpenAI names (generated, SGLang's
    extensions such as top_k and ignore_eos included), and what shapes the text."""

    model: str | None = None
    input: str | list[Any]
    instructions: str | None = None
    # Shapes are checked below and by tool_calls.plan_tools, which name the exact field at fault.
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    store: bool = True
    previous_response_id: str | None = None
    background: bool = False
    stream: bool = False
    truncation: Literal["auto", "disabled"] | None = None
    top_logprobs: int | None = None
    include: list[str] | None = None
    lora_path: str | None = None
    stop: StopField = None
    skip_special_tokens: bool = True
    no_stop_trim: bool = False

    _check_stop_count = field_validator("stop")(check_stop_count)

    @field_validator("metadata")
    @classmethod
    def _metadata_limits(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        if v and len(v) > MAX_METADATA_KEYS:
            raise ValueError(f"at most {MAX_METADATA_KEYS} keys are accepted, not {len(v)}")
        for key, value in (v or {}).items():
            if len(key) > MAX_METADATA_KEY or len(value) > MAX_METADATA_VALUE:
                raise ValueError(f"keys are at most {MAX_METADATA_KEY} characters and values at most "
                                 f"{MAX_METADATA_VALUE}")
        return v

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def response_format(self) -> ResponseFormat | None:
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return ResponseFormat(type="json_object")
        if fmt.schema_ is None:
            raise ApiError(400, "text.format of type 'json_schema' needs a 'schema'.", "text.format.schema")
        return ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(
            name=fmt.name, schema=fmt.schema_, strict=fmt.strict, description=fmt.description))


# ---------------------------------------------------------------- input items
def input_items(value: str | list[Any]) -> list[dict]:
    """The request's input as stored items, each with an id; a 400 naming the item for anything malformed."""
    if isinstance(value, str):
        return [{"type": "message", "id": new_item_id("msg_"), "role": "user", "status": "completed",
                 "content": [{"type": "input_text", "text": value}]}]
    if not value:
        raise ApiError(400, "'input' must not be an empty list.", "input")
    return [_item(item, f"input.{i}") for i, item in enumerate(value)]


def _item(item: Any, where: str) -> dict:
    if not isinstance(item, dict):
        raise ApiError(400, f"Invalid value for {where!r}: expected an object.", where)
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "message":
        return _message(item, where)
    if kind == "function_call":
        name, call_id, arguments = (_string(item, key, where) for key in ("name", "call_id", "arguments"))
        try:
            json.loads(arguments or "{}")
        except ValueError:
            raise ApiError(400, f"Invalid value for '{where}.arguments': not valid JSON.",
                           f"{where}.arguments") from None
        return {"type": kind, "id": _id(item, kind), "call_id": call_id, "name": name, "arguments": arguments,
                "status": "completed"}
    if kind == "function_call_output":
        output = item.get("output")
        if isinstance(output, list):
            output = _text_of(output, f"{where}.output")
        if not isinstance(output, str):
            raise ApiError(400, f"Invalid value for '{where}.output': expected a string or a list of input_text "
                                "parts.", f"{where}.output")
        return {"type": kind, "id": _id(item, kind), "call_id": _string(item, "call_id", where), "output": output,
                "status": "completed"}
    if kind == "reasoning":  # an earlier turn's reasoning: kept in the record, not shown to the template
        return {"type": kind, "id": _id(item, kind), "summary": item.get("summary") or [],
                **({"content": item["content"]} if isinstance(item.get("content"), list) else {})}
    if not isinstance(kind, str):
        raise ApiError(400, f"Invalid value for '{where}.type': expected an item type such as 'message'.",
                       f"{where}.type")
    raise ApiError(400, f"Input items of type {kind!r} are not supported: give 'message', 'function_call', "
                        "'function_call_output' or 'reasoning' items.", f"{where}.type")


def _message(item: dict, where: str) -> dict:
    role = item.get("role")
    if role not in (*INPUT_ROLES, "assistant"):
        raise ApiError(400, f"Invalid value for '{where}.role': expected 'user', 'assistant', 'system' or "
                            f"'developer', got {role!r}.", f"{where}.role")
    content = item.get("content")
    part_type = "output_text" if role == "assistant" else "input_text"
    if isinstance(content, str):
        parts = [{"type": part_type, "text": content}]
    elif isinstance(content, list):
        _text_of(content, f"{where}.content")  # checks every part
        parts = [{"type": p["type"], "text": p.get("text", p.get("refusal", ""))} for p in content]
    else:
        raise ApiError(400, f"Invalid value for '{where}.content': expected a string or a list of content "
                            "parts.", f"{where}.content")
    if role == "assistant":
        parts = [{**p, "annotations": []} if p["type"] == "output_text" else p for p in parts]
    return {"type": "message", "id": _id(item, "message"), "role": role, "status": "completed", "content": parts}


def _text_of(parts: list, where: str) -> str:
    texts = []
    for i, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in MEDIA_PARTS:
            raise unsupported(f"{where}.{i}.type", f"{kind} content (multimodal input)")
        if kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
            continue
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise ApiError(400, f"Invalid value for '{where}.{i}': expected a part of type 'input_text' or "
                                f"'output_text' with a 'text' string, got type {kind!r}.", f"{where}.{i}")
        texts.append(part["text"])
    return "".join(texts)


def _string(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise ApiError(400, f"Field '{where}.{key}' is required (a string).", f"{where}.{key}")
    return value


def _id(item: dict, kind: str) -> str:
    given = item.get("id")
    return given if isinstance(given, str) and 0 < len(given) <= 128 else new_item_id(ITEM_PREFIXES[kind])


def chat_messages(instructions: str | None, items: list[dict]) -> list[dict]:
    """The conversation as chat messages for the template: function calls join the assistant turn before
    them, their outputs become tool messages, reasoning items are left out (as chat templates drop them)."""
    out: list[dict] = [{"role": "system", "content": instructions}] if instructions else []
    for item in items:
        kind = item["type"]
        if kind == "message":
            role = "system" if item["role"] == "developer" else item["role"]
            out.append({"role": role, "content": "".join(p.get("text", "") for p in item["content"])})
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": json.loads(item["arguments"] or "{}")}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    return out


# ---------------------------------------------------------------- tools
def tool_plan(req: ResponsesRequest, parser: str | None) -> ToolPlan:
    """The tools of a Responses request as plan_tools plans a chat request's (their errors name the Responses
    fields): function tools are flat here ({type, name, parameters}), nested in chat ({type, function})."""
    tools = None
    if req.tools is not None:
        if not isinstance(req.tools, list):
            raise ApiError(400, "Invalid value for 'tools': expected a list of tools.", "tools")
        tools = [_chat_tool(tool, i) for i, tool in enumerate(req.tools)]
    shim = SimpleNamespace(tools=tools, tool_choice=_chat_choice(req.tool_choice), functions=None,
                           function_call=None, parallel_tool_calls=req.parallel_tool_calls)
    try:
        return plan_tools(shim, parser)
    except ApiError as exc:
        exc.message = exc.message.replace(".function.", ".").replace(".function'", "'")
        exc.param = exc.param.replace(".function", "") if exc.param else exc.param
        raise


def _chat_tool(tool: Any, i: int) -> dict:
    if not isinstance(tool, dict):
        raise ApiError(400, f"Invalid value for 'tools.{i}': expected an object.", f"tools.{i}")
    kind = tool.get("type")
    if kind != "function":
        raise ApiError(400, f"Tools of type {kind!r} are not supported: only 'function' tools are "
                            f"(field 'tools.{i}.type').", f"tools.{i}.type")
    return {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}


def _chat_choice(choice: Any) -> Any:
    if choice is None or choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    kind = choice.get("type") if isinstance(choice, dict) else None
    if isinstance(kind, str) and kind != "function":
        raise ApiError(400, f"tool_choice of type {kind!r} is not supported: give 'none', 'auto', 'required' or "
                            '{"type": "function", "name": ...}.', "tool_choice.type")
    raise ApiError(400, "Invalid value for 'tool_choice': expected 'none', 'auto', 'required' or "
                        '{"type": "function", "name": ...}.', "tool_choice")


def tool_choice_out(plan: ToolPlan, given: Any) -> Any:
    """tool_choice as the response object shows it."""
    if plan.choice == "function":
        return {"type": "function", "name": plan.function}
    return given if isinstance(given, str) else "auto"
