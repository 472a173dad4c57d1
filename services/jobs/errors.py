"""Client-facing errors of the jobs service, in the shape OpenAI returns for Files and Batches.

Handlers raise `ApiError`; `app.py` turns it into `{"error": {"message", "type", "param", "code"}}` with
its HTTP status, in one place. Anything else becomes a 500 (or a 503 when Redis is unreachable) without a
traceback in the body.
"""
from __future__ import annotations


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.headers = headers
        self.message = message
        self.param = param
        self.code = code
        self.type = type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def shown(value: object, limit: int = 100) -> str:
    """`repr(value)` cut to about `limit` characters, for quoting what a client sent in an error."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param, code)


def invalid_id(what: str, value: object, prefix: str, param: str) -> ApiError:
    return ApiError(400, f"Invalid {what} id {shown(value, 80)} in {param!r}: {what} ids look like '{prefix}...' "
                         "as this service issues them.", param, "invalid_id")


def not_found(what: str, id_: str, param: str | None = None) -> ApiError:
    return ApiError(404, f"No such {what}: {id_!r}", param, f"{what}_not_found")


def conflict(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(409, message, param, code)
