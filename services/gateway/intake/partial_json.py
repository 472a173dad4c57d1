"""Finding the parts of a JSON text that is still being generated.

Tool-call parsers read model output as it streams: they must know where an object's `"name"` value ends and
how much of its `"arguments"` value has arrived, long before the object is complete. These helpers locate
values by position (spans into the text) without decoding them, so an incomplete value can be forwarded as the
raw text received so far. Every function looks only at the text it is given and answers "incomplete" (None)
rather than guessing, so a later, longer text always gives an answer consistent with an earlier one.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

WHITESPACE = " \t\n\r"
_STRING_BODY = re.compile(r'[^"\\]*(?:\\.[^"\\]*)*', re.DOTALL)  # up to the closing quote, escapes skipped
_STRUCTURE = re.compile(r'["{}\[\]]')
_SCALAR = re.compile(r"[^,}\]\s]*")


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in WHITESPACE:
        i += 1
    return i


def string_end(text: str, i: int) -> int | None:
    """End (exclusive) of the JSON string opening at text[i] == '"'; None while the closing quote is missing."""
    m = _STRING_BODY.match(text, i + 1)
    j = m.end()
    return j + 1 if j < len(text) and text[j] == '"' else None


def value_end(text: str, i: int) -> int | None:
    """End (exclusive) of the JSON value starting at text[i]; None while it may still continue.

    Containers are matched by depth, skipping strings; a scalar (number, true, false, null) ends at the
    first delimiter, so one that reaches the end of the text is incomplete.
    """
    ch = text[i]
    if ch == '"':
        return string_end(text, i)
    if ch in "{[":
        depth, j = 0, i
        while True:
            m = _STRUCTURE.search(text, j)  # jump to the next character that matters
            if m is None:
                return None
            j, ch = m.start(), m.group()
            if ch == '"':
                end = string_end(text, j)
                if end is None:
                    return None
                j = end
                continue
            depth += 1 if ch in "{[" else -1
            j += 1
            if depth == 0:
                return j
    m = _SCALAR.match(text, i)
    return m.end() if m.end() < len(text) else None


@dataclass
class ObjectScan:
    """What is known of a JSON object whose text may be incomplete."""

    fields: dict[str, tuple[int, int | None]] = field(default_factory=dict)  # key -> value span, end None: open
    end: int | None = None  # after the closing brace; None while open
    valid: bool = True  # False once the text cannot be a JSON object any more

    def complete_value(self, text: str, key: str) -> object | None:
        """The decoded value of `key` once it is complete (None otherwise, or when it is not valid JSON)."""
        start, end = self.fields.get(key, (0, None))
        if end is None:
            return None
        try:
            return json.loads(text[start:end])
        except ValueError:
            return None


def scan_object(text: str, i: int) -> ObjectScan:
    """Scan the object opening at text[i] == '{' (top-level keys only; nested values are spans)."""
    scan = ObjectScan()
    j = skip_ws(text, i + 1)
    if j < len(text) and text[j] == "}":
        scan.end = j + 1
        return scan
    while j < len(text):
        if text[j] != '"':
            scan.valid = False
            return scan
        key_end = string_end(text, j)
        if key_end is None:
            return scan
        try:
            key = json.loads(text[j:key_end])
        except ValueError:
            scan.valid = False
            return scan
        j = skip_ws(text, key_end)
        if j >= len(text):
            return scan
        if text[j] != ":":
            scan.valid = False
            return scan
        j = skip_ws(text, j + 1)
        if j >= len(text):
            return scan
        end = value_end(text, j)
        scan.fields[key] = (j, end)
        if end is None:
            return scan
        j = skip_ws(text, end)
        if j >= len(text):
            return scan
        if text[j] == "}":
            scan.end = j + 1
            return scan
        if text[j] != ",":
            scan.valid = False
            return scan
        j = skip_ws(text, j + 1)
    return scan
