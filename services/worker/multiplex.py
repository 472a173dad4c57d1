"""GenerateMany's worker side: many Generate calls served over one stream, a step's outputs in one message.

Each gRPC message costs the worker's event loop a write and a wake-up from gRPC's completion thread, both under
the GIL that the engine thread needs for its steps. With one Generate stream per generation, 64 generations
cost 64 messages per engine step; over GenerateMany they cost one, since every generation's output of a step
reaches the loop in one callback (`OutputRelay`) and is posted before the stream writes again.

Each call runs the servicer's own Generate handler, so admission, errors and aborts are the same as over
Generate: `context.abort(code, details)` ends that call alone with that status. A cancel from the caller, or
the stream ending, cancels the call's handler, which aborts its request in the engine.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import AsyncIterator, Callable

import grpc

from pdserve.proto import worker_pb2 as pb
from pdserve.shared.logs import REQUEST_ID, SAFE_ID

log = logging.getLogger("pdserve.worker")


class CallAborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code, self.details = code, details


class CallContext:
    """What a Generate handler uses of its grpc.aio.ServicerContext, for one call on a GenerateMany stream."""

    def __init__(self, stream: grpc.aio.ServicerContext) -> None:
        self._stream = stream

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        raise CallAborted(code, details)

    def invocation_metadata(self):
        return self._stream.invocation_metadata()


Generate = Callable[[pb.GenerateRequest, object], AsyncIterator[pb.GenerateResponse]]


async def serve_many(generate: Generate, calls: AsyncIterator[pb.GenerateCall],
                     context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateEvents]:
    """GenerateMany over `generate` (a servicer's Generate): events of all calls, as many per message as are ready."""
    posted: list[pb.GenerateEvent] = []
    ready = asyncio.Event()
    running: dict[int, asyncio.Task] = {}

    def post(event: pb.GenerateEvent) -> None:
        posted.append(event)
        ready.set()

    async def run(call: int, request: pb.GenerateRequest, request_id: str) -> None:
        REQUEST_ID.set(request_id if SAFE_ID.fullmatch(request_id) else None)  # this task's context only
        try:
            async with contextlib.aclosing(generate(request, CallContext(context))) as messages:
                async for message in messages:
                    post(pb.GenerateEvent(call=call, response=message))
            post(pb.GenerateEvent(call=call, end=True))
        except CallAborted as exc:
            log.warning("Generate failed: %s: %s", exc.code.name, exc.details)
            post(pb.GenerateEvent(call=call, status=exc.code.value[0], details=exc.details))
        except asyncio.CancelledError:
            log.info("Generate cancelled by the caller")
            raise
        except Exception as exc:  # a bug in one call must not end the others
            log.exception("Generate failed")
            post(pb.GenerateEvent(call=call, status=grpc.StatusCode.INTERNAL.value[0],
                                  details=f"the worker failed on this request ({type(exc).__name__})"))
        finally:
            if running.get(call) is asyncio.current_task():
                del running[call]
            ready.set()  # the stream may be waiting for its last call to end

    async def read() -> None:
        async for message in calls:
            if message.cancel:
                task = running.pop(message.call, None)
                if task is not None:
                    task.cancel()
            elif message.HasField("start") and message.call not in running:
                running[message.call] = asyncio.create_task(run(message.call, message.start, message.request_id))
        ready.set()  # the caller closed its side: the stream ends once its calls have

    reader = asyncio.create_task(read())
    try:
        while True:
            await ready.wait()
            ready.clear()
            if posted:
                events = posted[:]
                posted.clear()
                yield pb.GenerateEvents(events=events)
            elif reader.done():
                reader.result()  # a broken request stream ends this one with its error
                if not running:
                    return
    finally:
        tasks = [reader, *running.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
