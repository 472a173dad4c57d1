"""The gateway's refusal, as an exception: `ApiError` carries the HTTP status and the message a client reads;
`Busy` adds when to come back (Retry-After). Below everything else at the gateway's top (errors.py maps them to
responses, re-exporting both), so that the modules errors.py itself uses, the CPU pool among them, can refuse too.
"""
from __future__ import annotations

from aiohttp import web

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
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

    def response(self, nested: bool = False) -> web.Response:
        """The error as JSON; `nested`: OpenAI's {"error": {...}} envelope, which SGLang's /v1/responses uses."""
        if nested:
            inner = {k: v for k, v in self.body().items() if k != "object"}
            return web.json_response({"error": inner}, status=self.status)
        return web.json_response(self.body(), status=self.status)


class Busy(ApiError):
    """A refusal that tells the client when to come back: 429 (over the limits) or 503 (no worker, stopping)."""

    def __init__(self, status: int, message: str, retry_after_s: int) -> None:
        super().__init__(status, message)
        self.retry_after_s = retry_after_s

    def response(self, nested: bool = False):
        response = super().response(nested)
        response.headers["Retry-After"] = str(self.retry_after_s)
        return response
