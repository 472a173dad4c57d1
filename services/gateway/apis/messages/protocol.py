"""Anthropic's Messages API request: its schema (pydantic) and its mapping onto the chat template and tools.

A Messages request becomes what a chat request becomes: `template_messages` turns `system` and the content
blocks into chat-template messages (an assistant's `tool_use` blocks are its tool calls, a user's `tool_result`
blocks are tool messages before the user's text, `thinking` blocks its reasoning), and `plan_tools` turns
`tools`/`tool_choice` into a `tool_calls.ToolPlan` (`any` is chat's `required`, `tool` a named function), so the
same grammar, reader and streaming code serve both APIs. Content blocks are read one by one, so a bad block is
a 400 naming its exact field (`messages.2.content.0.tool_use_id`).
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, create_model, field_validator

from pdserve.services.gateway.errors import ApiError, unsupported
from pdserve.services.gateway.intake.dialects import ANTHROPIC_MESSAGES, sampling_fields
from pdserve.services.gateway.intake.protocol import parse
from pdserve.services.gateway.intake.tool_calls import NAME_PATTERN, FunctionDef, ToolPlan
from pdserve.services.gateway.intake.tool_parsers import get_parser

# Each is matched against every piece of generated text (chat's bound on its stop strings).
MAX_STOP_SEQUENCES = 64
# Block types of other Anthropic features, refused by name rather than read as something else.
MEDIA_BLOCKS = {"image": "image input", "document": "document input", "search_result": "search results",
                "container_upload": "container uploads", "server_tool_use": "server tools",
                "web_search_tool_result": "server tools"}


class _Schema(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


class TextBlock(_Schema):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Schema):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Schema):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[dict[str, Any]] = ""
    is_error: bool = False


class ThinkingBlock(_Schema):
    type: Literal["thinking"]
    thinking: str
    signature: str = ""


class ToolParam(_Schema):
    type: Literal["custom"] | None = None
    name: str
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoice(_Schema):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class Thinking(_Schema):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=1)


class Metadata(_Schema):
    user_id: str | None = None


_BLOCK_SCHEMAS = [m.model_json_schema() for m in (TextBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock)]
# Blocks are read one by one (see the module docstring); the API document shows what they hold.
ContentField = Annotated[str | list[dict[str, Any]], WithJsonSchema(
    {"anyOf": [{"type": "string"}, {"type": "array", "items": {"anyOf": _BLOCK_SCHEMAS}}]})]
SystemField = Annotated[str | list[dict[str, Any]] | None, WithJsonSchema(
    {"anyOf": [{"type": "string"}, {"type": "array", "items": TextBlock.model_json_schema()}, {"type": "null"}]})]


class InputMessage(_Schema):
    role: Literal["user", "assistant"]
    content: ContentField


class _PromptFields(_Schema):
    """What shapes the prompt: shared by /v1/messages and /v1/messages/count_tokens."""

    model: str
    messages: list[InputMessage] = Field(min_length=1)
    system: SystemField = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None


class CountTokensRequest(_PromptFields):
    pass


_MessagesSamplingFields = create_model("_MessagesSamplingFields", __base__=_PromptFields,
                                       **sampling_fields(ANTHROPIC_MESSAGES))


class MessagesRequest(_MessagesSamplingFields):
    """Anthropic's fields, and SamplingParams' others under their own names (generated) as extensions."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = Field(None, max_length=MAX_STOP_SEQUENCES)
    stream: bool = False
    metadata: Metadata | None = None
    # Read by intake.job like chat's text options; Anthropic has no such fields.
    skip_special_tokens: bool = True
    no_stop_trim: bool = False

    @field_validator("stop_sequences")
    @classmethod
    def _no_empty_stop(cls, v: list[str] | None) -> list[str] | None:
        if v and any(s == "" for s in v):
            raise ValueError("stop sequences must not be empty")
        return v

    def stop_list(self) -> list[str]:
        return list(self.stop_sequences or [])


# ---------------------------------------------------------------- messages -> chat template
def template_messages(req: _PromptFields) -> list[dict]:
    """The chat-template messages of a request: the system prompt, then each message's blocks mapped."""
    out: list[dict] = []
    system = _system_text(req.system)
    if system:
        out.append({"role": "system", "content": system})
    names: dict[str, str] = {}  # tool_use id -> tool name, for the tool messages that answer it
    for i, msg in enumerate(req.messages):
        where = f"messages.{i}"
        if isinstance(msg.content, str):
            out.append({"role": msg.role, "content": msg.content})
            continue
        texts, calls, reasoning, results = [], [], [], []
        for j, raw in enumerate(msg.content):
            at = f"{where}.content.{j}"
            kind = raw.get("type") if isinstance(raw, dict) else None
            if kind == "text":
                texts.append(parse(TextBlock, raw, at).text)
            elif kind == "tool_use" and msg.role == "assistant":
                block = parse(ToolUseBlock, raw, at)
                names[block.id] = block.name
                calls.append({"id": block.id, "type": "function",
                              "function": {"name": block.name, "arguments": block.input}})
            elif kind == "tool_result" and msg.role == "user":
                block = parse(ToolResultBlock, raw, at)
                result = {"role": "tool", "tool_call_id": block.tool_use_id,
                          "content": _result_text(block.content, f"{at}.content")}
                if block.tool_use_id in names:
                    result["name"] = names[block.tool_use_id]
                results.append(result)
            elif kind == "thinking" and msg.role == "assistant":
                reasoning.append(parse(ThinkingBlock, raw, at).thinking)
            elif kind == "redacted_thinking" and msg.role == "assistant":
                continue  # encrypted by Anthropic: nothing a local model can read
            elif isinstance(kind, str) and kind in MEDIA_BLOCKS:
                raise unsupported(f"{at}.type", MEDIA_BLOCKS[kind])
            else:
                allowed = "'text', 'tool_use', 'thinking'" if msg.role == "assistant" else "'text', 'tool_result'"
                raise ApiError(400, f"Invalid value for '{at}.type': a {msg.role} message holds {allowed} "
                                    f"blocks, got {kind!r}.", f"{at}.type")
        out += results
        if msg.role == "user" and (texts or not results):
            out.append({"role": "user", "content": "\n".join(texts)})
        elif msg.role == "assistant":
            reply: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
            if calls:
                reply["tool_calls"] = calls
            if reasoning:
                reply["reasoning_content"] = "\n".join(reasoning)
            out.append(reply)
    return out


def continues_last(req: _PromptFields) -> bool:
    """A final assistant message of text is a prefill: the answer continues it (Anthropic's behaviour)."""
    last = req.messages[-1]
    if last.role != "assistant":
        return False
    return isinstance(last.content, str) or all(isinstance(b, dict) and b.get("type") == "text" for b in last.content)


def _system_text(system: str | list[dict] | None) -> str:
    if system is None or isinstance(system, str):
        return system or ""
    return "\n".join(parse(TextBlock, block if isinstance(block, dict) else {}, f"system.{k}").text
                     for k, block in enumerate(system))


def _result_text(content: str | list[dict], where: str) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for k, raw in enumerate(content):
        kind = raw.get("type") if isinstance(raw, dict) else None
        if isinstance(kind, str) and kind in MEDIA_BLOCKS:
            raise unsupported(f"{where}.{k}.type", MEDIA_BLOCKS[kind])
        if kind != "text":
            raise ApiError(400, f"Invalid value for '{where}.{k}.type': a tool result holds 'text' blocks, got "
                                f"{kind!r}.", f"{where}.{k}.type")
        texts.append(parse(TextBlock, raw, f"{where}.{k}").text)
    return "\n".join(texts)


# ---------------------------------------------------------------- tools
def plan_tools(req: _PromptFields, parser_name: str | None) -> ToolPlan:
    """The ToolPlan of `tools` and `tool_choice`; a 400 naming the field for anything malformed."""
    functions = _functions(req.tools or [])
    choice = req.tool_choice or ToolChoice(type="auto")
    if choice.type in ("any", "tool") and not functions:
        raise ApiError(400, f"Invalid value for 'tool_choice': tool_choice {choice.type!r} needs 'tools'.",
                       "tool_choice")
    names = [f.name for f in functions]
    if choice.type == "tool" and choice.name not in names:
        raise ApiError(400, f"Invalid value for 'tool_choice.name': {choice.name!r} is not among the given tools "
                            f"({', '.join(names)}).", "tool_choice.name")
    kind = {"auto": "auto" if functions else "none", "any": "required", "tool": "function", "none": "none"}
    plan = kind[choice.type]
    return ToolPlan(tuple(functions), plan, choice.name if plan == "function" else None,
                    not choice.disable_parallel_tool_use,
                    get_parser(parser_name) if parser_name and plan == "auto" else None)


def _functions(tools: list[ToolParam]) -> list[FunctionDef]:
    seen: set[str] = set()
    out = []
    for i, tool in enumerate(tools):
        where = f"tools.{i}"
        if not NAME_PATTERN.fullmatch(tool.name):
            raise ApiError(400, f"Invalid value for '{where}.name': tool names are 1 to 64 letters, digits, '_', "
                                f"'.' or '-', got {tool.name!r}.", f"{where}.name")
        if tool.name in seen:
            raise ApiError(400, f"Invalid value for '{where}.name': the tool name {tool.name!r} is given twice.",
                           f"{where}.name")
        seen.add(tool.name)
        kind = tool.input_schema.get("type", "object")
        if kind != "object":
            raise ApiError(400, f"Invalid value for '{where}.input_schema': the input schema must be a JSON "
                                f"schema of type 'object', got type {kind!r}.", f"{where}.input_schema")
        out.append(FunctionDef(name=tool.name, description=tool.description, parameters=tool.input_schema))
    return out


MessagesRequest.model_rebuild()
