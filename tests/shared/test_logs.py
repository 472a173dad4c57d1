"""shared/logs.py: text and JSON lines on stderr, the request id on each, and its trip over gRPC."""
from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys

import grpc
import pytest

from pdserve.shared import logs

SCRIPT = """
import logging
from pdserve.shared import logs
logs.setup_logging("{level}", json_lines={json_lines})
log = logging.getLogger("pdserve.test")
log.info("plain line")
logs.REQUEST_ID.set("req-42")
log.warning("with an id", extra={{"status": 503, "path": "/v1/x"}})
log.debug("hidden unless debug")
try:
    1 / 0
except ZeroDivisionError:
    log.exception("it broke")
"""


def run(level: str, json_lines: bool) -> list[str]:
    result = subprocess.run([sys.executable, "-c", SCRIPT.format(level=level, json_lines=json_lines)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout == ""  # logs go to stderr
    return result.stderr.splitlines()


def test_json_lines_parse_and_carry_the_request_id_and_fields():
    lines = run("info", True)
    entries = [json.loads(line) for line in lines]  # one object per line, the traceback inside it
    assert [e["message"] for e in entries] == ["plain line", "with an id", "it broke"]
    plain, tagged, broke = entries
    assert plain["level"] == "INFO" and plain["logger"] == "pdserve.test" and "request_id" not in plain
    assert tagged["request_id"] == "req-42" and tagged["status"] == 503 and tagged["path"] == "/v1/x"
    assert "ZeroDivisionError" in broke["exception"] and broke["level"] == "ERROR"
    assert plain["time"].endswith("+00:00")


def test_text_lines_name_the_request_id_and_follow_the_level():
    lines = run("debug", False)
    assert " INFO pdserve.test: plain line" in lines[0] and "request_id" not in lines[0]
    assert lines[1].endswith("WARNING pdserve.test: with an id [request_id=req-42]")
    assert "hidden unless debug [request_id=req-42]" in lines[2]
    assert not any("hidden" in line for line in run("info", False))


@pytest.mark.parametrize("given, kept", [
    ("abc-123", True), ("0f8e2a6c-4e0b-4d2e-9c1a-7f1f0e8d9b2a", True), ("trace:span.1", True),
    ("", False), ("x" * 129, False), ("bad id", False), ("evil\nline", False), ("-leading", False), (None, False),
])
def test_a_clients_request_id_is_kept_only_when_it_is_a_safe_short_token(given, kept):
    rid = logs.request_id(given)
    assert (rid == given) is kept
    assert logs.SAFE_ID.fullmatch(rid)


# ---------------------------------------------------------------- gRPC


async def test_the_request_id_travels_in_grpc_metadata_and_tags_the_workers_failure_lines(caplog):
    seen: list[str | None] = []

    async def stream(request: bytes, context):
        seen.append(logs.REQUEST_ID.get())
        yield b"first"
        if request == b"fail":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "bad prompt")
        if request == b"hang":
            await asyncio.sleep(60)

    async def unary(request: bytes, context):
        seen.append(logs.REQUEST_ID.get())
        return b"pong"

    handlers = grpc.method_handlers_generic_handler("t.Svc", {
        "Stream": grpc.unary_stream_rpc_method_handler(stream),
        "Ping": grpc.unary_unary_rpc_method_handler(unary)})
    server = grpc.aio.server(interceptors=[logs.RequestIdServerInterceptor()])
    server.add_generic_rpc_handlers((handlers,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    caplog.set_level(logging.INFO, "pdserve.worker")
    caplog.handler.addFilter(logs.add_request_id)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}",
                                             interceptors=logs.client_interceptors()) as channel:
            call_stream = channel.unary_stream("/t.Svc/Stream")
            ping = channel.unary_unary("/t.Svc/Ping")

            async def tagged(rid: str | None, coro_fn):
                logs.REQUEST_ID.set(rid)
                return await coro_fn()

            assert await asyncio.create_task(tagged("req-a", lambda: ping(b"x"))) == b"pong"
            assert await asyncio.create_task(tagged(None, lambda: ping(b"x"))) == b"pong"
            assert await asyncio.create_task(tagged("not safe", lambda: ping(b"x"))) == b"pong"

            async def failing():
                return [m async for m in call_stream(b"fail")]

            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await asyncio.create_task(tagged("req-b", failing))
            assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT

            async def cancelled():
                call = call_stream(b"hang")
                assert await call.read() == b"first"
                call.cancel()

            await asyncio.create_task(tagged("req-c", cancelled))
            for _ in range(100):  # the server learns of the cancellation a moment later
                if any("cancelled" in r.getMessage() for r in caplog.records):
                    break
                await asyncio.sleep(0.02)
    finally:
        await server.stop(0)
    # The server set each call's id, and only for calls that carried a safe one.
    assert seen == ["req-a", None, None, "req-b", "req-c"]
    lines = {(r.request_id, r.levelname, r.getMessage()) for r in caplog.records}
    assert ("req-b", "WARNING", "Stream failed: INVALID_ARGUMENT: bad prompt") in lines
    assert ("req-c", "INFO", "Stream cancelled by the caller") in lines
    assert not any(r.request_id == "req-a" for r in caplog.records)  # a call that succeeds logs nothing


async def test_a_stream_closed_between_two_messages_logs_its_cancel_with_the_request_id(caplog):
    # gRPC cancels a call whose client went away; when that lands while a message is being sent, the handler is
    # not awaiting anything: its generator is closed later, and the cancel must still be logged under the id.
    async def stream(request, context):
        for i in range(10):
            yield i

    handler = grpc.unary_stream_rpc_method_handler(stream)
    traced = logs._traced_stream(handler.unary_stream, "req-closed", "Generate")
    messages = traced(None, None)
    assert await messages.__anext__() == 0
    caplog.set_level(logging.INFO)
    logs.REQUEST_ID.set(None)
    await messages.aclose()
    assert [(r.request_id, r.getMessage()) for r in caplog.records if "cancelled" in r.getMessage()] == [
        ("req-closed", "Generate cancelled by the caller")]
