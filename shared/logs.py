"""Logging for every service, and the request id that ties one request's log lines together.

One handler on stderr writes text lines (the default) or one JSON object per line (`--log-format json`).
The request id lives in a context variable: the gateway's access middleware sets it for the task serving a
request, and every record logged in that task carries it (`request_id`). It travels to the workers as gRPC
metadata (`x-request-id`): the client interceptor adds it to a call, the server interceptor sets it for the
task serving the call and logs that call's failures and cancellations with it.
"""
from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import logging
import re
import sys
import uuid
from contextlib import aclosing
from contextvars import ContextVar
from datetime import datetime, timezone

import grpc

LEVELS = ("critical", "error", "warning", "info", "debug")
FORMATS = ("text", "json")
HEADER = "X-Request-Id"
METADATA_KEY = "x-request-id"  # gRPC metadata keys are lower case
# A client's own id is kept when it is a short plain token: it is written into logs and gRPC metadata as is.
SAFE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")

REQUEST_ID: ContextVar[str | None] = ContextVar("request_id", default=None)
# Attributes every LogRecord has; the others came through `extra=` and are written as JSON fields.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "request_id"}
log = logging.getLogger("pdserve.worker")  # the server interceptor's lines are the worker's


def add_log_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log-level", default="info", type=str.lower, choices=LEVELS)
    parser.add_argument("--log-format", default="text", choices=FORMATS,
                        help="text lines, or one JSON object per line (time, level, logger, message, request_id "
                             "and the line's own fields)")


def setup_logging(level: str = "info", json_lines: bool = False, with_pid: bool = False) -> None:
    """Route every logger to stderr, in text or JSON, with the request id of the task that logs. `with_pid`:
    several processes of one service write to the same stderr, and each line says which (`name[pid]`, or the
    JSON field `pid`)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(add_request_id)
    handler.setFormatter(JsonFormatter(with_pid) if json_lines else TextFormatter(with_pid))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    # grpc's asyncio layer logs a line per call at debug level: noise, not what --log-level debug is for.
    logging.getLogger("grpc").setLevel(max(logging.INFO, logging.getLogger().level))


def add_request_id(record: logging.LogRecord) -> bool:
    record.request_id = REQUEST_ID.get()
    return True


class TextFormatter(logging.Formatter):
    def __init__(self, with_pid: bool = False) -> None:
        super().__init__(f"%(asctime)s %(levelname)s %(name)s{'[%(process)d]' if with_pid else ''}: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        rid = getattr(record, "request_id", None)
        return f"{line} [request_id={rid}]" if rid else line


class JsonFormatter(logging.Formatter):
    def __init__(self, with_pid: bool = False) -> None:
        super().__init__()
        self.with_pid = with_pid

    def format(self, record: logging.LogRecord) -> str:
        entry = {"time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
                 "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        if self.with_pid:
            entry["pid"] = record.process
        rid = getattr(record, "request_id", None)
        if rid:
            entry["request_id"] = rid
        entry.update((k, v) for k, v in vars(record).items() if k not in _STANDARD)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def request_id(given: str | None) -> str:
    """The client's id when it is a safe short token, else a new one."""
    return given if given and SAFE_ID.fullmatch(given) else uuid.uuid4().hex


# ---------------------------------------------------------------- gRPC: the id travels as metadata


def client_interceptors() -> list[grpc.aio.ClientInterceptor]:
    """For a channel (`interceptors=`): every unary call carries the current request id, if any."""
    return [_UnaryRequestId(), _StreamRequestId()]  # a channel files each interceptor under one kind only


class _UnaryRequestId(grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(_with_request_id(details), request)


class _StreamRequestId(grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(_with_request_id(details), request)


def _with_request_id(details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
    rid = REQUEST_ID.get()
    if rid is None:
        return details
    return details._replace(metadata=grpc.aio.Metadata(*(details.metadata or ()), (METADATA_KEY, rid)))


class RequestIdServerInterceptor(grpc.aio.ServerInterceptor):
    """Serves a call that carries a request id with that id set, and logs the call's failure or cancellation."""

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        rid = next((v for k, v in details.invocation_metadata or () if k == METADATA_KEY), None)
        if handler is None or rid is None or not SAFE_ID.fullmatch(rid) or handler.request_streaming:
            return handler
        method = details.method.rsplit("/", 1)[-1]
        if handler.response_streaming:
            return handler._replace(unary_stream=_traced_stream(handler.unary_stream, rid, method))
        return handler._replace(unary_unary=_traced_unary(handler.unary_unary, rid, method))


def _traced_unary(behaviour, rid: str, method: str):
    async def call(request, context):
        REQUEST_ID.set(rid)  # each call is served in a task of its own: the id ends with it
        try:
            return await behaviour(request, context)
        except (Exception, asyncio.CancelledError) as exc:
            _log_end(exc, context, method)
            raise

    return call


def _traced_stream(behaviour, rid: str, method: str):
    if not inspect.isasyncgenfunction(behaviour):  # a handler that writes with context.write()
        return _traced_unary(behaviour, rid, method)

    async def call(request, context):
        REQUEST_ID.set(rid)
        try:
            async with aclosing(behaviour(request, context)) as messages:
                async for message in messages:
                    yield message
        except (Exception, asyncio.CancelledError) as exc:
            _log_end(exc, context, method)
            raise
        except GeneratorExit:  # the caller went away while its last message was being sent: closed, not cancelled
            REQUEST_ID.set(rid)  # the close may run in another task's context
            log.info("%s cancelled by the caller", method)
            raise

    return call


def _log_end(exc: BaseException, context, method: str) -> None:
    if isinstance(exc, asyncio.CancelledError):
        log.info("%s cancelled by the caller", method)
    elif isinstance(exc, grpc.aio.AbortError):  # the handler's context.abort(code, details)
        code = context.code()
        log.warning("%s failed: %s: %s", method, getattr(code, "name", code), context.details())
    else:
        log.warning("%s failed: %r", method, exc)
