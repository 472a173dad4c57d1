"""Tool calling on the chat API: what a request's tools and tool_choice ask for, and the calls in its answer.

Lifecycle of one request: `plan_tools` checks `tools` and `tool_choice` (the deprecated `functions` and
`function_call` are mapped onto them) and decides three things: which tools the chat template is shown, which
grammar constrains the output, and how the output is read. Then one `CallStream` per choice turns the output
text into content and tool calls, as OpenAI deltas while streaming or whole at the end; both go through the
same stream, so a streamed answer carries exactly the calls of the same answer not streamed.

As in SGLang: `none` hides the tools from the template and reads no calls; `auto` reads calls with the
gateway's --tool-call-parser (without one, the output stays plain content); a named function shows the
template that tool alone. `required` and a named function are enforced with a JSON schema: the model can only
write `[{"name": ..., "parameters": {...}}, ...]` or the named function's arguments object, which are read
directly, so they work with any model and need no parser.
"""
from __future__ import annotations

import copy
import functools
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError
from pydantic import BaseModel, ConfigDict

from pdserve.services.gateway.errors import ApiError
from pdserve.services.gateway.intake.protocol import parse
from pdserve.services.gateway.intake.tool_parsers import NamedCallOutput, RequiredCallsOutput, ToolParser, get_parser
from pdserve.shared.sampling_params import CONSTRAINT_FIELDS

NAME_PATTERN = re.compile(r"[A-Za-z0-9_.-]{1,64}")
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"] = "function"
    function: FunctionDef


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tool fields ask for."""

    functions: tuple[FunctionDef, ...] = ()
    choice: Literal["none", "auto", "required", "function"] = "none"
    function: str | None = None  # the function a named tool_choice calls
    parallel: bool = True
    parser: ToolParser | None = None  # reads calls out of free text (tool_choice auto)

    @property
    def template_tools(self) -> list[dict] | None:
        """The tools as the chat template receives them (OpenAI's shape, as transformers documents it)."""
        if self.choice == "none" or not self.functions:
            return None
        return [{"type": "function", "function": f.model_dump(exclude_none=True)} for f in self.functions
                if self.function is None or f.name == self.function]

    @property
    def reader(self) -> ToolParser | None:
        if self.choice == "required":
            return RequiredCallsOutput()
        if self.choice == "function":
            return NamedCallOutput(self.function or "")
        return self.parser if self.choice == "auto" else None

    @property
    def needs_special_tokens(self) -> bool:
        reader = self.reader
        return reader is not None and reader.needs_special_tokens

    def json_schema(self) -> str | None:
        """The grammar that enforces tool_choice required or a named function (a JSON schema, as text)."""
        if self.choice == "function":
            fn = next(f for f in self.functions if f.name == self.function)
            return json.dumps(fn.parameters or NO_PARAMETERS)
        if self.choice != "required":
            return None
        one = len(self.functions) == 1
        options, defs = [], _Definitions()
        for i, f in enumerate(self.functions):
            at = "#/items/properties/parameters" if one else f"#/items/anyOf/{i}/properties/parameters"
            options.append({"type": "object",
                            "properties": {"name": {"type": "string", "enum": [f.name]},
                                           "parameters": defs.hoist(f.name, f.parameters or NO_PARAMETERS, at)},
                            "required": ["name", "parameters"], "additionalProperties": False})
        schema: dict[str, Any] = {"type": "array", "items": options[0] if one else {"anyOf": options},
                                  "minItems": 1, **defs.root()}
        if not self.parallel:
            schema["maxItems"] = 1
        return json.dumps(schema)

    def constrain(self, values: dict, names: dict[str, str]) -> tuple[dict, dict[str, str]]:
        """SamplingParams values (and the API names of their fields) with the grammar of tool_choice required or
        a named function added; such a tool_choice cannot be combined with another constraint."""
        schema = self.json_schema()
        if schema is None:
            return values, names
        other = next((names.get(k, k) for k in CONSTRAINT_FIELDS if values.get(k) is not None), None)
        if other is not None:
            raise ApiError(400, f"tool_choice {self.choice if self.choice == 'required' else 'naming a function'} "
                                f"is enforced with a grammar and cannot be combined with {other!r}.", "tool_choice")
        return {**values, "json_schema": schema}, {**names, "json_schema": "tools"}

    def stream(self) -> CallStream | None:
        """A reader of one choice's output; None when the output is plain content."""
        reader = self.reader
        if reader is None:
            return None
        return CallStream(reader, None if self.parallel else 1)


DEFS_KEYS = ("$defs", "definitions")  # where a JSON schema keeps named subschemas (draft 2019-09 on; before)


class _Definitions:
    """The named subschemas of the tools' parameters, moved to the root of tool_choice required's schema.

    Each tool's parameters sit inside that schema, where their `#/$defs/...` would point at the root: so their
    definitions go to the root's, and their other local references (`#`, `#/properties/...`) are made to point
    where the parameters now are. One name given two different schemas by two tools cannot be both: a 400.
    """

    def __init__(self) -> None:
        self.named: dict[str, dict[str, tuple[str, Any]]] = {key: {} for key in DEFS_KEYS}  # -> (tool, schema)

    def hoist(self, tool: str, parameters: dict, at: str) -> dict:
        """`parameters` as they read at `at` (a JSON pointer), without their definitions."""
        moved = _relocated(parameters, at)
        for key in DEFS_KEYS:
            if not isinstance(moved.get(key), dict):
                continue
            for name, sub in moved.pop(key).items():
                owner, known = self.named[key].setdefault(name, (tool, sub))
                if known != sub:
                    # SGLang's sentence first: a client may match on it
                    raise ApiError(400, f"Tool definition '{name}' has multiple schemas, which is not supported: "
                                        f"tool_choice 'required' joins the tools' parameters into one schema, and "
                                        f"tools {owner!r} and {tool!r} both define '{key}/{name}' differently; rename "
                                        f"one of them.", "tools")
        return moved

    def root(self) -> dict:
        return {key: {name: sub for name, (_, sub) in named.items()} for key, named in self.named.items() if named}


def _relocated(node: Any, at: str) -> Any:
    """A copy of `node` whose local references, other than to definitions, point below `at`."""
    if isinstance(node, list):
        return [_relocated(item, at) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: _relocated(value, at) for key, value in node.items()}
    ref = node.get("$ref")
    if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")) \
            and not ref.startswith(tuple(f"#/{key}/" for key in DEFS_KEYS)):
        out["$ref"] = at + ref[1:]
    return out


# ---------------------------------------------------------------- request checks
def plan_tools(req: Any, parser_name: str | None) -> ToolPlan:
    """The plan for a ChatCompletionRequest; a 400 naming the field for anything malformed."""
    functions, tools_field = _functions(req)
    choice, function, choice_field = _choice(req, functions)
    # SGLang's words for these three, which its clients match on
    if choice in ("required", "function") and not functions:
        which = "required" if choice == "required" else "a specific tool"
        raise ApiError(400, f"Tools cannot be empty if tool choice is set to {which}.", choice_field)
    if function is not None and function not in {f.name for f in functions}:
        raise ApiError(400, f"Tool '{function}' not found in tools list.", choice_field)
    return ToolPlan(tuple(functions), choice, function, req.parallel_tool_calls is not False,
                    get_parser(parser_name) if parser_name and choice == "auto" else None)


def _functions(req: Any) -> tuple[list[FunctionDef], str]:
    if req.functions:
        if req.tools:
            raise ApiError(400, "Give 'tools' or the deprecated 'functions', not both.", "functions")
        if not isinstance(req.functions, list):
            raise ApiError(400, "Invalid value for 'functions': expected a list of functions.", "functions")
        items = [(parse(FunctionDef, f if isinstance(f, dict) else {}, f"functions.{i}"), f"functions.{i}")
                 for i, f in enumerate(req.functions)]
        return _checked(items), "functions"
    if not req.tools:
        return [], "tools"
    if not isinstance(req.tools, list):
        raise ApiError(400, "Invalid value for 'tools': expected a list of tools.", "tools")
    items = []
    for i, tool in enumerate(req.tools):
        if not isinstance(tool, dict):
            raise ApiError(400, f"Invalid value for 'tools.{i}': expected an object.", f"tools.{i}")
        if tool.get("type", "function") != "function":
            raise ApiError(400, f"Invalid value for 'tools.{i}.type': only 'function' tools are supported, "
                                f"got {tool.get('type')!r}.", f"tools.{i}.type")
        items.append((parse(ToolDef, tool, f"tools.{i}").function, f"tools.{i}.function"))
    return _checked(items), "tools"


def _checked(items: list[tuple[FunctionDef, str]]) -> list[FunctionDef]:
    seen: set[str] = set()
    for i, (fn, where) in enumerate(items):
        if not NAME_PATTERN.fullmatch(fn.name):
            raise ApiError(400, f"Invalid value for '{where}.name': function names are 1 to 64 letters, digits, "
                                f"'_', '.' or '-', got {fn.name!r}.", f"{where}.name")
        if fn.name in seen:
            raise ApiError(400, f"Invalid value for '{where}.name': the function name {fn.name!r} is given "
                                "twice.", f"{where}.name")
        seen.add(fn.name)
        kind = (fn.parameters or {}).get("type", "object")
        if kind != "object":
            raise ApiError(400, f"Invalid value for '{where}.parameters': the parameters must be a JSON schema "
                                f"of type 'object', got type {kind!r}.", f"{where}.parameters")
        # Every tool, whatever tool_choice says, as SGLang checks them (and in its words, which clients match on).
        problem = _schema_problem(json.dumps(fn.parameters, sort_keys=True)) if fn.parameters else None
        if problem is not None:
            raise ApiError(400, f"Tool {i} function has invalid 'parameters' schema: {problem}",
                           f"{where}.parameters")
    return [fn for fn, _ in items]


@functools.lru_cache(maxsize=256)
def _schema_problem(schema: str) -> str | None:
    """Why a JSON schema is not one under draft 2020-12's metaschema, or None; cached because clients send the
    same tools with every request."""
    try:
        Draft202012Validator.check_schema(json.loads(schema))
    except SchemaError as exc:
        return exc.message
    return None


def _choice(req: Any, functions: list[FunctionDef]) -> tuple[str, str | None, str]:
    """(none | auto | required | function, the named function, the field it came from)."""
    if req.function_call is not None:
        if req.tool_choice is not None:
            raise ApiError(400, "Give 'tool_choice' or the deprecated 'function_call', not both.", "function_call")
        value, where = req.function_call, "function_call"
        if isinstance(value, dict) and isinstance(value.get("name"), str):
            return "function", value["name"], where
        if value not in ("none", "auto"):
            raise ApiError(400, "Invalid value for 'function_call': expected 'none', 'auto' or "
                                '{"name": ...}.', where)
        return ("auto" if value == "auto" and functions else "none"), None, where
    value, where = req.tool_choice, "tool_choice"
    if value is None or value == "auto":
        return ("auto" if functions else "none"), None, where  # auto without tools: nothing to call
    if value in ("none", "required"):
        return value, None, where
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("function"), dict) \
            and isinstance(value["function"].get("name"), str):
        return "function", value["function"]["name"], where
    raise ApiError(400, "Invalid value for 'tool_choice': expected 'none', 'auto', 'required' or "
                        '{"type": "function", "function": {"name": ...}}.', where)


def template_messages(messages: list[dict]) -> list[dict]:
    """Messages for the chat template: the arguments of earlier tool calls as objects, not JSON text, because
    templates (Qwen, Llama) write them with `tojson`; a string there would be encoded twice."""
    out = []
    for i, msg in enumerate(messages):
        calls = msg.get("tool_calls")
        if not calls:
            out.append(msg)
            continue
        msg = {**msg, "tool_calls": copy.deepcopy(calls)}
        for j, call in enumerate(msg["tool_calls"]):
            fn = call.get("function") if isinstance(call, dict) else None
            where = f"messages.{i}.tool_calls.{j}"
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise ApiError(400, f"Invalid value for '{where}': a tool call needs a function with a name.",
                               f"{where}.function")
            if isinstance(fn.get("arguments"), str):
                try:
                    fn["arguments"] = json.loads(fn["arguments"] or "{}")
                except ValueError:
                    raise ApiError(400, f"Invalid value for '{where}.function.arguments': not valid JSON.",
                                   f"{where}.function.arguments") from None
        out.append(msg)
    return out


# ---------------------------------------------------------------- reading the output
@dataclass
class _SentCall:
    id: str
    name: str
    arguments: str = ""


@dataclass
class CallStream:
    """One choice's output read as content and tool calls; everything handed out is final."""

    reader: ToolParser
    max_calls: int | None = None  # 1 when parallel_tool_calls is false: later calls are dropped
    text: str = ""
    content: str = ""
    calls: list[_SentCall] = field(default_factory=list)

    def push(self, piece: str, final: bool = False) -> tuple[str, list[dict]]:
        """New content and tool-call deltas (OpenAI's `delta.tool_calls` entries) for the next piece of text."""
        self.text += piece
        if not piece and not final:
            return "", []
        scan = self.reader.scan(self.text, final)
        new_content = ""
        if len(scan.content) > len(self.content) and scan.content.startswith(self.content):
            new_content, self.content = scan.content[len(self.content):], scan.content
        deltas = []
        named = [c for c in scan.calls if c.name is not None][:self.max_calls]
        for index, call in enumerate(named):
            entry: dict[str, Any] = {"index": index}
            if index == len(self.calls):
                self.calls.append(_SentCall(f"call_{uuid.uuid4().hex[:24]}", call.name or ""))
                entry.update(id=self.calls[index].id, type="function", function={"name": call.name, "arguments": ""})
            sent = self.calls[index]
            if len(call.arguments) > len(sent.arguments) and call.arguments.startswith(sent.arguments):
                entry.setdefault("function", {})["arguments"] = call.arguments[len(sent.arguments):]
                sent.arguments = call.arguments
            if "function" in entry:
                deltas.append(entry)
        return new_content, deltas

    def push_delta(self, delta: dict, final: bool) -> dict:
        """A chat delta with its `content` read for tool calls (reasoning passes through untouched)."""
        content, calls = self.push(delta.pop("content", ""), final)
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
        return delta

    def finish_reason(self, reason: str | None, matched_stop: int | str | None) -> tuple[str | None, Any]:
        """OpenAI's "tool_calls" for an output that ended normally with calls in it."""
        if reason == "stop" and self.calls:
            return "tool_calls", None
        return reason, matched_stop

    def message_calls(self) -> list[dict] | None:
        if not self.calls:
            return None
        return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in self.calls]

    def message_content(self) -> str | None:
        return self.content or (None if self.calls else self.content)
