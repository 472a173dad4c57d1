"""The error reference, from the gateway's and the jobs service's error types.

The statuses and their `type` come from the tables the services answer with (`ERROR_TYPES` of the gateway's
`api_error.py` and of the Messages API's `format.py`); which statuses each service can answer, and the jobs
service's `code`s, from its source: every `ApiError(STATUS, ...)` or `Busy(STATUS, ...)` the services raise
(and the jobs service's helpers that build one), read with `ast`.
"""
from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

from mdtable import code, table

REPO = Path(__file__).resolve().parents[2]
JOBS_HELPERS = {"bad_request": 400, "conflict": 409}  # services/jobs/errors.py: helper -> its status


def raised(folder: str) -> dict[int, set[str]]:
    """Status -> the modules under `folder` raising an ApiError or Busy of that status."""
    found: dict[int, set[str]] = defaultdict(set)
    for path, node in _calls(folder):
        if _callee(node) in ("ApiError", "Busy") and node.args and isinstance(node.args[0], ast.Constant):
            found[node.args[0].value].add(str(path.relative_to(REPO / folder)))
    return found


def jobs_codes() -> dict[tuple[int, str], str]:
    """(status, code) -> type, for every error code the jobs service answers with."""
    found: dict[tuple[int, str], str] = {}
    for _, node in _calls("services/jobs"):
        callee = _callee(node)
        kw = {k.arg: k.value for k in node.keywords}
        if callee == "ApiError" and node.args and isinstance(node.args[0], ast.Constant):
            status, position = node.args[0].value, 3
        elif callee in JOBS_HELPERS:
            status, position = JOBS_HELPERS[callee], 2
        else:
            continue
        value = kw.get("code", node.args[position] if len(node.args) > position else None)
        shown = _literal(value)
        if shown:
            found[(status, shown)] = _literal(kw.get("type")) or "invalid_request_error"
    return found


def _calls(folder: str):
    for path in sorted((REPO / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                yield path, node


def _callee(node: ast.Call) -> str:
    func = node.func
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""


def _literal(value: ast.expr | None) -> str:
    """A string constant, or an f-string with its fields shown as <name>."""
    if isinstance(value, ast.Constant) and isinstance(value.value, str):
        return value.value
    if isinstance(value, ast.JoinedStr):
        return "".join(part.value if isinstance(part, ast.Constant) else f"<{ast.unparse(part.value)}>"
                       for part in value.values)
    return ""


def page() -> str:
    from pdserve.services.gateway.api_error import ERROR_TYPES
    from pdserve.services.gateway.apis.messages.format import ERROR_TYPES as MESSAGES_TYPES, STATUS

    gateway = raised("services/gateway")
    for status in (404, 405, 413, 500):  # the error middleware's own answers (errors.py `as_api_error`)
        gateway[status].add("errors.py")
    rows = [[code(status), code(ERROR_TYPES.get(status, "invalid_request_error")),
             ", ".join(code(m) for m in sorted(gateway[status]))] for status in sorted(gateway)]
    messages = [[code(status), code(STATUS.get(status, status)), code(kind)]
                for status, kind in sorted(MESSAGES_TYPES.items()) if status not in STATUS.values()]
    messages += [[code(frm), code(to), code(MESSAGES_TYPES[to])] for frm, to in STATUS.items()]
    jobs = [[code(status), code(kind), code(c)] for (status, c), kind in sorted(jobs_codes().items())]
    return "\n".join([
        "# Error codes", "",
        "Every error status the services answer with, read from their error types when this site is built.", "",
        "## OpenAI routes (the gateway)", "",
        "An error is `{\"object\": \"error\", \"message\", \"type\", \"param\", \"code\"}` with `code` the HTTP "
        "status, as SGLang answers; on `/v1/responses*` it comes in OpenAI's envelope, `{\"error\": {\"message\", "
        "\"type\", \"param\", \"code\"}}`. `param` names the request field at fault where there is one. A 429, and "
        "a 503 when no worker is ready or the gateway is draining, carry `Retry-After`. Anything unexpected is a "
        "500 whose body names no internals (the traceback goes to the gateway's log).", "",
        table(["status", "type", "raised in (services/gateway/)"], rows),
        "## Anthropic's Messages API", "",
        "`/v1/messages` answers in Anthropic's shape, `{\"type\": \"error\", \"error\": {\"type\", \"message\"}, "
        "\"request_id\"}`; the gateway's 503 (no worker, draining) is Anthropic's 529, which its clients retry.", "",
        table(["gateway status", "status sent", "type"], messages),
        "## Files and Batches (the jobs service)", "",
        "The jobs service answers in OpenAI's shape for Files and Batches, `{\"error\": {\"message\", \"type\", "
        "\"param\", \"code\"}}`, with these `code`s (a 507 also carries `x-should-retry: false`, so OpenAI's "
        "clients do not resend it; a 429 carries `Retry-After`):", "",
        table(["status", "type", "code"], jobs),
    ])
