"""GenerateMany's worker side: many generations served over one stream, a step's outputs in one message.

Each gRPC message costs the worker's event loop a write and a wake-up from gRPC's completion thread, both under
the GIL that the engine thread needs for its steps. With one Generate stream per generation, 64 generations
cost 64 messages per engine step; over GenerateMany they cost one. The relay hands a step's outputs over in one
callback, and each generation's `StepSink` turns its share into a message there, so no coroutine per
generation wakes per step either: its handler only waits for the end.

Admission, errors and aborts are Generate's: `context.abort(code, details)` ends that call alone with that
status. A cancel from the caller, or the stream ending, cancels the call's handler, which aborts its request in
the engine.
"""
from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator, Awaitable, Callable

import grpc

from pdserve.proto import worker_pb2 as pb
from pdserve.shared.logs import REQUEST_ID, SAFE_ID
from pdserve.shared.outputs import ReqOutput, is_moved

log = logging.getLogger("pdserve.worker")


class CallAborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code, self.details = code, details


class CallContext:
    """What a Generate handler uses of its grpc.aio.ServicerContext, for one call on a GenerateMany stream."""

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        raise CallAborted(code, details)


# A generation's handler on a GenerateMany stream: (request, context, post) where `post(message)` sends the call's
# next GenerateResponse; it returns when the call has sent them all.
Handler = Callable[[pb.GenerateRequest, object, Callable[[pb.GenerateResponse], None]], Awaitable[None]]


class StepSink:
    """One generation's outputs, taken where the relay delivers them (`put_nowait` per output, then `flush`):
    what a delivery brought becomes one message, posted at once, unless it holds fewer than `interval` tokens
    (--stream-interval; 1 for the first message) and finishes nothing. `wait` returns when every choice has
    finished, or with the error an output reported."""

    def __init__(self, choices: int, interval: int, build: Callable[[list[ReqOutput], bool], tuple], post) -> None:
        self.finished: set[int] = set()
        self._choices, self._interval, self._build, self._post = choices, interval, build, post
        self._pending: list[ReqOutput] = []
        self._first = True
        self._closed = False
        self._loop = asyncio.get_running_loop()
        self._progress = self._loop.time()
        self._ended: asyncio.Future[str | None] = self._loop.create_future()

    def put_nowait(self, out: ReqOutput) -> None:
        self._pending.append(out)

    def flush(self) -> None:
        ready = self._pending
        if self._closed or not ready:
            return
        self._progress = self._loop.time()
        error = next((o.error for o in ready if o.error), None)
        if error:
            moved = [o for o in ready if o.token_ids] if is_moved(error) else []
            if moved:  # a live move: what it produced here reaches the caller before the stream ends
                self._post(self._build(moved, self._first)[0])
            self._end(error)
            return
        if all(o.finish_reason is None for o in ready) and \
                sum(len(o.token_ids) for o in ready) < (1 if self._first else self._interval):
            return  # more tokens first (--stream-interval)
        self._pending = []
        message, finished = self._build(ready, self._first)
        self._first = False
        self.finished |= finished
        self._post(message)
        if len(self.finished) >= self._choices:
            self._end(None)

    async def wait(self, limit: Callable[[bool], float]) -> str | None:
        """None once every choice finished, an output's error text, or TimeoutError after `limit(first)` seconds
        without output (counted from this call: the request was only just handed to the engine)."""
        self._progress = self._loop.time()
        while True:
            remaining = self._progress + limit(self._first) - self._loop.time()
            if remaining <= 0:
                raise asyncio.TimeoutError
            try:
                return await asyncio.wait_for(asyncio.shield(self._ended), remaining)
            except asyncio.TimeoutError:
                continue  # output may have come meanwhile: the deadline moves with it

    def close(self) -> None:
        self._closed = True
        self._pending = []

    def _end(self, error: str | None) -> None:
        self._closed = True
        if not self._ended.done():
            self._ended.set_result(error)


async def serve_many(generate: Handler, calls: AsyncIterator[pb.GenerateCall],
                     context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateEvents]:
    """GenerateMany over `generate`: events of all calls, as many per message as are ready."""
    posted: list[pb.GenerateEvent] = []
    ready = asyncio.Event()
    running: dict[int, asyncio.Task] = {}

    def post(event: pb.GenerateEvent) -> None:
        posted.append(event)
        ready.set()

    async def run(call: int, request: pb.GenerateRequest, request_id: str) -> None:
        REQUEST_ID.set(request_id if SAFE_ID.fullmatch(request_id) else None)  # this task's context only
        try:
            await generate(request, CallContext(),
                           lambda message: post(pb.GenerateEvent(call=call, response=message)))
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
