"""The sampling parameters reference, from their one definition (shared/sampling_params.py) and the APIs' tables.

Each SamplingParams field is a row: its default and range as `param(...)` declares them, its docstring, and the
name each API gives it (services/gateway/intake/dialects.py), so a parameter added there is on the site at the
next build under every API's name. The log-probability fields, which each API asks for in its own way beside its
sampling fields, and the fields the gateway derives itself are left to the API pages.
"""
from __future__ import annotations

import ast
import dataclasses
import inspect
import json

from mdtable import code, table, text

from pdserve.services.gateway.intake import dialects
from pdserve.shared import sampling_params
from pdserve.shared.sampling_params import SamplingParams, spec_of

COLUMNS = [("chat, completions", dialects.OPENAI_CHAT), ("Responses", dialects.OPENAI_RESPONSES),
           ("Messages", dialects.ANTHROPIC_MESSAGES), ("`/generate`", dialects.NATIVE)]
LENGTH = "max_new_tokens"  # every API carries the length, each beside its sampling fields and under its own name


def docstrings() -> dict[str, str]:
    """Field -> the docstring written under it in the SamplingParams class body."""
    tree = ast.parse(inspect.getsource(sampling_params))
    body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "SamplingParams").body
    out = {}
    for node, after in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
            out[node.target.id] = after.value.value
    return out


def value_range(field: dataclasses.Field) -> str:
    spec = spec_of(field)
    if spec.lo_text:
        return text(spec.lo_text)
    if spec.lo is None and spec.hi is None:
        return ""
    lo = "" if spec.lo is None else f"{'(' if spec.lo_open else '['}{_number(spec.lo)}"
    hi = "" if spec.hi is None else f"{_number(spec.hi)}]"
    shown = f"{lo}, {hi}" if lo and hi else f"{'>' if spec.lo_open else '>='} {_number(spec.lo)}" if lo \
        else f"<= {_number(spec.hi)}"
    unit = " characters" if "str" in str(field.type) else ""  # a text's range bounds its length
    return text(shown + unit)


def _number(value: float) -> str:
    return {-(2**63): "-2^63", 2**63 - 1: "2^63 - 1"}.get(value, f"{value:g}")


def api_name(dialect: dialects.Dialect, field: dataclasses.Field) -> str:
    carried = {f.name for f in dialect.carried()}
    if field.name in carried or field.name == LENGTH:
        return code(dialect.api_name(field.name))
    if dialect is dialects.NATIVE and field.name not in dialects.LOGPROB_FIELDS:
        return code(field.name) + " (beside `text`)"
    return "—"


def page() -> str:
    docs = docstrings()
    skipped = dialects.GATEWAY_DERIVED | dialects.LOGPROB_FIELDS
    rows = []
    for field in dataclasses.fields(SamplingParams):
        if field.name in skipped:
            continue
        default = "" if field.default in (None, ()) else code(json.dumps(field.default))
        rows.append([f'<span id="{field.name}"></span>{code(field.name)}', default, value_range(field),
                     *(api_name(dialect, field) for _, dialect in COLUMNS), text(docs.get(field.name, ""))])
    return ("# Sampling parameters\n\n"
            "Every sampling parameter, from its one definition in `shared/sampling_params.py` (default, range, "
            "meaning) and the name each API gives it, read when this site is built. A value outside its range is "
            "a 400 naming the field, whichever API it came through; the openai SDK sends the fields OpenAI does "
            "not define in `extra_body`. Stop strings (`stop`, `stop_sequences` on Messages) and SGLang's "
            "`stop_regex` are matched by the gateway on the output text, beside these; log-probabilities are asked "
            "for on each API in its own way: see the [API pages](../apis/index.md).\n\n"
            + table(["parameter", "default", "range", *(title for title, _ in COLUMNS), "meaning"], rows))
