"""Reading tool calls out of model output, for each call format the served model families use.

A parser maps the output text so far to a `Scan`: the text outside the calls that is final, and the calls
found, each with its name once complete and as much of its JSON arguments as has arrived. Scans only grow:
for any text and any longer text that starts with it, the later scan's content and each call's arguments
start with the earlier scan's, and a call once named keeps its name. `tool_calls.CallStream` relies on this to
turn successive scans into OpenAI's incremental deltas, and gets the same calls whatever the chunking.

Markup never reaches the content: a tag that is still arriving is held back, and whitespace between text and
a call is dropped with the call. A block that turns out not to be a call (no name) is given back as content.
Names follow SGLang's --tool-call-parser.
"""
from __future__ import annotations

import ast
import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from pdserve.services.gateway.intake.partial_json import WHITESPACE, ObjectScan, scan_object, skip_ws


@dataclass
class Call:
    name: str | None  # None until the name is complete
    arguments: str = ""  # JSON text of the arguments, possibly incomplete


@dataclass
class Scan:
    content: str = ""
    calls: list[Call] = field(default_factory=list)


class ToolParser(ABC):
    """One call format. Subclasses are stateless: `scan` sees the whole output so far every time."""

    # The format's markers are special tokens, which the detokenizer must keep for the parser to see them.
    needs_special_tokens: bool = False

    @abstractmethod
    def scan(self, text: str, final: bool) -> Scan:
        """The calls in `text`; `final`: the output is complete, release anything held back."""


# ---------------------------------------------------------------- helpers
def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def plain_text(text: str, final: bool, tag: str | None = None, after_calls: bool = False) -> str:
    """The part of `text` (which holds no complete call marker) that is final content. A marker that may be
    arriving, and the whitespace before it (it goes with the call), are held back until the output ends; then
    trailing whitespace is dropped if calls came before it, so an answer of calls alone has no content."""
    if final:
        return text.rstrip(WHITESPACE) if after_calls else text
    keep = partial_suffix(text, tag) if tag else 0
    return text[:len(text) - keep].rstrip(WHITESPACE)


def call_arguments(text: str, obj: ObjectScan, keys: tuple[str, ...]) -> str:
    """The arguments of a call object as JSON text: the raw value as far as it has arrived when it is an object,
    a string's decoded content once complete (models sometimes encode the arguments twice)."""
    key = next((k for k in obj.fields if k in keys), None)  # the first in the text: later keys cannot change it
    if key is None:
        return "{}" if obj.end is not None or not obj.valid else ""
    start, end = obj.fields[key]
    if text[start] == "{":
        return text[start:end if end is not None else len(text)]
    value = obj.complete_value(text, key)
    if end is None:
        return ""
    if isinstance(value, str):
        return value
    return "{}" if value is None else json.dumps(value, ensure_ascii=False)


def object_call(text: str, obj: ObjectScan, keys: tuple[str, ...]) -> Call | None:
    """A call from a `{"name": ..., <keys[0]>: {...}}` object, kept once named even if the JSON then goes wrong;
    None once complete (or broken) without a name."""
    name = obj.complete_value(text, "name")
    if not isinstance(name, str) or not name:
        return Call(None) if obj.valid and obj.end is None else None
    return Call(name, call_arguments(text, obj, keys))


# ---------------------------------------------------------------- Hermes style (Qwen2.5, Qwen3)
class HermesParser(ToolParser):
    """`<tool_call>{"name": "f", "arguments": {...}}</tool_call>`, any number of them, text around them."""

    START, END = "<tool_call>", "</tool_call>"
    KEYS = ("arguments", "parameters")

    def scan(self, text: str, final: bool) -> Scan:
        out, pos = Scan(), 0
        while True:
            start = text.find(self.START, pos)
            if start < 0:
                out.content += plain_text(text[pos:], final, self.START, bool(out.calls))
                return out
            before = text[pos:start].rstrip(WHITESPACE)
            out.content += before
            body = start + len(self.START)
            j = skip_ws(text, body)
            if j < len(text) and text[j] == "{":
                obj = scan_object(text, j)
            else:
                obj = ObjectScan(valid=j >= len(text))  # a call must be an object; none has begun yet
            call = object_call(text, obj, self.KEYS)
            named = call is not None and call.name is not None
            if named:
                out.calls.append(call)
            # Inside the call's JSON a closing tag can only be part of a string: the block ends after the JSON.
            inside = obj.valid and obj.end is None and j < len(text)
            close = -1 if inside else text.find(self.END, obj.end if obj.valid and obj.end is not None else body)
            if close < 0 and not final:
                return out  # the block is still arriving
            block_end = len(text) if close < 0 else close + len(self.END)
            if not named:  # not a call after all: the model's own text, with the whitespace before it
                out.content += text[pos + len(before):block_end]
            pos = block_end


# ---------------------------------------------------------------- Llama 3 JSON
class Llama3Parser(ToolParser):
    """`{"name": "f", "parameters": {...}}`, optionally after `<|python_tag|>`, several joined by `;`."""

    TAG = "<|python_tag|>"
    KEYS = ("parameters", "arguments")
    needs_special_tokens = True

    def scan(self, text: str, final: bool) -> Scan:
        out = Scan()
        i = skip_ws(text, 0)
        if i >= len(text) or text[i] != "{":  # calls open the output, or follow the tag
            tag = text.find(self.TAG)
            if tag < 0:
                if i >= len(text) and not final:
                    return out  # nothing but whitespace yet
                out.content = plain_text(text, final, self.TAG)
                return out
            out.content = text[:tag].rstrip(WHITESPACE)
            i = tag + len(self.TAG)
        while True:
            i = skip_ws(text, i)
            while i < len(text) and text[i] == ";":
                i = skip_ws(text, i + 1)
            if i >= len(text):
                return out
            if text[i] != "{":
                break
            obj = scan_object(text, i)
            call = object_call(text, obj, self.KEYS)
            if call is None:
                break
            if call.name is not None:
                out.calls.append(call)
            if obj.end is None:
                return out
            i = obj.end
        out.content += plain_text(text[i:], final, after_calls=bool(out.calls))  # the model's own text
        return out


# ---------------------------------------------------------------- pythonic (Llama 3.2+, Llama 4)
_CALL_OPENING = re.compile(r"\[\s*[A-Za-z_][\w.]*\s*\(")
_OPENING_PREFIX = re.compile(r"\[\s*(?:[A-Za-z_][\w.]*\s*)?")


class PythonicParser(ToolParser):
    """`[get_weather(city="Paris"), f2(x=1)]`: keyword arguments with literal values, read by `ast`, never run."""

    def scan(self, text: str, final: bool) -> Scan:
        out, pos = Scan(), 0
        while True:
            start = self._list_start(text, pos, final)
            if start is None:
                out.content += plain_text(text[pos:], final, after_calls=bool(out.calls))
                return out
            if start < 0:  # a list may be opening at the end of the text
                out.content += plain_text(text[pos:-1 - start], False)
                return out
            before = text[pos:start].rstrip(WHITESPACE)
            out.content += before
            calls, end = _read_call_list(text, start)
            if end is None and not final:
                out.calls += calls
                return out
            end = len(text) if end is None else end
            if calls:
                out.calls += calls
            else:  # no call in it: the model's own text, with the whitespace before it
                out.content += text[pos + len(before):end]
            pos = end

    @staticmethod
    def _list_start(text: str, pos: int, final: bool) -> int | None:
        """Index of the next `[name(` from pos; None if there is none; -1 - index when one may be arriving."""
        k = text.find("[", pos)
        while k >= 0:
            if _CALL_OPENING.match(text, k):
                return k
            prefix = _OPENING_PREFIX.match(text, k)
            if not final and prefix is not None and prefix.end() == len(text):
                return -1 - k
            k = text.find("[", k + 1)
        return None


def _read_call_list(text: str, start: int) -> tuple[list[Call], int | None]:
    """The calls of the list opening at text[start] == '[', each once its element is complete, and the end of
    the list (None while it is open). Elements that are not calls with literal keyword arguments are skipped."""
    calls: list[Call] = []
    depth, element, j = 0, start + 1, start
    while j < len(text):
        ch = text[j]
        if ch in "'\"":
            j = _python_string_end(text, j)
            if j < 0:
                return calls, None
            continue
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                _add_call(calls, text[element:j])
                return calls, j + 1
        elif ch == "," and depth == 1:
            _add_call(calls, text[element:j])
            element = j + 1
        j += 1
    return calls, None


def _python_string_end(text: str, i: int) -> int:
    """End of the Python string literal opening at text[i]; -1 while it is open."""
    quote = text[i] * 3 if text.startswith(text[i] * 3, i) else text[i]
    j = i + len(quote)
    while j < len(text):
        if text[j] == "\\":
            j += 2
            continue
        if text.startswith(quote, j):
            return j + len(quote)
        j += 1
    return -1


def _add_call(calls: list[Call], source: str) -> None:
    source = source.strip()
    if not source:
        return
    try:
        node = ast.parse(source, mode="eval").body
        if not isinstance(node, ast.Call) or node.args or any(kw.arg is None for kw in node.keywords):
            return
        name = ast.unparse(node.func)
        if not re.fullmatch(r"[A-Za-z_][\w.]*", name):
            return
        # literal_eval accepts only literals (no names, calls or operators beyond signs): nothing is executed.
        arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
        calls.append(Call(name, json.dumps(arguments, ensure_ascii=False, allow_nan=False)))
    except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError):
        return


# ---------------------------------------------------------------- output shaped by a tool_choice grammar
class NamedCallOutput(ToolParser):
    """The output is the arguments object of one known function (tool_choice names it)."""

    def __init__(self, function: str) -> None:
        self.function = function

    def scan(self, text: str, final: bool) -> Scan:
        i = skip_ws(text, 0)
        if i >= len(text) or text[i] != "{":
            return Scan(content=text if final and i < len(text) else "")
        obj = scan_object(text, i)
        return Scan(calls=[Call(self.function, text[i:obj.end if obj.end is not None else len(text)])])


class RequiredCallsOutput(ToolParser):
    """The output is `[{"name": ..., "parameters": {...}}, ...]` (tool_choice "required")."""

    KEYS = ("parameters", "arguments")

    def scan(self, text: str, final: bool) -> Scan:
        out = Scan()
        i = skip_ws(text, 0)
        if i >= len(text) or text[i] != "[":
            out.content = text if final and i < len(text) else ""
            return out
        i = skip_ws(text, i + 1)
        while i < len(text) and text[i] == "{":
            obj = scan_object(text, i)
            call = object_call(text, obj, self.KEYS)
            if call is not None and call.name is not None:
                out.calls.append(call)
            if call is None or obj.end is None:
                break
            i = skip_ws(text, obj.end)
            if i < len(text) and text[i] == ",":
                i = skip_ws(text, i + 1)
        return out


PARSERS: dict[str, type[ToolParser]] = {
    "qwen25": HermesParser,
    "qwen": HermesParser,
    "llama3": Llama3Parser,
    "pythonic": PythonicParser,
}


def get_parser(name: str) -> ToolParser:
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of {', '.join(sorted(PARSERS))}")
    return PARSERS[name]()
