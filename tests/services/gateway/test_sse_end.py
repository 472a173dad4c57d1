"""The end of a stream waits for the client to take what is left: a client that reads nothing more is cut off
after --stream-write-timeout there too (a unit test of SSE over stand-ins for aiohttp's response and socket)."""
from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from pdserve.services.gateway.apis.context import GATEWAY, SSE
from pdserve.services.gateway.apis.messages.routes import EventStream


class Transport:
    def __init__(self) -> None:
        self.aborted = False

    def abort(self) -> None:
        self.aborted = True


class StuckAtTheEnd:
    """A response whose writes go out, and whose end waits for a client that never reads."""

    prepared = True

    async def write(self, data: bytes) -> None:
        pass

    async def write_eof(self) -> None:
        await asyncio.Event().wait()


@pytest.mark.parametrize("stream", [SSE, EventStream])
async def test_a_client_that_stops_reading_before_the_end_is_cut_off(stream):
    transport = Transport()
    request = SimpleNamespace(app={GATEWAY: SimpleNamespace(limits=SimpleNamespace(stream_write_timeout_s=0.2))},
                              transport=transport)
    sse = stream(request)
    sse.response = StuckAtTheEnd()
    start = time.monotonic()
    with pytest.raises(ConnectionResetError):  # the handler ends as if the client had left: places freed
        await asyncio.wait_for(sse.done(), 5)
    assert transport.aborted and time.monotonic() - start < 2
