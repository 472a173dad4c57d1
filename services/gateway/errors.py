"""Client-facing errors, in the OpenAI shape SGLang uses, mapped from exceptions in one place.

Handlers raise `ApiError` (or let pydantic's `ValidationError` escape); `error_middleware` turns every
exception into `{"object": "error", "message", "type", "param", "code"}` with its HTTP status. Anything
unexpected becomes a 500 whose body names no internals (the traceback goes to the log only).
"""
from __future__ import annotations

import json
import logging

from aiohttp import web
from pydantic import ValidationError

log = logging.getLogger("pdserve.gateway")

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type or ERROR_TYPES.get(status, "invalid_request_error")

    def body(self) -> dict:
        return {"object": "error", "message": self.message, "type": self.type, "param": self.param,
                "code": self.status}

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status)


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


async def read_json(request: web.Request) -> dict:
    """The request body as a JSON object; 400 when it is not one."""
    try:
        raw = await request.read()
        body = json.loads(raw or b"null")
    except (ValueError, UnicodeDecodeError):
        raise bad_request("The request body is not valid JSON.") from None
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.")
    return body


@web.middleware
async def error_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except ApiError as exc:
        return exc.response()
    except ValidationError as exc:
        return from_validation_error(exc).response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        if exc.status == 404:
            return ApiError(404, f"Route {request.method} {request.path} not found.").response()
        if exc.status == 405:
            return ApiError(405, f"Method {request.method} is not allowed for {request.path}.").response()
        if exc.status == 413:
            return ApiError(413, "The request body is too large.").response()
        return ApiError(exc.status, exc.reason or "request failed").response()
    except (ConnectionResetError, ConnectionError):
        raise  # the client went away: nobody to answer
    except Exception:
        log.exception("unexpected error in %s %s", request.method, request.path)
        return ApiError(500, "Internal server error.").response()
