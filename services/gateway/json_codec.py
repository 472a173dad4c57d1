"""JSON in and out of the gateway: request bodies decoded, large answers encoded. Pure functions: the callers
choose where they run (inline, or on the gateway's CPU pool when large: `errors.parse_body`, `apis.context`).

Decoding is orjson's (several times faster than the standard library) wherever orjson reads a body as the
standard library does, and the standard library's everywhere else, so the gateway accepts exactly the JSON it
always accepted, with the same values:
- a body with a run of 19 digits or more goes to the standard library: orjson reads an integer beyond 64 bits
  as a float (a seed of 2**64 + 1 would be rounded, silently);
- a body orjson refuses goes to the standard library, which decides: it accepts NaN, Infinity, 1e400, lone
  UTF-16 surrogates, a byte order mark and UTF-16/32 bodies, and refuses the rest with the same message as before.
A lone surrogate can only come out of the second path (orjson refuses one), so only there is the value searched
for one. A large body on that path is decoded with a Python hook per object and number (strings stay C's): the event loop then gets
the interpreter back every switch interval, where a C decoder would hold it to the end; and every few thousand
values the hooks ask the CPU pool whether the job is past its deadline (a 32 MiB body of 20-digit integers takes
seconds there), which stops it.

Encoding: `encode` writes a large answer with orjson (a 4 MiB answer in ~15 ms, where json.dumps holds the
interpreter for ~110 ms). The values are the same as json.dumps would write; the bytes differ in whitespace and
escapes (UTF-8 as is), and a NaN or infinite float, which json.dumps writes as the non-JSON NaN/Infinity, is null.
"""
from __future__ import annotations

import itertools
import json
import re
from typing import NamedTuple

import orjson

from pdserve.services.gateway.cpu_pool import check_deadline

LARGE_BODY = 64 << 10  # bytes of a request body from which it is decoded on the gateway's CPU pool

# Every digit as "0", every other byte as a space: a run of 19 "0"s is a number orjson may read differently.
_DIGITS = bytes(0x30 if 0x30 <= b <= 0x39 else 0x20 for b in range(256))
_LONG_NUMBER = b"0" * 19
# A \uD800-\uDFFF escape, or a surrogate encoded in UTF-8 (which the standard library lets through): only a body
# with one can decode to a string holding a lone surrogate.
_MAYBE_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}|\xed[\xa0-\xbf]")
_SURROGATE = re.compile("[\ud800-\udfff]")
SLICE = 1 << 20  # bytes of a body scanned at once
NOT_JSON = "The request body is not valid JSON."
TOO_DEEP = "The request body is nested too deeply."


class Decoded(NamedTuple):
    value: object  # the body's JSON value; None when it is not JSON
    problem: str | None = None  # why it is not JSON
    surrogate_at: str | None = None  # the dotted path of a string (or key) holding a lone UTF-16 surrogate


def decode(raw: bytes, yielding: bool = False) -> Decoded:
    """The JSON value of a request body (an empty body is null). `yielding`: the standard library's path, where a
    body takes it, calls a Python function per object and number (for a large body decoded beside the loop)."""
    raw = raw or b"null"
    if not _has_long_number(raw):
        try:
            return Decoded(orjson.loads(raw))
        except orjson.JSONDecodeError:
            pass
    hooks = {"object_hook": _same, "parse_int": _int, "parse_float": _float} if yielding else {}
    try:
        value = json.loads(raw, **hooks)
    except (ValueError, UnicodeDecodeError):
        return Decoded(None, NOT_JSON)
    except RecursionError:
        return Decoded(None, TOO_DEEP)
    where = lone_surrogate(value) if _may_hold_surrogate(raw) else None
    return Decoded(value, None, where)


# The scans below go a slice at a time: a C scan holds the interpreter to its end (a 31 MiB body: 0.1 s to
# translate, 0.5 s to search), and between slices the event loop can have it.
def _has_long_number(raw: bytes) -> bool:
    return any(_LONG_NUMBER in raw[i:i + SLICE + len(_LONG_NUMBER) - 1].translate(_DIGITS)
               for i in range(0, len(raw), SLICE))


def _may_hold_surrogate(raw: bytes) -> bool:
    return any(_MAYBE_SURROGATE.search(raw, i, i + SLICE + 5) for i in range(0, len(raw), SLICE))


_TICKS = itertools.count()  # values decoded through the hooks, in every thread: each 4096th checks the deadline


def _same(value: dict) -> dict:
    if not next(_TICKS) & 0xFFF:
        check_deadline()
    return value


def _int(text: str) -> int:
    if not next(_TICKS) & 0xFFF:
        check_deadline()
    return int(text)


def _float(text: str) -> float:
    if not next(_TICKS) & 0xFFF:
        check_deadline()
    return float(text)


def lone_surrogate(value) -> str | None:
    """The dotted path of the first string (or key) in `value` holding a lone surrogate; None when none does."""
    stack = [("", value)]  # iterative: the body may be nested as deep as the JSON parser allows
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                return path
        elif isinstance(item, dict):
            for key, sub in item.items():
                sub_path = f"{path}.{key}" if path else str(key)
                if _SURROGATE.search(key):
                    return sub_path
                stack.append((sub_path, sub))
        elif isinstance(item, list):
            stack.extend((f"{path}.{i}" if path else str(i), sub) for i, sub in enumerate(item))
    return None


def encode(value: object) -> bytes:
    """A large answer as JSON (see the module's docstring for how it differs from json.dumps)."""
    return orjson.dumps(value)
