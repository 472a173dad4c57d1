"""GenerateMany's gateway side: this process's generations on one worker share one stream.

`GenerateStream` (one per worker) opens the stream at the first generation sent to the worker, and again after it
broke. `start` gives a `Call` that reads, cancels and ends as a Generate call does, so `Generation` treats both
alike: `read()` returns the next GenerateResponse, grpc.aio.EOF after the last, or raises the call's
grpc.aio.AioRpcError; `cancel()` aborts the request on the worker, and a read waiting then raises
asyncio.CancelledError. When the stream breaks (the worker died or restarted), every call on it fails with its
error at once, as their own streams would have.
"""
from __future__ import annotations

import asyncio
import itertools

import grpc

from pdserve.proto import worker_pb2 as pb
from pdserve.shared.logs import REQUEST_ID

STATUS = {code.value[0]: code for code in grpc.StatusCode}
_CANCELLED = object()


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class Call:
    """One generation on a GenerateMany stream."""

    def __init__(self, number: int, stream: _OpenStream) -> None:
        self.number = number
        self._stream = stream
        self._events: asyncio.Queue = asyncio.Queue()
        self._done = False

    async def read(self):
        item = await self._events.get()
        if item is _CANCELLED:
            raise asyncio.CancelledError()
        if isinstance(item, grpc.aio.AioRpcError):
            self._events.put_nowait(item)  # a call that failed keeps failing
            raise item
        return item

    def cancel(self) -> bool:
        if self._done:
            return False
        self._end(_CANCELLED)
        self._stream.cancel(self.number)
        return True

    def done(self) -> bool:
        return self._done

    def deliver(self, event: pb.GenerateEvent) -> None:
        if event.HasField("response"):
            self._events.put_nowait(event.response)
        elif event.end:
            self._end(grpc.aio.EOF)
        else:
            self._end(rpc_error(STATUS.get(event.status, grpc.StatusCode.UNKNOWN), event.details))

    def _end(self, last) -> None:
        self._done = True
        self._stream.calls.pop(self.number, None)
        self._events.put_nowait(last)


class _OpenStream:
    def __init__(self, stub) -> None:
        self.calls: dict[int, Call] = {}
        self.closed = False
        self._sends: asyncio.Queue[pb.GenerateCall | None] = asyncio.Queue()
        self._stream = stub.GenerateMany(self._outgoing())
        self._reader = asyncio.create_task(self._read(), name="generate-stream")

    async def _outgoing(self):
        while (message := await self._sends.get()) is not None:
            yield message

    def start(self, number: int, request: pb.GenerateRequest) -> Call:
        call = self.calls[number] = Call(number, self)
        self._sends.put_nowait(pb.GenerateCall(call=number, start=request, request_id=REQUEST_ID.get() or ""))
        return call

    def cancel(self, number: int) -> None:
        if not self.closed:
            self._sends.put_nowait(pb.GenerateCall(call=number, cancel=True))

    async def _read(self) -> None:
        error = rpc_error(grpc.StatusCode.UNAVAILABLE, "the worker ended the generate stream")
        try:
            async for events in self._stream:
                for event in events.events:
                    call = self.calls.get(event.call)
                    if call is not None:  # else a call cancelled here whose last events were on their way
                        call.deliver(event)
        except grpc.aio.AioRpcError as exc:
            error = exc
        except asyncio.CancelledError:
            error = rpc_error(grpc.StatusCode.CANCELLED, "the gateway closed the generate stream")
            raise
        finally:
            self.closed = True
            self._sends.put_nowait(None)  # ends the request side too, which gRPC leaves waiting on a broken stream
            for call in list(self.calls.values()):
                call._end(error)

    async def close(self) -> None:
        self._sends.put_nowait(None)
        self._stream.cancel()
        self._reader.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)


class GenerateStream:
    """This process's GenerateMany stream to one worker (see the module's text)."""

    def __init__(self, stub) -> None:
        self._stub = stub
        self._numbers = itertools.count(1)
        self._open: _OpenStream | None = None

    def start(self, request: pb.GenerateRequest) -> Call:
        if self._open is None or self._open.closed:
            self._open = _OpenStream(self._stub)
        return self._open.start(next(self._numbers), request)

    async def close(self) -> None:
        if self._open is not None:
            await self._open.close()
