"""Client-facing errors, in the OpenAI shape SGLang uses, mapped from exceptions in one place.

Handlers raise `ApiError` (or let pydantic's `ValidationError` escape); `error_middleware` turns every
exception into `{"object": "error", "message", "type", "param", "code"}` with its HTTP status (on /v1/responses
in OpenAI's envelope, `{"error": {"message", "type", "param", "code"}}`, as SGLang answers there). Anything
unexpected becomes a 500 whose body names no internals (the traceback goes to the log only).

`read_json` is the one door for JSON bodies: one over the app's `client_max_size` (--max-body-bytes) is a 413 as
soon as it passes the limit, a compressed one is read inflated (body_encoding.py), a large one is decoded off the event loop (`parse_body`), and JSON that Python accepts but nothing
downstream can use (lone UTF-16 surrogates such as "\\ud800", nesting deeper than the parser's stack) is a 400.
"""
from __future__ import annotations

import logging

from aiohttp import web
from pydantic import ValidationError

# ApiError and Busy are imported from here by the handlers.
from pdserve.services.gateway.api_error import ERROR_TYPES, ApiError, Busy  # noqa: F401
from pdserve.services.gateway.cpu_pool import CPU_POOL
from pdserve.services.gateway.json_codec import LARGE_BODY, Decoded, decode

log = logging.getLogger("pdserve.gateway")


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param)


def unsupported(param: str, what: str | None = None) -> ApiError:
    return ApiError(400, f"{what or param} is not supported yet (field {param!r}).", param)


def unavailable(message: str) -> ApiError:
    return ApiError(503, message)


def from_validation_error(exc: ValidationError, prefix: str = "") -> ApiError:
    """The first problem pydantic found, naming the field by its dotted path."""
    err = exc.errors(include_url=False)[0]
    loc = [str(p) for p in err.get("loc", ()) if not _is_union_tag(p)]
    param = ".".join([prefix, *loc] if prefix else loc) or None
    msg = err.get("msg", "invalid value")
    if err.get("type") == "missing":
        return bad_request(f"Field {param!r} is required.", param)
    if err.get("type") == "extra_forbidden":
        return bad_request(f"Unknown field {param!r}.", param)
    return bad_request(f"Invalid value for {param!r}: {msg}.", param)


def _is_union_tag(part) -> bool:
    # pydantic inserts the name of the union member it tried ("str", "list[int]", ...) into the location.
    return isinstance(part, str) and (part in ("str", "int", "float", "bool") or "[" in part
                                      or part.startswith("function-") or part[:1].isupper())


def too_large(limit: int) -> ApiError:
    return ApiError(413, f"The request body is larger than the limit of {limit / (1 << 20):g} MiB "
                         "(--max-body-bytes).")


_PARSED = "pdserve.parsed_body"
INFLATED = "pdserve.inflated_body"  # a compressed body, as body_encoding.inflate inflated it


async def body_bytes(request: web.Request) -> bytes:
    """The request's body as the client meant it: inflated when it came compressed."""
    if INFLATED in request:
        return request[INFLATED]
    return await request.read()  # raises HTTPRequestEntityTooLarge (413) once the body passes the limit


async def parse_body(request: web.Request) -> Decoded:
    """The body's JSON value (json_codec.decode), decoded once per request: middlewares and the handler share it.
    A body of LARGE_BODY bytes or more is decoded on the gateway's CPU pool: decoding megabytes of JSON (millions of
    numbers, a logit_bias over the whole vocabulary) takes the event loop, and every stream it serves, for up to a
    second otherwise."""
    if _PARSED not in request:
        raw = await body_bytes(request)
        pool = request.app.get(CPU_POOL)
        if len(raw) >= LARGE_BODY and pool is not None:
            request[_PARSED] = await pool.run(len(raw), decode, raw, True)
        else:
            request[_PARSED] = decode(raw)
    return request[_PARSED]


async def read_json(request: web.Request) -> dict:
    """The request body as a JSON object; 400 when it is not one, 413 when it is over the size limit."""
    body, problem, surrogate_at = await parse_body(request)
    if problem is not None:
        raise bad_request(problem)
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.")
    if surrogate_at is not None:
        raise bad_request(f"{surrogate_at!r} holds a lone UTF-16 surrogate (an unpaired \\uD800-\\uDFFF escape), "
                          "which is not text.", surrogate_at)
    return body


# Routes whose errors come in OpenAI's {"error": {...}} envelope, as SGLang sends them there.
NESTED_ERROR_PREFIX = "/v1/responses"


def answer(request: web.Request, error: ApiError) -> web.Response:
    """`error` in the shape the request's route answers errors in."""
    return error.response(nested=request.path.startswith(NESTED_ERROR_PREFIX))


@web.middleware
async def error_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except Exception as exc:  # noqa: BLE001 - each kind is mapped by `as_api_error`, the rest re-raised
        # Answered inside the block: `exc` is dropped with it. Kept in a local of this frame past it, the
        # exception's traceback (which holds this frame) would make a cycle that only the garbage collector
        # frees, and with it every frame's locals: a refused 31 MiB body stayed in the gateway's memory.
        return answer(request, as_api_error(request, exc))


def as_api_error(request: web.Request, exc: Exception) -> ApiError:
    """The client's answer for `exc`; re-raises what has none (a redirect, a client that went away)."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, ValidationError):
        return from_validation_error(exc)
    if isinstance(exc, web.HTTPException):
        if exc.status < 400:
            raise exc
        if exc.status == 404:
            return ApiError(404, f"Route {request.method} {request.path} not found.")
        if exc.status == 405:
            return ApiError(405, f"Method {request.method} is not allowed for {request.path}.")
        if exc.status == 413:
            return too_large(request.client_max_size)
        return ApiError(exc.status, exc.reason or "request failed")
    if isinstance(exc, RecursionError):
        # Only input nested deeper than Python's stack gets here (a JSON body parsed before read_json sees it,
        # as the model-kind check does): the client's doing, not the server's.
        return bad_request("The request body is nested too deeply.")
    if isinstance(exc, ConnectionError):
        raise exc  # the client went away: nobody to answer
    log.error("unexpected error in %s %s", request.method, request.path, exc_info=exc)
    return ApiError(500, "Internal server error.")
